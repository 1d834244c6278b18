"""HF model families on packed input: ``"bytescale"`` equals ``"sdpa"`` on each sequence alone.

Tiny configs built offline (``AutoConfig.for_model``), float64.  For every family, one packed
``[1, T]`` forward and backward with ``attn_implementation="bytescale"`` gives the same logits
and parameter gradients as the same weights run with ``"sdpa"`` on each sequence alone, both
with the sequence boundaries taken from ``position_ids`` (no layout installed) and inside an
``attention_context`` holding the micro-batch layout (the strategy's path).  ``FAMILIES`` and
:func:`tiny_config` are shared with the other ``test_hf_*`` files.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import lightning_bytescale.hf as lhf  # noqa: E402
from lightning_bytescale.hf import count_attention_calls, layout_from_positions  # noqa: E402
from lightning_bytescale.packed_attention import attention_context  # noqa: E402

VOCAB = 64
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)
# Per family: what differs from BASE (windows off, dropouts 0, small heads).  What each one adds
# to the coverage is in the comment.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},  # GQA, RoPE, RMSNorm, SwiGLU
    "qwen2": {"use_sliding_window": False},  # q/k/v biases
    "qwen3": {"head_dim": 8, "use_sliding_window": False},  # q/k RMSNorm per head
    "mistral": {"sliding_window": None},  # the window off
    "granite": {"attention_multiplier": 0.3, "embedding_multiplier": 2.0},  # scaling != D**-0.5
    "phi": {"partial_rotary_factor": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0},  # partial RoPE, LayerNorm
    "gemma": {"head_dim": 8},  # scaled embeddings, GeGLU
    "olmo2": {},  # q/k norm over all heads
    "gpt_neox": {"rotary_pct": 0.25, "attention_dropout": 0.0, "hidden_dropout": 0.0},  # parallel residual
    "starcoder2": {"sliding_window": None, "residual_dropout": 0.0, "embedding_dropout": 0.0},  # biases
    "cohere": {},  # parallel block, interleaved RoPE
    "gpt2": {
        "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256,
        "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    },  # learned absolute positions (from position_ids), multi-head
}  # fmt: skip
# Families whose norms run in float32 even on float64 weights: packed and per-sequence runs then
# agree to float32 rounding of the reductions over tokens, not to float64 rounding.
FLOAT32_INSIDE = {"gemma": 1e-7, "cohere": 1e-7}
# The families the multi-rank equivalence test trains (the four, plus scaling and partial RoPE).
TRAINED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "granite", "phi")


def tiny_config(family: str) -> Any:
    return AutoConfig.for_model(family, **{**BASE, **FAMILIES[family]})


def build(family: str, attn: str, seed: int = 0) -> torch.nn.Module:
    """A float64 model of ``family`` (weights from ``seed``) with its own config object."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        tiny_config(family), attn_implementation=attn, dtype=torch.float64
    )


def twin(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    """The same weights under another attention.  A config is per model: transformers writes
    the implementation into the config object, so sharing one would switch both models."""
    other = AutoModelForCausalLM.from_config(
        copy.deepcopy(model.config), attn_implementation=attn, dtype=torch.float64
    )
    other.load_state_dict(model.state_dict())
    return other


def packed(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(s) for s in lengths])
    return ids, pos


def per_sequence_reference(model, ids, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of each sequence run alone and the summed next-token loss (sdpa, float64)."""
    logits, loss, start = [], torch.zeros((), dtype=torch.float64), 0
    for s in lengths:
        seq = ids[start : start + s]
        out = model(input_ids=seq[None], position_ids=torch.arange(s)[None], use_cache=False).logits[0]
        logits.append(out)
        loss = loss + F.cross_entropy(out[:-1], seq[1:], reduction="sum")
        start += s
    return torch.cat(logits), loss


def packed_loss(logits: torch.Tensor, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    labels = torch.cat([torch.cat([ids[a + 1 : a + s], torch.tensor([-100])]) for a, s in _spans(lengths)])
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    return list(zip(starts, lengths))


def passes_positions_to_attention(model, ids, pos) -> bool:
    """Whether the model's layers hand ``position_ids`` to the attention function (the path that
    finds sequence boundaries without a layout)."""
    seen = []
    hook = lambda module, args, kwargs: seen.append("position_ids" in kwargs)  # noqa: E731
    attn = next(m for m in model.modules() if m.__class__.__name__.endswith("Attention"))
    handle = attn.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids[None], position_ids=pos[None], use_cache=False)
    handle.remove()
    return all(seen) and bool(seen)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("with_layout", [False, True], ids=["positions", "layout"])
def test_packed_bytescale_equals_sdpa_per_sequence(family, with_layout):
    lengths = [7, 1, 13, 4, 9]
    model = build(family, "bytescale")
    ref = twin(model, "sdpa")
    model.train(), ref.train()  # every dropout of the tiny configs is 0
    ids, pos = packed(lengths)

    want_logits, want_loss = per_sequence_reference(ref, ids, lengths)
    want_loss.backward()
    if not with_layout and not passes_positions_to_attention(model, ids, pos):
        pytest.skip(f"this transformers version does not hand position_ids to {family}'s attention")
    with count_attention_calls() as counted:
        if with_layout:
            with attention_context(layout_from_positions(pos, len(ids))):
                logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        else:
            logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
    loss = packed_loss(logits, ids, lengths)
    loss.backward()

    tol = FLOAT32_INSIDE.get(family, 1e-12)
    assert counted.calls == model.config.get_text_config().num_hidden_layers  # ours ran, in every layer
    assert (logits - want_logits).abs().max().item() <= tol
    assert abs(loss.item() - want_loss.item()) <= tol
    got, want = grads(model), grads(ref)
    assert got.keys() == want.keys() and got
    for name in want:
        assert (got[name] - want[name]).abs().max().item() <= tol, name


def test_packed_differs_from_one_long_sequence():
    """Control: the comparison above can fail. Without sequence boundaries the logits differ."""
    lengths = [7, 13]
    model = build("llama", "bytescale")
    ids, _ = packed(lengths)
    ref = twin(model, "sdpa")
    want, _ = per_sequence_reference(ref, ids, lengths)
    whole = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0]
    assert (whole[7:] - want[7:]).abs().max().item() > 1e-3


def test_layout_from_positions():
    layout = layout_from_positions(torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6]]), 8)
    assert layout.seq_lens == (3, 1, 2, 2) and layout.cu_seqlens == (0, 3, 4, 6, 8)
    assert layout.is_local
    assert layout_from_positions(None, 5).seq_lens == (5,)
    assert layout_from_positions(torch.tensor([[4, 5, 6]]), 3).seq_lens == (3,)  # a continued sequence


def test_registered_on_import():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["bytescale"] is lhf.bytescale_attention
    assert ALL_MASK_ATTENTION_FUNCTIONS["bytescale"] is lhf.bytescale_mask
    assert lhf.ATTN_IMPLEMENTATION == "bytescale"
