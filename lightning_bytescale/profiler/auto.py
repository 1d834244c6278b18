"""``cost_model="auto"``: the run's own model measured on its device at set-up, the same on every rank.

:func:`auto_cost_model` is what a training run calls once its model sits on its device (and,
under a process group, on every rank): it measures, as ``bytescale-profile`` does
(:mod:`.layers`), one transformer layer's forward+backward at a few lengths around the capacity
``C`` (:func:`auto_lengths`: ``C/8, C/4, C/2, C``) in the run's precision (``"bf16-mixed"``
runs under autocast, ``"*-true"`` as the parameters are), the bytes every layer saves, the host
link, and fits the planner's :class:`~lightning_bytescale.planner.cost_model.CostModel`
(:meth:`CostModel.fit`, the profiler's fit).  The ring term comes from the links given
(``bandwidth_intra`` / ``bandwidth_inter``) or, with ``measure_links=True``, from timed
point-to-point exchanges on the run's own process group (group ranks 0 and 1; 0 and
``ranks_per_node`` for the link between nodes).  Without ``capacity`` and with a
``memory_budget`` it first derives ``C`` from the saved bytes, as the profiler does.

**Every rank plans with the same model.**  Under a process group the lengths are split over the
ranks (``split=True``; rank ``r`` measures lengths ``r, r + world, ...``), their figures summed
over the group (one all-reduce of float64), group rank 0 fits, and the fitted values are
broadcast as float64, so every rank builds the same :class:`CostModel` bit for bit.  The tensors
are made on :func:`~lightning_bytescale.engine.comm_device.comm_device` of the group (the host for
gloo, the rank's GPU for NCCL).

**Cached.**  Group rank 0 keeps the result in a file keyed by what determines it
(:mod:`.cache`: model structure and dtypes, device, torch and CUDA versions, precision,
attention kernel, the measurement's settings); the next start reads it and measures nothing
(measured links excepted: they belong to the cluster, not the model, and are measured on every
start that asks for them, in milliseconds).  One line (:attr:`AutoCostModel.line`) says what was
measured or read, and where the file is.

The measurement leaves the model as it found it: the gradients it had, its train/eval modes,
and torch's random state (the layer's inputs and output gradient are drawn inside
``torch.random.fork_rng``), so a run with ``"auto"`` trains exactly as one given the same model.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from filelock import Timeout
from torch import nn

from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.models.heads import config_heads
from lightning_bytescale.offload.blocks import find_blocks
from lightning_bytescale.packed_attention.kernels import select_kernel
from lightning_bytescale.packed_attention.local import local_kernel
from lightning_bytescale.planner.cost_model import CostModel, OffloadConfig
from lightning_bytescale.profiler.cache import CostCache, cache_key, default_cache_dir, device_name
from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.layers import prepare_length, time_rounds
from lightning_bytescale.profiler.links import measure_bandwidth
from lightning_bytescale.profiler.run import _capacity, _fit_line
from lightning_bytescale.profiler.timing import synchronize

#: Lightning precision -> (autocast dtype or None).  ``"*-true"`` runs as the parameters are.
PRECISIONS: dict[str, torch.dtype | None] = {
    "64-true": None,
    "64": None,
    "32-true": None,
    "32": None,
    "bf16-true": None,
    "16-true": None,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}
CAPACITY_PROBES = (256, 512, 1024)  # lengths whose saved bytes give C from a memory budget
MIN_LENGTH = 16

# The float64 vector rank 0 broadcasts: what every rank builds the same model from (NaN: None).
_VALUES = (
    "a",
    "b",
    "g",
    "c",
    "d",
    "num_layers",
    "kv_bytes_per_token_per_layer",
    "bandwidth_intra",
    "bandwidth_inter",
    "ranks_per_node",
    "forward_fraction",
    "attention_heads",
    "kv_heads",
    "capacity",
    "bandwidth_d2h",
    "bandwidth_h2d",
    "measured_s",
)
_INTS = {"num_layers", "ranks_per_node", "attention_heads", "kv_heads", "capacity"}


@dataclass
class AutoCostModel:
    """What ``cost_model="auto"`` resolved to on this start (the same on every rank)."""

    cost_model: CostModel
    capacity: int | None  # C: the one given, or derived from the memory budget
    offload: OffloadConfig  # the layers and the host link measured (Eq. 3)
    cache_path: Path | None  # group rank 0's cache file (None: caching off)
    from_cache: bool  # read back: no layer was measured on this start
    measured_s: float  # seconds the layer measurement took when it was made
    lengths: list[int]
    line: str  # one printable line: what was measured or read, and where the cache is
    points: dict[str, list[float]] = field(default_factory=dict)  # the measured points (group rank 0)


def auto_lengths(capacity: int) -> list[int]:
    """The lengths measured around ``C``: ``C/8, C/4, C/2, C`` (at least 16 tokens, distinct)."""
    capacity = int(capacity)
    if capacity < 4 * MIN_LENGTH:
        raise ProfileError(
            f"cost_model='auto' measures lengths up to C; C={capacity} is below {4 * MIN_LENGTH}"
        )
    out: list[int] = []
    for frac in (8, 4, 2, 1):
        s = max(MIN_LENGTH, capacity // frac)
        if s not in out:
            out.append(s)
    return out


def autocast_dtype(precision: str | None) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision (``None``: run as the parameters are)."""
    if precision is None:
        return None
    key = str(precision)
    if key not in PRECISIONS:
        raise ProfileError(
            f"cost_model='auto' cannot measure in precision {precision!r}; it knows {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[key]


@contextlib.contextmanager
def _precision(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
    else:
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield


def _model_config(model: nn.Module) -> Any:
    """The first ``config`` in ``model``'s tree that names heads (a LightningModule holds its
    model's), else ``model.config``."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config_heads(config) is not None:
            return config
    return getattr(model, "config", None)


def _head_dim(config: Any) -> int | None:
    """The attention head size a config names (``head_dim``, else the hidden size over the heads)."""
    v = getattr(config, "head_dim", None)
    if isinstance(v, int) and v > 0:
        return v
    heads = config_heads(config)
    hidden = getattr(config, "dim", None) or getattr(config, "hidden_size", None)
    if heads and isinstance(hidden, int) and hidden % heads[0] == 0:
        return hidden // heads[0]
    return None


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str:
    """The attention kernels a model of ``head_dim`` runs on ``device`` in ``dtype`` (local and ring)."""
    if head_dim is None:
        return f"unknown head size ({device.type}, {str(dtype).removeprefix('torch.')})"
    q = torch.empty(1, 1, head_dim, dtype=dtype, device=device)
    return f"local={local_kernel(q)}, ring={select_kernel(device, dtype, head_dim)}"


@contextlib.contextmanager
def _untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run a measurement and leave ``model``'s gradients, modes and torch's random state as they were."""
    grads = {p: p.grad for p in model.parameters()}
    modes = {m: m.training for m in model.modules()}
    cuda = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    try:
        with torch.random.fork_rng(devices=cuda):
            model.train()
            yield
    finally:
        for p, g in grads.items():
            p.grad = g
        for m, mode in modes.items():
            m.train(mode)


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int, int]:
    """``(group rank, group size, global rank of group rank 0)``; one process without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, 0
    pg = group if group is not None else dist.group.WORLD
    return dist.get_rank(pg), dist.get_world_size(pg), dist.get_global_rank(pg, 0)


def _broadcast(values: list[float], group: dist.ProcessGroup | None, src: int) -> list[float]:
    """Group rank 0's float64 ``values`` on every rank of ``group`` (``src``: its global rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    dist.broadcast(t, src=src, group=group)
    return [float(v) for v in t.tolist()]  # one copy back


def _sum_over_group(rows: list[list[float]], group: dist.ProcessGroup | None) -> list[list[float]]:
    """Every rank's float64 ``rows`` summed over ``group`` (each rank fills only its own rows)."""
    t = torch.tensor(rows, dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, group=group)
    return [[float(v) for v in row] for row in t.tolist()]  # one copy back


def _exchange_seconds(peer: int, nbytes: int, repeats: int, group: dist.ProcessGroup | None) -> float:
    """The fastest of ``repeats`` two-way ``batch_isend_irecv`` exchanges of ``nbytes`` with global rank ``peer``."""
    device = comm_device(group)
    send = torch.ones(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    best = math.inf
    for i in range(repeats + 1):  # the first exchange connects the pair
        synchronize(device)
        start = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        synchronize(device)
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return best


def measure_group_links(
    group: dist.ProcessGroup | None, ranks_per_node: int | None, nbytes: int = 4 * 2**20, repeats: int = 3
) -> tuple[float | None, float | None]:
    """``(intra, inter)`` bytes/s per rank and direction on the run's own group, as the ranks of
    each pair time them: group rank 0 with group rank 1 (one node unless ``ranks_per_node`` is 1)
    and, when the group spans nodes, with group rank ``ranks_per_node``.  ``None`` where there is
    no such pair or this rank is not in it (:func:`auto_cost_model` broadcasts group rank 0's).
    Call it on every rank of the group: only the ranks of a pair exchange."""
    rank, world, _ = _rank_and_world(group)
    pg = group if group is not None else dist.group.WORLD
    pairs = []
    if world >= 2 and (ranks_per_node is None or ranks_per_node >= 2):
        pairs.append(("intra", 1))
    if ranks_per_node is not None and world > ranks_per_node:
        pairs.append(("inter", ranks_per_node))
    found: dict[str, float] = {}
    for kind, other in pairs:
        if rank in (0, other):
            peer = dist.get_global_rank(pg, other if rank == 0 else 0)
            found[kind] = nbytes / _exchange_seconds(peer, nbytes, repeats, group)
    return found.get("intra"), found.get("inter")


@dataclass
class _Setup:
    """What every rank measures with."""

    model: nn.Module
    blocks: list[nn.Module]
    device: torch.device
    cast: torch.dtype | None
    vocab: int
    num_layers: int
    heads: tuple[int, int] | None
    kv_bytes: float
    name: str
    warmup: int
    repeats: int


def _measure_lengths(setup: _Setup, lengths: Sequence[int]) -> list[list[float]]:
    """``[fwd+bwd s, fwd s, layer bytes, outside bytes]`` of one layer at each of ``lengths``,
    under the run's autocast (the timed callables run inside it too)."""
    if not lengths:
        return []
    with _precision(setup.device, setup.cast):
        runs = [prepare_length(setup.model, setup.blocks, s, setup.vocab, setup.device) for s in lengths]
        fwd = time_rounds(runs, "forward", setup.device, setup.warmup, setup.repeats)
        both = time_rounds(runs, "forward_backward", setup.device, setup.warmup, setup.repeats)
    return [[b, min(f, b), r.layer_bytes, r.outside_bytes] for r, f, b in zip(runs, fwd, both)]


def _capacity_from_budget(setup: _Setup, available: float, round_to: int) -> int:
    """``C`` from the bytes saved at :data:`CAPACITY_PROBES` (one forward each) and the bytes available."""
    with _precision(setup.device, setup.cast):
        runs = [
            prepare_length(setup.model, setup.blocks, s, setup.vocab, setup.device) for s in CAPACITY_PROBES
        ]
    layer = _fit_line(CAPACITY_PROBES, [r.layer_bytes for r in runs])
    outside = _fit_line(CAPACITY_PROBES, [r.outside_bytes for r in runs])
    probe = CostModel(a=0.0, b=1.0, c=layer[0], d=layer[1], num_layers=setup.num_layers)
    return _capacity(probe, outside, available, round_to)


def _static_bytes(params: int, dtype: torch.dtype, state_bytes_per_param: float | None) -> float:
    """Parameters, gradients and Adam's two fp32 states (the profiler's default)."""
    if state_bytes_per_param is None:
        state_bytes_per_param = 2 * torch.tensor([], dtype=dtype).element_size() + 8
    return params * state_bytes_per_param


def _encode(cost: CostModel, capacity: int | None, offload: OffloadConfig, measured_s: float) -> list[float]:
    src = {
        **{f: getattr(cost, f) for f in _VALUES if hasattr(cost, f)},
        "capacity": capacity,
        "bandwidth_d2h": offload.bandwidth_d2h,
        "bandwidth_h2d": offload.bandwidth_h2d,
        "measured_s": measured_s,
    }
    return [math.nan if src[f] is None else float(src[f]) for f in _VALUES]


def _decode(values: Sequence[float], name: str) -> tuple[CostModel, int | None, OffloadConfig, float]:
    got: dict[str, Any] = {}
    for f, v in zip(_VALUES, values):
        got[f] = None if math.isnan(v) else (int(v) if f in _INTS else v)
    offload = OffloadConfig(
        layers_per_rank=got["num_layers"],
        bandwidth_d2h=got["bandwidth_d2h"],
        bandwidth_h2d=got["bandwidth_h2d"],
    )
    model_fields = {
        f: got[f] for f in _VALUES if f not in ("capacity", "bandwidth_d2h", "bandwidth_h2d", "measured_s")
    }
    return CostModel(name=name, **model_fields), got["capacity"], offload, got["measured_s"]


def _fit_record(
    lengths: list[int], rows: list[list[float]], setup: _Setup, capacity: int | None, measured_s: float
) -> dict[str, Any]:
    """Group rank 0's fit of the summed rows: the cost model, the host link, the points."""
    both = [r[0] for r in rows]
    fwd = [r[1] for r in rows]
    acts = [r[2] for r in rows]
    shares = [f / b for f, b in zip(fwd, both) if b > 0]
    heads = setup.heads
    cost = CostModel.fit(
        lengths,
        both,
        act_lengths=lengths,
        act_bytes=acts,
        num_layers=setup.num_layers,
        kv_bytes_per_token_per_layer=setup.kv_bytes,
        forward_fraction=min(1.0, max(1e-6, sum(shares) / len(shares) if shares else 1.0 / 3.0)),
        name=setup.name,
        attention_heads=None if heads is None else heads[0],
        kv_heads=None if heads is None else heads[1],
    )
    d2h, h2d = measure_bandwidth(setup.device, 16 * 2**20, repeats=3)
    return {
        "cost_model": cost.to_json_dict(),
        "capacity": capacity,
        "offload": OffloadConfig(
            layers_per_rank=setup.num_layers, bandwidth_d2h=d2h, bandwidth_h2d=h2d
        ).to_json_dict(),
        "measured_s": measured_s,
        "device": device_name(setup.device),
        "points": {
            "lengths": [float(s) for s in lengths],
            "layer_seconds": both,
            "layer_forward_seconds": fwd,
            "act_bytes": acts,
            "outside_act_bytes": [r[3] for r in rows],
        },
    }


def _record_values(record: dict[str, Any], name: str) -> tuple[CostModel, int | None, OffloadConfig, float]:
    cost = CostModel.from_json_dict({**record["cost_model"], "name": name})
    offload = OffloadConfig.from_json_dict(record["offload"])
    return cost, record.get("capacity"), offload, float(record.get("measured_s", 0.0))


def _measure_and_fit(
    setup: _Setup,
    todo: list[int],
    capacity: int | None,
    rank: int,
    world: int,
    split: bool,
    group: dist.ProcessGroup | None,
) -> dict[str, Any] | None:
    """This rank's share of the lengths measured, the group's figures summed, group rank 0's fit
    (``None`` on the other ranks).  A failure on any rank is raised on every rank."""
    mine = todo[rank::world] if (split and world > 1) else (todo if rank == 0 else [])
    rows = [[0.0] * 4 for _ in todo] + [[0.0] * 4]  # the last row counts the ranks that failed
    failure = ""
    began = time.perf_counter()
    try:
        with _untouched(setup.model, setup.device):
            got = _measure_lengths(setup, mine)
        for s, row in zip(mine, got):
            rows[todo.index(s)] = row
    except Exception as err:  # raised on every rank below, so that no rank waits for this one
        failure = f"rank {rank}: {type(err).__name__}: {err}"
        rows[-1][0] = 1.0
    if world > 1:
        rows = _sum_over_group(rows, group)
    if rows[-1][0] > 0:
        raise ProfileError(
            f"cost_model='auto' failed measuring the layer on {int(rows[-1][0])} rank(s): "
            f"{failure or 'see the failing ranks log'}"
        )
    if rank != 0:
        return None
    return _fit_record(todo, rows[:-1], setup, capacity, time.perf_counter() - began)


def auto_cost_model(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    precision: str | None = None,
    capacity: int | None = None,
    memory_budget: int | None = None,
    state_bytes_per_param: float | None = None,
    reserve_bytes: int = 0,
    round_to: int = 1,
    bandwidth_intra: float | None = None,
    bandwidth_inter: float | None = None,
    ranks_per_node: int | None = None,
    measure_links: bool = False,
    link_bytes: int = 4 * 2**20,
    layers: Sequence[nn.Module] | None = None,
    num_layers: int | None = None,
    vocab: int | None = None,
    param_count: int | None = None,
    kv_bytes_per_token_per_layer: float | None = None,
    lengths: Sequence[int] | None = None,
    warmup: int = 1,
    repeats: int = 2,
    group: dist.ProcessGroup | None = None,
    split: bool = True,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    lock_timeout_s: float = 600.0,
) -> AutoCostModel:
    """Measure (or read back) ``model``'s cost model on ``device``; see the module docstring.

    ``model``: the engine's contract (``model(input_ids [T], position_ids [T]) -> logits [T, V]``
    inside an attention context), on its device, before any sharding; ``layers`` its blocks
    (default: found as the offloader finds them); ``num_layers`` / ``param_count`` the real
    model's when a shallower copy is measured.  ``precision``: the run's Lightning precision.
    ``capacity``: ``C``; without it ``memory_budget`` (device bytes a rank may use) gives one, as
    ``bytescale-profile --memory-budget`` does.  ``bandwidth_intra`` / ``bandwidth_inter``
    (bytes/s) win over measured links (``measure_links=True``).  ``group``: the process group
    whose ranks must agree (default: the world, when one is initialised); call it on every rank
    of it.  ``cache_dir``: default ``$BYTESCALE_COST_CACHE`` or
    ``~/.cache/lightning_bytescale/cost``; ``cache=False`` measures every time.  An error on any
    rank is raised on every rank (no rank is left waiting for it).
    """
    start = time.perf_counter()
    rank, world, src = _rank_and_world(group)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    cast = autocast_dtype(precision)
    blocks = list(layers) if layers is not None else find_blocks(model)
    if not blocks:
        raise ProfileError(
            f"cost_model='auto' cannot find the transformer blocks of {type(model).__name__}: pass layers=[...] "
            "(its block list in forward order) or give the model an offload_layers() method"
        )
    config = _model_config(model)
    vocab = vocab or getattr(config, "vocab", None) or getattr(config, "vocab_size", None)
    if vocab is None:
        raise ProfileError("cost_model='auto' cannot tell the model's vocabulary size; pass vocab=")
    if capacity is None and memory_budget is None and lengths is None:
        raise ProfileError(
            "cost_model='auto' measures lengths around the capacity C: give capacity=, or memory_budget= "
            "(device bytes a rank may use) to derive it"
        )
    if capacity is not None and lengths is None:
        auto_lengths(capacity)  # checks C now, on every rank
    param_dtype = next(model.parameters()).dtype
    run_dtype = cast or param_dtype
    heads = config_heads(config)
    head_dim = _head_dim(config)
    if kv_bytes_per_token_per_layer is None:
        elem = torch.tensor([], dtype=run_dtype).element_size()
        kv_bytes_per_token_per_layer = float(2 * heads[1] * head_dim * elem) if heads and head_dim else 0.0
    setup = _Setup(
        model=model,
        blocks=blocks,
        device=dev,
        cast=cast,
        vocab=int(vocab),
        num_layers=int(num_layers) if num_layers is not None else len(blocks),
        heads=heads,
        kv_bytes=float(kv_bytes_per_token_per_layer),
        name=f"auto-{type(model).__name__}-{dev.type}",
        warmup=warmup,
        repeats=repeats,
    )
    params = int(param_count) if param_count is not None else sum(p.numel() for p in model.parameters())
    settings = {
        "capacity": capacity,
        "memory_budget": memory_budget,
        "state_bytes_per_param": state_bytes_per_param,
        "reserve_bytes": reserve_bytes,
        "round_to": round_to,
        "lengths": None if lengths is None else [int(s) for s in lengths],
        "profiled_layers": len(blocks),
        "num_layers": setup.num_layers,
        "param_count": params,
        "vocab": setup.vocab,
        "kv_bytes_per_token_per_layer": setup.kv_bytes,
        "warmup": warmup,
        "repeats": repeats,
    }
    kernel = attention_kernel(dev, run_dtype, head_dim)
    key = cache_key(model, dev, precision=precision, attention_kernel=kernel, settings=settings)
    store = CostCache(Path(cache_dir) if cache_dir is not None else default_cache_dir(), key)
    links = (
        measure_group_links(group, ranks_per_node, link_bytes)
        if (measure_links and world > 1)
        else (None, None)
    )

    record: dict[str, Any] | None = None
    lock = None
    cap = capacity
    failure = ""
    try:
        if rank == 0:
            try:
                if cache:
                    lock = store.lock(lock_timeout_s)
                    try:
                        lock.acquire()
                    except Timeout:
                        lock = None  # another start holds it too long: measure, write nothing
                    record = store.read()
                if record is not None:
                    cap = record.get("capacity")
                elif cap is None and lengths is None:
                    static = _static_bytes(params, param_dtype, state_bytes_per_param)
                    with _untouched(model, dev):
                        cap = _capacity_from_budget(setup, memory_budget - static - reserve_bytes, round_to)
            except Exception as err:  # raised on every rank below, so that no rank waits for this one
                failure = f"{type(err).__name__}: {err}"
        # [status: 1 read back, 0 to measure, -1 failed; C]
        head = [
            -1.0 if failure else (1.0 if record is not None else 0.0),
            math.nan if cap is None else float(cap),
        ]
        if world > 1:
            head = _broadcast(head, group, src)
        if head[0] < 0:
            raise ProfileError(f"cost_model='auto' failed on group rank 0: {failure or 'see its log'}")
        cap = None if math.isnan(head[1]) else int(head[1])
        from_cache = head[0] == 1.0
        if not from_cache:
            todo = [int(s) for s in lengths] if lengths is not None else auto_lengths(cap)  # type: ignore[arg-type]
            record = _measure_and_fit(setup, todo, cap, rank, world, split, group)
        values = [0.0] * len(_VALUES)
        if rank == 0:
            assert record is not None
            if not from_cache and cache and lock is not None:
                store.write(record)
            cost, cap_0, offload, measured = _record_values(record, setup.name)
            values = _encode(
                cost.with_(bandwidth_intra=links[0], bandwidth_inter=links[1]), cap_0, offload, measured
            )
        if world > 1:
            values = _broadcast(values, group, src)
    finally:
        if lock is not None:
            lock.release()
    cost, cap, offload, measured_s = _decode(values, setup.name)
    cost = cost.with_(  # configured links win over measured ones (group rank 0's, broadcast)
        bandwidth_intra=bandwidth_intra if bandwidth_intra is not None else cost.bandwidth_intra,
        bandwidth_inter=bandwidth_inter if bandwidth_inter is not None else cost.bandwidth_inter,
        ranks_per_node=ranks_per_node,
    )
    result = AutoCostModel(
        cost_model=cost,
        capacity=cap,
        offload=offload,
        cache_path=store.path if cache else None,
        from_cache=from_cache,
        measured_s=measured_s,
        lengths=[int(s) for s in lengths] if lengths is not None else auto_lengths(cap),  # type: ignore[arg-type]
        line="",
        points=dict(record.get("points", {})) if record else {},
    )
    result.line = _line(
        result, model, dev, precision, world, split, time.perf_counter() - start, measure_links
    )
    return result


def _line(
    result: AutoCostModel,
    model: nn.Module,
    device: torch.device,
    precision: str | None,
    world: int,
    split: bool,
    took: float,
    measure_links: bool,
) -> str:
    cm = result.cost_model
    what = (
        f"{type(model).__name__} ({cm.num_layers} layers, {precision or str(next(model.parameters()).dtype)}) "
        f"on {device_name(device)}"
    )
    fit = f"T(s) = {cm.a:.3g} s^2 + {cm.b:.3g} s + {cm.g:.3g} s/layer, C = {result.capacity}"
    if cm.models_comm:
        link = f"links {cm.bandwidth(True) / 1e9:.3g}/{cm.bandwidth(False) / 1e9:.3g} GB/s" + (
            " (measured)" if measure_links else ""
        )
    else:
        link = "no ring term (no link figures)"
    where = f"cache {result.cache_path}" if result.cache_path is not None else "no cache"
    if result.from_cache:
        how = f"read back, nothing measured ({took:.2f} s)"
    else:
        over = f" over {world} ranks" if (split and world > 1) else ""
        how = f"measured at lengths {','.join(map(str, result.lengths))}{over} in {result.measured_s:.2f} s"
    return f"cost_model='auto': {what}: {how}; {fit}; {link}; {where}"


__all__ = [
    "PRECISIONS",
    "AutoCostModel",
    "attention_kernel",
    "auto_cost_model",
    "auto_lengths",
    "autocast_dtype",
    "measure_group_links",
]
