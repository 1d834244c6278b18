"""The step's scalars in one float64 all-reduce after the buckets, on every backend alike.

``sync_step`` with a :class:`BucketedGradSync` sums the gradients in the buckets and then the
loss, the per-rank reports, the caller's extra values and the exact counts in one small
float64 all-reduce of their own, the same code on gloo as on NCCL.  A 3-rank run (one rank
with no micro-batch, one parameter no rank uses) checks the whole step against the flat
all-reduce, which sends the same values its own way: gradients, loss, reports, exact
telemetry, ``grad=None`` for the unused parameter, a non-finite loss named on its rank, and
exactly one all-gather (the plan digest) and one all-reduce per bucket plus one for the
scalars in every step.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _ranks import DistCalls, gather_reports, init_gloo, save_report

WORLD = 3
STEPS = 3

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32), torch.nn.Linear(16, 4))
    return model.to(dtype)  # model[2] is used by no rank: its gradient stays None


def _step(step: int, rank: int):
    """One step's micro-batches: ranks hold 1, 2 and 0 of them (rank 2 runs none)."""
    from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
    from lightning_bytescale.packed_attention.layout import AttentionLayout

    lengths = [[7], [5, 9], []][rank]
    mbs = []
    for i, s in enumerate(lengths):
        ids = torch.randint(0, 32, (s,), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + i))
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        layout = AttentionLayout(cu_seqlens=torch.tensor([0, s]), seq_lens=(s,))
        mbs.append(PackedMicroBatch(ids, labels, layout.positions(), layout, (rank * 2 + i,), 18))
    return StepBatch(
        mbs, num_global_tokens=18, num_tokens=21, digest=f"step{step}", step=step, stats={"world_size": 3}
    )


def _forward(bad: bool):
    from lightning_bytescale.engine.loss import token_loss

    def forward(model, mb):
        logits = model[1](model[0](mb.input_ids))
        loss = token_loss(logits, mb.labels, mb.num_global_tokens)
        if bad and dist.get_rank() == 1 and mb.seq_ids[0] == 3:
            loss = loss * math.nan
        return loss

    return forward


def _run(model, sync, counters, bad_step=None) -> dict:
    from lightning_bytescale.engine import NonFiniteError, run_step

    out: dict = {"steps": []}
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        extra = torch.zeros(3, dtype=torch.float64)
        extra[dist.get_rank()] = float(2**40 + 7 * step + dist.get_rank())  # exact only in float64
        before = counters.snapshot()
        try:
            result = run_step(
                model,
                _step(step, dist.get_rank()),
                forward=_forward(step == bad_step),
                grad_sync=sync,
                extra=extra,
            )
        except NonFiniteError as err:
            out["error"] = {"step": step, "text": str(err)}
            break
        after = counters.snapshot()
        out["steps"].append(
            {
                "loss": result.loss,
                "extra": result.extra.tolist(),
                "num_micro_batches": [r.num_micro_batches for r in result.reports],
                "grads": [
                    None if p.grad is None else p.grad.double().reshape(-1).tolist()
                    for p in model.parameters()
                ],
                "calls": {k: after[k] - before[k] for k in after},
            }
        )
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("scalars"), _worker, WORLD, timeout_s=200)


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    grad_group = dist.new_group(list(range(WORLD)))
    counters = DistCalls(("all_reduce", "all_gather", "reduce", "broadcast", "barrier"))

    def bucketed(dtype: torch.dtype, **options) -> dict:
        """``STEPS`` steps of a fresh model with a fresh sync: 2-3 buckets, the first one small."""
        model = _model(dtype)
        sync = BucketedGradSync(
            model.parameters(), group=grad_group, bucket_bytes=8192, first_bucket_bytes=512
        )
        try:
            return {"buckets": len(sync.buckets), **_run(model, sync, counters, **options)}
        finally:
            sync.close()

    report = {
        name: {
            "bucketed": bucketed(dtype),
            "flat": _run(_model(dtype), None, counters),
            "bad": bucketed(dtype, bad_step=1),
        }
        for name, dtype in (("float32", torch.float32), ("float64", torch.float64))
    }
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_bucketed_step_gives_the_flat_all_reduces_results(reports, dtype):
    tol = 1e-6 if dtype == "float32" else 1e-12
    for rank, rep in enumerate(reports):
        case = rep[dtype]["bucketed"]
        assert case["buckets"] >= 2
        bucketed, flat = case["steps"], rep[dtype]["flat"]["steps"]
        assert len(bucketed) == len(flat) == STEPS
        for k, (b, f) in enumerate(zip(bucketed, flat)):
            assert b["loss"] == pytest.approx(f["loss"], rel=tol, abs=tol), (rank, k)
            assert b["num_micro_batches"] == f["num_micro_batches"] == [1, 2, 0]
            # the telemetry travels in float64 whatever the gradients' dtype: exact past 2**24
            # (the flat buffer sums it in the gradients' dtype)
            assert b["extra"] == [float(2**40 + 7 * k + r) for r in range(WORLD)]
            assert b["extra"] == pytest.approx(f["extra"], rel=1e-7)
            assert b["grads"][-2:] == f["grads"][-2:] == [None, None]  # the parameter no rank used
            for gb, gf in zip(b["grads"][:-2], f["grads"][:-2]):
                assert max(abs(x - y) for x, y in zip(gb, gf)) <= tol
        # the loss is one number on every rank
        assert [s["loss"] for s in bucketed] == [s["loss"] for s in reports[0][dtype]["bucketed"]["steps"]]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_step_makes_the_digest_all_gather_one_all_reduce_per_bucket_and_one_for_the_scalars(
    reports, dtype
):
    for rep in reports:
        case = rep[dtype]["bucketed"]
        for step in case["steps"]:
            assert step["calls"] == {
                "all_reduce": case["buckets"] + 1,
                "all_gather": 1,
                "reduce": 0,
                "broadcast": 0,
                "barrier": 0,
            }
        for step in rep[dtype]["flat"]["steps"]:  # the flat sync: everything in one all-reduce
            assert step["calls"]["all_reduce"] == 1 and step["calls"]["all_gather"] == 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_non_finite_loss_fails_every_rank_naming_its_rank(reports, dtype):
    for rep in reports:
        bad = rep[dtype]["bad"]
        assert len(bad["steps"]) == 1 and bad["error"]["step"] == 1
        assert "loss on rank(s) [1]" in bad["error"]["text"]
