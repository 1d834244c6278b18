"""Pipelines as HDP ranks on gloo, float64, against one process: (pipeline=2, data_parallel=2) and (2, 1).

One start of 4 ranks (the ``(2, 2)`` mesh) and one of 2 (``(2, 1)``).  The reference is an
independent single process: the same initial weights (a 3-block Llama with untied embeddings, so
the two stages hold two blocks and one), each whole sequence alone, plain causal attention, AdamW.

Each rank holds one stage (:class:`LlamaStage`) and steps its own AdamW; after every step its
gradients (before the step) and parameters (after it) are compared by name with the reference's,
and the step's loss with the reference's on every rank, the first stages included.  The plans are
the balance planner's PP-Balance plans (``pipeline_degree=2``: different micro-batch counts per
pipeline) and hand plans: on ``(2, 2)`` one pipeline with three micro-batches and the other with one
(fewer than its stages: ``ScheduleGPipe``), and one pipeline with none; on ``(2, 1)`` a step of one
micro-batch.  On ``(2, 2)`` three of the first five steps hold two sequences longer than C, which the
planner shards as ring items over both pipelines: at every stage the ring runs between that stage
of the two pipelines, on the global group, at the same micro-batch index on both (plans with rings
run ``Schedule1F1B`` on every pipeline); the sixth step is docs/pipelines.md's example of two
ring items that 1F1B, as placed, would deadlock on, the second one a Ulysses item (its all-to-all
follows the rings' order rule: the same item order, the same index on every member).  A second run pads every pipeline to five micro-batches
with padding micro-batches (``min_micro_batches=5``: always ``Schedule1F1B``, rings included),
which must change nothing.  Stage-to-stage transfers go only to the rank's own pipeline, and no process group is
created after set-up.

On ``(2, 3)`` (6 ranks) a hand plan has three ring items (the middle one a Ulysses item), each over
another pair of the three pipelines, so the index rule leaves a gap in one pipeline, filled with a
padding micro-batch: two steps must equal one process there too.
"""

from __future__ import annotations

import _parallel as helpers
import pytest
import torch
import torch.distributed as dist
from _ranks import gather_reports, init_gloo, save_report

from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(280)]

CAPACITY = 24
LR = 1e-2
TOLERANCE = 1e-10
STEPS = 6
PADDED_STEPS = 3
STAGES = 2
PAD_TO = 5  # the padded run: every pipeline padded to 5 micro-batches (more than most have)
# on (2, 2): steps 2 and 3 are hand plans without rings, 5 the example of docs/pipelines.md
RING_STEPS = (0, 1, 4, 5)
TP_STEPS = 6  # (2, 2, 2): the (2, 2) plans and data, rings included, with a TP group of two per stage
TRIANGLE_STEPS = 2  # on (2, 3): three ring items, each over another pair of the three pipelines


def _models():
    from lightning_bytescale.models import LlamaConfig

    return helpers.reference_and_model(LlamaConfig.preset("tiny", layers=3, tie_embeddings=False))


def _batch(step: int, pipelines: int) -> list[torch.Tensor]:
    if pipelines == 3 or (pipelines == 2 and step == 5):  # sequences longer than C (rings) and a short one
        g = torch.Generator().manual_seed(2000 + step)
        return [torch.randint(0, 64, (s,), generator=g) for s in (30, 30, 30, 10)[3 - pipelines :]]
    if pipelines == 1 and step == 2:  # two short sequences: one micro-batch, fewer than the stages
        return helpers.global_batch(step, (2, 10), 2)
    if pipelines == 2 and step in RING_STEPS:  # two sequences longer than C: rings across the pipelines
        return helpers.global_batch(step, (2, 20), 6, long=(31 + step % 3, 45))
    return helpers.global_batch(step, (2, CAPACITY), 4 * pipelines + 2)


def _greedy(seqs: list[int], lengths: list[int]) -> list[MicroBatch]:
    return helpers.greedy_micro_batches(seqs, lengths, CAPACITY)


def _hand_plan(lengths: list[int], split: int) -> Plan:
    """Pipeline 0 holds sequences ``[0, split)``, pipeline 1 the rest."""
    ranks = [_greedy(list(range(split)), lengths), _greedy(list(range(split, len(lengths))), lengths)]
    plan = Plan(2, CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": STAGES})
    plan.validate()
    return plan


def _triangle_plan(lengths: list[int]) -> Plan:
    """Ring items 0, 1, 2 on pipelines {0, 1}, {1, 2}, {2, 0}; pipeline 2 also holds the short sequence.

    The index rule puts them at indices 0, 1 and 2: pipeline 0 runs item 0, a padding
    micro-batch, item 2; pipeline 1 items 0 and 1; pipeline 2 its local micro-batch, items 1 and 2.
    """
    from lightning_bytescale.planner import zigzag

    ranks: list[list[MicroBatch]] = [[], [], []]
    for item, ring in enumerate([(0, 1), (1, 2), (2, 0)]):
        for member, r in enumerate(ring):
            ranges = tuple(zigzag.member_ranges(lengths[item], 2, member))
            mode = "ulysses" if item == 1 else "ring"
            ranks[r].append(MicroBatch([Piece(item, ranges)], ring=ring, item=item, mode=mode))
    ranks[2].insert(0, MicroBatch([Piece(3, ((0, lengths[3]),))]))
    ranks[0].sort(key=lambda mb: mb.item)  # every pipeline runs its ring items in item order
    plan = Plan(3, CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": STAGES})
    plan.validate()
    return plan


def _crossed_plan(lengths: list[int]) -> Plan:
    """docs/pipelines.md's example: ring items 0 and 1 on both pipelines, pipeline 0 a local micro-batch between them.

    As placed, 1F1B's stage 0 runs ``F 0, F local, B 0, F 1`` on pipeline 0 and ``F 0, F 1, B 0``
    on pipeline 1 and would hang; the index rule moves item 1 to index 1 on pipeline 0 too.  Item 1
    is a Ulysses item: its exchanges take the rings' place in that order.
    """
    from lightning_bytescale.planner import zigzag

    ranks: list[list[MicroBatch]] = [[], []]
    for item in (0, 1):
        for member in (0, 1):
            ranges = tuple(zigzag.member_ranges(lengths[item], 2, member))
            mode = "ulysses" if item == 1 else "ring"
            ranks[member].append(MicroBatch([Piece(item, ranges)], ring=(0, 1), item=item, mode=mode))
    ranks[0].insert(1, MicroBatch([Piece(2, ((0, lengths[2]),))]))
    plan = Plan(2, CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": STAGES})
    plan.validate()
    return plan


def _plan(step: int, seqs: list[torch.Tensor], pipelines: int) -> Plan:
    from lightning_bytescale.planner import make_plan

    lengths = [len(s) for s in seqs]
    if pipelines == 3:
        return _triangle_plan(lengths)
    if pipelines == 2 and step == 2:
        return _hand_plan(lengths, len(lengths) - 1)  # several micro-batches against one
    if pipelines == 2 and step == 3:
        return _hand_plan(lengths, len(lengths))  # pipeline 1 runs nothing
    if pipelines == 2 and step == 5:
        return _crossed_plan(lengths)
    return make_plan(
        lengths, world_size=pipelines, capacity=CAPACITY, planner="balance", pipeline_degree=STAGES, seed=step
    )


def _train(pmesh, log: helpers.CallLog, *, steps: int, min_micro_batches: int) -> dict:
    from lightning_bytescale.parallel import LlamaStage, parallelize_llama

    ref, model = _models()
    parallelize_llama(model, pmesh.tp_mesh)  # one lane: unchanged
    stage = LlamaStage(model, pmesh.stage, pmesh.dims.pipeline)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    pipelines = pmesh.dims.data_parallel
    keys = (
        "grad_diff",
        "param_diff",
        "loss_diff",
        "counts",
        "schedules",
        "padding",
        "peers",
        "rings",
        "modes",
        "params",
    )
    out: dict = {k: [] for k in keys}
    for s in range(steps):
        seqs = _batch(s, pipelines)
        loss_ref, _, grads_ref = helpers.reference_step(ref, opt_ref, seqs, float("inf"))  # no clipping
        batch = helpers.pipeline_batch(_plan(s, seqs, pipelines), pmesh, seqs, s, min_micro_batches)
        log.mark(f"step{s}")
        helpers.pipeline_step_against(stage, opt, batch, pmesh, ref, grads_ref, loss_ref, out)
        events = log.since(f"step{s}")
        p2p = [(list(ranks), list(ps)) for name, ranks, ps in events if name == "batch_isend_irecv"]
        out["peers"].append(p2p)
    out["params"] = sorted(n for n, _ in stage.named_parameters())
    out["sharded"] = sum(type(p).__name__ == "DTensor" for p in stage.parameters())
    return out


def _worker(rank: int, port: int, outdir: str, world: int, tp: int = 1) -> None:
    from lightning_bytescale.parallel import ParallelDims

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    dims = ParallelDims(world, tensor_parallel=tp, pipeline=STAGES)
    pmesh = dims.build("cpu")
    log = helpers.CallLog()
    pg_setup = helpers.process_groups()
    report: dict = {
        "coords": [pmesh.stage, pmesh.hdp_rank, pmesh.lane],
        "dp_group": dist.get_process_group_ranks(pmesh.dp_group),
        "pp_group": dist.get_process_group_ranks(pmesh.pp_group),
        "pipeline_ranks": list(dims.pipeline_ranks(pmesh.hdp_rank)),
    }
    if dims.data_parallel == 3:
        report["train"] = _train(pmesh, log, steps=TRIANGLE_STEPS, min_micro_batches=0)
    elif tp > 1:
        report["train"] = _train(pmesh, log, steps=TP_STEPS, min_micro_batches=0)
    else:
        report["train"] = _train(pmesh, log, steps=STEPS, min_micro_batches=0)
        report["padded"] = _train(pmesh, log, steps=PADDED_STEPS, min_micro_batches=PAD_TO)
    report.update(pg_setup=pg_setup, pg_end=helpers.process_groups(), group_calls=log.groups_created())
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports_2x2(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("pp2x2"), _worker, 4, 4, timeout_s=260)


@pytest.fixture(scope="module")
def reports_2x3(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("pp2x3"), _worker, 6, 6, timeout_s=260)


@pytest.fixture(scope="module")
def reports_2x2x2(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("pp2x2x2"), _worker, 8, 8, 2, timeout_s=270)


@pytest.fixture(scope="module")
def reports_2x1(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("pp2x1"), _worker, 2, 2, timeout_s=200)


def _check_exact(train: dict, steps: int) -> None:
    assert len(train["param_diff"]) == steps
    assert max(train["grad_diff"]) <= TOLERANCE, train["grad_diff"]
    assert max(train["param_diff"]) <= TOLERANCE, train["param_diff"]
    assert max(train["loss_diff"]) <= 1e-12, train["loss_diff"]


def test_stage_is_outermost_and_groups_are_a_stage_and_a_pipeline(reports_2x2):
    # global rank g is stage g // 2, pipeline (HDP rank) g % 2
    assert [r["coords"] for r in reports_2x2] == [[0, 0, 0], [0, 1, 0], [1, 0, 0], [1, 1, 0]]
    for g, rep in enumerate(reports_2x2):
        assert rep["dp_group"] == [2 * (g // 2), 2 * (g // 2) + 1]  # stage g // 2 of both pipelines
        assert rep["pp_group"] == rep["pipeline_ranks"] == [g % 2, g % 2 + 2]  # both stages of pipeline g % 2


def test_stages_split_the_model_and_hold_its_parameter_names(reports_2x2):
    first, last = reports_2x2[0]["train"]["params"], reports_2x2[2]["train"]["params"]
    assert not set(first) & set(last)
    assert any(n.startswith("embed.") for n in first) and any(n.startswith("blocks.1.") for n in first)
    assert any(n.startswith("lm_head.") for n in last) and any(n.startswith("blocks.2.") for n in last)


def test_2x2_adamw_steps_with_different_micro_batch_counts_per_pipeline_equal_one_process(reports_2x2):
    for rep in reports_2x2:
        train = rep["train"]
        _check_exact(train, STEPS)
        assert any(len(set(c)) > 1 for c in train["counts"]), train["counts"]
        assert train["counts"][2][1] == 1 < train["counts"][2][0], train["counts"]  # one against several
        assert train["counts"][3][1] == 0, train["counts"]
        assert train["modes"][5] == ["ring", "ulysses"], train["modes"]  # the crossed plan's two items
    # the pipeline with one micro-batch ran GPipe, the one without any no schedule, the others 1F1B
    pipe1 = reports_2x2[1]["train"]
    assert pipe1["schedules"][2] == "ScheduleGPipe" and pipe1["schedules"][3] is None
    assert reports_2x2[0]["train"]["schedules"][2] == "Schedule1F1B"


def test_2x2_padding_micro_batches_change_nothing(reports_2x2):
    for rep in reports_2x2:
        padded = rep["padded"]
        _check_exact(padded, PADDED_STEPS)
        assert set(padded["schedules"]) == {"Schedule1F1B"}
    for rep in reports_2x2:  # padding micro-batches in steps with rings too
        padded = rep["padded"]
        assert all(c == [PAD_TO, PAD_TO] for c in padded["counts"]), padded["counts"]
        assert padded["rings"][0] > 0 and padded["padding"][0] > 0, padded


def test_2x1_adamw_steps_equal_one_process(reports_2x1):
    for rep in reports_2x1:
        for run, steps in (("train", STEPS), ("padded", PADDED_STEPS)):
            _check_exact(rep[run], steps)
        assert rep["train"]["schedules"][2] == "ScheduleGPipe", rep["train"]["counts"]
        assert rep["padded"]["schedules"][2] == "Schedule1F1B" and rep["padded"]["padding"][2] == PAD_TO - 1


def test_stage_transfers_stay_in_the_pipeline_and_rings_join_one_stage_on_the_global_group(reports_2x2):
    for g, rep in enumerate(reports_2x2):
        other_stage, other_pipeline = (g + 2) % 4, g ^ 1  # the same pipeline's other stage; this stage's
        for run in ("train", "padded"):
            groups: dict[tuple[int, ...], set[int]] = {}
            for step in rep[run]["peers"]:
                for ranks, peers in step:
                    groups.setdefault(tuple(ranks), set()).update(peers)
            assert groups.pop(tuple(rep["pp_group"])) == {other_stage}, (g, run)
            assert groups == {(0, 1, 2, 3): {other_pipeline}}, (g, run, groups)  # ring K/V: global group
            assert [r > 0 for r in rep[run]["rings"]] == [
                s in RING_STEPS for s in range(len(rep[run]["rings"]))
            ]


def test_no_process_group_is_created_after_set_up(reports_2x2, reports_2x1, reports_2x3):
    for rep in reports_2x2 + reports_2x1 + reports_2x3:
        assert rep["pg_setup"] == rep["pg_end"]
        assert rep["group_calls"] == 0


def test_2x3_rings_over_three_pairs_of_pipelines_with_an_index_gap_equal_one_process(reports_2x3):
    for g, rep in enumerate(reports_2x3):
        train = rep["train"]
        _check_exact(train, TRIANGLE_STEPS)
        pipeline = g % 3
        assert train["counts"] == [[3, 2, 3]] * TRIANGLE_STEPS, train["counts"]
        assert train["padding"] == [1 if pipeline == 0 else 0] * TRIANGLE_STEPS  # the gap at index 1
        assert train["rings"] == [2] * TRIANGLE_STEPS
        assert all(modes == ["ring", "ulysses"] for modes in train["modes"]) == (pipeline != 0), train[
            "modes"
        ]
        stage_ranks = {3 * (g // 3) + h for h in range(3)}  # this stage of the three pipelines
        ring_peers = {p for step in train["peers"] for ranks, peers in step if len(ranks) == 6 for p in peers}
        assert ring_peers == stage_ranks - {g}, (g, ring_peers)


def test_2x2x2_tensor_parallel_stages_equal_one_process(reports_2x2x2):
    # global rank g: stage g // 4, pipeline (g // 2) % 2, lane g % 2
    assert [r["coords"] for r in reports_2x2x2] == [[g // 4, (g // 2) % 2, g % 2] for g in range(8)]
    for rep in reports_2x2x2:
        train = rep["train"]
        _check_exact(train, TP_STEPS)
        assert train["sharded"] >= 4, "the stage's projections are DTensor shards"
        assert [r > 0 for r in train["rings"]] == [s in RING_STEPS for s in range(TP_STEPS)]
        assert train["modes"][5] == ["ring", "ulysses"], train["modes"]  # Ulysses on the lane's heads
        assert rep["pg_setup"] == rep["pg_end"] and rep["group_calls"] == 0
