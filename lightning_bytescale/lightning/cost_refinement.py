"""Refine the cost model during training from the run's own micro-batch times, the same on every rank.

The pure refit (:mod:`lightning_bytescale.planner.cost_refit`) needs, after every step, every
rank's micro-batches: their features and their measured seconds.  Here is where they come from
and where the refitted model goes (docs/cost-model.md, "Refinement during training"):

* **Features**: every rank holds the whole plan of a step, so the training loader records every
  rank's micro-batches' :class:`~lightning_bytescale.planner.cost_features.Work` in the step's
  statistics (``stats["cost_work"]``, plan order) and every rank computes the same ones.
* **Times**: each rank times its own micro-batches (CUDA events on a GPU, wall time on the CPU:
  ``run_micro_batches``) and writes them into its slots of a vector with one slot per
  micro-batch of every rank (:meth:`CostRefinement.extra`).  That vector travels in the step's
  one world-spanning all-reduce (``sync_step``'s ``extra``; no collective of its own): every
  slot has one writer and zeros elsewhere, so the sum hands every rank every time, the same
  bits (float64 with the bucketed gradient sync, the default; the flat sync's buffer dtype,
  float32 or wider, with the flat one).
* **The refit** (:meth:`CostRefinement.observe`) then runs on every rank on the same float64
  samples and gives the same model bit for bit.  A model fitted from the steps up to ``k``
  plans the steps from ``k + lag`` on (the run's step count over epochs, ``stats["plan_index"]``);
  ``lag`` is at least the training loader's look-ahead plus one
  (:func:`~lightning_bytescale.planner.cost_refit.lag_for_loader`: 1 with ``num_workers=0``,
  ``num_workers x prefetch_factor + 1`` with workers).
* **To the loader's workers**: after each step the rank writes its refit's schedule (the model
  versions and the last step seen) to a file of its own, atomically; the loader plans step
  ``i`` with the version for ``i``, and a worker that asks early waits for it
  (:func:`~lightning_bytescale.planner.cost_refit.wait_for_model`).
* **Checkpoints**: :class:`CostRefinementCallback` saves the refit's state (versions and the
  window, floats exact) with the run, so a resumed run plans every step as the uninterrupted
  run would, given the same measurements; global rank 0 also leaves the schedule in the run's
  folder (``cost_schedule.json``) for ``bytescale-sim --cost-model``.

Switched on by ``ByteScaleStrategy(refine_cost_model=...)``: ``None`` (the default) refines a
``cost_model="auto"`` and keeps an explicit model pinned; ``True`` or ``False`` force it.  Off,
the times are still gathered and the telemetry still reports how well the plan's model fits.
Not under tensor or pipeline parallelism yet (their sync runs per lane or stage).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel.layout import Layout
from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_features import Work, predict_seconds, relative_errors
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.cost_refit import (
    CostRefit,
    RefitConfig,
    RefitReport,
    coefficients,
    lag_for_loader,
    step_samples,
    write_schedule,
)

#: The file global rank 0 leaves in the run's folder (``Trainer(default_root_dir=...)``).
RUN_SCHEDULE_FILE = "cost_schedule.json"
#: At most this many micro-batches in the step's planned-against-measured rows (the chart).
MAX_FIT_ROWS = 2000


def check_option(
    option: Any, layout: type[Layout], tensor_parallel_size: int, pipeline_parallel_size: int
) -> None:
    """Refuse a ``refine_cost_model`` value the strategy cannot honour (a ``ConfigError``; a bad
    ``RefitConfig`` dict: a ``CostRefitError``), before any rank starts (``layout``: the run's layout;
    the sizes name it in the message)."""
    if option is not None and not isinstance(option, (bool, RefitConfig, Mapping)):
        raise ConfigError(
            f"refine_cost_model must be None (refine a cost_model='auto'), True, False, a RefitConfig or its "
            f"dict, got {type(option).__name__}"
        )
    if isinstance(option, Mapping):
        option = RefitConfig.from_json_dict(option)  # a bad setting: a CostRefitError now, not on every rank
    wanted = option is True or (isinstance(option, RefitConfig) and option.enabled)
    if wanted and not layout.whole_layers:  # a rank times a shard or a stage, not whole layers
        raise ConfigError(
            f"refine_cost_model refits from every rank's micro-batch times, which tensor_parallel_size="
            f"{tensor_parallel_size} and pipeline_parallel_size={pipeline_parallel_size} do not gather yet: pass "
            "refine_cost_model=False (or None) and a profiled cost model (bytescale-profile --tensor-parallel N)"
        )


def refit_config(option: Any, auto: bool) -> RefitConfig:
    """The refit's settings for ``refine_cost_model=option`` (``auto``: the model is ``"auto"``)."""
    if isinstance(option, RefitConfig):
        return option
    if isinstance(option, Mapping):
        return RefitConfig.from_json_dict(option)
    return RefitConfig(enabled=auto if option is None else bool(option))


class CostRefinement:
    """One rank's refit during training, its schedule file and its step statistics."""

    def __init__(
        self, base: CostModel, config: RefitConfig, rank: int, directory: Path | None = None
    ) -> None:
        self.refit = CostRefit(base, config)
        self.rank = int(rank)
        self._own_dir = directory is None
        self.directory = (
            Path(tempfile.mkdtemp(prefix="bytescale-cost-")) if directory is None else Path(directory)
        )
        self.schedule_path = self.directory / f"cost_schedule.rank{self.rank}.json"
        self.last_report: RefitReport | None = None
        self.publish()

    @property
    def enabled(self) -> bool:
        return self.refit.config.enabled

    def publish(self) -> None:
        """Write the schedule the loader's workers read (atomically)."""
        write_schedule(self.schedule_path, self.refit)

    def loader_schedule(self, num_workers: int, prefetch_factor: int | None) -> str | None:
        """The schedule file the training loader plans with (None when off), the lag raised to
        the loader's look-ahead plus one where it is shorter."""
        if not self.enabled:
            return None
        need = lag_for_loader(num_workers, prefetch_factor)
        if self.refit.config.lag < need:
            self.refit.config = dataclasses.replace(self.refit.config, lag=need)
            self.publish()
        return str(self.schedule_path)

    # ------------------------------------------------------------------ one step
    def local_seconds(self, local: Any, works: Sequence[Sequence[float]]) -> list[float]:
        """This rank's measured seconds of its micro-batches, in plan order (``local``: the step's
        ``LocalResult``; ``works``: their feature rows)."""
        return [float(m.seconds) for m in local.micro_batches]

    def extra(self, batch: Any, local: Any) -> torch.Tensor | None:
        """This rank's times in its slots of the step's vector (None: the step has no features)."""
        work = _work_rows(batch)
        if work is None or self.rank >= len(work):
            return None
        counts = [len(w) for w in work]
        out = torch.zeros(sum(counts), dtype=torch.float64)
        if out.numel() == 0:
            return None
        mine = self.local_seconds(local, work[self.rank])
        if len(mine) == counts[self.rank]:  # otherwise none: a sample is dropped, never misattributed
            start = sum(counts[: self.rank])
            out[start : start + len(mine)] = torch.tensor(mine, dtype=torch.float64)
        return out

    def observe(self, batch: Any, result: Any) -> dict[str, Any]:
        """Every rank's times from the step's all-reduce, the fit metrics, the refit: the
        ``strategy.step_stats`` entries of the step (the same on every rank)."""
        work = _work_rows(batch)
        if work is None or result.extra is None:
            return {}
        flat = [float(v) for v in result.extra.tolist()]
        if len(flat) != sum(len(w) for w in work):
            return {}
        seconds: list[list[float]] = []
        at = 0
        for rows in work:
            seconds.append(flat[at : at + len(rows)])
            at += len(rows)
        works = [[Work.from_row(r) for r in rows] for rows in work]
        pairs = [
            (r, i, w, s)
            for r, (ws, ss) in enumerate(zip(works, seconds))
            for i, (w, s) in enumerate(zip(ws, ss))
            if math.isfinite(s) and s > 0
        ]
        base = self.refit.base
        stats = batch.stats if isinstance(batch.stats, dict) else {}
        index = stats.get("plan_index")
        in_force = self._model_for(index)
        out: dict[str, Any] = {
            "cost_error": relative_errors(
                [w.planned_s for *_, w, _ in pairs], [s for *_, s in pairs]
            ).to_json_dict(),
            "cost_base_error": relative_errors(
                [predict_seconds(base, w) for *_, w, _ in pairs], [s for *_, s in pairs]
            ).to_json_dict(),
            "cost_coefficients": coefficients(in_force, base),
            "cost_fit_rows": [[r, i, w.planned_s, s, w.tokens] for r, i, w, s in pairs[:MAX_FIT_ROWS]],
        }
        if not self.enabled or index is None or int(index) <= self.refit.last_step:
            return out  # off, a loader of the user's own, or a step seen already: nothing to fit
        report = self.refit.observe(int(index), step_samples(work, seconds))
        self.last_report = report
        if report.updated:
            self.publish()
            if report.clamped:
                rank_zero_info(report.line())
        else:
            self.publish()  # the last step seen moved on: the workers may plan further
        out["cost_fit_report"] = {
            "updated": report.updated,
            "reason": report.reason,
            "samples": report.samples,
            "applies_from": report.applies_from,
            "clamped": sorted(report.clamped),
            "fitted": dict(report.coefficients),
        }
        return out

    def _model_for(self, index: Any) -> CostModel:
        if index is None or not self.enabled:
            return self.refit.base if not self.enabled else self.refit.current
        try:
            return self.refit.model_for_step(int(index))
        except Exception:  # a step the schedule no longer or not yet answers for: the newest
            return self.refit.current

    def start_at(self, index: int) -> None:
        """The run trains from step ``index`` on (a resume, maybe from a checkpoint without a
        refit): the steps before it count as seen without samples, so the loader may plan it."""
        if self.enabled and self.refit.last_step < index - 1:
            self.refit.last_step = index - 1
            self.publish()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return self.refit.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the saved versions and window, later fits under this run's settings (the lag
        never shorter than the saved one, so no published version moves)."""
        saved = CostRefit.from_state_dict(state)
        lag = max(saved.config.lag, self.refit.config.lag)
        self.refit = CostRefit.from_state_dict(state, dataclasses.replace(self.refit.config, lag=lag))
        self.publish()

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


def _work_rows(batch: Any) -> list[list[list[float]]] | None:
    stats = getattr(batch, "stats", None)
    work = stats.get("cost_work") if isinstance(stats, dict) else None
    return work if isinstance(work, list) else None


class CostRefinementCallback(Callback):
    """Saves the refit with the run's checkpoints and restores it on resume; global rank 0 keeps
    the run's schedule in ``default_root_dir`` (``cost_schedule.json``)."""

    def __init__(self, refinement: CostRefinement) -> None:
        self.refinement = refinement

    @property
    def state_key(self) -> str:
        return "CostRefinement"

    def state_dict(self) -> dict[str, Any]:
        return self.refinement.state_dict() if self.refinement.enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict and self.refinement.enabled:
            self.refinement.load_state_dict(state_dict)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        dataset, sampler = getattr(loader, "dataset", None), getattr(loader, "sampler", None)
        if callable(getattr(dataset, "plan_index", None)) and hasattr(sampler, "epoch"):
            self.refinement.start_at(dataset.plan_index(int(sampler.epoch), int(sampler.step)))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        report = self.refinement.last_report
        if trainer.is_global_zero and report is not None and report.updated:
            write_schedule(Path(trainer.default_root_dir) / RUN_SCHEDULE_FILE, self.refinement.refit)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.refinement.close()


def attach(
    trainer: pl.Trainer, config: PlannerConfig, option: Any, *, auto: bool, rank: int, whole_layers: bool
) -> CostRefinement | None:
    """The rank's refinement for a fit (None when not fitting or where a rank does not hold whole layers:
    the layout's ``whole_layers``, false on a tensor/pipeline mesh),
    its callback added to the trainer; call it on every rank in the strategy's ``setup``, after
    the cost model is final and before any loader is built."""
    if trainer.state.fn != TrainerFn.FITTING or not whole_layers:
        return None
    base = config.cost_model if isinstance(config.cost_model, CostModel) else CostModel.paper_preset()
    settings = refit_config(option, auto)
    limit = (
        trainer.limit_train_batches
    )  # an int counts batches (1: one batch, as fast_dev_run sets), 1.0 is all
    whole = limit is None or (isinstance(limit, float) and limit == 1.0)
    partial = bool(trainer.overfit_batches) or not whole
    if settings.enabled and partial:  # epochs cut short: the loader's step index skips what the lag counts on
        if option is not None:
            raise ConfigError(
                "refine_cost_model cannot run with Trainer(limit_train_batches=...) or overfit_batches (epochs cut "
                "short skip the steps its lag counts on): pass refine_cost_model=False"
            )
        settings = dataclasses.replace(settings, enabled=False)
        rank_zero_info(
            "cost model refinement off: the Trainer cuts epochs short (limit_train_batches/overfit_batches)"
        )
    refinement = CostRefinement(base, settings, rank)
    for old in [c for c in trainer.callbacks if isinstance(c, CostRefinementCallback)]:
        old.refinement.close()
        trainer.callbacks.remove(old)
    trainer.callbacks.append(CostRefinementCallback(refinement))
    return refinement


__all__ = [
    "RUN_SCHEDULE_FILE",
    "CostRefinement",
    "CostRefinementCallback",
    "attach",
    "check_option",
    "refit_config",
]
