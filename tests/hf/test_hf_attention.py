"""The ``"bytescale"`` attention and mask functions as transformers calls them.

* the layer's ``scaling`` is honoured and GQA works, against an explicit float64 softmax;
* what the attention cannot do is refused at call time with the field to change;
* no tensor with two dimensions of at least ``T`` is created in a packed forward and backward
  (a dispatch-mode recorder sees every tensor any op creates), while the ``sdpa`` path of the
  same model does build one (the recorder would catch a ``[T, T]`` mask);
* importing the base package never imports transformers or ``lightning_bytescale.hf``.

(Installed transformers is imported by torchmetrics whenever Lightning is: that is Lightning's
import, not this package's, and costs about a second of start-up.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from test_hf_families import build, packed  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from lightning_bytescale.errors import ConfigError  # noqa: E402
from lightning_bytescale.hf import bytescale_attention, bytescale_mask  # noqa: E402


class Layer(nn.Module):
    is_causal = True


def explicit_attention(q, k, v, lengths, scale):
    """Causal softmax attention per sequence, written out: q [T, H, D], k/v [T, Hkv, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out, start = [], 0
    for s in lengths:
        sl = slice(start, start + s)
        scores = torch.einsum("qhd,khd->hqk", q[sl], k[sl]) * scale
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[sl]))
        start += s
    return torch.cat(out)


@pytest.mark.parametrize("scaling", [None, 0.123, 1.7])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_scaling_and_gqa_against_explicit_softmax(scaling, heads):
    h, hkv = heads
    lengths = [5, 1, 8]
    t = sum(lengths)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, h, t, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, hkv, t, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, hkv, t, 8, dtype=torch.float64, generator=g, requires_grad=True)
    pos = torch.cat([torch.arange(s) for s in lengths])[None]
    out, weights = bytescale_attention(Layer(), q, k, v, None, scaling=scaling, position_ids=pos)
    assert weights is None and out.shape == (1, t, h, 8)
    scale = 8**-0.5 if scaling is None else scaling
    want = explicit_attention(*(x[0].transpose(0, 1) for x in (q, k, v)), lengths, scale)
    assert (out[0] - want).abs().max().item() <= 1e-13
    got = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(got, ref):
        assert (a - b).abs().max().item() <= 1e-13


def _qkv(b=1, h=4, hkv=2, t=6, tk=None, d=8, dv=None):
    q = torch.randn(b, h, t, d, dtype=torch.float64)
    k = torch.randn(b, hkv, tk or t, d, dtype=torch.float64)
    v = torch.randn(b, hkv, tk or t, dv or d, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize(
    ("tensors", "mask", "kwargs", "message"),
    [
        (_qkv(b=2), None, {}, "batch size 1, got batch size 2"),
        (_qkv(t=2, tk=6), None, {}, "KV cache"),
        (_qkv(dv=4), None, {}, "equal key and value head sizes"),
        (_qkv(), torch.zeros(1, 1, 6, 6), {}, "takes no attention mask"),
        (_qkv(), None, {"dropout": 0.1}, "attention_dropout"),
        (_qkv(), None, {"sliding_window": 4}, "sliding_window"),
        (_qkv(), None, {"softcap": 30.0}, "attn_logit_softcapping"),
        (_qkv(), None, {"s_aux": torch.zeros(4)}, "attention sinks"),
        (_qkv(), None, {"position_bias": torch.zeros(1, 4, 6, 6)}, "ALiBi"),
        (_qkv(), None, {"is_causal": False}, "is_causal"),
    ],
    ids=["batch", "cache", "mla", "mask", "dropout", "window", "softcap", "sinks", "bias", "bidirectional"],
)
def test_attention_refuses_what_it_cannot_do(tensors, mask, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        bytescale_attention(Layer(), *tensors, mask, **kwargs)


def test_non_causal_layer_is_refused():
    layer = Layer()
    layer.is_causal = False
    with pytest.raises(ConfigError, match="causal only"):
        bytescale_attention(layer, *_qkv(), None)


def test_mask_function_builds_nothing_and_refuses_padding():
    assert bytescale_mask(batch_size=1, q_length=9, kv_length=9, attention_mask=None) is None
    assert (
        bytescale_mask(
            batch_size=1, q_length=9, kv_length=9, attention_mask=torch.ones(1, 9, dtype=torch.bool)
        )
        is None
    )
    with pytest.raises(ConfigError, match="takes no padding"):
        bytescale_mask(
            batch_size=1, q_length=3, kv_length=3, attention_mask=torch.tensor([[True, True, False]])
        )
    with pytest.raises(ConfigError, match="batch size 1"):
        bytescale_mask(batch_size=2, q_length=3, kv_length=3)
    with pytest.raises(ConfigError, match="KV cache"):
        bytescale_mask(batch_size=1, q_length=1, kv_length=3)


def test_model_with_padding_mask_or_batch_is_refused():
    model = build("llama", "bytescale")
    ids, pos = packed([3, 4])
    with pytest.raises(ConfigError, match="takes no padding"):
        model(input_ids=ids[None], attention_mask=torch.tensor([[1] * 6 + [0]]), use_cache=False)
    with pytest.raises(ConfigError, match="batch size 1"):
        model(input_ids=ids.view(1, 7).expand(2, 7), use_cache=False)


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any op returns (forward and backward, every kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def square_tensors(attn: str, lengths: list[int]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors with two dimensions >= T created by a packed forward and backward."""
    model = build("llama", attn)
    ids, pos = packed(lengths)
    t = len(ids)
    with ShapeRecorder() as rec:
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits
        logits.square().mean().backward()
    assert len(rec.shapes) > 100  # the recorder saw the whole model
    return [(op, shape) for op, shape in rec.shapes if sum(d >= t for d in shape) >= 2]


def test_no_t_by_t_tensor_in_packed_forward_and_backward():
    lengths = [40, 3, 57, 21, 64, 9, 50, 33, 27, 36]  # T = 340, far above every other dimension (<= 64)
    assert square_tensors("bytescale", lengths) == []


def test_the_recorder_catches_a_t_by_t_mask():
    """Control: transformers' sdpa path builds a [1, 1, T, T] mask for the same packed input."""
    lengths = [40, 3, 57, 21, 64, 9, 50, 33, 27, 36]
    found = square_tensors("sdpa", lengths)
    assert any(shape[-2:] == (340, 340) for _, shape in found), found


def _modules_after(imports: str) -> list[str]:
    code = (
        f"import sys, {imports}\n"
        "print(' '.join(m for m in sys.modules if m == 'transformers' or m.startswith('lightning_bytescale.hf')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=180, capture_output=True, text=True
    )
    return done.stdout.split()


def test_base_package_does_not_import_transformers():
    """Without Lightning, nothing of the package loads transformers; with it (torchmetrics imports
    transformers when installed), the strategy still never loads ``lightning_bytescale.hf``."""
    base = "lightning_bytescale, lightning_bytescale.packed_attention, lightning_bytescale.engine, " + (
        "lightning_bytescale.models, lightning_bytescale.planner, lightning_bytescale.data"
    )
    assert _modules_after(base) == []
    assert [
        m
        for m in _modules_after("lightning_bytescale.lightning.strategy")
        if m.startswith("lightning_bytescale")
    ] == []
