"""A model sharded while it is on the meta device, given on each rank only its own shards.

Tensor parallelism exists for models one device cannot hold, so a model must never be whole on
one device before it is sliced.  It is built on the meta device instead (no memory), sharded
there (``parallelize_llama``, ``parallelize_hf``, ``parallelize_module``: DTensors of meta
shards), and ``to_empty`` gives each rank storage for its own shards only
(:func:`to_empty_keeping_ties`: tied weights stay tied).  What remains
is their values, which must be exactly the parts of the whole tensors one process would have:

* :func:`fill_from_whole` copies them from whole tensors that global rank ``src`` holds (a
  checkpoint read on its host): one tensor at a time travels from it on the module's device, each
  rank keeps its part, and with ``src=None`` every rank holds the whole tensors and copies its
  own parts without communication;
* :func:`materialize_sharded` draws them: on ``src`` each module's ``reset_parameters`` fills
  whole tensors on the device, module by module in ``module.modules()`` order (so the values are
  those of Lightning's materialisation of the unsharded model on one device), and they reach
  every rank as above.  DTensor random operations would instead draw each shard on its own rank:
  on a CPU mesh every lane draws the same values for different slices.

So a rank holds, beyond its shards, one whole tensor at a time (and on ``src``, one module's).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_bytescale.errors import ConfigError


def named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` once (a tied weight under its first name), non-persistent buffers too."""
    seen: set[int] = set()
    out = []
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@torch.no_grad()
def _copy_part(target: torch.Tensor, whole: torch.Tensor | None, src: int | None) -> None:
    """``target`` (a DTensor: its local shard) gets its part of ``whole``, which ``src`` holds (``None``: this rank)."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if whole is None:
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
    else:
        full = whole.detach().to(device=local.device)
    if src is not None:
        dist.broadcast(full, src=src)
    if isinstance(target, DTensor):  # this rank's part, cut locally (no communication)
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    local.copy_(full)


@torch.no_grad()
def fill_from_whole(
    module: nn.Module, whole: Mapping[str, torch.Tensor] | None, *, src: int | None = 0
) -> None:
    """Copy into every parameter and buffer of ``module`` (a DTensor: its local shard) its part of ``whole[name]``.

    ``src``: the global rank that holds ``whole`` (any device; the others pass ``None``): each
    tensor is broadcast from it on the device ``module`` lives on, one at a time, and every rank
    keeps its part.  ``src=None``: every rank holds ``whole`` and copies its own parts, no
    communication.  Names are those of ``named_parameters`` and ``named_buffers`` (a tied weight
    under its first name); ``whole`` must hold each of them with the module's shape (the whole
    shape of a DTensor) and dtype.  Call on every rank of the global group, after ``to_empty``.
    """
    if not _distributed():
        src = None
    holds = src is None or _rank() == src
    tensors = named_tensors(module)
    problem = None
    if holds:
        problem = _mismatch(tensors, whole)
    if (
        src is not None
    ):  # every rank learns of a mismatch before any tensor travels (no rank waits on a broadcast)
        box = [problem]
        dist.broadcast_object_list(box, src=src)
        problem = box[0]
    if problem is not None:
        raise ConfigError(f"fill_from_whole: {problem}; build both from the same config and dtype")
    for name, t in tensors:
        _copy_part(t, whole[name] if holds and whole is not None else None, src)


def _mismatch(
    tensors: list[tuple[str, torch.Tensor]], whole: Mapping[str, torch.Tensor] | None
) -> str | None:
    """The first tensor ``whole`` lacks or holds with another shape or dtype, in words (``None``: all fit)."""
    if whole is None:
        return f"rank {_rank()} is the source but holds no whole tensors"
    for name, t in tensors:
        value = whole.get(name)
        if value is None or (tuple(value.shape), value.dtype) != (tuple(t.shape), t.dtype):
            got = "nothing" if value is None else f"{tuple(value.shape)} {value.dtype}"
            return f"{name!r} is {tuple(t.shape)} {t.dtype} in the sharded model but the whole weights have {got}"
    return None


def _own(module: nn.Module, name: str) -> torch.Tensor:
    return module._parameters[name] if name in module._parameters else module._buffers[name]  # type: ignore[return-value]


@contextmanager
def _whole_in_place(module: nn.Module, names: list[str], device: torch.device) -> Iterator[None]:
    """``module``'s own tensors ``names`` replaced by uninitialised whole plain tensors on ``device`` (restored after)."""
    saved = {n: _own(module, n) for n in names}
    for n, t in saved.items():
        whole = torch.empty(t.shape, dtype=t.dtype, device=device)
        if n in module._parameters:
            module._parameters[n] = nn.Parameter(whole, requires_grad=t.requires_grad)
        else:
            module._buffers[n] = whole
    try:
        yield
    finally:
        for n, t in saved.items():
            if n in module._parameters:
                module._parameters[n] = t  # type: ignore[assignment]
            else:
                module._buffers[n] = t


def to_empty_keeping_ties(module: nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)``, with a tensor two modules share (a tied weight) still shared after.

    ``to_empty`` gives a meta parameter a new ``Parameter`` in every module that holds it, so a tie
    would come undone silently (the tied head would train apart from the embedding).
    """
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, t in (*sub._parameters.items(), *sub._buffers.items()):
            if t is not None:
                places.setdefault(id(t), []).append((sub, name))
    module.to_empty(device=device)
    for (first, name), *others in places.values():
        shared = _own(first, name)
        for sub, other in others:
            if other in sub._parameters:
                sub._parameters[other] = shared  # type: ignore[assignment]
            else:
                sub._buffers[other] = shared


@torch.no_grad()
def materialize_sharded(module: nn.Module, device: torch.device, *, src: int = 0) -> list[str]:
    """A model with meta tensors (sharded or not) on ``device``, each rank holding its shards of ``src``'s draws.

    ``to_empty`` first (ties kept: :func:`to_empty_keeping_ties`); then, per module with tensors
    of its own, ``src`` runs its ``reset_parameters`` on whole plain tensors on ``device`` and every
    rank keeps its part (:func:`fill_from_whole`'s transfer).  A tied tensor keeps its first
    module's draws, as when a constructor ties after drawing both (the later draws still advance
    the generator).  Returns the names of module types with tensors but
    without ``reset_parameters`` (left uninitialised, as Lightning leaves them).  Call on every
    rank of the global group.  Nothing happens to a model without meta tensors.
    """
    if not any(t.is_meta for _, t in named_tensors(module)):
        return []
    to_empty_keeping_ties(module, device)
    source = src if _distributed() else None
    missing: set[str] = set()
    filled: set[int] = set()
    for sub in module.modules():
        names = [n for n, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None]
        if not names:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):
            missing.add(type(sub).__name__)
            continue
        drawn: dict[str, torch.Tensor] = {}
        if source is None or _rank() == source:
            with _whole_in_place(sub, names, device):
                reset()
                drawn = {n: _own(sub, n) for n in names}  # reset_parameters may assign new tensors
        for n in names:
            t = _own(sub, n)
            if id(t) not in filled:
                filled.add(id(t))
                _copy_part(t, drawn[n].to(t.dtype) if n in drawn else None, source)
    return sorted(missing)


__all__ = ["fill_from_whole", "materialize_sharded", "named_tensors", "to_empty_keeping_ties"]
