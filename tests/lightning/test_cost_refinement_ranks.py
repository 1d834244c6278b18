"""Two gloo ranks refine the cost model from the same step data: each times only its own
micro-batches, the times travel in the step's one all-reduce (``sync_step``'s ``extra``), and both
ranks compute the same refined models, bit for bit (one run of two ranks, a few seconds); and a
Trainer run on two ranks whose refined model re-plans steps trains exactly the one-process reference."""

from __future__ import annotations

import json
import math
import os
import random
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _ranks import free_port, init_gloo, run_ranks
from _strategy_helpers import QUIET
from test_tensor_parallel_strategy import INIT_SEED, LR, MAX_NORM, TOLERANCE, reference_steps

# imported before the fork: the ranks inherit them instead of importing Lightning twice
from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy, token_loss
from lightning_bytescale.engine.executor import LocalResult, MicroBatchResult, sync_step
from lightning_bytescale.engine.micro_batch import step_digest
from lightning_bytescale.lightning.cost_refinement import CostRefinement
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.cost_features import Work, plan_work, plan_work_rows, predict_seconds
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import RefitConfig

pytestmark = pytest.mark.multiprocess
WORLD = 2
STEPS = 10


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    try:
        base = CostModel.paper_preset()
        true = base.with_(a=base.a * 40, b=base.b * 25, g=1e-4)
        noise = random.Random(100 + rank)  # each rank's own measurements: no rank knows the other's
        refinement = CostRefinement(base, RefitConfig(lag=1, max_change=4.0), rank)
        lengths = random.Random(7)
        states, stats = [], []
        for k in range(STEPS):
            batch_lengths = [lengths.randint(16, 900) for _ in range(14)]
            plan = make_plan(
                batch_lengths, world_size=WORLD, capacity=1024, cost_model=refinement.refit.model_for_step(k)
            )
            batch = types.SimpleNamespace(
                stats={"cost_work": plan_work_rows(plan), "plan_index": k}, step=k, num_global_tokens=0
            )
            mine = [predict_seconds(true, w) * math.exp(noise.gauss(0, 0.05)) for w in plan_work(plan)[rank]]
            local = LocalResult(
                loss=torch.zeros((), dtype=torch.float64), loss_tokens=0,
                micro_batches=[MicroBatchResult(i, 0.0, 0, s, 1) for i, s in enumerate(mine)],
            )  # fmt: skip
            result = sync_step([], batch, local, extra=refinement.extra(batch, local), check_tokens=False)
            stats.append(refinement.observe(batch, result))
            states.append(json.dumps(refinement.state_dict(), sort_keys=True))
        refinement.close()
        (Path(out) / f"rank{rank}.json").write_text(json.dumps({"states": states, "stats": stats}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_identical_refined_models_from_the_step_data(tmp_path):
    run_ranks(_rank, WORLD, free_port(), str(tmp_path), timeout_s=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert (
        r0["states"] == r1["states"]
    )  # every version and window sample, floats exact (JSON repr round-trips)
    assert r0["stats"] == r1["stats"]
    rows = r0["stats"][-1]["cost_fit_rows"]
    assert {r for r, *_ in rows} == {0, 1}  # both ranks' times, on both ranks
    reports = [s["cost_fit_report"] for s in r0["stats"]]
    assert sum(r["updated"] for r in reports) >= STEPS - 4
    assert r0["stats"][-1]["cost_error"]["median"] < 0.15 < r0["stats"][0]["cost_error"]["median"]


# ----------------------------------------------------------------------------- exactness
# A Trainer run on 2 forked ranks, float64, refining from timings of a "machine" far from the paper
# preset (so the refined model re-plans steps): the plans change, what is trained does not.
EXACT_STEPS = 8
EXACT_CONFIG = LlamaConfig.preset("tiny", vocab=257)
MACHINE = CostModel.paper_preset().with_(a=2e-7, b=1e-6, g=3e-4)


def _machine_seconds(self, local, works):
    """Deterministic timings of ``MACHINE``, a function of the features only (no wall time)."""
    return [predict_seconds(MACHINE, Work.from_row(row)) for row in works]


class _ExactLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(EXACT_CONFIG)

    def training_step(self, mb, batch_idx):
        return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


class _Rows(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.step_stats
        self.rows.append(
            {
                "identity": batch.data_identity,
                "digest": batch.digest,
                "logged": float(trainer.callback_metrics["train/loss"]),
                "coefficients": stats["cost_coefficients"],
                "report": stats.get("cost_fit_report"),
            }
        )

    def on_train_end(self, trainer, pl_module):
        r = trainer.global_rank
        (self.out / f"rows_{r}.json").write_text(json.dumps(self.rows))
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out / f"params_{r}.pt"
        )


def _exact_data(cache: Path) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 80, "scale": 1 / 512},
        cache_dir=cache, tokens_per_step=240, num_workers=0,
    )  # fmt: skip


def _exact_strategy(refine: bool) -> ByteScaleStrategy:
    return ByteScaleStrategy(
        capacity=24, cost_model="paper", refine_cost_model=refine, start_method="fork", timeout=60
    )


def _run_batches(
    strategy: ByteScaleStrategy, data: ByteScaleDataModule, steps: int
) -> tuple[list, list, list]:
    """The run's first ``steps`` global batches over epochs as rank 0 plans them under ``strategy``:
    the sequences, their data identities, the plans."""
    data.trainer = types.SimpleNamespace(
        global_rank=0, world_size=WORLD, strategy=strategy, overfit_batches=0
    )
    data.setup("fit")
    dataset = data.train_dataloader().dataset
    batches, identities, plans = [], [], []
    epoch = step = 0
    for _ in range(steps):
        if step == dataset.batching.num_steps(epoch):
            epoch, step = epoch + 1, 0
        ids = dataset.sample_ids(epoch, step)
        batches.append([torch.as_tensor(dataset.tokens(int(i)), dtype=torch.long) for i in ids])
        identities.append(dataset.data_identity(ids))
        plans.append(dataset.plan(epoch, step))
        step += 1
    return batches, identities, plans


@pytest.mark.timeout(300)
def test_refined_plans_train_exactly_the_one_process_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(CostRefinement, "local_seconds", _machine_seconds)  # inherited by the forked ranks
    cache = tmp_path / "cache"
    _exact_data(cache).prepare_data()
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=_exact_strategy(True), precision="64-true",
        default_root_dir=tmp_path, max_steps=EXACT_STEPS, gradient_clip_val=MAX_NORM, limit_val_batches=0,
        callbacks=[_Rows(tmp_path)], **QUIET,
    )  # fmt: skip
    trainer.fit(_ExactLM(), datamodule=_exact_data(cache))

    # the same global batches (two epochs), planned with the base model, and one process on whole sequences
    batches, identities, plans = _run_batches(_exact_strategy(False), _exact_data(cache), EXACT_STEPS)
    model, losses, norms = reference_steps(EXACT_CONFIG, batches)
    assert min(norms) > MAX_NORM, "clipping must act in every step"
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    rows = [json.loads((tmp_path / f"rows_{r}.json").read_text()) for r in range(WORLD)]
    # every rank switched models at the same steps (the same coefficients, the same plan digests)
    assert rows[0] == rows[1]
    steps = rows[0]
    assert [row["identity"] for row in steps] == identities
    base = [step_digest(p, i) for p, i in zip(plans, identities)]
    changed = [k for k, row in enumerate(steps) if row["digest"] != base[k]]
    assert changed, "the refined model must re-plan some step, else this test proves nothing"
    assert all(row["digest"] == base[k] for k, row in enumerate(steps[:2]))  # before the first refit applies
    assert any(row["report"] and row["report"]["updated"] for row in steps)
    worst_loss = max(abs(row["logged"] - want) for row, want in zip(steps, losses))
    worst_param = 0.0
    for r in range(WORLD):
        got = torch.load(tmp_path / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
    assert worst_param <= TOLERANCE and worst_loss <= TOLERANCE, (changed, worst_param, worst_loss)
