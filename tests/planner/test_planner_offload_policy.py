"""Where offload shrinks a ring: pipelines (PP-Balance) and ``naive``'s ``offload_policy``.

Hand-computed cases on two tiny cost models:

* attention-bound: ``T = a s^2`` only (work ``D t(D)`` is the same on any ring size);
* communication-bound: ``a = 1e-9``, ``b = 1e-6``, K/V 1000 B, 1 GB/s, one pass, 10 layers,
  so a 2048-token sequence at C = 512 (``D(s) = 4``) has, per layer, member times
  N=4: 0.512 + max(1.049, 1.536) = 2.048 ms; N=3 (684 slots): 0.684 + max(1.398, 1.368) =
  2.082 ms; N=2: 1.024 + max(2.097, 1.024) = 3.121 ms; N=1: 4.194 + 2.048 = 6.242 ms.
  With 10 layers and ``l = 10`` layers offloadable at r* = 1 (``f(1) = 0.2``) every size 1-4 fits.
"""

from __future__ import annotations

import pytest

from lightning_bytescale.planner import CostModel, OffloadConfig, PlanError, make_plan

LINK10 = OffloadConfig(layers_per_rank=10, bandwidth_d2h=1e12, bandwidth_h2d=1e12)
LINK8 = OffloadConfig(layers_per_rank=8, bandwidth_d2h=1e12, bandwidth_h2d=1e12)


def _comm_model() -> CostModel:
    return CostModel(
        a=1e-9,
        b=1e-6,
        c=1.0,
        num_layers=10,
        kv_bytes_per_token_per_layer=1000.0,
        comm_passes=1.0,
        bandwidth_inter=1e9,
    )


def _attn_model() -> CostModel:
    return CostModel(a=1e-9, b=0.0, c=1.0, num_layers=8)


def _ring_of(plan, seq: int) -> tuple[int, float]:
    """(ranks holding ``seq``, its offload ratio)."""
    holders = {r for r, mbs in enumerate(plan.ranks) for mb in mbs for p in mb.pieces if p.seq == seq}
    ratios = {mb.offload_ratio for mbs in plan.ranks for mb in mbs for p in mb.pieces if p.seq == seq}
    assert len(ratios) == 1
    return len(holders), ratios.pop()


def _pipeline_loads(plan, p: int) -> list[float]:
    out = []
    for mbs in plan.ranks:
        ts = [mb.est_time for mb in mbs]
        out.append(sum(ts) / p + (p - 1) * max(ts, default=0.0) / p)
    return out


def test_member_times_of_the_comm_model_by_hand():
    cm = _comm_model()
    want = {4: 2.048e-3, 3: 2.082e-3, 2: 3.1214e-3, 1: 6.2423e-3}
    for n, t in want.items():
        assert cm.ring_member_time([2048], n)[0] == pytest.approx(10 * t, rel=2e-4)


def test_pipelines_keep_attention_bound_rings_whole():
    """Attention-bound: W = 67.1 ms on any ring size; 4 ranks x p = 2.

    No shrinking: every pipeline holds one 8.39 ms member + four 2.10 ms bins, load
    16.78 / 2 + 8.39 / 2 = 12.58 ms.  A ring of 2 (16.78 ms members) costs at least 16.78 ms,
    of 1 at least 33.55 ms, so offload does not pay and the ring keeps D(s) = 4 ranks.
    """
    lengths = [2048] + [512] * 16
    plan = make_plan(
        lengths,
        world_size=4,
        capacity=512,
        planner="balance",
        cost_model=_attn_model(),
        offload=LINK8,
        pipeline_degree=2,
    ).validate()
    assert _ring_of(plan, 0) == (4, 0.0)
    assert max(_pipeline_loads(plan, 2)) == pytest.approx(12.583e-3, rel=1e-3)
    no_off = make_plan(
        lengths,
        world_size=4,
        capacity=512,
        planner="balance",
        cost_model=_attn_model(),
        offload=False,
        pipeline_degree=2,
    )
    assert plan.digest() != no_off.digest()  # options differ, the placement does not
    assert [len(m) for m in plan.ranks] == [len(m) for m in no_off.ranks]


def test_pipelines_shrink_a_comm_bound_ring_where_it_pays():
    """Communication-bound, 4 ranks x p = 2, 16 bins of 500 tokens (7.5 ms each).

    Estimated step (W / (world p) + (p-1)/p x mean of the 4 longest slots, or the longest item):
    D=4: 25.24 + 10.24 = 35.48 ms; D=3: 22.81 + 8.74 = 31.55 ms; D=2: 22.80 + 9.68 = 32.48 ms;
    D=1: 62.42 ms.  So 3 ranks, at the smallest ratio that fits 684 slots in 512 tokens:
    (2 + 8 (1 - r)) / 10 x 684 <= 512  ->  r >= 0.3144.
    """
    lengths = [2048] + [500] * 16
    kw = dict(world_size=4, capacity=512, planner="balance", cost_model=_comm_model(), pipeline_degree=2)
    plan = make_plan(lengths, offload=LINK10, **kw).validate()
    n, r = _ring_of(plan, 0)
    assert n == 3 and r == pytest.approx(0.3144, abs=1e-4)
    no_off = make_plan(lengths, offload=False, **kw).validate()
    assert _ring_of(no_off, 0) == (4, 0.0)
    assert max(_pipeline_loads(plan, 2)) < max(_pipeline_loads(no_off, 2))


def test_naive_offload_policies_by_hand():
    """``pays``: fewest ranks with t(D) <= 1.05 t(4) = 21.50 ms and D t(D) <= 0.95 x 81.92 ms:
    D=3 (20.82 ms, 62.46 ms of work); D=2 (31.21 ms) and D=1 (62.42 ms) are too long.
    ``paper_min_ranks``: Eq. 3's optimum, one rank at r >= 0.9375 ((2 + 8(1-r))/10 x 2048 <= 512)."""
    kw = dict(world_size=8, capacity=512, planner="naive", cost_model=_comm_model(), offload=LINK10)
    lengths = [2048, 300, 200]
    pays = make_plan(lengths, offload_policy="pays", **kw).validate()
    assert _ring_of(pays, 0)[0] == 3 and pays.options["offload_policy"] == "pays"
    literal = make_plan(lengths, **kw).validate()  # default: Eq. 3 read literally
    assert _ring_of(literal, 0) == (1, pytest.approx(0.9375, abs=1e-6))
    assert literal.options["offload_policy"] == "paper_min_ranks"
    # attention-bound: the work is the same on any ring size, so "pays" keeps D(s) = 4, no offload
    attn = make_plan(
        lengths,
        world_size=8,
        capacity=512,
        planner="naive",
        cost_model=_attn_model(),
        offload=LINK8,
        offload_policy="pays",
    ).validate()
    assert _ring_of(attn, 0) == (4, 0.0)
    # slack 0: the ring of 3 is 1.7% slower than the ring of 4, so it stays at 4
    tight = make_plan(lengths, offload_policy="pays", slack=0.0, **kw).validate()
    assert _ring_of(tight, 0) == (4, 0.0)


def test_offload_policy_is_checked():
    with pytest.raises(PlanError, match="offload_policy must be one of"):
        make_plan([2048], world_size=8, capacity=512, planner="naive", offload=LINK10, offload_policy="max")


def test_too_long_message_names_the_offload_aware_pool():
    """Paper preset, 32 layers: r*(2M) = 1, f(1) = 2/32, so a rank holds 8192 x 16 = 131072 tokens
    of it and 8 ranks about 1048576."""
    with pytest.raises(PlanError) as err:
        make_plan([3, 2_000_000], world_size=8, capacity=8192, planner="balance", offload=True)
    msg = str(err.value)
    assert "r* = 1.000" in msg and "a rank holds 131072" in msg
    assert "pool holds about 1048576 tokens" in msg and "65536 without offload" in msg
    with pytest.raises(PlanError, match=r"the pool holds 65536 tokens\)"):
        make_plan([3, 2_000_000], world_size=8, capacity=8192, planner="balance", offload=False)


def test_cli_passes_the_offload_policy(tmp_path):
    import json

    from lightning_bytescale.cli.plan import main

    lens = tmp_path / "l.json"
    lens.write_text("[2048, 300, 200, 9000]")
    args = [
        "--lengths",
        str(lens),
        "--world-size",
        "8",
        "--capacity",
        "1024",
        "--planner",
        "naive",
        "--offload",
    ]
    for policy in ("pays", "paper_min_ranks"):
        out = tmp_path / f"{policy}.json"
        assert main([*args, "--offload-policy", policy, "--json", str(out)]) == 0
        assert json.loads(out.read_text())["options"]["offload_policy"] == policy
