"""The reference Llama model: config presets, parameter/FLOP counts, RoPE, packed forward."""

from __future__ import annotations

import pytest
import torch

from lightning_bytescale.engine.reference import causal_attention
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.models.llama import apply_rope, rope_tables
from lightning_bytescale.packed_attention import attention_context
from lightning_bytescale.packed_attention.layout import AttentionLayout


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("tied", [True, False])
def test_num_params_matches_the_module(name, tied):
    cfg = LlamaConfig.preset(name, tie_embeddings=tied)
    model = LlamaModel(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_paper_7b_shape_on_meta_device():
    cfg = LlamaConfig.preset("7b")
    assert (cfg.layers, cfg.heads, cfg.kv_heads, cfg.dim, cfg.head_dim) == (32, 32, 8, 4096, 128)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == cfg.num_params()
    assert 5.5e9 < n < 7.0e9  # GQA with 8 KV groups is smaller than the 6.7B MHA LLaMA-7B
    # Training FLOPs: 6 per matmul weight per token, plus causal attention growing linearly in s.
    matmul = n - cfg.vocab * cfg.dim - cfg.dim * (2 * cfg.layers + 1)  # minus the lookup table and norms
    assert cfg.flops_per_token(0) == 6 * matmul
    slope = 6 * cfg.layers * cfg.heads * cfg.head_dim  # 3 * 4 * L * H * D / 2
    assert cfg.flops_per_token(8192) - cfg.flops_per_token(0) == slope * 8192
    assert cfg.flops_per_token(100, training=False) * 3 == cfg.flops_per_token(100)
    assert cfg.flops_per_token(100, causal=False) > cfg.flops_per_token(100)


def test_config_errors():
    with pytest.raises(ValueError, match="unknown Llama preset"):
        LlamaConfig.preset("8b")
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(dim=32, heads=4, kv_heads=3)
    with pytest.raises(ValueError, match="divisible by heads"):
        LlamaConfig(dim=30, heads=4, kv_heads=2)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 16, dtype=torch.float64)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_tables(torch.tensor([pq]), 16, 10000.0, torch.float64)
        ck, sk = rope_tables(torch.tensor([pk]), 16, 10000.0, torch.float64)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert abs(score(7, 3) - score(1004, 1000)) < 1e-9
    assert abs(score(7, 3) - score(7, 4)) > 1e-6


def test_packed_forward_equals_each_sequence_alone():
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny", tie_embeddings=True)
    model = LlamaModel(cfg).double()
    ref = LlamaModel(cfg, attention_fn=causal_attention).double()
    ref.load_state_dict(model.state_dict())
    lengths = (4, 1, 9)
    seqs = [torch.randint(0, cfg.vocab, (s,)) for s in lengths]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(s) for s in lengths])
    layout = AttentionLayout(cu_seqlens=torch.tensor([0, 4, 5, 14]), seq_lens=lengths)
    with attention_context(layout):
        packed = model(ids, pos)
    alone = torch.cat([ref(s, torch.arange(s.numel())) for s in seqs])
    assert packed.shape == (14, cfg.vocab)
    assert (packed - alone).abs().max().item() <= 1e-12
    # Without positions, tokens are one causal sequence starting at 0.
    assert torch.allclose(model(seqs[2]), ref(seqs[2], torch.arange(9)), atol=1e-12)


def test_bf16_forward_runs():
    model = LlamaModel(LlamaConfig.preset("tiny")).to(torch.bfloat16)
    out = model(torch.randint(0, 64, (6,)), torch.arange(6))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    with pytest.raises(ValueError, match="packed"):
        model(torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_q_k_v_reach_attention_in_the_autocast_dtype(weights):
    """Under bf16 autocast the RoPE tables follow the projections: no float32 q/k next to a bf16 v."""
    seen = []

    def recording(q, k, v):
        seen.append((q.dtype, k.dtype, v.dtype))
        return causal_attention(q, k, v)

    model = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=recording).to(weights)
    ids, pos = torch.randint(0, 64, (7,)), torch.arange(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, pos)
    assert seen == [(torch.bfloat16,) * 3] * model.config.layers
    seen.clear()
    model.double()(ids, pos)  # outside autocast: the weights' dtype
    assert seen == [(torch.float64,) * 3] * model.config.layers


@pytest.mark.parametrize("tied", [True, False])
def test_a_meta_device_model_materialises_with_the_model_init(tied):
    """``Trainer.init_module(empty_init=True)`` / ``configure_model``: the strategy's meta-device build,
    materialised the way Lightning does (each module's ``reset_parameters``), equals the eager model."""
    from lightning_bytescale.lightning import compat
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    cfg = LlamaConfig.preset("tiny", tie_embeddings=tied)
    torch.manual_seed(11)
    eager = LlamaModel(cfg)
    torch.manual_seed(11)
    with ByteScaleStrategy().tensor_init_context(empty_init=True):
        lazy = LlamaModel(cfg)
    assert all(p.is_meta for p in lazy.parameters())
    compat._materialize_distributed_module(lazy, torch.device("cpu"))
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(a, b), name  # the same draws in the same order
    std = float(lazy.embed.weight.std())
    assert abs(std - 0.02) < 0.002, std  # the model's N(0, 0.02), not nn.Embedding's N(0, 1)
    assert torch.equal(lazy.norm.weight, torch.ones_like(lazy.norm.weight))
