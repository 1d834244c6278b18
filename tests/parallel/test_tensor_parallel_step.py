"""HDP x tensor parallelism on gloo, float64, against one process: (data_parallel=2, tensor_parallel=2) and (1, 2).

One start of 4 ranks (the ``(2, 2)`` mesh) and one of 2 (``(1, 2)``).  The reference model is an
independent single process: the same initial weights on each whole sequence alone, plain causal
attention, ``torch.nn.utils.clip_grad_norm_`` and AdamW.

On ``(2, 2)``, with the reference Llama sharded by ``parallelize_llama`` (untied embeddings, so the
vocabulary is sharded too):

* one step's micro-batches (local and ring): every slot's logits and the gradient of the loss with
  respect to the embedding output (the decoder's input gradient) equal the reference's at the same
  (sequence, position); attention received this lane's heads only; before the data-parallel sum the
  replicated parameters' gradients are equal on both lanes; after ``run_parallel_step`` every
  gradient equals the reference's;
* ten AdamW steps with clipping (the balance planner with rings, in odd steps run as Ulysses
  items: the lane's 2 query heads and 1 key/value head split over the 2 HDP ranks, and one hand
  plan in which HDP rank 1 runs no micro-batch): parameters, losses and gradient norms track the
  reference; every ring and Ulysses P2P of a rank goes to the same lane of the other HDP rank, on
  the global group; no process group is created after set-up;
* the same with FSDP2 on ``"data_parallel"`` and TP inside.

On ``(1, 2)`` (one HDP rank, tied embeddings: replicated on both lanes) the same training check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _parallel import (
    CallLog,
    global_batch,
    grad_diff,
    process_groups,
    reference_and_model,
    shard_with_fsdp,
    train_against_reference,
)
from _ranks import gather_reports, init_gloo, save_report
from torch.distributed.tensor import DTensor

from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(280)]

CAPACITY = 24
MAX_NORM = 0.05  # below the gradient norms here: clipping acts in every step
LR = 1e-2
TOLERANCE = 1e-10
STEPS = 10
FSDP_STEPS = 3


def _models(tied: bool):
    from lightning_bytescale.models import LlamaConfig

    return reference_and_model(LlamaConfig.preset("tiny", tie_embeddings=tied))


def _batch(step: int, hdp: int) -> list[torch.Tensor]:
    if hdp == 1:  # one HDP rank: no ring, every sequence fits C
        return global_batch(step, (2, CAPACITY), 8)
    return global_batch(step, (2, 20), 6, long=(31 + step % 3, 45))  # two sequences longer than C


def _idle_plan(seqs: list[torch.Tensor]) -> Plan:
    """HDP rank 0 runs everything (two micro-batches), HDP rank 1 nothing."""
    lengths = [len(s) for s in seqs]
    half = len(seqs) // 2
    mbs = [
        MicroBatch([Piece(j, ((0, lengths[j]),)) for j in part])
        for part in (range(half), range(half, len(seqs)))
    ]
    plan = Plan(2, sum(lengths), "hand", lengths, [mbs, []])
    plan.validate()
    return plan


def _plan(step: int, seqs: list[torch.Tensor], hdp: int) -> Plan:
    from lightning_bytescale.planner import make_plan

    if hdp == 2 and step == 3:
        return _idle_plan(seqs)
    plan = make_plan([len(s) for s in seqs], world_size=hdp, capacity=CAPACITY, planner="balance", seed=step)
    if step % 2:  # odd steps: the ring items as Ulysses items (the lane's heads split over the HDP ranks)
        for mbs in plan.ranks:
            for mb in mbs:
                if mb.ring is not None:
                    mb.mode = "ulysses"
    return plan


def _lane_step(plan: Plan, pmesh, seqs, step: int):
    from lightning_bytescale.engine import build_step

    return build_step(plan, pmesh.hdp_rank, lambda j: seqs[j], step=step, ring_ranks=pmesh.ring_ranks)


def _gradient_case(pmesh) -> dict:
    """One step of micro-batches: logits and input gradients per slot, replicated gradients per lane."""
    from lightning_bytescale.engine import run_micro_batches, token_loss
    from lightning_bytescale.engine.reference import reference_loss
    from lightning_bytescale.packed_attention import attention
    from lightning_bytescale.parallel import parallelize_llama, run_parallel_step

    ref, model = _models(tied=False)
    parallelize_llama(model, pmesh.tp_mesh)
    heads_seen: set[tuple[int, int]] = set()

    def recording_attention(q, k, v):
        heads_seen.add((q.shape[1], k.shape[1]))
        return attention(q, k, v)

    model.attention_fn = recording_attention
    seqs = _batch(0, pmesh.dims.data_parallel)
    # reference: logits and embedding-output gradients per sequence, one backward of the global loss
    embed_out: list[torch.Tensor] = []
    hook = ref.embed.register_forward_hook(lambda m, i, out: embed_out.append(out) or out.retain_grad())
    ref_logits = [ref(s, torch.arange(len(s))).detach() for s in seqs]
    embed_out.clear()
    reference_loss(ref, seqs).backward()
    hook.remove()
    ref_input_grads = [e.grad for e in embed_out]

    records = []

    def forward(m, mb):
        captured: dict = {}

        def keep(mod, inputs, out):
            out.register_hook(lambda g: captured.setdefault("grad", g.detach().clone()))

        handle = m.embed.register_forward_hook(keep)
        logits = m(mb.input_ids, mb.position_ids)
        handle.remove()
        records.append((mb, logits.detach().clone(), captured))
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    plan = _plan(0, seqs, pmesh.dims.data_parallel)
    step = _lane_step(plan, pmesh, seqs, 0)
    # before any data-parallel sum: replicated (plain) parameters' gradients, lane against lane
    run_micro_batches(model, step.micro_batches, forward=forward)
    replicated_gap = 0.0
    for _, p in model.named_parameters():
        if isinstance(p, DTensor):
            continue
        lanes = [torch.empty_like(p.grad) for _ in range(pmesh.dims.tensor_parallel)]
        dist.all_gather(lanes, p.grad, group=pmesh.tp_group)
        replicated_gap = max(replicated_gap, max((x - lanes[0]).abs().max().item() for x in lanes))
    logit_err = grad_err = 0.0
    slots = 0
    for mb, logits, captured in records:
        pos = mb.layout.positions()
        for j, seq in enumerate(mb.seq_ids):
            a, b = mb.layout.cu_seqlens[j], mb.layout.cu_seqlens[j + 1]
            p = pos[a:b]
            real = p < len(seqs[seq])
            rows = torch.arange(a, b)[real]
            logit_err = max(logit_err, (logits[rows] - ref_logits[seq][p[real]]).abs().max().item())
            grad_err = max(
                grad_err, (captured["grad"][rows] - ref_input_grads[seq][p[real]]).abs().max().item()
            )
            slots += int(real.sum())
    model.zero_grad(set_to_none=True)
    records.clear()
    result = run_parallel_step(model, step, pmesh, forward=forward)
    loss_ref = float(reference_loss(ref, seqs))
    return {
        "heads_seen": sorted(heads_seen),
        "replicated_gap": replicated_gap,
        "logit_err": logit_err,
        "input_grad_err": grad_err,
        "slots": slots,
        "rings": sum(mb.layout.ring is not None for mb in step.micro_batches),
        "param_grad_err": grad_diff(model, ref),
        "loss_err": abs(result.loss - loss_ref),
    }


def _train(pmesh, log: CallLog, *, steps: int, tied: bool, fsdp: bool) -> dict:
    from lightning_bytescale.parallel import parallelize_llama

    ref, model = _models(tied)
    parallelize_llama(model, pmesh.tp_mesh)
    hdp = pmesh.dims.data_parallel
    return train_against_reference(
        model, ref, pmesh, steps=steps, batch=lambda s: _batch(s, hdp), plan=lambda s, seqs: _plan(s, seqs, hdp),
        max_norm=MAX_NORM, lr=LR, driver=shard_with_fsdp(model, pmesh) if fsdp else None, log=log,
    )  # fmt: skip


def _worker(rank: int, port: int, outdir: str, world: int, tp: int) -> None:
    from lightning_bytescale.parallel import ParallelDims

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    dims = ParallelDims(world, tensor_parallel=tp, ranks_per_node=world)
    pmesh = dims.build("cpu")
    log = CallLog()
    pg_setup = process_groups()
    report: dict = {"coords": [pmesh.hdp_rank, pmesh.lane, list(pmesh.ring_ranks)]}
    if dims.data_parallel > 1:
        report["grads"] = _gradient_case(pmesh)
        report["train"] = _train(pmesh, log, steps=STEPS, tied=False, fsdp=False)
        report["pg_after_train"] = process_groups()
        report["fsdp"] = _train(pmesh, log, steps=FSDP_STEPS, tied=False, fsdp=True)
    else:
        report["train"] = _train(pmesh, log, steps=4, tied=True, fsdp=False)
    report["pg_setup"], report["pg_end"] = pg_setup, process_groups()
    report["group_calls"] = sum(
        1 for e in log.events if e[0] in ("new_group", "new_subgroups", "split_group")
    )
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports_2x2(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("tp2x2"), _worker, 4, 4, 2, timeout_s=260)


@pytest.fixture(scope="module")
def reports_1x2(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("tp1x2"), _worker, 2, 2, 2, timeout_s=200)


def test_global_ranks_map_to_hdp_ranks_and_lanes_tp_inner(reports_2x2):
    # TP inner: global rank g is HDP rank g // 2, lane g % 2; a lane's ring ranks are g % 2 + 2 h
    assert [r["coords"] for r in reports_2x2] == [
        [0, 0, [0, 2]],
        [0, 1, [1, 3]],
        [1, 0, [0, 2]],
        [1, 1, [1, 3]],
    ]


def test_tp_forward_and_input_gradients_equal_one_process_per_slot(reports_2x2):
    for rep in reports_2x2:
        g = rep["grads"]
        assert g["rings"] > 0 and g["slots"] > 0
        assert g["heads_seen"] == [[2, 1]], "attention must receive this lane's 4/2 heads and 2/2 KV heads"
        assert g["logit_err"] <= TOLERANCE, g
        assert g["input_grad_err"] <= TOLERANCE, g
        assert g["param_grad_err"] <= TOLERANCE, g
        assert g["loss_err"] <= 1e-12, g


def test_replicated_parameters_gradients_agree_across_lanes_before_the_sum(reports_2x2):
    for rep in reports_2x2:
        assert rep["grads"]["replicated_gap"] <= 1e-15, rep["grads"]["replicated_gap"]


def _check_training(train: dict, steps: int) -> None:
    assert len(train["param_diff"]) == steps
    assert min(train["norms"]) > MAX_NORM, "clipping must act in every step"
    assert max(train["grad_diff"]) <= TOLERANCE, train["grad_diff"]
    assert max(train["param_diff"]) <= TOLERANCE, train["param_diff"]
    assert max(train["loss_diff"]) <= 1e-12, train["loss_diff"]
    assert max(train["norm_diff"]) <= 1e-12, train["norm_diff"]


def test_2x2_adamw_steps_with_clipping_equal_one_process(reports_2x2):
    for rep in reports_2x2:
        train = rep["train"]
        _check_training(train, STEPS)
        assert [2, 0] in train["counts"], "a step in which HDP rank 1 runs no micro-batch"
        assert any(s["rings"] for s in train["steps"])
        assert {m for s in train["steps"] for m in s["modes"]} == {"ring", "ulysses"}


def test_ring_p2p_of_each_lane_goes_to_the_same_lane_of_the_other_hdp_rank(reports_2x2):
    for rank, rep in enumerate(reports_2x2):
        peers = {
            p
            for s in rep["train"]["steps"]
            for name, _, ps in s["events"]
            if name == "batch_isend_irecv"
            for p in ps
        }
        groups = {
            tuple(ranks)
            for s in rep["train"]["steps"]
            for name, ranks, _ in s["events"]
            if name == "batch_isend_irecv"
        }
        expected = {g for g in range(4) if g % 2 == rank % 2 and g != rank}  # same lane, other HDP rank
        assert peers == expected, (rank, peers)
        assert groups == {(0, 1, 2, 3)}, "ring P2P runs on the one global group"


def test_no_process_group_is_created_after_set_up(reports_2x2):
    for rep in reports_2x2:
        assert rep["pg_after_train"] == rep["pg_setup"] == rep["pg_end"]
        assert rep["group_calls"] == 0


def test_2x2_fsdp2_on_data_parallel_with_tp_inside_equals_one_process(reports_2x2):
    for rep in reports_2x2:
        _check_training(rep["fsdp"], FSDP_STEPS)


def test_1x2_adamw_steps_with_clipping_and_tied_embeddings_equal_one_process(reports_1x2):
    for rep in reports_1x2:
        _check_training(rep["train"], 4)
        assert rep["coords"][:2] in ([0, 0], [0, 1])
        assert rep["pg_end"] == rep["pg_setup"]


def test_data_parallel_collectives_come_before_or_after_every_ring_exchange(reports_2x2):
    for rank, rep in enumerate(reports_2x2):
        lane = tuple(g for g in range(4) if g % 2 == rank % 2)  # this lane's data-parallel group
        for s, step in enumerate(rep["train"]["steps"]):
            events = step["events"]
            name, ranks, _ = events[0]
            assert (name, tuple(ranks)) == ("all_gather", (0, 1, 2, 3)), (
                rank,
                s,
                events[0],
            )  # the digest, all lanes
            p2p = [i for i, e in enumerate(events) if e[0] == "batch_isend_irecv"]
            dp = [i for i, e in enumerate(events) if e[0] == "all_reduce" and tuple(e[1]) == lane]
            assert len(dp) == 1, (
                rank,
                s,
                events,
            )  # gradients and scalars: one all-reduce on the lane's group
            if p2p:
                assert dp[0] > max(p2p), (rank, s)
