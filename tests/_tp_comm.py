"""Helpers for counting tensor parallelism's communication and tensor sizes on one process.

:func:`fake_tp_mesh` makes this process rank ``rank`` of a ``TP``-lane tensor-parallel mesh on
torch's fake process group (``torch.testing._internal.distributed.fake_pg``): every collective
is issued and returns at once, moving no data, so ``CommDebugMode`` counts them exactly and a
lane's local computation runs as it would on that lane (values that depend on other lanes'
contributions are not the real ones).  :class:`LargestTensor` records the largest tensor an op
produces, a DTensor counted by its local shard: what a lane allocates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from _fake_pg import fake_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TP = 2


@contextlib.contextmanager
def fake_tp_mesh(rank: int = 0) -> Iterator[Any]:
    """This process as lane ``rank`` of a 1-D ``TP``-lane mesh on the fake process group, for the block."""
    with fake_world() as join:
        join(rank, TP)
        yield init_device_mesh("cpu", (TP,))


def all_reduces(mode: CommDebugMode) -> int:
    """All-reduces ``mode`` counted: DTensor's functional ones and plain ``dist.all_reduce`` calls."""
    return sum(
        n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op)
    )


def backward_all_reduces(loss: torch.Tensor) -> int:
    """The all-reduces of ``loss.backward()``."""
    with CommDebugMode() as mode:
        loss.backward()
    return all_reduces(mode)


class LargestTensor(TorchDispatchMode):
    """The most elements of one tensor any op produced inside the mode (a DTensor's local shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, (t.to_local() if isinstance(t, DTensor) else t).numel())
        return out
