"""DTensor parameters seen as their local shards, for the step's data-parallel gradient sum.

Under tensor parallelism (and FSDP2) parameters and their gradients are DTensors; the step's
gradient sum over the data-parallel group
(:func:`~lightning_bytescale.engine.executor.sync_step`) flattens plain gradients into one
buffer.  Summing lane ``t``'s shard over the HDP ranks of lane ``t`` is exactly that sum on the
local shards, once each gradient has its parameter's placements (DTensor's autograd can leave
one replicated or partial on the TP mesh: an embedding under DTensor's own ``RowwiseParallel``
comes back replicated, not ``VocabParallelEmbedding``'s; it is redistributed first, a slice or a TP reduction, the same on every lane), so :class:`LocalShards` hands ``sync_step`` one plain leaf per DTensor parameter
that shares the shard's storage (its ``.grad`` shares the local gradient's), and afterwards
puts what the sum left back on the DTensor parameters: a gradient summed in place is already
there, one that arrived on a rank that produced none is wrapped as a DTensor of the parameter's
placements, one no rank produced (or, under ZeRO-2, that another rank owns) is ``None``.  Plain
parameters pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class _Entry:
    name: str
    param: torch.Tensor
    proxy: torch.Tensor  # ``param`` itself for a plain tensor
    local_grad: torch.Tensor | None  # the DTensor gradient's local tensor handed to the proxy


class LocalShards:
    """``(name, parameter)`` pairs with every DTensor replaced by a plain view of its local shard."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        self._entries: list[_Entry] = []
        with torch.no_grad():
            for name, p in named:
                if not isinstance(p, DTensor):
                    self._entries.append(_Entry(name, p, p, None))
                    continue
                if p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
                    # DTensor's autograd may leave a gradient replicated (an embedding under its own
                    # RowwiseParallel) or partial: bring it to the parameter's own placements first
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                proxy = p.to_local().detach().requires_grad_(p.requires_grad)
                local_grad = None if p.grad is None else p.grad.to_local()
                proxy.grad = local_grad
                self._entries.append(_Entry(name, p, proxy, local_grad))

    @property
    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The pairs to hand to ``sync_step``: plain tensors only, in the given order."""
        return [(e.name, e.proxy) for e in self._entries]

    def rekey(self, by_parameter: Mapping[int, int]) -> dict[int, int]:
        """``by_parameter`` (keyed by ``id(parameter)``, e.g. ZeRO-2's owners) keyed by the ids of the tensors in :attr:`named`."""
        return {id(e.proxy): by_parameter[id(e.param)] for e in self._entries if id(e.param) in by_parameter}

    def write_back(self) -> None:
        """Give each DTensor parameter the gradient its proxy holds now (see the module docstring)."""
        for e in self._entries:
            if e.proxy is e.param:
                continue
            grad = e.proxy.grad
            if grad is None:
                e.param.grad = None
            elif grad is not e.local_grad:
                e.param.grad = DTensor.from_local(
                    grad, e.param.device_mesh, e.param.placements, run_check=False, shape=e.param.shape,
                    stride=e.param.stride(),
                )  # fmt: skip


__all__ = ["LocalShards"]
