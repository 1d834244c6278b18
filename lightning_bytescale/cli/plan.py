"""``bytescale-plan``: plan one global batch from the command line and print its statistics.

Lengths come from a file (a JSON list of integers, a ``.npy`` array, or text with one length
per line; ``#`` starts a comment) or from a synthetic distribution (``--distribution NAME
--tokens T``).  ``--json PATH`` also writes the plan in the documented schema
(docs/planner.md); two runs with the same arguments write byte-identical files.  The options
become one :class:`~lightning_bytescale.planner.config.PlannerConfig`; ``--option KEY=VALUE``
passes a planner's own options and ``--import MODULE`` loads planners registered elsewhere.
``--attention-heads H --kv-heads K`` give the cost model the heads of one lane, so that
``balance`` may run items as Ulysses or hybrid (``--modes`` restricts the choice).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from lightning_bytescale.planner import distributions
from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.planners import make_plan
from lightning_bytescale.planner.registry import planner_own_options


def load_lengths(path: str) -> list[int]:
    """Read lengths from a JSON list, a ``.npy`` file, or a text file with one per line."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"lengths file {path!r} does not exist")
    if p.suffix == ".npy":
        try:
            arr = np.load(p, allow_pickle=False)
        except ValueError as err:
            raise PlanError(f"{path}: not a plain .npy array ({err})") from err
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise PlanError(f"{path}: expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        return [int(x) for x in arr]
    text = p.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
        bad = [i for i, x in enumerate(data) if isinstance(x, bool) or not isinstance(x, int)]
        if bad:
            raise PlanError(f"{path}: entry {bad[0]} ({data[bad[0]]!r}) is not an integer")
        return list(data)
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            out.append(int(line))
        except ValueError:
            raise PlanError(f"{path}:{lineno}: {line!r} is not an integer length") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bytescale-plan",
        description="Plan one global batch with a ByteScale planner and print its statistics.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--lengths", metavar="FILE", help="JSON list, .npy, or text file with one length per line"
    )
    src.add_argument(
        "--distribution",
        metavar="NAME",
        help=f"length distribution: {', '.join(distributions.names())}",
    )
    ap.add_argument("--tokens", type=int, help="global batch tokens (with --distribution)")
    ap.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="context length for --distribution (default: capacity x world size, at most 2M)",
    )
    ap.add_argument("--world-size", type=int, required=True, help="HDP ranks")
    ap.add_argument("--capacity", type=int, required=True, help="tokens per rank per micro-batch (C)")
    ap.add_argument(
        "--planner",
        default="balance",
        help="static, naive, balance, or a peer: megatron_dcp, verl_kk, lpt (or a registered planner)",
    )
    ap.add_argument(
        "--cp-size", type=int, default=None, help="static planner's CP degree (default: smallest that fits)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the plan (documented schema) to PATH")
    ap.add_argument(
        "--cost-model",
        metavar="FILE",
        help="a bytescale-profile file or a cost-model JSON dict (default: the paper preset)",
    )
    ap.add_argument("--ranks-per-node", type=int, default=None)
    ap.add_argument("--pipeline-degree", type=int, default=1)
    ap.add_argument(
        "--max-micro-batches",
        type=int,
        default=None,
        help="with --pipeline-degree > 1: the most micro-batches one pipeline runs in a step (receive buffers)",
    )
    ap.add_argument("--slack", type=float, default=0.05)
    ap.add_argument("--num-buckets", type=int, default=8)
    off = ap.add_mutually_exclusive_group()
    off.add_argument(
        "--offload", dest="offload", action="store_true", default=None, help="force selective offload on"
    )
    off.add_argument("--no-offload", dest="offload", action="store_false", help="force offload off")
    ap.add_argument("--compute-only", action="store_true", help="balance on the paper's compute-only model")
    ap.add_argument(
        "--attention-heads",
        type=int,
        default=None,
        help="query heads of one lane, given to the cost model (with --kv-heads): balance may then run "
        "sequences as Ulysses or hybrid where the heads allow",
    )
    ap.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads of one lane (with --attention-heads)"
    )
    ap.add_argument(
        "--modes",
        default=None,
        metavar="LIST",
        help="balance: the attention modes it may choose, comma-separated from ring,ulysses,hybrid "
        "(default: every mode the cost model's heads allow)",
    )
    ap.add_argument(
        "--offload-policy",
        choices=("paper_min_ranks", "pays"),
        default=None,
        help="naive with offload: Eq. 3's fewest ranks (default) or shrink rings only where it pays",
    )
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a planner's own option (repeatable; VALUE read as JSON, else as a string), e.g. pp_reading=round_robin",
    )
    ap.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (repeatable): a module that registers planners with register_planner",
    )
    return ap


def _option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--option``: the value as JSON (numbers, true/false, null), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise PlanError(f"--option {text!r}: write KEY=VALUE, e.g. --option pp_reading=round_robin")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def _summary(stats: dict, plan_ms: float) -> str:
    keys = (
        "num_sequences",
        "num_tokens",
        "micro_batches",
        "min_micro_batches",
        "max_micro_batches",
        "ring_items",
        "max_time",
        "mean_time",
        "max_over_mean",
        "makespan",
        "bubble_fraction",
        "ring_bytes",
        "exposed_ring_time",
        "offloaded_sequences",
    )
    lines = [
        f"{k:>22}: {stats[k]:.6g}" if isinstance(stats[k], float) else f"{k:>22}: {stats[k]}" for k in keys
    ]
    lines.append(f"{'cp_degree_histogram':>22}: {stats['cp_degree_histogram']}")
    lines.append(f"{'mode_counts':>22}: {stats['mode_counts']}")
    sent = {mode: f"{b:.4g}" for mode, b in stats["comm_bytes_by_mode"].items()}
    lines.append(f"{'comm_bytes_by_mode':>22}: {sent}")
    lines.append(f"{'plan_ms':>22}: {plan_ms:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for module in args.imports:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise PlanError(f"--import {module}: cannot import it ({err}); is it on PYTHONPATH?") from err
        if args.lengths:
            if args.tokens is not None:
                raise PlanError("--tokens goes with --distribution, not with --lengths")
            lengths = load_lengths(args.lengths)
        else:
            if args.tokens is None:
                raise PlanError("--distribution needs --tokens T (the global batch size in tokens)")
            ctx = args.context_length or min(distributions.REFERENCE_CONTEXT, args.capacity * args.world_size)
            lengths = distributions.sample_global_batch(args.distribution, args.tokens, ctx, seed=args.seed)
        if not lengths:
            raise PlanError("no lengths given; the global batch is empty")
        options = dict(_option(text) for text in args.option)
        if args.offload_policy is not None:
            options["offload_policy"] = args.offload_policy
        if args.modes is not None:
            if "modes" not in planner_own_options(args.planner):
                raise PlanError(
                    f"--modes: planner {args.planner!r} runs every sequence as a ring; balance chooses attention modes"
                )
            options["modes"] = args.modes
        config = PlannerConfig.from_options(
            planner=args.planner,
            capacity=args.capacity,
            cost_model=args.cost_model,
            cp_size=args.cp_size,
            seed=args.seed,
            offload=args.offload,
            slack=args.slack,
            num_buckets=args.num_buckets,
            pipeline_degree=args.pipeline_degree,
            max_micro_batches=args.max_micro_batches,
            ranks_per_node=args.ranks_per_node,
            comm_aware=not args.compute_only,
            **options,
        )
        if args.attention_heads is not None or args.kv_heads is not None:
            cost = config.cost_model if config.cost_model is not None else CostModel.paper_preset()
            config = config.replace(
                cost_model=cost.with_(attention_heads=args.attention_heads, kv_heads=args.kv_heads)
            )
        t0 = time.perf_counter()
        plan = make_plan(lengths, world_size=args.world_size, config=config)
        plan_ms = (time.perf_counter() - t0) * 1e3
        plan.validate()
    except PlanError as err:
        print(f"bytescale-plan: error: {err}", file=sys.stderr)
        return 2
    data = plan.to_json_dict()
    print(
        f"planner {plan.planner}: {plan.world_size} ranks, capacity {plan.capacity}, digest {data['digest'][:16]}"
    )
    print(_summary(data["stats"], plan_ms))
    if args.json:
        Path(args.json).write_text(
            json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n", encoding="utf-8"
        )
        print(f"plan written to {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
