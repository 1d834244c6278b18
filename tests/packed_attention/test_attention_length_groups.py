"""Local attention on length groups: padded, batched calls that are exact and few.

On a CPU, :func:`varlen_attention` sorts a micro-batch's sequences by length, cuts them into
groups of similar lengths and runs one causal call per group over its sequences right-padded to
the group's longest.  Checked here: in float64, outputs and gradients equal the dense
block-diagonal reference (many short sequences of mixed lengths, GQA, single tokens, empty
sequences); the groups obey their padding rule and are as large as it allows; a long-tailed
micro-batch takes one call a group, not one a sequence; and the per-sequence path that CUDA
keeps without a varlen kernel equals the reference too.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import TOL, local_layout, make_inputs, max_err, reference_with_grads

from lightning_bytescale.packed_attention import attention, attention_context
from lightning_bytescale.packed_attention import local as local_module
from lightning_bytescale.packed_attention.local import PAD_FREE, PAD_SLACK, length_groups, varlen_attention

HEADS = [(4, 2), (4, 4), (6, 1)]


def _grouped_attention(lens, heads, kv_heads, seed=0):
    q, k, v, dout = make_inputs(lens, heads, kv_heads, seed=seed)
    ref = reference_with_grads(q, k, v, dout, lens)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qq, kk, vv, lens, scale=q.shape[-1] ** -0.5)
    out.backward(dout)
    return (out, qq.grad, kk.grad, vv.grad), ref


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=2, max_size=40).filter(
        lambda xs: len(set(xs)) > 1 and any(xs)
    ),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**16),
)
def test_grouped_attention_equals_the_reference_in_float64(lens, heads, seed):
    got, want = _grouped_attention(lens, *heads, seed=seed)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert max_err(a, b) <= TOL, name


def test_padding_never_reaches_a_real_row(monkeypatch):
    # short sequences share groups with longer ones, so most are padded past their end; a pad
    # row that reached a real output or gradient would show against the reference
    lens = [1, 2, 2, 3, 30, 4, 5, 5, 6, 1, 7, 29, 8]
    assert any(len(g) > 1 and len({lens[i] for i in g}) > 1 for g in length_groups(lens))
    got, want = _grouped_attention(lens, 4, 2)
    for a, b in zip(got, want):
        assert max_err(a, b) <= TOL
    # the check can fail: without the causal mask real rows would read the pad rows
    plain = local_module.F.scaled_dot_product_attention
    monkeypatch.setattr(
        local_module.F,
        "scaled_dot_product_attention",
        lambda *a, **kw: plain(*a, **{**kw, "is_causal": False}),
    )
    unmasked, _ = _grouped_attention(lens, 4, 2)
    assert max_err(unmasked[0], want[0]) > 1e-3


@pytest.mark.parametrize("seed", range(20))
def test_groups_cover_every_sequence_once_within_the_padding_rule_and_are_maximal(seed):
    rng = random.Random(seed)
    lens = [rng.choice([0, rng.randint(1, 8), rng.randint(1, 512)]) for _ in range(rng.randint(1, 300))]
    groups = length_groups(lens)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == [i for i, s in enumerate(lens) if s > 0]
    assert [lens[i] for i in flat] == sorted(lens[i] for i in flat)  # sorted within and across groups

    def fits(members):
        longest = max(lens[i] for i in members)
        return len(members) * longest**2 <= PAD_SLACK * sum(lens[i] ** 2 for i in members) + PAD_FREE

    assert all(fits(g) for g in groups)
    assert all(not fits([*a, b[0]]) for a, b in zip(groups, groups[1:]))


def test_a_long_tailed_micro_batch_takes_one_call_a_group(monkeypatch):
    rng = random.Random(0)
    lens = [min(512, int(rng.paretovariate(1.2) * 4)) for _ in range(200)]
    calls = []
    plain = local_module.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return plain(*args, **kwargs)

    monkeypatch.setattr(local_module.F, "scaled_dot_product_attention", counted)
    q, k, v, _ = make_inputs(lens, 4, 2)
    with attention_context(local_layout(lens)):
        attention(q, k, v)
    groups = length_groups(lens)
    assert len(calls) == len(groups) < len(lens) // 10
    assert [shape[0] for shape in calls] == [len(g) for g in groups]


@pytest.mark.parametrize("heads", HEADS)
def test_the_per_sequence_path_of_gpus_without_varlen_kernels_equals_the_reference(heads):
    # CUDA float32/float64 keeps one call per sequence (no padded copies for the backward);
    # the same function runs here on the CPU
    lens = [7, 1, 0, 12, 5, 5, 30]
    q, k, v, dout = make_inputs(lens, *heads)
    ref = reference_with_grads(q, k, v, dout, lens)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = local_module._per_sequence(qq, kk, vv, tuple(lens), scale=8**-0.5, gqa=heads[0] != heads[1])
    out.backward(dout)
    for a, b in zip((out, qq.grad, kk.grad, vv.grad), ref):
        assert max_err(a, b) <= TOL
