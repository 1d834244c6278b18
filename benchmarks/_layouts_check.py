"""``gpu_check.py``'s layouts on two or more GPUs: the strategy's pipelines, FSDP2 with TP, ZeRO-1 checkpoints, TP's all-reduces.

The ranks are started once (``torch.multiprocessing``, spawn: the parent has used CUDA) and run
the jobs one after another, each ``Trainer`` with the ranks as its external launch (``LOCAL_RANK``
set, as under torchrun); NCCL on ``cuda:<rank>``, gloo on the CPU in the dry run.  Every job gets a
process group of its own (on the ranks' one TCP store under its own prefix) and leaves none
behind, so one job's failure leaves the next its own communicator; the ranks agree through the
store after every job (a rank that does not report within the job's time stops the run: its
collectives may be out of step) and rank 0 decides through the store whether the next job
starts before the deadline.  Each rank writes ``<job>.rank<r>.json`` (rank 0 also
``<job>.pt`` with whole tensors where a job compares them), what ``gpu_check.py`` judges.

Jobs (:data:`JOBS`): ``pipelines`` (``pipeline_parallel_size=2``, ``bf16-mixed``), ``fsdp2_tp``
(``tensor_parallel_size=2`` with ``fully_shard`` over the data-parallel dimension, ``64-true``),
``tp_zero1_checkpoints`` (``tensor_parallel_size=2``, ``zero=1``: a consolidated and a sharded
checkpoint, each resumed), ``tp_allreduce_count`` (``CommDebugMode`` on the reference Llama
sharded by ``parallelize_llama``), and the ``tensor_parallel`` section's two runs (``tp_bf16``,
``tp_float64``: :mod:`_tp_check`'s module and data).

It also holds the small state helpers the one-GPU ``mesh`` section shares (a module of its own,
``benchmarks`` is on ``sys.path``, so the spawned ranks can unpickle what they run).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _common import QUIET_TRAINER  # benchmarks/_common.py
from _tp_check import MeshData, MeshSteps, Record, TPLlama
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.models import LlamaConfig, LlamaModel

STAGES = 2
TP = 2
FLAT_FROM_STEP = 3  # the optimizer state and the cached stages exist from here on
FLAT_PEAK_RATIO = 1.02  # a later step's peak may exceed that step's by 2% plus FLAT_PEAK_SLACK bytes
FLAT_PEAK_SLACK = 2 * 2**20
RESUME_AT = 3  # tp_zero1_checkpoints: the steps before the checkpoint


# ----------------------------------------------------------------------------- state helpers
def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state by name as this rank holds them (DTensors as their shards), copied to the host."""
    out = {f"param/{n}": local(p).detach().cpu().clone() for n, p in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"state/{names[id(p)]}/{key}"] = local(value).detach().cpu().clone()
    return out


def state_sizes(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes of all the tensors and of the largest one."""
    sizes = [t.numel() * t.element_size() for t in state.values()]
    return {"state_bytes": sum(sizes), "largest_tensor_bytes": max(sizes, default=0)}


def compare_states(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Names on one side only and the largest absolute difference of the others (0.0: equal)."""
    common = [k for k in saved if k in loaded]
    diff = max(
        (float((saved[k].double() - loaded[k].double()).abs().max()) for k in common if saved[k].numel()),
        default=0.0,
    )
    return {
        "only_one_side": sorted(set(saved) ^ set(loaded))[:5],
        "max_abs_diff": diff,
        "tensors": len(common),
    }


def zero_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Overwrite the parameters and the optimizer state with zeros, so that a load must bring every value back."""
    with torch.no_grad():
        for p in module.parameters():
            local(p).zero_()
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    local(value).zero_()


def device_peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``fn()`` and the device memory it held at its peak beyond what was allocated before (``None`` off CUDA)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def flat_peaks(peaks: list[int]) -> bool:
    """Whether every peak from :data:`FLAT_FROM_STEP` on stays within that step's (a leak grows it step after step)."""
    later = peaks[FLAT_FROM_STEP:]
    return bool(later) and max(later) <= FLAT_PEAK_RATIO * later[0] + FLAT_PEAK_SLACK


# ----------------------------------------------------------------------------- the ranks
@dataclass
class Rank:
    """What a job gets: this rank, the run's settings (``spec``) and where to write."""

    rank: int
    world: int
    out: Path
    spec: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return self.spec["accelerator"] == "gpu"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.rank) if self.cuda else torch.device("cpu")

    def trainer(
        self, root: Path, *, precision: str, max_steps: int, callbacks: list, **strategy: Any
    ) -> pl.Trainer:
        root.mkdir(parents=True, exist_ok=True)
        spec = self.spec
        return pl.Trainer(
            accelerator=spec["accelerator"], devices=self.world, precision=precision, max_steps=max_steps,
            num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks,
            strategy=ByteScaleStrategy(planner="balance", capacity=spec["capacity"], timeout=spec["timeout_s"], **strategy),
            **QUIET_TRAINER,
        )  # fmt: skip

    def peak_now(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None


# ----------------------------------------------------------------------------- pipelines
def fixed_lengths(capacity: int) -> tuple[int, ...]:
    """One global batch shape for every step (so every step plans and packs alike): several micro-batches a pipeline."""
    c = capacity
    return (c, 3 * c // 4, c // 2, c // 2, c // 4, c // 4, c // 8, c // 8)


def learnable(step: int, vocab: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Arithmetic progressions mod ``vocab`` of the given lengths (as gpu_check's sequences)."""
    g = torch.Generator().manual_seed(20_000 + step)
    out = []
    for n in lengths:
        a, b = torch.randint(0, vocab, (2,), generator=g).tolist()
        out.append((a + (b % 7 + 1) * torch.arange(n)) % vocab)
    return out


class PipelineSteps(MeshSteps):
    """Item ``k``: this pipeline's micro-batches of global batch ``k`` (the same plan every step: seed 0)."""

    def __getitem__(self, k: int):
        from lightning_bytescale.parallel import build_pipeline_step
        from lightning_bytescale.planner import make_plan

        seqs = learnable(k, self.vocab, fixed_lengths(self.capacity))
        plan = make_plan(
            [len(s) for s in seqs], world_size=self.pmesh.dims.data_parallel, capacity=self.capacity,
            pipeline_degree=STAGES, seed=0,
        )  # fmt: skip
        return build_pipeline_step(
            plan,
            self.pmesh.hdp_rank,
            seqs.__getitem__,
            stages=STAGES,
            step=k,
            ring_ranks=self.pmesh.ring_ranks,
        )


class StagedLlama(pl.LightningModule):
    """The reference Llama (untied) replaced by this rank's stage in ``configure_model``; the head's output dtypes recorded."""

    def __init__(self, preset: str, init: dict[str, torch.Tensor], steps: int, capacity: int) -> None:
        super().__init__()
        self.model = LlamaModel(LlamaConfig.preset(preset, tie_embeddings=False))
        self.model.load_state_dict(init)
        self.steps, self.capacity = steps, capacity
        self.head_dtypes: set[str] = set()

    def configure_model(self) -> None:
        from lightning_bytescale.parallel import LlamaStage

        pipeline = self.device_mesh["pipeline"]
        self.model = LlamaStage(self.model, pipeline.get_local_rank(), pipeline.size())
        if self.model.is_last:
            self.model.part("head").register_forward_hook(
                lambda m, a, out: self.head_dtypes.add(str(out.dtype))
            )

    def train_dataloader(self):
        pmesh = self.trainer.strategy.parallel_mesh
        data = PipelineSteps(pmesh, self.steps, self.model.vocab_size, self.capacity)
        return StatefulDataLoader(data, batch_size=None, shuffle=False, num_workers=0)

    def training_step(self, mb, batch_idx):
        raise AssertionError("training_step is not called under pipelines")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class StepRows(pl.Callback):
    """Per step: the logged loss, the step's peak device memory (CUDA), the pipelines' measured bubbles."""

    def __init__(self, job: Rank) -> None:
        self.job, self.rows = job, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.job.cuda:
            torch.cuda.reset_peak_memory_stats(self.job.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.step_stats
        self.rows.append({
            "loss": float(trainer.callback_metrics["train/loss"]),
            "peak_bytes": self.job.peak_now(),
            "micro_batches": len(batch.micro_batches),
            "pipeline_bubble": stats.get("pipeline_bubble"),
        })  # fmt: skip


def pipelines(job: Rank) -> dict:
    spec = job.spec
    module = StagedLlama(spec["preset"], spec["init"], spec["steps"], spec["capacity"])
    rows = StepRows(job)
    trainer = job.trainer(
        job.out / "pipelines", precision="bf16-mixed", max_steps=spec["steps"], callbacks=[rows],
        pipeline_parallel_size=STAGES, checkpoint_format="sharded",
    )  # fmt: skip
    trainer.fit(module)
    pmesh = trainer.strategy.parallel_mesh
    peaks = [r["peak_bytes"] for r in rows.rows]
    return {
        "mesh": list(pmesh.mesh.mesh.shape),
        "stage": pmesh.stage,
        "backend": str(dist.get_backend()),
        "device": str(module.device),
        "rows": rows.rows,
        "head_dtypes": sorted(module.head_dtypes),
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "peak_flat": flat_peaks(peaks) if job.cuda else None,
    }


# ----------------------------------------------------------------------------- tensor parallelism
class FSDPTPLlama(TPLlama):
    """:mod:`_tp_check`'s module with ``fully_shard`` over the data-parallel dimension around its TP blocks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        dp = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=dp, reshard_after_forward=False)
        fully_shard(self.model, mesh=dp, reshard_after_forward=False)


def _tp_fit(job: Rank, name: str, module: TPLlama, precision: str, **strategy: Any) -> dict:
    spec = job.spec
    root = job.out / name
    trainer = job.trainer(
        root, precision=precision, max_steps=spec["steps"], callbacks=[Record(root)],
        tensor_parallel_size=TP, **strategy,
    )  # fmt: skip
    cfg = LlamaConfig.preset(spec["preset"])
    trainer.fit(module, datamodule=MeshData(spec["steps"], cfg.vocab, spec["capacity"]))
    report = json.loads((root / f"tp_report_{job.rank}.json").read_text())
    report["fsdp_driver"] = trainer.strategy.fsdp is not None
    if job.rank == 0:
        (job.out / f"{name}.pt").write_bytes((root / "tp_params.pt").read_bytes())
    return report


def tp_bf16(job: Rank) -> dict:
    return _tp_fit(job, "tp_bf16", TPLlama(job.spec["preset"], job.spec["init"], "adamw"), "bf16-mixed")


def tp_float64(job: Rank) -> dict:
    return _tp_fit(job, "tp_float64", TPLlama(job.spec["preset"], job.spec["init"], "sgd"), "64-true")


def fsdp2_tp(job: Rank) -> dict:
    return _tp_fit(job, "fsdp2_tp", FSDPTPLlama(job.spec["preset"], job.spec["init"], "sgd"), "64-true")


class SaveAtEnd(pl.Callback):
    """At the end of the first run: this rank's state, then a consolidated and a sharded checkpoint (peak memory of each)."""

    def __init__(self, job: Rank, paths: dict[str, Path]) -> None:
        self.job, self.paths, self.saved, self.peaks = job, paths, {}, {}

    def on_train_end(self, trainer, pl_module):
        self.saved = local_state(pl_module, trainer.optimizers[0])
        for fmt, path in self.paths.items():
            trainer.strategy.checkpoint_format = fmt
            _, self.peaks[fmt] = device_peak(self.job.device, lambda path=path: trainer.save_checkpoint(path))


class LoadProbe(pl.Callback):
    """In the resumed run: the state right after the load (before its first step) and the load's peak memory."""

    def __init__(self, job: Rank) -> None:
        self.job, self.state, self.peak, self.losses = job, {}, None, []

    def on_fit_start(self, trainer, pl_module):  # after set-up, before the checkpoint is restored
        if self.job.cuda:
            torch.cuda.synchronize(self.job.device)
            torch.cuda.reset_peak_memory_stats(self.job.device)
            self.base = torch.cuda.memory_allocated(self.job.device)

    def on_train_start(self, trainer, pl_module):
        self.state = local_state(pl_module, trainer.optimizers[0])
        if self.job.cuda:
            self.peak = torch.cuda.max_memory_allocated(self.job.device) - self.base

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def tp_zero1_checkpoints(job: Rank) -> dict:
    """``zero=1`` on the mesh: RESUME_AT steps, a consolidated and a sharded save, each resumed into a zeroed run for one step."""
    spec = job.spec
    cfg = LlamaConfig.preset(spec["preset"])
    root = job.out / "tp_zero1_checkpoints"
    paths = {fmt: root / f"{fmt}.ckpt" for fmt in ("consolidated", "sharded")}
    saver = SaveAtEnd(job, paths)
    trainer = job.trainer(
        root / "first", precision="32-true", max_steps=RESUME_AT, callbacks=[saver],
        tensor_parallel_size=TP, zero=1, checkpoint_format="consolidated",
    )  # fmt: skip
    trainer.fit(
        TPLlama(spec["preset"], spec["init"], "adamw"),
        datamodule=MeshData(RESUME_AT + 1, cfg.vocab, spec["capacity"]),
    )
    out: dict[str, Any] = {"state": state_sizes(saver.saved), "saves": {}}
    zeros = {k: torch.zeros_like(v) for k, v in spec["init"].items()}  # the resumed runs start from zeros
    for fmt, path in paths.items():
        probe = LoadProbe(job)
        trainer = job.trainer(
            root / f"resumed_{fmt}", precision="32-true", max_steps=RESUME_AT + 1, callbacks=[probe],
            tensor_parallel_size=TP, zero=1, checkpoint_format=fmt,
        )  # fmt: skip
        data = MeshData(RESUME_AT + 1, cfg.vocab, spec["capacity"])
        trainer.fit(TPLlama(spec["preset"], zeros, "adamw"), datamodule=data, ckpt_path=path)
        out["saves"][fmt] = {
            "save_peak_bytes": saver.peaks[fmt], "load_peak_bytes": probe.peak,
            "sharded_folder": path.is_dir(), **compare_states(saver.saved, probe.state),
            "resumed_losses": probe.losses,
        }  # fmt: skip
    return out


def tp_allreduce_count(job: Rank) -> dict:
    """All-reduces of one forward and one backward of the reference Llama sharded by ``parallelize_llama``, 1 and 2 blocks."""
    from torch.distributed.tensor.debug import CommDebugMode

    from lightning_bytescale.parallel import ParallelDims, parallelize_llama

    pmesh = ParallelDims(job.world, tensor_parallel=TP).build(job.device.type)

    def all_reduces(mode: CommDebugMode) -> int:
        return sum(
            n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op)
        )

    counts = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig.preset(job.spec["preset"], layers=layers, tie_embeddings=False)).to(
            job.device
        )
        parallelize_llama(model, pmesh.tp_mesh)
        ids = torch.randint(0, model.config.vocab, (64,), generator=torch.Generator().manual_seed(3)).to(
            job.device
        )
        with CommDebugMode() as forward:
            logits = model(ids)
        with CommDebugMode() as backward:
            logits.float().sum().backward()
        counts[layers] = {"forward": all_reduces(forward), "backward": all_reduces(backward)}
    return {"mesh": list(pmesh.mesh.mesh.shape), "counts": counts, "backend": str(dist.get_backend())}


JOBS: dict[str, Callable[[Rank], dict]] = {
    "tp_bf16": tp_bf16,
    "tp_float64": tp_float64,
    "pipelines": pipelines,
    "fsdp2_tp": fsdp2_tp,
    "tp_zero1_checkpoints": tp_zero1_checkpoints,
    "tp_allreduce_count": tp_allreduce_count,
}


def _forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches, which hold the meshes (and groups) of the job before."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # torch private
    fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if fast_path is not None:
        fast_path()


def rank_main(rank: int, world: int, port: int, out: str, jobs: list[str], spec: dict[str, Any]) -> None:
    """One rank: the jobs in order, each with a process group of its own; ``<job>.rank<r>.json`` after each."""
    job = Rank(rank, world, Path(out), spec)
    if job.cuda:
        torch.cuda.set_device(job.device)
    else:
        torch.set_num_threads(1)
    # the ranks as an external launch (torchrun's variables): the Trainer starts no process
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    wait = timedelta(seconds=spec["timeout_s"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=wait)
    for i, name in enumerate(jobs):
        if rank == 0:
            store.set(f"go/{i}", "run" if time.time() < spec["deadline"] else "budget")
        store.wait([f"go/{i}"], wait)
        if store.get(f"go/{i}").decode() != "run":
            return  # the parent records the jobs not started
        t0 = time.perf_counter()
        result: dict[str, Any]
        try:
            dist.init_process_group(
                "nccl" if job.cuda else "gloo", store=dist.PrefixStore(f"job{i}", store), rank=rank,
                world_size=world, timeout=wait, **({"device_id": job.device} if job.cuda else {}),
            )  # fmt: skip
            result = JOBS[name](job)
        except Exception as err:  # recorded; the ranks agree below whether the next job can start
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            _forget_meshes()
        result["seconds"] = time.perf_counter() - t0
        (job.out / f"{name}.rank{rank}.json").write_text(json.dumps(result, default=str))
        store.set(f"done/{i}/{rank}", "error" if "error" in result else "ok")
        store.wait(
            [f"done/{i}/{r}" for r in range(world)], wait
        )  # a rank stuck in a collective stops the run


def finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


__all__ = [
    "JOBS",
    "compare_states",
    "device_peak",
    "finite",
    "flat_peaks",
    "local_state",
    "rank_main",
    "state_sizes",
    "zero_state",
]
