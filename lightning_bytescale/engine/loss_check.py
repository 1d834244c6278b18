"""Catch a loss that is not normalised by the global token count, in the first steps.

HDP is exact only if every micro-batch returns ``sum of token losses / num_global_tokens``
(:func:`~lightning_bytescale.engine.loss.token_loss`, or ``mb.loss(logits)``).  The most
common mistake, ``F.cross_entropy(logits, labels)`` (a per-micro-batch mean), trains without
any error but weights tokens by their micro-batch's size: the logged loss is several times the
true one and the parameters differ from single-process training.

The check is exact rather than heuristic: a correctly normalised loss is *inversely
proportional* to ``num_global_tokens``.  So, once, the same forward runs again without
gradients on a copy of the micro-batch whose ``num_global_tokens`` is doubled, from the same
random-number state (dropout draws the same masks).  ``token_loss`` then gives exactly half
the loss (up to rounding); a per-micro-batch mean gives the same loss.  Each rank probes its
first micro-batch without a ring; and one ring item of the plan (the first without offload),
marked ``probe_ring``, is probed by all of its members together, since its forward exchanges
with them, so plans made of rings only (``static``) are checked too.  A loss of zero (no
trained token) is not conclusive, so the probe moves on to the next micro-batch or step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable

import torch

from lightning_bytescale.engine.batch import PackedMicroBatch


class LossScaling(enum.IntEnum):
    """Verdict of one probe (an integer so it can ride in the step's all-reduce)."""

    UNCHECKED = 0
    NORMALISED = 1  # the loss halves when num_global_tokens doubles
    PARTLY = 2  # it scales, but not inversely: part of it ignores num_global_tokens
    PER_MICRO_BATCH = 3  # it does not depend on num_global_tokens at all


def probe_forward(forward: Callable[[PackedMicroBatch], torch.Tensor], mb: PackedMicroBatch) -> torch.Tensor:
    """``forward`` on ``mb`` with ``num_global_tokens`` doubled: no gradients, RNG state untouched."""
    doubled = dataclasses.replace(mb, num_global_tokens=2 * int(mb.num_global_tokens))
    device = mb.input_ids.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.no_grad():
        out = forward(doubled)
    return out.detach()


def verdict(loss: float, probe: float) -> LossScaling:
    """Compare the real loss with the probe's (same forward, twice the global token count)."""
    if not (math.isfinite(loss) and math.isfinite(probe)) or abs(loss) < 1e-30:
        return LossScaling.UNCHECKED
    ratio = loss / probe if probe != 0 else math.inf
    if abs(ratio - 2.0) <= 0.02:
        return LossScaling.NORMALISED
    if abs(ratio - 1.0) <= 0.02:
        return LossScaling.PER_MICRO_BATCH
    return LossScaling.PARTLY


def is_probe_candidate(mb: PackedMicroBatch) -> bool:
    """Whether ``mb`` can be probed on its own: no ring (a ring's probe talks to its peers).

    A ring micro-batch marked ``probe_ring`` is probed too, but by every member at once
    (:func:`~lightning_bytescale.engine.micro_batch.probe_ring_item`), whatever else a member
    has probed.
    """
    return mb.layout.ring is None


__all__ = ["LossScaling", "is_probe_candidate", "probe_forward", "verdict"]
