"""Packed micro-batch builder: labels, positions, padding, zigzag slots, errors, and a fuzz."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_bytescale.engine.micro_batch import (
    EmptyBatchError,
    PackingError,
    build_micro_batch,
    build_step,
    count_loss_tokens,
)
from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


def make_tokens(lengths):
    """Sequence j holds the distinct ids 1000*j + 1 .. 1000*j + s (never 0, the padding id)."""
    data = [np.arange(1000 * j + 1, 1000 * j + 1 + s, dtype=np.int64) for j, s in enumerate(lengths)]
    return lambda j: data[j]


def local_mb(seqs, lengths):
    return MicroBatch(pieces=[Piece(j, ((0, lengths[j]),)) for j in seqs])


def ring_mb(seqs, lengths, ring, member, item=0):
    n = len(ring)
    pieces = [Piece(j, tuple(zigzag.member_ranges(lengths[j], n, member))) for j in seqs]
    return MicroBatch(pieces=pieces, ring=tuple(ring), item=item)


def test_local_micro_batch_concatenates_whole_sequences():
    lengths = [3, 5]
    mb = build_micro_batch(local_mb([1, 0], lengths), 0, make_tokens(lengths), num_global_tokens=6, index=2)
    assert mb.input_ids.tolist() == [1001, 1002, 1003, 1004, 1005, 1, 2, 3]
    assert mb.labels.tolist() == [1002, 1003, 1004, 1005, -100, 2, 3, -100]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb.layout.cu_seqlens == (0, 5, 8)
    assert mb.layout.seq_lens == (5, 3)
    assert mb.layout.ring is None and mb.seq_ids == (1, 0)
    assert mb.num_global_tokens == 6 and mb.index == 2
    assert torch.equal(mb.layout.positions(), mb.position_ids)
    assert bool(mb.layout.valid().all())


def test_ring_micro_batch_takes_zigzag_slots_with_labels_from_the_full_sequence():
    # s = 7 on a ring of 2: c = 2, chunks hold 1, 2, 2, 2 tokens (padding spread, docs/planner.md):
    # member 0 holds chunks 0 and 3 -> positions 0, 5, 6 and one padding slot (position 7, last).
    lengths = [7]
    tokens = make_tokens(lengths)
    m0 = build_micro_batch(ring_mb([0], lengths, (3, 1), 0), 3, tokens, num_global_tokens=6)
    m1 = build_micro_batch(ring_mb([0], lengths, (3, 1), 1), 1, tokens, num_global_tokens=6)
    assert m0.position_ids.tolist() == [0, 5, 6, 7]
    assert m0.input_ids.tolist() == [1, 6, 7, 0]
    assert m0.labels.tolist() == [2, 7, -100, -100]  # chunk boundary: label of position 0 is held by member 1
    assert m1.position_ids.tolist() == [1, 2, 3, 4]
    assert m1.input_ids.tolist() == [2, 3, 4, 5]
    assert m1.labels.tolist() == [3, 4, 5, 6]  # label of position 4 is token 5 (held by member 0)
    assert m0.layout.ring == (3, 1) and m0.layout.member == 0 and m1.layout.member == 1
    assert m0.layout.valid().tolist() == [True, True, True, False]
    for m in (m0, m1):
        assert m.layout.cu_seqlens == (0, 4)
        assert torch.equal(m.layout.positions(), m.position_ids)


def test_ring_micro_batch_packs_several_sequences_each_padded_to_2c():
    lengths = [5, 9, 2]
    tokens = make_tokens(lengths)
    ring = (0, 1, 2)
    mbs = [build_micro_batch(ring_mb([2, 0, 1], lengths, ring, m), r, tokens, 13) for m, r in enumerate(ring)]
    slots = [2 * zigzag.chunk_size(lengths[j], 3) for j in (2, 0, 1)]
    for m in mbs:
        assert list(m.layout.slots) == slots
        assert m.layout.seq_lens == (2, 5, 9)
        pad = ~m.layout.valid()
        assert (m.input_ids[pad] == 0).all() and (m.labels[pad] == -100).all()
    assert sum(int((m.labels != -100).sum()) for m in mbs) == 13


def test_count_loss_tokens_and_errors():
    assert count_loss_tokens([3, 5, 1]) == 6
    with pytest.raises(EmptyBatchError, match="zero loss tokens"):
        count_loss_tokens([1, 1])
    assert count_loss_tokens([1], allow_zero=True) == 0
    with pytest.raises(PackingError, match="length 0"):
        count_loss_tokens([4, 0])


def test_builder_rejects_inconsistent_plans():
    lengths = [6, 4]
    tokens = make_tokens(lengths)
    with pytest.raises(PackingError, match="not a member"):
        build_micro_batch(ring_mb([0], lengths, (0, 1), 0), 2, tokens, 8)
    bad = MicroBatch(pieces=[Piece(0, ((0, 3),))])
    with pytest.raises(PackingError, match="piece ranges"):
        build_micro_batch(bad, 0, tokens, 8)
    with pytest.raises(PackingError, match="plan says length"):
        build_micro_batch(local_mb([0], lengths), 0, tokens, 8, lengths=[7, 4])
    with pytest.raises(PackingError, match="single-rank ring"):
        build_micro_batch(MicroBatch([Piece(0, ((0, 6),))], ring=(0,), item=0), 0, tokens, 8)
    with pytest.raises(PackingError, match="integers"):
        build_micro_batch(local_mb([0], lengths), 0, lambda j: np.ones(6) * 0.5, 8)
    plan = Plan(2, 8, "hand", tuple(lengths), [[local_mb([0, 1], lengths)], []])
    with pytest.raises(PackingError, match="outside the plan's world size"):
        build_step(plan, 2, tokens)
    with pytest.raises(EmptyBatchError):
        build_step(Plan(1, 8, "hand", (1,), [[local_mb([0], [1])]]), 0, make_tokens([1]))


def test_build_step_fields_and_torch_or_list_tokens():
    lengths = [4, 3]
    plan = Plan(2, 8, "hand", tuple(lengths), [[local_mb([0], lengths), local_mb([1], lengths)], []])
    as_list = [list(range(1, 5)), list(range(5, 8))]
    step = build_step(plan, 0, lambda j: torch.tensor(as_list[j]), step=7)
    assert step.num_global_tokens == 5 and step.num_tokens == 7 and step.step == 7
    assert [m.index for m in step.micro_batches] == [0, 1]
    assert step.micro_batches[1].input_ids.tolist() == [5, 6, 7]
    other = build_step(plan, 1, lambda j: as_list[j])
    assert other.micro_batches == [] and other.digest == step.digest
    changed = Plan(2, 8, "hand", tuple(lengths), [[local_mb([0, 1], lengths)], []])
    assert build_step(changed, 1, lambda j: as_list[j]).digest != step.digest


# ----------------------------------------------------------------------------- fuzz


def random_plan(lengths: list[int], world: int, rng: random.Random) -> Plan:
    """Any valid plan shape: local packs and rings of any size/order, item ids in a global order."""
    ranks: list[list[MicroBatch]] = [[] for _ in range(world)]
    order = list(range(len(lengths)))
    rng.shuffle(order)
    item = 0
    while order:
        take = [order.pop() for _ in range(min(len(order), rng.randint(1, 3)))]
        n = rng.randint(1, world)
        ring = rng.sample(range(world), n)
        if n == 1:
            ranks[ring[0]].append(local_mb(take, lengths))
        else:
            for m, r in enumerate(ring):
                ranks[r].append(ring_mb(take, lengths, ring, m, item=item))
        item += 1
    return Plan(world, 4 * sum(lengths), "fuzz", tuple(lengths), ranks)


def check_step_batches(plan: Plan, tokens) -> None:
    lengths = plan.lengths
    seen: dict[int, list[int]] = {j: [] for j in range(len(lengths))}
    loss_tokens = 0
    for r in range(plan.world_size):
        step = build_step(plan, r, tokens)
        assert step.num_global_tokens == sum(s - 1 for s in lengths)
        assert len(step.micro_batches) == len(plan.ranks[r])
        for mb, spec in zip(step.micro_batches, plan.ranks[r]):
            lay = mb.layout
            assert mb.input_ids.shape == mb.labels.shape == mb.position_ids.shape
            assert int(lay.cu_seqlens[-1]) == mb.num_slots
            assert torch.equal(lay.positions(), mb.position_ids)
            valid = lay.valid()
            assert (mb.input_ids[~valid] == 0).all() and (mb.labels[~valid] == -100).all()
            n = lay.ring_size
            for k, j in enumerate(mb.seq_ids):
                s = lengths[j]
                a, b = int(lay.cu_seqlens[k]), int(lay.cu_seqlens[k + 1])
                assert b - a == (s if spec.ring is None else zigzag.slots_per_member(s, n))
                real = int(valid[a:b].sum())
                assert bool(valid[a : a + real].all()), "padding is last in each sequence's slots"
                assert b - a - real <= 2 and bool((mb.position_ids[a + real : b] >= s).all())
                full = tokens(j)
                for p, x, y, v in zip(
                    mb.position_ids[a:b].tolist(),
                    mb.input_ids[a:b].tolist(),
                    mb.labels[a:b].tolist(),
                    valid[a:b].tolist(),
                ):
                    if v:
                        seen[j].append(p)
                        assert x == full[p]
                        assert y == (full[p + 1] if p + 1 < s else -100)
            loss_tokens += int((mb.labels != -100).sum())
    for j, s in enumerate(lengths):
        assert sorted(seen[j]) == list(range(s)), f"sequence {j} not covered exactly once"
    assert loss_tokens == sum(s - 1 for s in lengths)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8).filter(lambda xs: sum(xs) > len(xs)),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_fuzz_builder_on_random_plans(lengths, world, seed):
    plan = random_plan(lengths, world, random.Random(seed))
    check_step_batches(plan.validate(), make_tokens(lengths))


def _planner():
    try:
        from lightning_bytescale.planner import make_plan
    except ImportError:
        return None
    return make_plan


@pytest.mark.skipif(_planner() is None, reason="lightning_bytescale.planner.make_plan not available")
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    lengths=st.lists(st.integers(2, 64), min_size=1, max_size=10),
    world=st.integers(1, 4),
    planner=st.sampled_from(["static", "naive", "balance"]),
    slack=st.integers(0, 8),
    seed=st.integers(0, 100),
)
def test_fuzz_builder_on_planner_plans(lengths, world, planner, slack, seed):
    from lightning_bytescale.planner import PlanError

    make_plan = _planner()
    capacity = max(4, -(-max(lengths) // world) + slack)  # small enough that long sequences need rings
    try:
        plan = make_plan(lengths, world_size=world, capacity=capacity, planner=planner, seed=seed)
    except PlanError:
        assume(False)  # e.g. the static baseline finds no CP group that fits
    plan.validate()
    check_step_batches(plan, make_tokens(lengths))
