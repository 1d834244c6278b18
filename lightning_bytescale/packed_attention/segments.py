"""Geometry of packed variable-length blocks: which rows a block reads and how they split into sequences.

A ring step computes one *varlen block*: several sequences' query rows against the same
sequences' key rows, in one kernel call where the kernel allows it.  Two small objects
describe it:

* :class:`Segments`: the per-sequence lengths of the packed rows a kernel sees (host ints, for
  per-sequence loops and ``max_seqlen``), plus the device tensors CUDA varlen kernels take
  (``cu_seqlens`` as int32, and per-token sequence ids and offsets for log-sum-exp layouts);
* :class:`Rows`: the rows of a packed tensor a block reads: a contiguous range (a view, no copy)
  or an index (a gather), so one sequence never pays for a copy.

Device tensors are built once per device and cached on the object (ring set-ups are cached
per layout, so the layers of a model share them).  On CUDA they are copied from pinned host
memory with ``non_blocking=True``: building them never synchronises the host with the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without a host synchronisation.

    A pageable host-to-CUDA copy waits for the device; a pinned one with ``non_blocking=True``
    does not (PyTorch's pinned-memory allocator keeps the host buffer until the copy is done).
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True, eq=False)
class Segments:
    """Lengths of the sequences packed one after another in a block's rows."""

    lens: tuple[int, ...]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.lens and min(self.lens) < 0:
            raise ValueError(f"sequence lengths must be >= 0, got {self.lens}")

    @classmethod
    def of(cls, lens: Sequence[int]) -> Segments:
        return cls(tuple(int(n) for n in lens))

    @property
    def total(self) -> int:
        return sum(self.lens)

    @property
    def max_len(self) -> int:
        return max(self.lens, default=0)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of every sequence in the packed rows."""
        out, start = [], 0
        for n in self.lens:
            out.append((start, start + n))
            start += n
        return out

    def _cached(self, key: str, device: torch.device, build) -> torch.Tensor:
        slot = (key, str(device))
        if slot not in self._cache:
            self._cache[slot] = to_device(build(), device)
        return self._cache[slot]

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 ``[n + 1]`` cumulative offsets on ``device`` (the varlen kernels' ``cu_seqlens``)."""
        return self._cached(
            "cu", device, lambda: torch.tensor([0, *self.lens], dtype=torch.int64).cumsum(0).to(torch.int32)
        )

    def token_seq(self, device: torch.device) -> torch.Tensor:
        """int64 ``[total]``: the sequence index of every row."""
        return self._cached(
            "seq",
            device,
            lambda: torch.repeat_interleave(
                torch.arange(len(self.lens)), torch.tensor(self.lens, dtype=torch.long)
            ),
        )

    def token_offset(self, device: torch.device) -> torch.Tensor:
        """int64 ``[total]``: the offset of every row inside its sequence."""
        return self._cached(
            "off",
            device,
            lambda: (
                torch.cat([torch.arange(n) for n in self.lens])
                if self.lens
                else torch.zeros(0, dtype=torch.long)
            ),
        )


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows of a packed tensor along one dimension: ``range(start, stop)`` or an index."""

    start: int = 0
    stop: int = 0
    index: torch.Tensor | None = None  # int64 host index; None for the contiguous range
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, ranges: Sequence[tuple[int, int]]) -> Rows:
        """Rows covering ``ranges`` in order: a view when they are one contiguous run."""
        merged: list[list[int]] = []
        for a, b in ranges:
            if b <= a:
                continue
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        if len(merged) <= 1:
            a, b = merged[0] if merged else (0, 0)
            return cls(a, b)
        return cls(index=torch.cat([torch.arange(a, b) for a, b in merged]))

    @property
    def count(self) -> int:
        return self.stop - self.start if self.index is None else int(self.index.numel())

    def _index(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._cache:
            self._cache[key] = to_device(self.index, device)
        return self._cache[key]

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The rows of ``x`` (a view for a range, a copy for an index)."""
        if self.index is None:
            return x.narrow(dim, self.start, self.stop - self.start)
        return x.index_select(dim, self._index(x.device))

    def add_(self, target: torch.Tensor, value: torch.Tensor, dim: int = 0) -> None:
        """``target[rows] += value`` in place."""
        value = value.to(target.dtype)
        if self.index is None:
            target.narrow(dim, self.start, self.stop - self.start).add_(value)
        else:
            target.index_add_(dim, self._index(target.device), value)

    def put_(self, target: torch.Tensor, value: torch.Tensor, dim: int = 0) -> None:
        """``target[rows] = value`` in place."""
        if self.index is None:
            target.narrow(dim, self.start, self.stop - self.start).copy_(value)
        else:
            target.index_copy_(dim, self._index(target.device), value.to(target.dtype))
