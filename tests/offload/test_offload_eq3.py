"""Offload lowers the rank count of long sequences exactly as Eq. 3 says; short ones never offload.

Cost model chosen so every number can be checked by hand: l = 10 layers, C = 1000 tokens,
Act(s) = 100 s bytes, T(s) = 3e-11 s^2 seconds (forward = 1/3 of it), host link
min(2e9, 1e9) = 1e9 bytes/s.  Then the overlap bound is
r*(s) = min(1, T(s)/3 * 1e9 / Act(s)) = min(1, 1e-4 s) and Eq. 3 reads
D(s, r) = ceil((2 + 8 (1 - r)) * 100 s / (10 * 1000 * 100)) = ceil((2 + 8 (1 - r)) s / 10000).
"""

from __future__ import annotations

import pytest
from _offload_helpers import plan_offload_ratios

from lightning_bytescale.offload.offloader import micro_batch_offload_ratio
from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.cost_model import (
    CostModel,
    OffloadConfig,
    eq3_lower_bound,
    eq3_ranks,
    max_offload_ratio,
    ranks_with_offload,
    ranks_without_offload,
)
from lightning_bytescale.planner.errors import PlanError
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

C = 1000
COST = CostModel(a=3e-11, b=0.0, g=0.0, c=100.0, d=0.0, num_layers=10)
LINK = OffloadConfig(layers_per_rank=10, bandwidth_d2h=2e9, bandwidth_h2d=1e9)

# s: (ceil(s/C), r* = min(1, s/1e4), lower bound min(1, 10*1000 / (8 s)), Eq. 3 D(s, r*))
BY_HAND = {
    800: (1, 0.08, 1.0, 1),  # shorter than C: one rank, no offload
    1500: (2, 0.15, 0.833333, 2),  # r* below the lower bound: infeasible, r = 0
    4000: (4, 0.40, 0.3125, 3),  # ceil(6.8 * 0.4) = ceil(2.72) = 3
    8000: (8, 0.80, 0.15625, 3),  # ceil(3.6 * 0.8) = ceil(2.88) = 3
    12000: (12, 1.00, 0.104167, 3),  # ceil(2.0 * 1.2) = ceil(2.4) = 3
}
# The planner uses the smallest ratio that reaches Eq. 3's rank count (same ranks, less PCIe):
# member slots 2*ceil(s/2D); need (2 + 8 (1 - r)) / 10 * slots <= 1000, i.e.
# r >= 1 - (10000 / slots - 2) / 8, rounded up to 1e-6.
#   s=4000,  D=3: slots 1334 -> r >= 1 - (7.496252 - 2)/8 = 0.312969
#   s=8000,  D=3: slots 2668 -> r >= 1 - (3.748126 - 2)/8 = 0.781485
#   s=12000, D=3: slots 4000 -> r >= 1 - (2.5 - 2)/8      = 0.9375
PLANNED = {800: (1, 0.0), 1500: (2, 0.0), 4000: (3, 0.312969), 8000: (3, 0.781485), 12000: (3, 0.9375)}


@pytest.mark.parametrize("s", sorted(BY_HAND))
def test_eq3_by_hand(s):
    d0, r_star, lower, d_eq3 = BY_HAND[s]
    assert ranks_without_offload(s, C) == d0
    assert max_offload_ratio(s, COST, LINK) == pytest.approx(r_star, abs=1e-9)
    assert eq3_lower_bound(s, C, COST, LINK) == pytest.approx(lower, abs=1e-6)
    assert eq3_ranks(s, r_star, C, COST, LINK) == d_eq3
    assert ranks_with_offload(s, C, COST, LINK) == pytest.approx(PLANNED[s], abs=1e-6)
    d, r = PLANNED[s]
    assert d <= d0
    if r > 0:
        assert r <= r_star + 1e-12  # the copies hide behind the layer's forward
        assert r >= lower - 1e-12  # and the ratio does save a rank
        assert eq3_ranks(s, r, C, COST, LINK) <= d  # Eq. 3 agrees the memory fits
    # D(s, r) is non-increasing in r
    ds = [eq3_ranks(s, k / 20, C, COST, LINK) for k in range(21)]
    assert all(a >= b for a, b in zip(ds, ds[1:]))


def test_plan_uses_fewer_ranks_with_offload_and_short_sequences_never_offload():
    lengths = [4000, 12000, 800, 700, 300, 1500]
    plan = make_plan(lengths, world_size=8, capacity=C, planner="naive", cost_model=COST, offload=LINK)
    ring_of = {}
    ratio_of = {}
    for rank in range(plan.world_size):
        for mb, r in zip(plan.ranks[rank], plan_offload_ratios(plan, rank)):
            for piece in mb.pieces:
                ring_of.setdefault(piece.seq, set()).update(mb.ring or (rank,))
                ratio_of.setdefault(piece.seq, set()).add(r)
    for seq, s in enumerate(lengths):
        d, r = PLANNED.get(s, (1, 0.0))
        assert len(ring_of[seq]) == d, (s, ring_of[seq])
        assert len(ratio_of[seq]) == 1 and ratio_of[seq].pop() == pytest.approx(r, abs=1e-6), s
    # 3 + 3 + 2 ranks for the long ones instead of 4 + 12 + 2: without offload 12000 cannot fit 8 ranks
    with pytest.raises(PlanError):
        make_plan(lengths, world_size=8, capacity=C, planner="naive", cost_model=COST, offload=False)


def test_long_sequence_can_become_local_with_offload():
    fast = OffloadConfig(layers_per_rank=10, bandwidth_d2h=1e10, bandwidth_h2d=1e10)  # r* = min(1, 1e-3 s)
    # s = 3000: ceil(3000/C) = 3; at r* = 1 Eq. 3 gives ceil(2 * 3000 / 10000) = 1 rank;
    # smallest ratio for one rank: r >= 1 - (10000/3000 - 2)/8 = 0.833334 (rounded up)
    assert eq3_ranks(3000, 1.0, C, COST, fast) == 1
    assert ranks_with_offload(3000, C, COST, fast) == pytest.approx((1, 0.833334), abs=1e-6)
    plan = make_plan(
        [3000, 600, 200], world_size=2, capacity=C, planner="naive", cost_model=COST, offload=fast
    )
    found = {}
    for rank in range(2):
        for mb, r in zip(plan.ranks[rank], plan_offload_ratios(plan, rank)):
            assert mb.ring is None
            found[tuple(p.seq for p in mb.pieces)] = r
    assert found[(0,)] == pytest.approx(0.833334, abs=1e-6)
    assert all(r == 0.0 for seqs, r in found.items() if 0 not in seqs)


def test_ratio_helper_zeroes_short_only_micro_batches_and_validates():
    lengths = (3000, 600)
    long_mb = MicroBatch(pieces=[Piece(0, ((0, 3000),))], offload_ratio=0.8)
    short_mb = MicroBatch(pieces=[Piece(1, ((0, 600),))], offload_ratio=0.8)  # a planner bug
    plan = Plan(world_size=1, capacity=C, planner="hand", lengths=lengths, ranks=[[long_mb, short_mb]])
    assert plan_offload_ratios(plan, 0) == [0.8, 0.0]
    assert micro_batch_offload_ratio(short_mb) == 0.8  # without lengths nothing is known
    with pytest.raises(ValueError, match="rank 3 not in the plan"):
        plan_offload_ratios(plan, 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        micro_batch_offload_ratio(MicroBatch(pieces=[], offload_ratio=1.5))


def test_planned_offload_runs_exactly_and_fits_capacity():
    """Plan -> packed micro-batches -> executor with the offloader, on one rank.

    C = 48 tokens, l = 6 layers; a 100-token sequence needs ceil(100/48) = 3 ranks without
    offload.  With a link fast enough that r* = 1, Eq. 3 gives one rank: the smallest ratio
    is r >= 1 - (6 * 48 / 100 - 2) / 4 = 0.78.  The offloader runs it with ceil(0.78 * 4) = 4
    of the 6 layers on the host, so the device keeps 2 layers of 100 tokens, within the rank's
    budget of l * Act(C) = 6 layers of 48 tokens, measured in real saved bytes.
    """
    import torch

    from lightning_bytescale.engine.executor import run_micro_batches
    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.offload.offloader import OUTSIDE, ActivationOffloader
    from lightning_bytescale.packed_attention import attention_context
    from lightning_bytescale.packed_attention.layout import AttentionLayout

    cap, layers = 48, 6
    cost = CostModel(a=1e-9, b=1e-6, c=1000.0, num_layers=layers)
    link = OffloadConfig(layers_per_rank=layers, bandwidth_d2h=1e12, bandwidth_h2d=1e12)
    assert ranks_without_offload(100, cap) == 3
    assert ranks_with_offload(100, cap, cost, link) == pytest.approx((1, 0.78), abs=1e-6)
    lengths = [100, 30, 20]
    plan = make_plan(lengths, world_size=1, capacity=cap, planner="naive", cost_model=cost, offload=link)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (s,), generator=gen) for s in lengths]
    step = build_step(plan, 0, lambda i: data[i])
    assert sorted(mb.offload_ratio for mb in step.micro_batches) == pytest.approx([0.0, 0.0, 0.78])

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.preset("tiny", layers=layers))
    run_micro_batches(model, step.micro_batches)
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    off = ActivationOffloader(model.blocks, capacity=cap)
    run_micro_batches(model, step.micro_batches, micro_batch_context=off.micro_batch_context)
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))

    long_mb = next(mb for mb in step.micro_batches if mb.offload_ratio > 0)
    st = off.pass_stats[long_mb.index]
    assert st.offloaded_layers == (0, 1, 2, 3)
    resident = sum(b for i, b in st.layer_resident_bytes.items() if i != OUTSIDE)
    probe = ActivationOffloader(model.blocks, min_bytes=0)
    with attention_context(AttentionLayout(torch.tensor([0, cap]), (cap,))), probe.context(0, 0.0) as full:
        model(data[0][:cap], torch.arange(cap))
    budget = sum(b for i, b in full.layer_bytes.items() if i != OUTSIDE)  # l * Act(C), measured
    assert resident <= budget, (resident, budget)
    unloaded = sum(b for i, b in st.layer_bytes.items() if i != OUTSIDE)
    assert unloaded > budget  # without offload the sequence would not fit one rank
    print(f"\nlayer bytes on the device: {resident} <= l * Act(C) = {budget}; without offload {unloaded}")
