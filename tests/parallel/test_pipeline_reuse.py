"""The pipeline step's stages: their lifetime, their reuse between steps, their receive buffers, autocast.

One start of 2 gloo ranks, ``(pipeline=2, data_parallel=1)``, a 3-block tiny Llama (two blocks on
stage 0, one on stage 1), hand plans of one pipeline whose micro-batch counts repeat:

* **Lifetime.** With the garbage collector off, no step's ``PipelineStage`` or schedule outlives
  the step without a cache (``run_pipeline_step(..., schedules=None)``), and a stage the cache drops
  is gone at once: nothing keeps a reference cycle around a stage.
* **Reuse.** With a :class:`StageSchedules`, a step whose count repeats runs the very stage and
  schedule of the earlier step (identity); without ``max_micro_batches`` the cache holds only the
  step's own count, with it any counts up to that many micro-batches in all.  Every step, reused
  or not, equals one process in float64 (gradients and parameters to 1e-10, the loss to 1e-12):
  the loss of a reused schedule divides by *this* step's global token count.
* **Receive buffers.** The buffers torch's stage holds after a step's backward (counted from the
  stage's receive infos, gradients included, distinct storages) are
  ``receive_buffer_slots(stage, 2) * n * C * dim`` elements: one ``[1, C, dim]`` per micro-batch
  on each stage (stage 0 the output gradient, stage 1 the activation, whose gradient torch
  released once it was sent).
* **Autocast.** ``compute_context=torch.autocast("cpu", bfloat16)`` on a float32 stage: the head's
  logits come out in bfloat16 (torch 2.11 checks them against the declared dtype), the hidden
  state between the stages in float32, the backward outside autocast, the loss finite.
"""

from __future__ import annotations

import functools
import gc
import weakref

import _parallel as helpers
import pytest
import torch
import torch.distributed as dist
from _ranks import gather_reports, init_gloo, save_report

from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]

CAPACITY = 24
LR = 1e-2
TOLERANCE = 1e-10
STAGES = 2
# per step: the lengths of the pipeline's sequences, each alone in a micro-batch (so the counts
# are 3, 3, 2, 3, 4) and different token counts in the steps that repeat a count
LENGTHS = [(20, 18, 21), (15, 22, 19), (17, 23), (9, 12, 24), (20, 20, 11, 14)]
COUNTS = [len(x) for x in LENGTHS]


def _plan(lengths: tuple[int, ...]) -> Plan:
    """One pipeline, each sequence alone in a micro-batch."""
    ranks = [[MicroBatch([Piece(j, ((0, n),))]) for j, n in enumerate(lengths)]]
    plan = Plan(1, CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": STAGES})
    plan.validate()
    return plan


def _seqs(k: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + k)
    return [torch.randint(0, helpers.VOCAB, (s,), generator=g) for s in LENGTHS[k]]


def _config():
    from lightning_bytescale.models import LlamaConfig

    return LlamaConfig.preset("tiny", layers=3, tie_embeddings=False)


def _lifetime(pmesh) -> dict:
    """Without a cache: is any step's stage or schedule alive after the step (the collector off)?"""
    from lightning_bytescale.parallel import LlamaStage, run_pipeline_step

    _, model = helpers.reference_and_model(_config())
    stage = LlamaStage(model, pmesh.stage, STAGES)
    refs: list[weakref.ref] = []

    def keep(schedule) -> None:
        refs.extend([weakref.ref(schedule), weakref.ref(schedule._stage)])

    alive = []
    for k in range(len(LENGTHS)):
        seqs = _seqs(k)
        batch = helpers.pipeline_batch(_plan(LENGTHS[k]), pmesh, seqs, k)
        stage.zero_grad(set_to_none=True)
        run_pipeline_step(stage, batch, pmesh, on_schedule=keep)
        alive.append(sum(r() is not None for r in refs))
    return {"alive": alive, "tracked": len(refs)}


def _reuse(pmesh, limit: int | None) -> dict:
    """With a cache: which steps reused which stage, dropped stages' lifetime, exactness against one process."""
    from lightning_bytescale.parallel import LlamaStage, StageSchedules, run_pipeline_step

    ref, model = helpers.reference_and_model(_config())
    stage = LlamaStage(model, pmesh.stage, STAGES)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    schedules = StageSchedules(stage, pmesh, max_micro_batches=limit)
    seen: list = []
    out: dict = {"grad_diff": [], "param_diff": [], "loss_diff": [], "held": []}
    for k in range(len(LENGTHS)):
        seqs = _seqs(k)
        loss_ref, _, grads_ref = helpers.reference_step(ref, opt_ref, seqs, float("inf"))
        batch = helpers.pipeline_batch(_plan(LENGTHS[k]), pmesh, seqs, k)
        opt.zero_grad(set_to_none=True)
        result = run_pipeline_step(stage, batch, pmesh, schedules=schedules, on_schedule=seen.append)
        out["grad_diff"].append(helpers.grad_diff(stage, grads_ref))
        opt.step()
        out["param_diff"].append(helpers.param_diff(stage, ref))
        out["loss_diff"].append(abs(result.loss - loss_ref))
        out["held"].append(schedules.held_micro_batches)
    # step j ran the schedule of the first step i <= j with the same object
    out["first_use"] = [next(i for i in range(j + 1) if seen[i] is seen[j]) for j in range(len(seen))]
    out["built"] = schedules.built
    stages = [weakref.ref(s._stage) for s in seen]
    seen.clear()
    out["alive_while_cached"] = [r() is not None for r in stages]
    schedules.clear()
    out["alive_after_clear"] = sum(r() is not None for r in stages)
    return out


def _buffers(pmesh) -> dict:
    """The receive buffers torch's stage holds after a step's backward, against the count by hand."""
    from lightning_bytescale.parallel import LlamaStage, build_schedule

    _, model = helpers.reference_and_model(_config())
    stage = LlamaStage(model, pmesh.stage, STAGES)
    k = 4
    seqs = _seqs(k)
    batch = helpers.pipeline_batch(_plan(LENGTHS[k]), pmesh, seqs, k)
    schedule = build_schedule(stage, batch, pmesh)
    schedule._stage.scope.num_global_tokens = batch.step.num_global_tokens
    mbs = batch.micro_batches
    stage.bind(mbs)
    inputs = (torch.stack([mb.input_ids for mb in mbs]),) if stage.is_first else ()
    target = torch.stack([mb.labels for mb in mbs]) if stage.is_last else None
    schedule.step(*inputs, target=target, losses=[], return_outputs=False, slot=torch.arange(len(mbs)))
    tensors = {}
    torch_stage = schedule._stage
    for infos in (*torch_stage.args_recv_info.values(), *torch_stage.grad_recv_info.values()):
        for info in infos:
            for t in (getattr(info, "buffer", None), getattr(getattr(info, "buffer", None), "grad", None)):
                if isinstance(t, torch.Tensor):
                    tensors[t.untyped_storage().data_ptr()] = t
    return {
        "elements": sum(t.numel() for t in tensors.values()),
        "shapes": sorted({tuple(t.shape) for t in tensors.values()}),
        "micro_batches": len(mbs),
        "dim": stage.hidden_size,
    }


def _autocast(pmesh) -> dict:
    """A float32 stage under bfloat16 autocast: the dtypes of the hidden state and the logits."""
    from lightning_bytescale.parallel import LlamaStage, StageSchedules, run_pipeline_step

    torch.manual_seed(0)
    from lightning_bytescale.models import LlamaModel

    stage = LlamaStage(LlamaModel(_config()), pmesh.stage, STAGES)  # float32
    dtypes: dict[str, list] = {"out": [], "head": [], "backward_autocast": []}
    stage.register_forward_hook(lambda m, a, out: dtypes["out"].append(str(out.dtype)))
    if stage.is_last:
        stage.part("head").register_forward_hook(lambda m, a, out: dtypes["head"].append(str(out.dtype)))
    probe = next(iter(stage.part("blocks").parameters()))  # its gradient hook runs inside the backward
    probe.register_hook(lambda g: dtypes["backward_autocast"].append(torch.is_autocast_enabled("cpu")))
    schedules = StageSchedules(stage, pmesh)
    context = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    losses = []
    for k in (0, 1):
        seqs = _seqs(k)
        batch = helpers.pipeline_batch(_plan(LENGTHS[k]), pmesh, seqs, k)
        stage.zero_grad(set_to_none=True)
        result = run_pipeline_step(stage, batch, pmesh, schedules=schedules, compute_context=context)
        losses.append(result.loss)
    grads = [p.grad for p in stage.parameters()]
    return {
        **dtypes,
        "losses": losses,
        "grads_finite": all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        "grad_dtypes": sorted({str(g.dtype) for g in grads if g is not None}),
    }


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Both ranks' reports of the one run (every check below reads them)."""
    return gather_reports(tmp_path_factory.mktemp("pp_reuse"), _worker, STAGES, timeout_s=180)


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.parallel import ParallelDims

    torch.set_num_threads(1)
    init_gloo(rank, STAGES, port)
    pmesh = ParallelDims(STAGES, pipeline=STAGES).build("cpu")
    gc.collect()
    gc.disable()  # a reference cycle would keep a stage alive until the next collection
    try:
        report = {
            "stage": pmesh.stage,
            "lifetime": _lifetime(pmesh),
            "reuse": _reuse(pmesh, None),
            "reuse_limited": _reuse(pmesh, 5),
        }
    finally:
        gc.enable()
    report["buffers"] = _buffers(pmesh)
    try:
        report["autocast"] = _autocast(pmesh)
    except Exception as err:  # reported, so the test names it (torch 2.11 checks the logits' dtype)
        report["autocast"] = {"error": repr(err)}
    save_report(outdir, rank, report)
    dist.destroy_process_group()


def test_no_stage_outlives_its_step(reports):
    for rep in reports:
        life = rep["lifetime"]
        assert life["tracked"] == 2 * len(LENGTHS)
        assert life["alive"] == [0] * len(LENGTHS), life  # after every step, with the collector off


def test_a_repeated_count_reuses_the_stage_and_schedule(reports):
    for rep in reports:
        plain, limited = rep["reuse"], rep["reuse_limited"]
        # counts 3, 3, 2, 3, 4: without a limit only the step's own count stays cached
        assert plain["first_use"] == [0, 0, 2, 3, 4] and plain["built"] == 4
        assert plain["held"] == COUNTS
        # with max_micro_batches=5: 3 and 2 fit together, so step 3 runs step 0's schedule again
        assert limited["first_use"] == [0, 0, 2, 0, 4] and limited["built"] == 3
        assert limited["held"] == [3, 3, 5, 5, 4]
        assert max(limited["held"]) <= 5
        for run in (plain, limited):
            assert run["alive_while_cached"][-1] and run["alive_after_clear"] == 0
        assert plain["alive_while_cached"][:4] == [False] * 4  # dropped stages are gone at once


def test_reused_schedules_equal_one_process(reports):
    for rep in reports:
        for run in (rep["reuse"], rep["reuse_limited"]):
            assert max(run["grad_diff"]) <= TOLERANCE, run["grad_diff"]
            assert max(run["param_diff"]) <= TOLERANCE, run["param_diff"]
            assert max(run["loss_diff"]) <= 1e-12, run["loss_diff"]


def test_the_receive_buffers_are_counted_by_hand(reports):
    from lightning_bytescale.planner.pipeline import receive_buffer_bytes, receive_buffer_slots

    by_stage = {rep["stage"]: rep["buffers"] for rep in reports}
    n, dim = by_stage[0]["micro_batches"], by_stage[0]["dim"]
    assert n == COUNTS[4]
    # stage 0: the output gradient it receives per micro-batch; stage 1: the activation (whose
    # gradient was released once sent)
    assert by_stage[0]["elements"] == n * CAPACITY * dim
    assert by_stage[1]["elements"] == n * CAPACITY * dim
    for stage, buffers in by_stage.items():
        assert buffers["shapes"] == [[1, CAPACITY, dim]]
        assert buffers["elements"] == receive_buffer_slots(stage, STAGES) * n * CAPACITY * dim
    assert receive_buffer_bytes(n, CAPACITY, dim * 8, STAGES) == 8 * max(
        b["elements"] for b in by_stage.values()
    )


def test_autocast_gives_bfloat16_logits_and_float32_hidden_states(reports):
    by_stage = {rep["stage"]: rep["autocast"] for rep in reports}
    assert not any("error" in r for r in by_stage.values()), by_stage
    first, last = by_stage[0], by_stage[1]
    assert set(first["out"]) == {"torch.float32"}  # the hidden state between the stages
    assert set(last["head"]) == set(last["out"]) == {"torch.bfloat16"}
    assert len(last["head"]) == COUNTS[0] + COUNTS[1]
    for rep in (first, last):
        assert rep["backward_autocast"] and not any(rep["backward_autocast"])  # backwards outside autocast
        assert rep["grads_finite"] and rep["grad_dtypes"] == ["torch.float32"]
        assert all(0 < loss < 10 for loss in rep["losses"])
