"""Sharded checkpoints: every rank writes its own part with ``torch.distributed.checkpoint`` (DCP).

A consolidated checkpoint gathers everything on rank 0, which writes one file: under ZeRO that
is the whole optimizer state (for a 7B model with Adam, about 84 GB) sent to one rank at every
save.  A *sharded* checkpoint is a folder instead:

* the model's ``state_dict`` (replicated: every rank offers it, DCP's de-duplication has each
  tensor written once, the writes spread over the ranks);
* each optimizer's state **keyed by parameter name** (``optimizer_<i>``, then the parameter's
  name, then the state's, e.g. ``exp_avg``), each entry offered only by the rank that holds it (its ``ZeroRedundancyOptimizer`` partition; every
  rank when the state is not sharded, de-duplicated like the model);
* ``meta.pt``, written by rank 0: everything else Lightning puts in a checkpoint (loops and the
  data position, callbacks, LR schedulers, hyper-parameters, precision state) and each
  optimizer's parameter groups with parameter *names* in place of indices.

Because optimizer state is keyed by name, loading reshards: each rank reads the model and the
entries of the parameters it owns under the *current* partition, whatever the world size and
ZeRO setting of the run that saved.

DTensor state (tensor parallelism, FSDP2 on the mesh) goes in as it is: each rank offers its
local shards of the parameters and of the optimizer state (AdamW's moments are DTensors like
their parameter), DCP records where each shard sits in the whole tensor and writes a shard that
several ranks hold (the same TP shard on every HDP rank of a lane) once.  On load every rank
reads into templates shaped like its *current* parameters (the parameters themselves, and
``empty_like`` of them for the optimizer state), so it reads only the parts of the whole tensors
its own shards cover, on whatever mesh; nothing is gathered on save or load.  :func:`export_consolidated` turns a folder into the one
file a consolidated save writes (``state_dict``, ``optimizer_states`` in PyTorch's indexed
layout, the rest), for sharing a model or loading it anywhere without a process group, and
``LightningModule.load_from_checkpoint`` reads a folder directly (:func:`load_for_module`).
``torch.load`` cannot open a folder (``IsADirectoryError``): :func:`read_consolidated` is its
counterpart for one.

The metadata file keeps the name Lightning's FSDP and ModelParallel strategies give theirs
(``meta.pt``).  Loading needs no process group: every rank reads what it needs on its own.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.nn import Module
from torch.optim import Optimizer

from lightning_bytescale.errors import CheckpointError, ConfigError
from lightning_bytescale.parallel import full_state
from lightning_bytescale.parallel.layout import Layout, MeshLayout, PipelineLayout
from lightning_bytescale.parallel.zero import keeps_state, state_sharded_over_hdp_ranks

CHECKPOINT_FORMATS = ("auto", "sharded", "consolidated")
META_FILE = "meta.pt"  # Lightning's name for a sharded checkpoint's metadata file
DCP_METADATA_FILE = ".metadata"
INFO_KEY = "bytescale_sharded"  # in meta.pt: the layout of the DCP part
LAYOUT_VERSION = 1
MODEL_KEY = "state_dict"


def optimizer_key(index: int) -> str:
    """The top-level DCP key of optimizer ``index``'s state."""
    return f"optimizer_{index}"


def validate_format(value: Any) -> str:
    """``checkpoint_format`` as given, or a :class:`ConfigError` naming the valid values."""
    if value not in CHECKPOINT_FORMATS:
        raise ConfigError(
            f"checkpoint_format must be one of {list(CHECKPOINT_FORMATS)}, got {value!r}: 'sharded' has every rank "
            "write its part of a checkpoint folder with torch.distributed.checkpoint, 'consolidated' gathers "
            "everything on rank 0 into one file, 'auto' is 'sharded' exactly when optimizer state is sharded over the ranks (ZeRO, or FSDP2 on the "
            "tensor-parallel mesh)"
        )
    return str(value)


def is_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` shards its state over the ranks (``ZeroRedundancyOptimizer``)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_sharded` (its ``meta.pt`` and DCP metadata)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def _param_names(module: Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _group_names(optimizer: Optimizer, names: dict[int, str]) -> list[list[str]]:
    """Each parameter group's parameter names (the full groups, also under ZeRO)."""
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"parameter group {g} of {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)} that "
                    "is not a parameter of the LightningModule, so a sharded checkpoint cannot name its state; "
                    "optimize only the module's parameters or use checkpoint_format='consolidated'"
                )
            fqns.append(names[id(p)])
        groups.append(fqns)
    return groups


def sharded_optimizer_state(optimizer: Optimizer, module: Module) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, keyed by parameter name; no communication.

    ``{"state": {name: {state_name: value}}, "param_groups": [{..., "params": [names]}]}``:
    under ZeRO ``state`` holds the parameters of this rank's partition, otherwise all of them.
    The groups are the full groups (the same on every rank).
    """
    names = _param_names(module)
    local = optimizer.optim.state if is_zero(optimizer) else optimizer.state  # type: ignore[attr-defined]
    groups = _group_names(optimizer, names)
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in local and local[p]:
                state[names[id(p)]] = dict(local[p])
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": fqns}
        for group, fqns in zip(optimizer.param_groups, groups)
    ]
    return {"state": state, "param_groups": param_groups}


def _check_local(path: str | Path) -> Path:
    text = str(path)
    if "://" in text:
        raise ConfigError(
            f"sharded checkpoints are written to a local or mounted file system, got {text!r}; save to a shared "
            "mounted folder, or set ByteScaleStrategy(checkpoint_format='consolidated') for remote storage"
        )
    return Path(text)


def _partial(path: Path) -> Path:
    """The sibling folder a save writes before it replaces ``path``; the same name on every rank.

    Its name holds neither the checkpoint's name nor ``.ckpt``, so Lightning's ``hpc`` and
    ``last`` look-ups never take a save that was killed half-way for a checkpoint.
    """
    digest = hashlib.sha1(path.name.encode()).hexdigest()[:12]
    return path.parent / f".partial-checkpoint-{digest}"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def save_sharded(
    checkpoint: dict[str, Any],
    path: str | Path,
    *,
    rank: int,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Write ``checkpoint`` (Lightning's dict; optimizer states from :func:`sharded_optimizer_state`) as a folder.

    A collective: every rank calls it with its own ``checkpoint``, the same ``path`` and a
    ``barrier`` over all ranks.  The ranks write into a sibling folder, which rank 0 then
    renames to ``path``: an existing checkpoint there (a file or a sharded folder) stays whole
    until the new one is complete.  Any other non-empty folder at ``path`` is refused.
    """
    path = _check_local(path)
    if path.is_dir() and not is_sharded_checkpoint(path) and any(path.iterdir()):
        raise CheckpointError(  # every rank sees the same folder, so all ranks stop here together
            f"cannot write a sharded checkpoint to {str(path)!r}: it is a folder that is not a checkpoint; "
            "choose another path or remove the folder"
        )
    meta = dict(checkpoint)
    tensors: dict[str, Any] = {MODEL_KEY: meta.pop(MODEL_KEY, {})}
    states = meta.pop("optimizer_states", None)
    layouts = []
    for i, state in enumerate(states or []):
        if set(state) != {"state", "param_groups"} or any(
            not isinstance(n, str) for g in state["param_groups"] for n in g["params"]
        ):
            raise CheckpointError(
                f"optimizer state {i} is not keyed by parameter name; the strategy's optimizer_state() makes it "
                "for sharded checkpoints"
            )
        tensors[optimizer_key(i)] = state["state"]
        layouts.append({"param_groups": state["param_groups"]})
    meta[INFO_KEY] = {
        "version": LAYOUT_VERSION,
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        "optimizers": layouts if states is not None else None,
    }
    partial = _partial(path)
    if barrier is not None:
        barrier()  # every rank has looked at ``path`` before rank 0 changes anything
    if rank == 0:
        _remove(partial)  # what a save that was killed left behind
        partial.mkdir(parents=True)
    if barrier is not None:
        barrier()
    with _local_io():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(partial))  # returns once every rank wrote
    if rank == 0:
        torch.save(meta, partial / META_FILE)
        _remove(path)
        partial.rename(path)
    if barrier is not None:
        barrier()
    return path


# ------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Entry:
    key: str  # DCP's flat key
    path: tuple[Any, ...]  # the nested path it was saved under
    metadata: TensorStorageMetadata | BytesStorageMetadata


def _entries(metadata: Metadata) -> list[_Entry]:
    planner_data = metadata.planner_data or {}
    return [
        _Entry(key, tuple(planner_data.get(key, (key,))), md)
        for key, md in metadata.state_dict_metadata.items()
    ]


def _allocate(entry: _Entry, device: torch.device | None = None) -> Any:
    md = entry.metadata
    if isinstance(md, TensorStorageMetadata):
        size = tuple(md.size)
        return torch.empty(size, dtype=md.properties.dtype, device=device if len(size) else None)
    return None  # bytes: DCP puts the loaded object here


def _allocate_like(entry: _Entry, param: torch.Tensor) -> Any:
    """Where an optimizer entry of ``param`` is read to: shaped like ``param`` when it is a DTensor of its size.

    A DTensor template (the parameter's own mesh and placements) makes DCP read only this
    rank's shard; a scalar (a step count) or the state of a plain parameter is read whole.  State
    of a DTensor parameter in another shape is refused: read whole, it would not be a shard.
    """
    from torch.distributed.tensor import DTensor

    md = entry.metadata
    if not isinstance(param, DTensor) or not isinstance(md, TensorStorageMetadata) or not md.size:
        return _allocate(entry, param.device)
    if tuple(md.size) != tuple(param.shape):
        _, name, state_name = entry.path
        raise CheckpointError(
            f"the checkpoint's optimizer state {state_name!r} of {name!r} has shape {tuple(md.size)}, not its DTensor "
            f"parameter's {tuple(param.shape)}: a sharded checkpoint reads a DTensor parameter's state into its "
            "shards only when it is shaped like the parameter (AdamW, SGD with momentum) or a scalar; use "
            "ByteScaleStrategy(checkpoint_format='consolidated') with this optimizer"
        )
    return torch.empty_like(param, dtype=md.properties.dtype)


def _read(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    """Read the flat keys of ``template`` from the folder into it, on this rank only (no collectives)."""
    if template:
        with _local_io():
            dcp.load(template, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return template


@contextmanager
def _local_io() -> Iterator[None]:
    """Without a process group DCP reads and writes in this process (what is meant here): no warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _load_meta(path: Path, weights_only: bool | None) -> tuple[dict[str, Any], Metadata]:
    if not is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{str(path)!r} is not a sharded checkpoint folder (it needs {META_FILE} and {DCP_METADATA_FILE}); "
            "pass the folder a sharded save wrote, or a consolidated .ckpt file"
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=weights_only)
    if INFO_KEY not in meta:
        raise CheckpointError(
            f"{str(path)!r} is a sharded checkpoint of another strategy (its {META_FILE} lacks {INFO_KEY!r}); "
            "load it with the strategy that wrote it, or convert it to one file first"
        )
    return meta, dcp.FileSystemReader(path).read_metadata()


def _check_groups(
    i: int, saved: list[dict[str, Any]], current: list[list[str]], stage_only: bool = False
) -> None:
    if len(saved) != len(current):
        raise CheckpointError(
            f"optimizer {i} has {len(current)} parameter group(s) but the checkpoint has {len(saved)}; build the "
            "optimizer as the saved run did (configure_optimizers)"
        )
    for g, (group, names) in enumerate(zip(saved, current)):
        if set(group["params"]) != set(names) and not (stage_only and set(names) <= set(group["params"])):
            missing = sorted(set(group["params"]) - set(names))[:3]
            extra = sorted(set(names) - set(group["params"]))[:3]
            raise CheckpointError(
                f"parameter group {g} of optimizer {i} differs from the checkpoint's: saved but not optimized now "
                f"{missing}, optimized now but not saved {extra}; build the optimizer as the saved run did"
            )


def _indexed(
    state: dict[str, dict[str, Any]], saved_groups: list[dict[str, Any]], order: list[list[str]]
) -> dict[str, Any]:
    """PyTorch's optimizer ``state_dict`` layout (integer indices in the order of ``order``'s groups)."""
    index = {name: i for i, name in enumerate(n for names in order for n in names)}
    start, groups = 0, []
    for group, names in zip(saved_groups, order):
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(start, start + len(names))),
            }
        )
        start += len(names)
    return {"state": {index[name]: value for name, value in state.items()}, "param_groups": groups}


def _nest(values: dict[str, Any], entries: dict[str, _Entry]) -> dict[str, dict[str, Any]]:
    """``{name: {state_name: value}}`` from flat keys saved under ``(optimizer_<i>, name, state_name)``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        _, name, state_name = entries[key].path
        out.setdefault(name, {})[state_name] = value
    return out


def load_sharded(
    path: str | Path,
    module: Module,
    optimizers: Sequence[Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    keeps_state: Callable[[Optimizer, torch.Tensor], bool] | None = None,
    stage_only: bool = False,
) -> dict[str, Any]:
    """Read a sharded checkpoint for this rank; returns the dict Lightning restores from.

    The model's tensors are read *in place* into ``module``'s own state (every rank reads them;
    a DTensor only its local shard); ``state_dict`` in the result is the module's state, so
    Lightning's ``load_state_dict`` after it changes nothing.  Each optimizer gets, in PyTorch's
    indexed layout, the entries of the parameters this rank owns now (its ZeRO partition, those
    ``keeps_state(optimizer, parameter)`` accepts, or all), read from whichever ranks wrote them;
    a DTensor parameter's entries are DTensors like it.  No collectives: every rank reads on its own.
    ``stage_only``: ``module`` is one pipeline stage of the saved model, so the saved keys of the
    other stages are not unexpected (and each optimizer group may hold more names than the stage's).
    """
    path = _check_local(path)
    meta, metadata = _load_meta(path, weights_only)
    info = meta.pop(INFO_KEY)
    entries = _entries(metadata)
    by_key = {e.key: e for e in entries}

    own = module.state_dict(keep_vars=False)
    saved = {e.path[1]: e.key for e in entries if e.path[0] == MODEL_KEY and len(e.path) == 2}
    missing = sorted(set(own) - set(saved))
    unexpected = [] if stage_only else sorted(set(saved) - set(own))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the checkpoint {str(path)!r} does not match the model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; "
            "load it into the model it was saved from, or set LightningModule.strict_loading = False"
        )
    common = [k for k in own if k in saved]
    with torch.no_grad():
        _read(path, {saved[k]: own[k] for k in common})
    checkpoint: dict[str, Any] = dict(meta)
    checkpoint[MODEL_KEY] = {k: own[k] for k in common}

    layouts = info.get("optimizers")
    if layouts is None:  # saved with weights_only=True
        return checkpoint
    if optimizers and len(optimizers) != len(layouts):
        raise CheckpointError(
            f"the run has {len(optimizers)} optimizer(s) but the checkpoint {str(path)!r} has {len(layouts)}; "
            "return the same optimizers from configure_optimizers as the saved run"
        )
    names = _param_names(module)
    states = []
    for i, optimizer in enumerate(optimizers):
        order = _group_names(optimizer, names)
        _check_groups(i, layouts[i]["param_groups"], order, stage_only)
        local = optimizer.optim if is_zero(optimizer) else optimizer  # type: ignore[attr-defined]
        held = {
            names[id(p)]: p
            for g in local.param_groups
            for p in g["params"]
            if keeps_state is None or keeps_state(optimizer, p)
        }
        template = {
            e.key: _allocate_like(e, held[e.path[1]])
            for e in entries
            if e.path[0] == optimizer_key(i) and len(e.path) == 3 and e.path[1] in held
        }
        state = _nest(_read(path, template), by_key)
        states.append(_indexed(state, layouts[i]["param_groups"], order))
    checkpoint["optimizer_states"] = states
    return checkpoint


# ------------------------------------------------------------------------------- per layout
class LayoutCheckpoints:
    """How plain HDP saves and loads; :func:`layout_checkpoints` chooses each run's once.

    ``default`` is Lightning's own step (the strategy's parent class's method), used where the
    layout needs nothing else: a consolidated save of plain HDP is Lightning's, a ZeRO
    optimizer's state gathered on rank 0 by ``consolidate_state_dict``.
    """

    stage_only = False
    """The model is one pipeline stage: a folder's keys of the other stages are not unexpected."""

    def __init__(self, pipelines: int = 1) -> None:
        self.pipelines = pipelines

    def check_format(self, value: Any) -> str:
        """``checkpoint_format`` as given, or a ``ConfigError`` naming the valid values."""
        return validate_format(value)

    def sharded(self, fmt: str, optimizers: Sequence[Optimizer], fsdp: Any) -> bool:
        """Whether a save writes a sharded folder now: ``"auto"`` is sharded when ZeRO splits the optimizer state."""
        if fmt == "auto":
            return any(is_zero(opt) for opt in optimizers)
        return fmt == "sharded"

    def optimizer_state(
        self, optimizer: Optimizer, module: Module, *, sharded: bool, layout: Any, default: Callable[..., Any]
    ) -> dict[str, Any]:
        """Sharded: this rank's own state by parameter name (no gather); else Lightning's."""
        return sharded_optimizer_state(optimizer, module) if sharded else default(optimizer)

    def model_state(self, module: Module, *, sharded: bool, default: Callable[[], Any]) -> dict[str, Any]:
        """The module's state as it is (Lightning's)."""
        return default()

    def load_model_state(
        self, module: Module, checkpoint: Any, strict: bool, *, from_folder: bool, default: Callable[..., Any]
    ) -> None:
        """Lightning's load (a folder's state is already read into the module in place)."""
        default(checkpoint, strict=strict)

    def load_optimizer_states(
        self,
        module: Module,
        optimizers: Sequence[Optimizer],
        checkpoint: Any,
        *,
        from_folder: bool,
        default: Callable[..., Any],
    ) -> None:
        default(checkpoint)

    def whole_state(self, module: Module) -> dict[str, Any]:
        """The module's state as one process holds it (what a spawned run hands back to the main process)."""
        return module.state_dict()

    def before_save(self, filepath: str | Path, *, sharded: bool, rank: int, storage_options: Any) -> None:
        """What a save of either format checks or clears at ``filepath`` first.

        A consolidated file replaces the folder an earlier sharded save wrote there (rank 0
        removes it); a sharded save does not go through the ``CheckpointIO`` plugin, so it takes
        no ``storage_options``.
        """
        if not sharded:
            if rank == 0 and is_sharded_checkpoint(filepath):
                shutil.rmtree(filepath)
            return
        if storage_options is not None:
            raise TypeError(
                "ByteScaleStrategy.save_checkpoint(..., storage_options=...) is not supported for sharded "
                "checkpoints (they do not use the CheckpointIO plugin); set checkpoint_format='consolidated'"
            )

    def load_folder(
        self, path: str | Path, module: Any, optimizers: Sequence[Optimizer], *, weights_only: bool | None
    ) -> dict[str, Any]:
        """A sharded folder read for this rank (:func:`load_sharded`): the model in place, the optimizer state it keeps.

        ZeRO's partition says which optimizer entries this rank keeps
        (:func:`~lightning_bytescale.parallel.zero.keeps_state`); a pipeline stage expects only its own keys.
        """
        return load_sharded(
            path,
            module,
            optimizers,
            strict=module.strict_loading,
            weights_only=weights_only,
            keeps_state=keeps_state,
            stage_only=self.stage_only,
        )


class MeshCheckpoints(LayoutCheckpoints):
    """The tensor-parallel mesh: a consolidated save holds every DTensor whole, gathered one tensor at a time.

    Saved on global rank 0's host and loaded back as each rank's shards, on any mesh
    (:mod:`~lightning_bytescale.parallel.full_state`); ``"auto"`` is sharded exactly when the HDP
    ranks hold different parts of the optimizer state (ZeRO on the mesh, FSDP2).
    """

    def sharded(self, fmt: str, optimizers: Sequence[Optimizer], fsdp: Any) -> bool:
        if fmt == "auto":
            return state_sharded_over_hdp_ranks(list(optimizers), fsdp)
        return fmt == "sharded"

    def optimizer_state(
        self, optimizer: Optimizer, module: Module, *, sharded: bool, layout: Any, default: Callable[..., Any]
    ) -> dict[str, Any]:
        """Sharded: this rank's own state; else the DTensors whole (every rank gathers, rank 0 keeps)."""
        return (
            sharded_optimizer_state(optimizer, module)
            if sharded
            else full_state.optimizer_state(module, optimizer)
        )

    def model_state(self, module: Module, *, sharded: bool, default: Callable[[], Any]) -> dict[str, Any]:
        """Sharded: the local shards as they are; else the DTensors whole (every rank gathers, rank 0 keeps)."""
        return default() if sharded else full_state.model_state(module)

    def load_model_state(
        self, module: Module, checkpoint: Any, strict: bool, *, from_folder: bool, default: Callable[..., Any]
    ) -> None:
        """A folder is read into the module already; a file's whole tensors give each rank its shards."""
        if from_folder:
            default(checkpoint, strict=strict)
            return
        full_state.load_model_state(module, checkpoint["state_dict"], strict)

    def load_optimizer_states(
        self,
        module: Module,
        optimizers: Sequence[Optimizer],
        checkpoint: Any,
        *,
        from_folder: bool,
        default: Callable[..., Any],
    ) -> None:
        """A folder's states hold this rank's shards; a file's whole tensors give each rank its shards."""
        if from_folder:
            default(checkpoint)
            return
        full_state.load_optimizer_states(module, list(optimizers), checkpoint["optimizer_states"])

    def whole_state(self, module: Module) -> dict[str, Any]:
        """Every DTensor gathered whole (a collective: every rank calls it)."""
        return full_state.full_state_dict(module)


class PipelineCheckpoints(MeshCheckpoints):
    """Pipelines: every stage holds other parameters, so every save is a sharded folder naming every stage's."""

    stage_only = True

    def check_format(self, value: Any) -> str:
        """``"consolidated"`` is refused: rank 0 alone cannot write the model."""
        if value == "consolidated":
            raise ConfigError(
                f"checkpoint_format='consolidated' is not supported with pipeline_parallel_size={self.pipelines}: "
                "every stage holds other parameters, so rank 0 alone cannot write the model. Use "
                "checkpoint_format='sharded' (or 'auto', which is sharded with pipelines)"
            )
        return validate_format(value)

    def sharded(self, fmt: str, optimizers: Sequence[Optimizer], fsdp: Any) -> bool:
        return True

    def optimizer_state(
        self, optimizer: Optimizer, module: Module, *, sharded: bool, layout: Any, default: Callable[..., Any]
    ) -> dict[str, Any]:
        """This rank's state by parameter name, with each group's parameter names of every stage (a pipeline collective).

        Rank 0 writes the groups into ``meta.pt``; with them merged over the pipeline every stage
        finds its own parameters there on load.
        """
        state = sharded_optimizer_state(optimizer, module)
        names = [[*g["params"]] for g in state["param_groups"]]
        every: list[Any] = [None] * layout.dims.pipeline
        dist.all_gather_object(every, names, group=layout.pp_group)
        for g, group in enumerate(state["param_groups"]):
            group["params"] = [n for stage in every for n in stage[g]]
        return state


def layout_checkpoints(layout: type[Layout], pipelines: int = 1) -> LayoutCheckpoints:
    """How a run of ``layout`` saves and loads, chosen once (``pipelines``: its pipeline size, for messages)."""
    return _CHECKPOINTS[layout](pipelines)


_CHECKPOINTS: dict[type[Layout], type[LayoutCheckpoints]] = {
    Layout: LayoutCheckpoints,
    MeshLayout: MeshCheckpoints,
    PipelineLayout: PipelineCheckpoints,
}


def read_consolidated(
    folder: str | Path, *, optimizer_states: bool = True, weights_only: bool | None = False
) -> dict[str, Any]:
    """The sharded checkpoint ``folder`` as the dict a consolidated save writes, in this process's memory.

    ``state_dict``, ``optimizer_states`` in PyTorch's indexed layout (parameters in the order of
    the optimizer's groups; left out with ``optimizer_states=False``) and Lightning's other
    state.  Runs in one process, without a process group; every tensor is read to the CPU.
    """
    folder = _check_local(folder)
    meta, metadata = _load_meta(folder, weights_only=weights_only)
    info = meta.pop(INFO_KEY)
    entries = [e for e in _entries(metadata) if optimizer_states or e.path[0] == MODEL_KEY]
    by_key = {e.key: e for e in entries}
    values = _read(folder, {e.key: _allocate(e, torch.device("cpu")) for e in entries})
    checkpoint: dict[str, Any] = dict(meta)
    checkpoint[MODEL_KEY] = {e.path[1]: values[e.key] for e in entries if e.path[0] == MODEL_KEY}
    layouts = info.get("optimizers")
    if optimizer_states and layouts is not None:
        states = []
        for i, layout in enumerate(layouts):
            keys = {e.key: values[e.key] for e in entries if e.path[0] == optimizer_key(i)}
            order = [list(g["params"]) for g in layout["param_groups"]]
            states.append(_indexed(_nest(keys, by_key), layout["param_groups"], order))
        checkpoint["optimizer_states"] = states
    return checkpoint


def export_consolidated(folder: str | Path, out: str | Path) -> Path:
    """Write the sharded checkpoint ``folder`` as one consolidated checkpoint file ``out``.

    The file is what a consolidated save writes (:func:`read_consolidated`), so ``torch.load``,
    ``LightningModule.load_from_checkpoint``, ``optimizer.load_state_dict`` and
    ``Trainer.fit(ckpt_path=...)`` with any strategy read it.  Runs in one process (no process
    group) and holds the whole checkpoint in memory.
    """
    checkpoint = read_consolidated(folder)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out)
    return out


def model_state(folder: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's tensors of the sharded checkpoint ``folder``, whole, under their names less ``prefix``.

    Only the names starting with ``prefix`` (the LightningModule's attribute holding the model,
    e.g. ``"model."``), so the result loads into the model itself
    (``LlamaModel.load_state_dict``, a Hugging Face model's).  A folder saved under pipelines holds
    every stage's tensors under the whole model's names (each stage is the model restricted to
    its parameters), and a tensor-parallel one every shard of every DTensor: either reads back as
    the unsplit model's state.  Runs in one process, without a process group; every tensor on the CPU.
    """
    state = read_consolidated(folder, optimizer_states=False)[MODEL_KEY]
    picked = {name.removeprefix(prefix): value for name, value in state.items() if name.startswith(prefix)}
    if not picked:
        raise CheckpointError(
            f"no model tensor of the checkpoint {str(folder)!r} is named with the prefix {prefix!r} (its names begin "
            f"{sorted(state)[:3]}); pass the prefix of the LightningModule's attribute that holds the model, e.g. 'model.'"
        )
    return picked


def export_model(folder: str | Path, out: str | Path, prefix: str = "") -> Path:
    """Write the model's state dict of the sharded checkpoint ``folder`` (:func:`model_state`) as the file ``out``.

    ``torch.load(out)`` is a plain state dict that loads into the unsplit model, e.g. a pipelined
    run's checkpoint into one ``LlamaModel`` for evaluation in one process.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model_state(folder, prefix), out)
    return out


def load_for_module(
    path: Any, map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any] | None:
    """What ``LightningModule.load_from_checkpoint`` reads from a sharded folder: the model and
    Lightning's state, without optimizer state; ``None`` for anything that is not such a folder.

    Installed as the loader of ``load_from_checkpoint`` (:func:`~lightning_bytescale.lightning.compat.load_checkpoint_folders_with`)
    when the strategy module is imported.  ``map_location`` as a device or device string moves
    the tensors there; otherwise they stay on the CPU.
    """
    if not isinstance(path, (str, Path)) or not is_sharded_checkpoint(path):
        return None
    checkpoint = read_consolidated(path, optimizer_states=False, weights_only=weights_only)
    if isinstance(map_location, (str, torch.device)):
        checkpoint[MODEL_KEY] = {k: v.to(map_location) for k, v in checkpoint[MODEL_KEY].items()}
    return checkpoint


def export_command(
    argv: Iterable[str] | None,
    *,
    prog: str,
    description: str,
    out_help: str,
    export: Callable[[argparse.Namespace], Path],
    options: Callable[[argparse.ArgumentParser], Any] | None = None,
) -> int:
    """A command exporting a sharded checkpoint: ``FOLDER OUT`` (``options`` adds the rest), then ``export(args)``.

    A :class:`CheckpointError` is the command's error (exit 2); else it prints the path written.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("folder", help="the sharded checkpoint folder (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out", help=out_help)
    if options is not None:
        options(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        written = export(args)
    except CheckpointError as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {written}")
    return 0


def _model_only(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-only",
        metavar="PREFIX",
        nargs="?",
        const="",
        default=None,
        help="write only the model's state dict, its names less PREFIX (the LightningModule's attribute, "
        "e.g. 'model.'): a file that the unsplit model's load_state_dict reads",
    )


def _export(args: argparse.Namespace) -> Path:
    if args.model_only is None:
        return export_consolidated(args.folder, args.out)
    return export_model(args.folder, args.out, args.model_only)


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m lightning_bytescale.lightning.checkpoint FOLDER OUT.ckpt``: export a sharded checkpoint."""
    return export_command(
        argv,
        prog="python -m lightning_bytescale.lightning.checkpoint",
        description="Turn a sharded checkpoint folder (of any layout, pipelines and tensor parallelism included) "
        "into one consolidated checkpoint file, or with --model-only into the model's state dict.",
        out_help="the consolidated file to write",
        export=_export,
        options=_model_only,
    )


if __name__ == "__main__":
    raise SystemExit(main())
