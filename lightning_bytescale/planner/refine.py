"""Refine an all-local placement: move and swap sequences between ranks at their packed cost.

DP-Balance places short sequences one at a time, longest first, each priced alone
(``local_time([s])``, which pays the per-micro-batch overhead ``g`` once per sequence), and only
afterwards packs each rank's share into micro-batches of ``C`` tokens.  The packed cost is what
the step pays, and it is not the sum that was balanced: a rank pays ``g`` per micro-batch, not per
sequence, and a share that packs into one micro-batch more than another's costs that much
more.  With few sequences per rank (a short step, or a large ``C``) this leaves the slowest
rank several percent above what the same sequences allow.

:func:`refine_local_shares` prices every rank exactly as :func:`~.items.emit` will build it
(its share packed best-fit-decreasing, each micro-batch at ``local_time``) and repeatedly applies
the best move of one sequence, or swap of two, between the slowest rank and the least-loaded
ones, accepting a change only when it lowers the slowest rank's time, or keeps it and lowers
the sum of squared rank times.  That order strictly decreases, so the loop ends.  It only runs
where it can matter, with at most ``MAX_SEQUENCES_PER_RANK`` sequences per rank on average
(with more, LPT's placement is fine-grained already and a share's micro-batch count hardly
varies), and it is bounded by ``max_work`` sequences priced in all, so it adds about a
millisecond to a plan.  It never returns a placement that is slower than the one it was given,
and it is deterministic, so every rank derives the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.packing import best_fit_decreasing

MAX_SEQUENCES_PER_RANK = 16
"""Above this many sequences per rank on average the placement is left as it is."""

MAX_WORK = 4000
"""Sequences one refinement may price, summed over the shares it prices (about a microsecond each)."""

CANDIDATE_RANKS = 4
"""Least-loaded ranks the slowest one may trade with in one round."""


class _Pricer:
    """Per-layer packed time of a share: its sequences' own time plus ``g`` per micro-batch.

    ``local_time`` of a micro-batch is ``num_layers * (sum(a s^2 + b s) + g)``, so a share costs
    ``num_layers * (sum of its sequences' a s^2 + b s + g * its micro-batch count)``; only the
    count needs the packing, and it is at least ``ceil(tokens / C)``, which rules most options
    out before packing them.
    """

    def __init__(self, lengths: Sequence[int], capacity: int, cost: CostModel, budget: int) -> None:
        self.lengths, self.capacity, self.g, self.budget = lengths, capacity, cost.g, budget
        self.own = [cost.a * s * s + cost.b * s for s in lengths]
        self.bins: dict[tuple[int, ...], int] = {}

    def lower(self, own: float, tokens: int) -> float:
        return own + self.g * -(-tokens // self.capacity)

    def exact(self, share: list[int], own: float) -> float:
        key = tuple(share)
        count = self.bins.get(key)
        if count is None:
            if self.budget <= 0:
                return math.inf  # out of budget: an unpriced option is never taken
            self.budget -= len(share)
            count = len(best_fit_decreasing(self.lengths, self.capacity, share))
            self.bins[key] = count
        return own + self.g * count


def refine_local_shares(
    lengths: Sequence[int],
    capacity: int,
    cost: CostModel,
    shares: Sequence[Sequence[int]],
    *,
    max_work: int = MAX_WORK,
) -> list[list[int]]:
    """Each rank's sequences after moves and swaps that lower the slowest rank's packed time.

    ``shares[r]`` lists the sequences rank ``r`` runs, all local (each fits ``capacity``).  The
    result has the same sequences, each on exactly one rank; no rank is slower than the slowest
    one was before.
    """
    out = [sorted(s) for s in shares]
    world = len(out)
    if world < 2 or sum(len(s) for s in out) > MAX_SEQUENCES_PER_RANK * world:
        return out
    price = _Pricer(lengths, capacity, cost, max_work)
    own = [sum(price.own[i] for i in s) for s in out]
    tokens = [sum(lengths[i] for i in s) for s in out]
    times = [price.exact(s, o) for s, o in zip(out, own)]

    def score(ts: list[float]) -> tuple[float, float]:
        return max(ts), sum(t * t for t in ts)

    while price.budget > 0:
        hi = max(range(world), key=lambda r: (times[r], -r))
        others = sorted((r for r in range(world) if r != hi), key=lambda r: (times[r], r))[:CANDIDATE_RANKS]
        best, top = score(times), times[hi]
        change: tuple[int, list[int], list[int], float, float, float, float, int, int] | None = None
        for j in out[hi]:
            for r in others:
                for k in [None, *out[r]]:  # move j to r, or swap it for one of r's sequences
                    dk, sk = (0.0, 0) if k is None else (price.own[k], lengths[k])
                    a_tok = tokens[hi] - lengths[j] + sk
                    b_tok = tokens[r] + lengths[j] - sk
                    a_near = own[hi] - price.own[j] + dk  # running sums: good enough to rule out
                    b_near = own[r] + price.own[j] - dk
                    if price.lower(a_near, a_tok) > top or price.lower(b_near, b_tok) > top:
                        continue  # one side would end above the slowest rank's time now
                    a = sorted(x for x in [*out[hi], *([] if k is None else [k])] if x != j)
                    b = sorted(x for x in [*out[r], j] if x != k)
                    a_own, b_own = sum(price.own[i] for i in a), sum(price.own[i] for i in b)
                    ta, tb = price.exact(a, a_own), price.exact(b, b_own)
                    trial = list(times)
                    trial[hi], trial[r] = ta, tb
                    s = score(trial)
                    if s < best:
                        best, change = s, (r, a, b, ta, tb, a_own, b_own, a_tok, b_tok)
        if change is None:
            break
        r, a, b, ta, tb, a_own, b_own, a_tok, b_tok = change
        out[hi], out[r], times[hi], times[r] = a, b, ta, tb
        own[hi], own[r], tokens[hi], tokens[r] = a_own, b_own, a_tok, b_tok
    return out


__all__ = ["refine_local_shares"]
