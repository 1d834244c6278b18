"""The simulated pipeline bubble of executed plans, and ``bytescale-sim --measured``, on hand-made plans.

Expected bubbles come from 1F1B arithmetic, not from the code: with P stages and m >= P
micro-batches of equal time t per stage for the forward and the backward together, a pipeline
runs ``(m + P - 1) t`` and works ``m t``, so its bubble is ``(P - 1) / (m + P - 1)``.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from lightning_bytescale.cli.sim import main
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan
from lightning_bytescale.sim.pipeline_bubble import pipeline_bubbles

CAPACITY = 100


def _local(seq: int, length: int) -> MicroBatch:
    return MicroBatch([Piece(seq, ((0, length),))])


def _plan(counts: list[int], stages: int, lengths_of=lambda r, i: 60) -> Plan:
    """Pipeline r holds ``counts[r]`` local micro-batches of one sequence each."""
    lengths: list[int] = []
    ranks: list[list[MicroBatch]] = []
    for r, m in enumerate(counts):
        ranks.append([])
        for i in range(m):
            ranks[r].append(_local(len(lengths), lengths_of(r, i)))
            lengths.append(lengths_of(r, i))
    plan = Plan(len(counts), CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": stages})
    return plan.validate()


def _uniform(p: int, m: int) -> float:
    return float(Fraction(p - 1, m + p - 1))


COST = CostModel(a=2e-6, b=1e-3, g=5e-3, num_layers=4)


@pytest.mark.parametrize(("stages", "counts"), [(2, [4, 3]), (3, [4, 5]), (4, [4, 8])])
def test_equal_micro_batches_give_the_1f1b_bubble(stages, counts):
    bubbles = pipeline_bubbles(_plan(counts, stages), COST)
    assert [b.micro_batches for b in bubbles] == counts
    for b, m in zip(bubbles, counts, strict=True):
        assert b.bubble == pytest.approx(_uniform(stages, m), rel=1e-12)
    # the step bubble also waits for the slowest pipeline: 1 - m / (max m + P - 1)
    slowest = max(counts) + stages - 1
    for b, m in zip(bubbles, counts, strict=True):
        assert b.step_bubble == pytest.approx(1 - m / slowest, rel=1e-12)


def test_padding_to_capacity_makes_every_micro_batch_cost_c_slots():
    # linear cost only: padded to C every micro-batch costs the same, whatever it holds
    linear = CostModel(a=0.0, b=1e-3, num_layers=2)
    plan = _plan([5, 4], 2, lambda r, i: [10, 90, 40, 70, 20][i])
    padded = pipeline_bubbles(plan, linear, pad_to_capacity=True)
    assert [b.bubble for b in padded] == pytest.approx([_uniform(2, 5), _uniform(2, 4)], rel=1e-12)
    assert padded[0].busy_s == pytest.approx(5 * 2 * 1e-3 * CAPACITY / 2)  # 5 x (2 layers x b x C) / 2 stages
    plain = pipeline_bubbles(plan, linear)  # the tokens alone: unequal micro-batches, another bubble
    assert plain[0].bubble != pytest.approx(_uniform(2, 5), rel=1e-3)
    assert plain[0].busy_s == pytest.approx(2 * 1e-3 * (10 + 90 + 40 + 70 + 20) / 2)


def test_a_ring_item_pads_every_pipeline_to_the_stages_as_the_executor_does():
    # pipeline 0: ring item + 3 locals, pipeline 1: the ring item alone -> one padding micro-batch
    lengths = (120, 50, 50, 50)
    ring = [MicroBatch([Piece(0, ((0, 30), (90, 120)))], ring=(0, 1), item=0)]
    ring.append(MicroBatch([Piece(0, ((30, 90),))], ring=(0, 1), item=0))
    ranks = [[ring[0], _local(1, 50), _local(2, 50), _local(3, 50)], [ring[1]]]
    plan = Plan(2, CAPACITY, "hand", lengths, ranks, {"pipeline_degree": 2}).validate()
    bubbles = pipeline_bubbles(plan, COST)
    assert [(b.micro_batches, b.padding) for b in bubbles] == [(4, 0), (2, 1)]
    assert [b.micro_batches for b in pipeline_bubbles(plan, COST, min_micro_batches=0)] == [4, 1]


def test_one_stage_is_refused():
    with pytest.raises(ValueError, match="pipeline degree of at least 2"):
        pipeline_bubbles(_plan([3], 1), COST)


def _measured_file(tmp_path, measured: list[list[float]]) -> str:
    plan = _plan([4, 3], 2)
    data = {
        "cost_model": COST.to_json_dict(),
        "variants": {
            "hand": {"steps": [{"plan": plan.to_json_dict(), "measured": [{"bubble": b} for b in measured]}]}
        },
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_cli_prints_measured_next_to_simulated(tmp_path, capsys):
    path = _measured_file(tmp_path, [[0.30, 0.10], [0.20, 0.40], [0.25, 0.35]])
    assert main(["--measured", path, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["variant"], r["pipeline"], r["micro_batches"]) for r in rows] == [
        ("hand", 0, 4),
        ("hand", 1, 3),
    ]
    assert rows[0]["measured"] == {"median": 0.25, "min": 0.20, "max": 0.30}
    assert rows[1]["measured"] == {"median": 0.35, "min": 0.10, "max": 0.40}
    assert rows[0]["simulated"] == pytest.approx(1 / 5) and rows[1]["simulated"] == pytest.approx(1 / 4)
    assert main(["--measured", path]) == 0
    table = capsys.readouterr().out
    assert "0.250 (0.200-0.300)" in table and "0.200" in table and "0.250" in table


def test_cli_names_what_is_missing_or_wrong(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"variants": {}}))
    assert main(["--measured", str(bad)]) == 2
    assert "no 'cost_model'" in capsys.readouterr().err
    path = _measured_file(tmp_path, [[0.3]])
    assert main(["--measured", path]) == 2
    assert "1 measured bubbles for a plan of 2 pipelines" in capsys.readouterr().err
    assert main(["--measured", str(tmp_path / "none.json")]) == 2
    assert "cannot read --measured" in capsys.readouterr().err
    (tmp_path / "text.json").write_text("not json")
    assert main(["--measured", str(tmp_path / "text.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err
