"""Gradient sync in buckets, overlapped with the last micro-batch's backward, with no extra copy.

A rank's gradients are final once the backward of its *last* micro-batch has accumulated them.
:class:`BucketedGradSync` watches that backward (``register_post_accumulate_grad_hook``): as
soon as every parameter of the next bucket has its final gradient, it starts an asynchronous
all-reduce (sum) of that bucket, so communication overlaps the rest of the backward, as DDP's
reducer does.  Buckets hold about ``bucket_bytes`` (DDP's 25 MB by default), except the first
in backward order, which holds at most ``first_bucket_bytes`` (DDP's 1 MiB): a model smaller than
one bucket would otherwise be one bucket, launched only when the whole backward is over, while
the small first bucket of the last layers' gradients is summed during the rest of it.  They are launched
strictly in bucket order on every rank -- collectives must be issued in the same order
everywhere, and ranks' backwards differ -- so a bucket with a parameter that got no gradient in
the last backward (used only by earlier micro-batches, or not at all) waits for
:meth:`BucketedGradSync.finish`, which launches the rest after the loop and waits for all.  A
rank without micro-batches launches every bucket there, with zeros.  Nothing ever *waits*
inside a hook: a rank blocked in its backward could hold up a ring peer that the collective is
waiting for.

Memory: the gradients *are* the buckets.  :meth:`prepare` (at the start of a step) points each
small parameter's ``p.grad`` at a zeroed view of its bucket's flat buffer, autograd accumulates
into it in place, and the all-reduce runs on the buffer itself (DDP's
``gradient_as_bucket_view``); a parameter of a bucket's size or more is a bucket of its own and
its gradient tensor is all-reduced in place.  So nothing is copied, and beyond the gradients
themselves only autograd's transient gradients of small parameters (less than a bucket each)
exist.  Parameters narrower than float32 (bf16/fp16) are summed in a float32 copy made at
launch, so a sum over many ranks does not drift; that copy is the only extra memory, one per
such bucket in flight.

ZeRO-2 (``owners``): a parameter whose optimizer state lives on one rank (the
``ZeroRedundancyOptimizer`` partition, :mod:`~lightning_bytescale.engine.zero`) needs its
summed gradient on that rank only.  Buckets then hold parameters of one owner each, and a
bucket is *reduced* to its owner (``dist.reduce``) instead of all-reduced; once it is done,
the other ranks drop those gradients and free the bucket's buffer (it is allocated again, zeroed,
at the next :meth:`BucketedGradSync.prepare`).  So from the end of the sync to the next step's
backward each rank holds only the gradients of its own shard.  Parameters without an owner
(not in a sharded optimizer) are all-reduced as before.

The all-reduces run on their own process group (created once, at set-up), so they can be in
flight while the last micro-batch's ring exchanges run point-to-point on the global group:
with NCCL, operations of one group are ordered on one stream, and a bucket all-reduce queued
before another rank's ring receive would deadlock.

The step's scalars (loss, token counts, per-rank reports: :func:`~lightning_bytescale.engine.executor.sync_step`)
can ride in the last bucket instead of a collective of their own (the *carrier*, on gloo only:
there each collective, however small, costs a rank a worker thread's round trip -- about 1.5 ms
of CPU with 4 ranks on 2 cores -- while on NCCL a small all-reduce is cheap and the last bucket
is better launched from its hook).  The carrier is the last bucket in launch order when it is
all-reduced in place (not a solo parameter, not ZeRO-2, not widened): its buffer has ``reserve``
elements after the gradients' views, it is never launched from a hook but by :meth:`finish`,
which writes the tail into that room first -- the last bucket becomes final at the very end of
the backward, so little overlap is given up.  The same choice is made on every rank (it
depends only on the parameters and the group), so the collectives keep one order everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bytescale.engine.finite import all_finite
from lightning_bytescale.errors import ConfigError

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed's first DDP bucket


class _Bucket:
    """Parameters whose gradients are summed by one collective.

    Several small parameters share one flat buffer whose views are their gradients.  A
    parameter of a bucket's size or more is a bucket of its own (``solo``): its gradient is
    reduced in place, with no buffer, so autograd can hand over the gradient it computed
    without an extra copy of that (large) tensor.  ``owner`` is the global rank the sum goes
    to (ZeRO-2), or ``None``: every rank gets it (all-reduce).
    """

    def __init__(self, params: list[nn.Parameter], solo: bool = False, owner: int | None = None) -> None:
        self.params = params
        self.solo = solo
        self.owner = owner
        self.numel = sum(p.numel() for p in params)  # the gradients' elements (the buffer's front)
        self.reserve = 0  # elements after them, for a carried tail (the carrier bucket only)
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor | None] = [None] * len(params)
        if not solo:
            self.allocate()
        self.widen = params[0].dtype in (torch.bfloat16, torch.float16)  # sum in float32
        self.work: Any = None
        self.wide: torch.Tensor | None = None
        self.finite_at_launch: torch.Tensor | None = (
            None  # this rank's own values, read before the collective
        )

    def allocate(self) -> None:
        """A zeroed flat buffer and the parameters' views into it."""
        first = self.params[0]
        self.buffer = torch.zeros(self.numel + self.reserve, dtype=first.dtype, device=first.device)
        offset = 0
        for j, p in enumerate(self.params):
            self.views[j] = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    @property
    def grads(self) -> torch.Tensor | None:
        """The part of the buffer the gradients are views of (without a carried tail's room)."""
        return None if self.buffer is None else self.buffer[: self.numel]

    def release(self) -> None:
        """Drop the gradients and the buffer (a non-owner after the reduce: ZeRO-2)."""
        for p in self.params:
            p.grad = None
        self.buffer = None
        self.views = [None] * len(self.params)
        self.wide = None


class BucketedGradSync:
    """Sum ``params``' gradients over the ranks of ``group`` in buckets overlapped with backward.

    Per step: :meth:`prepare` before the first micro-batch, :meth:`arm` right before the last
    one (its backward then launches buckets as they become final), :meth:`finish` after the
    loop on every rank (it launches the rest and waits); afterwards every ``p.grad`` holds the
    sum over ranks -- with ``owners`` (ZeRO-2: ``id(parameter) -> global rank`` of the rank
    that keeps its optimizer state), only on the owner, and the other ranks hold ``None``.
    :meth:`produced` tells which parameters got a gradient on this rank (a prepared gradient
    is a zero buffer even if nothing reached it).  :meth:`close` removes the hooks.  Without
    an initialised process group nothing is communicated.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        owners: Mapping[int, int] | None = None,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if first_bucket_bytes <= 0:
            raise ConfigError(f"first_bucket_bytes must be positive, got {first_bucket_bytes}")
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = min(int(first_bucket_bytes), self.bucket_bytes)
        self.owners = dict(owners) if owners is not None else None
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialised else 0  # global rank: owners are global ranks
        self.buckets = self._make_buckets()
        self._where = {
            id(p): (b, j) for b, bucket in enumerate(self.buckets) for j, p in enumerate(bucket.params)
        }
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._armed = False
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._produced: set[int] = set()
        self._next = 0
        self.launched_in_backward = 0  # buckets launched during the last backward (telemetry)
        self.track_finite = False  # record each bucket's local finiteness when it is launched
        last = self.buckets[-1] if self.buckets else None
        carries = (
            initialised
            and dist.get_backend(group) == "gloo"
            and last is not None
            and not last.solo
            and last.owner is None
            and not last.widen
        )
        self.carrier: _Bucket | None = last if carries else None
        self._hook_launchable = len(self.buckets) - (1 if self.carrier is not None else 0)
        self._carried = 0  # elements of the tail carried in the last finish()
        self._grow_to = 0  # the carrier's room from the next prepare() on (a tail that did not fit)

    def _make_buckets(self) -> list[_Bucket]:
        """Last parameters first (backward computes them first); one dtype, device and owner per bucket.

        Buckets are ordered by the backward position of their last parameter, i.e. by when they
        become final.  Without ``owners`` one bucket is filled at a time; with them, one per
        owner (and dtype and device) is open at a time, so each bucket can be reduced to one rank.
        Until the first bucket is closed, open buckets take at most ``first_bucket_bytes`` (a
        parameter larger than that still goes into an empty bucket alone), so the first bucket in
        backward order is small; with ``owners`` each owner's first bucket may be small too.
        """
        done: list[tuple[int, _Bucket]] = []  # (backward position of its last parameter, bucket)
        open_: dict[tuple[Any, ...], tuple[list[nn.Parameter], int, int]] = {}  # key -> params, bytes, last

        def close(key: tuple[Any, ...]) -> None:
            members, _, last = open_.pop(key)
            done.append((last, _Bucket(members, owner=key[0])))

        for position, p in enumerate(reversed(self.params)):
            owner = None if self.owners is None else self.owners.get(id(p))
            key = (owner, p.dtype, p.device)
            if self.owners is None:  # one open bucket at a time
                for other in [k for k in open_ if k != key]:
                    close(other)
            nbytes = p.numel() * p.element_size()
            if nbytes >= self.bucket_bytes:  # a bucket of its own, reduced in place
                if key in open_:
                    close(key)
                done.append((position, _Bucket([p], solo=True, owner=owner)))
                continue
            cap = self.bucket_bytes if done else self.first_bucket_bytes
            if key in open_ and open_[key][1] + nbytes > cap:
                close(key)
            members, size, _ = open_.get(key, ([], 0, position))
            members.append(p)
            open_[key] = (members, size + nbytes, position)
        for key in list(open_):
            close(key)
        return [bucket for _, bucket in sorted(done, key=lambda item: item[0])]

    @property
    def extra_bytes(self) -> int:
        """Memory this sync holds beyond the gradients themselves (float32 copies of narrow buckets)."""
        return sum(b.wide.numel() * b.wide.element_size() for b in self.buckets if b.wide is not None)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank holds now: bucket buffers and solo parameters' gradients."""
        total = 0
        for b in self.buckets:
            if b.buffer is not None:
                total += b.buffer.numel() * b.buffer.element_size()
            elif b.solo and b.params[0].grad is not None:
                total += b.params[0].grad.numel() * b.params[0].grad.element_size()
        return total

    def can_carry(self, n: int) -> bool:
        """Whether :meth:`finish` can carry a tail of ``n`` elements in the last bucket this step.

        A tail that does not fit makes room for the next steps (the carrier's buffer grows at the
        next :meth:`prepare`, with some headroom); this step's caller sends it on its own.  The
        answer depends only on ``n`` and earlier calls, so ranks asking the same keep agreeing.
        """
        carrier = self.carrier
        if carrier is None:
            return False
        if n <= carrier.reserve:
            return True
        self._grow_to = max(self._grow_to, n + n // 4 + 64)
        return False

    @property
    def carrier_dtype(self) -> torch.dtype | None:
        """The dtype a carried tail is summed in (``None``: this sync carries nothing)."""
        return None if self.carrier is None else self.carrier.params[0].dtype

    def carried(self) -> torch.Tensor:
        """The tail carried by the last :meth:`finish`, summed over the ranks (a view; copy to keep)."""
        carrier = self.carrier
        assert carrier is not None and carrier.buffer is not None and self._carried
        return carrier.buffer[carrier.numel : carrier.numel + self._carried]

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def prepare(self) -> None:
        """Point every gradient at its (zeroed) bucket view; an existing gradient is kept as its value."""
        if self.carrier is not None and self._grow_to > self.carrier.reserve:
            # room for the tail: a new buffer below (the gradients are copied over)
            self.carrier.reserve = self._grow_to
            self.carrier.buffer = None
        self._carried = 0
        for bucket in self.buckets:
            if bucket.solo:  # autograd's own gradient tensor is reduced in place
                continue
            if bucket.buffer is None:  # released after last step's reduce (ZeRO-2, not the owner)
                bucket.allocate()
            assert bucket.buffer is not None
            if all(p.grad is None for p in bucket.params):  # the usual case: one pass over the buffer
                bucket.buffer.zero_()
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
                continue
            for p, view in zip(bucket.params, bucket.views):
                assert view is not None
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
            if bucket.reserve:
                bucket.buffer[bucket.numel :].zero_()  # a carried tail's room
        self._produced = set()
        self._ready = [set() for _ in self.buckets]
        self._next = 0
        self.launched_in_backward = 0
        for bucket in self.buckets:
            bucket.finite_at_launch = None

    def arm(self) -> None:
        """The next backward is the step's last on this rank: launch buckets as they become final."""
        self._armed = True

    @torch.no_grad()
    def local_grads_finite(self) -> torch.Tensor | None:
        """A 0-d bool: this rank's OWN accumulated gradients are all finite (no host sync on a GPU).

        After the last backward some buckets are already being summed in place, so their
        buffers may hold other ranks' values: for those the flag recorded at launch (from this
        rank's values, before the collective) counts, and the buffers not launched yet are read
        directly.  So a non-finite gradient is blamed on the rank that produced it, not on a
        rank whose buffer an all-reduce in flight has just filled.  ``None`` without gradients.
        """
        flags: list[torch.Tensor] = []
        for b, bucket in enumerate(self.buckets):
            if b < self._next and bucket.finite_at_launch is not None:
                flags.append(bucket.finite_at_launch)
                continue
            values = _local_values(bucket)
            if values is not None:
                flags.append(all_finite([values]))
        if not flags:
            return None
        return torch.stack([f.to(flags[0].device) for f in flags]).all()

    def produced(self, p: nn.Parameter) -> bool:
        """Whether a backward of this step accumulated a gradient into ``p`` on this rank."""
        return id(p) in self._produced

    def _on_grad(self, p: torch.Tensor) -> None:
        self._produced.add(id(p))
        if not self._armed:
            return
        where = self._where.get(id(p))
        if where is None:
            return
        self._ready[where[0]].add(id(p))
        while self._next < self._hook_launchable and len(self._ready[self._next]) == len(
            self.buckets[self._next].params
        ):
            self._launch(self._next)
            self._next += 1
            self.launched_in_backward += 1

    def finish(self, tail: torch.Tensor | None = None) -> None:
        """Launch the buckets not launched yet (in order), then wait for all of them.

        ``tail`` (1-d, at most the carrier's room: :meth:`can_carry`) rides in the last bucket
        and is summed with it; :meth:`carried` reads the sum afterwards.
        """
        self._armed = False
        if tail is not None:
            carrier = self.carrier
            if carrier is None or tail.numel() > carrier.reserve or carrier.buffer is None:
                raise ValueError("this gradient sync has no room for the tail: ask can_carry(n) first")
            if self._next == len(self.buckets):
                raise RuntimeError("the last bucket was already launched: the tail cannot ride in it")
            carrier.buffer[carrier.numel : carrier.numel + tail.numel()].copy_(tail.reshape(-1))
            self._carried = tail.numel()
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for bucket in self.buckets:
            self._complete(bucket)

    # ---------------------------------------------------------------- buckets
    @torch.no_grad()
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.solo:
            p = bucket.params[0]
            if p.grad is None:  # no gradient on this rank: it contributes zeros
                p.grad = torch.zeros_like(p)
            target = p.grad
        else:
            for p, view in zip(bucket.params, bucket.views):  # autograd may have replaced a gradient
                if p.grad is not None and view is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
            assert bucket.buffer is not None
            target = bucket.buffer
        if self.track_finite:
            bucket.finite_at_launch = all_finite([target if bucket.solo else bucket.grads])
        if bucket.widen:
            bucket.wide = target.float()
            target = bucket.wide
        if not (dist.is_available() and dist.is_initialized()):
            return
        if bucket.owner is None:
            bucket.work = dist.all_reduce(target, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        else:  # ZeRO-2: the sum goes to the rank that keeps this bucket's optimizer state
            bucket.work = dist.reduce(
                target, dst=bucket.owner, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )

    @torch.no_grad()
    def _complete(self, bucket: _Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        if bucket.owner is not None and bucket.owner != self.rank:
            bucket.release()  # ZeRO-2: another rank owns these gradients
            return
        if bucket.solo:
            p = bucket.params[0]
            if bucket.wide is not None and p.grad is not None:
                p.grad.copy_(bucket.wide.view_as(p.grad))
            bucket.wide = None
            return
        if bucket.wide is not None and bucket.buffer is not None:
            bucket.buffer.copy_(bucket.wide)
            bucket.wide = None
        for p, view in zip(bucket.params, bucket.views):
            p.grad = view

    def close(self) -> None:
        """Remove the hooks and drop any collective left in flight (the sync is unusable afterwards).

        A step that failed part-way (an exception between the launch of a bucket and
        :meth:`finish`) leaves works behind; they would keep the process group's native state
        (its store, its threads) alive for as long as the sync is.
        """
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for bucket in self.buckets:
            bucket.work = None
            bucket.wide = None


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "BucketedGradSync"]


def _local_values(bucket: _Bucket) -> torch.Tensor | None:
    """The gradient values a bucket not launched yet holds on this rank (``None``: none)."""
    if bucket.solo:
        return bucket.params[0].grad
    if bucket.buffer is None:
        return None
    # autograd may have replaced a view by its own tensor: read what the parameters point at
    grads = [p.grad for p in bucket.params if p.grad is not None]
    if all(g.data_ptr() == v.data_ptr() for g, v in zip(grads, bucket.views) if v is not None) and len(
        grads
    ) == len(bucket.params):
        return bucket.grads
    return torch.cat([g.reshape(-1) for g in grads]) if grads else None
