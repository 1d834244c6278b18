"""Synthetic length distributions meet the paper's anchors (bytescale-paper §1.2)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lightning_bytescale.planner import distributions as dist
from lightning_bytescale.planner.errors import PlanError

ANCHORS = {
    "byted": {
        "samples_le_4k": 0.80,
        "samples_ge_128k": 0.01,
        "tokens_ge_128k": 0.443,
        "tokens_gt_256k": 0.37,
        "samples_at_2m": 0.0005,
        "tokens_at_2m": 0.121,
    },
    "github": {"tokens_ge_128k": 0.162, "tokens_gt_256k": 0.098},
}
# sampled shares wander: tolerances for 10^6 samples (token shares carry the heavy tail's noise)
TOL = {"samples_le_4k": 0.005, "samples_ge_128k": 0.0005, "samples_at_2m": 0.0001}
K = dist.K


def measured_anchors(lengths: np.ndarray) -> dict[str, float]:
    """The shares of ``dist.expected_anchors``, measured on a sample of lengths (2M reference)."""
    x = np.asarray(lengths, dtype=np.float64)
    tot = x.sum()
    return {
        "samples_le_4k": float(np.mean(x <= 4 * K)),
        "samples_ge_128k": float(np.mean(x >= 128 * K)),
        "tokens_ge_128k": float(x[x >= 128 * K].sum() / tot),
        "tokens_gt_256k": float(x[x >= 256 * K].sum() / tot),
        "samples_at_2m": float(np.mean(x >= dist.REFERENCE_CONTEXT)),
        "tokens_at_2m": float(x[x >= dist.REFERENCE_CONTEXT].sum() / tot),
        "mean_length": float(x.mean()),
    }


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_expected_shares_meet_the_anchors_exactly(name):
    got = dist.expected_anchors(name)
    for key, want in ANCHORS[name].items():
        assert got[key] == pytest.approx(want, abs=1e-4), key


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_sampled_shares_meet_the_anchors(name):
    x = dist.sample_lengths(name, 1_000_000, seed=11)
    assert x.dtype == np.int64 and x.min() >= 1 and x.max() <= dist.REFERENCE_CONTEXT
    got = measured_anchors(x)
    print(f"\n{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
    for key, want in ANCHORS[name].items():
        assert got[key] == pytest.approx(want, abs=TOL.get(key, 0.02)), key


def test_github_has_fewer_long_samples_than_byted():
    g, b = dist.expected_anchors("github"), dist.expected_anchors("byted")
    assert g["samples_ge_128k"] < b["samples_ge_128k"]
    assert g["tokens_ge_128k"] < b["tokens_ge_128k"]


@pytest.mark.parametrize("name", ["github", "byted"])
@pytest.mark.parametrize("context", [4096, 262144, 2**21])
def test_global_batch_has_exact_tokens_and_respects_the_context(name, context):
    b = dist.sample_global_batch(name, tokens=3_000_000, context_length=context, seed=5)
    assert sum(b) == 3_000_000
    assert min(b) >= 1 and max(b) <= context
    assert b == dist.sample_global_batch(name, tokens=3_000_000, context_length=context, seed=5)
    assert b != dist.sample_global_batch(name, tokens=3_000_000, context_length=context, seed=6)


def test_split_keeps_tokens_and_scale_shrinks_lengths():
    x = np.array([10, 25, 3])
    assert dist.apply_context(x, 10).tolist() == [10, 10, 10, 5, 3]
    assert dist.apply_context(x, 2**21 // 2, mode="scale").tolist() == [5, 12, 1]
    b = dist.sample_global_batch("byted", 100_000, 8192, seed=1, mode="scale")
    assert sum(b) == 100_000 and max(b) <= 8192


def test_rng_argument_and_errors():
    a = dist.sample_global_batch("github", 50_000, 65536, rng=random.Random(3))
    assert a == dist.sample_global_batch("github", 50_000, 65536, rng=random.Random(3))
    with pytest.raises(PlanError, match="unknown length distribution 'nope'"):
        dist.sample_lengths("nope", 3)
    with pytest.raises(PlanError, match="tokens"):
        dist.sample_global_batch("github", 0, 100)
    with pytest.raises(PlanError, match="mode"):
        dist.apply_context(np.array([5]), 2, mode="wrap")
