"""Properties of the cost-model refit on synthetic micro-batches priced by a known model.

Each example draws true coefficients ``a``, ``b``, ``g``, a window of local micro-batches (a few
documents each) and their times from the true model, priced here by hand (``L (a sum s^2 + b sum s
+ g)``), then checks what the refit must do whatever the numbers: recover the coefficients,
ignore a minority of wild samples, stay within its bound, and give the same bits for the same
samples in any order.
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner.cost_features import Work
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import CostRefit, RefitConfig, Sample, refit_model

LAYERS = 8
coefficient = st.floats(min_value=1e-10, max_value=1e-8)  # a: seconds per attention-area token pair
per_token = st.floats(min_value=1e-7, max_value=1e-5)
overhead = st.floats(min_value=1e-5, max_value=1e-3)


def _works(seed: int, n: int) -> list[Work]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        docs = [max(8, int(rng.lognormvariate(5.0, 1.0))) for _ in range(rng.randint(1, 6))]
        out.append(Work(area=float(sum(s * s for s in docs)), tokens=float(sum(docs))))
    return out


def _seconds(a: float, b: float, g: float, w: Work) -> float:
    return LAYERS * (a * w.area + b * w.tokens + g)


def _start(a: float, b: float, g: float, factor: float) -> CostModel:
    return CostModel(a=a * factor, b=b / factor, g=g * factor, num_layers=LAYERS, name="start")


def _bits(cost: CostModel) -> tuple[str, ...]:
    return tuple(float(v).hex() for v in (cost.a, cost.b, cost.g))


@settings(max_examples=60, deadline=None)
@given(a=coefficient, b=per_token, g=overhead, seed=st.integers(0, 10**6), off=st.floats(0.6, 1.6))
def test_exact_timings_give_back_the_true_coefficients(a, b, g, seed, off):
    pool = [Sample(_seconds(a, b, g, w), (w,)) for w in _works(seed, 40)]
    got, clamped = refit_model(_start(a, b, g, off), _start(a, b, g, off), pool, RefitConfig(max_change=4.0))
    assert not clamped
    for name, want in (("a", a), ("b", b), ("g", g)):
        assert math.isclose(getattr(got, name), want, rel_tol=1e-6), (name, getattr(got, name), want)


@settings(max_examples=40, deadline=None)
@given(
    a=coefficient, b=per_token, g=overhead, seed=st.integers(0, 10**6),
    wild=st.lists(st.integers(0, 59), min_size=1, max_size=8, unique=True),
    slow=st.floats(5.0, 200.0) | st.floats(0.02, 0.2),
)  # fmt: skip
def test_a_minority_of_wild_samples_hardly_moves_the_fit(a, b, g, seed, wild, slow):
    """Up to 8 of 60 samples (13%) 5 to 200 times slower, or 5 to 50 times faster (a clock
    glitch); the rest with 3% noise."""
    rng = random.Random(seed)
    pool = []
    for i, w in enumerate(_works(seed, 60)):
        t = _seconds(a, b, g, w) * math.exp(rng.gauss(0.0, 0.03))
        pool.append(Sample(t * slow if i in wild else t, (w,)))
    start = _start(a, b, g, 1.0)
    got, _ = refit_model(start, start, pool, RefitConfig(max_change=4.0))
    works = [s.work[0] for s in pool]
    errors = sorted(abs(_seconds(got.a, got.b, got.g, w) / _seconds(a, b, g, w) - 1.0) for w in works)
    assert errors[len(errors) // 2] < 0.03  # the refitted model prices the clean work within the noise


@settings(max_examples=60, deadline=None)
@given(
    a=coefficient, b=per_token, g=overhead, seed=st.integers(0, 10**6),
    scale=st.floats(1e-3, 1e3), bound=st.floats(1.1, 8.0),
)  # fmt: skip
def test_no_update_moves_a_coefficient_beyond_the_bound(a, b, g, seed, scale, bound):
    """Whatever the measured times (here the truth times up to 1000x off, and uneven), every
    coefficient lands within ``[old / F, old x F]``, and a clamp is reported exactly when the fit
    wanted more."""
    rng = random.Random(seed)
    pool = [Sample(_seconds(a, b, g, w) * scale * rng.uniform(0.5, 2.0), (w,)) for w in _works(seed, 30)]
    start = _start(a, b, g, 1.0)
    got, clamped = refit_model(start, start, pool, RefitConfig(max_change=bound))
    for name in ("a", "b", "g"):
        old, new = getattr(start, name), getattr(got, name)
        assert old / bound * (1 - 1e-12) <= new <= old * bound * (1 + 1e-12), (name, old, new, bound)
        if name in clamped:
            want, kept = clamped[name]
            assert kept == new and (want > old * bound or want < old / bound)


@settings(max_examples=30, deadline=None)
@given(
    a=coefficient, b=per_token, g=overhead, seed=st.integers(0, 10**6), perm=st.randoms(use_true_random=False)
)
def test_the_same_samples_in_any_order_give_the_same_bits(a, b, g, seed, perm):
    """Ranks may gather a step's samples in another order: the model must not change by one bit."""
    rng = random.Random(seed)
    pool = [Sample(_seconds(a, b, g, w) * math.exp(rng.gauss(0.0, 0.1)), (w,)) for w in _works(seed, 40)]
    start = _start(a, b, g, 1.3)
    first, _ = refit_model(start, start, pool, RefitConfig())
    shuffled = list(pool)
    perm.shuffle(shuffled)
    second, _ = refit_model(start, start, shuffled, RefitConfig())
    assert _bits(first) == _bits(second)


@settings(max_examples=15, deadline=None)
@given(a=coefficient, b=per_token, g=overhead, seed=st.integers(0, 10**6), off=st.sampled_from([0.01, 30.0]))
def test_a_far_start_converges_step_by_step_within_the_bound(a, b, g, seed, off):
    """From a model 30-100x off, each update at most doubles or halves; after enough steps the
    refit sits on the truth (the noise is 2%)."""
    refit = CostRefit(_start(a, b, g, off), RefitConfig(lag=1, warmup_steps=0, window=4, max_change=2.0))
    rng = random.Random(seed)
    for step in range(24):
        works = _works(seed * 100 + step, 12)
        refit.observe(
            step, [Sample(_seconds(a, b, g, w) * math.exp(rng.gauss(0.0, 0.02)), (w,)) for w in works]
        )
    cur = refit.current
    probe = _works(seed + 1, 50)
    errors = sorted(abs(_seconds(cur.a, cur.b, cur.g, w) / _seconds(a, b, g, w) - 1.0) for w in probe)
    assert errors[len(errors) // 2] < 0.05, errors[len(errors) // 2]
