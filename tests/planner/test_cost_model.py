"""Cost model formulas against hand-computed cases, fits, presets and Eq. 3 properties."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bytescale.planner.cost_model import (
    PAPER_TABLE_ATTENTION_MS,
    PAPER_TABLE_LENGTHS,
    PAPER_TABLE_MLP_MS,
    CostModel,
    OffloadConfig,
    eq3_ranks,
    fits_capacity,
    max_offload_ratio,
    member_slots,
    offload_options,
    ranks_with_offload,
    ranks_without_offload,
)
from lightning_bytescale.planner.errors import PlanError

# a = 1e-9 s/token^2, b = 1e-6 s/token, K/V 1000 B/token/layer, 1 GB/s between nodes, 1 pass
HAND = CostModel(
    a=1e-9,
    b=1e-6,
    g=0.0,
    num_layers=2,
    kv_bytes_per_token_per_layer=1000.0,
    bandwidth_inter=1e9,
    comm_passes=1.0,
)


def test_layer_and_local_time_by_hand():
    m = CostModel(a=2.0, b=3.0, g=5.0, c=7.0, d=11.0, num_layers=4)
    assert m.layer_time(10) == 2 * 100 + 30 + 5
    assert m.act_bytes(10) == 81
    # local pack: sum of per-sequence terms, g once, times layers
    assert m.local_time([10, 1]) == 4 * ((200 + 30) + (2 + 3) + 5)


def test_ring_member_time_by_hand():
    # s = 1000 on 4 ranks: c = 125, 250 slots per member
    lin, att, tr = HAND.ring_parts([1000], 4)
    assert lin == pytest.approx(250 * 1e-6)
    assert att == pytest.approx(1e-9 * 1000**2 / 4)  # 2.5e-4
    assert tr == pytest.approx(3 * 250 * 1000 / 1e9)  # (N-1) * member slots * kv / bw = 7.5e-4
    t, exposed = HAND.ring_member_time([1000], 4)
    assert t == pytest.approx(2 * (2.5e-4 + 7.5e-4))
    assert exposed == pytest.approx(2 * 5e-4)
    t0, exposed0 = HAND.ring_member_time([1000], 4, comm_aware=False)
    assert t0 == pytest.approx(2 * (2.5e-4 + 2.5e-4))
    assert exposed0 == pytest.approx(exposed)  # reported either way
    # a ring of one is local work
    assert HAND.ring_member_time([1000], 1) == (HAND.local_time([1000]), 0.0)


def test_crossover_length_by_hand():
    # s* = passes (n-1) kv / (a bw) = 3 * 1000 / (1e-9 * 1e9) = 3000 for n = 4
    assert HAND.crossover_length(4) == pytest.approx(3000)
    _, att, tr = HAND.ring_parts([3000], 4)  # 3000 / 8 = 375 exactly: no padding
    assert att == pytest.approx(tr)
    _, att, tr = HAND.ring_parts([2000], 4)
    assert tr > att  # below the crossover: communication-bound
    _, att, tr = HAND.ring_parts([4000], 4)
    assert att > tr  # above: hidden
    assert HAND.ring_member_time([4000], 4)[1] == 0.0


def test_intra_node_bandwidth_is_used_for_intra_rings():
    m = HAND.with_(bandwidth_intra=1e10)
    assert m.ring_parts([1000], 4, intra=True)[2] == pytest.approx(HAND.ring_parts([1000], 4)[2] / 10)
    assert m.crossover_length(4, intra=True) == pytest.approx(300)
    # a missing link falls back to the other one; no K/V bytes means no transfer at all
    assert CostModel(a=1, b=1, kv_bytes_per_token_per_layer=1, bandwidth_intra=5.0).bandwidth(False) == 5.0
    assert CostModel(a=1, b=1, bandwidth_inter=1.0).ring_parts([100], 4)[2] == 0.0


def test_ring_bytes_by_hand():
    # 4 members each receive 3 shares of 250 slots, 2 layers, 1 pass, 1000 B
    assert HAND.ring_bytes([1000], 4) == pytest.approx(4 * 3 * 250 * 1000 * 2)
    assert HAND.ring_bytes([1000], 1) == 0.0


def test_from_model_shape_llama7b_numbers():
    m = CostModel.from_model_shape(32, 4096, 32, 8, 11008, 32000, flops_per_s=1e15, dtype_bytes=2)
    assert m.a == pytest.approx(3 * 2 * 4096 / 1e15)
    dense = 2 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 11008) + 2 * 4096 * 32000 / 32
    assert m.b == pytest.approx(3 * dense / 1e15)
    assert m.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert m.c == 2 * (6 * 4096 + 2 * 1024 + 3 * 11008)
    assert m.num_layers == 32
    with pytest.raises(PlanError, match="divide"):
        CostModel.from_model_shape(2, 100, 3, 1, 10, 10)


def test_fit_recovers_coefficients_and_stays_non_negative():
    xs = [1000, 2000, 4000, 8000, 16000]
    m = CostModel.fit(
        xs, [3e-9 * x * x + 2e-6 * x + 1e-4 for x in xs], act_lengths=xs, act_bytes=[5 * x + 7 for x in xs]
    )
    assert (m.a, m.b, m.g) == pytest.approx((3e-9, 2e-6, 1e-4), rel=1e-6)
    assert (m.c, m.d) == pytest.approx((5, 7), rel=1e-6)
    # data that an unconstrained fit would give a negative intercept: all coefficients >= 0
    m2 = CostModel.fit([1, 2, 3], [0.0, 1.0, 2.5])
    assert min(m2.a, m2.b, m2.g) >= 0
    with pytest.raises(PlanError):
        CostModel.fit([1, 2], [1.0])


def test_paper_preset_fits_the_table_and_states_its_links():
    m = CostModel.paper_preset()
    for s, att, mlp in zip(PAPER_TABLE_LENGTHS, PAPER_TABLE_ATTENTION_MS, PAPER_TABLE_MLP_MS):
        fwd_ms = m.forward_layer_time(s) * 1e3
        assert fwd_ms == pytest.approx(att + mlp, rel=0.10), s
    assert m.kv_bytes_per_token_per_layer == 4096
    assert (m.bandwidth_intra, m.bandwidth_inter, m.ranks_per_node) == (150e9, 25e9, 8)
    # crossover (tokens per rank, large rings): between nodes above 8K, inside a node a few K
    per_rank_inter = m.crossover_length(1000) / 1000
    per_rank_intra = m.crossover_length(1000, intra=True) / 1000
    assert 8000 < per_rank_inter < 25000
    assert 1000 < per_rank_intra < 5000
    # Fig. 21 calibration: r* = 0.5 at 64K, 1.0 at 256K with 25 GB/s PCIe
    link = OffloadConfig(layers_per_rank=32)
    assert max_offload_ratio(65536, m, link) == pytest.approx(0.5, abs=1e-6)
    assert max_offload_ratio(262144, m, link) == 1.0


def test_json_round_trip_and_unknown_fields():
    m = CostModel.paper_preset()
    d = json.loads(json.dumps(m.to_json_dict()))
    assert CostModel.from_json_dict(d) == m
    with pytest.raises(PlanError, match="unknown cost model field"):
        CostModel.from_json_dict({**d, "alpha": 1})
    with pytest.raises(PlanError, match="num_layers"):
        CostModel(a=1, b=1, num_layers=0)
    with pytest.raises(PlanError, match="bandwidth_inter"):
        CostModel(a=1, b=1, bandwidth_inter=0.0)


@pytest.mark.parametrize(
    ("s", "c", "d"),
    [
        (1, 2, 1),
        (8192, 8192, 1),
        (8193, 8192, 2),
        (16384, 8192, 2),
        (16385, 8192, 3),
        (8, 7, 2),
        (13, 7, 3),
        (7, 7, 1),
    ],
)
def test_ranks_without_offload_by_hand(s, c, d):
    assert ranks_without_offload(s, c) == d


@settings(max_examples=200, deadline=None)
@given(s=st.integers(1, 10**6), c=st.integers(2, 5000))
def test_ranks_without_offload_is_the_fewest_that_fit(s, c):
    d = ranks_without_offload(s, c)
    assert member_slots(s, d) <= c
    assert d == 1 or member_slots(s, d - 1) > c
    if c % 2 == 0:
        assert d == math.ceil(s / c)


def test_ranks_without_offload_rejects_bad_input():
    with pytest.raises(PlanError, match="capacity"):
        ranks_without_offload(10, 1)
    with pytest.raises(PlanError, match="length"):
        ranks_without_offload(0, 10)


COST = CostModel(a=3e-11, b=0.0, c=100.0, num_layers=10)


@settings(max_examples=150, deadline=None)
@given(s=st.integers(1, 200_000), c=st.integers(100, 5000), layers=st.integers(1, 40))
def test_eq3_properties(s, c, layers):
    link = OffloadConfig(layers_per_rank=layers, bandwidth_d2h=2e9, bandwidth_h2d=1e9)
    d0 = ranks_without_offload(s, c)
    d, r = ranks_with_offload(s, c, COST, link)
    r_star = max_offload_ratio(s, COST, link)
    assert d <= d0
    if s <= c:
        assert (d, r) == (1, 0.0)
    if r > 0:
        assert d < d0  # any offload saves at least one rank
        assert r <= r_star + 1e-12  # and hides behind the forward
        assert COST.forward_layer_time(s) >= r * COST.act_bytes(s) / link.bandwidth - 1e-15
        assert eq3_ranks(s, r, c, COST, link) <= d + 1  # Eq. 3 (no padding) agrees up to padding
    else:
        assert d == d0
    for dd, rr in offload_options(s, c, COST, link):
        assert fits_capacity(member_slots(s, dd), rr, c, link)
    ds = [eq3_ranks(s, k / 10, c, COST, link) for k in range(11)]
    assert all(x >= y for x, y in zip(ds, ds[1:]))
