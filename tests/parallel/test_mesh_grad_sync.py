"""The bucketed gradient sync on the ``(data_parallel, tensor_parallel)`` mesh, seen from one rank of a fake world.

One process joins torch's ``FakeProcessGroup`` as one rank of four (``(2, 2)``: HDP ranks 0 and
1, lanes 0 and 1): every collective returns at once without data, so the values are not checked
here (the float64 suites under ``tests/lightning`` and ``tests/parallel`` check them on gloo), but
the order in which a rank issues its collectives, and what it sums, is exactly what the code
issues.  Recorded are the ``torch.distributed`` collectives with their sizes and groups, and the
end of each micro-batch's backward.

* Under ``ByteScaleStrategy(tensor_parallel_size=2)`` (its step loop, as a ``Trainer`` drives it):
  the gradient all-reduces on the lane's data-parallel group are issued inside the last
  micro-batch's backward, each a bucket smaller than the gradients (no flat copy of them), and
  afterwards every DTensor gradient is a DTensor of its parameter's placements whose local tensor
  lies in a bucket; an HDP rank without micro-batches issues the same all-reduces in the same order.
* ``run_parallel_step`` with FSDP2 and parameters FSDP does not manage: every rank launches its
  buckets before FSDP's reduce-scatters, a rank without micro-batches too.
* The TP lanes cut the same buckets when a dimension does not divide evenly over them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.engine import build_step
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.step_checks import StepChecks
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning import step as step_loop
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import (
    FSDPStepDriver,
    ParallelDims,
    parallelize_llama,
    run_parallel_step,
)
from lightning_bytescale.parallel.layout import make_runner
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

WORLD, TP = 4, 2
LENGTHS = [10, 12, 9, 7]
BUCKET_MB = 0.02  # about 2600 float64 elements: the tiny Llama's gradients fill several buckets


@pytest.fixture
def fake_rank(fake_process_group) -> Callable:
    """``fake_rank(r)`` makes this process rank ``r`` of a fake world of four and returns its ``(2, 2)`` mesh."""

    def join(rank: int):
        fake_process_group(rank, WORLD)
        return ParallelDims(WORLD, tensor_parallel=TP).build("cpu")

    return join


class Recorder:
    """``torch.distributed``'s gradient collectives in issue order, and the end of each backward."""

    NAMES = ("all_reduce", "reduce", "reduce_scatter_tensor")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple] = []
        for name in self.NAMES:
            original = getattr(dist, name)

            def wrapped(*args, __name=name, __original=original, **kwargs):
                # torch calls these by position or by keyword (2.11's FSDP2 passes output=, input=)
                bound = inspect.signature(__original).bind(*args, **kwargs).arguments
                tensor = next(iter(bound.values()))  # tensor / output: the first parameter
                ranks = tuple(dist.get_process_group_ranks(bound.get("group") or dist.group.WORLD))
                self.events.append((__name, tensor.numel(), ranks))
                return __original(*args, **kwargs)

            monkeypatch.setattr(dist, name, wrapped)

    def mark(self, what: str) -> None:
        self.events.append((what,))

    def on(self, ranks: tuple[int, ...]) -> list[tuple]:
        """The collectives on the group of ``ranks`` (and every mark), in order."""
        return [e for e in self.events if len(e) == 1 or e[2] == ranks]


def _plan() -> Plan:
    """HDP rank 0 runs two local micro-batches, HDP rank 1 none."""
    mbs = [
        MicroBatch([Piece(0, ((0, 10),)), Piece(1, ((0, 12),))]),
        MicroBatch([Piece(2, ((0, 9),)), Piece(3, ((0, 7),))]),
    ]
    return Plan(2, 24, "hand", tuple(LENGTHS), [mbs, []]).validate()


def _step(pmesh):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in LENGTHS]
    return build_step(_plan(), pmesh.hdp_rank, lambda j: seqs[j], step=0, ring_ranks=pmesh.ring_ranks)


def _llama() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig.preset("tiny", tie_embeddings=False)).double()


class TPModule(pl.LightningModule):
    """Written as for Lightning's ``ModelParallelStrategy``; records the end of each backward."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.model = _llama()
        self.recorder = recorder

    def configure_model(self) -> None:
        parallelize_llama(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, mb, batch_idx):
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def backward(self, loss, *args, **kwargs) -> None:
        loss.backward(*args, **kwargs)
        self.recorder.mark("backward returned")


def _strategy_step(pmesh, monkeypatch: pytest.MonkeyPatch):
    """One step of the strategy's step loop on ``pmesh``: its module, its recorder and its runner's bucketed sync.

    A fake group sums nothing and gathers nothing (a gather's output keeps whatever memory it
    was given), so the checks of values (the plan digests, the token count, parameter
    fingerprints, finite losses) are off.
    """
    monkeypatch.setattr(step_loop, "StepChecks", functools.partial(StepChecks, plan=False, tokens=False))
    strategy = ByteScaleStrategy(
        tensor_parallel_size=TP,
        parallel_devices=[torch.device("cpu")] * WORLD,
        bucket_cap_mb=BUCKET_MB,
        check_parameters_every_n_steps=0,
        check_finite=False,
    )
    recorder = Recorder(monkeypatch)
    module = TPModule(recorder)
    module._device_mesh = pmesh.mesh
    module.configure_model()
    strategy.parallel_mesh = pmesh
    strategy.connect(module)
    recorder.events.clear()
    runner = make_runner(strategy.layout, module, strategy._runner_options())  # what set-up makes
    strategy._runner = runner
    loop = strategy._loop
    loop.sync(loop.train(_step(pmesh), (0,), {}))
    return module, recorder, runner.options.buckets.sync


def test_tp_gradients_are_summed_in_buckets_inside_the_last_backward_with_no_flat_copy(
    fake_rank, monkeypatch
):
    pmesh = fake_rank(0)  # HDP rank 0, lane 0: two micro-batches
    module, recorder, sync = _strategy_step(pmesh, monkeypatch)
    lane_group = (0, 2)
    events = recorder.on(lane_group)
    ends = [i for i, e in enumerate(events) if e == ("backward returned",)]
    assert len(ends) == 2
    during = [e for e in events[ends[0] + 1 : ends[1]] if e[0] == "all_reduce"]
    assert during, f"no gradient all-reduce was issued inside the last backward: {events}"
    assert sync is not None and sync.group is pmesh.dp_group
    assert len(sync.buckets) > 1
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in module.named_parameters()}
    held = sum(t.numel() for t in local.values())  # this rank's gradient elements
    sizes = [e[1] for e in events if len(e) > 1]
    assert max(sizes) < held, f"a collective of {max(sizes)} elements: a flat copy of the {held} gradients"
    assert sorted(e[1] for e in during) == sorted(b.numel for b in sync.buckets)
    storages = {b.buffer.untyped_storage().data_ptr() for b in sync.buckets if b.buffer is not None}
    solo = {id(b.params[0]) for b in sync.buckets if b.solo}
    sharded = 0
    for name, p in module.named_parameters():
        grad = p.grad
        if isinstance(p, DTensor):  # the TP shards; norms are plain replicas on every lane
            assert isinstance(grad, DTensor) and grad.placements == p.placements, name
            grad, sharded = grad.to_local(), sharded + 1
        assert grad.shape == local[name].shape, name
        if id(p) not in solo:
            assert grad.untyped_storage().data_ptr() in storages, f"{name}'s gradient is a copy"
    assert sharded > 0


def test_an_hdp_rank_without_micro_batches_issues_the_same_gradient_collectives(fake_rank, monkeypatch):
    sequences = {}
    for rank in (0, 2, 1, 3):  # lane 0 of HDP ranks 0 and 1, then lane 1 of both
        pmesh = fake_rank(rank)
        _, recorder, _ = _strategy_step(pmesh, monkeypatch)
        lane_group = tuple(dist.get_process_group_ranks(pmesh.dp_group))
        sequences[rank] = [e for e in recorder.on(lane_group) if len(e) > 1]
        monkeypatch.undo()
    assert len(sequences[0]) > 2  # buckets and the scalars
    assert sequences[0] == sequences[2], "HDP rank 1 (no micro-batch) must issue what HDP rank 0 issues"
    assert sequences[1] == sequences[3]
    assert [e[1] for e in sequences[0]] == [e[1] for e in sequences[1]], "both lanes cut the same buckets"


def _fsdp_with_unmanaged(pmesh):
    from torch.distributed.fsdp import fully_shard

    model = _llama()
    parallelize_llama(model, pmesh.tp_mesh)
    for block in model.blocks:
        fully_shard(block, mesh=pmesh.dp_mesh, reshard_after_forward=False)
    fully_shard(
        model,
        mesh=pmesh.dp_mesh,
        reshard_after_forward=False,
        ignored_params={model.norm.weight, model.embed.weight},
    )
    return model, FSDPStepDriver(model, pmesh.dp_group)


def test_fsdp2_the_buckets_of_the_unmanaged_parameters_go_before_its_reduce_scatters(fake_rank, monkeypatch):
    sequences = {}
    for rank in (0, 2):  # HDP rank 0 (two micro-batches) and 1 (none), lane 0
        pmesh = fake_rank(rank)
        model, driver = _fsdp_with_unmanaged(pmesh)
        recorder = Recorder(monkeypatch)
        finish = driver.finish_step

        def finish_step(finish=finish, recorder=recorder) -> None:
            recorder.mark("FSDP reduce-scatters")
            finish()

        monkeypatch.setattr(driver, "finish_step", finish_step)
        named = driver.unmanaged([(n, p) for n, p in model.named_parameters() if p.requires_grad])
        assert sorted(n for n, _ in named) == ["embed.weight", "norm.weight"]
        sync = BucketedGradSync(
            [p for _, p in named], group=pmesh.dp_group, bucket_bytes=2000, first_bucket_bytes=1000
        )
        run_parallel_step(
            model, _step(pmesh), pmesh, fsdp=driver, grad_sync=sync, check_plan=False, check_tokens=False,
            check_finite=False,
        )  # fmt: skip
        events = [e for e in recorder.on((0, 2)) if e[0] != "reduce_scatter_tensor"]
        marker = events.index(("FSDP reduce-scatters",))
        assert [e[1] for e in events[:marker]] == [b.numel for b in sync.buckets], (rank, events)
        sequences[rank] = events
        monkeypatch.undo()
    assert sequences[0] == sequences[2]


def test_lanes_cut_the_same_buckets_when_a_dimension_does_not_divide_evenly(fake_rank):
    cuts = []
    for rank in (0, 1):  # lane 0 holds 33 rows of the uneven parameter, lane 1 32
        pmesh = fake_rank(rank)
        torch.manual_seed(0)
        whole = [torch.randn(65, 40), torch.randn(40, 40), torch.randn(65, 8), torch.randn(12)]
        params = [torch.nn.Parameter(distribute_tensor(t, pmesh.tp_mesh, [Shard(0)])) for t in whole]
        assert params[0].to_local().shape[0] == (33 if rank == 0 else 32)
        # 8400 bytes: lane 0 (8480 bytes of the two large shards) closes a bucket between them, lane 1 (8320) not
        sync = BucketedGradSync(params, group=pmesh.dp_group, bucket_bytes=8400, first_bucket_bytes=3000)
        index = {id(p): i for i, p in enumerate(params)}
        cuts.append([[index[id(p)] for p in b.params] for b in sync.buckets])
        sync.close()
    assert len(cuts[0]) > 1
    assert cuts[0] == cuts[1]


def test_run_parallel_step_refuses_a_bucketed_sync_of_other_parameters_or_another_group(fake_rank):
    pmesh = fake_rank(0)
    model = _llama()
    parallelize_llama(model, pmesh.tp_mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    sync = BucketedGradSync(params[1:], group=pmesh.dp_group)
    with pytest.raises(ConfigError, match="grad_sync holds"):
        run_parallel_step(model, _step(pmesh), pmesh, grad_sync=sync, check_plan=False)
    with pytest.raises(ConfigError, match="not over this rank's data-parallel group"):  # the global group
        run_parallel_step(model, _step(pmesh), pmesh, grad_sync=BucketedGradSync(params), check_plan=False)
    with pytest.raises(ConfigError, match="grad_owners and grad_sync"):
        run_parallel_step(
            model,
            _step(pmesh),
            pmesh,
            grad_sync=BucketedGradSync(params, group=pmesh.dp_group),
            grad_owners={},
            check_plan=False,
        )
