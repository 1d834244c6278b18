"""Gradient sync in buckets, overlapped with the last micro-batch's backward, with no extra copy.

A rank's gradients are final once the backward of its *last* micro-batch has accumulated them.
:class:`BucketedGradSync` watches that backward (``register_post_accumulate_grad_hook``): as
soon as every parameter of the next bucket has its final gradient, it starts an asynchronous
all-reduce (sum) of that bucket, so communication overlaps the rest of the backward, as DDP's
reducer does.  Buckets hold about ``bucket_bytes`` (DDP's 25 MB by default) and are launched
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

The all-reduces run on their own process group (created once, at set-up), so they can be in
flight while the last micro-batch's ring exchanges run point-to-point on the global group:
with NCCL, operations of one group are ordered on one stream, and a bucket all-reduce queued
before another rank's ring receive would deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class _Bucket:
    """Parameters whose gradients are summed by one all-reduce.

    Several small parameters share one flat buffer whose views are their gradients.  A
    parameter of a bucket's size or more is a bucket of its own (``solo``): its gradient is
    all-reduced in place, with no buffer, so autograd can hand over the gradient it computed
    without an extra copy of that (large) tensor.
    """

    def __init__(self, params: list[nn.Parameter], solo: bool = False) -> None:
        self.params = params
        self.solo = solo
        first = params[0]
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor | None] = [None] * len(params)
        if not solo:
            self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
            offset = 0
            for j, p in enumerate(params):
                self.views[j] = self.buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.widen = first.dtype in (torch.bfloat16, torch.float16)  # sum in float32
        self.work: Any = None
        self.wide: torch.Tensor | None = None


class BucketedGradSync:
    """Sum ``params``' gradients over the ranks of ``group`` in buckets overlapped with backward.

    Per step: :meth:`prepare` before the first micro-batch, :meth:`arm` right before the last
    one (its backward then launches buckets as they become final), :meth:`finish` after the
    loop on every rank (it launches the rest and waits); afterwards every ``p.grad`` holds the
    sum over ranks.  :meth:`produced` tells which parameters got a gradient on this rank (a
    prepared gradient is a zero buffer even if nothing reached it).  :meth:`close` removes the
    hooks.  Without an initialised process group nothing is communicated.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.bucket_bytes = int(bucket_bytes)
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

    def _make_buckets(self) -> list[_Bucket]:
        """Last parameters first (backward computes them first); one dtype and device per bucket."""
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if nbytes >= self.bucket_bytes:  # a bucket of its own, all-reduced in place
                if current:
                    buckets.append(_Bucket(current))
                    current, size = [], 0
                buckets.append(_Bucket([p], solo=True))
                continue
            if current and (
                size + nbytes > self.bucket_bytes
                or (p.dtype, p.device) != (current[0].dtype, current[0].device)
            ):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(_Bucket(current))
        return buckets

    @property
    def extra_bytes(self) -> int:
        """Memory this sync holds beyond the gradients themselves (float32 copies of narrow buckets)."""
        return sum(b.wide.numel() * b.wide.element_size() for b in self.buckets if b.wide is not None)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def prepare(self) -> None:
        """Point every gradient at its (zeroed) bucket view; an existing gradient is kept as its value."""
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.views):
                if view is None:  # solo: autograd's own gradient tensor is all-reduced in place
                    continue
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
        self._produced = set()
        self._ready = [set() for _ in self.buckets]
        self._next = 0
        self.launched_in_backward = 0

    def arm(self) -> None:
        """The next backward is the step's last on this rank: launch buckets as they become final."""
        self._armed = True

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
        self._armed = False
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
        if bucket.widen:
            bucket.wide = target.float()
            target = bucket.wide
        if dist.is_available() and dist.is_initialized():
            bucket.work = dist.all_reduce(target, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def _complete(self, bucket: _Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
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
        """Remove the hooks (the sync is unusable afterwards)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["DEFAULT_BUCKET_BYTES", "BucketedGradSync"]
