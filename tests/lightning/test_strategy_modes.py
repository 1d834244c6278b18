"""Attention modes under ``Trainer(strategy=ByteScaleStrategy(...))``: the planner's ring, Ulysses and hybrid items.

What a user runs: ``ByteScaleStrategy(cost_model=...)`` with a cost model that names the model's
heads (as ``bytescale-profile`` records them), ``ByteScaleDataModule`` planning every global
batch with ``balance``, which chooses each item's mode by that cost model (``_mode_plans``: links
slow enough that Ulysses and the hybrid layout win somewhere).  The model is the reference Llama
with 4 query and 4 key/value heads over the data module's byte tokens, float64, AdamW with weight
decay, clipping in every step.  The reference is one process on whole sequences (plain causal
SDPA), on the same global batches, read from a data module built the same way.

* 4 ranks (2 a node, from the cost model): four steps, one of which runs ring, Ulysses and hybrid
  items together; the telemetry logs each step's items and bytes per mode, the same on every rank.
* ``tensor_parallel_size=2`` on ``(2, 2)``: the lanes' heads (2 of each) split over the two HDP
  ranks in the Ulysses items the planner chose.

A cost model with another model's heads is refused before any rank starts (or at set-up, for a
model built in ``configure_model``), not at the first attention call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _mode_plans import mode_cost_model, modes_of
from _strategy_helpers import QUIET, datamodule_batches
from test_tensor_parallel_strategy import INIT_SEED, MAX_NORM, TOLERANCE, TPLM, reference_steps
from torch.distributed.tensor import DTensor

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy, TelemetryCallback
from lightning_bytescale.errors import CostModelHeadsError
from lightning_bytescale.lightning.strategy_options import check_cost_model_heads
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.planner import PlannerConfig

STEPS = 4
CONFIG = LlamaConfig.preset("tiny", vocab=257, kv_heads=4, tie_embeddings=False)
MODES = ("ring", "ulysses", "hybrid")
# (world, tensor_parallel_size, capacity per HDP rank, tokens per step, the links' bandwidth, ranks per node)
RUNS = {"dp4": (4, 1, 24, 240, 1e6, 2), "tp2x2": (4, 2, 48, 160, 3e5, 4)}


def _cost(run: str):
    _, tp, _, _, bandwidth, per_node = RUNS[run]
    return mode_cost_model(
        kv_heads=4, vocab=CONFIG.vocab, tensor_parallel=tp, bandwidth_intra=bandwidth, ranks_per_node=per_node
    )


def _strategy(run: str) -> ByteScaleStrategy:
    _, tp, capacity, _, _, _ = RUNS[run]
    return ByteScaleStrategy(
        tensor_parallel_size=tp, capacity=capacity, cost_model=_cost(run), start_method="fork", timeout=120
    )


def _data(cache: Path, run: str) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 80, "scale": 1 / 512},
        cache_dir=cache, tokens_per_step=RUNS[run][3], num_workers=0,
    )  # fmt: skip


class ModesLM(TPLM):
    """``TPLM`` (with a tensor-parallel mesh: sharded in ``configure_model``, the attention's heads
    recorded) over the data module's byte tokens, 4 query and 4 key/value heads."""

    def __init__(self) -> None:
        super().__init__(tied=False)
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(CONFIG)


class Recorder(pl.Callback):
    """Every rank writes per step its logged loss, the modes of its ring micro-batches and the mode
    telemetry, and at the end its (gathered) parameters."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.rows.append(
            {
                "step": batch.step,
                "identity": batch.data_identity,
                "logged": float(metrics["train/loss"]),
                "modes": sorted({mb.layout.mode for mb in batch.micro_batches if mb.layout.ring is not None}),
                "telemetry": {k: float(v) for k, v in metrics.items() if k.startswith("comm/mode_")},
            }
        )

    def on_train_end(self, trainer, pl_module):
        full = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in pl_module.state_dict().items()
        }
        r = trainer.global_rank
        report = {"rows": self.rows, "heads_seen": sorted(pl_module.heads_seen)}
        (self.out / f"report_{r}.json").write_text(json.dumps(report))
        torch.save(full, self.out / f"params_{r}.pt")


def _fit_and_check(tmp_path: Path, run: str) -> tuple[list, list[dict]]:
    world = RUNS[run][0]
    cache = tmp_path / "cache"
    _data(cache, run).prepare_data()  # the store, before the ranks start
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=_strategy(run), precision="64-true", default_root_dir=tmp_path,
        max_steps=STEPS, gradient_clip_val=MAX_NORM, limit_val_batches=0,
        callbacks=[TelemetryCallback(charts_every_n_steps=0), Recorder(tmp_path)], **QUIET,
    )  # fmt: skip
    trainer.fit(ModesLM(), datamodule=_data(cache, run))

    batches, identities, plans = datamodule_batches(_strategy(run), _data(cache, run), world, STEPS)
    model, losses, norms = reference_steps(CONFIG, batches)
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert min(norms) > MAX_NORM, "clipping must act in every step"
    reports = [json.loads((tmp_path / f"report_{r}.json").read_text()) for r in range(world)]
    worst_param = worst_loss = 0.0
    for r, rep in enumerate(reports):
        assert [row["identity"] for row in rep["rows"]] == identities, (
            f"rank {r} trained other global batches"
        )
        for k, row in enumerate(rep["rows"]):
            worst_loss = max(worst_loss, abs(row["logged"] - losses[k]))
            stats = plans[k].mode_stats()
            for mode in MODES:  # the plan's figures, the same on every rank
                assert row["telemetry"][f"comm/mode_counts/{mode}"] == stats["mode_counts"][mode], (
                    r,
                    k,
                    mode,
                )
                assert row["telemetry"][f"comm/mode_bytes_planned/{mode}"] == stats["comm_bytes"][mode]
        got = torch.load(tmp_path / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
    print(f"\n{run} with modes {[dict(modes_of(p)) for p in plans]}: max parameter difference "
          f"{worst_param:.3e}, loss {worst_loss:.3e}")  # fmt: skip
    assert worst_param <= TOLERANCE and worst_loss <= TOLERANCE, (worst_param, worst_loss)
    return plans, reports


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_ring_ulysses_and_hybrid_items_in_one_step_equal_one_process(tmp_path):
    plans, reports = _fit_and_check(tmp_path, "dp4")
    per_step = [{mode for mode, _ in modes_of(plan)} for plan in plans]
    assert set(MODES) in per_step, per_step  # one step runs every mode
    for k, plan in enumerate(plans):  # every rank ran the modes of its own items in the plan
        for r, rep in enumerate(reports):
            want = sorted({mb.mode for mb in plan.ranks[r] if mb.ring is not None})
            assert rep["rows"][k]["modes"] == want, (k, r)


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_tensor_parallel_lanes_run_ulysses_items_on_their_heads_equal_one_process(tmp_path):
    plans, reports = _fit_and_check(tmp_path, "tp2x2")
    assert any(mode == "ulysses" for plan in plans for mode, _ in modes_of(plan)), [
        modes_of(p) for p in plans
    ]
    assert any(mode == "ring" for plan in plans for mode, _ in modes_of(plan))
    assert all(rep["heads_seen"] == [[2, 2]] for rep in reports)  # a lane's heads reach the attention


# ----------------------------------------------------------------------------- the heads check
class _BuiltLater(pl.LightningModule):
    """A module that builds its model in ``configure_model`` (as ``HFCausalLM`` does)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config_ = config
        self.model: LlamaModel | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = LlamaModel(self.config_)

    def training_step(self, mb, batch_idx):  # pragma: no cover - refused before the first step
        raise AssertionError("the heads check must refuse the run before its first step")

    def train_dataloader(self):
        return [0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_cost_model_with_other_heads_is_refused_before_any_rank_starts(tmp_path):
    gqa = LlamaConfig.preset("tiny", vocab=257)  # 4 query heads, 2 key/value heads
    strategy = ByteScaleStrategy(capacity=24, cost_model=_cost("dp4"), start_method="fork")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, default_root_dir=tmp_path, **QUIET)
    module = _BuiltLater(gqa)
    module.configure_model()
    with pytest.raises(
        CostModelHeadsError, match=r"kv_heads=4, but the model has 4 query and 2 key/value heads"
    ):
        trainer.fit(module)  # before the fork: no rank started, no data asked for


def test_a_cost_model_with_other_heads_is_refused_at_set_up_for_a_model_built_in_configure_model(tmp_path):
    import torch.distributed as dist

    strategy = ByteScaleStrategy(capacity=24, cost_model=_cost("dp4"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, default_root_dir=tmp_path, **QUIET)
    had_group = dist.is_initialized()
    try:
        with pytest.raises(CostModelHeadsError, match=r"give the cost model attention_heads=4, kv_heads=2"):
            trainer.fit(_BuiltLater(LlamaConfig.preset("tiny", vocab=257)))
    finally:  # one process: the strategy's group of one is this process's
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()


def test_the_heads_check_reads_lanes_and_leaves_what_it_cannot_judge():
    mha, gqa = LlamaModel(CONFIG), LlamaModel(LlamaConfig.preset("tiny", vocab=257))
    one, lanes = PlannerConfig(cost_model=_cost("dp4")), PlannerConfig(cost_model=_cost("tp2x2"))
    check_cost_model_heads(one, mha, 1)
    check_cost_model_heads(lanes, mha, 2)  # (2, 2): one lane's heads
    with pytest.raises(CostModelHeadsError, match=r"one lane of tensor_parallel_size=2 holds 2 and 1"):
        check_cost_model_heads(lanes, gqa, 2)
    with pytest.raises(
        CostModelHeadsError,
        match=r"plan rings only \(ByteScaleStrategy\(options=\{'modes': \('ring',\)\}\)\)",
    ):
        check_cost_model_heads(one, gqa, 1)
    ring_only = PlannerConfig(cost_model=_cost("dp4"), options={"modes": ("ring",)})
    check_cost_model_heads(ring_only, gqa, 1)  # rings only: the heads plan nothing
    check_cost_model_heads(
        PlannerConfig(cost_model=_cost("dp4").with_(attention_heads=None, kv_heads=None)), gqa, 1
    )
    check_cost_model_heads(PlannerConfig(), gqa, 1)  # the paper preset names no heads
    check_cost_model_heads(one, torch.nn.Linear(2, 2), 1)  # heads not readable: nothing to compare
