"""ByteScaleStrategy under a real Trainer on CPU (gloo, fork launcher).

Exactness: parameters and logged losses after several steps equal an independent
single-process float64 loop over the same global batches (whole sequences, plain causal
SDPA, no plan, no strategy), for every planner, with ZeRO-1, across a mid-epoch resume, and
across a resume on a smaller world.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_bytescale
from lightning_bytescale import ByteScaleStrategy, token_loss
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = pytest.mark.multiprocess

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


def reference(steps: int, clip: float | None = CLIP) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, whole sequences, float64: the ground truth."""
    torch.manual_seed(INIT_SEED)
    model = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=causal_sdpa).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    losses = []
    for k in range(steps):
        seqs = global_batch(k)
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        total = 0.0
        for s in seqs:
            logits = model(s, torch.arange(len(s)))
            loss = F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n
            loss.backward()
            total += float(loss)
        if clip is not None:
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
        offloader = trainer.strategy._offloader
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


class PoisonedLM(TinyLM):
    """Produces a non-finite loss or gradient for global-batch sequence ``POISON_SEQ`` of step 1."""

    kind = "loss"

    def training_step(self, mb, batch_idx):
        loss = super().training_step(mb, batch_idx)
        if batch_idx == 1 and POISON_SEQ in mb.seq_ids:
            if self.kind == "loss":
                return loss * float("nan")
            loss.register_hook(lambda g: g * float("inf"))
        return loss


POISON_SEQ = 1


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
    os.environ.pop("MASTER_PORT", None)
    callbacks: list[pl.Callback] = [Recorder(out)]
    if ckpt_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ByteScaleStrategy(
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
        precision="64-true",
        max_steps=max_steps,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=bool(ckpt_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=out,
    )
    trainer.fit(
        module or TinyLM(), datamodule=StepDataModule(planner, diverge_rank, offload_ratio), ckpt_path=resume
    )
    return trainer


def read_rows(out: Path, rank: int = 0) -> list[dict]:
    return json.loads((out / f"rows_{rank}.json").read_text())


def assert_params_equal(out: Path, world: int, expected: dict[str, torch.Tensor]) -> None:
    for r in range(world):
        got = torch.load(out / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            err = (got[k] - v).abs().max().item()
            assert err <= 1e-10, f"rank {r} parameter {k} differs from the single-process run by {err:.3e}"


# ----------------------------------------------------------------------------- tests
def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, start in (("bytescale", "popen"), ("bytescale_spawn", "spawn"), ("bytescale_fork", "fork")):
        assert StrategyRegistry[name]["strategy"] is ByteScaleStrategy
        assert StrategyRegistry[name]["init_params"] == {"start_method": start}
    trainer = pl.Trainer(strategy="bytescale_fork", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ByteScaleStrategy)
    assert lightning_bytescale.ByteScaleStrategy is ByteScaleStrategy


def test_options_validated():
    with pytest.raises(ValueError, match="planner must be one of"):
        ByteScaleStrategy(planner="fast")
    with pytest.raises(ValueError, match="capacity"):
        ByteScaleStrategy(capacity=0)
    with pytest.raises(ValueError, match="DistributedDataParallel options"):
        ByteScaleStrategy(find_unused_parameters=True)
    with pytest.raises(ValueError, match="ranks_per_node must be a positive integer"):
        ByteScaleStrategy(ranks_per_node=0)
    with pytest.raises(ValueError, match="comm_aware must be True or False"):
        ByteScaleStrategy(comm_aware="no")
    with pytest.raises(ValueError, match=r"cost_model file .*missing.json' does not exist; write one with"):
        ByteScaleStrategy(cost_model="missing.json")
    s = ByteScaleStrategy(planner="static", capacity=128, cp_size=2, timeout=5, seed=3)
    assert s.planner_options() == {
        "planner": "static",
        "capacity": 128,
        "cp_size": 2,
        "offload": False,
        "slack": 0.05,
        "cost_model": None,
        "comm_aware": True,
        "ranks_per_node": None,
        "seed": 3,
        "num_buckets": 8,
        "pipeline_degree": 1,
    }
    assert s.planner_options() == s.planner_config.as_options()
    assert s._timeout.total_seconds() == 5


def test_comm_aware_and_cost_model_file_reach_make_plan(tmp_path):
    """The strategy's comm_aware / ranks_per_node / cost-model file travel through the DataModule's
    planner options into make_plan; every rank computes the same plan (same digest) from them."""
    from types import SimpleNamespace

    from lightning_bytescale import ByteScaleDataModule
    from lightning_bytescale.data.loader import _make_plan
    from lightning_bytescale.planner.cost_model import CostModel

    cost = CostModel.paper_preset().with_(name="from-file")
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"format": "bytescale-profile/1", "cost_model": cost.to_json_dict()}))
    lengths = (700, 40, 30, 300, 12, 90)
    digests = {}
    for aware in (True, False):
        strategy = ByteScaleStrategy(capacity=128, cost_model=str(path), comm_aware=aware, ranks_per_node=2)
        assert strategy.cost_model == cost
        dm = ByteScaleDataModule(num_workers=0)
        dm.trainer = SimpleNamespace(global_rank=0, world_size=8, strategy=strategy)
        opts = dm.planner_options()
        assert opts["comm_aware"] is aware and opts["ranks_per_node"] == 2 and opts["cost_model"] == cost
        plan = _make_plan(lengths, 8, 5, opts)
        assert plan.options["comm_aware"] is aware and plan.options["ranks_per_node"] == 2
        assert plan.options["cost_model"]["name"] == "from-file"
        again = _make_plan(lengths, 8, 5, dict(opts))  # another rank: the same plan
        assert again.digest() == plan.digest()
        assert plan.stats()["exposed_ring_time"] >= 0.0
        digests[aware] = plan.digest()
    assert digests[True] != digests[False]
    own = ByteScaleDataModule(cost_model=path, comm_aware=False, ranks_per_node=4, num_workers=0)
    assert own.planner_options()["comm_aware"] is False and own.planner_options()["cost_model"] == cost


@pytest.mark.parametrize(
    ("planner", "world", "zero1", "offload", "gradient_sync"),
    [
        ("balance", 3, False, False, "bucketed"),
        ("naive", 2, False, False, "bucketed"),
        ("static", 4, False, False, "bucketed"),
        ("balance", 4, True, False, "bucketed"),
        ("balance", 2, False, True, "bucketed"),
        ("balance", 3, False, False, "flat"),
    ],
)
def test_equals_single_process(tmp_path, planner, world, zero1, offload, gradient_sync):
    # small buckets (about 16 KB of float64), so a step has many and the last backward launches some
    fit(
        tmp_path,
        world,
        planner,
        zero1=zero1,
        offload=offload,
        offload_ratio=0.5 if offload else 0.0,
        gradient_sync=gradient_sync,
        bucket_cap_mb=1 / 64,
    )
    expected, losses = reference(5)
    assert_params_equal(tmp_path, world, expected)
    for r in range(world):
        rows = read_rows(tmp_path, r)
        assert [row["step"] for row in rows] == list(range(5))
        for row, want in zip(rows, losses):
            assert abs(row["logged"] - want) <= 1e-12, (row["logged"], want)
            assert abs(row["output"] - want) <= 1e-12
    if offload:  # activations really went through the offloader (bit-identical gradients above)
        assert all(row["offloaded_bytes"] > 0 for r in range(world) for row in read_rows(tmp_path, r))
    stats = read_rows(tmp_path)[-1]["stats"]
    seqs = global_batch(4)
    assert stats["lengths"] == [len(s) for s in seqs]
    assert stats["cp_degrees"][-1] >= 2 and all(1 <= d <= world for d in stats["cp_degrees"])
    if planner == "static":  # every packed sequence is sharded over the whole CP group
        assert set(stats["cp_degrees"]) == {world}
    assert stats["tokens"] == sum(len(s) for s in seqs)
    assert stats["loss_tokens"] == sum(len(s) - 1 for s in seqs)
    assert len(stats["busy_s"]) == world and all(b > 0 for b in stats["busy_s"] if b)
    assert sum(stats["num_micro_batches"]) >= 1 and len(stats["num_micro_batches"]) == world
    assert stats["ring_bytes"] > 0  # the long sequence always runs on a ring
    # measured ring wait: one slot per rank, positive exactly where that rank exchanged ring data
    assert len(stats["ring_wait_s"]) == world
    for sent, wait in zip(stats["ring_bytes_per_rank"], stats["ring_wait_s"]):
        assert (wait > 0) if sent > 0 else (wait == 0)
    # planned exposed ring time: the plan's own figure (recomputed here from the same plan)
    plan = make_plan([len(s) for s in seqs], world, planner, 0)
    assert stats["exposed_ring_planned_s"] == pytest.approx(plan.stats()["exposed_ring_time"], rel=1e-12)
    assert stats["max_over_mean_measured"] >= 1.0 and 0.0 <= stats["bubble_fraction"] < 1.0
    assert stats["step_time_s"] > 0


def test_resume_mid_epoch_same_and_smaller_world(tmp_path):
    expected, losses = reference(6)
    # 2 ranks, stop after 3 of 8 steps, resume on 2 ranks.
    fit(tmp_path / "a", 2, max_steps=3, ckpt_every=3)
    ckpt = next((tmp_path / "a" / "ckpt").glob("*.ckpt"))
    fit(tmp_path / "b", 2, max_steps=6, resume=ckpt)
    assert [row["step"] for row in read_rows(tmp_path / "b")] == [3, 4, 5]
    assert_params_equal(tmp_path / "b", 2, expected)
    # 4 ranks with ZeRO-1, stop after 3, resume on 2 ranks (optimizer state re-partitioned).
    fit(tmp_path / "c", 4, max_steps=3, ckpt_every=3, zero1=True)
    ckpt = next((tmp_path / "c" / "ckpt").glob("*.ckpt"))
    fit(tmp_path / "d", 2, max_steps=6, resume=ckpt, zero1=True)
    rows = read_rows(tmp_path / "d", 1)
    assert [row["step"] for row in rows] == [3, 4, 5]
    assert [row["logged"] for row in rows] == pytest.approx(losses[3:], abs=1e-12)
    assert_params_equal(tmp_path / "d", 2, expected)


def test_divergent_plans_name_the_ranks(tmp_path):
    with pytest.raises(Exception, match=r"ranks \[2\] differ from ranks \[0, 1\]"):
        fit(tmp_path, 3, diverge_rank=2, max_steps=2)


def test_plan_for_another_world_size_rejected(tmp_path):
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ByteScaleStrategy(capacity=CAPACITY, start_method="fork", timeout=30),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        max_steps=1,
    )
    with pytest.raises(Exception, match=r"hold plans made for \[3\] ranks, but the run has 2"):
        trainer.fit(TinyLM(), datamodule=StepDataModule("balance", plan_world=3))


class ManualLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("accumulate", "module", "message"),
    [(2, TinyLM, "accumulate_grad_batches=2"), (1, ManualLM, "needs automatic optimization")],
)
def test_unsupported_trainer_settings_rejected(tmp_path, accumulate, module, message):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ByteScaleStrategy(start_method="fork"),
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    os.environ.pop("MASTER_PORT", None)
    with pytest.raises(Exception, match=message):
        trainer.fit(module(), datamodule=StepDataModule("balance"))


@pytest.mark.parametrize("kind", ["loss", "gradient"])
def test_non_finite_names_micro_batch_and_sequences(tmp_path, kind):
    module = PoisonedLM()
    module.kind = kind
    what = (
        "non-finite loss in micro-batch" if kind == "loss" else "gradients first non-finite after micro-batch"
    )
    pattern = rf"Non-finite values at step 1.*rank \d: {what} \d+ \(sequences \[[\d, ]*\b{POISON_SEQ}\b"
    with pytest.raises(Exception, match=pattern):
        fit(tmp_path, 2, module=module, max_steps=3)


def test_ranks_without_micro_batches(tmp_path, monkeypatch):
    """Global batches of one or two short sequences: most ranks have no work and still join
    the one all-reduce; parameters still equal the single-process run."""
    this = __import__(__name__)

    def tiny_batch(step: int, seed: int = 0) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(500 + step)
        return [
            torch.randint(0, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
            for _ in range(1 + step % 2)
        ]

    monkeypatch.setattr(this, "global_batch", tiny_batch)
    fit(tmp_path, 4, "balance", max_steps=4)
    expected, losses = reference(4)
    assert_params_equal(tmp_path, 4, expected)
    rows = read_rows(tmp_path)
    assert [row["logged"] for row in rows] == pytest.approx(losses, abs=1e-12)
    assert all(sorted(row["stats"]["num_micro_batches"])[0] == 0 for row in rows)


def test_rank_report_round_trip_and_messages():
    from lightning_bytescale.engine.step_checks import (
        SLOT,
        RankReport,
        describe_divergence,
        describe_non_finite,
        digest_key,
    )

    rep = RankReport(
        busy_s=0.25,
        ring_bytes=4096,
        num_micro_batches=3,
        bad_micro_batch=2,
        bad_kind=2,
        bad_seq_ids=(0, 7),
        ring_wait_s=0.125,
    )
    slot = rep.encode()
    assert len(slot) == SLOT
    assert RankReport.decode(slot) == rep
    assert RankReport.decode(RankReport(num_micro_batches=1).encode()).bad_micro_batch is None
    msg = describe_non_finite([RankReport(), rep], step=5)
    assert (
        "step 5" in msg
        and "rank 1: gradients first non-finite after micro-batch 2" in msg
        and "[0, 7]" in msg
    )
    assert "rank 0" not in msg
    a, b = digest_key("abc"), digest_key("abd")
    assert a != b and 0 <= a < 2**60
    msg = describe_divergence([(a, 3), (a, 3), (b, 3), (a, 3)])
    assert "ranks [2] differ from ranks [0, 1, 3]" in msg and "same seed" in msg
