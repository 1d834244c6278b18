"""Mixed precision with ``ByteScaleStrategy(pipeline_parallel_size=2)``: ``"bf16-mixed"`` trains in bfloat16, ``"16-mixed"`` is refused.

Lightning enters the precision plugin's ``train_step_context`` (autocast under ``"bf16-mixed"``)
around ``training_step``; under pipelines the stage's forwards and the loss run inside torch's
schedule, so the strategy enters it there.  A 2-rank gloo Trainer (one pipeline of two stages, a
float32 3-block tiny Llama) trains three steps under ``"bf16-mixed"``: the head's logits must come
out in bfloat16 on the last stage (torch 2.11 also checks them against the dtype the stage declared),
the hidden state between the stages stays float32 (the residual stream of float32 parameters),
the parameters stay float32 and the loss stays finite.  This file is in the torch 2.11
subset (``scripts/compat_torch.sh``).

A float16 ``GradScaler`` (``"16-mixed"``) would need every stage to agree on skipping a step; it
is refused before any rank starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import QUIET, global_batch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

STAGES = 2
CAPACITY = 48
STEPS = 3


class Steps(Dataset):
    """Item ``k``: the pipeline's micro-batches of global batch ``k`` (one pipeline: PP-Balance on one rank)."""

    def __init__(self, pmesh) -> None:
        self.pmesh = pmesh

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, k: int):
        from lightning_bytescale.parallel import build_pipeline_step
        from lightning_bytescale.planner import make_plan

        seqs = global_batch(k)
        lengths = [len(s) for s in seqs]
        plan = make_plan(lengths, world_size=1, capacity=CAPACITY, pipeline_degree=STAGES, seed=k)
        ring_ranks = self.pmesh.ring_ranks
        return build_pipeline_step(plan, 0, seqs.__getitem__, stages=STAGES, step=k, ring_ranks=ring_ranks)


class StagedLM(pl.LightningModule):
    """A float32 tiny Llama replaced by its stage; hooks record the dtypes the stage's forwards produce."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(LlamaConfig.preset("tiny", layers=3, tie_embeddings=False))
        self.dtypes: dict[str, list[str]] = {"stage_out": [], "head": []}

    def configure_model(self) -> None:
        from lightning_bytescale.parallel import LlamaStage

        pipeline = self.device_mesh["pipeline"]
        self.model = LlamaStage(self.model, pipeline.get_local_rank(), pipeline.size())
        self.model.register_forward_hook(lambda m, a, out: self.dtypes["stage_out"].append(str(out.dtype)))
        if self.model.is_last:
            head = self.model.part("head")
            head.register_forward_hook(lambda m, a, out: self.dtypes["head"].append(str(out.dtype)))

    def train_dataloader(self):
        return StatefulDataLoader(Steps(self.trainer.strategy.parallel_mesh), batch_size=None, shuffle=False)

    def training_step(self, mb, batch_idx):
        raise AssertionError("training_step is not called under pipelines")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Report(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_end(self, trainer, pl_module):
        report = {
            "stage": trainer.strategy.parallel_mesh.stage,
            "dtypes": pl_module.dtypes,
            "params": sorted({str(p.dtype) for p in pl_module.parameters()}),
            "losses": self.losses,
        }
        (self.out / f"report_{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bf16_mixed_pipelines_compute_the_logits_in_bfloat16(tmp_path):
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=STAGES, precision="bf16-mixed", max_steps=STEPS, default_root_dir=tmp_path,
        strategy=ByteScaleStrategy(pipeline_parallel_size=STAGES, capacity=CAPACITY, start_method="fork", timeout=120),
        callbacks=[Report(tmp_path)], **QUIET,
    )  # fmt: skip
    trainer.fit(StagedLM())
    reports = {
        r["stage"]: r for r in (json.loads((tmp_path / f"report_{g}.json").read_text()) for g in (0, 1))
    }
    first, last = reports[0], reports[1]
    assert last["dtypes"]["head"] and set(last["dtypes"]["head"]) == {"torch.bfloat16"}, last["dtypes"]
    assert set(last["dtypes"]["stage_out"]) == {"torch.bfloat16"}  # the logits the schedule gets
    assert first["dtypes"]["stage_out"] and set(first["dtypes"]["stage_out"]) == {"torch.float32"}
    for rep in (first, last):
        assert rep["params"] == ["torch.float32"]
        assert len(rep["losses"]) == STEPS and all(0 < x < 10 for x in rep["losses"]), rep["losses"]
    assert first["losses"] == last["losses"]  # the step's loss, broadcast from the last stage


def test_a_float16_grad_scaler_is_refused_before_any_rank_starts(tmp_path):
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=STAGES, plugins=[plugin], max_steps=1, default_root_dir=tmp_path,
        strategy=ByteScaleStrategy(pipeline_parallel_size=STAGES, capacity=CAPACITY, start_method="fork"), **QUIET,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2: a float16 GradScaler.*bf16-mixed"):
        trainer.fit(StagedLM())  # raised here, in this process: no rank was started
