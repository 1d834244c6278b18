"""The PP-Balance benchmark's figures in docs/benchmarks.md are those of its results file.

``benchmarks/pipeline_balance.py`` writes ``benchmarks/results/pipeline_balance.json``; the
section of docs/benchmarks.md that reports it names the file, and its two tables (bubble per
variant and pipeline, throughput per variant) and every ratio it quotes must be values of the
file, rounded as printed.  The file must hold what it says: every measured round and step, and
a comparison that the simulator, re-scoring the stored plans with the stored cost model, gives
again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_bytescale.sim.pipeline_bubble import compare_measured

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/pipeline_balance.json"
EARLIER = "benchmarks/results/pipeline_balance_load7.json"  # an earlier run of the same plans, heavier load
HEADING = "## Pipelines on CPU: PP-Balance against equal micro-batch counts (issue 30)"


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((ROOT / RESULTS).read_text())


@pytest.fixture(scope="module")
def section() -> str:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert HEADING in text
    body = text.split(HEADING, 1)[1]
    return body.split("\n## ", 1)[0]


def _spread(x: dict, fmt: str) -> str:
    return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}-{fmt.format(x['max'])})"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def test_section_names_the_file(section):
    assert RESULTS in section and "pipeline_balance.png" in section


def test_bubble_table_is_the_file(results, section):
    for r in results["comparison"]:
        cells = [
            r["variant"],
            str(r["pipeline"]),
            f"{r['micro_batches']:.1f}",
            _spread(r["measured"], "{:.3f}"),
            f"{r['simulated']:.3f}",
            f"{r['simulated_padded']:.3f}",
        ]
        assert _row(cells) in section, _row(cells)


def test_throughput_table_is_the_file(results, section):
    for name, variant in results["variants"].items():
        s = variant["summary"]
        tok = {k: s["tokens_per_s"][k] / 1000 for k in ("median", "min", "max")}
        cells = [
            name,
            _spread(tok, "{:.1f}K"),
            _spread(s["step_s"], "{:.2f}"),
            f"{s['simulated_step_s']:.3f}",
            f"{s['simulated_tokens_per_s'] / 1000:.1f}K",
        ]
        assert _row(cells) in section, _row(cells)


def test_quoted_ratios_are_the_files(results, section):
    earlier = json.loads((ROOT / EARLIER).read_text())
    assert EARLIER in section
    allowed = set()
    for ratios in (results["ratios"], earlier["ratios"]):
        for r in (
            ratios["pp_balance_over_equal_counts_tokens_per_s"],
            ratios["simulated_pp_balance_over_equal_counts_tokens_per_s"],
            *(ratios["per_round"][k] for k in ("median", "min", "max")),
        ):
            allowed |= {f"{r:.2f}x", f"{r:.1f}x"}
    quoted = set(re.findall(r"(?<![\w.])\d+\.\d+x(?!\w)", section))
    assert quoted and quoted <= allowed, quoted - allowed


def test_file_holds_every_round_and_step(results):
    setup = results["setup"]
    measured_steps = setup["steps_per_run"] - setup["warmup_steps"]
    for variant in results["variants"].values():
        assert len(variant["steps"]) == measured_steps
        for step in variant["steps"]:
            assert sorted(m["round"] for m in step["measured"]) == list(range(setup["rounds"]))
        assert variant["summary"]["tokens_per_s"]["n"] == measured_steps * setup["rounds"]


def test_comparison_is_what_the_simulator_gives_for_the_stored_plans(results):
    assert compare_measured(results) == results["comparison"]
    earlier = json.loads((ROOT / EARLIER).read_text())  # the same plans, so the same simulated bubbles
    for v, variant in earlier["variants"].items():
        assert variant["plan_digests"] == [s["plan"]["digest"] for s in results["variants"][v]["steps"]]
    assert [(r["simulated"], r["simulated_padded"]) for r in earlier["comparison"]] == [
        (r["simulated"], r["simulated_padded"]) for r in results["comparison"]
    ]
