"""The two stress distributions for the planner comparisons: ``short`` and ``mixed``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_bytescale.planner import distributions as dist

K = 1024


def _token_share_below(x: np.ndarray, limit: int) -> float:
    return float(x[x <= limit].sum() / x.sum())


def test_short_is_short_heavy():
    x = dist.sample_lengths("short", 400_000, seed=2)
    assert np.mean(x <= 8 * K) == pytest.approx(0.99, abs=0.002)
    assert _token_share_below(x, 8 * K) == pytest.approx(0.75, abs=0.03)
    assert x.max() <= 512 * K
    assert dist.mean_length("short") == pytest.approx(x.mean(), rel=0.03)


def test_mixed_puts_the_same_tokens_in_every_length_doubling():
    x = dist.sample_lengths("mixed", 1_000_000, seed=3)
    octaves = 13  # 256 tokens to 2M
    shares = [float(x[(x > 256 * 2**i) & (x <= 256 * 2 ** (i + 1))].sum() / x.sum()) for i in range(octaves)]
    assert min(shares) > 0.5 / octaves and max(shares) < 1.5 / octaves
    lo, hi = 256, dist.REFERENCE_CONTEXT  # density lo hi / (hi - lo) s^-2: mean lo hi ln(hi / lo) / (hi - lo)
    expected = lo * hi * math.log(hi / lo) / (hi - lo)
    assert dist.mean_length("mixed") == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["short", "mixed"])
def test_global_batches_have_exact_tokens(name):
    b = dist.sample_global_batch(name, tokens=2_000_000, context_length=65536, seed=4)
    assert sum(b) == 2_000_000 and max(b) <= 65536
    assert name in dist.names()
