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
:meth:`BucketedGradSync.launch`, which launches the rest right after that backward.  A rank
without micro-batches launches every bucket in :meth:`BucketedGradSync.finish`, with zeros.

The cross-communicator rule (docs/engine.md, "The order of a step's communication").  The
buckets run on their own process group, while ring attention exchanges point-to-point on the
global one; with NCCL a kernel of one communicator can keep another's from progressing, so
two communicators must be used in an order every rank agrees on.  Hooks launch buckets only in
a last backward *without* ring exchanges (:meth:`arm`); after a last backward with one, every
bucket is launched at once when it returns (:meth:`launch`).  So on every rank each ring
transfer of the step is issued before any bucket collective, and the ranks' issue orders
never cross.  For the same reason a hook may wait (for a float32 staging buffer, below): it
runs in a backward with no ring transfer, after this rank's last one, and waits only for an
earlier bucket, which every rank launches first, so nothing it waits for can be waiting for
this rank.

Memory: the gradients *are* the buckets.  :meth:`prepare` (at the start of a step) points each
small parameter's ``p.grad`` at a zeroed view of its bucket's flat buffer, autograd accumulates
into it in place, and the all-reduce runs on the buffer itself (DDP's
``gradient_as_bucket_view``); a parameter of a bucket's size or more is a bucket of its own and
its gradient tensor is all-reduced in place.  So nothing is copied, and beyond the gradients
themselves only autograd's transient gradients of small parameters (less than a bucket each)
exist.  Parameters narrower than float32 (bf16/fp16) are summed in float32, so a sum over many
ranks does not drift: at launch a narrow bucket is copied into one of at most
``staging_copies`` float32 staging buffers (each the size of the largest narrow bucket on its
device, allocated in the step's first launches and dropped by :meth:`finish`), and a bucket
that finds none free first completes the oldest one in flight (waits for its collective and
writes its sum back), whose buffer it then reuses.  So the extra memory is at most
``staging_copies`` float32 copies of the largest narrow bucket, however many there are (one
per bucket, all in flight at once, was up to twice the bf16 gradients).

ZeRO-2 (``owners``): a parameter whose optimizer state lives on one rank (the
``ZeroRedundancyOptimizer`` partition, :mod:`~lightning_bytescale.engine.zero`) needs its
summed gradient on that rank only.  Buckets then hold parameters of one owner each, and a
bucket is *reduced* to its owner (``dist.reduce``) instead of all-reduced; once it is done,
the other ranks drop those gradients and free the bucket's buffer (it is allocated again, zeroed,
at the next :meth:`BucketedGradSync.prepare`).  So from the end of the sync to the next step's
backward each rank holds only the gradients of its own shard.  Parameters without an owner
(not in a sharded optimizer) are all-reduced as before.

DTensor parameters (tensor parallelism on a ``(data_parallel, tensor_parallel)`` mesh, a
pipeline stage sharded the same way): the sync sums each parameter's *local shard* over
``group`` (the lane's data-parallel group: the same shard of every HDP rank), which is the sum
of the DTensor gradient.  A bucket holds local shards; each DTensor gradient is a DTensor of its
parameter's placements whose local tensor is the bucket view, so autograd's in-place
accumulation (a gradient arriving in another placement, such as the vocabulary-sharded
embedding's replicated one, is brought to the parameter's by DTensor's in-place add, a slice)
writes into the bucket.  Bucket boundaries are decided from each DTensor's global size divided
by its shards, not from the local shard's size, so every TP lane of an HDP rank builds the same
buckets even when a dimension does not divide evenly: the lanes run the same backward, so each
launches bucket ``k`` at the same point among its TP collectives, and every rank's issue order
of TP and bucket collectives is a subsequence of one global order (all TP collectives before
bucket 0, bucket 0 in every lane, the TP collectives up to bucket 1, ...).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bytescale.engine.finite import all_finite
from lightning_bytescale.errors import ConfigError

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed's first DDP bucket
DEFAULT_STAGING_COPIES = 2  # float32 copies of narrow buckets in flight: one summed while the next is filled


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
        self.numel = sum(_local(p).numel() for p in params)  # the gradients' elements (the buffer)
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor | None] = [None] * len(params)  # local-shard shapes
        if not solo:
            self.allocate()
        self.widen = params[0].dtype in (torch.bfloat16, torch.float16)  # sum in float32
        self.work: Any = None
        self.wide: torch.Tensor | None = None  # a narrow bucket's float32 copy, in flight (a staging view)
        self.staging: torch.Tensor | None = None  # the staging buffer ``wide`` is a view of
        self.done = False  # its collective waited for and its sum in place (this step)
        self.finite_at_launch: torch.Tensor | None = (
            None  # this rank's own values, read before the collective
        )

    def allocate(self) -> None:
        """A zeroed flat buffer and the parameters' (local shards') views into it."""
        first = _local(self.params[0])
        self.buffer = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        offset = 0
        for j, p in enumerate(self.params):
            local = _local(p)
            self.views[j] = self.buffer[offset : offset + local.numel()].view_as(local)
            offset += local.numel()

    def release(self) -> None:
        """Drop the gradients and the buffer (a non-owner after the reduce: ZeRO-2)."""
        for p in self.params:
            p.grad = None
        self.buffer = None
        self.views = [None] * len(self.params)
        self.wide = None


class BucketedGradSync:
    """Sum ``params``' gradients over the ranks of ``group`` in buckets overlapped with backward.

    Per step: :meth:`prepare` before the first micro-batch; :meth:`arm` right before the last
    one when its backward exchanges nothing point-to-point (that backward then launches buckets
    as they become final); :meth:`launch` right after the last backward (it launches the rest,
    without waiting); :meth:`finish` on every rank (it launches what is left -- everything on a
    rank without micro-batches -- and waits); afterwards every ``p.grad`` holds the
    sum over ranks -- with ``owners`` (ZeRO-2: ``id(parameter) -> global rank`` of the rank
    that keeps its optimizer state), only on the owner, and the other ranks hold ``None``.
    :meth:`produced` tells which parameters got a gradient on this rank (a prepared gradient
    is a zero buffer even if nothing reached it).  :meth:`close` removes the hooks.  Without
    an initialised process group nothing is communicated.  DTensor parameters are summed as
    their local shards over ``group`` (the lane's data-parallel group on the mesh), their
    gradients DTensors over the bucket views (module docstring).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        owners: Mapping[int, int] | None = None,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        staging_copies: int = DEFAULT_STAGING_COPIES,
    ) -> None:
        if isinstance(staging_copies, bool) or not isinstance(staging_copies, int) or staging_copies < 1:
            raise ConfigError(
                f"staging_copies must be an integer >= 1 (float32 copies of bf16/fp16 buckets in flight), "
                f"got {staging_copies!r}"
            )
        if bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if first_bucket_bytes <= 0:
            raise ConfigError(f"first_bucket_bytes must be positive, got {first_bucket_bytes}")
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = min(int(first_bucket_bytes), self.bucket_bytes)
        self.owners = dict(owners) if owners is not None else None
        self.staging_copies = staging_copies
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
        self._staged: deque[_Bucket] = deque()  # narrow buckets whose float32 copy is in flight, oldest first
        self._free_staging: dict[torch.device, list[torch.Tensor]] = {}  # staging buffers not in use
        self._staging_made: dict[torch.device, int] = {}  # staging buffers allocated this step
        self._staging_numel: dict[torch.device, int] = {}  # the largest narrow bucket, per device
        for bucket in self.buckets:
            if bucket.widen:
                device = bucket.params[0].device
                self._staging_numel[device] = max(self._staging_numel.get(device, 0), bucket.numel)
        self.peak_staging_bytes = 0  # the most bytes of float32 staging buffers allocated at once (a step)

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
            nbytes = _sizing_numel(p) * p.element_size()  # the same on every TP lane
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
        """Memory this sync holds beyond the gradients themselves (float32 staging buffers of narrow buckets)."""
        return sum(4 * self._staging_numel[device] * made for device, made in self._staging_made.items())

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients this rank holds now: bucket buffers and solo parameters' gradients."""
        total = 0
        for b in self.buckets:
            if b.buffer is not None:
                total += b.buffer.numel() * b.buffer.element_size()
            elif b.solo and b.params[0].grad is not None:
                grad = _local(b.params[0].grad)
                total += grad.numel() * grad.element_size()
        return total

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def prepare(self) -> None:
        """Point every gradient at its (zeroed) bucket view; an existing gradient is kept as its value."""
        for bucket in self.buckets:
            if bucket.solo:  # autograd's own gradient tensor is reduced in place
                continue
            if bucket.buffer is None:  # released after last step's reduce (ZeRO-2, not the owner)
                bucket.allocate()
            assert bucket.buffer is not None
            if all(p.grad is None for p in bucket.params):  # the usual case: one pass over the buffer
                bucket.buffer.zero_()
                for p, view in zip(bucket.params, bucket.views):
                    assert view is not None
                    p.grad = _as_grad(view, p)
                continue
            for p, view in zip(bucket.params, bucket.views):
                assert view is not None
                grad = _local_grad(p)
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                p.grad = _as_grad(view, p)
        self._produced = set()
        self._ready = [set() for _ in self.buckets]
        self._next = 0
        self.launched_in_backward = 0
        self._armed = False
        self._drop_staging()
        self.peak_staging_bytes = 0
        for bucket in self.buckets:
            bucket.finite_at_launch = None
            bucket.done = False

    def arm(self) -> None:
        """The next backward is the step's last on this rank: launch buckets as they become final.

        Only for a backward without ring exchanges (the cross-communicator rule, module
        docstring); after one with them, call :meth:`launch` once it has returned.
        """
        self._armed = True

    def launch(self) -> None:
        """The last backward is over: launch every bucket not launched yet, in order, without waiting."""
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1

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
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(
            self.buckets[self._next].params
        ):
            self._launch(self._next)
            self._next += 1
            self.launched_in_backward += 1

    def finish(self) -> None:
        """Launch the buckets not launched yet (in order), then wait for all of them."""
        self.launch()
        for bucket in self.buckets:
            self._complete(bucket)
        self._drop_staging()

    # ---------------------------------------------------------------- buckets
    @torch.no_grad()
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.solo:
            p = bucket.params[0]
            if p.grad is None:  # no gradient on this rank: it contributes zeros
                p.grad = _as_grad(torch.zeros_like(_local(p)), p)
            target = _local_grad(p)
            assert target is not None
        else:
            for p, view in zip(bucket.params, bucket.views):  # autograd may have replaced a gradient
                grad = _local_grad(p)
                if grad is not None and view is not None and grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    p.grad = _as_grad(view, p)
            assert bucket.buffer is not None
            target = bucket.buffer
        if self.track_finite:
            bucket.finite_at_launch = all_finite([target])
        if bucket.widen:
            bucket.staging = self._staging_buffer(target.device)
            bucket.wide = bucket.staging[: bucket.numel]
            bucket.wide.copy_(target.reshape(-1))
            target = bucket.wide
            self._staged.append(bucket)
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
        if bucket.done:
            return
        bucket.done = True
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        if bucket.owner is not None and bucket.owner != self.rank:
            bucket.release()  # ZeRO-2: another rank owns these gradients
        elif bucket.solo:
            p = bucket.params[0]
            if bucket.wide is not None and p.grad is not None:
                grad = _local(p.grad)
                grad.copy_(bucket.wide.view_as(grad))
        else:
            if bucket.wide is not None and bucket.buffer is not None:
                bucket.buffer.copy_(bucket.wide)
            for p, view in zip(bucket.params, bucket.views):
                assert view is not None
                p.grad = _as_grad(view, p)
        if bucket.staging is not None:  # the sum is written back: the staging buffer is free again
            self._free_staging.setdefault(bucket.staging.device, []).append(bucket.staging)
            if bucket in self._staged:
                self._staged.remove(bucket)
        bucket.wide = bucket.staging = None

    def _staging_buffer(self, device: torch.device) -> torch.Tensor:
        """A free float32 staging buffer on ``device``; completes the oldest bucket in flight if none is.

        On NCCL completing a bucket is a stream wait, so the host does not block; on gloo it
        waits for that all-reduce.  Either way only in a backward without ring exchanges (the
        cross-communicator rule, module docstring), and only for a bucket every rank launches
        before this one.
        """
        while not self._free_staging.get(device) and self._staging_made.get(device, 0) >= self.staging_copies:
            self._complete(self._staged[0])
        free = self._free_staging.get(device)
        if free:
            return free.pop()
        self._staging_made[device] = self._staging_made.get(device, 0) + 1
        self.peak_staging_bytes = max(self.peak_staging_bytes, self.extra_bytes)
        return torch.empty(self._staging_numel[device], dtype=torch.float32, device=device)

    def _drop_staging(self) -> None:
        self._staged.clear()
        self._free_staging.clear()
        self._staging_made.clear()

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
            bucket.wide = bucket.staging = None
        self._drop_staging()


__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "DEFAULT_STAGING_COPIES", "BucketedGradSync"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _sizing_numel(p: torch.Tensor) -> int:
    """The elements ``p`` counts for when buckets are cut: the same on every rank that holds a shard of it.

    A DTensor's global size divided by its shards (rounded up), so TP lanes whose shards differ by
    a row (a dimension that does not divide evenly) still cut the same buckets.
    """
    if not isinstance(p, DTensor):
        return p.numel()
    shards = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_shard():
            shards *= p.device_mesh.size(dim)
    return -(-p.numel() // shards)


def _as_grad(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` as ``p``'s gradient: itself for a plain parameter, a DTensor of ``p``'s placements for a DTensor."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad``'s local tensor, in ``p``'s placements (a DTensor gradient in another one is redistributed first)."""
    grad = p.grad
    if not isinstance(grad, DTensor):
        return grad
    if isinstance(p, DTensor) and tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(
            p.device_mesh, p.placements
        )  # the same on every lane: a slice or a TP reduction
        p.grad = grad
    return grad.to_local()


def _local_values(bucket: _Bucket) -> torch.Tensor | None:
    """The gradient values a bucket not launched yet holds on this rank (``None``: none)."""
    if bucket.solo:
        return _local_grad(bucket.params[0])
    if bucket.buffer is None:
        return None
    # autograd may have replaced a view by its own tensor: read what the parameters point at
    grads = [g for g in (_local_grad(p) for p in bucket.params) if g is not None]
    if all(g.data_ptr() == v.data_ptr() for g, v in zip(grads, bucket.views) if v is not None) and len(
        grads
    ) == len(bucket.params):
        return bucket.buffer
    return torch.cat([g.reshape(-1) for g in grads]) if grads else None
