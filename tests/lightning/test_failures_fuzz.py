"""Fuzzing: random batches and options through ``make_plan`` -> ``build_step`` on every rank.

``tests/planner/test_planner.py`` fuzzes the planners (validation, determinism, sharding) and
``tests/engine/test_engine_packing.py`` fuzzes the packer on small worlds with default options.  Here
hypothesis drives the whole path with the options users turn (offload, pipeline degree, ranks
per node, slack, buckets, comm-awareness, 1-token sequences, up to 12 ranks) and checks the
promise end to end: either a clear ``PlanError``/``EmptyBatchError`` that is justified, or
step batches in which every real token of every sequence appears exactly once, with its right
input id, position and next-token label, every rank agreeing on the digest and the global token
count.  A second fuzz feeds malformed input and requires a ``ValueError`` naming the problem,
never a crash of another kind.  Fixed budgets, derandomized, so CI is reproducible.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_bytescale.engine.micro_batch import IGNORE_INDEX, EmptyBatchError, build_step
from lightning_bytescale.planner import PlanError, make_plan, ranks_without_offload

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def batches(draw):
    world = draw(st.integers(1, 12))
    cap = draw(st.integers(2, 48))
    lengths = draw(st.lists(st.integers(1, 3 * cap), min_size=1, max_size=12))
    if draw(st.booleans()):  # a long one, up to (a little beyond) the whole pool
        lengths.append(draw(st.integers(1, world * cap + cap)))
    planner = draw(st.sampled_from(["balance", "naive", "static"]))
    options = {
        "seed": draw(st.integers(0, 1000)),
        "offload": draw(st.sampled_from([None, False, True])),
        "slack": draw(st.sampled_from([0.0, 0.05, 0.5])),
        "num_buckets": draw(st.integers(1, 8)),
        "comm_aware": draw(st.booleans()),
        "ranks_per_node": draw(st.sampled_from([None, 1, 2, 4, 8])),
    }
    if planner == "balance":
        options["pipeline_degree"] = draw(st.integers(1, 3))
    if planner == "static" and draw(st.booleans()):
        options["cp_size"] = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    return world, cap, lengths, planner, options


def _tokens(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    seqs = [torch.randint(0, 1000, (s,), generator=g) for s in lengths]
    return seqs, (lambda j: seqs[j])


@FUZZ
@given(case=batches())
def test_plan_then_pack_covers_every_token_and_label_exactly_once(case):
    world, cap, lengths, planner, options = case
    try:
        plan = make_plan(lengths, world_size=world, capacity=cap, planner=planner, **options)
    except PlanError as err:
        event(f"refused by {planner}")
        msg = str(err)
        assert "sequence" in msg or "cp_size" in msg, msg
        if planner != "static" and options["offload"] is False:
            # refused only when the longest sequence needs more ranks than there are
            assert ranks_without_offload(max(lengths), cap) > world, msg
        assert "add ranks" in msg or "cp_size" in msg, msg  # a fix is named
        return
    if planner != "static" and options["offload"] is False:
        assert ranks_without_offload(max(lengths), cap) <= world
    plan.validate()
    seqs, tokens = _tokens(lengths)
    expected_loss_tokens = sum(s - 1 for s in lengths)
    rings = {mb.item for mbs in plan.ranks for mb in mbs if mb.ring is not None}
    event(f"planned ({'with' if rings else 'without'} rings)")
    if expected_loss_tokens == 0:
        for r in range(world):
            with pytest.raises(EmptyBatchError):
                build_step(plan, r, tokens)
        return

    seen = [torch.zeros(s, dtype=torch.long) for s in lengths]
    digests, loss_tokens = set(), 0
    for r in range(world):
        step = build_step(plan, r, tokens)
        digests.add(step.digest)
        assert step.num_global_tokens == expected_loss_tokens
        assert step.num_tokens == sum(lengths)
        assert len(step.micro_batches) == len(plan.ranks[r])
        for mb, spec in zip(step.micro_batches, plan.ranks[r]):
            lay = mb.layout
            assert mb.num_slots == int(lay.cu_seqlens[-1])
            if spec.offload_ratio == 0:
                assert mb.num_slots <= cap, (
                    f"rank {r} micro-batch {mb.index}: {mb.num_slots} slots > capacity {cap}"
                )
            pos, valid = lay.positions(), lay.valid()
            assert torch.equal(pos, mb.position_ids)
            assert (mb.labels[~valid] == IGNORE_INDEX).all()
            owner = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(lay.slots))
            for j in set(mb.seq_ids):
                here = valid & (owner == j)
                p = pos[here]
                full = seqs[j]
                assert torch.equal(mb.input_ids[here], full[p])
                nxt = torch.where(p + 1 < lengths[j], full[(p + 1).clamp(max=lengths[j] - 1)], IGNORE_INDEX)
                assert torch.equal(mb.labels[here], nxt)
                seen[j].index_add_(0, p, torch.ones_like(p))
            loss_tokens += int((mb.labels != IGNORE_INDEX).sum())
    assert len(digests) == 1, "ranks packed different digests for one plan"
    for j, counts in enumerate(seen):
        assert bool((counts == 1).all()), f"sequence {j}: tokens seen {counts.tolist()} times"
    assert loss_tokens == expected_loss_tokens


BAD_LENGTH = st.one_of(
    st.integers(-5, 0),
    st.floats(allow_nan=True, allow_infinity=True).filter(
        lambda x: x != int(x) if math.isfinite(x) else True
    ),
    st.text(max_size=3),
    st.none(),
)


@st.composite
def malformed(draw):
    lengths = draw(st.lists(st.integers(1, 50), max_size=5))
    kw = {"world_size": draw(st.integers(1, 6)), "capacity": draw(st.integers(2, 32))}
    fault = draw(st.sampled_from(["length", "world", "capacity", "seed", "planner", "slack", "buckets"]))
    if fault == "length":
        lengths.insert(draw(st.integers(0, len(lengths))), draw(BAD_LENGTH))
    elif fault == "world":
        kw["world_size"] = draw(st.one_of(st.integers(-3, 0), st.just(True), st.just(2.5), st.just("4")))
    elif fault == "capacity":
        kw["capacity"] = draw(st.one_of(st.integers(-3, 1), st.just(False), st.just(8.5), st.none()))
    elif fault == "seed":
        kw["seed"] = draw(st.one_of(st.just(1.5), st.just("0"), st.just(True)))
    elif fault == "planner":
        kw["planner"] = draw(st.sampled_from(["", "Balance", "fastest"]))
    elif fault == "slack":
        kw["slack"] = draw(st.sampled_from([-0.1, float("nan"), float("inf")]))
    else:
        kw["num_buckets"] = draw(st.integers(-2, 0))
    return lengths, kw, fault


@FUZZ
@given(case=malformed())
def test_malformed_planner_input_is_a_value_error_naming_it(case):
    lengths, kw, fault = case
    with pytest.raises(PlanError) as err:
        make_plan(lengths, **kw)
    msg = str(err.value)
    named = {
        "length": "sequence",
        "world": "world_size",
        "capacity": "capacity",
        "seed": "seed",
        "planner": "planner",
        "slack": "slack",
        "buckets": "num_buckets",
    }[fault]
    assert named in msg, msg
