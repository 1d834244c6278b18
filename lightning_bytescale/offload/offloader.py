"""Selective activation offloading: move a chosen fraction of a micro-batch's saved activations to host.

A transformer's forward pass saves activations layer by layer and its backward pass consumes
them in reverse, so the first layers' activations are needed last: they can travel to host
memory during the forward pass and come back in time for the backward pass (ByteScale §5.2).
:class:`ActivationOffloader` does this with ``torch.autograd.graph.saved_tensors_hooks``:

* every micro-batch runs inside ``offloader.context(micro_batch_id, ratio)``; ``ratio`` (from
  the plan, Eq. 3) is the fraction of the *offloadable* layers whose saved tensors go to host.
  The last ``keep_last`` layers (default 2, the ``2 * Act(s)`` term of Eq. 3) always stay on
  the device, and the offloaded layers are the *first* ones, so the layers whose activations
  are needed first in backward never leave the device;
* layers are identified through forward pre-hooks on the modules passed as ``layers`` (the
  model's block list, in forward order).  Tensors saved outside those modules (embedding,
  final norm, head, loss) stay resident.  Without ``layers`` the offloader falls back to the
  fraction of saved tensors in forward order, learning how many a forward saves from the first
  forward it sees (which itself stays resident);
* every offloaded tensor carries a :class:`Tag` ``(micro_batch, layer, act_id)`` and lives in
  a record owned by the autograd graph, so interleaved micro-batches never share state and the
  host copy is freed together with the graph node that saved it;
* parameters, views of parameters, small tensors and tensors that are not dense (expanded or
  overlapping views) stay resident;
* on CUDA the copies run on dedicated device-to-host and host-to-device streams into pooled
  pinned host blocks (power-of-two sizes, reused across micro-batches, the idle ones bounded),
  ordered by events, so they overlap compute; in backward the first
  unpack of layer ``j`` also starts reloading layer ``j - 1``.  On CPU the "host" is a separate
  store of clones with the same bookkeeping, so the logic is testable without a GPU.

Gradients are bit-identical to running without the context: values, dtypes and strides of
every saved tensor are restored exactly.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_bytescale.errors import ByteScaleError

__all__ = [
    "ActivationOffloader",
    "OffloadError",
    "OffloadStats",
    "PassStats",
    "Tag",
    "micro_batch_offload_ratio",
    "offloaded_layers",
]

OUTSIDE = -1  # layer index of tensors saved outside the given layers (or in fallback mode)


class OffloadError(ByteScaleError, ValueError):
    """Bad offload configuration (ratio out of range, bad layer list, nested contexts...)."""


@dataclass(frozen=True)
class Tag:
    """Identifies one saved tensor: micro-batch id, layer index (``-1`` outside layers), order."""

    micro_batch: int
    layer: int
    act_id: int


@dataclass
class PassStats:
    """What one forward under :meth:`ActivationOffloader.context` saved (activation bytes only)."""

    micro_batch: int
    ratio: float
    offloaded_layers: tuple[int, ...]
    saved_bytes: int = 0  # activation bytes saved by autograd (parameters excluded)
    resident_bytes: int = 0  # of which kept on the device
    offloaded_bytes: int = 0  # of which copied to host
    parameter_bytes: int = 0  # parameters and their views: never offloaded, not counted above
    num_saved: int = 0
    num_offloaded: int = 0
    layer_bytes: dict[int, int] = field(default_factory=dict)  # saved bytes by layer (-1: outside)
    layer_resident_bytes: dict[int, int] = field(default_factory=dict)


@dataclass
class OffloadStats:
    """Offloader-wide counters (bytes held by the hooks, not the whole allocator)."""

    live_device_bytes: int = 0  # saved activations the hooks hold on the device right now
    peak_device_bytes: int = 0
    live_host_bytes: int = 0  # offloaded copies currently on the host
    peak_host_bytes: int = 0
    offloaded_bytes: int = 0  # total copied to host
    reloaded_bytes: int = 0  # total copied back
    passes: int = 0


def offloaded_layers(num_layers: int, ratio: float, keep_last: int = 2) -> tuple[int, ...]:
    """The layers whose activations go to host at ``ratio``: the first ``ceil(r * (L - keep_last))``.

    Rounding is up so that the resident memory never exceeds the plan's Eq. 3 estimate
    ``(keep_last + (1 - r) * (L - keep_last)) * Act(s)``.
    """
    _check_ratio(ratio)
    if num_layers < 0 or keep_last < 0:
        raise OffloadError(f"num_layers ({num_layers}) and keep_last ({keep_last}) must be >= 0")
    n = max(0, num_layers - keep_last)
    k = min(n, math.ceil(ratio * n - 1e-9))
    return tuple(range(k))


def _check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 <= float(ratio) <= 1.0:
        raise OffloadError(
            f"offload ratio must be a number in [0, 1], got {ratio!r}; the ratio is the fraction "
            "of offloadable layers whose saved activations go to host memory"
        )


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its elements fill exactly ``numel`` consecutive storage slots."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _host_view(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A view of the byte buffer ``buf`` with ``t``'s dtype, size and strides (``t`` dense)."""
    return buf[: _nbytes(t)].view(t.dtype).as_strided(t.size(), t.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (tensor parallelism), else ``t`` itself."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # the shard itself, no autograd node (this runs inside the pack hook)
        return t.to_local()


def _nbytes(t: torch.Tensor) -> int:
    """The bytes ``t`` takes on this rank (a DTensor's local shard, not its global size)."""
    t = _local(t)
    return t.numel() * t.element_size()


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where the bytes ``t`` holds on this rank start; ``None`` for a wrapper without a storage of its
    own (the pending result of a functional collective, as tensor-parallel layers return)."""
    try:
        return _local(t).untyped_storage().data_ptr()
    except RuntimeError:
        return None


class _PinnedPool:
    """Pinned host blocks for offloaded activations, reused across micro-batches, with a bounded idle cache.

    Blocks come in power-of-two sizes (at least 4 KiB), the sizes PyTorch's pinned-memory
    allocator rounds every request to anyway, so a class costs nothing beyond what that allocator
    reserves.  A request takes a free block of its own class or of the next one up (a view of
    its front holds the tensor), else a new block.  A block goes back to the cache when its last
    copy is queued (the event of that copy travels with it; the next user's copy waits for it).
    The cache of idle blocks holds at most ``max_cached_bytes`` (default: the most bytes the
    pool ever had in use at once); beyond that the least recently used idle blocks are dropped,
    back to PyTorch's pinned allocator (which reuses them for the next pinned allocation of their
    size, and honours the events of their pending copies).  So the pool never holds more than
    twice its peak use, however many different lengths the micro-batches have, where a cache
    keyed by exact sizes keeps a block for every size it has seen.
    """

    MIN_BLOCK = 4096

    def __init__(self, max_cached_bytes: int | None = None, *, pin: bool = True) -> None:
        if max_cached_bytes is not None and (
            isinstance(max_cached_bytes, bool)
            or not isinstance(max_cached_bytes, int)
            or max_cached_bytes < 0
        ):
            raise OffloadError(
                f"max_cached_host_bytes must be an integer >= 0 or None, got {max_cached_bytes!r}"
            )
        self.max_cached_bytes = max_cached_bytes
        self.pin = pin
        self._free: dict[int, OrderedDict[int, tuple[torch.Tensor, Any]]] = {}  # size -> {stamp: block}
        self._lru: OrderedDict[int, int] = OrderedDict()  # stamp -> size, least recently freed first
        self._stamp = 0
        self._lock = threading.RLock()  # a record's __del__ may run while it is held
        self.cached_bytes = 0  # idle blocks held
        self.in_use_bytes = 0  # blocks handed out and not given back
        self.peak_in_use_bytes = 0
        self.released_bytes = 0  # idle blocks dropped by the cap, in total

    @classmethod
    def block_size(cls, nbytes: int) -> int:
        """The power of two (at least :data:`MIN_BLOCK`) a request of ``nbytes`` is served from."""
        return max(cls.MIN_BLOCK, 1 << max(0, nbytes - 1).bit_length())

    @property
    def held_bytes(self) -> int:
        """Bytes of blocks the pool holds: in use and idle."""
        return self.in_use_bytes + self.cached_bytes

    def get(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A block of at least ``nbytes`` and the event its previous copy recorded (``None``: fresh)."""
        size = self.block_size(nbytes)
        with self._lock:
            for cls in (size, 2 * size):
                free = self._free.get(cls)
                if free:
                    stamp, (buf, event) = free.popitem()  # the most recently freed: warm in cache
                    del self._lru[stamp]
                    self.cached_bytes -= cls
                    self._take(cls)
                    return buf, event
            self._take(size)
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin), None

    def put(self, buf: torch.Tensor, event: Any) -> None:
        """Give ``buf`` back once its last copy is queued (``event`` marks that copy's end)."""
        size = buf.numel()
        with self._lock:
            self.in_use_bytes -= size
            stamp, self._stamp = self._stamp, self._stamp + 1
            self._free.setdefault(size, OrderedDict())[stamp] = (buf, event)
            self._lru[stamp] = size
            self.cached_bytes += size
            cap = self.peak_in_use_bytes if self.max_cached_bytes is None else self.max_cached_bytes
            while self.cached_bytes > cap:
                oldest, old_size = self._lru.popitem(last=False)
                del self._free[old_size][oldest]
                self.cached_bytes -= old_size
                self.released_bytes += old_size

    def _take(self, size: int) -> None:
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._lru.clear()
            self.released_bytes += self.cached_bytes
            self.cached_bytes = 0


class _Resident:
    """A saved tensor kept on its device (accounted, so live/peak bytes are known)."""

    __slots__ = ("tensor", "nbytes", "owner", "pass_", "group", "__weakref__")

    def __init__(
        self, tensor: torch.Tensor, nbytes: int, owner: ActivationOffloader, pass_: _Pass, group: int
    ) -> None:
        self.tensor = tensor
        self.nbytes = nbytes
        self.owner = owner
        self.pass_ = pass_
        self.group = group
        owner._account(device=nbytes)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.owner._account(device=-self.nbytes)


class _Offloaded:
    """A saved tensor whose data lives on the host until backward reloads it."""

    __slots__ = (
        "tag",
        "group",
        "pass_",
        "owner",
        "size",
        "stride",
        "dtype",
        "device",
        "nbytes",
        "host",
        "buf",
        "d2h_event",
        "dev",
        "h2d_event",
        "__weakref__",
    )

    def __init__(self, tag: Tag, group: int, pass_: _Pass, owner: ActivationOffloader, t: torch.Tensor):
        self.tag = tag
        self.group = group
        self.pass_ = pass_
        self.owner = owner
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        self.device = t.device
        self.nbytes = _nbytes(t)
        self.host: torch.Tensor | None = None
        self.buf: torch.Tensor | None = None
        self.d2h_event: Any = None
        self.dev: torch.Tensor | None = None
        self.h2d_event: Any = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.owner._release(self)


class _Pass:
    """State of one forward under one context entry (one micro-batch)."""

    def __init__(self, micro_batch: int, ratio: float, layers: tuple[int, ...], n_offload_tensors: int):
        self.micro_batch = micro_batch
        self.ratio = ratio
        self.offload_layers = frozenset(layers)
        self.n_offload_tensors = n_offload_tensors  # fallback mode only
        self.eligible_seen = 0  # fallback mode: eligible tensors packed so far
        self.act_ids: dict[int, int] = {}
        self.groups: dict[int, list[weakref.ref]] = {}
        self.unpacked_groups: set[int] = set()
        # (id(tensor), layer) -> weak refs to the tensor and its record; only within one layer, so
        # that a tensor saved by many layers (e.g. RoPE tables) never ties their prefetches together
        self.seen: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}
        # the local tensors of saved DTensors already counted, per layer: DTensor.from_local wraps
        # one local tensor in a new object for every module it enters (q, k and v projections)
        self.dtensor_storages: set[tuple[Any, ...]] = set()
        self.stats = PassStats(micro_batch, ratio, tuple(sorted(layers)))
        self.lock = threading.RLock()  # a record's __del__ may run while it is held


class ActivationOffloader:
    """Per-micro-batch selective offload of saved activations (see the module docstring).

    ``layers``: the model's transformer blocks in forward order (e.g. ``model.layers``).  Layer
    ``i`` is identified by a forward pre-hook on ``layers[i]``; nothing else about the modules
    is assumed.  ``keep_last``: layers at the end that never offload (default 2, as Eq. 3
    assumes).  ``min_bytes``: smaller tensors stay resident.  ``fallback_group``: without
    layers, how many consecutive saved tensors form one prefetch group.  ``capacity``: the
    plan's C; :meth:`micro_batch_context` never offloads a micro-batch of only shorter
    sequences.  ``max_cached_host_bytes``: idle pinned host blocks kept for reuse on CUDA (default
    ``None``: as many bytes as were ever in use at once, so the pool holds at most twice its
    peak; see :class:`_PinnedPool`).  ``trace``: record ``(event, tag)`` pairs in :attr:`events`
    (for tests and debugging).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module] | None = None,
        *,
        keep_last: int = 2,
        min_bytes: int = 1024,
        prefetch: bool = True,
        fallback_group: int = 8,
        capacity: int | None = None,
        max_cached_host_bytes: int | None = None,
        trace: bool = False,
    ) -> None:
        if layers is not None:
            layers = list(layers)
            if not layers or not all(isinstance(m, nn.Module) for m in layers):
                raise OffloadError(
                    "layers must be a non-empty sequence of nn.Module (pass the model's block "
                    "list, e.g. model.layers), or None to offload by saved-tensor order"
                )
            if len({id(m) for m in layers}) != len(layers):
                raise OffloadError("layers contains the same module twice; pass each block once")
        if keep_last < 0 or min_bytes < 0 or fallback_group < 1:
            raise OffloadError("keep_last and min_bytes must be >= 0 and fallback_group >= 1")
        self.layers = layers
        self.keep_last = keep_last
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.fallback_group = fallback_group
        self.capacity = capacity
        self.trace = trace
        self.events: list[tuple[str, Tag]] = []
        self.stats = OffloadStats()
        self.pass_stats: dict[int, PassStats] = {}  # latest forward of each micro-batch id
        self.learned_saved: int | None = None  # fallback mode: eligible saved tensors per forward
        self._lock = threading.RLock()  # a record's __del__ may run while it is held
        self._active: _Pass | None = None
        self._current_layer = OUTSIDE
        self._param_ptrs: frozenset[int] = frozenset()
        self._streams: dict[tuple[str, int], Any] = {}
        self._pool = _PinnedPool(max_cached_host_bytes)
        self._handles: list[Any] = []
        if layers is not None:
            for i, module in enumerate(layers):
                self._handles.append(module.register_forward_pre_hook(self._make_pre_hook(i)))
                self._handles.append(module.register_forward_hook(self._post_hook))
            self._param_ptrs = frozenset(_storage_ptr(p) for m in layers for p in m.parameters())

    # ------------------------------------------------------------------ public API
    @property
    def num_layers(self) -> int | None:
        return None if self.layers is None else len(self.layers)

    def offloaded_layers(self, ratio: float) -> tuple[int, ...]:
        """Layer indices offloaded at ``ratio`` (empty in fallback mode)."""
        if self.layers is None:
            _check_ratio(ratio)
            return ()
        return offloaded_layers(len(self.layers), ratio, self.keep_last)

    @contextlib.contextmanager
    def context(self, micro_batch_id: int, ratio: float) -> Iterator[PassStats]:
        """Offload ``ratio`` of this micro-batch's layers; wrap its forward (and backward) in it.

        The backward pass may also run outside the context: every saved tensor remembers how to
        come back.  Contexts do not nest.
        """
        _check_ratio(ratio)
        if self._active is not None:
            raise OffloadError(
                f"offload context for micro-batch {micro_batch_id} entered inside the one for "
                f"micro-batch {self._active.micro_batch}; contexts do not nest"
            )
        if self.layers is not None:
            p = _Pass(micro_batch_id, float(ratio), self.offloaded_layers(ratio), 0)
            self._param_ptrs = frozenset(_storage_ptr(q) for m in self.layers for q in m.parameters())
        else:
            n = 0 if self.learned_saved is None else math.ceil(ratio * self.learned_saved - 1e-9)
            p = _Pass(micro_batch_id, float(ratio), (), n)
        self._active = p
        self._current_layer = OUTSIDE
        with self._lock:
            self.stats.passes += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(p, t), lambda rec: self._unpack(rec)
            ):
                yield p.stats
        finally:
            self._active = None
            self._current_layer = OUTSIDE
            if self.layers is None and p.eligible_seen:
                self.learned_saved = p.eligible_seen
            # an entry that saved nothing (e.g. the paper's separate backward entry) keeps the forward's
            if p.stats.num_saved or micro_batch_id not in self.pass_stats:
                self.pass_stats[micro_batch_id] = p.stats

    def micro_batch_context(self, micro_batch: Any) -> contextlib.AbstractContextManager:
        """Context factory for one engine micro-batch (uses ``index`` and ``offload_ratio``).

        With ``capacity`` set, a micro-batch of only sequences shorter than C never offloads.
        """
        ratio = micro_batch_offload_ratio(micro_batch, capacity=self.capacity)
        return self.context(int(getattr(micro_batch, "index", 0)), ratio)

    def reset_peak(self) -> None:
        with self._lock:
            self.stats.peak_device_bytes = self.stats.live_device_bytes
            self.stats.peak_host_bytes = self.stats.live_host_bytes

    def empty_cache(self) -> None:
        """Drop the pool's idle pinned host blocks (back to PyTorch's pinned allocator)."""
        self._pool.clear()

    @property
    def cached_host_bytes(self) -> int:
        return self._pool.cached_bytes

    def remove(self) -> None:
        """Remove the forward hooks from the layers."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ layer hooks
    def _make_pre_hook(self, index: int):
        def hook(module: nn.Module, args: Any) -> None:
            if self._active is not None:
                self._current_layer = index

        return hook

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._active is not None:
            self._current_layer = OUTSIDE

    # ------------------------------------------------------------------ pack / unpack
    def _is_parameter(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return True
        return bool(self._param_ptrs) and _storage_ptr(t) in self._param_ptrs

    def _pack(self, p: _Pass, t: torch.Tensor) -> Any:
        layer = self._current_layer if self.layers is not None else OUTSIDE
        key = (id(t), layer)
        hit = p.seen.get(key)
        if hit is not None and hit[0]() is t:
            rec = hit[1]()
            if rec is not None:
                return rec  # the same tensor saved again in this layer: share its record
        st = p.stats
        if self._is_parameter(t):
            st.parameter_bytes += _nbytes(t)
            return t
        nbytes = _nbytes(t)
        if isinstance(t, DTensor):  # its memory counts once, however many DTensors share it
            local = _local(t)
            where = (
                layer,
                _storage_ptr(local) or id(local),
                local.storage_offset(),
                tuple(local.shape),
                local.stride(),
            )
            nbytes = 0 if where in p.dtensor_storages else nbytes
            p.dtensor_storages.add(where)
        eligible = (
            nbytes >= max(1, self.min_bytes)
            and t.layout == torch.strided
            and not isinstance(t, DTensor)  # counted (its local bytes), never offloaded
            and t.device.type in ("cpu", "cuda")
            and _is_dense(t)
        )
        if self.layers is not None:
            offload = eligible and layer in p.offload_layers
            group = layer
        else:
            index = p.eligible_seen
            if eligible:
                p.eligible_seen += 1
            offload = eligible and index < p.n_offload_tensors
            group = index // self.fallback_group
        act_id = p.act_ids.get(layer, 0)
        p.act_ids[layer] = act_id + 1
        tag = Tag(p.micro_batch, layer, act_id)
        st.saved_bytes += nbytes
        st.num_saved += 1
        st.layer_bytes[layer] = st.layer_bytes.get(layer, 0) + nbytes
        if offload:
            rec: Any = self._offload(p, tag, group, t)
            st.offloaded_bytes += nbytes
            st.num_offloaded += 1
            with p.lock:
                p.groups.setdefault(group, []).append(weakref.ref(rec))
        else:
            rec = _Resident(t, nbytes, self, p, group)
            st.resident_bytes += nbytes
            st.layer_resident_bytes[layer] = st.layer_resident_bytes.get(layer, 0) + nbytes
        p.seen[key] = (weakref.ref(t), weakref.ref(rec))
        return rec

    def _unpack(self, rec: Any) -> torch.Tensor:
        if isinstance(rec, torch.Tensor):
            return rec
        p = rec.pass_
        first = False
        with p.lock:
            if rec.group not in p.unpacked_groups:
                p.unpacked_groups.add(rec.group)
                first = True
        if first:
            # backward reached a new layer: bring its tensors and (ahead of need) the layer below
            self._reload_group(p, rec.group)
            if self.prefetch:
                self._reload_group(p, rec.group - 1)
        if isinstance(rec, _Resident):
            return rec.tensor
        self._reload(rec)
        if self.trace:
            self.events.append(("use", rec.tag))
        if rec.device.type == "cuda":
            stream = torch.cuda.current_stream(rec.device)
            stream.wait_event(rec.h2d_event)
            rec.dev.record_stream(stream)
        return rec.dev

    # ------------------------------------------------------------------ copies
    def _stream(self, kind: str, device: torch.device) -> Any:
        key = (kind, device.index if device.index is not None else torch.cuda.current_device())
        s = self._streams.get(key)
        if s is None:
            s = torch.cuda.Stream(device=torch.device("cuda", key[1]))
            self._streams[key] = s
        return s

    def _offload(self, p: _Pass, tag: Tag, group: int, t: torch.Tensor) -> _Offloaded:
        rec = _Offloaded(tag, group, p, self, t)
        if t.device.type == "cuda":
            compute = torch.cuda.current_stream(t.device)
            d2h = self._stream("d2h", t.device)
            d2h.wait_stream(compute)
            buf, last_use = self._pool.get(rec.nbytes)
            if last_use is not None:
                d2h.wait_event(last_use)
            host = _host_view(buf, t)
            with torch.cuda.stream(d2h):
                host.copy_(t.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(d2h)
            t.record_stream(d2h)  # the allocator must not reuse t's memory before the copy ends
            rec.buf, rec.d2h_event = buf, event
        else:
            with torch.no_grad():
                host = t.detach().clone()  # preserves strides of dense tensors
        rec.host = host
        self._account(host=rec.nbytes, offloaded=rec.nbytes)
        if self.trace:
            self.events.append(("offload", tag))
        return rec

    def _reload_group(self, p: _Pass, group: int) -> None:
        with p.lock:
            refs = list(p.groups.get(group, ()))
        for ref in refs:
            rec = ref()
            if rec is not None:
                self._reload(rec)

    def _reload(self, rec: _Offloaded) -> None:
        with rec.pass_.lock:
            if rec.dev is not None:
                return
            if rec.device.type == "cuda":
                h2d = self._stream("h2d", rec.device)
                h2d.wait_event(rec.d2h_event)
                with torch.cuda.stream(h2d):
                    dev = torch.empty_strided(rec.size, rec.stride, dtype=rec.dtype, device=rec.device)
                    dev.copy_(rec.host, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(h2d)
                self._pool.put(rec.buf, event)  # reusable once this copy has finished
                rec.buf, rec.h2d_event = None, event
            else:
                dev = rec.host
            rec.dev, rec.host = dev, None
        self._account(device=rec.nbytes, host=-rec.nbytes, reloaded=rec.nbytes)
        if self.trace:
            self.events.append(("reload", rec.tag))

    def _release(self, rec: _Offloaded) -> None:
        if rec.dev is not None:
            self._account(device=-rec.nbytes)
        else:
            if rec.buf is not None:
                self._pool.put(rec.buf, rec.d2h_event)
            self._account(host=-rec.nbytes)

    def _account(self, device: int = 0, host: int = 0, offloaded: int = 0, reloaded: int = 0) -> None:
        with self._lock:
            s = self.stats
            s.live_device_bytes += device
            s.live_host_bytes += host
            s.peak_device_bytes = max(s.peak_device_bytes, s.live_device_bytes)
            s.peak_host_bytes = max(s.peak_host_bytes, s.live_host_bytes)
            s.offloaded_bytes += offloaded
            s.reloaded_bytes += reloaded


# ---------------------------------------------------------------------- plan integration
def micro_batch_offload_ratio(
    micro_batch: Any, lengths: Sequence[int] | None = None, capacity: int | None = None
) -> float:
    """The offload ratio a plan/engine micro-batch asks for, validated.

    With ``capacity`` C, a micro-batch whose sequences are all shorter than C gets 0: short
    sequences never offload.  Their lengths come from ``lengths`` (the global batch's, indexed
    by the plan's ``Piece.seq`` or the engine's ``seq_ids``) or, for an engine
    ``PackedMicroBatch``, from its layout's ``seq_lens``.
    """
    ratio = float(getattr(micro_batch, "offload_ratio", 0.0) or 0.0)
    _check_ratio(ratio)
    if ratio == 0.0 or capacity is None:
        return ratio
    if lengths is not None:
        seqs = [piece.seq for piece in getattr(micro_batch, "pieces", ())] or list(
            getattr(micro_batch, "seq_ids", ())
        )
        own = [lengths[s] for s in seqs]
    else:
        own = list(getattr(getattr(micro_batch, "layout", None), "seq_lens", ()))
    if own and all(s < capacity for s in own):
        return 0.0
    return ratio
