"""A Llama-style decoder for packed (THD) input, small enough to read in one sitting.

RMSNorm, rotary position embeddings computed from ``position_ids`` (angles in float64, tables
in the dtype the projections produce, so q, k and v reach attention in one dtype under autocast
too), grouped-query attention, a SwiGLU MLP, and tied or untied embeddings.  The model never sees sequence boundaries or
rings: it takes one packed micro-batch ``input_ids [T]`` with its ``position_ids [T]`` and calls
the public :func:`lightning_bytescale.packed_attention.attention`, which reads the micro-batch's
layout from the context the engine installed.  The same weights therefore run on whole local
sequences and on zigzag shards of a long sequence.

Shapes range from ``tiny`` (tests) to the paper's LLaMA-7B (and 13B/70B) via
:meth:`LlamaConfig.preset`; :meth:`LlamaConfig.flops_per_token` feeds MFU estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.packed_attention.input_dtype import autocast_dtype

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LlamaConfig:
    vocab: int = 32000
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    ffn_dim: int = 11008
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # For unit tests: a few thousand parameters.
        "tiny": dict(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn_dim=64),
        # For CPU examples and smoke runs.
        "small": dict(vocab=512, dim=128, layers=4, heads=8, kv_heads=2, ffn_dim=352),
        "125m": dict(
            vocab=32000, dim=768, layers=12, heads=12, kv_heads=4, ffn_dim=2048, tie_embeddings=True
        ),
        "1b": dict(vocab=32000, dim=2048, layers=22, heads=32, kv_heads=4, ffn_dim=5632),
        # The paper's models (Table 1: layers, heads, KV groups, hidden); FFN sizes from LLaMA.
        "7b": dict(vocab=32000, dim=4096, layers=32, heads=32, kv_heads=8, ffn_dim=11008),
        "13b": dict(vocab=32000, dim=5120, layers=40, heads=40, kv_heads=8, ffn_dim=13824),
        # LLaMA-30B's published shape (52 heads of 128, no GQA): the paper's table lists 56 heads
        # and 8 KV groups, which neither its hidden size 6656 nor 52 heads divide.
        "30b": dict(vocab=32000, dim=6656, layers=60, heads=52, kv_heads=52, ffn_dim=17920),
        "70b": dict(
            vocab=32000, dim=8192, layers=80, heads=64, kv_heads=8, ffn_dim=28672, rope_theta=500000.0
        ),
    }

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ConfigError(f"dim {self.dim} must be divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} must be even for rotary embeddings")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named shape (``tiny``, ``small``, ``125m``, ``1b``, ``7b``, ``13b``, ``30b``, ``70b``), with overrides."""
        if name not in cls.PRESETS:
            raise ConfigError(f"unknown Llama preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        hd = self.head_dim
        attn = self.dim * hd * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab * self.dim * (1 if self.tie_embeddings else 2)
        return self.layers * per_layer + emb + self.dim

    def flops_per_token(self, seq_len: int, *, causal: bool = True, training: bool = True) -> float:
        """Model FLOPs per token for a sequence of ``seq_len`` tokens (for MFU).

        Matrix multiplies: 2 FLOPs per weight per token (the output projection included, the
        embedding lookup not).  Attention scores and values: ``4 * layers * heads * head_dim``
        per key, over ``seq_len`` keys, halved when causal.  Training is 3x forward.
        """
        hd = self.head_dim
        matmul = self.layers * (
            self.dim * hd * (2 * self.heads + 2 * self.kv_heads) + 3 * self.dim * self.ffn_dim
        )
        matmul += self.vocab * self.dim
        keys = seq_len / 2 if causal else seq_len
        forward = 2 * matmul + 4 * self.layers * self.heads * hd * keys
        return float(3 * forward if training else forward)


def public_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The plugin's packed attention (local or ring, chosen by the current layout)."""
    from lightning_bytescale.packed_attention import attention

    return attention(q, k, v)


INIT_STD = 0.02  # the normal initialisation of every projection and embedding (GPT-2 / Llama)


class NormalLinear(nn.Linear):
    """``nn.Linear`` without bias whose ``reset_parameters`` draws ``N(0, init_std)``, as the model's init.

    Lightning materialises a model built on the meta device (``Trainer.init_module(empty_init=True)``,
    ``configure_model``) by calling each module's own ``reset_parameters``; ``nn.Linear``'s would
    give PyTorch's default (Kaiming uniform), not the model's initialisation.
    """

    def __init__(self, in_features: int, out_features: int, init_std: float = INIT_STD) -> None:
        self.init_std = init_std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters`` draws ``N(0, init_std)`` (``nn.Embedding``'s: ``N(0, 1)``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = INIT_STD) -> None:
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Ones, as at construction (meta-device initialisation calls this to materialise)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``cos, sin`` of shape ``[T, 1, head_dim]`` for the given positions (angles in float64)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim)
    )
    angles = position_ids.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rope_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype q and k come out of their projections in: autocast's under autocast (float64 stays), else ``x``'s."""
    target = autocast_dtype(x.device.type)
    return x.dtype if target is None or x.dtype == torch.float64 else target


def model_rope(
    config: LlamaConfig, position_ids: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's ``cos, sin`` tables for ``position_ids``, in the dtype q and k will have after ``x``'s projections."""
    return rope_tables(position_ids, config.head_dim, config.rope_theta, _rope_dtype(x))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = NormalLinear(cfg.dim, cfg.heads * cfg.head_dim)
        self.wk = NormalLinear(cfg.dim, cfg.kv_heads * cfg.head_dim)
        self.wv = NormalLinear(cfg.dim, cfg.kv_heads * cfg.head_dim)
        self.wo = NormalLinear(cfg.heads * cfg.head_dim, cfg.dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        # ``-1`` heads: under tensor parallelism the projections give this rank's heads only
        t = x.shape[0]
        q = apply_rope(self.wq(x).view(t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(t, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(t, -1, self.head_dim)
        return self.wo(attn(q, k, v).reshape(t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = NormalLinear(dim, hidden)
        self.w3 = NormalLinear(dim, hidden)
        self.w2 = NormalLinear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, attn)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(nn.Module):
    """``forward(input_ids [T], position_ids [T]) -> logits [T, vocab]`` on one packed micro-batch.

    ``attention_fn`` defaults to the public packed attention; tests may pass a plain causal
    attention to build an independent single-sequence reference with the same weights.
    """

    def __init__(self, config: LlamaConfig, attention_fn: AttentionFn | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention_fn: AttentionFn = attention_fn or public_attention
        # every parameter is initialised by its own module (normal(0, 0.02), norms ones), so a model
        # built on the meta device gets the same initialisation when Lightning materialises it
        self.embed = NormalEmbedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else NormalLinear(config.dim, config.vocab)

    def reset_parameters(self, std: float = INIT_STD) -> None:
        """Initialise again: projections and embeddings ``N(0, std)``, norms ones."""
        for m in self.modules():
            if isinstance(m, (NormalLinear, NormalEmbedding)):
                m.init_std = std
            if m is not self and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 1:
            raise ConfigError(f"input_ids must be packed [T], got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[0], device=input_ids.device)
        x = self.embed(input_ids)
        # in the dtype the projections produce (autocast's, under autocast): a float32 table would
        # turn q and k into float32 next to a half-precision v, and attention would cast them back
        cos, sin = model_rope(self.config, position_ids, x)
        for block in self.blocks:
            x = block(x, cos, sin, self.attention_fn)
        x = self.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.embed.weight)
        return self.lm_head(x)  # through the module, so a parallel style's hooks run

    def flops_per_token(self, seq_len: int, **kwargs: Any) -> float:
        return self.config.flops_per_token(seq_len, **kwargs)
