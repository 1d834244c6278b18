"""The layout of one packed micro-batch, as attention sees it.

The engine builds one `AttentionLayout` per micro-batch and installs it with
:func:`lightning_bytescale.packed_attention.attention_context`; the public
:func:`lightning_bytescale.packed_attention.attention` reads it, so a user's model never sees a ring.

Slots of the packed ``[T, ...]`` tensors are grouped by sequence: sequence ``j`` occupies
slots ``cu_seqlens[j]:cu_seqlens[j+1]``.

* Local micro-batch (``ring is None``): each sequence's slots are its real tokens, positions
  ``0 .. s_j - 1``, no padding.
* Ring micro-batch: the same sequences, in the same order, on every member; sequence ``j``
  occupies ``2 * c_j`` slots on every member (``c_j = zigzag.chunk_size(s_j, N)``): the real
  tokens of chunk ``member``, then those of chunk ``2N - 1 - member``, then the member's padding
  (0, 1 or 2 slots: the padding is spread over the chunks, see :mod:`lightning_bytescale.planner.zigzag`).
  Slot positions come from :func:`lightning_bytescale.planner.zigzag.member_positions`;
  positions ``>= s_j`` are padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_bytescale.planner import zigzag


@dataclass
class AttentionLayout:
    cu_seqlens: torch.Tensor  # int64 [n + 1], slot boundaries of each sequence in the packed tensor
    seq_lens: tuple[int, ...]  # real (full) length of each sequence
    ring: tuple[int, ...] | None = None  # ordered global ranks of the ring, None for local work
    member: int = 0  # this rank's index in ``ring``

    @property
    def ring_size(self) -> int:
        return 1 if self.ring is None else len(self.ring)

    @property
    def is_local(self) -> bool:
        return self.ring is None

    def positions(self, member: int | None = None) -> torch.Tensor:
        """Position of every slot (for ``member``; default this rank), int64 ``[T]``."""
        m = self.member if member is None else member
        if self.ring is None:
            return torch.cat([torch.arange(s, dtype=torch.long) for s in self.seq_lens])
        n = len(self.ring)
        return torch.tensor(
            [p for s in self.seq_lens for p in zigzag.member_positions(s, n, m)], dtype=torch.long
        )

    def valid(self, member: int | None = None) -> torch.Tensor:
        """True for real-token slots, False for padding, bool ``[T]``."""
        pos = self.positions(member)
        bound = torch.repeat_interleave(
            torch.tensor(self.seq_lens, dtype=torch.long), self.cu_seqlens.diff().long()
        )
        return pos < bound
