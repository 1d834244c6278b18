"""The tensor memory a block of code holds at its peak, in one process, by following every storage it creates.

:class:`LiveBytes` is a dispatch mode: every tensor an op returns (a DTensor's local tensor) whose
storage is none of the op's inputs' (a new allocation, not a view or an in-place result) registers
that storage, weakly, so the bytes of the storages still alive are known after every op; ``peak``
is their largest sum, ``largest`` the largest single storage, ``live`` the sum at the end.
Storages made before the block (the model's tensors, and views of them) are not counted, nor meta
tensors (no memory), nor memory a library allocates outside PyTorch's operators.  On a CPU this
stands for what a GPU's allocator would count on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta
    ):  # a wrapper's data is a tensor of its own
        return None
    return t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.largest = 0

    @property
    def live(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(nbytes for _, nbytes in self.storages.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        inputs = {s._cdata for s in map(_storage, tree_leaves((args, kwargs))) if s is not None}
        out = func(*args, **(kwargs or {}))
        for storage in map(_storage, tree_leaves(out)):
            if storage is None or storage._cdata in inputs:
                continue
            key = storage._cdata
            if key not in self.storages or self.storages[key][0].expired():
                self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
                self.largest = max(self.largest, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out
