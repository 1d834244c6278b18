"""The bucketed gradient sync per pipeline stage on gloo, float64, against one process: (pipeline=2, data_parallel=2).

One start of 4 ranks.  Each rank holds one stage (:class:`LlamaStage` of a 3-block tiny Llama with
untied embeddings) and sums its gradients over the stage's data-parallel group with a
:class:`BucketedGradSync` (small buckets, so there are several), through ``run_pipeline_step(...,
grad_sync=...)``.  Four hand plans: pipeline 0 with three micro-batches and pipeline 1 with one
(``ScheduleGPipe``); pipeline 1 with none; two ring items across both pipelines last on both
(their backward exchanges K/V, so the buckets wait for the schedule's end); and the ring items
followed by a local micro-batch on one pipeline.

After every step the gradients equal the reference's (1e-10) and the loss too, on every rank;
a stage whose last micro-batch is local issues some of its bucket all-reduces inside that
backward (the autograd engine is running), one whose last micro-batch is a ring item or that has
none issues them all outside any backward; the two ranks of a stage's data-parallel group issue
the same all-reduces in the same order (one per bucket, then the scalars), none of them as large
as the stage's gradients.
"""

from __future__ import annotations

import _parallel as helpers
import pytest
import torch
import torch.distributed as dist
from _ranks import gather_reports, init_gloo, save_report

from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CAPACITY = 24
TOLERANCE = 1e-10
STAGES = 2
BUCKET_BYTES = 20_000  # float64: 2500 elements, so each stage's gradients fill several buckets
LOCAL_LAST, IDLE, RING_LAST, LOCAL_AFTER_RING = range(4)


def _seqs(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    lengths = {RING_LAST: (30, 30), LOCAL_AFTER_RING: (30, 30, 10)}.get(step, (9, 11, 7, 12, 8))
    return [torch.randint(0, helpers.VOCAB, (n,), generator=g) for n in lengths]


def _ring(lengths: list[int], item: int, member: int) -> MicroBatch:
    from lightning_bytescale.planner import zigzag

    ranges = tuple(zigzag.member_ranges(lengths[item], 2, member))
    return MicroBatch([Piece(item, ranges)], ring=(0, 1), item=item)


def _plan(step: int, lengths: list[int]) -> Plan:
    def local(*seqs: int) -> list[MicroBatch]:
        return [MicroBatch([Piece(j, ((0, lengths[j]),))]) for j in seqs]

    if step == LOCAL_LAST:  # three micro-batches against one
        ranks = [local(0, 1, 2), [MicroBatch([Piece(3, ((0, lengths[3]),)), Piece(4, ((0, lengths[4]),))])]]
    elif step == IDLE:  # pipeline 1 runs nothing
        ranks = [local(0, 1, 2, 3, 4), []]
    elif step == RING_LAST:  # the two ring items alone (a pipeline's local micro-batches go after its rings)
        ranks = [[_ring(lengths, 0, 0), _ring(lengths, 1, 0)], [_ring(lengths, 0, 1), _ring(lengths, 1, 1)]]
    else:  # the ring items, then a short sequence on pipeline 1
        ranks = [
            [_ring(lengths, 0, 0), _ring(lengths, 1, 0)],
            [_ring(lengths, 0, 1), _ring(lengths, 1, 1), *local(2)],
        ]
    plan = Plan(2, CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": STAGES})
    return plan.validate()


class BucketLog:
    """The stage's gradient collectives on its data-parallel group: ``(name, elements, inside a backward)``."""

    def __init__(self, dp_ranks: list[int]) -> None:
        self.dp_ranks = dp_ranks
        self.events: list[list] = []
        for name in ("all_reduce", "reduce"):
            original = getattr(dist, name)

            def wrapped(tensor, *args, __name=name, __original=original, **kwargs):
                group = kwargs.get("group")
                if group is not None and dist.get_process_group_ranks(group) == self.dp_ranks:
                    inside = (
                        torch._C._current_graph_task_id() != -1
                    )  # the autograd engine is running a backward
                    self.events.append([__name, tensor.numel(), inside])
                return __original(tensor, *args, **kwargs)

            setattr(dist, name, wrapped)


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine.grad_sync import BucketedGradSync
    from lightning_bytescale.models import LlamaConfig
    from lightning_bytescale.parallel import LlamaStage, ParallelDims, run_pipeline_step

    torch.set_num_threads(1)
    init_gloo(rank, 4, port)
    pmesh = ParallelDims(4, pipeline=STAGES).build("cpu")
    ref, model = helpers.reference_and_model(LlamaConfig.preset("tiny", layers=3, tie_embeddings=False))
    stage = LlamaStage(model, pmesh.stage, STAGES)
    params = [p for p in stage.parameters() if p.requires_grad]
    sync = BucketedGradSync(params, group=pmesh.dp_group, bucket_bytes=BUCKET_BYTES)
    log = BucketLog(dist.get_process_group_ranks(pmesh.dp_group))
    report: dict = {
        "coords": [pmesh.stage, pmesh.hdp_rank],
        "buckets": [b.numel for b in sync.buckets],
        "gradient_elements": sum(p.numel() for p in params),
        "steps": [],
    }
    for s in range(4):
        seqs = _seqs(s)
        loss_ref, _, grads_ref = helpers.reference_step(
            ref, torch.optim.SGD(ref.parameters(), lr=0.0), seqs, 1e9
        )
        batch = helpers.pipeline_batch(_plan(s, [len(x) for x in seqs]), pmesh, seqs, s)
        mbs = batch.micro_batches
        log.events = []
        for p in params:
            p.grad = None
        result = run_pipeline_step(stage, batch, pmesh, grad_sync=sync)
        report["steps"].append(
            {
                "last": "none" if not mbs else ("ring" if mbs[-1].layout.ring is not None else "local"),
                "grad_diff": helpers.grad_diff(stage, grads_ref),
                "loss_diff": abs(result.loss - loss_ref),
                "events": log.events,
            }
        )
    sync.close()
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("pp_buckets"), _worker, 4, timeout_s=220)


def test_bucketed_stage_sync_equals_one_process(reports):
    for rep in reports:
        for s, step in enumerate(rep["steps"]):
            assert step["grad_diff"] <= TOLERANCE, (rep["coords"], s, step["grad_diff"])
            assert step["loss_diff"] <= 1e-12, (rep["coords"], s, step["loss_diff"])


def test_the_plans_cover_a_local_last_a_ring_last_and_an_idle_pipeline(reports):
    lasts = {
        (tuple(rep["coords"]), s): step["last"] for rep in reports for s, step in enumerate(rep["steps"])
    }
    assert lasts[((0, 1), IDLE)] == "none"
    assert lasts[((0, 0), RING_LAST)] == lasts[((0, 1), RING_LAST)] == "ring"
    assert lasts[((0, 1), LOCAL_AFTER_RING)] == "local" and lasts[((0, 0), LOCAL_AFTER_RING)] == "ring"
    assert len(reports[0]["buckets"]) > 1 and len(reports[2]["buckets"]) > 1


def test_a_stage_launches_buckets_inside_its_last_backward_only_when_it_is_local(reports):
    for rep in reports:
        for s, step in enumerate(rep["steps"]):
            buckets = step["events"][:-1]  # the scalars last
            inside = [e[2] for e in buckets]
            if step["last"] == "local":
                assert any(inside), (rep["coords"], s, step["events"])
            else:  # after a ring's backward or without micro-batches: after the schedule
                assert not any(inside), (rep["coords"], s, step["events"])
            assert not step["events"][-1][2]


def test_the_ranks_of_a_stage_issue_the_same_bucket_collectives(reports):
    by_stage: dict[int, list[dict]] = {}
    for rep in reports:
        by_stage.setdefault(rep["coords"][0], []).append(rep)
    for stage, reps in by_stage.items():
        assert len(reps) == 2
        for s in range(4):
            a, b = ([e[:2] for e in rep["steps"][s]["events"]] for rep in reps)
            assert a == b, (stage, s, a, b)
            assert [n for _, n in a[:-1]] == reps[0]["buckets"]
            assert max(n for _, n in a) < reps[0]["gradient_elements"]
