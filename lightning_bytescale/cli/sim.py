"""``bytescale-sim``: simulate a named scenario with every planner and print the comparison.

Examples::

    bytescale-sim --list
    bytescale-sim --scenario paper-7b-github-2m
    bytescale-sim --scenario paper-7b-byted-1m --planners static,balance --steps 2 --json
    bytescale-sim --scenario paper-7b-github-2m --planners balance,balance_modes   # ring-only vs modes
    bytescale-sim --measured benchmarks/results/pipeline_balance.json   # measured vs simulated bubble
    bytescale-sim --scenario paper-7b-github-2m --cost-model runs/last.ckpt  # a run's refined cost model

``--cost-model`` takes what a run leaves behind (a checkpoint file or sharded folder, the
telemetry's JSON or JSON-lines records, a saved refit or schedule) or a cost-model file, and
simulates with the newest model in it in place of the one the scenario derives from its shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import refined_cost_model
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
    p.add_argument(
        "--cost-model",
        metavar="SOURCE",
        help="simulate with the newest cost model in SOURCE: a run's checkpoint (.ckpt file or sharded "
        "folder), its telemetry (.json or .jsonl records holding 'cost_refit'), a saved refit, or a "
        "bytescale-profile / cost-model JSON file (default: the scenario's, from its shape)",
    )
    return p


def read_cost_source(source: str) -> CostModel:
    """The newest cost model in ``source`` (see ``--cost-model``); :class:`ValueError` naming the fix."""
    path = Path(source)
    if path.is_dir():
        meta = path / "meta.pt"  # a sharded checkpoint: everything but the tensors is in meta.pt
        if not meta.is_file():
            raise ConfigError(
                f"--cost-model {source} is a folder without meta.pt: give a checkpoint file, a sharded "
                "checkpoint folder, or a telemetry or cost-model JSON file"
            )
        path = meta
    if not path.is_file():
        raise ConfigError(f"--cost-model {source}: no such file")
    data: Any
    if path.suffix in (".ckpt", ".pt", ".pth"):
        import torch  # only to read a checkpoint: the simulator itself runs without torch

        # the user's own run's checkpoint, read as Lightning reads it to resume
        data = torch.load(path, map_location="cpu", weights_only=False)
    else:
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:  # JSON lines: one telemetry record a line
                data = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"--cost-model {source} is neither JSON nor JSON lines ({err}); give a checkpoint or a "
                    "telemetry or cost-model JSON file"
                ) from err
    return refined_cost_model(data)


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
        cost_model = read_cost_source(args.cost_model) if args.cost_model else None
        result = run_scenario(scenario, planners=planners, steps=args.steps, cost_model=cost_model)
    except (ValueError, OSError) as err:
        print(f"bytescale-sim: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = {
            "scenario": result["scenario"],
            "planners": {n: {k: r[k] for k in SUMMARY_KEYS} for n, r in result["planners"].items()},
        }
        if cost_model is not None:
            out["cost_model"] = {"source": args.cost_model, **cost_model.to_json_dict()}
        print(json.dumps(out, indent=2))
    else:
        if cost_model is not None:
            print(
                f"cost model: the newest in {args.cost_model} (a={cost_model.a:.4g}, b={cost_model.b:.4g}, g={cost_model.g:.4g})"
            )
        print(_table(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
