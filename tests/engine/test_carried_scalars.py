"""The step's scalars riding in the last gradient bucket (gloo): exact, one collective fewer.

``sync_step`` with a :class:`BucketedGradSync` on gloo writes the loss, the per-rank reports,
the caller's extra values and the exact counts as a tail of the last bucket, so the step
makes no all-reduce of its own for them.  In a float32 bucket the floats travel as float32
pairs in slots with one writer each; the encoding is checked here against float64 sums for
many worlds and values, and a 3-rank run checks the whole step (gradients, loss, reports,
has-gradient flags, telemetry, a non-finite loss) against the flat all-reduce, which sends
the same values its own way.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _ranks import DistCalls, gather_reports, init_gloo, save_report
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.engine.executor import COUNT_BITS, _CarriedScalars
from lightning_bytescale.engine.step_checks import SLOT

# --------------------------------------------------------------------------- the encoding


@st.composite
def _ranks_values(draw):
    world = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    n_extra = draw(st.integers(0, 6))
    n_counts = draw(st.integers(1, 5))  # the step always sends its head counts
    finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
    losses = [draw(finite) for _ in range(world)]
    # a report slot holds small counts, seconds, bytes and sequence ids up to 2**40 (one writer: its rank)
    ids = st.integers(0, 2**40)
    reports = [[float(draw(st.one_of(ids, st.floats(0, 1e9)))) for _ in range(SLOT)] for _ in range(world)]
    owners = [draw(st.integers(0, world - 1)) for _ in range(n_extra)]  # one writer per extra element
    extra_values = [float(draw(st.one_of(st.integers(0, 2**30), finite))) for _ in range(n_extra)]
    cap = (2**COUNT_BITS - 1) // world
    counts = [[draw(st.integers(0, cap)) for _ in range(n_counts)] for _ in range(world)]
    return world, dtype, losses, reports, owners, extra_values, counts


@settings(max_examples=200, deadline=None)
@given(_ranks_values())
def test_the_tail_sums_to_the_float64_scalars_in_either_dtype(case):
    world, dtype, losses, reports, owners, extra_values, counts = case
    tails, carried = [], None
    for rank in range(world):
        block = torch.zeros(world, SLOT, dtype=torch.float64)
        block[rank] = torch.tensor(reports[rank], dtype=torch.float64)
        extra = torch.zeros(len(extra_values), dtype=torch.float64)
        for i, (owner, value) in enumerate(zip(owners, extra_values)):
            if owner == rank:
                extra[i] = value
        floats = [torch.tensor([losses[rank]], dtype=torch.float64), block.reshape(-1), extra]
        carried = _CarriedScalars(floats, torch.tensor(counts[rank], dtype=torch.int64), world, rank, dtype)
        assert carried.tail.dtype == dtype
        tails.append(carried.tail)
    assert carried is not None
    summed = torch.stack(tails).sum(dim=0)  # what the bucket's all-reduce does, in its dtype
    out = carried.decode(summed)
    n_reports = world * SLOT
    assert out.dtype == torch.float64 and out.numel() == 1 + n_reports + len(extra_values) + len(counts[0])
    scale = sum(abs(x) for x in losses)
    assert abs(float(out[0]) - math.fsum(losses)) <= 1e-12 * max(scale, 1.0)
    expected = [v for row in reports for v in row] + extra_values
    for got, want in zip(out[1 : 1 + n_reports + len(extra_values)].tolist(), expected):
        if want == int(want) and abs(want) < 2**48:
            assert got == want  # counts, sizes and sequence ids stay exact
        else:
            assert abs(got - want) <= 2**-45 * abs(want) + 1e-37  # below float32's range it reads 0
    sums = [sum(c[i] for c in counts) for i in range(len(counts[0]))]
    assert [int(x) for x in out[1 + n_reports + len(extra_values) :].tolist()] == sums


def test_a_non_finite_loss_stays_non_finite():
    for bad in (math.nan, math.inf, -math.inf):
        floats = [torch.tensor([bad], dtype=torch.float64), torch.zeros(2 * SLOT, dtype=torch.float64)]
        carried = _CarriedScalars(floats, torch.zeros(1, dtype=torch.int64), 2, 0, torch.float32)
        assert not math.isfinite(float(carried.decode(carried.tail)[0]))


def test_narrow_dtypes_carry_nothing():
    floats = [torch.zeros(1, dtype=torch.float64), torch.zeros(SLOT, dtype=torch.float64)]
    for dtype in (torch.bfloat16, torch.float16, None):
        assert _CarriedScalars(floats, torch.zeros(1, dtype=torch.int64), 1, 0, dtype).dtype is None


# --------------------------------------------------------------------------- 3 gloo ranks

WORLD = 3
STEPS = 4


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
        cu = torch.tensor([0, s])
        layout = AttentionLayout(cu_seqlens=cu, seq_lens=(s,))
        mbs.append(PackedMicroBatch(ids, labels, layout.positions(), layout, (rank * 2 + i,), 18))
    return StepBatch(
        mbs, num_global_tokens=18, num_tokens=21, digest=f"step{step}", step=step, stats={"world_size": 3}
    )


def _forward(bad_step: int | None):
    from lightning_bytescale.engine.loss import token_loss

    def forward(model, mb):
        logits = model[1](model[0](mb.input_ids))
        loss = token_loss(logits, mb.labels, mb.num_global_tokens)
        if bad_step is not None and dist.get_rank() == 1 and mb.seq_ids[0] == 3:
            loss = loss * math.nan
        return loss

    return forward


def _run(model, sync, counters, bad_step=None) -> dict:
    from lightning_bytescale.engine import NonFiniteError, run_step

    out = {"steps": []}
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        batch = _step(step, dist.get_rank())
        extra = torch.zeros(3, dtype=torch.float64)
        extra[dist.get_rank()] = float(2**30 + 7 * step + dist.get_rank())  # one writer per element
        before = counters.snapshot()
        try:
            result = run_step(
                model,
                batch,
                forward=_forward(bad_step if step == bad_step else None),
                grad_sync=sync,
                extra=extra,
            )
        except NonFiniteError as err:
            out["error"] = {"step": step, "text": str(err), "carried": 0 if sync is None else sync._carried}
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
                "all_reduce": after["all_reduce"] - before["all_reduce"],
                "carried": 0 if sync is None else sync._carried,
            }
        )
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("carried"), _worker, WORLD, timeout_s=200)


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    grad_group = dist.new_group(list(range(WORLD)))
    counters = DistCalls(("all_reduce", "all_gather"))

    def bucketed(dtype: torch.dtype, **options) -> dict:
        """``STEPS`` steps of a fresh model with a fresh sync: 2-3 buckets, the last one small."""
        model = _model(dtype)
        sync = BucketedGradSync(
            model.parameters(), group=grad_group, bucket_bytes=8192, first_bucket_bytes=512
        )
        try:
            return {
                "carrier": sync.carrier is not None,
                "buckets": len(sync.buckets),
                **_run(model, sync, counters, **options),
            }
        finally:
            sync.close()

    report = {
        name: {
            "bucketed": bucketed(dtype),
            "flat": _run(_model(dtype), None, counters),
            "bad": bucketed(dtype, bad_step=2),
        }
        for name, dtype in (("float32", torch.float32), ("float64", torch.float64))
    }
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_carried_scalars_give_the_flat_all_reduces_results_with_one_collective_fewer(reports, dtype):
    for rank, rep in enumerate(reports):
        case = rep[dtype]["bucketed"]
        assert case["carrier"] and case["buckets"] >= 2
        bucketed, flat = case["steps"], rep[dtype]["flat"]["steps"]
        assert len(bucketed) == len(flat) == STEPS
        # the first step finds no room and sends the scalars on their own; the carrier grows
        assert bucketed[0]["carried"] == 0 and all(s["carried"] > 0 for s in bucketed[1:])
        for k, (b, f) in enumerate(zip(bucketed, flat)):
            tol = 1e-6 if dtype == "float32" else 1e-12
            assert b["loss"] == pytest.approx(f["loss"], rel=tol, abs=tol), (rank, k)
            assert b["num_micro_batches"] == f["num_micro_batches"] == [1, 2, 0]
            assert b["extra"] == [float(2**30 + 7 * k + r) for r in range(WORLD)]  # exact in float32 too
            assert b["grads"][-2:] == [None, None]  # the parameter no rank used keeps grad=None
            for gb, gf in zip(b["grads"][:-2], f["grads"][:-2]):
                assert max(abs(x - y) for x, y in zip(gb, gf)) <= tol
            # one all-reduce per bucket, and for the first step one more for the scalars
            assert b["all_reduce"] == case["buckets"] + (1 if k == 0 else 0), (rank, k, b["all_reduce"])
        # the loss is one number on every rank
        assert {s["loss"] for s in bucketed} == {s["loss"] for s in reports[0][dtype]["bucketed"]["steps"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_non_finite_loss_in_a_carried_step_fails_every_rank_naming_its_rank(reports, dtype):
    for rep in reports:
        bad = rep[dtype]["bad"]
        assert len(bad["steps"]) == 2 and bad["error"]["step"] == 2
        assert bad["error"]["carried"] > 0  # the failing step carried its scalars
        assert "loss on rank(s) [1]" in bad["error"]["text"]
