"""A loopback ring: all N members of a zigzag ring in one process and one thread.

The members run the very code a P2P ring runs (:func:`.ring.forward_steps` /
:func:`.ring.backward_steps`: the same set-up, block plans, kernels, merges and transfer
order); only the sends and receives are replaced by in-memory mailboxes.  One thread cannot
block in a wait while a peer has still to post, so the members' generators run in lockstep
(:func:`run_lockstep`): each member runs up to its next wait, then the next member, round
after round.  Every member posts before it waits in a round, so every wait finds its message.

On CUDA a post copies the tensor on the ring's communication stream and a wait hands it to
the compute stream with an event (:func:`.comm.post_on_comm_stream`, :func:`.comm.hand_over`),
as a P2P transfer does; so the loopback ring tests the streams and the block kernels of a GPU
ring on a single GPU, and on CPU every block, merge and backward path in CI.

    outs = loopback_ring_attention(q_parts, k_parts, v_parts, layouts)   # one tensor per member
    torch.autograd.backward(outs, grads)                                # gradients for every member

:func:`zigzag_shard` / :func:`zigzag_unshard` move packed whole sequences to members' slots and back.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.packed_attention import kernels
from lightning_bytescale.packed_attention.comm import hand_over, post_on_comm_stream
from lightning_bytescale.packed_attention.input_dtype import kernel_inputs
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.packed_attention.ring import Steps, backward_steps, forward_steps
from lightning_bytescale.packed_attention.ring_plan import RingLayoutError, RingSetup, ring_setup
from lightning_bytescale.planner import zigzag


class LoopbackError(ByteScaleError, RuntimeError):
    """The members of a loopback ring fell out of step (a wait with nothing posted for it)."""


@dataclass
class Mailboxes:
    """In-memory transport of one loopback ring: FIFO queues keyed by (src, dst, tag)."""

    boxes: dict[tuple[int, int, int], deque] = field(default_factory=lambda: defaultdict(deque))
    posts: int = 0
    bytes_sent: int = 0

    def transport(self, me: int):
        """The ``RingSetup.transport`` of member rank ``me``."""

        def post(tensor: torch.Tensor, dst: int, src: int, tag: int) -> _Delivery:
            # a copy: the receiver gets its own buffer, as over P2P
            self.boxes[(me, dst, tag)].append(post_on_comm_stream(tensor, tensor.clone))
            self.posts += 1
            self.bytes_sent += tensor.numel() * tensor.element_size()
            return _Delivery(self, (src, me, tag))

        return post


class _Delivery:
    """The receive side of one loopback post: ``wait()`` takes the next message from ``src``."""

    def __init__(self, mail: Mailboxes, key: tuple[int, int, int]) -> None:
        self._mail, self._key = mail, key
        self._recv: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._recv is not None

    def wait(self) -> torch.Tensor:
        if self._recv is None:
            box = self._mail.boxes[self._key]
            if not box:
                src, dst, tag = self._key
                raise LoopbackError(
                    f"member {dst} waits for a transfer (tag {tag}) that member {src} has not posted; "
                    "loopback members must run the same steps in lockstep (run_lockstep)"
                )
            self._recv = hand_over(box.popleft())
        return self._recv


def run_lockstep(members: Sequence[Steps]) -> list:
    """Run every member's generator to its end, one step each per round; their return values."""
    results: list = [None] * len(members)
    live = list(range(len(members)))
    while live:
        for m in list(live):
            try:
                next(members[m])
            except StopIteration as stop:
                results[m] = stop.value
                live.remove(m)
    return results


def _setups(
    layouts: Sequence[AttentionLayout], q_list: Sequence[torch.Tensor], mail: Mailboxes
) -> list[RingSetup]:
    n = len(layouts)
    if n == 0 or not (len(q_list) == n):
        raise RingLayoutError(
            f"a loopback ring needs one layout per member, got {n} layouts for {len(q_list)} members"
        )
    first = layouts[0]
    for m, lay in enumerate(layouts):
        if lay.ring is None or len(lay.ring) != n:
            raise RingLayoutError(
                f"layout {m} has ring {lay.ring}; a loopback ring of {n} members needs rings of {n}"
            )
        if lay.member != m:
            raise RingLayoutError(f"layout {m} says member {lay.member}; pass the layouts in member order")
        if tuple(lay.ring) != tuple(first.ring) or tuple(lay.seq_lens) != tuple(first.seq_lens):
            raise RingLayoutError(
                f"layout {m} (ring {lay.ring}, lengths {lay.seq_lens}) differs from layout 0 "
                f"(ring {first.ring}, lengths {first.seq_lens}); all members run the same ring item"
            )
    ranks = tuple(int(r) for r in first.ring)
    return [
        ring_setup(lay, q.shape[0], q.device, transport=mail.transport(ranks[m]))
        for m, (lay, q) in enumerate(zip(layouts, q_list))
    ]


class LoopbackRingAttention(torch.autograd.Function):
    """All members' ring attention in one autograd node: inputs ``*q, *k, *v``, outputs one per member."""

    @staticmethod
    def forward(ctx, spec, *tensors):  # type: ignore[override]
        layouts, scale, impl, mail = spec
        n = len(layouts)
        qs, ks, vs = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        setups = _setups(layouts, qs, mail)
        kernel_list = [kernels.resolve_kernel(impl, q) for q in qs]
        results = run_lockstep(
            [
                forward_steps(q, k, v, s, scale, kern)
                for q, k, v, s, kern in zip(qs, ks, vs, setups, kernel_list)
            ]
        )
        outs = [o.to(q.dtype) for (o, _), q in zip(results, qs)]
        ctx.save_for_backward(*qs, *ks, *vs, *outs, *(lse for _, lse in results))
        ctx.setups, ctx.scale, ctx.kernels, ctx.n = setups, scale, kernel_list, n
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):  # type: ignore[override]
        n = ctx.n
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[j * n : (j + 1) * n] for j in range(5))
        douts = [torch.zeros_like(o) if d is None else d for d, o in zip(douts, outs)]
        grads = run_lockstep(
            [
                backward_steps(d, q, k, v, o, lse, s, ctx.scale, kern)
                for d, q, k, v, o, lse, s, kern in zip(douts, qs, ks, vs, outs, lses, ctx.setups, ctx.kernels)
            ]
        )
        dq, dk, dv = zip(*grads)
        return (None, *dq, *dk, *dv)


def loopback_ring_attention(
    q_list: Sequence[torch.Tensor],
    k_list: Sequence[torch.Tensor],
    v_list: Sequence[torch.Tensor],
    layouts: Sequence[AttentionLayout],
    *,
    scale: float | None = None,
    impl: str | None = None,
    mailboxes: Mailboxes | None = None,
) -> list[torch.Tensor]:
    """Zigzag ring attention of every member of one ring item, in this process and thread.

    ``q_list[m]``, ``k_list[m]``, ``v_list[m]`` are member ``m``'s slots (``[T_m, H, D]``,
    ``[T_m, Hkv, D]``) and ``layouts[m]`` its layout (``member == m``, the same ring and lengths
    for all).  Returns member ``m``'s output for each ``m``; autograd reaches every input.
    ``scale`` defaults to ``D ** -0.5``; ``impl`` picks the block kernel as in
    :func:`.ring.ring_attention`; pass ``mailboxes`` to count the transfers.  Each member's q, k
    and v are brought to one dtype first (:func:`.input_dtype.kernel_inputs`).
    """
    if not (len(q_list) == len(k_list) == len(v_list)):
        raise RingLayoutError(
            f"got {len(q_list)} q, {len(k_list)} k and {len(v_list)} v tensors; pass one per member"
        )
    # one dtype per member, as in attention(): the autocast dtype under autocast
    members = [kernel_inputs(q, k, v) for q, k, v in zip(q_list, k_list, v_list)]
    q_list, k_list, v_list = ([m[j] for m in members] for j in range(3))
    scale = q_list[0].shape[-1] ** -0.5 if scale is None else float(scale)
    spec = (tuple(layouts), scale, impl, mailboxes if mailboxes is not None else Mailboxes())
    return list(LoopbackRingAttention.apply(spec, *q_list, *k_list, *v_list))


def ring_layouts(seq_lens: Sequence[int], ring_size: int) -> list[AttentionLayout]:
    """The layouts of all members of a ring of ``ring_size`` holding ``seq_lens`` (ranks ``0..N-1``)."""
    slots = [zigzag.slots_per_member(int(s), ring_size) for s in seq_lens]
    cu = [0, *accumulate(slots)]
    ring = tuple(range(ring_size))
    return [
        AttentionLayout(cu, tuple(int(s) for s in seq_lens), ring=ring, member=m) for m in range(ring_size)
    ]


def _slot_sources(layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """For every slot of ``layout``: its row in the packed whole sequences (clamped) and whether it is real."""
    lens = torch.tensor(layout.seq_lens, dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(layout.slots, dtype=torch.long))
    pos = layout.positions()
    valid = pos < lens[seq]
    return starts[seq] + torch.minimum(pos, lens[seq] - 1), valid


def zigzag_shard(x: torch.Tensor, layouts: Sequence[AttentionLayout], pad: float = 0.0) -> list[torch.Tensor]:
    """Split packed whole sequences ``x [sum(seq_lens), ...]`` into every member's slots (padding = ``pad``)."""
    parts = []
    for lay in layouts:
        src, valid = _slot_sources(lay)
        src, valid = src.to(x.device), valid.to(x.device)
        part = x.index_select(0, src)
        parts.append(part.masked_fill(~valid.view(-1, *([1] * (x.dim() - 1))), pad))
    return parts


def zigzag_unshard(parts: Sequence[torch.Tensor], layouts: Sequence[AttentionLayout]) -> torch.Tensor:
    """The inverse of :func:`zigzag_shard`: members' real slots back into packed whole sequences."""
    total = sum(int(s) for s in layouts[0].seq_lens)
    out = parts[0].new_zeros((total, *parts[0].shape[1:]))
    for part, lay in zip(parts, layouts):
        src, valid = _slot_sources(lay)
        idx = valid.nonzero().squeeze(1).to(part.device)
        out.index_copy_(0, src.to(part.device).index_select(0, idx), part.index_select(0, idx))
    return out
