"""The tensor memory a block of code holds at its peak, in one process, by following every storage it creates.

:class:`LiveBytes` is a dispatch mode: every tensor an op returns (a DTensor's local tensor)
registers its storage, weakly, so the bytes of the storages still alive are known after every
op; ``peak`` is their largest sum, ``largest`` the largest single storage, ``live`` the sum at the
end.  Storages made before the block (the model's existing tensors) are not counted, and neither
are meta tensors (no memory) nor memory a library allocates outside PyTorch's operators.  On a
CPU this stands for what a GPU's allocator would count on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.largest = 0

    def _track(self, t: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.is_meta:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.storages or self.storages[key][0].expired():
            self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
            self.largest = max(self.largest, storage.nbytes())

    @property
    def live(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(nbytes for _, nbytes in self.storages.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.live)
        return out
