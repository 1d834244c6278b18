"""The strategy tests' shared pieces: global batches, plans, ``TinyLM``, the reference, a run.

``reference`` is an independent single-process float64 loop over the same global batches
(whole sequences, plain causal SDPA, no plan, no strategy); ``fit`` trains ``TinyLM`` under
``ByteScaleStrategy`` (fork launcher) with a ``Recorder`` that writes what each rank saw.
Tests and the scripts they start import this module (``tests/`` is on ``sys.path``); tests
that change ``global_batch`` or ``make_plan`` patch them here, where ``fit`` looks them up.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale import ByteScaleStrategy, token_loss
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

CAPACITY = 24
STEPS_PER_EPOCH = 8
LR = 0.05
CLIP = 0.5
INIT_SEED = 1234


# ----------------------------------------------------------------------------- data
def global_batch(step: int, seed: int = 0) -> list[torch.Tensor]:
    """The sequences of global batch ``step``: a long tail (some need a ring at CAPACITY)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    n_short = int(torch.randint(3, 7, (1,), generator=g))
    lengths = torch.randint(3, CAPACITY, (n_short,), generator=g).tolist()
    lengths.append(int(torch.randint(CAPACITY + 1, 2 * CAPACITY, (1,), generator=g)))
    return [torch.randint(0, 64, (s,), generator=g) for s in lengths]


def _stand_in_plan(lengths: list[int], world: int, capacity: int) -> Plan:
    """A valid plan: long sequences on zigzag rings, short ones best-fit on the least loaded rank."""
    ranks: list[list[MicroBatch]] = [[] for _ in range(world)]
    load = [0.0] * world
    item = 0
    for seq in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        s = lengths[seq]
        if s > capacity and world > 1:
            n = min(world, math.ceil(s / capacity))
            ring = tuple(sorted(sorted(range(world), key=lambda r: (load[r], r))[:n]))
            for member, r in enumerate(ring):
                piece = Piece(seq, tuple(zigzag.member_ranges(s, n, member)))
                ranks[r].append(MicroBatch([piece], ring=ring, item=item))
                load[r] += s * s / n
            item += 1
            continue
        r = min(range(world), key=lambda r: (load[r], r))
        last = next((mb for mb in reversed(ranks[r]) if mb.ring is None), None)
        if last is not None and last.num_tokens + s <= capacity:
            last.pieces.append(Piece(seq, ((0, s),)))
        else:
            ranks[r].append(MicroBatch([Piece(seq, ((0, s),))]))
        load[r] += s * s
    return Plan(world_size=world, capacity=capacity, planner="stand-in", lengths=tuple(lengths), ranks=ranks)


def make_plan(lengths: list[int], world: int, planner: str, seed: int):
    """The project's planner when present, else a small stand-in."""
    try:
        from lightning_bytescale.planner import make_plan as project_make_plan
    except ImportError:
        return _stand_in_plan(lengths, world, CAPACITY)
    opts = {"cp_size": world} if planner == "static" else {}
    return project_make_plan(
        tuple(lengths), world_size=world, seed=seed, planner=planner, capacity=CAPACITY, **opts
    )


class StepData(Dataset):
    """Item ``k``: this rank's StepBatch of global batch ``k`` (planned for the current world)."""

    def __init__(self, world: int, rank: int, planner: str, seed: int = 0, plan_seed: int = 0) -> None:
        self.world, self.rank, self.planner, self.seed, self.plan_seed = world, rank, planner, seed, plan_seed
        self.offload_ratio = 0.0

    def __len__(self) -> int:
        return STEPS_PER_EPOCH

    def __getitem__(self, k: int):
        seqs = global_batch(k, self.seed)
        plan = make_plan([len(s) for s in seqs], self.world, self.planner, self.plan_seed)
        batch = build_step(plan, self.rank, lambda j: seqs[j], step=k)
        for mb in batch.micro_batches:
            mb.offload_ratio = self.offload_ratio
        return batch


class StepDataModule(pl.LightningDataModule):
    def __init__(
        self,
        planner: str,
        diverge_rank: int | None = None,
        offload_ratio: float = 0.0,
        plan_world: int | None = None,
    ) -> None:
        super().__init__()
        self.planner, self.diverge_rank, self.offload_ratio = planner, diverge_rank, offload_ratio
        self.plan_world = plan_world

    def train_dataloader(self):
        t = self.trainer
        plan_seed = 1 if t.global_rank == self.diverge_rank else 0
        data = StepData(t.world_size, t.global_rank, self.planner, plan_seed=plan_seed)
        if plan_seed:  # a divergent rank: same lengths, a different plan
            data.__class__ = _ReversedPlanData
        data.offload_ratio = self.offload_ratio
        if self.plan_world:  # plans made for another world size
            data.world = self.plan_world
        return StatefulDataLoader(data, batch_size=None, shuffle=False, num_workers=0)


class _ReversedPlanData(StepData):
    """Plans with the ranks' roles permuted: a valid plan that differs from the other ranks'."""

    def __getitem__(self, k: int):
        seqs = global_batch(k, self.seed)
        plan = make_plan([len(s) for s in seqs], self.world, self.planner, self.plan_seed)
        plan.ranks = plan.ranks[::-1]
        plan.ranks = [[_rename(mb, self.world) for mb in mbs] for mbs in plan.ranks]
        return build_step(plan, self.rank, lambda j: seqs[j], step=k)


def _rename(mb: MicroBatch, world: int) -> MicroBatch:
    if mb.ring is None:
        return mb
    return MicroBatch(mb.pieces, ring=tuple(world - 1 - r for r in mb.ring), item=mb.item)


# ----------------------------------------------------------------------------- model
class TinyLM(pl.LightningModule):
    """The documented user contract: packed micro-batch in, token_loss out."""

    def __init__(self, scheduler: bool = True) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(LlamaConfig.preset("tiny"))
        self.scheduler = scheduler

    def training_step(self, mb, batch_idx):
        logits = self.model(mb.input_ids, mb.position_ids)
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def reference(
    steps: int,
    clip: float | None = CLIP,
    *,
    initial: dict[str, torch.Tensor] | None = None,
    clip_grads: Callable[[list[torch.nn.Parameter]], None] | None = None,
    config: LlamaConfig | None = None,
    batches: Callable[[int], list[torch.Tensor]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, whole sequences, float64: the ground truth.

    ``initial``: start from these weights (a state dict of ``TinyLM``) instead of ``INIT_SEED``'s;
    ``clip_grads(params)``: clip this way instead of by the norm ``clip``; ``config``: the model's
    shape (default the ``tiny`` preset); ``batches(k)``: the sequences of global batch ``k`` (default ``global_batch``).
    """
    torch.manual_seed(INIT_SEED)
    model = LlamaModel(config or LlamaConfig.preset("tiny"), attention_fn=causal_sdpa).double()
    if initial is not None:
        model.load_state_dict({k.removeprefix("model."): v.double() for k, v in initial.items()})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    losses = []
    for k in range(steps):
        seqs = (batches or global_batch)(k)  # looked up now: tests may replace global_batch
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        total = 0.0
        for s in seqs:
            logits = model(s, torch.arange(len(s)))
            loss = F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n
            loss.backward()
            total += float(loss)
        if clip_grads is not None:
            clip_grads(list(model.parameters()))
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        losses.append(total)
    return {f"model.{k}": v for k, v in model.state_dict().items()}, losses


# ----------------------------------------------------------------------------- runs
class Recorder(pl.Callback):
    """Every rank writes what it saw (logged loss, step stats, batch steps, final params)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = dict(trainer.strategy.step_stats)
        offloader = trainer.strategy.offloader
        self.rows.append(
            {
                "offloaded_bytes": offloader.stats.offloaded_bytes if offloader is not None else 0,
                "step": batch.step,
                "logged": float(trainer.callback_metrics["train/loss"]),
                "output": float(outputs["loss"]),
                "stats": stats,
            }
        )

    def on_train_end(self, trainer, pl_module):
        r = trainer.global_rank
        (self.out / f"rows_{r}.json").write_text(json.dumps(self.rows))
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out / f"params_{r}.pt"
        )


# ----------------------------------------------------------------------------- trainer
QUIET: dict = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
}
"""Trainer options that keep a test's Trainer silent and out of the way (no logs, bars, sampler)."""


def quiet_trainer(out: Path, world: int, strategy, **options) -> pl.Trainer:
    """A float64 CPU Trainer on ``world`` ranks writing under ``out``; ``options`` override the defaults."""
    os.environ.pop("MASTER_PORT", None)  # a port left by an earlier launcher in this process
    defaults = {"accelerator": "cpu", "precision": "64-true", "default_root_dir": out, **QUIET}
    return pl.Trainer(devices=world, strategy=strategy, **{**defaults, **options})


@contextlib.contextmanager
def in_this_process():
    """A one-device ``trainer.fit`` in the test's own process, leaving no process group behind.

    One device runs no launcher: the strategy joins a process group in this very process, which
    the next test would find (and reuse with the wrong world) unless it is destroyed here.
    """
    had_group = torch.distributed.is_initialized()
    try:
        yield
    finally:
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def step_checkpoints(out: Path, every: int | None) -> list[pl.Callback]:
    """A ModelCheckpoint keeping every ``every``-th step under ``out/ckpt`` (none for ``None`` or 0)."""
    if not every:
        return []
    return [pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=every, save_top_k=-1)]


def fit(
    out: Path,
    world: int,
    planner: str = "balance",
    *,
    max_steps: int = 5,
    zero1: bool = False,
    ckpt_every: int | None = None,
    resume: Path | None = None,
    diverge_rank: int | None = None,
    timeout: float = 60,
    module: pl.LightningModule | None = None,
    offload: bool = False,
    offload_ratio: float = 0.0,
    gradient_sync: str = "bucketed",
    bucket_cap_mb: float = 25.0,
) -> pl.Trainer:
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[pl.Callback] = [Recorder(out), *step_checkpoints(out, ckpt_every)]
    trainer = quiet_trainer(
        out,
        world,
        ByteScaleStrategy(
            planner=planner,
            capacity=CAPACITY,
            zero1=zero1,
            start_method="fork",
            timeout=timeout,
            offload=bool(offload),
            offloader_options={"keep_last": 0, "min_bytes": 0} if offload else None,
            gradient_sync=gradient_sync,
            bucket_cap_mb=bucket_cap_mb,
        ),
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        enable_checkpointing=bool(ckpt_every),
        callbacks=callbacks,
    )
    trainer.fit(
        module or TinyLM(), datamodule=StepDataModule(planner, diverge_rank, offload_ratio), ckpt_path=resume
    )
    return trainer


def datamodule_batches(
    strategy: ByteScaleStrategy, data, world: int, steps: int
) -> tuple[list, list[str], list]:
    """The first ``steps`` global batches of a run's ``ByteScaleDataModule`` as its HDP rank 0 (lane 0)
    plans them under ``strategy`` on ``world`` ranks: the sequences, their data identities, the plans."""
    from types import SimpleNamespace

    from lightning_bytescale.parallel import ParallelDims

    if strategy.tensor_parallel_size > 1:
        dims = ParallelDims(world, tensor_parallel=strategy.tensor_parallel_size)
        strategy.parallel_mesh = SimpleNamespace(dims=dims, hdp_rank=0, lane=0, ring_ranks=dims.lane_ranks(0))
    data.trainer = SimpleNamespace(global_rank=0, world_size=world, strategy=strategy, overfit_batches=0)
    data.setup("fit")
    dataset = data.train_dataloader().dataset
    batches, identities, plans = [], [], []
    for k in range(steps):
        ids = dataset.sample_ids(0, k)
        batches.append([torch.as_tensor(dataset.tokens(int(i)), dtype=torch.long) for i in ids])
        identities.append(dataset.data_identity(ids))
        plans.append(dataset.plan(0, k))
    return batches, identities, plans


def read_rows(out: Path, rank: int = 0) -> list[dict]:
    return json.loads((out / f"rows_{rank}.json").read_text())


def assert_params_equal(out: Path, world: int, expected: dict[str, torch.Tensor]) -> None:
    for r in range(world):
        got = torch.load(out / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            err = (got[k] - v).abs().max().item()
            assert err <= 1e-10, f"rank {r} parameter {k} differs from the single-process run by {err:.3e}"
