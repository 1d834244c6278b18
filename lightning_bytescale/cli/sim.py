"""``bytescale-sim``: simulate a named scenario with every planner and print the comparison.

Examples::

    bytescale-sim --list
    bytescale-sim --scenario paper-7b-github-2m
    bytescale-sim --scenario paper-7b-byted-1m --planners static,balance --steps 2 --json
    bytescale-sim --scenario paper-7b-github-2m --planners balance,balance_modes   # ring-only vs modes
    bytescale-sim --measured benchmarks/results/pipeline_balance.json   # measured vs simulated bubble
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.planner.modes import MODES
from lightning_bytescale.sim.pipeline_bubble import compare_measured
from lightning_bytescale.sim.run import SUMMARY_KEYS, VARIANTS, run_scenario
from lightning_bytescale.sim.scenario import SCENARIOS, get_scenario


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bytescale-sim",
        description="Simulate one training step of a cluster scenario with the real planners.",
    )
    p.add_argument("--scenario", help="scenario name (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenario names and exit")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    p.add_argument(
        "--planners",
        help=f"comma-separated planners (default: the scenario's); known: {','.join(VARIANTS)}",
    )
    p.add_argument("--steps", type=int, help="global batches to simulate (default: the scenario's)")
    p.add_argument("--seed", type=int, help="seed of the length sampler (default: the scenario's)")
    p.add_argument(
        "--measured",
        metavar="FILE",
        help="a measured pipeline run's JSON (benchmarks/pipeline_balance.py): print its measured "
        "bubble per variant and pipeline next to the simulator's for the same plans",
    )
    return p


def _measured_table(rows: list[dict]) -> str:
    head = [
        "variant",
        "pipeline",
        "micro-batches",
        "measured (median, min-max)",
        "simulated",
        "sim. padded to C",
    ]
    lines = [head]
    for r in rows:
        m = r["measured"]
        got = "-" if m is None else f"{m['median']:.3f} ({m['min']:.3f}-{m['max']:.3f})"
        lines.append(
            [
                r["variant"],
                str(r["pipeline"]),
                f"{r['micro_batches']:.1f}",
                got,
                f"{r['simulated']:.3f}",
                f"{r['simulated_padded']:.3f}",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in lines
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "pipeline bubble (1 - stage compute / schedule wall), measured against simulated\n" + "\n".join(
        out
    )


def _measured(path: str, as_json: bool) -> int:
    try:
        with open(path) as f:
            data = json.load(f)
        rows = compare_measured(data)
    except OSError as err:
        print(f"bytescale-sim: error: cannot read --measured {path}: {err.strerror}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as err:
        print(
            f"bytescale-sim: error: --measured {path} is not JSON ({err}); pass a benchmark's result file",
            file=sys.stderr,
        )
        return 2
    except ValueError as err:
        print(f"bytescale-sim: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if as_json else _measured_table(rows))
    return 0


def _by_mode(counts: dict, exposed: dict) -> str:
    """``ring 41 (12.3s), hybrid 3 (0.4s)``: ring items and exposed seconds (all ranks) per mode."""
    parts = [
        f"{mode} {counts.get(mode, 0):.3g} ({exposed.get(mode, 0.0):.1f}s)"
        for mode in MODES
        if counts.get(mode, 0) or exposed.get(mode, 0.0)
    ]
    return ", ".join(parts) or "-"


def _table(result: dict) -> str:
    head = [
        "planner",
        "step_s",
        "tokens/s",
        "max/mean",
        "bubble",
        "ring_GB",
        "plan_ms",
        "speedup",
        "items (exposed)",
    ]
    rows = [head]
    for name, r in result["planners"].items():
        sp = r["speedup_vs_static"]
        rows.append(
            [
                name,
                f"{r['step_time_s']:.3f}",
                f"{r['tokens_per_s']:.4g}",
                f"{r['max_over_mean']:.3f}",
                f"{r['bubble_fraction']:.3f}",
                f"{r['ring_bytes'] / 1e9:.1f}",
                f"{r['plan_ms']:.1f}",
                "-" if sp is None else f"{sp:.2f}x",
                _by_mode(r["mode_counts"], r["exposed_comm_by_mode"]),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = "items (exposed): ring items per attention mode, and their exposed communication summed over ranks"
    return f"scenario {result['scenario']}\n" + "\n".join(lines) + f"\n{note}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, sc in SCENARIOS.items():
            print(f"{name:28s} {sc.description}")
        return 0
    if args.measured:
        return _measured(args.measured, args.json)
    if not args.scenario:
        _parser().error("give --scenario NAME (or --list to see the names)")
    try:
        scenario = get_scenario(args.scenario)
        if args.seed is not None:
            scenario = scenario.with_(seed=args.seed)
        planners = [p.strip() for p in args.planners.split(",") if p.strip()] if args.planners else None
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        result = run_scenario(scenario, planners=planners, steps=args.steps)
    except ValueError as err:
        print(f"bytescale-sim: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "scenario": result["scenario"],
            "planners": {n: {k: r[k] for k in SUMMARY_KEYS} for n, r in result["planners"].items()},
        }
        print(json.dumps(out, indent=2))
    else:
        print(_table(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
