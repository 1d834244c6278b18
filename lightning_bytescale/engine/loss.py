"""The token-level loss that makes HDP exactly equal to single-process training.

Every rank divides its *sum* of token losses by the token count of the whole global batch
(not of its micro-batch or rank), so summing the ranks' gradients with one all-reduce gives
the gradient of the global token-mean loss, whatever the plan (ByteScale Eq. 1-2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_bytescale.errors import ConfigError

IGNORE_INDEX = -100


def token_loss(logits: torch.Tensor, labels: torch.Tensor, num_global_tokens: int) -> torch.Tensor:
    """Sum of token cross-entropies (labels of -100 ignored) divided by ``num_global_tokens``.

    ``logits`` is ``[..., V]`` and ``labels`` the matching ``[...]``.  The cross-entropy is
    computed in float32 or wider: half-precision logits are upcast, float64 stays float64.
    """
    if int(num_global_tokens) <= 0:
        raise ConfigError(
            f"num_global_tokens must be positive, got {num_global_tokens}; "
            "a global batch without loss tokens cannot be normalised"
        )
    if logits.shape[:-1] != labels.shape:
        raise ConfigError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match: "
            "expected logits [..., V] for labels [...]"
        )
    if logits.dtype != torch.float64:
        logits = logits.float()
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / int(num_global_tokens)
