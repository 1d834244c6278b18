"""Synthetic sequence-length distributions matching the paper's data anchors (§1.2, §8.2).

Each distribution is a mixture of simple pieces over a 2M-token reference context
(``REFERENCE_CONTEXT = 2**21``): log-uniform ranges, a truncated power law for the tail, and
(for ``byted``) a point mass at exactly 2M (documents as long as the context).  Piece
boundaries sit on the anchor thresholds, so the anchors hold *exactly* in expectation
(:func:`expected_anchors`) and a test checks them on samples too.

``byted`` (in-house long-context data) meets, at the 2M reference:

* 80% of samples are <= 4K tokens;
* 0.05% of samples are 2M long and carry 12.1% of the tokens;
* the 1% of samples that are >= 128K carry 44.3% of the tokens;
* 37% of the tokens come from sequences longer than 256K.

``github`` (code) meets:

* 16.2% of the tokens come from sequences longer than 128K;
* 9.8% of the tokens come from sequences longer than 256K;
* fewer long samples than ``byted`` (0.33% of samples >= 128K, none at 2M; 74% <= 4K); mean
  about 6.4K.

Two stress shapes for the planners (not from the paper; their shares are exact in expectation
like the anchors above):

* ``short`` (short-heavy, e.g. chat or instruction data): 99% of samples and about 75% of the
  tokens are in sequences of at most 8K; the rest thins out to 512K.  Balancing many local
  micro-batches of different quadratic cost is the whole game.
* ``mixed`` (very mixed): a power law with exponent 1 from 256 tokens to 2M
  (``p(s) ~ s^-2``), so every doubling of the length carries the same share of the tokens
  (1/13 each): short, medium and very long sequences compete for the same ranks.

Three public histograms (:mod:`.public_lengths`, with their sources): ``pile`` and
``prolong512k`` (LongCA-bench's document counts of the Pile and of ProLong's 512K mix) and
``magi_long`` (MagiAttention's benchmark distribution for sequences longer than 64K).  A
length is drawn uniformly inside a bin drawn by its share; documents keep their own lengths
(the Pile's reach 9.3M tokens) until they are fitted to the context.  :data:`SYNTHETIC` names
the four shapes above, which the planner comparisons run on.

Scaling to a context length ``L`` (:func:`sample_global_batch`): ``mode="split"`` (default)
keeps the documents and cuts those longer than ``L`` into ``L``-token pieces plus a remainder
(the paper's setting: the same data trained at 256K..2M contexts); ``mode="scale"`` multiplies
every length by ``L / 2M`` (same shape at any scale, for small CPU runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.public_lengths import HISTOGRAMS

REFERENCE_CONTEXT = 2**21
K = 1024


@dataclass(frozen=True)
class _Piece:
    prob: float
    kind: str  # "loguniform" | "pareto" | "point" | "uniform" (lengths lo..hi, both included)
    lo: float
    hi: float = 0.0
    alpha: float = 0.0

    def mean(self) -> float:
        lo, hi, a = self.lo, self.hi, self.alpha
        if self.kind == "point":
            return lo
        if self.kind == "uniform":
            return (lo + hi) / 2
        if self.kind == "loguniform":
            return (hi - lo) / np.log(hi / lo)
        num = np.log(hi / lo) if a == 1 else (hi ** (1 - a) - lo ** (1 - a)) / (1 - a)
        den = (hi ** (-a) - lo ** (-a)) / (-a)
        return num / den

    def cdf(self, x: float) -> float:
        lo, hi, a = self.lo, self.hi, self.alpha
        if self.kind == "point":
            return float(x >= lo)
        if self.kind == "uniform":
            return float(min(max(np.floor(x) - lo + 1, 0) / (hi - lo + 1), 1.0))
        if x <= lo:
            return 0.0
        if x >= hi:
            return 1.0
        if self.kind == "loguniform":
            return float(np.log(x / lo) / np.log(hi / lo))
        return float((lo ** (-a) - x ** (-a)) / (lo ** (-a) - hi ** (-a)))

    def sample(self, u: np.ndarray) -> np.ndarray:
        lo, hi, a = self.lo, self.hi, self.alpha
        if self.kind == "point":
            return np.full(u.shape, lo)
        if self.kind == "uniform":
            return lo + u * (hi - lo + 1)  # floored by the caller: lo..hi, each as likely
        if self.kind == "loguniform":
            return lo * (hi / lo) ** u
        return (lo ** (-a) - u * (lo ** (-a) - hi ** (-a))) ** (-1.0 / a)


_M = float(REFERENCE_CONTEXT)
DISTRIBUTIONS: dict[str, tuple[_Piece, ...]] = {
    "byted": (
        _Piece(0.80, "loguniform", 64, 4 * K),
        _Piece(0.13886127, "loguniform", 4 * K, 16 * K),
        _Piece(0.05113873, "loguniform", 16 * K, 128 * K),
        _Piece(0.00334544, "loguniform", 128 * K, 256 * K),
        _Piece(0.00615456, "pareto", 256 * K, _M, 3.9408458),
        _Piece(0.0005, "point", _M),
    ),
    "github": (
        _Piece(0.62, "loguniform", 32, 2 * K),
        _Piece(0.25, "loguniform", 2 * K, 8 * K),
        _Piece(0.095, "loguniform", 8 * K, 32 * K),
        _Piece(0.03167017, "loguniform", 32 * K, 128 * K),
        _Piece(0.00215609, "loguniform", 128 * K, 256 * K),
        _Piece(0.00117374, "pareto", 256 * K, _M, 1.5),
    ),
    "short": (
        _Piece(0.80, "loguniform", 16, 2 * K),
        _Piece(0.19, "loguniform", 2 * K, 8 * K),
        _Piece(0.009, "loguniform", 8 * K, 64 * K),
        _Piece(0.001, "pareto", 64 * K, 512 * K, 1.5),
    ),
    "mixed": (_Piece(1.0, "pareto", 256, _M, 1.0),),
}
#: The synthetic shapes (the paper's anchors and two stress shapes): the planner comparisons' grid.
SYNTHETIC = tuple(sorted(DISTRIBUTIONS))
DISTRIBUTIONS.update(
    {name: tuple(_Piece(n, "uniform", lo, hi) for lo, hi, n in bins) for name, bins in HISTOGRAMS.items()}
)


def names() -> list[str]:
    return sorted(DISTRIBUTIONS)


def _longest(pieces: tuple[_Piece, ...]) -> int:
    """The longest document a distribution draws: the 2M reference, or a histogram's last bin."""
    return max([REFERENCE_CONTEXT] + [int(p.hi) for p in pieces if p.kind == "uniform"])


def _pieces(name: str) -> tuple[_Piece, ...]:
    try:
        return DISTRIBUTIONS[name]
    except KeyError:
        raise PlanError(f"unknown length distribution {name!r}; choose from {names()}") from None


def _generator(seed: int | None, rng) -> np.random.Generator:
    if rng is None:
        return np.random.default_rng(0 if seed is None else seed)
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, random.Random):
        return np.random.default_rng(rng.getrandbits(63))
    raise PlanError(f"rng must be a numpy Generator or random.Random, got {type(rng).__name__}")


def sample_lengths(name: str, n: int, *, seed: int | None = 0, rng=None) -> np.ndarray:
    """``n`` document lengths (int64) at the 2M reference context (a public histogram's own
    lengths, see :mod:`.public_lengths`); deterministic per seed."""
    if n < 0:
        raise PlanError(f"number of samples must be >= 0, got {n}")
    pieces = _pieces(name)
    gen = _generator(seed, rng)
    probs = np.array([p.prob for p in pieces])
    probs = probs / probs.sum()
    which = gen.choice(len(pieces), size=n, p=probs)
    u = gen.random(n)
    out = np.empty(n, dtype=np.float64)
    for k, piece in enumerate(pieces):
        sel = which == k
        if sel.any():
            out[sel] = piece.sample(u[sel])
    lengths = np.floor(out).astype(np.int64)
    return np.clip(lengths, 1, _longest(pieces))


def mean_length(name: str) -> float:
    pieces = _pieces(name)
    return float(sum(p.prob * p.mean() for p in pieces) / sum(p.prob for p in pieces))


def expected_anchors(name: str) -> dict[str, float]:
    """Exact expected sample and token shares at the anchor thresholds (2M reference)."""
    pieces = _pieces(name)
    total_p = sum(p.prob for p in pieces)
    total_t = sum(p.prob * p.mean() for p in pieces)

    def share(pred) -> tuple[float, float]:
        sel = [p for p in pieces if pred(p)]
        return sum(p.prob for p in sel) / total_p, sum(p.prob * p.mean() for p in sel) / total_t

    s4k = sum(p.prob * p.cdf(4 * K) for p in pieces) / total_p
    s128, t128 = share(lambda p: p.lo >= 128 * K)
    _, t256 = share(lambda p: p.lo >= 256 * K)
    s2m, t2m = share(lambda p: p.lo >= _M)
    return {
        "samples_le_4k": s4k,
        "samples_ge_128k": s128,
        "tokens_ge_128k": t128,
        "tokens_gt_256k": t256,
        "samples_at_2m": s2m,
        "tokens_at_2m": t2m,
        "mean_length": total_t / total_p,
    }


def apply_context(lengths: np.ndarray, context_length: int, mode: str = "split") -> np.ndarray:
    """Fit reference-context documents to ``context_length`` (``split`` or ``scale``)."""
    if context_length < 1:
        raise PlanError(f"context_length must be >= 1, got {context_length}")
    x = np.asarray(lengths, dtype=np.int64)
    if mode == "scale":
        return np.maximum(1, np.floor(x * (context_length / REFERENCE_CONTEXT))).astype(np.int64)
    if mode != "split":
        raise PlanError(f"mode must be 'split' or 'scale', got {mode!r}")
    if not (x > context_length).any():
        return x
    full, rem = np.divmod(x, context_length)
    counts = full + (rem > 0)
    out = np.full(int(counts.sum()), context_length, dtype=np.int64)
    ends = np.cumsum(counts) - 1
    has_rem = rem > 0
    out[ends[has_rem]] = rem[has_rem]
    return out


def sample_global_batch(
    name: str,
    tokens: int,
    context_length: int = REFERENCE_CONTEXT,
    seed: int | None = 0,
    *,
    rng=None,
    mode: str = "split",
) -> list[int]:
    """Lengths of one global batch of exactly ``tokens`` tokens (the last one trimmed to fit).

    Documents are drawn from distribution ``name`` and fitted to ``context_length`` by ``mode``.
    Deterministic for a given ``seed`` (or ``rng``: numpy Generator or ``random.Random``).
    """
    if tokens < 1:
        raise PlanError(f"tokens must be >= 1, got {tokens}")
    gen = _generator(seed, rng)
    mean = mean_length(name)
    if mode == "scale":
        mean *= context_length / REFERENCE_CONTEXT
    out: list[np.ndarray] = []
    have = 0
    while have < tokens:
        n = int(max(16, 1.2 * (tokens - have) / max(mean, 1.0)))
        block = apply_context(sample_lengths(name, n, rng=gen), context_length, mode)
        out.append(block)
        have += int(block.sum())
    x = np.concatenate(out)
    cum = np.cumsum(x)
    last = int(np.searchsorted(cum, tokens))  # first index whose cumsum >= tokens
    x = x[: last + 1].copy()
    x[-1] -= int(cum[last] - tokens)
    return [int(v) for v in x]
