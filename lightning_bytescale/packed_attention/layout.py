"""The layout of one packed micro-batch, as attention sees it: host metadata, never a device tensor.

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

A ring micro-batch's ``mode`` says how its members compute attention: ``"ring"`` (zigzag ring
attention, :mod:`.ring`), ``"ulysses"`` (an all-to-all over the members gives each one every
token of ``H / N`` heads, :mod:`.ulysses`) or ``"hybrid"`` (Ulysses inside each group of
``ulysses_size`` consecutive members, the members one node holds, and a ring across the
groups).  The slots are the zigzag slots above in every mode.

Every field is a Python value (``cu_seqlens`` is a tuple of ints, whatever it was built from),
so moving a batch to a device -- Lightning's ``batch_to_device`` goes into dataclasses and moves
every tensor it finds -- leaves the layout where it is: on the host, readable without a
host-device synchronisation.  The kernels' device copies of the offsets are made from it once
per layout (:class:`~lightning_bytescale.packed_attention.segments.Segments`, from pinned memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.planner import zigzag

MODES = ("ring", "ulysses", "hybrid")


class AttentionModeError(ByteScaleError, ValueError):
    """A layout names an unknown attention mode, or a hybrid layout's Ulysses groups do not tile its ring."""


def _ints(values: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """Host ints of a sequence or a tensor (a device tensor is read back once, here)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    return tuple(int(x) for x in values)


@dataclass
class AttentionLayout:
    """Where each sequence of a packed micro-batch sits, and its ring: host metadata (no tensor)."""

    # slot boundaries of each sequence in the packed tensor, n + 1 host ints (a tensor or any
    # sequence of ints is accepted and stored as a tuple)
    cu_seqlens: tuple[int, ...]
    seq_lens: tuple[int, ...]  # real (full) length of each sequence
    ring: tuple[int, ...] | None = None  # ordered global ranks of the ring, None for local work
    member: int = 0  # this rank's index in ``ring``
    mode: str = "ring"  # "ring", "ulysses" or "hybrid": how a ring item's members compute attention
    # hybrid only: members per Ulysses group (consecutive in ``ring``: the item's members on one node)
    ulysses_size: int | None = None

    def __post_init__(self) -> None:
        self.cu_seqlens = _ints(self.cu_seqlens)
        self.seq_lens = _ints(self.seq_lens)
        self.ring = None if self.ring is None else _ints(self.ring)
        self.member = int(self.member)
        if self.mode not in MODES:
            raise AttentionModeError(
                f"attention mode {self.mode!r} is not one of {MODES}; set the plan's micro-batch mode to one of them"
            )
        if self.mode == "hybrid":
            u = self.ulysses_size
            n = self.ring_size
            if u is None or int(u) < 1 or n % int(u):
                raise AttentionModeError(
                    f"a hybrid layout needs ulysses_size, the members of each node, dividing its ring of {n} "
                    f"members; got {u!r}. Build it with build_micro_batch(..., ranks_per_node=...)"
                )
            self.ulysses_size = int(u)
        elif self.ulysses_size is not None:
            raise AttentionModeError(
                f"ulysses_size={self.ulysses_size} is for hybrid layouts; a {self.mode!r} layout takes none"
            )

    @property
    def ring_size(self) -> int:
        return 1 if self.ring is None else len(self.ring)

    @property
    def is_local(self) -> bool:
        return self.ring is None

    @property
    def num_slots(self) -> int:
        """Slots of the packed tensors the layout covers (``cu_seqlens[-1]``)."""
        return self.cu_seqlens[-1] if self.cu_seqlens else 0

    @property
    def slots(self) -> tuple[int, ...]:
        """Slots of each sequence (``diff(cu_seqlens)``)."""
        return tuple(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    def positions(self, member: int | None = None) -> torch.Tensor:
        """Position of every slot (for ``member``; default this rank), int64 ``[T]`` on the host."""
        m = self.member if member is None else member
        if self.ring is None:
            return torch.cat([torch.arange(s, dtype=torch.long) for s in self.seq_lens])
        n = len(self.ring)
        return torch.tensor(
            [p for s in self.seq_lens for p in zigzag.member_positions(s, n, m)], dtype=torch.long
        )

    def valid(self, member: int | None = None) -> torch.Tensor:
        """True for real-token slots, False for padding, bool ``[T]`` on the host."""
        pos = self.positions(member)
        bound = torch.repeat_interleave(
            torch.tensor(self.seq_lens, dtype=torch.long), torch.tensor(self.slots, dtype=torch.long)
        )
        return pos < bound
