"""A single-process reference for HDP training: each sequence alone, plain causal attention.

Used to check exactness: after one HDP step (any plan, any world size) the gradients must
equal the gradients of :func:`reference_loss` on the same global batch.  Nothing here touches
packing, layouts or rings, so the comparison is independent of that code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_bytescale.engine.micro_batch import EmptyBatchError


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over ONE sequence, ``[T, H, D]`` with GQA (``H % H_kv == 0``)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    t = q.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_loss(model: nn.Module, sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropies over all sequences / their total label count.

    ``model(input_ids [s], position_ids [s]) -> logits [s, V]`` runs on each sequence alone;
    the caller makes it use plain causal attention (e.g. ``attention_fn=causal_attention``).
    """
    total = None
    count = 0
    for seq in sequences:
        seq = torch.as_tensor(seq, dtype=torch.long)
        logits = model(seq, torch.arange(seq.numel()))
        ce = F.cross_entropy(logits[:-1].double(), seq[1:], reduction="sum")
        total = ce if total is None else total + ce
        count += seq.numel() - 1
    if total is None or count == 0:
        raise EmptyBatchError("the reference needs at least one sequence of two or more tokens")
    return total / count
