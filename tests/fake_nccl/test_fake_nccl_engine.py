"""The engine's collectives on fake NCCL: every tensor they touch is on the GPU, results come back once.

Each test makes this process one rank of a fake NCCL world (``tests/_fake_nccl.py``), gives it
fake CUDA parameters, gradients and losses (autograd cannot run on them: the gradients are set,
not computed) and runs one piece of the step: ``sync_step`` with and without parameters (the
FSDP2 case: every gradient reduced by FSDP, only the step's scalars left), with ZeRO-2 owners
and with the bucketed sync; ZeRO-2's reduce to owners and its clipping; the broadcast of rank
0's parameters and buffers at set-up; the plan-digest check and its data-divergence message;
a ring transfer; a Ulysses exchange both ways.  A host tensor in any of their collectives fails
here as on NCCL.  The values are checked where the tier gives them (a reduction leaves this
rank's values, a gather repeats them), and so is the number of device-to-host copies where a
result comes back to the host.
"""

from __future__ import annotations

import pytest
import torch
from _fake_nccl import CUDA, RECORDED, fake_nccl
from torch import nn

from lightning_bytescale.engine.batch import StepBatch
from lightning_bytescale.engine.executor import LocalResult, MicroBatchResult, check_step, sync_step
from lightning_bytescale.errors import PlanDivergenceError

D2H = "a device-to-host copy"


def _step(tokens: int, world: int, step: int = 3) -> StepBatch:
    return StepBatch(
        [], num_global_tokens=tokens, num_tokens=tokens, digest="plan", step=step, stats={"world_size": world}
    )


def _local(mode, loss: float, tokens: int) -> LocalResult:
    """A rank's loop result as a GPU loop leaves it: the loss on the device."""
    results = [MicroBatchResult(0, loss, tokens, 0.5, 1, (0,), True)]
    return LocalResult(
        loss=mode.cuda(torch.tensor(loss, dtype=torch.float64)), loss_tokens=tokens, micro_batches=results
    )


def _params(mode, *shapes, grads=True) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(mode.cuda(torch.randn(s, generator=g))) for s in shapes]
    if grads:
        for p in params[:-1]:  # the last one gets no gradient on this rank
            p.grad = mode.cuda(torch.randn(p.shape, generator=g))
    return params


@pytest.mark.covers("engine/executor.py:allreduce_gradients:all_reduce")
def test_sync_step_without_parameters_sends_the_scalars_on_the_gpu():
    """FSDP2 reduces every gradient itself: sync_step gets no parameter, only the step's scalars."""
    with fake_nccl(world_size=2, rank=1) as mode:
        result = sync_step([], _step(7, 2), _local(mode, 0.75, 7))
        d2h = [s for s in mode.syncs if s.kind == D2H]
    assert result.loss == 0.75 and result.loss_tensor.device.type == "cpu"
    assert result.reports[1].num_micro_batches == 1 and result.reports[0].num_micro_batches == 0
    assert len(d2h) == 1, d2h  # the reduced scalars come back to the host once


@pytest.mark.covers("engine/executor.py:allreduce_gradients:all_reduce")
def test_sync_step_with_parameters_sums_them_in_one_gpu_buffer():
    with fake_nccl(world_size=2, rank=0) as mode:
        params = _params(mode, (3, 4), (5,), (2,))
        before = [mode.value(p.grad).clone() for p in params[:2]]
        extra = torch.tensor([2.0, 3.0], dtype=torch.float64)  # the caller's values, on the host
        result = sync_step(list(params), _step(4, 2), _local(mode, 0.5, 4), extra=extra)
        grads = [p.grad for p in params]
        after = [mode.value(g) for g in grads[:2]]
        d2h = [s for s in mode.syncs if s.kind == D2H]
    assert (
        all(g.device == CUDA for g in grads[:2]) and grads[2] is None
    )  # no rank made it: None, as one process
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert result.extra.tolist() == [2.0, 3.0] and result.loss == 0.5
    assert len(d2h) == 1, d2h


@pytest.mark.covers(
    "engine/executor.py:_start_scalars:all_reduce",
    "engine/zero.py:reduce_gradients_to_owners:reduce",
    "engine/zero.py:reduce_gradients_to_owners:all_reduce",
)
def test_sync_step_with_zero2_owners_reduces_on_the_gpu():
    with fake_nccl(world_size=2, rank=1) as mode:
        params = _params(mode, (4,), (6,), (2,))
        owners = {id(params[0]): 0, id(params[1]): 1}  # params[2] has no owner: all-reduced
        result = sync_step(list(params), _step(3, 2), _local(mode, 0.25, 3), owners=owners)
        kept = [p.grad is not None for p in params]
        devices = {p.grad.device for p in params if p.grad is not None}
    assert kept == [False, True, False]  # rank 1 keeps what it owns; no rank made params[2]'s gradient
    assert devices == {CUDA} and result.loss == 0.25


@pytest.mark.covers("engine/executor.py:_start_scalars:all_reduce")
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # the sync compares buffers
@pytest.mark.parametrize(
    "owned",
    [
        pytest.param(
            False,
            id="all-reduce",
            marks=pytest.mark.covers("engine/grad_sync.py:BucketedGradSync._launch:all_reduce"),
        ),
        pytest.param(
            True, id="zero2", marks=pytest.mark.covers("engine/grad_sync.py:BucketedGradSync._launch:reduce")
        ),
    ],
)
def test_sync_step_with_the_bucketed_sync_on_the_gpu(owned):
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    with fake_nccl(world_size=2, rank=0) as mode:
        params = _params(mode, (8,), (8,), (4,), grads=False)
        owners = {id(p): i % 2 for i, p in enumerate(params)} if owned else None
        sync = BucketedGradSync(params, bucket_bytes=40, first_bucket_bytes=40, owners=owners)
        sync.prepare()
        for p in params:  # what backward would have accumulated
            p.grad.copy_(mode.cuda(torch.ones(p.shape)))
            sync._produced.add(id(p))
        result = sync_step(list(params), _step(2, 2), _local(mode, 1.0, 2), grad_sync=sync)
        sync.close()
        held = [p.grad is not None for p in params]
    assert len(sync.buckets) >= 2 and result.loss == 1.0
    assert held == ([True, False, True] if owned else [True, True, True])


@pytest.mark.covers("engine/zero.py:clip_grad_norm_:all_reduce")
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_zero2_clipping_combines_the_norms_on_the_gpu(norm_type):
    """A rank that owns no gradient (or no parameter) still sends its zero norm, on the GPU."""
    from lightning_bytescale.engine.zero import clip_grad_norm_

    with fake_nccl(world_size=2, rank=1) as mode:
        params = [nn.Parameter(mode.cuda(torch.ones(4)))]
        params[0].grad = mode.cuda(torch.full((4,), 3.0))
        total = clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
        clipped = mode.value(params[0].grad).clone()
        empty = clip_grad_norm_([], max_norm=1.0, norm_type=norm_type)  # nothing owned here
        empty_value = mode.value(empty)
    expected = 6.0 if norm_type == 2.0 else 3.0
    assert total.device == CUDA and torch.allclose(clipped, torch.full((4,), 3.0 / (expected + 1e-6)))
    assert empty.device == CUDA and float(empty_value) == 0.0


@pytest.mark.covers("engine/state_sync.py:broadcast_tensors:broadcast")
def test_the_setup_broadcast_sends_host_buffers_through_the_gpu():
    """A model with a buffer kept on the host (rank 0's copy must still reach every rank)."""
    from lightning_bytescale.engine.state_sync import broadcast_module_state

    with fake_nccl(world_size=2, rank=1) as mode:
        model = mode.module_to_cuda(nn.Linear(3, 2))
        model.register_buffer("table", torch.arange(4.0))  # a host buffer, as some models keep
        weight = mode.value(model.weight).clone()
        calls = broadcast_module_state(model)
        table, weight_after = model.table, mode.value(model.weight)
    assert calls == 2  # the CUDA bucket and the host one
    assert table.device.type == "cpu" and table.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.equal(weight_after, weight)


@pytest.mark.covers("engine/step_checks.py:start_plan_agreement:all_gather")
@pytest.mark.parametrize("wait", [True, False], ids=["now", "overlapped"])
def test_the_plan_digest_check_gathers_on_the_gpu(wait):
    with fake_nccl(world_size=4, rank=2) as mode:
        check = check_step(_step(5, 4), wait=wait)
        check.wait()
        gathered = check.agreement.gathered
        d2h = [s for s in mode.syncs if s.kind == D2H]
    assert check.done and {t.device for t in gathered} == {CUDA} and len(gathered) == 4
    assert len(d2h) == 1, d2h  # the gathered keys come back once, not per rank or element


@pytest.mark.covers("engine/step_checks.py:_judge:all_gather_object")
def test_ranks_reading_different_data_are_named_through_an_object_gather_on_the_gpu():
    from lightning_bytescale.engine.step_checks import _judge

    rows = [[1, 3, 4, 11], [1, 3, 4, 11], [1, 3, 4, 22], [1, 3, 4, 11]]  # rank 2 reads another store
    with fake_nccl(world_size=4, rank=2), pytest.raises(PlanDivergenceError) as err:
        _judge(rows, 3, 4, None, "store-b")
    assert "ranks [2] differ from ranks [0, 1, 3]" in str(err.value)
    assert "read 'store-b'" in str(err.value)


@pytest.mark.covers(
    "packed_attention/comm.py:Transfer._start:P2POp",
    "packed_attention/comm.py:Transfer._start:isend",
    "packed_attention/comm.py:Transfer._start:irecv",
    "packed_attention/comm.py:Transfer._start:batch_isend_irecv",
)
def test_a_ring_transfer_is_a_gpu_exchange():
    from lightning_bytescale.packed_attention.comm import Transfer

    with fake_nccl(world_size=4, rank=1) as mode:
        kv = mode.cuda(torch.randn(2, 6, 2, 4).to(torch.bfloat16))
        transfer = Transfer(kv, dst=2, src=0, tag=7)
        recv = transfer.wait()
    assert transfer.done and recv.device == CUDA and recv.dtype == torch.bfloat16 and recv.shape == kv.shape


@pytest.mark.covers(
    "packed_attention/ulysses.py:p2p_exchange:P2POp",
    "packed_attention/ulysses.py:p2p_exchange:isend",
    "packed_attention/ulysses.py:p2p_exchange:irecv",
    "packed_attention/ulysses.py:p2p_exchange:batch_isend_irecv",
)
def test_a_ulysses_exchange_is_a_gpu_exchange_both_ways():
    """Tokens to heads and back between two members (global ranks 1 and 2 of 4), q's heads split, k's replicated.

    Every send and receive buffer is on the GPU (the receive buffers are made on the inputs'
    device, not the host): one ``batch_isend_irecv`` per exchange, one send to and one receive
    from the other member per tensor.  The values are the gloo suite's
    (``tests/packed_attention/test_attention_ulysses.py``): a receive buffer here keeps no value.
    """
    from lightning_bytescale.packed_attention.ulysses import to_heads, to_tokens
    from lightning_bytescale.packed_attention.ulysses_plan import Exchange, sequence_rows

    g = torch.Generator().manual_seed(0)
    slots, seq_lens = 6, [5, 7]
    q = torch.randn(slots, 4, 8, generator=g).to(torch.bfloat16)
    k = torch.randn(slots, 1, 8, generator=g).to(torch.bfloat16)
    ranges = [((0, 2), (2, 4)), ((0, 1), (0, 1))]  # q: 2 heads per member; k: its one head on both
    rows = torch.from_numpy(sequence_rows(seq_lens, [0, 3], slots, 2))
    with fake_nccl(world_size=4, rank=2) as mode:
        ex = Exchange((1, 2), 1, slots, mode.cuda(rows))
        RECORDED.clear()
        heads = to_heads(ex, [mode.cuda(q), mode.cuda(k)], ranges, tag=7311)
        forward = [(c.function, c.op) for c in RECORDED]
        RECORDED.clear()
        tokens = to_tokens(ex, heads, ranges, [q.shape, k.shape], tag=7312)
        backward = [(c.function, c.op) for c in RECORDED]
    exchange = [("p2p_exchange", "c10d.send.default")] * 2 + [("p2p_exchange", "c10d.recv_.default")] * 2
    assert forward == exchange and backward == exchange
    assert [h.shape for h in heads] == [(12, 2, 8), (12, 1, 8)] and [t.shape for t in tokens] == [
        q.shape,
        k.shape,
    ]
    assert {t.device for t in (*heads, *tokens)} == {CUDA} and {t.dtype for t in (*heads, *tokens)} == {
        torch.bfloat16
    }
