"""Test helpers over the offloader: the paper's ``act_ctx`` interface and a plan's per-rank ratios.

The package's interface is ``ActivationOffloader.context(micro_batch_id, ratio)`` (and
``micro_batch_context`` for engine micro-batches).  The tests also check that the paper's
interface (ByteScale §5.2: ``ctx = get_act_ctx(n, ratios, layers)``,
``ctx.update_micro_batch_id(i)``, ``with ctx: ...``) maps onto it, and read a whole rank's ratios
from a plan; both are thin wrappers kept here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_bytescale.offload.offloader import (
    ActivationOffloader,
    OffloadError,
    PassStats,
    _check_ratio,
    micro_batch_offload_ratio,
)


class ActCtx:
    """The paper's ``act_ctx``: per-micro-batch ratios; select one with :meth:`update_micro_batch_id`."""

    def __init__(self, offloader: ActivationOffloader, offload_ratios: Sequence[float]) -> None:
        for r in offload_ratios:  # validated up front, with the offloader's own message
            _check_ratio(r)
        self.offloader = offloader
        self.offload_ratios = [float(r) for r in offload_ratios]
        self.micro_batch_id = 0
        self._cm: contextlib.AbstractContextManager | None = None

    def update_micro_batch_id(self, micro_batch_id: int) -> None:
        if not 0 <= micro_batch_id < len(self.offload_ratios):
            raise OffloadError(
                f"micro-batch id {micro_batch_id} out of range: this act_ctx has "
                f"{len(self.offload_ratios)} ratios"
            )
        self.micro_batch_id = micro_batch_id

    def __enter__(self) -> PassStats:
        self._cm = self.offloader.context(self.micro_batch_id, self.offload_ratios[self.micro_batch_id])
        return self._cm.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        cm, self._cm = self._cm, None
        return cm.__exit__(*exc) if cm is not None else None


def get_act_ctx(
    num_micro_batch: int,
    offload_ratios: Sequence[float],
    layers: Sequence[nn.Module] | None = None,
    **kw: Any,
) -> ActCtx:
    """Paper-style constructor: an :class:`ActCtx` over a new :class:`ActivationOffloader`."""
    if len(offload_ratios) != num_micro_batch:
        raise OffloadError(f"got {len(offload_ratios)} offload ratios for {num_micro_batch} micro-batches")
    return ActCtx(ActivationOffloader(layers, **kw), offload_ratios)


def plan_offload_ratios(plan: Any, rank: int) -> list[float]:
    """Per micro-batch offload ratios of ``rank``'s list in ``plan`` (short-only micro-batches get 0)."""
    if not 0 <= rank < len(plan.ranks):
        raise OffloadError(f"rank {rank} not in the plan (world size {len(plan.ranks)})")
    return [micro_batch_offload_ratio(mb, plan.lengths, plan.capacity) for mb in plan.ranks[rank]]
