"""Fake NCCL on a CPU-only torch: a process group that takes CUDA tensors only, and every collective recorded.

gloo takes host tensors in any collective; NCCL refuses them (``No backend type associated with
device type cpu``).  :func:`fake_nccl` makes this process one rank of a world on torch's
``FakeProcessGroup`` (``torch.testing._internal.distributed.fake_pg``) registered as the
backend ``"fakenccl"`` for ``cuda`` only, inside the fake-CUDA tier (``tests/_fake_cuda.py``):
a collective or point-to-point call on a host tensor raises NCCL's own error, the same call on a
fake CUDA tensor runs (its fake kernel: devices and dtypes checked, no data moved).

On top of the fake-CUDA tier, :class:`FakeNccl` gives fake CUDA tensors *values*: every fake
CUDA tensor made from host data (a host-to-device copy, :meth:`FakeNccl.cuda`, a factory on
``cuda``: ``empty`` gives zeros) carries a host copy of its storage, every op on fake tensors
runs once more on those copies, and a value read back (``.item()``, ``.tolist()``, a
device-to-host copy) returns it -- still recorded in :attr:`FakeCuda.syncs`.  So code that reads
a collective's result back (the step's checks, a plan agreement, an object collective) runs to
the end.  Collectives move no data, and their values follow one simple world: a reduction
leaves each tensor as this rank holds it (the other ranks add nothing), a gather fills every
slot with this rank's input (the other ranks hold the same), a broadcast leaves the receive
buffer as it is.  An op whose inputs lack values gives outputs without values (reading those
raises, as in the fake-CUDA tier).  Autograd cannot run on fake CUDA tensors, so the tier runs
under ``torch.no_grad()``: drive backward pieces with gradients you set.

Every collective that runs is recorded (:data:`RECORDED`) with the function of the package that
called it: the innermost frame under ``lightning_bytescale/``, as ``module:qualified name``.
:func:`call_sites` finds the package's collective and point-to-point call sites by reading its
source; ``tests/fake_nccl/test_collective_coverage.py`` fails when one is neither covered by a
test of the tier (``@pytest.mark.covers("engine/executor.py:allreduce_gradients:all_reduce")``,
checked at run time by ``tests/fake_nccl/conftest.py``) nor on :data:`ALLOWED`.

Mesh sub-groups: ``init_device_mesh("cuda", ...)`` (``ParallelDims.build``) makes its groups on
the fake backend as it does on NCCL (``new_group`` over a ``FakeStore``), because
:func:`fake_nccl` answers the CUDA queries as one GPU and names ``cuda`` the accelerator (torch's
``barrier`` asks for it).  Build meshes inside :func:`fake_nccl`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from _fake_cuda import CUDA, FakeCuda, _wrapper, fake_cuda
from _fake_pg import forget_sharding_propagation, leave
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg
from torch.utils._pytree import tree_leaves, tree_map

BACKEND = "fakenccl"
PACKAGE = Path(__file__).resolve().parents[1] / "lightning_bytescale"
aten = torch.ops.aten
_EMPTY = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}

# ---------------------------------------------------------------------------- what a call site is
# Each kind of collective: the c10d and functional-collective ops that run as it (what the tier
# records), and the torch.distributed calls of the package that may run it (what a site is)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (
        (
            "allreduce_",
            "allreduce_coalesced_",
            "all_reduce",
            "all_reduce_",
            "all_reduce_coalesced",
            "all_reduce_coalesced_",
        ),
        ("all_reduce",),
    ),
    "reduce": (("reduce_",), ("reduce",)),
    "broadcast": (("broadcast_", "broadcast"), ("broadcast", "broadcast_object_list")),
    "all_gather": (
        (
            "allgather_",
            "_allgather_base_",
            "allgather_coalesced_",
            "allgather_into_tensor_coalesced_",
            "all_gather_into_tensor",
            "all_gather_into_tensor_out",
            "all_gather_into_tensor_coalesced",
        ),
        ("all_gather", "all_gather_into_tensor", "all_gather_object"),
    ),
    "reduce_scatter": (
        (
            "reduce_scatter_",
            "_reduce_scatter_base_",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor_coalesced",
            "reduce_scatter_tensor_out",
        ),
        ("reduce_scatter", "reduce_scatter_tensor"),
    ),
    "all_to_all": (("alltoall_", "alltoall_base_", "all_to_all_single"), ("all_to_all", "all_to_all_single")),
    "gather": (("gather_",), ("gather", "gather_object")),
    "scatter": (("scatter_",), ("scatter", "scatter_object_list")),
    "barrier": (("barrier", "monitored_barrier_"), ("barrier", "monitored_barrier")),
    "p2p": (
        ("send", "recv_", "recv_any_source_"),
        (
            "send",
            "recv",
            "isend",
            "irecv",
            "batch_isend_irecv",
            "P2POp",
            "send_object_list",
            "recv_object_list",
        ),
    ),
}
OP_KINDS = {op: kind for kind, (ops, _) in KINDS.items() for op in ops}
ANY = frozenset(KINDS)
CALLS: dict[str, frozenset[str]] = {
    call: frozenset({kind}) for kind, (_, calls) in KINDS.items() for call in calls
}
# DTensor methods that communicate (whatever they are called on)
METHODS: dict[str, frozenset[str]] = {"full_tensor": ANY, "redistribute": ANY}
# the communicating functions of each torch.distributed module, by module (``None``: every public name)
MODULES: dict[str, dict[str, frozenset[str]] | None] = {
    "torch.distributed": CALLS,
    "torch.distributed._functional_collectives": None,  # funcol
    "torch.distributed.tensor": {"distribute_tensor": ANY, "distribute_module": ANY},
    "torch.distributed.tensor.parallel": {"parallelize_module": ANY},
    "torch.distributed.checkpoint.state_dict": {
        name: ANY
        for name in (
            "get_model_state_dict",
            "get_optimizer_state_dict",
            "get_state_dict",
            "set_model_state_dict",
            "set_optimizer_state_dict",
            "set_state_dict",
        )
    },
}


# Calls that cut locally, with no communication, when a keyword is ``None``: not sites.
# ``distribute_tensor(..., src_data_rank=None)``: "each rank uses its local data" (torch's docs),
# neither scatter nor broadcast.
LOCAL_WHEN_NONE = {"distribute_tensor": "src_data_rank"}


def _communicates(module: str, name: str) -> frozenset[str] | None:
    """The kinds of collective ``module.name`` may run as, or ``None`` when it does not communicate."""
    names = MODULES.get(module, {})
    if names is None:
        return None if name.startswith("_") else ANY
    return names.get(name)


# Call sites that are gloo on host tensors by design: never NCCL, so never under this tier.
ALLOWED = {
    # the profiler's host link probe: two CPU processes on gloo time a batch_isend_irecv exchange
    # over 127.0.0.1 (the point-to-point link of a ring step), after a barrier
    "profiler/links.py:_p2p_worker.<locals>.best_of:barrier",
    "profiler/links.py:_p2p_worker.<locals>.best_of:P2POp",
    "profiler/links.py:_p2p_worker.<locals>.best_of:isend",
    "profiler/links.py:_p2p_worker.<locals>.best_of:irecv",
    "profiler/links.py:_p2p_worker.<locals>.best_of:batch_isend_irecv",
}


@dataclass(frozen=True)
class CallSite:
    """One call of a collective in the package: ``module:function:call`` (line for messages only)."""

    module: str  # relative to lightning_bytescale/, e.g. "engine/executor.py"
    function: str  # qualified name, as the frame's co_qualname (comprehensions folded into their function)
    call: str  # the name called: all_reduce, full_tensor, get_model_state_dict, ...
    line: int

    @property
    def key(self) -> str:
        return f"{self.module}:{self.function}:{self.call}"


def _fold(qualname: str) -> str:
    """A frame's qualified name without comprehension scopes (Python 3.12 inlines them, 3.11 does not)."""
    parts = [
        p for p in qualname.split(".") if p not in ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
    ]
    while parts and parts[-1] == "<locals>":
        parts.pop()
    return ".".join(parts)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


class _Scanner(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.scope: list[str] = []
        self.sites: dict[str, CallSite] = {}
        self.modules: dict[str, str] = {}  # local name -> torch.distributed module it is bound to
        self.names: dict[str, str] = {}  # local name -> communicating function imported by name

    # scopes -------------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for outside in (*node.decorator_list, node.args, node.returns):  # evaluated in the enclosing scope
            if outside is not None:
                self.visit(outside)
        self.scope += [node.name, "<locals>"]
        for stmt in node.body:
            self.visit(stmt)
        del self.scope[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.scope += ["<lambda>", "<locals>"]
        self.generic_visit(node)
        del self.scope[-2:]

    # imports (read first: an import may sit inside a function, below a use elsewhere) -----
    def imports(self, node: ast.Import | ast.ImportFrom) -> None:
        for a in node.names:
            if isinstance(node, ast.Import):
                if a.name in MODULES:
                    self.modules[a.asname or a.name] = a.name
                continue
            full = f"{node.module}.{a.name}"
            if full in MODULES:
                self.modules[a.asname or a.name] = full
            elif node.module in MODULES and _communicates(node.module, a.name):
                self.names[a.asname or a.name] = a.name

    # sites --------------------------------------------------------------------------------
    def _site(self, call: str, node: ast.AST) -> None:
        function = _fold(".".join(self.scope)) or "<module>"
        site = CallSite(self.module, function, call, node.lineno)
        self.sites.setdefault(site.key, site)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _dotted(node.value)
        module = self.modules.get(chain, chain) if chain else None
        if module in MODULES and _communicates(module, node.attr):
            self._site(node.attr, node)
        self.generic_visit(node)

    def _callee(self, func: ast.AST) -> str | None:
        """The communicating function a call's callee names (``None``: another callee)."""
        if isinstance(func, ast.Name) and isinstance(func.ctx, ast.Load):
            return self.names.get(func.id)
        if isinstance(func, ast.Attribute):
            chain = _dotted(func.value)
            module = self.modules.get(chain, chain) if chain else None
            if module in MODULES and _communicates(module, func.attr):
                return func.attr
        return None

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in METHODS:
            self._site(func.attr, node)
        keyword = LOCAL_WHEN_NONE.get(self._callee(func) or "")
        if keyword is not None and any(
            k.arg == keyword and isinstance(k.value, ast.Constant) and k.value.value is None
            for k in node.keywords
        ):  # cuts locally: the callee is no site, its arguments may hold some
            if isinstance(func, ast.Attribute):
                self.visit(func.value)
            for child in (*node.args, *node.keywords):
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.names and isinstance(node.ctx, ast.Load):
            self._site(self.names[node.id], node)


def call_sites(root: Path = PACKAGE) -> dict[str, CallSite]:
    """Every collective and point-to-point call site under ``root`` (the package), by ``module:function:call``.

    A site is a use of a ``torch.distributed`` collective (called or passed on), a DTensor
    ``full_tensor`` / ``redistribute`` call, or a ``torch.distributed.checkpoint`` state-dict
    function, in the function that holds it; not a call that cuts locally
    (:data:`LOCAL_WHEN_NONE`: ``distribute_tensor(..., src_data_rank=None)``).
    """
    sites: dict[str, CallSite] = {}
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        text = path.read_text()
        if "torch.distributed" not in text and not any(f".{m}(" in text for m in METHODS):
            continue  # no site can be written without one of these
        tree = ast.parse(text, filename=str(path))
        scanner = _Scanner(module)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                scanner.imports(node)
        scanner.visit(tree)
        sites.update(scanner.sites)
    return sites


def kinds_of(call: str) -> frozenset[str]:
    """The kinds of collective a call of this name may run as (any, for DTensor and checkpoint functions)."""
    return CALLS.get(call) or ANY


# ---------------------------------------------------------------------------- what ran
@dataclass(frozen=True)
class Collective:
    """One collective that ran under the tier: its kind, the op and the package function that called it."""

    kind: str
    op: str
    module: str  # "" when no package frame was on the stack (the test itself)
    function: str


RECORDED: list[Collective] = []  # every collective run under the tier (tests/fake_nccl/conftest.py clears it)


def _caller() -> tuple[str, str]:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if f"{PACKAGE}/" in filename:
            return Path(filename).relative_to(PACKAGE).as_posix(), _fold(frame.f_code.co_qualname)
        frame = frame.f_back
    return "", ""


def ran(site: str) -> bool:
    """Whether the call site ``module:function:call`` ran a collective of its kind under the tier."""
    module, function, call = site.split(":")
    kinds = kinds_of(call)
    return any(c.module == module and c.function == function and c.kind in kinds for c in RECORDED)


# ---------------------------------------------------------------------------- the mode
class _NoValue(Exception):
    pass


def _group_of(args: tuple) -> dist.ProcessGroup | None:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue
    return None


class FakeNccl(FakeCuda):
    """:class:`FakeCuda` with values on its fake CUDA tensors and every collective recorded (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # fake storage (its StorageImpl) -> (the fake storage, kept alive; its host copy)
        self._values: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    # values -------------------------------------------------------------------------------
    def cuda(self, t: torch.Tensor) -> torch.Tensor:
        """A fake CUDA tensor of ``t``'s shape, dtype and values."""
        out = super().cuda(t)
        self._store(out, t.detach())
        return out

    def module_to_cuda(self, module: nn.Module) -> nn.Module:
        """``module`` with every parameter and buffer fake CUDA, with values; ``requires_grad`` kept (no autograd runs here)."""
        return module._apply(self.cuda)

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The host values of fake tensor ``t`` (a view of its storage's copy), or ``None``."""
        entry = self._values.get(t.untyped_storage()._cdata)
        if entry is None:
            return None
        return torch.empty(0, dtype=t.dtype).set_(entry[1], t.storage_offset(), t.shape, t.stride())

    def tolist(self, t: torch.Tensor) -> object:
        """``t.tolist()`` as CUDA does it: one device-to-host copy (a fake tensor reads element by element)."""
        v = self.value(t) if t.device.type == "cuda" else None
        if v is None:
            return torch.Tensor.tolist(t)
        self._record("a device-to-host copy", "Tensor.tolist")
        return v.tolist()

    @staticmethod
    def data_ptr(t: torch.Tensor) -> int:
        """A fake tensor's address: its storage's own (the ``StorageImpl``'s) plus the view's byte offset.

        torch gives every fake storage the address 0, so code that asks whether two tensors share
        memory (the bucketed sync: is a gradient still its bucket's view, or did autograd hand
        over a tensor of its own to copy in?) would find every pair aliased.
        """
        return t.untyped_storage()._cdata + t.storage_offset() * t.element_size()

    def twinned(self, t: torch.Tensor, twin: torch.Tensor) -> None:
        v = self.value(t)
        if v is not None:
            self._store(twin, v)

    def _store(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        storage = fake.untyped_storage()
        key = storage._cdata
        if key not in self._values:
            self._values[key] = (storage, torch.zeros(storage.nbytes(), dtype=torch.uint8).untyped_storage())
        view = self.value(fake)
        assert view is not None
        if (
            view.untyped_storage().data_ptr() != real.untyped_storage().data_ptr()
            or view.stride() != real.stride()
        ):
            view.copy_(real)

    def _forget(self, out: object) -> None:
        for f in tree_leaves(out):
            if isinstance(f, FakeTensor):
                self._values.pop(f.untyped_storage()._cdata, None)

    def _real(self, x: object) -> object:
        if isinstance(x, FakeTensor):
            v = self.value(x)
            if v is None:
                raise _NoValue
            return v
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        return x

    def _run_on_values(self, func, args, kwargs, out) -> None:
        """Run ``func`` once more on the host values and store them on ``out``'s fake tensors."""
        if not any(isinstance(f, FakeTensor) for f in tree_leaves(out)):
            return
        try:
            real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            real_out = func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - no values (a fake input without, or a CUDA-only op)
            self._forget(out)
            return
        if any(isinstance(r, FakeTensor) for r in tree_leaves(real_out)):
            return  # under another fake mode (DTensor's sharding propagation): metadata only
        if func in _EMPTY:
            real_out.zero_()
        for f, r in zip(tree_leaves(out), tree_leaves(real_out)):
            if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor):
                self._store(f, r)

    # collectives --------------------------------------------------------------------------
    def _collective(self, func, types, args, kwargs):
        name = func._schema.name.split("::")[-1]
        kind = OP_KINDS.get(name)
        module, function = _caller()
        out = super().__torch_dispatch__(func, types, args, kwargs)  # NCCL's device checks
        if kind is not None:
            RECORDED.append(Collective(kind, str(func), module, function))
        try:
            self._collective_values(name, args, out)
        except _NoValue:
            self._forget(out)
        return out

    def _collective_values(self, name: str, args: tuple, out: object) -> None:
        pg = _group_of(args)
        rank = pg.rank() if pg is not None else 0

        def put(dst: torch.Tensor, src: torch.Tensor) -> None:
            self._store(dst, self._real(src))

        if name == "allgather_" or name == "gather_":
            for o in args[0][0] if args[0] else ():
                put(o, args[1][0])
        elif name == "_allgather_base_":
            self._store(
                args[0], torch.cat([self._real(args[1])] * (args[0].shape[0] // max(1, args[1].shape[0])))
            )
        elif name in ("allgather_coalesced_", "allgather_into_tensor_coalesced_"):
            for o, i in zip(args[0], args[1]):
                o = o if isinstance(o, torch.Tensor) else o[0]
                self._store(o, torch.cat([self._real(i)] * (o.shape[0] // max(1, i.shape[0]))))
        elif name == "reduce_scatter_" or name == "scatter_":
            if args[1] and args[1][0]:
                put(args[0][0], args[1][0][rank])
        elif name == "_reduce_scatter_base_":
            put(args[0], args[1].chunk(args[1].shape[0] // max(1, args[0].shape[0]))[rank])
        elif name in ("alltoall_base_",):
            put(args[0], args[1])
        elif name == "alltoall_":
            for o, i in zip(args[0], args[1]):
                put(o, i)
        elif name == "all_gather_into_tensor":
            self._store(out, torch.cat([self._real(args[0])] * int(args[1])))
        elif name == "reduce_scatter_tensor":
            group = dist.distributed_c10d._resolve_process_group(args[3])
            self._store(out, self._real(args[0]).chunk(int(args[2]))[group.rank()])
        elif (
            isinstance(out, FakeTensor)
            and isinstance(args[0], FakeTensor)
            and out.shape == args[0].shape
            and out.untyped_storage()._cdata != args[0].untyped_storage()._cdata
        ):  # functional ops: all_reduce, broadcast, all_to_all_single, wait_tensor, _wrap_tensor_autograd
            put(out, args[0])
        # the rest (all-reduce, reduce, broadcast in place; send, receive, barrier) leave values as they are

    # the dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(_wrapper(x) for x in leaves):
            return NotImplemented  # a DTensor first: its inner ops on fake tensors come back here
        if func.namespace in ("c10d", "_c10d_functional"):
            return self._collective(func, types, args, kwargs)
        if any(isinstance(x, FakeTensor) for x in leaves):
            if (
                func is aten._to_copy.default
                and torch.device(kwargs.get("device") or args[0].device).type == "cpu"
            ):
                v = self.value(args[0])
                if v is not None and args[0].device.type == "cuda":
                    self._record("a device-to-host copy", func)
                    return aten._to_copy.default(v, **kwargs)
            if (
                func is aten.copy_.default
                and not isinstance(args[0], FakeTensor)
                and args[0].device.type == "cpu"
            ):
                v = self.value(args[1])
                if v is not None:
                    self._record("a device-to-host copy", func)
                    return args[0].copy_(v)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            # recorded by the fake-CUDA tier; with values the op runs on them (a host scalar, or
            # fake CUDA outputs of the shape the values give)
            try:
                real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            except _NoValue:
                raise err from None
            real_out = func(*real_args, **real_kwargs)
            return tree_map(lambda r: self.cuda(r) if isinstance(r, torch.Tensor) else r, real_out)
        self._run_on_values(func, args, kwargs, out)
        return out


# ---------------------------------------------------------------------------- the tier
def register_backend() -> None:
    """``"fakenccl"``: torch's fake process group, registered for ``cuda`` only (as NCCL is); once."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create_fake_pg, extended_api=True, devices=["cuda"])


@contextmanager
def fake_nccl(world_size: int = 1, rank: int = 0) -> Iterator[FakeNccl]:
    """This process as global rank ``rank`` of ``world_size`` on fake NCCL, inside the fake-CUDA tier with values.

    Yields the :class:`FakeNccl` mode (``mode.cuda(t)`` makes a fake CUDA tensor of ``t``,
    ``mode.value(x)`` reads one's values).  The default process group is destroyed on the way
    out and DTensor's sharding-propagation caches are emptied on the way in and out
    (``tests/_fake_pg.py``: a cached result holds the mesh of the world that made it, and a later
    world, or a rank forked later from this process, would get DTensors on it); autograd is off
    inside (module docstring).
    """
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; fake_nccl makes its own")
    register_backend()
    mode = FakeNccl()
    forget_sharding_propagation()  # no mesh of an earlier world serves this one
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with ExitStack() as stack:
            # torch's barrier asks which accelerator this machine has (a CPU build says "cpu")
            stack.enter_context(mock.patch.object(torch._C, "_get_accelerator", lambda: torch.device("cuda")))
            stack.enter_context(
                mock.patch.object(FakeTensor, "tolist", lambda t: mode.tolist(t), create=True)
            )
            stack.enter_context(mock.patch.object(FakeTensor, "data_ptr", mode.data_ptr, create=True))
            stack.enter_context(fake_cuda(mode=mode))
            stack.enter_context(torch.no_grad())
            yield mode
    finally:
        leave()  # the group, and DTensor's cached meshes of it (tests/_fake_pg.py)


__all__ = [
    "ALLOWED",
    "CUDA",
    "CallSite",
    "Collective",
    "FakeNccl",
    "RECORDED",
    "call_sites",
    "fake_nccl",
    "kinds_of",
    "ran",
    "register_backend",
]
