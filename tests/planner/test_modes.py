"""Attention modes: the Ulysses and hybrid cost terms against counts by hand, where the heads and
nodes allow each mode, the plan checks, the digest and the per-mode statistics."""

from __future__ import annotations

import math

import pytest

from lightning_bytescale.planner import (
    CostModel,
    Plan,
    PlanError,
    PlannerConfig,
    PlannerConfigError,
    PlanValidationError,
    make_plan,
)
from lightning_bytescale.planner.cost_model import ULYSSES_PASSES
from lightning_bytescale.planner.modes import (
    GroupLayout,
    allowed_modes,
    best_mode,
    group_layout,
    hybrid_groups,
    likely_layout,
    mode_time,
    parse_modes,
)
from lightning_bytescale.planner.plan import MicroBatch, Piece
from lightning_bytescale.planner.zigzag import all_member_ranges

HEAD_BYTES = 128 * 2  # one head's vector of one token: head_dim 128 in bf16


def _model(heads: int, kv_heads: int, **kw) -> CostModel:
    base = dict(a=1e-11, b=1e-7, num_layers=4, bandwidth_intra=100e9, bandwidth_inter=10e9, ranks_per_node=4)
    base.update(kw)
    return CostModel(
        **base,
        kv_bytes_per_token_per_layer=2 * kv_heads * HEAD_BYTES,
        attention_heads=heads,
        kv_heads=kv_heads,
    )


def _received_by_hand(heads: int, kv_heads: int, n: int, tokens: int) -> int:
    """Bytes the busiest member of a Ulysses group receives in one pass, element by element.

    Member ``m`` computes query heads ``m H / n .. (m + 1) H / n - 1`` and reads the K/V heads
    those belong to (query head ``h`` reads K/V head ``h // (H / K)``).  From every other member it
    receives that member's ``tokens`` rows of q for its query heads and of k and v for the K/V
    heads it reads, and, after attention, the other member's output heads for its own tokens.
    """
    group = heads // kv_heads

    def q_heads(m: int) -> range:
        return range(m * heads // n, (m + 1) * heads // n)

    def kv_read(m: int) -> set[int]:
        return {h // group for h in q_heads(m)}

    busiest = 0
    for m in range(n):
        got = 0
        for src in range(n):
            if src == m:
                continue
            got += tokens * (len(q_heads(m)) + 2 * len(kv_read(m))) * HEAD_BYTES  # q, k, v in
            got += tokens * len(q_heads(src)) * HEAD_BYTES  # src's output heads for my tokens
        busiest = max(busiest, got)
    return busiest


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n"),
    [(8, 4, 2), (8, 2, 4), (32, 8, 8), (32, 8, 16), (40, 8, 5), (12, 4, 6), (8, 8, 8), (64, 8, 32)],
)
def test_all_to_all_volume_matches_a_count_by_hand(heads, kv_heads, n):
    cm = _model(heads, kv_heads)
    tokens = 6 * n  # a member's slots
    by_hand = _received_by_hand(heads, kv_heads, n, tokens)
    # one pass on the intra-node link, then both passes
    assert cm.ulysses_exchange(tokens, n, intra=True) == pytest.approx(
        ULYSSES_PASSES * by_hand / cm.bandwidth_intra, rel=1e-12
    )
    assert cm.ulysses_exchange(tokens, n, intra=False) == pytest.approx(
        ULYSSES_PASSES * by_hand / cm.bandwidth_inter, rel=1e-12
    )
    if kv_heads % n == 0:  # K/V heads split: the (2 d + 2 d_kv) s / n elements, (n-1)/n leaving
        d, d_kv, s = heads * 128, kv_heads * 128, tokens * n
        assert by_hand == pytest.approx((2 * d + 2 * d_kv) * s / n * (n - 1) / n * 2, rel=1e-12)


def test_replicated_kv_heads_cost_more_volume_than_a_split():
    cm = _model(32, 8)
    assert cm.ulysses_kv_heads(4) == 2  # split: 8 K/V heads over 4 members
    assert cm.ulysses_kv_heads(16) == 1  # each K/V head read whole by the 2 members its 4 query heads span
    one_pass = cm.ulysses_exchange(1, 16, intra=True) * cm.bandwidth_intra / ULYSSES_PASSES
    assert one_pass == pytest.approx(15 * (2 * 32 / 16 + 2 * 1) * HEAD_BYTES)
    assert one_pass > 15 * (2 * 32 / 16 + 2 * 8 / 16) * HEAD_BYTES  # what a split could have moved
    assert _model(40, 8).ulysses_kv_heads(5) == 3  # member 1's 8 query heads span K/V heads 1, 2, 3


def test_hybrid_ring_carries_a_node_groups_tokens_for_its_kv_heads():
    cm = _model(32, 8, ranks_per_node=4)
    lengths, n, u = [64 * 1024], 16, 4
    slots = 2 * math.ceil(lengths[0] / (2 * n))
    linear, attention, transfer, exchange = cm.hybrid_parts(lengths, n, u)
    # each ring step a member sends k and v of u x its tokens for its 2 K/V heads (8 / 4), 3 passes, 3 steps
    by_hand = 3 * (n // u - 1) * 2 * (u * slots) * (8 // u) * HEAD_BYTES
    assert transfer == pytest.approx(by_hand / cm.bandwidth_inter, rel=1e-12)
    assert exchange == pytest.approx(
        ULYSSES_PASSES * _received_by_hand(32, 8, u, slots) / cm.bandwidth_intra, rel=1e-12
    )
    assert linear == pytest.approx(cm.b * slots + cm.g) and attention == pytest.approx(
        cm.a * lengths[0] ** 2 / n
    )
    t, exposed = cm.hybrid_member_time(lengths, n, u)
    assert exposed == pytest.approx(cm.num_layers * (max(0.0, transfer - attention) + exchange))
    assert t == pytest.approx(cm.num_layers * (linear + attention) + exposed)
    # the ring across nodes moves 1/u of a plain ring's K/V per step (K/V heads split over the node)
    ring_transfer = cm.ring_parts(lengths, n)[2]
    assert transfer == pytest.approx(ring_transfer * (n // u - 1) / (n - 1), rel=1e-12)


def test_ulysses_member_time_is_local_attention_split_n_ways_plus_the_exchange():
    cm = _model(32, 8)
    lengths, n = [30_000, 2_001], 8
    linear, attention, exchange = cm.ulysses_parts(lengths, n, intra=True)
    ring_linear, ring_attention, _ = cm.ring_parts(lengths, n, intra=True)
    assert (linear, attention) == (ring_linear, ring_attention)
    t, exposed = cm.ulysses_member_time(lengths, n, intra=True)
    assert exposed == pytest.approx(cm.num_layers * exchange) and t == pytest.approx(
        cm.num_layers * (linear + attention + exchange)
    )
    assert cm.ulysses_member_time(lengths, n, intra=True, comm_aware=False)[0] == pytest.approx(
        cm.num_layers * (linear + attention)
    )


def test_modes_are_refused_where_the_heads_do_not_allow_them():
    cm = _model(12, 4, ranks_per_node=8)
    assert [n for n in range(2, 13) if cm.ulysses_allowed(n)] == [2, 3, 4, 6, 12]
    assert allowed_modes(cm, GroupLayout(8, True)) == ("ring",)
    assert allowed_modes(cm, GroupLayout(6, True)) == ("ring", "ulysses")
    assert allowed_modes(cm, GroupLayout(16, False, 8)) == ("ring",)  # 8 members a node: 8 does not divide 12
    assert allowed_modes(cm, GroupLayout(16, False, 4)) == ("ring", "hybrid")
    with pytest.raises(PlanError, match="must divide attention_heads"):
        cm.ulysses_kv_heads(8)
    no_heads = CostModel.paper_preset()
    assert allowed_modes(no_heads, GroupLayout(8, True)) == ("ring",)
    assert not no_heads.ulysses_allowed(2)


def test_the_planner_never_runs_a_mode_the_heads_refuse():
    # 12 query heads: Ulysses over 2, 3, 4, 6 or 12 ranks; hybrid with 2, 3, 4 or 6 a node
    cm = _model(12, 4, a=1e-13, bandwidth_inter=2e9, ranks_per_node=8)
    lengths = [200_000, 150_000, 90_000, 60_000, 40_000] + [3000] * 60
    plan = make_plan(lengths, world_size=32, capacity=8192, cost_model=cm, offload=False).validate()
    used = set()
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.ring is None or mb.mode == "ring":
                continue
            layout = group_layout(mb.ring, 8)
            used.add(mb.mode)
            assert 12 % (len(mb.ring) if mb.mode == "ulysses" else layout.per_node) == 0
    assert used  # the check above saw items in other modes


def test_parse_modes_and_the_planner_option_refuse_what_cannot_run():
    assert parse_modes(None) == ("ring", "ulysses", "hybrid")
    assert parse_modes("hybrid, ring") == ("ring", "hybrid")
    assert parse_modes(["ulysses", "ring", "ring"]) == ("ring", "ulysses")
    with pytest.raises(PlanError, match="'ulyses' is not one"):
        parse_modes(["ring", "ulyses"])
    with pytest.raises(PlanError, match="lacks 'ring'"):
        parse_modes(("ulysses",))
    lengths = [40_000, 500, 700]
    with pytest.raises(PlanError, match="need the cost model's attention_heads and kv_heads"):
        make_plan(lengths, world_size=8, capacity=8192, modes=("ring", "ulysses"))
    # the default: every mode the heads allow, so no heads means the ring only
    assert (
        make_plan(lengths, world_size=8, capacity=8192).digest()
        == make_plan(lengths, world_size=8, capacity=8192, modes=("ring",)).digest()
    )


def test_the_modes_option_is_checked_when_the_config_is_made():
    with pytest.raises(PlannerConfigError, match="lacks 'ring'"):
        PlannerConfig(options={"modes": ["ulysses"]})
    with pytest.raises(PlannerConfigError, match="need the cost model's attention_heads"):
        PlannerConfig(options={"modes": "ring,hybrid"})  # the paper preset names no heads
    with pytest.raises(PlannerConfigError, match="modes must be None, a list"):
        PlannerConfig(options={"modes": 3})
    cfg = PlannerConfig(cost_model=_model(32, 8), options={"modes": ["ring", "hybrid"]})
    assert cfg.planner_kwargs() == {"modes": ["ring", "hybrid"]}
    PlannerConfig(planner="naive", options={"modes": ["ulysses"]})  # balance's option: kept, not passed


def test_cost_model_heads_are_checked_and_left_out_of_files_when_unknown():
    with pytest.raises(PlanError, match="go together"):
        CostModel(a=1.0, b=1.0, attention_heads=8)
    with pytest.raises(PlanError, match="multiple of kv_heads"):
        CostModel(a=1.0, b=1.0, attention_heads=8, kv_heads=3)
    with pytest.raises(PlanError, match="integer >= 1"):
        CostModel(a=1.0, b=1.0, attention_heads=0, kv_heads=1)
    assert "attention_heads" not in CostModel.paper_preset().to_json_dict()
    shaped = CostModel.from_model_shape(32, 4096, 32, 8, 11008, 32000)
    assert (shaped.attention_heads, shaped.kv_heads) == (32, 8)
    assert CostModel.from_json_dict(shaped.to_json_dict()) == shaped


def test_layouts_of_members_on_nodes():
    assert group_layout((0, 1, 2, 3), 4) == GroupLayout(4, True)
    assert group_layout((0, 1, 4, 5), 4) == GroupLayout(4, False, 2)
    assert group_layout((0, 1, 2, 4, 5, 6), 4) == GroupLayout(6, False, 3)
    assert group_layout((0, 1, 2, 4, 5), 4) == GroupLayout(5, False)  # 3 + 2: uneven
    assert group_layout((0, 4, 1, 5), 4) == GroupLayout(4, False)  # a node's members not consecutive
    assert group_layout((0, 4), 4) == GroupLayout(2, False)  # one member a node: a plain ring
    assert group_layout((0, 1), None) == GroupLayout(2, False)
    assert hybrid_groups((8, 9, 10, 11, 20, 21, 22, 23), 4) == ((8, 9, 10, 11), (20, 21, 22, 23))
    with pytest.raises(PlanError, match="cannot run hybrid"):
        hybrid_groups((0, 1, 2, 4, 5), 4)
    cm = _model(32, 8, ranks_per_node=8)
    assert likely_layout(24, 8, cm, False) == GroupLayout(24, False, 8)
    assert likely_layout(12, 8, cm, False) == GroupLayout(12, False, 4)  # 6 a node would not divide 32
    assert likely_layout(8, 8, cm, True) == GroupLayout(8, True)


def test_best_mode_takes_the_least_time_and_the_ring_on_ties():
    cm = _model(32, 8, ranks_per_node=8)
    short, long = [16 * 1024], [2**21]
    # a short sequence on 32 ranks over 4 nodes: the ring is communication-bound, Ulysses x ring is not
    layout = GroupLayout(32, False, 8)
    pick = best_mode(cm, short, layout)
    times = {m: mode_time(cm, m, short, layout)[0] for m in ("ring", "ulysses", "hybrid")}
    assert pick.mode == min(times, key=times.get) == "hybrid" and pick.time == times["hybrid"]
    # a long one hides its ring transfer behind attention: the ring, whose exchange nothing adds to
    assert best_mode(cm, long, GroupLayout(8, True)).mode == "ring"
    free = cm.with_(bandwidth_intra=None, bandwidth_inter=None)  # no links modelled: every mode ties
    assert best_mode(free, short, layout).mode == "ring"
    assert best_mode(cm, short, layout, ("ring",)).mode == "ring"


def _ring_plan(mode: str, ring=(0, 1, 2, 3), rpn=2, heads=8, kv_heads=2) -> Plan:
    lengths = (1000, 40)
    ranks: list[list[MicroBatch]] = [[] for _ in range(4)]
    for m, r in enumerate(ring):
        pieces = [Piece(0, all_member_ranges(1000, len(ring))[m])]
        ranks[r].append(MicroBatch(pieces=pieces, ring=tuple(ring), item=0, est_time=1.0, mode=mode))
    ranks[0].append(MicroBatch(pieces=[Piece(1, ((0, 40),))], est_time=0.1))
    cm = _model(heads, kv_heads, ranks_per_node=rpn).to_json_dict()
    return Plan(4, 512, "hand", lengths, ranks, {"cost_model": cm, "ranks_per_node": rpn})


def test_plan_checks_reject_invalid_modes():
    for mode in ("ring", "ulysses", "hybrid"):
        _ring_plan(mode).validate()
    with pytest.raises(PlanValidationError, match="attention mode 'ulises'"):
        _ring_plan("ulises").validate()
    bad = _ring_plan("ring")
    bad.ranks[0][1].mode = "ulysses"
    with pytest.raises(PlanValidationError, match="is local but has attention mode 'ulysses'"):
        bad.validate()
    bad = _ring_plan("ulysses")
    bad.ranks[2][0].mode = "ring"
    with pytest.raises(PlanValidationError, match="mode ulysses vs ring"):
        bad.validate()
    with pytest.raises(PlanValidationError, match="do not divide the 6 query heads"):
        _ring_plan("ulysses", heads=6).validate()
    with pytest.raises(PlanValidationError, match="do not form whole node groups"):
        _ring_plan("hybrid", rpn=4).validate()  # one node: a Ulysses item, not a hybrid one
    with pytest.raises(PlanValidationError, match="do not form whole node groups"):
        _ring_plan("hybrid", ring=(0, 2, 1, 3)).validate()
    with pytest.raises(PlanValidationError, match="2 members a node, which do not divide the 9"):
        _ring_plan("hybrid", heads=9, kv_heads=3).validate()


def test_digest_covers_every_mode_but_the_ring():
    ring, uly, hyb = (_ring_plan(m) for m in ("ring", "ulysses", "hybrid"))
    assert len({ring.digest(), uly.digest(), hyb.digest()}) == 3
    back = Plan.from_json_dict(hyb.to_json_dict())
    assert back.digest() == hyb.digest() and back.ranks[1][0].mode == "hybrid"
    old = ring.to_json_dict()
    for entry in old["ranks"]:
        for mb in entry["micro_batches"]:
            del mb["mode"]  # a file written before modes existed
    assert Plan.from_json_dict(old).digest() == ring.digest()


def test_mode_stats_count_items_and_bytes_per_mode():
    cm = CostModel.from_json_dict(_ring_plan("ring").options["cost_model"])
    lengths = [1000]
    for mode, want in (
        ("ring", cm.ring_bytes(lengths, 4)),
        ("ulysses", cm.ulysses_bytes(lengths, 4)),
        ("hybrid", sum(cm.hybrid_bytes(lengths, 4, 2))),
    ):
        stats = _ring_plan(mode).stats()
        counts = {m: int(m == mode) for m in ("ring", "ulysses", "hybrid")}
        assert stats["mode_counts"] == counts
        assert stats["comm_bytes_by_mode"][mode] == pytest.approx(want) and want > 0
        assert stats["ring_bytes"] == pytest.approx(want)
    # by hand: Ulysses over 4 members of 250 slots each, 8 query and 2 K/V heads (one each), 4 layers
    by_hand = 4 * 4 * ULYSSES_PASSES * 3 * 250 * (2 + 2 * 1 + 2) * HEAD_BYTES
    assert cm.ulysses_bytes(lengths, 4) == pytest.approx(by_hand)


@pytest.mark.parametrize(("s", "n", "u"), [(1024, 8, 4), (96, 6, 3), (1003, 8, 2), (77, 12, 4)])
def test_a_hybrid_node_group_holds_a_zigzag_share_of_the_ring_across_nodes(s, n, u):
    def merged(ranges):
        out = []
        for a, b in sorted(ranges):
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            elif b > a:
                out.append((a, b))
        return out

    shares = all_member_ranges(s, n)
    for j in range(n // u):
        union = merged([x for m in range(j * u, (j + 1) * u) for x in shares[m]])
        assert len(union) <= 2  # a front block and its mirror
        if s % (2 * n) == 0:  # no padding: exactly member j's share of a ring of n / u
            assert union == merged(all_member_ranges(s, n // u)[j])
