"""FSDP2 on the data-parallel dimension with different micro-batch counts per rank, on 3 gloo ranks, float64.

The mesh is ``(data_parallel=3, tensor_parallel=1)``.  Every step's plan gives the ranks different
numbers of micro-batches -- hand plans with counts ``(0, 1, 3)`` and ``(3, 1, 0)`` (a ring between
two ranks among them), then the balance planner -- and the reference Llama sharded with
``fully_shard`` per block and at the root runs through
:class:`~lightning_bytescale.parallel.FSDPStepDriver`.  After several AdamW steps with clipping the
parameters, losses and norms equal one process on the same global batches; the same plans without
FSDP (``(3, 1)`` through ``run_parallel_step``) too.  Each rank's collectives per step are counted
and ordered: one all-gather and one reduce-scatter per FSDP unit on the data-parallel group,
whatever the rank's micro-batch count (none included); every all-gather before the rank's first
ring P2P, every reduce-scatter after its last.  Settings that cannot be exact are refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _parallel import CallLog, global_batch, shard_with_fsdp, train_against_reference
from _ranks import gather_reports, init_gloo, save_report

from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

WORLD = 3
CAPACITY = 24
MAX_NORM = 0.05
LR = 1e-2
STEPS = 4
# FSDP2's collectives by name: torch 2.13 calls the *_single forms, 2.11 the *_tensor ones
GATHERS = ("all_gather_single", "all_gather_into_tensor")
SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def _models():
    from lightning_bytescale.engine.reference import causal_attention
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig.preset("tiny", tie_embeddings=False)
    torch.manual_seed(0)
    ref = LlamaModel(cfg, attention_fn=causal_attention).double()
    torch.manual_seed(0)
    return ref, LlamaModel(cfg).double()


def _batch(step: int) -> list[torch.Tensor]:
    return global_batch(step, (2, 16), 5, long=(30 + step,))  # sequence 5 needs a ring of two


def _hand_plan(seqs: list[torch.Tensor], idle: int, busy: int) -> Plan:
    """Rank ``idle`` runs nothing, rank ``busy`` three micro-batches (the middle one a ring with the third rank)."""
    lengths = [len(s) for s in seqs]
    other = 3 - idle - busy
    ring = (busy, other)

    def ring_mb(member: int) -> MicroBatch:
        s = lengths[5]
        return MicroBatch([Piece(5, tuple(zigzag.member_ranges(s, 2, member)))], ring=ring, item=0)

    def local(seqs: range) -> MicroBatch:
        return MicroBatch([Piece(j, ((0, lengths[j]),)) for j in seqs])

    ranks: list[list[MicroBatch]] = [[] for _ in range(WORLD)]
    ranks[busy] = [local(range(0, 2)), ring_mb(0), local(range(2, 5))]
    ranks[other] = [ring_mb(1)]
    plan = Plan(WORLD, 64, "hand", lengths, ranks)
    plan.validate()
    return plan


def _plan(step: int, seqs):
    from lightning_bytescale.planner import make_plan

    if step == 0:
        return _hand_plan(seqs, idle=0, busy=2)  # counts (0, 1, 3)
    if step == 1:
        return _hand_plan(seqs, idle=2, busy=0)  # counts (3, 1, 0)
    return make_plan(
        [len(s) for s in seqs], world_size=WORLD, capacity=CAPACITY, planner="balance", seed=step
    )


def _train(pmesh, log: CallLog, fsdp: bool) -> dict:
    from lightning_bytescale.parallel import fsdp_units

    ref, model = _models()
    driver = shard_with_fsdp(model, pmesh) if fsdp else None
    out = train_against_reference(
        model,
        ref,
        pmesh,
        steps=STEPS,
        batch=_batch,
        plan=_plan,
        max_norm=MAX_NORM,
        lr=LR,
        driver=driver,
        log=log,
    )
    out["steps"] = [[e[0] for e in s["events"]] for s in out["steps"]]
    out["units"] = len(fsdp_units(model))
    out["grad_types"] = sorted({type(p.grad).__name__ for p in model.parameters()})
    return out


def _refusals(pmesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    from lightning_bytescale.parallel import FSDPSettingError, FSDPStepDriver

    found = {}
    _, model = _models()
    for block in model.blocks:
        fully_shard(block, mesh=pmesh.dp_mesh)  # FSDP2's default: reshard_after_forward=True
    fully_shard(model, mesh=pmesh.dp_mesh)
    try:
        FSDPStepDriver(model, pmesh.dp_group)
    except FSDPSettingError as err:
        found["reshard_after_forward"] = str(err)
    _, model = _models()
    fully_shard(model.blocks[0], mesh=pmesh.dp_mesh, reshard_after_forward=False)  # no root unit
    try:
        FSDPStepDriver(model, pmesh.dp_group)
    except FSDPSettingError as err:
        found["root"] = str(err)
    return found


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.parallel import ParallelDims

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    pmesh = ParallelDims(WORLD, tensor_parallel=1).build("cpu")
    log = CallLog()
    report = {"fsdp": _train(pmesh, log, fsdp=True), "plain": _train(pmesh, log, fsdp=False)}
    report["refusals"] = _refusals(pmesh)
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("fsdp_uneven"), _worker, WORLD, timeout_s=220)


def _check(train: dict) -> None:
    assert train["counts"][0] == [0, 1, 3] and train["counts"][1] == [3, 1, 0]
    assert min(train["norms"]) > MAX_NORM, "clipping must act in every step"
    assert max(train["grad_diff"]) <= 1e-10, train["grad_diff"]
    assert max(train["param_diff"]) <= 1e-10, train["param_diff"]
    assert max(train["loss_diff"]) <= 1e-12, train["loss_diff"]
    assert max(train["norm_diff"]) <= 1e-12, train["norm_diff"]


def test_fsdp2_with_counts_0_1_3_equals_one_process(reports):
    for rep in reports:
        _check(rep["fsdp"])
        assert rep["fsdp"]["grad_types"] == ["DTensor"], "every unit's sharded gradient is set"


def test_3x1_without_fsdp_equals_one_process(reports):
    for rep in reports:
        _check(rep["plain"])


def test_fsdp2_collectives_are_one_per_unit_per_step_and_outside_the_rings(reports):
    units = reports[0]["fsdp"]["units"]
    assert units == 3  # two blocks and the root
    for rank, rep in enumerate(reports):
        for s, events in enumerate(rep["fsdp"]["steps"]):
            gathers = [i for i, e in enumerate(events) if e in GATHERS]
            scatters = [i for i, e in enumerate(events) if e in SCATTERS]
            p2p = [i for i, e in enumerate(events) if e == "batch_isend_irecv"]
            where = (rank, s, rep["fsdp"]["counts"][s][rank])
            assert len(gathers) == units and len(scatters) == units, where
            assert events[0] == "all_gather", where  # the plan digest, first
            if p2p:
                assert max(gathers) < min(p2p) and max(p2p) < min(scatters), where
            grads = [i for i, e in enumerate(events) if e == "all_reduce"]
            assert grads and min(grads) > max(scatters), where  # the step's scalars after the gradients
        # the idle rank of step 0 made exactly the same data-parallel collectives as the busy one
        assert [e for e in rep["fsdp"]["steps"][0] if e != "batch_isend_irecv"] == [
            e for e in reports[2]["fsdp"]["steps"][0] if e != "batch_isend_irecv"
        ]


def test_settings_that_cannot_be_exact_are_refused_naming_them(reports):
    for rep in reports:
        found = rep["refusals"]
        assert "reshard_after_forward=True" in found["reshard_after_forward"]
        assert "reshard_after_forward=False" in found["reshard_after_forward"]
        assert "fully_shard applied to the root module" in found["root"]
