"""The token-budgeted global batch sampler: budget, coverage, determinism, position."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.data import DataError, GlobalBatching, ResumeMismatchError, TokenBudgetBatchSampler


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 50), min_size=1, max_size=120),
    extra=st.integers(0, 200),
    seed=st.integers(0, 2**31),
    mode=st.sampled_from(["window", "strict"]),
)
def test_budget_and_coverage(lengths, extra, seed, mode):
    lens = np.array(lengths)
    budget = int(lens.max()) + extra
    gb = GlobalBatching(lens, budget, seed=seed, budget_mode=mode)
    for epoch in (0, 1):
        batches = gb.batches(epoch)
        ids = np.concatenate(batches)
        assert sorted(ids.tolist()) == list(range(lens.size))  # every sample once per epoch
        sums = [int(lens[b].sum()) for b in batches]
        assert all(len(b) > 0 for b in batches)
        if mode == "strict":
            assert max(sums) <= budget
            # a step closes only when the next sample would not fit
            for b, nxt in zip(batches[:-1], batches[1:]):
                assert int(lens[b].sum()) + int(lens[nxt[0]]) > budget
        else:
            # the same count in every epoch, whatever the order
            assert len(batches) == (int(lens.sum()) - int(lens.max())) // budget + 1
            assert all(s < budget + lens.max() for s in sums)
            # each step starts inside its own token window
            starts = np.cumsum(sums) - sums
            assert all(i * budget <= s < (i + 1) * budget for i, s in enumerate(starts))


def test_deterministic_and_reshuffled_per_epoch():
    lens = np.random.default_rng(0).integers(2, 100, size=500)
    a, b = GlobalBatching(lens, 1000, seed=5), GlobalBatching(lens, 1000, seed=5)
    for e in (0, 1, 2):
        assert all(np.array_equal(x, y) for x, y in zip(a.batches(e), b.batches(e)))
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), GlobalBatching(lens, 1000, seed=6).order(0))
    assert np.array_equal(GlobalBatching(lens, 1000, shuffle=False).order(3), np.arange(500))


def test_budget_below_longest_sample_is_an_error():
    with pytest.raises(DataError, match="tokens_per_step=10 is smaller than the longest sample"):
        GlobalBatching(np.array([5, 11]), 10)


def test_sampler_position_and_resume():
    lens = np.random.default_rng(1).integers(2, 60, size=200)
    gb = GlobalBatching(lens, 300, seed=2)
    n = gb.num_steps(0)
    s = TokenBudgetBatchSampler(gb)
    assert len(s) == n
    it = iter(s)
    first = [next(it) for _ in range(4)]
    assert first == [(0, i) for i in range(4)]
    state = s.state_dict()
    assert (state["epoch"], state["step"]) == (0, 4)
    t = TokenBudgetBatchSampler(GlobalBatching(lens, 300, seed=2))
    t.load_state_dict(state)
    assert list(t)[:2] == [(0, 4), (0, 5)]
    assert (t.epoch, t.step) == (1, 0)  # a finished epoch moves on to the next
    t.set_epoch(1)  # Lightning calls this at the epoch start: same epoch, position kept
    assert next(iter(t)) == (1, 0)
    t.set_epoch(3)
    assert (t.epoch, t.step) == (3, 0)
    other = TokenBudgetBatchSampler(GlobalBatching(lens, 301, seed=2))
    with pytest.raises(ResumeMismatchError, match="tokens_per_step: saved 300, now 301"):
        other.load_state_dict(state)
