"""Ring blocks on a CPU in shape groups: the sequences of one shape in one batched call, exactly.

The ``cpu`` block kernel gathers a varlen block's sequences with equal ``(query rows, key
rows)`` into one batch (:mod:`~lightning_bytescale.packed_attention.block_groups`).  Checked
here: in float64, outputs, log-sum-exps and gradients equal the dense per-sequence reference of
``test_attention_kernels`` on blocks where shapes repeat (causal and not, GQA / MQA / MHA,
sequences without query rows); a block of many sequences makes one call per shape, not one per
sequence; the groups hold what they should and are cached; and a zigzag ring of many short
sequences (the blocks a static CP ring computes) equals the whole-sequence reference through
the loopback ring.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import TOL, max_err
from test_attention_kernels import dense_grads, inputs
from test_attention_loopback import check_against_reference, run_loopback

from lightning_bytescale.packed_attention import kernels
from lightning_bytescale.packed_attention.block_groups import shape_groups
from lightning_bytescale.packed_attention.segments import Segments

HEADS = [(4, 2), (4, 1), (3, 3)]


def _block(q_lens, k_lens, causal, heads, seed=0, dtype=torch.float64):
    """The cpu kernel's forward and backward of one block, and the dense reference's."""
    scale = 0.3
    q, k, v, dout = inputs(q_lens, k_lens, *heads, seed=seed, dtype=dtype)
    ref_out, ref_lse, ref_grads = dense_grads(q, k, v, dout, q_lens, k_lens, causal, scale)
    seg = {"q_seg": Segments.of(q_lens), "k_seg": Segments.of(k_lens)}
    out, lse = kernels.block_forward(q, k, v, causal=causal, scale=scale, impl="cpu", **seg)
    grads = kernels.block_backward(
        dout, q, k, v, ref_out, ref_lse, causal=causal, scale=scale, impl="cpu", **seg
    )
    return (out, lse, *grads), (ref_out, ref_lse, *ref_grads)


# (query rows, key rows) of a sequence: few shapes, so that they repeat within a block
SHAPES = st.sampled_from([(1, 1), (2, 2), (2, 4), (3, 3), (4, 2), (0, 3), (5, 7)])


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(SHAPES, min_size=2, max_size=30),
    causal=st.booleans(),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**16),
)
def test_grouped_block_equals_the_dense_reference_in_float64(shapes, causal, heads, seed):
    q_lens = [lq for lq, _ in shapes]
    k_lens = [lq if causal else lk for lq, lk in shapes]  # a causal block is a diagonal block
    if not any(q_lens):
        return
    got, want = _block(q_lens, k_lens, causal, heads, seed=seed)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and max_err(a, b) <= TOL, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_block_in_narrow_dtypes(dtype):
    q_lens = [3, 3, 5, 3, 5, 1, 0]
    got, want = _block(q_lens, q_lens, True, (4, 2), dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert max_err(a, b) <= tol, name


def _count_calls(monkeypatch, name):
    calls = []
    real = getattr(kernels, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, name, counted)
    return calls


def test_one_call_per_shape_not_per_sequence(monkeypatch):
    rng = random.Random(0)
    shapes = [rng.choice([(2, 2), (4, 4), (6, 6)]) for _ in range(200)] + [(9, 9), (11, 11)]
    rng.shuffle(shapes)
    lens = [lq for lq, _ in shapes]
    forward = _count_calls(monkeypatch, "_CPU_FWD")
    backward = _count_calls(monkeypatch, "_CPU_BWD")
    got, want = _block(lens, lens, True, (4, 2))
    for a, b in zip(got, want):
        assert max_err(a, b) <= TOL
    assert len(forward) == len(backward) == 5  # three batched shapes, two sequences alone
    assert sorted(shape[0] for shape in forward) == [1, 1] + sorted(lens.count(n) for n in (2, 4, 6))


def test_groups_hold_their_sequences_and_are_cached():
    q_seg, k_seg = Segments.of([2, 0, 3, 2, 1]), Segments.of([4, 5, 1, 4, 6])
    blocks = shape_groups(q_seg, k_seg, False)
    assert blocks.calls == 3 and blocks.q_rows == 8
    (group,) = blocks.groups
    assert (group.q_len, group.k_len, group.count) == (2, 4, 2)
    assert group.q_index.tolist() == [0, 1, 5, 6]
    assert group.k_index.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert blocks.singles == ((slice(2, 5), slice(9, 10)), (slice(7, 8), slice(14, 20)))
    assert shape_groups(q_seg, k_seg, False) is blocks  # the layers of a model share them
    assert shape_groups(q_seg, Segments.of([4, 5, 1, 4, 7]), False) is not blocks


def test_mismatched_blocks_are_refused():
    with pytest.raises(ValueError, match="3 query sequences but 2 key sequences"):
        shape_groups(Segments.of([1, 2, 3]), Segments.of([1, 2]), False)
    with pytest.raises(ValueError, match="causal block needs equal"):
        shape_groups(Segments.of([2, 2]), Segments.of([2, 3]), True)
    q, k, v, _ = inputs([2, 2], [2, 2])
    with pytest.raises(ValueError, match="cover 4 rows but q has 5"):
        kernels.block_forward(
            torch.cat([q, q[:1]]), k, v, causal=False, scale=1.0, impl="cpu",
            q_seg=Segments.of([2, 2]), k_seg=Segments.of([2, 2]),
        )  # fmt: skip


@pytest.mark.parametrize("n", [2, 4])
def test_a_zigzag_ring_of_many_short_sequences_equals_the_reference(monkeypatch, n):
    # what a static CP ring computes: a pack of short sequences, each sharded over the ring,
    # so every member holds a few rows of each and the blocks repeat a few shapes
    rng = random.Random(n)
    lens = [rng.randint(1, 6 * n) for _ in range(60)]
    forward = _count_calls(monkeypatch, "_CPU_FWD")
    ref, results = run_loopback(lens, n, 4, 2, "cpu")
    check_against_reference(ref, results, lens)
    assert len(forward) < n * n * len(lens) / 4  # batched: far fewer calls than blocks x sequences
