"""The step's plan check overlaps the local micro-batches, yet runs before any P2P or gradient collective.

``check_step(..., wait=False)`` only starts the all-gather of the plan keys;
``run_micro_batches(plan_check=...)`` waits for it right before this rank's first ring
micro-batch, before the last backward when the bucketed gradient sync is armed (that backward
launches bucket all-reduces), and at the latest after the loop.  One start of 4 gloo ranks
(float64, forked when safe), plans whose ranks run a local micro-batch *before* a ring one:

* ranks that agree: loss and gradients equal one process on the whole batch (1e-10), with the
  flat and the bucketed sync, and the wait comes after the local micro-batch and before the
  ring one;
* ranks whose plans differ (rank 1's copy lists one more sequence): every rank raises
  :class:`PlanDivergenceError` naming rank 1, with no P2P transfer, no gradient bucket and no
  all-reduce; ranks whose first micro-batch is local ran it, none entered the ring;
* ranks that read different data (another ``data_identity`` on rank 2): every rank raises
  naming both stores, with no P2P transfer and no all-reduce.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from _ranks import DistCalls, gather_reports, init_gloo, save_report

from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

WORLD = 4
LENGTHS = (5, 31, 7, 9, 3, 12, 6, 8)
TOLERANCE = 1e-10

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _local(seqs):
    return MicroBatch([Piece(j, ((0, LENGTHS[j]),)) for j in seqs])


def _plan(extra_on: int | None = None, rank: int = 0) -> Plan:
    """Every rank: local work first, then its member of one ring of 4 over sequence 1, then more local work."""
    ranks = [[_local([0, 2])], [_local([3])], [_local([4, 5])], []]
    ring = (2, 0, 3, 1)
    for m, r in enumerate(ring):
        ranks[r].append(
            MicroBatch([Piece(1, tuple(zigzag.member_ranges(LENGTHS[1], WORLD, m)))], ring=ring, item=0)
        )
    ranks[1].append(_local([6]))
    ranks[3].append(_local([7]))
    if extra_on is not None and rank == extra_on:  # this rank's copy also lists sequence 0
        ranks[extra_on][-1].pieces.append(Piece(0, ((0, LENGTHS[0]),)))
        return Plan(WORLD, 64, "hand", LENGTHS, ranks)
    return Plan(WORLD, 64, "hand", LENGTHS, ranks).validate()


def _model(reference: bool):
    from lightning_bytescale.engine.reference import causal_attention
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny", tie_embeddings=True)
    return LlamaModel(cfg, attention_fn=causal_attention if reference else None).double()


def _case(model, step, calls, grad_sync, ref_grads=None, ref_loss=None) -> dict:
    from lightning_bytescale.engine import check_step, run_micro_batches, sync_step
    from lightning_bytescale.packed_attention import comm_stats

    model.zero_grad(set_to_none=True)
    entered: list[str] = []
    phases: list[str] = []

    @contextlib.contextmanager
    def watch(mb):
        entered.append("ring" if mb.layout.ring is not None else "local")
        yield

    before, p2p0 = calls.snapshot(), comm_stats()["p2p_calls"]
    out: dict = {"error": None}
    try:
        check = check_step(step, wait=False)
        local = run_micro_batches(
            model,
            step.micro_batches,
            micro_batch_context=watch,
            check_finite=True,
            on_phase=phases.append,
            step=step.step,
            grad_sync=grad_sync,
            plan_check=check,
        )
        result = sync_step(list(model.named_parameters()), step, local, grad_sync=grad_sync)
        if ref_grads is not None:
            out["grad_err"] = max(
                (p.grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters()
            )
            out["loss_err"] = abs(result.loss - ref_loss)
    except Exception as err:  # noqa: BLE001  (recorded and checked by the tests)
        out["error"] = f"{type(err).__name__}: {err}"
    after = calls.snapshot()
    out["calls"] = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    out["p2p"] = comm_stats()["p2p_calls"] - p2p0
    out["entered"] = entered
    out["phases"] = phases
    return out


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine import build_step
    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.engine.reference import reference_loss

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    grad_group = dist.new_group(list(range(WORLD)))
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 64, (s,), generator=g) for s in LENGTHS]
    ref = _model(reference=True)
    loss = reference_loss(ref, tokens)
    loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    model = _model(reference=False)
    calls = DistCalls(("all_reduce", "all_gather", "batch_isend_irecv", "send", "recv"))  # collectives, P2P
    sync = BucketedGradSync(list(model.parameters()), group=grad_group, bucket_bytes=4096)
    get = tokens.__getitem__
    report = {
        "agree_flat": _case(
            model, build_step(_plan(), rank, get, step=3), calls, None, ref_grads, loss.item()
        ),
        "agree_bucketed": _case(
            model, build_step(_plan(), rank, get, step=3), calls, sync, ref_grads, loss.item()
        ),
        "diverged": _case(model, build_step(_plan(1, rank), rank, get, step=4), calls, None),
        "diverged_bucketed": _case(model, build_step(_plan(1, rank), rank, get, step=4), calls, sync),
        "data": _case(
            model,
            build_step(_plan(), rank, get, step=5, data_identity="store-B" if rank == 2 else "store-A"),
            calls,
            sync,
        ),
    }
    # the ranks are still in step after the failed checks: a last agreeing step runs normally
    report["after"] = _case(
        model, build_step(_plan(), rank, get, step=6), calls, sync, ref_grads, loss.item()
    )
    sync.close()
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("plan_check"), _worker, WORLD, timeout_s=200)


def test_the_plan_has_local_work_before_its_ring():
    plan = _plan()
    for rank in range(WORLD):
        kinds = ["ring" if mb.ring is not None else "local" for mb in plan.ranks[rank]]
        assert "ring" in kinds
    assert [mb.ring is None for mb in plan.ranks[0]][:1] == [True]


@pytest.mark.parametrize("case", ["agree_flat", "agree_bucketed", "after"])
def test_agreeing_ranks_match_one_process(reports, case):
    for rank, rep in enumerate(reports):
        out = rep[case]
        assert out["error"] is None, (rank, out["error"])
        assert out["grad_err"] <= TOLERANCE and out["loss_err"] <= 1e-12, (rank, out)
        assert out["p2p"] > 0  # the ring ran
        assert out["calls"]["all_gather"] == 1


def test_the_wait_comes_after_local_work_and_before_the_ring(reports):
    for rep in reports:
        phases = rep["agree_bucketed"]["phases"]
        wait = next(
            i for i, p in enumerate(phases) if "plan digest check" in p and "(waits on every rank)" in p
        )
        ring = next(i for i, p in enumerate(phases) if "(ring" in p)
        assert wait < ring, phases
        if rep["agree_bucketed"]["entered"][0] == "local":
            assert wait > 0, phases  # the local micro-batch ran while the all-gather was in flight
    assert any(rep["agree_bucketed"]["entered"][0] == "local" for rep in reports)


@pytest.mark.parametrize("case", ["diverged", "diverged_bucketed"])
def test_divergent_plans_stop_every_rank_before_any_p2p_or_gradient_collective(reports, case):
    for rank, rep in enumerate(reports):
        out = rep[case]
        assert out["error"] and out["error"].startswith("PlanDivergenceError: "), (rank, out)
        assert "ranks [1] differ from ranks [0, 2, 3]" in out["error"]
        assert out["p2p"] == 0, (rank, out)
        assert out["calls"] == {"all_gather": 1}, (rank, out)
        assert "ring" not in out["entered"], (rank, out)
    assert any(rep[case]["entered"] == ["local"] for rep in reports)  # local work overlapped the check


def test_different_data_stops_every_rank_naming_the_stores(reports):
    for rank, rep in enumerate(reports):
        out = rep["data"]
        assert out["error"] and out["error"].startswith("PlanDivergenceError: "), (rank, out)
        assert "'store-A'" in out["error"] and "'store-B'" in out["error"], out["error"]
        assert out["p2p"] == 0 and "ring" not in out["entered"], (rank, out)
        assert "all_reduce" not in out["calls"], (rank, out)
