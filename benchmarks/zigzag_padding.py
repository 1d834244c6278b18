"""Causal-mask area per ring member: padding at the sequence end against padding spread over the chunks.

A ring runs in lock step, so its attention time is set by the member with the most causal-mask
area (``sum(p + 1)`` over the real positions ``p`` a member holds, :func:`zigzag.member_causal_area`).
For each layout the script reports, per case ``(s, N)``:

* ``min_over_max``: the smallest member's area over the largest's (1.0: even);
* ``slowest_over_mean``: the largest member's area over the mean (what the ring loses);
* ``spread_rows``: ``(max - min) / s``, the difference in rows of the mask (``s`` pairs each).

``end`` is the layout before the spread (every chunk ``c = ceil(s / 2N)`` slots, the padding all at
the sequence end); ``spread`` is :mod:`lightning_bytescale.planner.zigzag`'s.  Also: the worst
case of both over every ``2N <= s < 200N`` for a few ring sizes, and the static planner's rings
on a github batch (the sum over ring items of the slowest member's area, over the sum of the
mean member's).  Pure arithmetic: the numbers do not depend on the machine.

Writes ``benchmarks/results/zigzag_padding.{json,png}``.  Run:
``.venv/bin/python benchmarks/zigzag_padding.py``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from lightning_bytescale.planner import distributions, make_plan, zigzag

RESULTS = Path(__file__).resolve().parent / "results"
CASES = [(907, 16), (1000, 16), (10_000, 64), (262_200, 256), (65_600, 64), (8_200, 8)]
SWEEP_RINGS = (2, 4, 8, 16, 64)


def end_padded_areas(s: int, n: int) -> list[int]:
    """Member areas when every chunk has ``c`` slots and the padding sits at the sequence end."""
    c = zigzag.chunk_size(s, n)
    area = []
    for k in range(2 * n):
        a, b = min(k * c, s), min((k + 1) * c, s)
        area.append((b - a) * (a + b + 1) // 2)
    return [area[m] + area[2 * n - 1 - m] for m in range(n)]


def spread_areas(s: int, n: int) -> list[int]:
    return [zigzag.member_causal_area(s, n, m) for m in range(n)]


def summary(areas: list[int], s: int) -> dict:
    mean = sum(areas) / len(areas)
    return {
        "min_over_max": min(areas) / max(areas),
        "slowest_over_mean": max(areas) / mean,
        "spread_rows": (max(areas) - min(areas)) / s,
        "member0_over_mean": areas[0] / mean,
    }


def sweep(n: int) -> dict:
    out = {}
    for name, fn in (("end", end_padded_areas), ("spread", spread_areas)):
        worst_slow, worst_rows, at = 0.0, 0.0, None
        for s in range(2 * n, 200 * n):
            row = summary(fn(s, n), s)
            if row["slowest_over_mean"] > worst_slow:
                worst_slow, at = row["slowest_over_mean"], s
            worst_rows = max(worst_rows, row["spread_rows"])
        out[name] = {"worst_slowest_over_mean": worst_slow, "at_length": at, "worst_spread_rows": worst_rows}
    return out


def static_plan(world: int = 64, capacity: int = 8192, context: int = 256 * 1024) -> dict:
    """The static planner's rings on a github batch: slowest-member area summed over ring items."""
    lengths = distributions.sample_global_batch("github", world * capacity * 4, context, seed=0)
    plan = make_plan(lengths, world_size=world, planner="static", capacity=capacity)
    items: dict[int, tuple[int, list[int]]] = {}
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.ring is not None:
                items[mb.item] = (len(mb.ring), [lengths[p.seq] for p in mb.pieces])
    out = {"world_size": world, "capacity": capacity, "context": context, "ring_items": len(items)}
    for name, fn in (("end", end_padded_areas), ("spread", spread_areas)):
        slowest = mean = 0.0
        for n, lens in items.values():
            per_member = defaultdict(int)
            for s in lens:
                for m, a in enumerate(fn(s, n)):
                    per_member[m] += a
            slowest += max(per_member.values())
            mean += sum(per_member.values()) / n
        out[name] = {"slowest_over_mean": slowest / mean}
    out["cp_size"] = next(iter(items.values()))[0] if items else 1
    return out


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, n = CASES[0]
    end, spread = end_padded_areas(s, n), spread_areas(s, n)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(n)
    ax.bar([x - 0.2 for x in xs], end, width=0.4, label="padding at the end")
    ax.bar([x + 0.2 for x in xs], spread, width=0.4, label="padding spread")
    ax.axhline(s * (s + 1) / 2 / n, color="k", lw=0.8, ls="--", label="mean")
    ax.set_xlabel("ring member")
    ax.set_ylabel("causal-mask area (query-key pairs)")
    ax.set_title(f"{s} tokens on a ring of {n}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    cases = []
    print(f"{'s':>8} {'N':>4} | {'end min/max':>11} {'end slow/mean':>13} | "
          f"{'spread min/max':>14} {'spread slow/mean':>16} {'spread rows':>11}")  # fmt: skip
    for s, n in CASES:
        end, spread = summary(end_padded_areas(s, n), s), summary(spread_areas(s, n), s)
        cases.append({"length": s, "ring": n, "end": end, "spread": spread})
        print(
            f"{s:>8} {n:>4} | {end['min_over_max']:>11.3f} {end['slowest_over_mean']:>13.3f} | "
            f"{spread['min_over_max']:>14.3f} {spread['slowest_over_mean']:>16.3f} {spread['spread_rows']:>11.2f}"
        )
    sweeps = {str(n): sweep(n) for n in SWEEP_RINGS}
    for n, row in sweeps.items():
        print(
            f"N={n:>3}, 2N <= s < 200N: slowest/mean up to {row['end']['worst_slowest_over_mean']:.3f} (end, "
            f"s={row['end']['at_length']}) vs {row['spread']['worst_slowest_over_mean']:.3f} (spread); "
            f"spread max-min up to {row['spread']['worst_spread_rows']:.2f} rows"
        )
    static = static_plan()
    print(
        f"static planner, github batch, {static['world_size']} ranks, rings of {static['cp_size']}: "
        f"slowest/mean member area {static['end']['slowest_over_mean']:.4f} (end) vs "
        f"{static['spread']['slowest_over_mean']:.4f} (spread) over {static['ring_items']} ring items"
    )
    RESULTS.mkdir(exist_ok=True)
    out = {"cases": cases, "sweeps": sweeps, "static_plan": static}
    (RESULTS / "zigzag_padding.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(RESULTS / "zigzag_padding.png")
    print(f"wrote {RESULTS / 'zigzag_padding.json'} and zigzag_padding.png")


if __name__ == "__main__":
    main()
