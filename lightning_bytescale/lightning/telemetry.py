"""Step telemetry: turn the strategy's per-step statistics into dashboard metrics.

`ByteScaleStrategy` leaves ``strategy.step_stats`` (a plain dict, :mod:`~lightning_bytescale.lightning.step_stats`)
after every optimizer step.
`TelemetryCallback` logs it through Lightning's logging, so every logger (W&B, CSV, TensorBoard)
gets the scalars every step: loss, tokens/s, estimated MFU, planned and measured per-rank busy
time, max/mean imbalance, bubble fraction, ring bytes, measured (blocked) and planned exposed ring
time, plan time and micro-batches per rank, and per attention mode of the plan's ring items
(``ring``, ``ulysses``, ``hybrid``) their count and planned bytes (``comm/mode_counts/<mode>``,
``comm/mode_bytes_planned/<mode>``, from ``Plan.mode_stats()``), and how well the cost model fits
(:func:`cost_metrics`: the relative error of planned against measured micro-batch seconds, median
and worst, under the model that planned the step and under the base model, and the coefficients).  Under pipelines (``pipeline_parallel_size`` > 1)
also per pipeline (HDP rank) ``h``: its micro-batch count, its measured pipeline bubble and the
simulator's bubble for the same executed order (``pipeline/bubble/<h>`` next to
``pipeline/bubble_sim/<h>``, :func:`pipeline_metrics`).
Every ``charts_every_n_steps`` steps it also logs the distributions: a sequence-length and a
CP-degree histogram, a per-rank load bar chart and the plan as a table -- as W&B objects when a
`WandbLogger` is attached, as TensorBoard histograms/text for a `TensorBoardLogger`, and as
summary scalars only for other loggers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning.step_stats import plan_facts

__all__ = [
    "TelemetryCallback",
    "merge_plan_stats",
    "cost_metrics",
    "mode_metrics",
    "step_metrics",
    "pipeline_metrics",
    "plan_rows",
    "rank_rows",
    "peak_tflops_for_device",
]

# Dense BF16/FP16 tensor-core peaks (TFLOP/s per device, no sparsity), matched on the device name.
_GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 125.0),
    ("V100", 125.0),
)
# Nominal FP32 peak of one CPU core (AVX2/AVX-512 FMA at ~3 GHz); a CPU rank runs one thread.
CPU_PEAK_TFLOPS = 0.1


def peak_tflops_for_device(device: torch.device) -> float | None:
    """A best-effort peak for MFU when the config gives none; None when unknown."""
    if device.type == "cpu":
        return CPU_PEAK_TFLOPS
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, peak in _GPU_PEAK_TFLOPS:
            if key in name:
                return peak
    return None


def _floats(values: Any) -> list[float]:
    if values is None:
        return []
    if isinstance(values, torch.Tensor):
        return [float(v) for v in values.flatten().tolist()]
    if isinstance(values, (int, float)):
        return [float(values)]
    return [float(v) for v in values]


def step_metrics(
    stats: dict[str, Any],
    *,
    flops: float | None = None,
    peak_tflops: float | None = None,
    world_size: int = 1,
    per_rank_limit: int = 64,
) -> dict[str, float]:
    """Scalars for one step from ``strategy.step_stats``.

    ``flops`` is the model's forward+backward FLOPs for the step's global batch (None: no MFU);
    ``peak_tflops`` the per-device peak.  Per-rank values get one key per rank up to
    ``per_rank_limit`` ranks; beyond that only min/mean/max are logged.
    """
    out: dict[str, float] = {}
    if "loss" in stats and stats["loss"] is not None:
        out["train/loss"] = float(stats["loss"])
    step_time = float(stats.get("step_time_s") or 0.0)
    tokens = float(stats.get("tokens") or 0.0)
    if tokens:
        out["data/tokens"] = tokens
    if stats.get("loss_tokens") is not None:
        out["data/loss_tokens"] = float(stats["loss_tokens"])
    if step_time > 0:
        out["perf/step_time_s"] = step_time
        if tokens:
            out["perf/tokens_per_s"] = tokens / step_time
        if flops:
            achieved = flops / step_time / max(world_size, 1) / 1e12
            out["perf/tflops_per_device"] = achieved
            if peak_tflops:
                out["perf/mfu"] = achieved / peak_tflops
    for key, name in (
        ("max_over_mean_planned", "balance/max_over_mean_planned"),
        ("max_over_mean_measured", "balance/max_over_mean_measured"),
        ("bubble_fraction", "balance/bubble_fraction"),
        ("ring_bytes", "comm/ring_bytes"),
        ("exposed_ring_planned_s", "comm/exposed_ring_planned_s"),
        ("plan_ms", "plan/plan_ms"),
    ):
        if stats.get(key) is not None:
            out[name] = float(stats[key])
    for key, name in (
        ("busy_s", "busy_s"),
        ("planned_s", "planned_s"),
        ("num_micro_batches", "micro_batches"),
        ("ring_wait_s", "ring_wait_s"),
    ):
        values = _floats(stats.get(key))
        if not values:
            continue
        out[f"ranks/{name}_max"] = max(values)
        out[f"ranks/{name}_mean"] = statistics.fmean(values)
        out[f"ranks/{name}_min"] = min(values)
        if len(values) <= per_rank_limit:
            for rank, value in enumerate(values):
                out[f"ranks/{name}/{rank}"] = value
    out.update(mode_metrics(stats))
    out.update(cost_metrics(stats))
    out.update(pipeline_metrics(stats, per_rank_limit=per_rank_limit))
    waits = _floats(stats.get("ring_wait_s"))
    if waits:  # summed over ranks, like the plan's exposed_ring_time
        out["comm/ring_wait_s"] = sum(waits)
    lengths = _floats(stats.get("lengths"))
    if stats.get("num_sequences") is not None:
        out["data/num_sequences"] = float(stats["num_sequences"])
    if lengths:
        out["data/num_sequences"] = float(len(lengths))
        out["data/seq_len_max"] = max(lengths)
        out["data/seq_len_mean"] = statistics.fmean(lengths)
    degrees = _floats(stats.get("cp_degrees"))
    if degrees:
        out["comm/cp_degree_max"] = max(degrees)
        out["comm/cp_degree_mean"] = statistics.fmean(degrees)
        out["comm/sharded_sequences"] = float(sum(1 for d in degrees if d > 1))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def mode_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """Per attention mode ``m`` of the step's plan: ``comm/mode_counts/<m>`` (its ring items) and
    ``comm/mode_bytes_planned/<m>`` (the bytes their attention sends in the step, summed over members and
    layers, by the plan's cost model), every mode a key (0 where none ran).  The plan's facts
    (``Plan.mode_stats()``), so every rank logs the same values."""
    out: dict[str, float] = {}
    for key, prefix in (
        ("mode_counts", "comm/mode_counts"),
        ("comm_bytes_by_mode", "comm/mode_bytes_planned"),
    ):
        values = stats.get(key)
        if isinstance(values, dict):
            out.update({f"{prefix}/{mode}": float(v) for mode, v in values.items()})
    return out


def cost_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """How well the cost model fits the step (``lightning/cost_refinement.py``'s statistics, the
    same on every rank): ``cost/error_median`` and ``cost/error_worst``, the relative error
    ``|planned - measured| / measured`` over every rank's micro-batches of the model that planned
    the step; ``cost/base_error_*`` the same for the model the run started from (the profiled,
    ``"auto"`` or preset one); ``cost/a``, ``cost/b``, ``cost/g`` and ``cost/comm`` (how many times
    slower than the base model's its links are) of the model in force; and after each refit
    ``cost/refit_updated`` (1 or 0), ``cost/refit_samples`` and ``cost/refit_clamped`` (coefficients
    held to the bound)."""
    out: dict[str, float] = {}
    for key, prefix in (("cost_error", "cost/error"), ("cost_base_error", "cost/base_error")):
        summary = stats.get(key)
        if isinstance(summary, dict) and summary.get("count"):
            out[f"{prefix}_median"] = float(summary["median"])
            out[f"{prefix}_worst"] = float(summary["worst"])
    coefficients = stats.get("cost_coefficients")
    if isinstance(coefficients, dict):
        out.update({f"cost/{name}": float(v) for name, v in coefficients.items()})
    report = stats.get("cost_fit_report")
    if isinstance(report, dict):
        out["cost/refit_updated"] = float(bool(report.get("updated")))
        out["cost/refit_samples"] = float(report.get("samples") or 0)
        out["cost/refit_clamped"] = float(len(report.get("clamped") or ()))
    return out


#: Columns of the planned-against-measured chart (``charts/cost_fit``), one row per micro-batch.
COST_FIT_COLUMNS = ["rank", "micro_batch", "planned_s", "measured_s", "tokens"]


#: ``step_stats`` key -> metric prefix of the per-pipeline figures (one key per HDP rank ``h``).
PIPELINE_METRICS: dict[str, str] = {
    "pipeline_micro_batches": "pipeline/micro_batches",
    "pipeline_bubble": "pipeline/bubble",
    "pipeline_bubble_sim": "pipeline/bubble_sim",
    "pipeline_schedule_s": "pipeline/schedule_s",
}


def pipeline_metrics(stats: dict[str, Any], *, per_rank_limit: int = 64) -> dict[str, float]:
    """Per pipeline (HDP rank) ``h`` under pipelines: ``pipeline/<figure>/<h>``, and ``pipeline/stage_bubble/<h>/<p>``.

    ``pipeline/bubble/<h>`` (measured: the mean over the pipeline's stages of ``1 - compute /
    schedule wall``) and ``pipeline/bubble_sim/<h>`` (the simulator's for the executed order)
    share the last part of their names, so a W&B chart of one pipeline shows both; with more
    than ``per_rank_limit`` pipelines only the mean and max of each are logged.
    """
    out: dict[str, float] = {}
    for key, prefix in PIPELINE_METRICS.items():
        values = _floats(stats.get(key))
        if not values:
            continue
        out[f"{prefix}_mean"] = statistics.fmean(values)
        out[f"{prefix}_max"] = max(values)
        if len(values) <= per_rank_limit:
            out.update({f"{prefix}/{h}": v for h, v in enumerate(values)})
    stages = stats.get("pipeline_stage_bubble") or []
    if len(stages) <= per_rank_limit:
        for h, row in enumerate(stages):
            out.update({f"pipeline/stage_bubble/{h}/{p}": float(v) for p, v in enumerate(row)})
    return out


def cp_degrees_of(plan: Any) -> list[int]:
    """The ring size of every sequence of a plan (1: packed locally on one rank): ``Plan.cp_degrees``."""
    from lightning_bytescale.planner.plan import Plan

    return Plan.cp_degrees(plan)


def merge_plan_stats(step_stats: dict[str, Any], plan_stats: dict[str, Any] | None) -> dict[str, Any]:
    """``step_stats`` with gaps filled from the step's plan statistics (``StepBatch.stats``).

    The plan's own names are mapped once, by :data:`~lightning_bytescale.lightning.step_stats.PLAN_FACTS` (``rank_time`` -> ``planned_s``,
    ``max_over_mean`` -> ``max_over_mean_planned``, ...); without per-sequence ring sizes a
    ``cp_degree_histogram`` (ring size -> sequences) gives ``cp_degrees`` in size order.
    ``ByteScaleStrategy``'s own ``step_stats`` already hold every plan fact, so for them this
    changes nothing.
    """
    out = dict(step_stats)
    plan = plan_stats or {}
    for name, value in plan_facts(plan).items():
        have = out.get(name)
        if (
            have is None
            or (isinstance(have, (list, tuple)) and not have)
            or (isinstance(have, float) and not math.isfinite(have))
        ):
            out[name] = value
    plan_obj = _as_plan(plan.get("plan"))
    if plan_obj is not None:
        if not out.get("lengths"):
            out["lengths"] = list(plan_obj.lengths)
        if not out.get("cp_degrees"):
            out["cp_degrees"] = cp_degrees_of(plan_obj)
    if not out.get("cp_degrees") and isinstance(plan.get("cp_degree_histogram"), dict):
        degrees: list[int] = []
        for size, count in sorted(plan["cp_degree_histogram"].items(), key=lambda kv: int(kv[0])):
            degrees.extend([int(size)] * int(count))
        out["cp_degrees"] = degrees
    return out


def rank_rows(stats: dict[str, Any]) -> list[list[float]]:
    """Rows ``[rank, planned_s, busy_s, micro_batches]`` for the per-rank load chart."""
    planned = _floats(stats.get("planned_s"))
    busy = _floats(stats.get("busy_s"))
    mbs = _floats(stats.get("num_micro_batches"))
    n = max(len(planned), len(busy), len(mbs))

    def at(values: list[float], i: int) -> float:
        return values[i] if i < len(values) else float("nan")

    return [[r, at(planned, r), at(busy, r), at(mbs, r)] for r in range(n)]


RANK_COLUMNS = ["rank", "planned_s", "busy_s", "micro_batches"]
PLAN_COLUMNS = ["rank", "micro_batch", "ring", "sequences", "tokens", "offload_ratio", "est_time"]


def plan_rows(plan: Any, max_rows: int = 2000) -> list[list[Any]]:
    """The plan as table rows (one per rank and micro-batch), for `PLAN_COLUMNS`."""
    rows: list[list[Any]] = []
    for rank, micro_batches in enumerate(plan.ranks):
        for index, mb in enumerate(micro_batches):
            ring = "-" if mb.ring is None else ",".join(str(r) for r in mb.ring)
            seqs = ",".join(str(p.seq) for p in mb.pieces)
            rows.append([rank, index, ring, seqs, mb.num_tokens, float(mb.offload_ratio), float(mb.est_time)])
            if len(rows) >= max_rows:
                return rows
    return rows


def _as_plan(plan: Any) -> Any:
    """A `Plan` from a Plan, its JSON dict (``Plan.to_json_dict``) or None."""
    if plan is None or hasattr(plan, "ranks") and not isinstance(plan, dict):
        return plan
    if isinstance(plan, dict) and "ranks" in plan:
        from lightning_bytescale.planner.plan import Plan

        try:
            return Plan.from_json_dict(plan, check_digest=False)
        except Exception:  # an unreadable plan only costs the table
            return None
    return None


def replan(trainer: Any, batch: Any) -> Any:
    """The step's whole plan, recomputed from the training loader's dataset (None if unavailable).

    A rank's `StepBatch` holds only its own micro-batches; the loader's dataset can plan any
    step again (``dataset.plan(epoch, step)``, deterministic by design).  The result is used
    only if its digest equals the batch's, so a table never shows a different plan.
    """
    if batch is None or not getattr(batch, "digest", None):
        return None
    try:
        loader = trainer.train_dataloader
        dataset = getattr(loader, "dataset", None)
        if dataset is None or not callable(getattr(dataset, "plan", None)):
            return None
        stats = batch.stats if isinstance(batch.stats, dict) else {}
        plan = dataset.plan(int(stats.get("epoch", trainer.current_epoch)), int(batch.step))
        from lightning_bytescale.engine.micro_batch import step_digest

        identity = getattr(batch, "data_identity", "") or ""
        return plan if step_digest(plan, identity) == batch.digest else None
    except Exception:  # a missing table must never stop training
        return None


def _sequence_rows(stats: dict[str, Any], max_rows: int = 2000) -> list[list[Any]]:
    lengths = _floats(stats.get("lengths"))
    degrees = _floats(stats.get("cp_degrees"))
    return [[i, int(s), int(degrees[i]) if i < len(degrees) else 1] for i, s in enumerate(lengths[:max_rows])]


class TelemetryCallback(Callback):
    """Logs ``trainer.strategy.step_stats`` after every step (see the module docstring).

    Args:
        peak_tflops: per-device peak for the MFU estimate; None picks a nominal value for the
            device (a table of GPUs, `CPU_PEAK_TFLOPS` for a CPU rank) and skips MFU if unknown.
        charts_every_n_steps: how often to log histograms, the load chart and the plan table
            (also after the first step); 0 disables them.
        per_rank_limit: log one key per rank only up to this world size.
        prog_bar: show loss and tokens/s in the progress bar.
        flops_per_token: FLOPs per trained token when the LightningModule exposes no
            ``train_flops(lengths)`` / ``flops_per_token``; None: no MFU then.
    """

    def __init__(
        self,
        peak_tflops: float | None = None,
        charts_every_n_steps: int = 50,
        per_rank_limit: int = 64,
        prog_bar: bool = True,
        flops_per_token: float | None = None,
    ) -> None:
        if charts_every_n_steps < 0:
            raise ConfigError(f"charts_every_n_steps must be >= 0, got {charts_every_n_steps}")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ConfigError(f"peak_tflops must be positive (TFLOP/s per device), got {peak_tflops}")
        self.peak_tflops = peak_tflops
        self.charts_every_n_steps = charts_every_n_steps
        self.per_rank_limit = per_rank_limit
        self.prog_bar = prog_bar
        self.flops_per_token = flops_per_token
        self._warned = False
        self.last_metrics: dict[str, float] = {}

    # -- helpers -------------------------------------------------------------------------
    def _step_flops(self, pl_module: LightningModule, stats: dict[str, Any]) -> float | None:
        lengths = [int(s) for s in _floats(stats.get("lengths"))]
        tokens, count = stats.get("tokens"), stats.get("num_sequences")
        if not lengths and tokens and count:  # no per-sequence lengths: assume equal ones
            lengths = [max(1, round(float(tokens) / float(count)))] * int(count)
        train_flops = getattr(pl_module, "train_flops", None)
        if callable(train_flops) and lengths:
            return float(train_flops(lengths))
        per_token = getattr(pl_module, "flops_per_token", None) or self.flops_per_token
        if callable(per_token):
            per_token = per_token()
        tokens = tokens or sum(lengths)
        if per_token and tokens:
            return float(per_token) * float(tokens)
        return None

    def _charts_due(self, trainer: Trainer) -> bool:
        n = self.charts_every_n_steps
        return n > 0 and (trainer.global_step == 1 or trainer.global_step % n == 0)

    # -- hooks ----------------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = getattr(trainer.strategy, "step_stats", None)
        if stats:
            stats = merge_plan_stats(stats, getattr(batch, "stats", None))
        if not stats:
            if not self._warned:
                rank_zero_warn(
                    "TelemetryCallback: the strategy reports no `step_stats`; use "
                    "strategy=ByteScaleStrategy (Trainer(strategy='bytescale')) to get step telemetry."
                )
                self._warned = True
            return
        peak = self.peak_tflops
        if peak is None:
            peak = peak_tflops_for_device(pl_module.device)
        metrics = step_metrics(
            stats,
            flops=self._step_flops(pl_module, stats),
            peak_tflops=peak,
            world_size=trainer.world_size,
            per_rank_limit=self.per_rank_limit,
        )
        if getattr(getattr(trainer.strategy, "loop_options", None), "log_loss", False):
            metrics.pop("train/loss", None)  # the strategy logs the step's global loss itself
        self.last_metrics = metrics
        shown = {"train/loss", "perf/tokens_per_s"} if self.prog_bar else set()
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name in shown, batch_size=1)
        if trainer.is_global_zero and self._charts_due(trainer):
            self._log_charts(trainer, stats, batch)

    def _log_charts(self, trainer: Trainer, stats: dict[str, Any], batch: Any = None) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

        plan = _as_plan(getattr(trainer.strategy, "last_plan", None) or stats.get("plan"))
        if plan is None:
            plan = replan(trainer, batch)
        for logger in trainer.loggers:
            try:
                if isinstance(logger, WandbLogger):
                    self._wandb_charts(logger, trainer.global_step, stats, plan)
                elif isinstance(logger, TensorBoardLogger):
                    self._tensorboard_charts(logger, trainer.global_step, stats, plan)
            except Exception as err:  # a chart must never stop training
                rank_zero_warn(f"TelemetryCallback: could not log charts to {type(logger).__name__}: {err}")

    @staticmethod
    def _wandb_charts(logger: Any, step: int, stats: dict[str, Any], plan: Any) -> None:
        import wandb

        payload: dict[str, Any] = {"trainer/global_step": step}
        lengths = _floats(stats.get("lengths"))
        degrees = _floats(stats.get("cp_degrees"))
        if lengths:
            payload["charts/seq_len_hist"] = wandb.Histogram(lengths, num_bins=min(64, max(len(lengths), 1)))
        if degrees:
            top = int(max(degrees))
            payload["charts/cp_degree_hist"] = wandb.Histogram(
                np_histogram=_int_histogram([int(d) for d in degrees], top)
            )
        rows = rank_rows(stats)
        if rows:
            table = wandb.Table(columns=RANK_COLUMNS, data=rows)
            payload["charts/rank_busy_s"] = wandb.plot.bar(
                table, "rank", "busy_s", title="measured busy s per rank"
            )
            payload["charts/rank_planned_s"] = wandb.plot.bar(
                table, "rank", "planned_s", title="planned s per rank"
            )
        if plan is not None:
            payload["charts/plan"] = wandb.Table(columns=PLAN_COLUMNS, data=plan_rows(plan))
        elif rows:  # no plan object available: the per-rank summary of the plan
            payload["charts/plan"] = wandb.Table(columns=RANK_COLUMNS, data=rows)
        fit_rows = stats.get("cost_fit_rows")
        if fit_rows:
            fit = wandb.Table(columns=COST_FIT_COLUMNS, data=[list(r) for r in fit_rows])
            payload["charts/cost_fit"] = wandb.plot.scatter(
                fit, "planned_s", "measured_s", title="planned vs measured micro-batch s"
            )
        seq_rows = _sequence_rows(stats)
        if seq_rows:
            payload["charts/sequences"] = wandb.Table(columns=["seq", "length", "cp_degree"], data=seq_rows)
        logger.experiment.log(payload)

    @staticmethod
    def _tensorboard_charts(logger: Any, step: int, stats: dict[str, Any], plan: Any) -> None:
        import numpy as np

        writer = logger.experiment
        lengths = _floats(stats.get("lengths"))
        degrees = _floats(stats.get("cp_degrees"))
        if lengths:
            writer.add_histogram("charts/seq_len", np.asarray(lengths), step)
        if degrees:
            writer.add_histogram("charts/cp_degree", np.asarray(degrees), step)
        rows = rank_rows(stats)
        if rows:
            text = "| rank | planned_s | busy_s | micro_batches |\n|---|---|---|---|\n" + "\n".join(
                f"| {int(r)} | {p:.4g} | {b:.4g} | {m:g} |" for r, p, b, m in rows
            )
            writer.add_text("charts/rank_load", text, step)
        if plan is not None:
            head = "| " + " | ".join(PLAN_COLUMNS) + " |\n|" + "---|" * len(PLAN_COLUMNS) + "\n"
            body = "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in plan_rows(plan, 200))
            writer.add_text("charts/plan", head + body, step)


def _int_histogram(values: Sequence[int], top: int) -> tuple[list[int], list[float]]:
    """Counts per integer value 1..top with bin edges at half-integers (a numpy-style pair)."""
    counts = [0] * top
    for v in values:
        counts[max(v, 1) - 1] += 1
    edges = [i + 0.5 for i in range(top + 1)]
    return counts, edges
