"""The strategy throughput figures in the README and docs/strategy.md are one set, from one results file.

Both documents quote ``benchmarks/results/strategy.json`` (written by
``benchmarks/strategy_throughput.py``) and name it.  Every throughput (``13.1K``), ratio
(``7.0x``) and ring-traffic (``13.3 MB``) figure in their strategy-benchmark passages must be a
value of that file, rounded as printed, and the headline figures must appear in both.  The
file itself must be what the benchmark says it reports: the headline is the median over
interleaved rounds, every round and step is kept (the long-tail settings on 4 ranks and, as
``long_tail_w2``, on 2 ranks with a core each, too), and in every all-short setting (``all_short``,
C = 512, and ``all_short_2k``, C = 2048, each on 4 ranks and, as ``_w2``, on 2 ranks with a core
each) the HDP and DDP runs trained the same model (their parameters agree far more closely than
either moved).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/strategy.json"
LONG = ("long_tail", "long_tail_w2")
SHORT = ("all_short", "all_short_2k", "all_short_w2", "all_short_2k_w2")
# each all-short setting's bytescale/ddp ratio in the file's ``ratios`` (all_short_2k: ..._short_2k)
RATIO_KEYS = {setting: "bytescale_over_ddp_" + setting.removeprefix("all_") for setting in SHORT}
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(K|x| MB)(?!\w)")


def kilo(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}K"


def ratios(r: float) -> set[str]:
    return {f"{r:.1f}x", f"{r:.2f}x"}


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((ROOT / RESULTS).read_text())


def allowed_figures(res: dict) -> set[str]:
    """Every figure the documents may quote from the file, as printed."""
    out: set[str] = set()
    for run in runs(res):
        out |= {kilo(run["tokens_per_s"]), kilo(run["tokens_per_s_mean"])}
        out |= {kilo(x) for x in run["tokens_per_s_all_rounds"]}
        if "ring_mbytes_per_step" in run:
            out.add(f"{run['ring_mbytes_per_step']:.1f} MB")
    for r in res["ratios"].values():
        out |= ratios(r)
    for setting in SHORT:
        for r in res[setting]["bytescale_over_ddp_per_round"]:
            out |= ratios(r)
    return out


def runs(res: dict) -> list[dict]:
    """Every configuration's entry (the all-short group also holds the comparison's own keys)."""
    return [
        run
        for group in (*LONG, *SHORT)
        for run in res[group].values()
        if isinstance(run, dict) and "tokens_per_s" in run
    ]


def headline(res: dict) -> list[set[str]]:
    """The figures both documents must quote: each as any one of its printed forms."""
    lt, r = res["long_tail"], res["ratios"]
    figures = [
        {kilo(lt["balance"]["tokens_per_s"])},
        {kilo(lt["naive"]["tokens_per_s"])},
        {kilo(lt["static"]["tokens_per_s"])},
        ratios(r["balance_over_static"]),  # 4.99x, not a rounded-up 5.0x, next to a 5x bar
        {kilo(res["long_tail_w2"]["balance"]["tokens_per_s"])},
        ratios(r["balance_over_static_w2"]),
        ratios(r["balance_over_naive_w2"]),
    ]
    for setting, key in RATIO_KEYS.items():
        figures += [{kilo(res[setting][side]["tokens_per_s"])} for side in ("bytescale", "ddp")]
        figures.append({f"{r[key]:.2f}x"})
    return figures


def readme_passage() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("**On this machine")
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else None]


def strategy_doc_passage() -> str:
    text = (ROOT / "docs" / "strategy.md").read_text()
    start = text.index(f"### Measured (CPU, `{RESULTS}`)")
    end = text.find("\n### ", start + 1)
    return text[start : end if end >= 0 else None]


PASSAGES = {"README.md": readme_passage, "docs/strategy.md": strategy_doc_passage}


@pytest.mark.parametrize("document", sorted(PASSAGES))
def test_every_figure_comes_from_the_results_file(document, results):
    passage = PASSAGES[document]()
    assert RESULTS in passage, f"{document} must name {RESULTS} where it quotes it"
    quoted = {"".join(m) for m in FIGURE.findall(passage)}
    assert quoted, f"no figures found in {document}'s benchmark passage"
    stray = quoted - allowed_figures(results)
    assert not stray, f"{document} quotes {sorted(stray)}, which {RESULTS} does not hold"


@pytest.mark.parametrize("document", sorted(PASSAGES))
def test_both_documents_quote_the_headline_figures(document, results):
    quoted = {"".join(m) for m in FIGURE.findall(PASSAGES[document]())}
    missing = [sorted(forms) for forms in headline(results) if not forms & quoted]
    assert not missing, f"{document} does not quote {sorted(missing)} from {RESULTS}"


def test_the_strategy_table_rows_match_the_file(results):
    passage = strategy_doc_passage()
    rows = {
        ("long_tail", "balance"): "| `balance` |",
        ("long_tail", "balance_offload"): "| `balance`, `offload=True` |",
        ("long_tail", "naive"): "| `naive` |",
        ("long_tail", "static"): "| `static` (cp_size 4) |",
        ("long_tail_w2", "balance"): "| `balance`, 2 ranks |",
        ("long_tail_w2", "naive"): "| `naive`, 2 ranks |",
        ("long_tail_w2", "static"): "| `static` (cp_size 2), 2 ranks |",
        ("all_short", "bytescale"): "| `bytescale` (balance) |",
        ("all_short", "ddp"): "| plain `ddp` |",
        ("all_short_2k", "bytescale"): "| `bytescale` (balance, fitted cost model) |",
        ("all_short_2k", "ddp"): "| plain `ddp`, C = 2048 |",
        ("all_short_w2", "bytescale"): "| `bytescale` (balance), 2 ranks |",
        ("all_short_w2", "ddp"): "| plain `ddp`, 2 ranks |",
        ("all_short_2k_w2", "bytescale"): "| `bytescale` (balance, fitted cost model), C = 2048, 2 ranks |",
        ("all_short_2k_w2", "ddp"): "| plain `ddp`, C = 2048, 2 ranks |",
    }
    for (data, name), label in rows.items():
        run = results[data][name]
        line = next(line for line in passage.splitlines() if label in line)
        cells = [c.strip() for c in line.split("|")]
        assert kilo(run["tokens_per_s"]) in cells and kilo(run["tokens_per_s_mean"]) in cells, line
        if "max_over_mean_planned" in run:
            imbalance = f"{run['max_over_mean_planned']:.2f} / {run['max_over_mean_measured']:.2f}"
            assert imbalance in cells, f"{line}: expected planned / measured {imbalance}"


def test_the_headline_is_the_median_of_interleaved_rounds_and_every_step_is_kept(results):
    setup = results["setup"]
    assert "median" in setup["headline"]
    for run in runs(results):
        rounds = run["tokens_per_s_all_rounds"]
        assert run["tokens_per_s"] == statistics.median(rounds)
        assert len(run["step_wall_s"]) == len(rounds) == run["rounds"] == len(run["load_avg"])
        assert all(
            len(steps) == setup["steps_per_run"] - setup["warmup_steps"] for steps in run["step_wall_s"]
        )
    for setting, key in RATIO_KEYS.items():
        short = results[setting]
        assert short["bytescale"]["rounds"] == short["ddp"]["rounds"] == setup["rounds"] >= 5
        per_round = [
            h / d
            for h, d in zip(
                short["bytescale"]["tokens_per_s_all_rounds"], short["ddp"]["tokens_per_s_all_rounds"]
            )
        ]
        assert all(math.isclose(a, b) for a, b in zip(per_round, short["bytescale_over_ddp_per_round"]))
        ratio = short["bytescale"]["tokens_per_s"] / short["ddp"]["tokens_per_s"]
        assert math.isclose(results["ratios"][key], ratio)


def test_the_ddp_baseline_obeys_the_capacity_and_trains_the_same_model(results):
    assert "no_sync" in results["setup"]["ddp_baseline"]
    assert f"<= {results['setup']['capacity']} tokens" in results["setup"]["ddp_baseline"]
    for setting in SHORT:
        short = results[setting]
        # the same model, batches and optimizer: after the same steps the two runs' parameters
        # differ by float32 rounding only, a small fraction of how far either moved
        assert short["max_param_diff_vs_ddp"] < 0.01 * short["max_param_change"], setting


@pytest.mark.parametrize("setting", SHORT)
def test_in_both_short_settings_the_balance_plans_beat_the_token_shares_under_the_fitted_cost(
    results, setting
):
    # both settings give the planner the cost model fitted on this CPU; under it DDP's token
    # shares leave the slowest rank slower than the balance plans do, step by step
    check = results[setting]["cost_check"]
    assert all(h <= d * (1 + 1e-12) for h, d in zip(check["bytescale_max_rank_s"], check["ddp_max_rank_s"]))
    assert check["predicted_bytescale_over_ddp"] > 1.0
    assert "fitted" in results["setup"]["short_settings"][setting]["bytescale_cost_model"]


def test_the_step_cpu_table_matches_its_results_file():
    """docs/benchmarks.md's per-step CPU table quotes ``benchmarks/results/step_overhead.json``."""
    res = json.loads((ROOT / "benchmarks/results/step_overhead.json").read_text())
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text[text.index("| | `ddp` | `bytescale` | `bytescale_unchecked` |") :].split("\n\n")[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    configs = ("ddp", "bytescale", "bytescale_unchecked")
    groups = {"model": "model (", "loop": "Lightning loop", "machinery": "machinery ("}
    for key, label in groups.items():
        line = next(v for k, v in rows.items() if k.startswith(label))
        cells = [c.strip() for c in line.split("|")[2:-1]]
        assert [c.split(" ms")[0] for c in cells] == [f"{res[c]['groups_ms'][key]:.1f}" for c in configs], (
            line
        )
    totals = [c.split(" ms")[0] for c in rows["total"].split("|")[2:-1]]
    assert [t.strip() for t in totals] == [f"{res[c]['total_ms']:.1f}" for c in configs]
    other = next(v for k, v in rows.items() if k.startswith("other threads"))
    cells = [c.split(" ms")[0].strip() for c in other.split("|")[2:-1]]
    assert cells == [f"{res[c]['other_threads_ms']:.1f}" for c in configs], other
    # the groups add up, and the machinery is what the strategy adds beyond the same model work
    for c in configs:
        assert math.isclose(sum(res[c]["groups_ms"].values()), res[c]["total_ms"])
    assert math.isclose(
        res["machinery_over_ddp_ms"],
        res["bytescale"]["groups_ms"]["machinery"] - res["ddp"]["groups_ms"]["machinery"],
    )


def test_the_collective_cost_table_matches_its_results_file():
    """docs/benchmarks.md's table of one collective's CPU quotes ``step_overhead.json``'s ``collective_cpu_ms``."""
    res = json.loads((ROOT / "benchmarks/results/step_overhead.json").read_text())["collective_cpu_ms"]
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text[text.index("| collective | 4 ranks on 2 cores | 2 ranks, a core each |") :].split("\n\n")[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert set(rows) == set(res["4 ranks"]) == set(res["2 ranks"])
    for label, line in rows.items():
        cells = [c.strip() for c in line.split("|")[2:-1]]
        want = [
            f"{res[k][label]['process_ms']:.2f} ms ({res[k][label]['main_thread_ms']:.2f} ms main)"
            for k in ("4 ranks", "2 ranks")
        ]
        assert cells == want, line


def test_the_long_tail_planners_were_given_the_fitted_cost_model(results):
    # a user who ran bytescale-profile plans with its fit; the paper preset describes a GPU cluster
    assert "fitted" in results["setup"]["long_tail_cost_model"]
    assert {"balance", "balance_offload", "naive", "static"} <= set(results["long_tail"])
    assert {"balance", "naive", "static"} <= set(results["long_tail_w2"])
    for setting in LONG:  # each rank's share is the same in both settings
        spec = results["setup"]["long_tail_settings"][setting]
        assert (
            spec["tokens_per_step"] // spec["ranks"]
            == results["setup"]["tokens_per_step"] // results["setup"]["world"]
        )
        assert spec["static_cp_size"] == spec["ranks"]
