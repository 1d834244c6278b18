"""Fake CUDA on a CPU-only torch: CUDA tensors without data, the CUDA ops' shape functions, host syncs counted.

No GPU runs in CI, yet most of what breaks on a first GPU run is visible without one: a host
tensor mixed with a device tensor (ATen's CUDA kernels refuse it), a value read back from the
device (a host synchronisation), an op whose output shape depends on values, a kernel picked for
the wrong dtype, a signature the installed torch does not have.  :class:`FakeCuda` shows them.

It is a ``TorchDispatchMode`` over torch's ``FakeTensorMode``: an op that touches a fake tensor
or creates one on ``cuda`` runs in the fake mode (its meta / fake kernel: shapes, dtypes and
devices, no data, device mismatches refused as on a GPU); every other op -- the host work of
the code under test -- runs for real, so host metadata stays readable.  Host-device
synchronisations are recorded in :attr:`FakeCuda.syncs` (a value read back from a device
tensor, a device-to-host copy, a host-to-device copy that is not a non-blocking copy from
pinned memory, an op with a data-dependent output shape, ``torch.cuda.synchronize``); the first
two cannot produce a value, so they also raise, after being recorded.

:func:`fake_cuda` enters it with the CUDA queries answered as on one sm90 GPU (``_initialized``
set, so ``.to("cuda")`` does not try to start a CUDA runtime this build lacks; autocast allowed
on ``cuda``), the ring's communication stream switched off (no CUDA streams on a CPU build),
and the attention caches cleared before and after (they hold device tensors).

One fake kernel is replaced: torch's for ``aten._efficient_attention_backward`` does not take
the op's schema (it lacks ``out``; torch 2.13), so the mode answers that op with gradients of
the inputs' shapes itself.

A tensor subclass with its own dispatch (a DTensor of fake CUDA tensors) dispatches first, so
its inner ops on fake tensors come back to the mode.  ``torch.tensor(data, device="cuda")`` is
built on the host and copied (counted), as on CUDA.

Limits, checked on torch 2.13 CPU: autograd cannot run on fake CUDA tensors (a CPU build aborts
the process; never give them ``requires_grad``), so the tier runs forwards and calls backward
functions directly; stream and event handling is not covered.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import ClassVar
from unittest import mock

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

CUDA = torch.device("cuda", 0)
META = torch.device("meta")
aten = torch.ops.aten
_COPIES = (aten._to_copy.default, aten.copy_.default)


@dataclass(frozen=True)
class HostSync:
    """One host-device synchronisation: what it was, the op, and the innermost package frame."""

    kind: str
    op: str
    where: str


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "lightning_bytescale" in f.filename]
    if not frames:
        return "outside the package"
    f = frames[-1]
    return f"{f.filename.rsplit('lightning_bytescale/', 1)[-1]}:{f.lineno} ({f.name}): {f.line}"


def _is_cuda(x: object) -> bool:
    return isinstance(x, FakeTensor) and x.device.type == "cuda"


def _wrapper(x: object) -> bool:
    """A tensor subclass with its own dispatch (a DTensor, funcol's async tensor) around other tensors."""
    return (
        isinstance(x, torch.Tensor)
        and not isinstance(x, FakeTensor)
        and type(x).__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl
    )


def _no_index(x: object) -> bool:
    """``"cuda"`` or ``torch.device("cuda")``: the current CUDA device, which a CPU build cannot name."""
    return (x == "cuda" if isinstance(x, str) else False) or (
        isinstance(x, torch.device) and x.type == "cuda" and x.index is None
    )


class FakeCuda(TorchDispatchMode):
    """Dispatch mode: fake CUDA ops, real host ops, host synchronisations recorded (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.ops: Counter[str] = Counter()  # every op that ran on a fake tensor, by name
        self.syncs: list[HostSync] = []
        self._pinned: set[int] = set()  # ids of live host tensors "pinned" here

    # ------------------------------------------------------------------ making fake CUDA tensors
    def cuda(self, t: torch.Tensor) -> torch.Tensor:
        """A fake CUDA tensor of ``t``'s shape and dtype (no copy counted: it stands for data already there)."""
        return FakeTensor(self.fake, t.detach().to("meta"), CUDA)

    def module_to_cuda(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with every parameter and buffer fake CUDA (no gradients: autograd cannot run here)."""
        module.requires_grad_(False)
        return module._apply(self.cuda)

    # ------------------------------------------------------------------ the mode
    def _record(self, kind: str, func) -> None:
        self.syncs.append(HostSync(kind, str(func), _where()))

    def _copy_kind(self, func, args, kwargs) -> str | None:
        """Which synchronising copy ``func`` is, or ``None`` (not a copy, or one that does not synchronise)."""
        if func is aten._to_copy.default:
            src, dst_device = args[0], kwargs.get("device")
            dst_cuda = dst_device is not None and torch.device(dst_device).type == "cuda"
            dst_host = dst_device is not None and torch.device(dst_device).type == "cpu"
        else:
            dst, src = args[0], args[1]
            dst_cuda, dst_host = _is_cuda(dst), dst.device.type == "cpu"
        non_blocking = bool(
            kwargs.get("non_blocking", args[2] if func is aten.copy_.default and len(args) > 2 else False)
        )
        if _is_cuda(src) and dst_host:
            return "a device-to-host copy"
        from_host = dst_cuda and not _is_cuda(src) and src.device.type == "cpu"
        if from_host and (not non_blocking or id(src) not in self._pinned):
            return "a host-to-device copy that is not non-blocking from pinned memory"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._pin_memory.default:  # a CPU build has no pinned allocator: remember the tensor
            out = args[0].clone()
            self._pinned.add(id(out))
            weakref.finalize(out, self._pinned.discard, id(out))
            return out
        if func is aten.is_pinned.default:
            return id(args[0]) in self._pinned
        leaves = tree_leaves((args, kwargs))
        if any(_wrapper(x) for x in leaves):
            return NotImplemented  # a DTensor (or another wrapper) first: its inner ops come back here
        device = kwargs.get("device")
        creates_cuda = device is not None and torch.device(device).type == "cuda"
        if not creates_cuda and not any(isinstance(x, FakeTensor) for x in leaves):
            return func(*args, **kwargs)  # host work: real
        self.ops[func.name()] += 1
        if func is aten._efficient_attention_backward.default:
            # torch's fake kernel for this op does not match its schema (it lacks ``out``): the
            # gradients have the inputs' shapes, and the bias gradient is empty without a bias
            with self.fake:
                q, k, v = (
                    self.fake.from_tensor(t) if not isinstance(t, FakeTensor) else t for t in args[1:4]
                )
                return (
                    torch.empty_like(q),
                    torch.empty_like(k),
                    torch.empty_like(v),
                    torch.empty(0, device=q.device),
                )
        if func in _COPIES:
            kind = self._copy_kind(func, args, kwargs)
            if kind is not None:
                self._record(kind, func)
        # real (host) tensors enter as fakes of themselves, not as constants: the fake mode would
        # run an op on constants for real, and a CUDA op cannot run on this build
        args, kwargs = tree_map_only(
            torch.Tensor,
            lambda t: t if isinstance(t, FakeTensor) else self.fake.from_tensor(t),
            (args, kwargs),
        )
        try:
            with self.fake:
                return func(*args, **kwargs)
        except DataDependentOutputException:
            self._record("a value read back from the device (.item(), .tolist(), bool(), int())", func)
            raise
        except DynamicOutputShapeException:
            self._record("an output shape that depends on device values", func)
            raise

    def twinned(self, t: torch.Tensor, twin: torch.Tensor) -> None:
        """``twin`` stands for ``t`` on another device (a device guard's way around, :class:`_DeviceGuards`)."""

    def calls(self, *names: str) -> int:
        """How many times ops of these names (``aten::_flash_attention_forward``, ...) ran on fake tensors."""
        return sum(self.ops[n] for n in names)


def _index(x: torch.Tensor, index) -> torch.Tensor:
    """``x[index]`` through aten ops (ints, slices, ``None``, ``...`` and index tensors)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (x.dim() - used)
    dim, advanced = 0, {}
    for item in items:
        if item is None:
            x = x.unsqueeze(dim)
            dim += 1
        elif isinstance(item, slice):
            x = aten.slice.Tensor(x, dim, item.start, item.stop, item.step or 1)
            dim += 1
        elif isinstance(item, torch.Tensor):
            advanced[dim] = item
            dim += 1
        else:
            x = aten.select.int(x, dim, int(item))
    if advanced:
        x = aten.index.Tensor(x, [advanced.get(d) for d in range(max(advanced) + 1)])
    return x


# What a CUDA device guard raises without a GPU: a CPU build has no CUDA guard at all; a CUDA
# build (torch 2.11 +cu130 on a CPU machine) finds no driver.
_GUARD_ERRORS = ("not linked with support for cuda", "CUDA driver", "NVIDIA driver", "no CUDA GPUs")


def _is_guard_error(err: RuntimeError) -> bool:
    return isinstance(err, getattr(torch, "AcceleratorError", ())) or any(
        s in str(err) for s in _GUARD_ERRORS
    )


class _DeviceGuards(TorchFunctionMode):
    """Python bindings that take a CUDA device guard before they dispatch, made to work on fake CUDA.

    Without a GPU that guard fails (a CPU build: "not linked with support for cuda devices"; a
    CUDA build: no driver): indexing, ``copy_`` and a few operators take one.  Indexing and
    ``copy_`` run as their aten ops
    (``copy_`` so that its host-device copies are still counted); any other binding that fails
    so runs on meta twins of its fake CUDA arguments, its fake outputs made CUDA again (fake
    tensors hold no data, so only shapes, dtypes and devices matter).
    """

    def __init__(self, mode: FakeCuda) -> None:
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and _is_cuda(args[0]):
            return _index(args[0], args[1])
        if func is torch.Tensor.__setitem__ and _is_cuda(args[0]):
            target, index, value = args
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=target.dtype)
            aten.copy_.default(_index(target, index), value)
            return None
        if func is torch.Tensor.copy_ and args[0].device.type == "cuda":  # fake CUDA, or a DTensor of it
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            return aten.copy_.default(args[0], args[1], non_blocking)
        device = kwargs.get("device")
        if (
            func in (torch.tensor, torch.as_tensor)
            and device is not None
            and torch.device(device).type == "cuda"
        ):
            # built on the host, then copied, as CUDA does (the copy is counted)
            return func(*args, **{**kwargs, "device": "cpu"}).to(CUDA)
        try:
            return func(*args, **kwargs)
        except RuntimeError as err:
            if not _is_guard_error(err):
                raise
            if any(_no_index(x) for x in tree_leaves((args, kwargs))):
                # ``.to("cuda")`` asks for the current device (torch's object collectives do this)
                args, kwargs = tree_map(lambda x: CUDA if _no_index(x) else x, (args, kwargs))
                return func(*args, **kwargs)
            if not any(_is_cuda(x) for x in tree_leaves((args, kwargs))):
                raise
        args, kwargs = tree_map_only(
            FakeTensor, lambda t: self._twin(t, META) if _is_cuda(t) else t, (args, kwargs)
        )
        out = func(*args, **kwargs)
        return tree_map_only(FakeTensor, lambda t: self._twin(t, CUDA) if t.device.type == "meta" else t, out)

    def _twin(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A fake tensor of ``t``'s shape, strides and dtype on ``device``."""
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        twin = FakeTensor(self.mode.fake, meta, device)
        self.mode.twinned(t, twin)
        return twin


def clear_attention_caches() -> None:
    """The caches that keep device tensors across calls (a fake tensor must not outlive its mode)."""
    from lightning_bytescale.packed_attention import cuda_kernels, local, ring_plan, ulysses_plan

    local._segments.cache_clear()
    local._grouped.cache_clear()
    ring_plan._LAST_SETUP.clear()
    ulysses_plan._LAST_SETUP.clear()
    cuda_kernels._placeholders.cache_clear()


@contextmanager
def fake_cuda(capability: tuple[int, int] = (9, 0), *, mode: FakeCuda | None = None) -> Iterator[FakeCuda]:
    """:class:`FakeCuda` (or ``mode``), with this process answering as a machine with one GPU of ``capability``."""
    from lightning_bytescale.packed_attention import comm, cuda_kernels

    mode = mode if mode is not None else FakeCuda()
    clear_attention_caches()
    with ExitStack() as stack:
        patches = [
            mock.patch.object(torch.cuda, "_initialized", True),
            mock.patch.object(torch.cuda, "is_available", lambda: True),
            mock.patch.object(torch.cuda, "device_count", lambda: 1),
            mock.patch.object(torch.cuda, "current_device", lambda: 0),
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability),
            mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True),
            # an optimizer's step asks (a CUDA build without a GPU would ask the driver)
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False),
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", lambda: False),
            mock.patch.object(
                torch.cuda,
                "synchronize",
                lambda device=None: mode._record("torch.cuda.synchronize", "synchronize"),
            ),
            mock.patch.object(torch.backends.cuda, "is_flash_attention_available", lambda: True),
            mock.patch.object(cuda_kernels, "_capability", lambda index: capability),
            mock.patch.object(
                cuda_kernels, "flash_attn_status", lambda: "flash-attn is not installed (fake CUDA)"
            ),
            mock.patch.object(comm, "comm_stream", lambda device: None),
            # a fake CUDA tensor first makes a real one where CUDA "is available" (a CUDA build
            # without a GPU, as torch 2.11 +cu130 here, would look for a driver)
            mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None),
        ]
        for p in patches:
            stack.enter_context(p)
        try:
            with _DeviceGuards(mode), mode:
                yield mode
        finally:
            clear_attention_caches()


@dataclass
class EchoTransfer:
    """A ring transfer that hands back an empty tensor like the one sent (fake tensors hold no data).

    Stands in for :class:`lightning_bytescale.packed_attention.comm.Transfer` under
    :func:`fake_p2p`; every instance records what was sent in :attr:`SENT`.
    """

    SENT: ClassVar[list[tuple[torch.dtype, int]]] = []

    send: torch.Tensor
    dst: int
    src: int
    tag: int
    group: object = None
    done: bool = False

    def __post_init__(self) -> None:
        self.recv = torch.empty_like(self.send)
        EchoTransfer.SENT.append((self.send.dtype, self.send.numel() * self.send.element_size()))

    def wait(self) -> torch.Tensor:
        return self.recv


@dataclass(frozen=True)
class P2POperation:
    """One send or receive a Ulysses exchange issued under :func:`fake_p2p`."""

    kind: str  # "send" or "recv"
    peer: int
    device: torch.device
    dtype: torch.dtype
    nbytes: int
    contiguous: bool


class _Done:
    def wait(self) -> None:
        return None


class EchoExchange:
    """Stands in for :func:`lightning_bytescale.packed_attention.ulysses.p2p_exchange` under :func:`fake_p2p`.

    Records every operation of every exchange in :attr:`OPS` (one list per ``batch_isend_irecv``)
    and receives nothing: fake tensors hold no data.
    """

    OPS: ClassVar[list[list[P2POperation]]] = []

    @staticmethod
    def post(sends, recvs, tag: int, group: object) -> list[_Done]:
        EchoExchange.OPS.append(
            [
                P2POperation(kind, peer, t.device, t.dtype, t.numel() * t.element_size(), t.is_contiguous())
                for kind, pairs in (("send", sends), ("recv", recvs))
                for peer, t in pairs
            ]
        )
        return [_Done()]


@contextmanager
def fake_p2p(rank: int, world: int) -> Iterator[list[tuple[torch.dtype, int]]]:
    """This process as global rank ``rank`` of ``world`` for ring and Ulysses set-ups, with echo P2P.

    Ring transfers are :class:`EchoTransfer`, Ulysses exchanges :class:`EchoExchange` (each
    exchange's operations in ``EchoExchange.OPS``).  Yields the list of ``(dtype, bytes)`` of every
    ring transfer posted inside the block.
    """
    import torch.distributed as dist

    from lightning_bytescale.packed_attention import ring, ulysses

    EchoTransfer.SENT = []
    EchoExchange.OPS = []
    with (
        mock.patch.object(dist, "is_initialized", lambda: True),
        mock.patch.object(dist, "get_rank", lambda group=None: rank),
        mock.patch.object(dist, "get_world_size", lambda group=None: world),
        mock.patch.object(ring, "Transfer", EchoTransfer),
        mock.patch.object(ulysses, "p2p_exchange", EchoExchange.post),
    ):
        yield EchoTransfer.SENT
