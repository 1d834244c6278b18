"""The conformance suite's pieces: data, one LightningModule for both sides, the runs, the feature table.

Every feature a Lightning user relies on runs on 2 CPU ranks under ``ByteScaleStrategy`` (fork
launcher, float64 where values are compared) and, where one process is what users expect, in a
single process with Lightning's default strategy on the *same global batches*: the reference
side's ``training_step`` gets the whole global batch (a list of sequences) and computes the
loss with plain causal SDPA (``tests/_strategy_helpers.causal_sdpa``), no plan, no strategy.
``ContractModule`` holds the hooks, logging and collectives both sides share; each run writes
what every rank saw to JSON (``record``) and, where asked, its gradients (``grads_<rank>.pt``).

:data:`FEATURES` is the contract, one row per feature: what a user gets ("works") or why it is
refused and what to do instead, and the test that proves it.  ``docs/strategy.md`` holds the
table rendered from it (``python tests/lightning/_contract.py --write-docs`` writes it;
``test_conformance.py::test_the_docs_table_is_the_suite`` fails when the two differ).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from _strategy_helpers import CAPACITY, INIT_SEED, LR, causal_sdpa, global_batch, make_plan  # noqa: E402

from lightning_bytescale import ByteScaleStrategy, token_loss  # noqa: E402
from lightning_bytescale.engine.loss import IGNORE_INDEX  # noqa: E402
from lightning_bytescale.engine.micro_batch import build_step  # noqa: E402
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel  # noqa: E402

WORLD = 2
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2, "predict": 3}
TIMEOUT_S = 30  # process-group timeout: a collective that would hang fails within it instead
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "strategy.md"
BEGIN, END = "<!-- contract:begin -->", "<!-- contract:end -->"


# ----------------------------------------------------------------------------- data
def sequences(split: str, step: int) -> list[torch.Tensor]:
    """Global batch ``step`` of ``split``: a long tail, one sequence longer than CAPACITY (a ring)."""
    return global_batch(step, SPLIT_SEEDS[split])


class HdpSteps(Dataset):
    """Item ``k``: this rank's StepBatch of global batch ``k`` of ``split``."""

    def __init__(self, split: str, steps: int, world: int, rank: int, batches: Any = None) -> None:
        self.split, self.steps, self.world, self.rank = split, steps, world, rank
        self.batches = batches or sequences

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int):
        seqs = self.batches(self.split, k)
        plan = make_plan([len(s) for s in seqs], self.world, "balance", 0)
        return build_step(plan, self.rank, lambda j: seqs[j], step=k)


class WholeBatches(Dataset):
    """Item ``k``: global batch ``k`` of ``split`` as it is, for one process."""

    def __init__(self, split: str, steps: int, batches: Any = None) -> None:
        self.split, self.steps, self.batches = split, steps, batches or sequences

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> list[torch.Tensor]:
        return self.batches(self.split, k)


class Iterated:
    """A dataset iterated as it is (``trainer.predict`` re-creates every ``DataLoader`` it gets)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __iter__(self):
        return (self.dataset[k] for k in range(len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)


class ContractData(pl.LightningDataModule):
    """The same global batches for both sides: per-rank StepBatches (``hdp``) or whole batches."""

    def __init__(self, hdp: bool, steps: dict[str, int] | None = None, batches: Any = None) -> None:
        super().__init__()
        self.hdp, self.batches = hdp, batches
        self.steps = {"train": 8, "val": 3, "test": 2, "predict": 2, **(steps or {})}

    def _dataset(self, split: str) -> Dataset:
        if self.hdp:
            t = self.trainer
            return HdpSteps(split, self.steps[split], t.world_size, t.global_rank, self.batches)
        return WholeBatches(split, self.steps[split], self.batches)

    def _loader(self, split: str) -> StatefulDataLoader:
        return StatefulDataLoader(self._dataset(split), batch_size=None, shuffle=False, num_workers=0)

    def train_dataloader(self):
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("val")

    def test_dataloader(self):
        return self._loader("test")

    def predict_dataloader(self):
        return Iterated(self._dataset("predict"))


# ----------------------------------------------------------------------------- the module
REFUSED_CALLS = ("all_gather", "reduce", "barrier", "broadcast", "log_sync_dist_on_step")


class ContractModule(pl.LightningModule):
    """The hooks, logging and collectives of the contract, for either side (``hdp``: ByteScale's).

    It records what it sees in ``self.rec`` and writes it to ``out/<tag>_<rank>.json`` at
    ``teardown``; ``record_grads`` also keeps every ``on_after_backward`` gradient.
    """

    def __init__(
        self,
        out: str,
        tag: str,
        *,
        hdp: bool,
        sgd: bool = False,
        zero_grads_in_hook: bool = False,
        record_grads: bool = False,
        probe_collectives: bool = False,
        uncaught_collective: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=None if hdp else causal_sdpa)
        self.out, self.tag, self.hdp, self.sgd = out, tag, hdp, sgd
        self.lr = LR  # what the LR finder sets
        self.zero_grads_in_hook, self.record_grads = zero_grads_in_hook, record_grads
        self.probe_collectives, self.uncaught_collective = probe_collectives, uncaught_collective
        self.val_metric = torchmetrics.SumMetric()  # a torchmetrics.Metric syncs itself at the epoch's end
        self.rec: dict[str, list] = defaultdict(list)
        self.grads: list[dict[str, torch.Tensor | None]] = []
        self.probed: set[str] = set()

    # -- the loss of a batch, both sides
    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, token cross-entropy sum, loss tokens)`` of a micro-batch (HDP) or a whole batch."""
        if self.hdp:
            logits = self.model(batch.input_ids, batch.position_ids)
            loss = token_loss(logits, batch.labels, batch.num_global_tokens)
            return loss, loss * batch.num_global_tokens, (batch.labels != IGNORE_INDEX).sum()
        n = sum(len(s) - 1 for s in batch)
        ce = sum(
            F.cross_entropy(self.model(s, torch.arange(len(s))).double()[:-1], s[1:], reduction="sum")
            for s in batch
        )
        return ce / n, ce, torch.tensor(n)

    def _probe(self, hook: str) -> None:
        """Each collective once inside a micro-batch loop: what happens is recorded (refused or not)."""
        if not self.hdp or hook in self.probed or not torch.is_grad_enabled() and hook == "training_step":
            return
        self.probed.add(hook)
        strategy = self.trainer.strategy
        calls = {
            "all_gather": lambda: self.all_gather(torch.ones(1)),
            "reduce": lambda: strategy.reduce(torch.ones(1), reduce_op="sum"),
            "barrier": lambda: strategy.barrier(),
            "broadcast": lambda: strategy.broadcast(1),
            "log_sync_dist_on_step": lambda: self.log(f"refused/{hook}", 1.0, on_step=True, on_epoch=False,
                                                      sync_dist=True),
        }  # fmt: skip
        for name, call in calls.items():
            try:
                call()
                self.rec[f"refusal/{hook}"].append([name, None, None])
            except Exception as err:
                self.rec[f"refusal/{hook}"].append([name, type(err).__name__, str(err)])

    # -- training
    def training_step(self, batch, batch_idx):
        if self.uncaught_collective:
            self.all_gather(torch.ones(1))  # routine under DDP: here it must fail at once
        loss, _, tokens = self._loss(batch)
        if not self.hdp:  # ByteScaleStrategy logs train/loss itself
            self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=1)
        if self.probe_collectives:
            self._probe("training_step")
        if torch.is_grad_enabled():  # not the loss-normalisation probe's second forward
            self.log("train/tokens", tokens.double(), on_step=False, on_epoch=True, reduce_fx="sum",
                     sync_dist=True)  # fmt: skip
        return {"loss": loss, "tokens": tokens.detach()}

    def on_train_batch_start(self, batch, batch_idx):
        self.rec["train_batch_start"].append([batch_idx, self.trainer.global_step])

    def on_before_zero_grad(self, optimizer):
        self.rec["before_zero_grad"].append(self.trainer.global_step)

    def on_before_backward(self, loss):
        visible = any(p.grad is not None for p in self.parameters())
        self.rec["before_backward"].append([float(loss), visible])

    def on_after_backward(self):
        if self.record_grads:
            self.grads.append(
                {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters()}
            )
        if self.zero_grads_in_hook:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def on_before_optimizer_step(self, optimizer):
        squares = sum(float(p.grad.double().pow(2).sum()) for p in self.parameters() if p.grad is not None)
        self.rec["before_optimizer_step"].append(squares)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        tokens = outputs.get("tokens", [])  # a rank without micro-batches has only "loss"
        local = sum(float(t) for t in tokens) if isinstance(tokens, list) else float(tokens)
        strategy = self.trainer.strategy
        total = float(strategy.reduce(torch.tensor(local, dtype=torch.float64), reduce_op="sum"))
        gathered = self.all_gather(torch.tensor([float(self.global_rank)], dtype=torch.float64))
        strategy.barrier()
        self.rec["train_batch_end"].append(
            {
                "step": self.trainer.global_step,
                "loss": float(outputs["loss"]),
                "logged": float(self.trainer.callback_metrics["train/loss"]) if self.hdp else None,
                "tokens_list": isinstance(tokens, list),
                "tokens_entries": len(tokens) if isinstance(tokens, list) else None,
                "tokens_total": total,
                "gathered": gathered.reshape(-1).tolist(),
                "broadcast": strategy.broadcast(self.global_rank * 10 + 7),
                "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            }
        )
        self.log("cb/loss", outputs["loss"].double(), on_step=True, on_epoch=False, sync_dist=True)

    def on_train_epoch_end(self):
        self.rec["train_epoch_end"].append(
            {
                "step": self.trainer.global_step,
                "tokens": float(self.trainer.callback_metrics.get("train/tokens", -1)),
            }
        )

    # -- evaluation
    def _eval_step(self, stage: str, batch) -> torch.Tensor:
        loss, ce, tokens = self._loss(batch)
        self.log(f"{stage}/ce_sum", ce, reduce_fx="sum", sync_dist=True, batch_size=1)
        self.log(f"{stage}/token_mean", ce / tokens, batch_size=int(tokens), sync_dist=True)
        if stage == "val":
            self.val_metric.update(ce.detach())
            self.log("val/metric_sum", self.val_metric, on_step=False, on_epoch=True)
        if not self.hdp:  # ByteScaleStrategy logs <stage>/loss itself
            self.log(f"{stage}/loss", ce / tokens, batch_size=int(tokens), prog_bar=stage == "val")
        return loss

    def validation_step(self, batch, batch_idx):
        if self.probe_collectives and not self.trainer.sanity_checking:
            self._probe("validation_step")
        return self._eval_step("val", batch)

    def test_step(self, batch, batch_idx):
        return self._eval_step("test", batch)

    def on_validation_start(self):
        self.rec["validation_start"].append([self.trainer.global_step, self.trainer.sanity_checking])

    def on_validation_epoch_end(self):
        self.log("val/ranks", torch.tensor(1.0, dtype=torch.float64), reduce_fx="sum", sync_dist=True)

    def _epoch_metrics(self, stage: str) -> None:
        if self.trainer.sanity_checking:
            return
        metrics = self.trainer.callback_metrics
        names = ("loss", "ce_sum", "token_mean", "ranks", "metric_sum")
        self.rec[f"{stage}_end"].append(
            {k: float(metrics[f"{stage}/{k}"]) for k in names if f"{stage}/{k}" in metrics}
        )

    def on_validation_end(self):
        self._epoch_metrics("val")

    def on_test_end(self):
        self._epoch_metrics("test")

    def predict_step(self, batch, batch_idx):
        """Logit sums over the positions that predict a token (every sequence's but its last)."""
        if self.hdp:
            logits = self.model(batch.input_ids, batch.position_ids)
            mask = batch.labels != IGNORE_INDEX
            return {"seq_ids": list(batch.seq_ids), "logit_sum": float(logits[mask].sum())}
        total = sum(float(self.model(s, torch.arange(len(s)))[:-1].sum()) for s in batch)
        return {"seq_ids": list(range(len(batch))), "logit_sum": total}

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.rec["predict"].append(outputs)

    def configure_optimizers(self):
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def teardown(self, stage: str) -> None:
        rank = self.global_rank
        Path(self.out).mkdir(parents=True, exist_ok=True)
        name = f"{self.tag}_{getattr(stage, 'value', stage)}_{rank}"
        (Path(self.out) / f"{name}.json").write_text(json.dumps(self.rec))
        torch.save(
            {k: v.detach().clone() for k, v in self.state_dict().items()}, Path(self.out) / f"{name}.pt"
        )
        if self.grads:
            torch.save(self.grads, Path(self.out) / f"{name}_grads.pt")


# ----------------------------------------------------------------------------- trainers
QUIET = {
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "use_distributed_sampler": False,
}


def hdp_strategy(**options: Any) -> ByteScaleStrategy:
    return ByteScaleStrategy(
        **{"capacity": CAPACITY, "start_method": "fork", "timeout": TIMEOUT_S, **options}
    )


def trainer(hdp: bool, root: Path, *, strategy_options: dict | None = None, **options: Any) -> pl.Trainer:
    """A float64 CPU Trainer: 2 ranks under ByteScaleStrategy (``hdp``), else one process."""
    os.environ.pop("MASTER_PORT", None)  # a port left by an earlier launcher in this process
    side = (
        {"devices": WORLD, "strategy": hdp_strategy(**(strategy_options or {}))}
        if hdp
        else {"devices": 1, "strategy": "auto"}
    )
    checkpoints = any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in options.get("callbacks", []))
    defaults = {"accelerator": "cpu", "precision": "64-true", "default_root_dir": root, "logger": False,
                "enable_checkpointing": checkpoints, "num_sanity_val_steps": 0, **QUIET}  # fmt: skip
    return pl.Trainer(**{**defaults, **side, **options})


def read(out: Path, tag: str, stage: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{tag}_{stage}_{rank}.json").read_text())


def params(out: Path, tag: str, stage: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{tag}_{stage}_{rank}.pt")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ----------------------------------------------------------------------------- the contract
@dataclass(frozen=True)
class Feature:
    """One row of the contract: ``verdict`` is "works" or "refused"; ``test`` proves ``what``."""

    group: str
    name: str
    verdict: str
    what: str
    test: str  # "test_file.py::test_name", relative to tests/


C = "lightning/test_conformance.py::"
FEATURES: tuple[Feature, ...] = (
    Feature(
        "hooks",
        "`on_train_batch_start`, `on_train_batch_end`, `on_before_zero_grad`",
        "works",
        'once per step on every rank (a rank without micro-batches too); `outputs["loss"]` is the step\'s '
        "global loss, equal to one process's",
        C + "test_batch_hooks_run_once_per_step_with_the_global_loss",
    ),
    Feature(
        "hooks",
        "a dict returned from `training_step`",
        "works",
        "its other keys reach `on_train_batch_end` as lists, one entry per micro-batch of this rank: the rank's "
        "own values, as under DDP (a rank without micro-batches gets only `loss`: read `outputs.get(key, [])`)",
        C + "test_training_step_dict_keeps_its_extra_keys",
    ),
    Feature(
        "hooks",
        "`on_before_backward(loss)`",
        "works",
        "once per step, after the micro-batches' backwards (they run in `training_step`) and the gradient sync: "
        "`loss` is the step's global loss, the same on every rank; no gradient is visible, as after DDP's "
        "`zero_grad`",
        C + "test_on_before_backward_gets_the_global_loss",
    ),
    Feature(
        "hooks",
        "`on_after_backward`",
        "works",
        "final gradients, summed over the ranks, equal to one process's; changing them (zeroing) changes the "
        "update on every rank alike",
        C + "test_on_after_backward_sees_final_gradients",
    ),
    Feature(
        "hooks",
        "`on_after_backward` under `zero=2`",
        "works",
        "the final gradients of the parameters this rank owns; the others are `None`",
        C + "test_zero2_on_after_backward_sees_the_owned_final_gradients",
    ),
    Feature(
        "hooks",
        "`on_before_optimizer_step`, `gradient_clip_val` (norm and value)",
        "works",
        "gradients before clipping equal one process's; clipping gives one process's update",
        C + "test_on_before_optimizer_step_and_clipping_match_one_process",
    ),
    Feature(
        "logging",
        "`self.log(..., sync_dist=True)` with `on_step=True` inside `training_step` or `validation_step`",
        "refused",
        "`CollectiveInMicroBatchError` at the call: ranks run different numbers of micro-batches, so a reduction "
        "per call would hang. Log in `on_train_batch_end`, or with `on_step=False, on_epoch=True`",
        C + "test_collectives_inside_the_micro_batch_loops_are_refused_at_once",
    ),
    Feature(
        "logging",
        "`self.log(..., sync_dist=True)` with `on_epoch=True` in `training_step`, `validation_step`, "
        "`test_step`",
        "works",
        "reduced over all ranks once, at the end of the epoch (also when a rank ran no micro-batch): the same "
        "value on every rank, equal to one process's",
        C + "test_epoch_values_logged_in_the_loops_are_reduced_over_ranks",
    ),
    Feature(
        "logging",
        "`self.log(...)` without `sync_dist` in `training_step`",
        "works",
        "this rank's value; on step the last micro-batch's (docs/faq.md)",
        "lightning/test_logging_micro_batches.py::test_on_step_keeps_the_last_micro_batch_whatever_reduce_fx",
    ),
    Feature(
        "logging",
        "`self.log(..., sync_dist=True)` in `on_train_batch_end`, `on_validation_epoch_end`",
        "works",
        "reduced over the ranks at the call, as under DDP",
        C + "test_sync_dist_in_once_per_step_hooks_reduces_over_ranks",
    ),
    Feature(
        "logging",
        "`val/loss`, `test/loss` (the strategy's)",
        "works",
        "the exact token mean over the epoch and all ranks (one float64 reduction at the epoch's end)",
        C + "test_val_and_test_loss_are_the_exact_token_mean",
    ),
    Feature(
        "collectives",
        "`self.all_gather`, `strategy.reduce`, `barrier`, `broadcast` in hooks that run once per "
        "step or epoch",
        "works",
        "as under DDP (`reduce` with `mean` is exact for integer tensors too)",
        C + "test_collectives_in_once_per_step_hooks_work",
    ),
    Feature(
        "collectives",
        "the same inside `training_step`, `validation_step`, `test_step`, `predict_step`",
        "refused",
        "`CollectiveInMicroBatchError` at once, naming the hook and the safe one "
        "(`on_train_batch_end`, ...); never a hang",
        C + "test_a_collective_in_training_step_fails_at_once",
    ),
    Feature(
        "callbacks",
        '`ModelCheckpoint(monitor="val/loss")`',
        "works",
        "the same best score and files on every rank, equal to one process's",
        C + "test_model_checkpoint_and_early_stopping_match_one_process",
    ),
    Feature(
        "callbacks",
        "`EarlyStopping`",
        "works",
        "the same decisions as one process, on every rank",
        C + "test_model_checkpoint_and_early_stopping_match_one_process",
    ),
    Feature(
        "callbacks",
        "`LearningRateMonitor`, LR schedulers",
        "works",
        "the learning rates of one process",
        C + "test_learning_rates_and_loggers_match_one_process",
    ),
    Feature(
        "callbacks",
        "`GradientAccumulationScheduler`, `Trainer(accumulate_grad_batches>1)`",
        "refused",
        "`GradientAccumulationError` before any rank starts: one batch is already one step (the planner splits "
        "it); raise the data module's `tokens_per_step` instead",
        C + "test_gradient_accumulation_is_refused_by_name",
    ),
    Feature(
        "callbacks",
        "`StochasticWeightAveraging`",
        "works",
        "the averaged model of one process",
        C + "test_stochastic_weight_averaging_matches_one_process",
    ),
    Feature(
        "callbacks",
        "the LR finder (`LearningRateFinder`, `Tuner.lr_find`)",
        "works",
        "the losses and suggestion of one process",
        C + "test_lr_finder_matches_one_process",
    ),
    Feature(
        "loggers",
        "`CSVLogger`, `TensorBoardLogger`, `WandbLogger(offline=True)`",
        "works",
        "`train/loss` and `val/loss` as one process logs them",
        C + "test_learning_rates_and_loggers_match_one_process",
    ),
    Feature(
        "precision",
        "`64-true`",
        "works",
        "parameters equal one process's to 1e-10",
        C + "test_parameters_equal_one_process_in_float64",
    ),
    Feature(
        "precision",
        "`32-true`",
        "works",
        "equal to the float64 reference within float32 rounding",
        C + "test_lower_precisions_train_alike_on_every_rank",
    ),
    Feature(
        "precision",
        "`bf16-mixed`, `bf16-true`",
        "works",
        "finite, the same on every rank, near the reference",
        C + "test_lower_precisions_train_alike_on_every_rank",
    ),
    Feature(
        "loop",
        "`max_steps`, `limit_train_batches`, `limit_val_batches`, `val_check_interval`, "
        "`num_sanity_val_steps`",
        "works",
        "the same steps and validations as one process",
        C + "test_loop_options_give_the_steps_of_one_process",
    ),
    Feature(
        "loop",
        "`check_val_every_n_epoch`, `max_epochs`",
        "works",
        "the same validations as one process",
        C + "test_stochastic_weight_averaging_matches_one_process",
    ),
    Feature(
        "loop",
        "`overfit_batches` (with `ByteScaleDataModule`)",
        "works",
        "the first n global batches, unshuffled, every epoch",
        C + "test_overfit_batches_repeats_the_first_batches",
    ),
    Feature(
        "loop",
        "`fast_dev_run`",
        "works",
        "one training and one validation step",
        C + "test_fast_dev_run_runs_one_step",
    ),
    Feature(
        "entry points",
        "`trainer.validate`, `trainer.test`",
        "works",
        "the metrics of one process",
        C + "test_validate_and_test_match_one_process",
    ),
    Feature(
        "entry points",
        "`trainer.predict`",
        "works",
        "each rank returns a list of its micro-batches' outputs (`mb.seq_ids` says which sequences); together "
        "they cover the global batch",
        C + "test_predict_covers_the_global_batch",
    ),
    Feature(
        "checkpoints",
        "`fit(ckpt_path=...)`",
        "works",
        "resumes exactly (equal to the run without a stop)",
        C + "test_resume_from_a_checkpoint_equals_the_uninterrupted_run",
    ),
    Feature(
        "checkpoints",
        "`LightningModule.load_from_checkpoint` (file or sharded folder)",
        "works",
        "the trained weights; a sharded (`zero>=1`) folder is read in one process",
        C + "test_load_from_checkpoint_reads_files_and_sharded_folders",
    ),
    Feature(
        "checkpoints",
        "`torch.load` on a sharded checkpoint folder",
        "refused",
        "by Python (`IsADirectoryError`: a folder is not a file); use "
        "`lightning_bytescale.lightning.checkpoint.read_consolidated(folder)` or `export_consolidated`",
        C + "test_load_from_checkpoint_reads_files_and_sharded_folders",
    ),
    Feature(
        "model",
        "`Trainer.init_module(empty_init=True)`, `configure_model` on the meta device",
        "works",
        "materialised by each module's `reset_parameters` (`LlamaModel`: its own initialisation), then rank 0's "
        "values everywhere; with `tensor_parallel_size > 1`, sharded on the meta device, each rank allocates only "
        "its shards of rank 0's draws",
        "models/test_model_llama.py::test_a_meta_device_model_materialises_with_the_model_init",
    ),
    Feature(
        "model",
        "manual optimization (`automatic_optimization = False`)",
        "refused",
        "`ConfigError`: the strategy drives the micro-batch loop and the gradient sync",
        C + "test_manual_optimization_is_refused",
    ),
    Feature(
        "data",
        "`ByteScaleDataModule` planner arguments under `ByteScaleStrategy`",
        "refused",
        "when they differ from the strategy's: `PlannerOptionsConflictError` before any rank starts; give them to "
        "the strategy",
        "planner/test_planner_config.py::test_data_module_planner_arguments_that_differ_are_refused",
    ),
    Feature(
        "telemetry",
        "`strategy.step_stats`",
        "works",
        "the step's measured values and the plan's facts (lengths, ring sizes: from the plan every rank holds), "
        "the same on every rank",
        "lightning/test_telemetry.py::test_step_stats_count_sequences_from_the_plan_on_masked_data",
    ),
)


def render() -> str:
    """The docs table (between the markers), one line per feature."""
    lines = ["| area | feature | verdict | what you get |", "|---|---|---|---|"]
    for f in FEATURES:
        lines.append(f"| {f.group} | {f.name} | {f.verdict} | {f.what} |")
    return "\n".join(lines)


def docs_block(text: str) -> str | None:
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    return match.group(1) if match else None


def write_docs() -> None:
    text = DOCS.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} block")
    DOCS.write_text(pattern.sub(lambda _: f"{BEGIN}\n{render()}\n{END}", text, count=1))


def close(a: float, b: float, rel: float = 1e-10) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        write_docs()
        print(f"wrote the contract table into {DOCS}")
    else:
        print(render())
