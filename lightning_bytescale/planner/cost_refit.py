"""Refine the cost model from the run's own micro-batch times: a robust, bounded, deterministic refit.

A profiled (or preset) model is a guess about the run; the run itself measures every
micro-batch.  :class:`CostRefit` keeps a sliding window of the last ``window`` steps' samples
(the :class:`~lightning_bytescale.planner.cost_features.Work` of a micro-batch, or of a sum of
micro-batches such as a pipeline stage's, and its measured busy seconds) and after each step
refits

* the compute coefficients ``a``, ``b``, ``g`` (per layer, the whole model's ``num_layers``
  times) by non-negative least squares on relative residuals, made robust by iterated
  reweighting with Tukey's biweight (``c = 4.685``, which gives a wild sample no weight at all;
  the scale ``1.4826 x`` the median absolute relative residual) from a start that neither a
  few samples far too slow nor a few far too fast can drag (:func:`_robust_nnls`);
* the exposed-communication coefficient: one factor ``m`` on the time of every byte on the
  links (both bandwidths divided by ``m``), the minimum of the same biweight loss found on a
  geometric grid over ``[1/F^2, F^2]`` and refined by golden section (only when the model has a
  communication term and the window has group micro-batches);

then clamps each coefficient to within a factor ``F = max_change`` of the model in force
(a coefficient at 0 may grow until its term adds ``F - 1`` times the old prediction of the
median sample) and reports what it clamped.

**Deterministic.**  Every sum is ``math.fsum`` (exactly rounded, so independent of order and
of the BLAS), products are elementwise IEEE operations, the small normal equations are solved
in Python floats, and the iteration counts are fixed: two calls with the same samples give the
same model bit for bit, on any rank, lane or stage.

**The lag.**  The loader's worker processes plan steps ahead of training, so a model fitted
from the steps up to ``k`` is applied from step ``k + lag`` on (:meth:`CostRefit.model_for_step`):
a step's model is final once the refit has seen step ``k - lag``, and never changes after.
:class:`CostSchedule` is what the workers need of it (the versions and the last step seen),
written to a file by :func:`write_schedule` and read by :func:`wait_for_model`.

**Resume.**  :meth:`CostRefit.state_dict` (JSON-ready; floats exact) holds the versions and the
window, so a run resumed from it plans every step as the uninterrupted run would, given the
same measurements.

Switched off (``RefitConfig(enabled=False)``) the base model plans every step.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from lightning_bytescale.planner.cost_features import (
    ErrorSummary,
    Work,
    predict_seconds,
    relative_errors,
)
from lightning_bytescale.planner.cost_model import CostModel, cost_model_from_json
from lightning_bytescale.planner.errors import CostRefitError

REFIT_FORMAT = "bytescale-cost-refit/1"
SCHEDULE_FORMAT = "bytescale-cost-schedule/1"

TUKEY_C = 4.685
MAD_TO_SIGMA = 1.4826
MIN_SCALE = 1e-3  # relative residuals below 0.1% are noise-free enough: no finer scale
ROBUST_ITERATIONS = 8  # biweight reweightings after the start
COEFFICIENTS = ("a", "b", "g")


@dataclass(frozen=True)
class RefitConfig:
    """How the cost model is refitted from the run (docs/cost-model.md, "Refinement from the run")."""

    enabled: bool = True
    """``False``: the base model plans every step (the refit only records nothing)."""

    window: int = 20
    """Steps whose samples the fit uses (the last ``window`` observed)."""

    lag: int = 2
    """A model fitted from steps ``<= k`` plans steps ``>= k + lag``; at least the loader's
    look-ahead plus one (:func:`lag_for_loader`)."""

    max_change: float = 2.0
    """``F``: no coefficient changes by more than this factor in one update (clamped, reported)."""

    warmup_steps: int = 2
    """The run's first steps (global steps ``< warmup_steps``) are not sampled: start-up,
    allocator growth and kernel selection make them slow."""

    min_samples: int = 8
    """Fewer usable samples in the window (or fewer than 3 distinct token counts): no update."""

    max_samples_per_step: int = 128
    """A step's samples beyond this are thinned, evenly by index (bounds the refit's time)."""

    fit_comm: bool = True
    """Refit the communication factor (when the model has a communication term)."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise CostRefitError(f"refit enabled must be True or False, got {self.enabled!r}")
        if not isinstance(self.fit_comm, bool):
            raise CostRefitError(f"refit fit_comm must be True or False, got {self.fit_comm!r}")
        for name, least in (("window", 1), ("lag", 1), ("warmup_steps", 0), ("min_samples", 3)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CostRefitError(f"refit {name} must be an integer >= {least}, got {value!r}")
        cap = self.max_samples_per_step
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise CostRefitError(f"refit max_samples_per_step must be an integer >= 1, got {cap!r}")
        f = self.max_change
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 1:
            raise CostRefitError(
                f"refit max_change must be a finite factor > 1 (2.0: at most halved or doubled per update), got {f!r}"
            )

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> RefitConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CostRefitError(f"unknown refit option(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


def lag_for_loader(num_workers: int, prefetch_factor: int | None = None) -> int:
    """The smallest safe lag for a step loader: the steps its workers plan ahead, plus one.

    A torch ``DataLoader`` with ``w`` workers keeps ``w x prefetch_factor`` (default 2) steps
    requested ahead of the one training; inline (``num_workers=0``) it plans the next step only
    when asked.  A step ``j`` is requested while step ``j - look_ahead`` trains, so its model must
    be fitted from steps up to ``j - look_ahead - 1``.
    """
    if num_workers < 0:
        raise CostRefitError(f"num_workers must be >= 0, got {num_workers}")
    ahead = 0 if num_workers == 0 else num_workers * (2 if prefetch_factor is None else int(prefetch_factor))
    return ahead + 1


@dataclass(frozen=True)
class Sample:
    """Measured busy ``seconds`` of ``work`` (one micro-batch, or several summed: a stage's)."""

    seconds: float
    work: tuple[Work, ...]

    def to_json(self) -> list:
        return [self.seconds, [w.to_row() for w in self.work]]

    @classmethod
    def from_json(cls, data: Sequence) -> Sample:
        seconds, rows = data
        return cls(float(seconds), tuple(Work.from_row(r) for r in rows))


def step_samples(
    work_by_rank: Sequence[Sequence[Work | Sequence[float]]], seconds_by_rank: Sequence[Sequence[float]]
) -> list[Sample]:
    """One sample per micro-batch of every rank: ``work_by_rank[r][i]`` (a :class:`Work` or its
    row) measured ``seconds_by_rank[r][i]``; a time that is not finite or not positive is left out."""
    if len(work_by_rank) != len(seconds_by_rank):
        raise CostRefitError(
            f"features of {len(work_by_rank)} ranks but times of {len(seconds_by_rank)}; give one list per rank"
        )
    out: list[Sample] = []
    for rank, (works, seconds) in enumerate(zip(work_by_rank, seconds_by_rank)):
        if len(works) != len(seconds):
            raise CostRefitError(
                f"rank {rank} planned {len(works)} micro-batches but {len(seconds)} times were measured; "
                "give one time per micro-batch, in plan order"
            )
        for w, s in zip(works, seconds):
            s = float(s)
            if math.isfinite(s) and s > 0:
                out.append(Sample(s, (w if isinstance(w, Work) else Work.from_row(w),)))
    return out


@dataclass(frozen=True)
class Version:
    """A model and the steps it plans: from ``apply_from`` until the next version's."""

    apply_from: int
    fitted_through: int  # the last step whose samples it was fitted on (-1: the base model)
    cost_model: CostModel

    def to_json_dict(self) -> dict:
        return {
            "apply_from": self.apply_from,
            "fitted_through": self.fitted_through,
            "cost_model": self.cost_model.to_json_dict(),
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> Version:
        return cls(
            int(data["apply_from"]),
            int(data["fitted_through"]),
            CostModel.from_json_dict(dict(data["cost_model"])),
        )


@dataclass(frozen=True)
class CostSchedule:
    """Which model plans which step: what the loader's workers need of a :class:`CostRefit`."""

    versions: tuple[Version, ...]
    last_step: int  # the last step the refit has seen (-1: none)
    lag: int
    enabled: bool = True

    def ready(self, step: int) -> bool:
        """Whether the model of ``step`` is final (no later observation can change it)."""
        return not self.enabled or step <= self.last_step + self.lag

    def model_for_step(self, step: int) -> CostModel:
        """The model that plans ``step``: the newest version applying from ``step`` or before."""
        if not self.enabled:
            return self.versions[0].cost_model
        if not self.ready(step):
            raise CostRefitError(
                f"the cost model of step {step} is not known yet: it is fitted from the steps up to "
                f"{step - self.lag} (lag {self.lag}) and the refit has seen steps up to {self.last_step}; "
                "plan a step only after the step lag steps before it was observed (raise the lag to at least "
                "the loader's look-ahead plus one: lag_for_loader)"
            )
        if step < self.versions[0].apply_from:
            raise CostRefitError(
                f"the cost model of step {step} is no longer kept (the oldest kept applies from step "
                f"{self.versions[0].apply_from}); the refit answers for the last step it observed and later ones"
            )
        chosen = self.versions[0]
        for v in self.versions:
            if v.apply_from <= step:
                chosen = v
        return chosen.cost_model

    def to_json_dict(self) -> dict:
        return {
            "format": SCHEDULE_FORMAT,
            "enabled": self.enabled,
            "lag": self.lag,
            "last_step": self.last_step,
            "versions": [v.to_json_dict() for v in self.versions],
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> CostSchedule:
        if not isinstance(data, Mapping) or data.get("format") not in (SCHEDULE_FORMAT, REFIT_FORMAT):
            raise CostRefitError(
                f"not a cost schedule (format {data.get('format') if isinstance(data, Mapping) else None!r}); "
                f"expected {SCHEDULE_FORMAT!r}"
            )
        try:
            lag = int(data["lag"]) if "lag" in data else int(data["config"]["lag"])
            enabled = bool(data["enabled"]) if "enabled" in data else bool(data["config"]["enabled"])
            versions = tuple(Version.from_json_dict(v) for v in data["versions"])
            return cls(versions, int(data["last_step"]), lag, enabled)
        except (KeyError, TypeError, ValueError) as err:
            raise CostRefitError(
                f"a cost schedule that cannot be read ({type(err).__name__}: {err})"
            ) from err


@dataclass
class RefitReport:
    """What one observed step did to the model (for the log line and the telemetry)."""

    step: int
    updated: bool
    reason: str
    samples: int = 0  # usable samples in the window
    applies_from: int | None = None
    coefficients: dict[str, float] = field(default_factory=dict)  # the model in force after (a, b, g, comm)
    previous: dict[str, float] = field(default_factory=dict)
    clamped: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (fitted, kept)
    error_before: ErrorSummary | None = None  # the window under the previous model
    error_after: ErrorSummary | None = None  # the window under the new one

    def line(self) -> str:
        """One line for a log."""
        if not self.updated:
            return f"cost refit at step {self.step}: no update ({self.reason})"
        coef = ", ".join(f"{k}={v:.4g}" for k, v in self.coefficients.items())
        err = ""
        if self.error_before is not None and self.error_after is not None:
            err = f"; window median error {self.error_before.median:.1%} -> {self.error_after.median:.1%}"
        clamp = ""
        if self.clamped:
            clamp = "; clamped " + ", ".join(
                f"{k} (fitted {want:.4g}, kept {got:.4g})" for k, (want, got) in self.clamped.items()
            )
        return (
            f"cost refit at step {self.step} on {self.samples} samples: {coef} from step {self.applies_from}"
            f"{err}{clamp}"
        )

    def to_json_dict(self) -> dict:
        d = asdict(self)
        d["clamped"] = {k: list(v) for k, v in self.clamped.items()}
        d["error_before"] = None if self.error_before is None else self.error_before.to_json_dict()
        d["error_after"] = None if self.error_after is None else self.error_after.to_json_dict()
        return d


def coefficients(cost: CostModel, base: CostModel | None = None) -> dict[str, float]:
    """``a``, ``b``, ``g`` and, when it has links, the communication factor ``comm`` of ``cost``
    against ``base`` (how many times slower its links are)."""
    out = {"a": cost.a, "b": cost.b, "g": cost.g}
    if base is not None and base.models_comm and cost.models_comm:
        out["comm"] = _comm_factor(cost, base)
    return out


def _comm_factor(cost: CostModel, base: CostModel) -> float:
    ref = base.bandwidth(False)
    now = cost.bandwidth(False)
    return 1.0 if ref is None or now is None else ref / now


class CostRefit:
    """The refit's state: the base model, the versions fitted since, the window of samples."""

    def __init__(self, base: CostModel, config: RefitConfig | None = None) -> None:
        if not isinstance(base, CostModel):
            raise CostRefitError(f"the refit starts from a CostModel, got {type(base).__name__}")
        self.base = base
        self.config = config if config is not None else RefitConfig()
        self.versions: list[Version] = [Version(0, -1, base)]
        self.window: list[tuple[int, list[Sample]]] = []
        self.last_step = -1

    # ------------------------------------------------------------------ reading
    @property
    def current(self) -> CostModel:
        """The newest model (what plans the steps from its ``apply_from`` on)."""
        return self.versions[-1].cost_model

    def schedule(self) -> CostSchedule:
        return CostSchedule(tuple(self.versions), self.last_step, self.config.lag, self.config.enabled)

    def model_for_step(self, step: int) -> CostModel:
        """The model that plans ``step`` (final once step ``step - lag`` was observed)."""
        return self.schedule().model_for_step(step)

    # ------------------------------------------------------------------ the refit
    def observe(self, step: int, samples: Iterable[Sample]) -> RefitReport:
        """Add one step's samples, refit, and publish a version applying from ``step + lag``.

        Steps are observed once each, in increasing order (a step without samples may be skipped).
        """
        step = int(step)
        if step <= self.last_step:
            raise CostRefitError(
                f"step {step} observed after step {self.last_step}: observe every step once, in order"
            )
        self.last_step = step
        cfg = self.config
        previous = self.current
        report = RefitReport(step, False, "", coefficients=coefficients(previous, self.base))
        if not cfg.enabled:
            report.reason = "refit off"
            return report
        if step < cfg.warmup_steps:
            report.reason = f"warm-up (steps < {cfg.warmup_steps} are not sampled)"
            self._prune()
            return report
        kept = _thin([s for s in samples if _usable(s)], cfg.max_samples_per_step)
        self.window.append((step, kept))
        self.window = [(k, s) for k, s in self.window if k > step - cfg.window]
        pool = [s for _, ss in self.window for s in ss]
        report.samples = len(pool)
        if len(pool) < cfg.min_samples or len({_tokens(s) for s in pool}) < 3:
            report.reason = (
                f"too few samples ({len(pool)} usable, at least {cfg.min_samples} with 3 distinct token counts "
                "needed)"
            )
            self._prune()
            return report
        win = _Window(pool, previous.num_layers)
        model, clamped = _refit_window(previous, self.base, pool, win, cfg)
        self.versions.append(Version(step + cfg.lag, step, model))
        self._prune()
        measured = win.y.tolist()
        report.updated, report.reason = True, "fitted"
        report.applies_from = step + cfg.lag
        report.previous = report.coefficients
        report.coefficients = coefficients(model, self.base)
        report.clamped = clamped
        report.error_before = relative_errors(win.predict(previous).tolist(), measured)
        report.error_after = relative_errors(win.predict(model).tolist(), measured)
        return report

    def _prune(self) -> None:
        """Drop the versions that planned only steps before the last observed one."""
        keep = 0
        for i, v in enumerate(self.versions):
            if v.apply_from <= self.last_step:
                keep = i
        self.versions = self.versions[keep:]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """JSON-ready; :meth:`from_state_dict` restores it exactly (floats round-trip)."""
        return {
            "format": REFIT_FORMAT,
            "config": asdict(self.config),
            "base": self.base.to_json_dict(),
            "last_step": self.last_step,
            "versions": [v.to_json_dict() for v in self.versions],
            "window": [{"step": k, "samples": [s.to_json() for s in ss]} for k, ss in self.window],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], config: RefitConfig | None = None) -> CostRefit:
        """The refit a checkpoint saved.  ``config`` (default: the saved one) governs later fits;
        the versions already published are kept as they are, so the steps they plan do not change."""
        if not isinstance(state, Mapping) or state.get("format") != REFIT_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise CostRefitError(f"not a saved cost refit (format {found!r}); expected {REFIT_FORMAT!r}")
        try:
            saved = RefitConfig.from_json_dict(state["config"])
            refit = cls(CostModel.from_json_dict(dict(state["base"])), config or saved)
            refit.last_step = int(state["last_step"])
            refit.versions = [Version.from_json_dict(v) for v in state["versions"]]
            refit.window = [
                (int(w["step"]), [Sample.from_json(s) for s in w["samples"]]) for w in state["window"]
            ]
        except CostRefitError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise CostRefitError(
                f"the saved cost refit cannot be read ({type(err).__name__}: {err}); resume from a checkpoint "
                "written by this version, or start the refit afresh"
            ) from err
        if not refit.versions:
            raise CostRefitError("the saved cost refit has no model version")
        return refit


# ====================================================================== the fit


def _usable(sample: Sample) -> bool:
    """A sample the compute fit can use: a positive finite time, work, no offloaded activations
    (their copies are the host link's, which Eq. 3 hides; one that is not would bias ``a`` and ``b``)."""
    return (
        math.isfinite(sample.seconds)
        and sample.seconds > 0
        and bool(sample.work)
        and all(w.offload_ratio <= 0 for w in sample.work)
    )


def _tokens(sample: Sample) -> float:
    return math.fsum(w.tokens for w in sample.work)


def _thin(samples: list[Sample], cap: int) -> list[Sample]:
    """At most ``cap`` samples, evenly spaced by index (deterministic)."""
    n = len(samples)
    if n <= cap:
        return samples
    return [samples[(i * n) // cap] for i in range(cap)]


def predict_sample(cost: CostModel, sample: Sample) -> float:
    """Whole-model seconds ``cost`` gives the work of ``sample``."""
    return math.fsum(predict_seconds(cost, w) for w in sample.work)


def _has_comm(sample: Sample) -> bool:
    return any(w.size > 1 and (w.transfer_bytes > 0 or w.exchange_bytes > 0) for w in sample.work)


class _Window:
    """The window's samples as arrays (one entry per micro-batch; ``bounds`` maps them to samples),
    so a candidate model's exposed communication is a few elementwise operations."""

    def __init__(self, pool: Sequence[Sample], num_layers: int) -> None:
        works = [w for s in pool for w in s.work]
        self.L = float(num_layers)
        self.single = all(len(s.work) == 1 for s in pool)
        self.bounds = list(itertools.accumulate([0] + [len(s.work) for s in pool]))
        self.area = np.array([w.area for w in works], dtype=np.float64)
        self.any_group = any(w.size > 1 for w in works)
        self.transfer = np.array([w.transfer_bytes if w.size > 1 else 0.0 for w in works], dtype=np.float64)
        self.t_intra = np.array([w.transfer_intra for w in works], dtype=bool)
        self.exchange = np.array([w.exchange_bytes if w.size > 1 else 0.0 for w in works], dtype=np.float64)
        self.e_intra = np.array([w.exchange_intra for w in works], dtype=bool)
        self.y = np.array([s.seconds for s in pool], dtype=np.float64)
        # whole-model columns of a, b, g: L sum area, L sum tokens, L count
        if self.single:
            cols = [[w.area for w in works], [w.tokens for w in works], [1.0] * len(works)]
        else:
            cols = [
                [math.fsum(w.area for w in s.work) for s in pool],
                [math.fsum(w.tokens for w in s.work) for s in pool],
                [float(len(s.work)) for s in pool],
            ]
        self.X = np.array(cols, dtype=np.float64).T * self.L

    def predict(self, cost: CostModel) -> np.ndarray:
        """Whole-model seconds ``cost`` gives every sample."""
        return _dot(self.X, (cost.a, cost.b, cost.g)) + self.exposed(cost)

    def _per_sample(self, per_work: np.ndarray) -> np.ndarray:
        if self.single:
            return per_work
        return np.array([math.fsum(per_work[i:j].tolist()) for i, j in itertools.pairwise(self.bounds)])

    def exposed(self, cost: CostModel, factor: float = 1.0) -> np.ndarray:
        """Whole-model communication seconds of every sample that nothing hides, under ``cost``
        with its links ``factor`` times slower."""
        out = np.zeros_like(self.area)
        bw_in, bw_out = cost.bandwidth(True), cost.bandwidth(False)
        if self.any_group and bw_in is not None and bw_out is not None:
            bw_in, bw_out = bw_in / factor, bw_out / factor
            transfer = self.transfer / np.where(self.t_intra, bw_in, bw_out) - self.area * cost.a
            out = np.where(transfer > 0, transfer, 0.0) + self.exchange / np.where(
                self.e_intra, bw_in, bw_out
            )
        return self._per_sample(out) * self.L


def refit_model(
    current: CostModel, base: CostModel, pool: Sequence[Sample], config: RefitConfig
) -> tuple[CostModel, dict[str, tuple[float, float]]]:
    """The model the window ``pool`` asks for, clamped to within ``config.max_change`` of
    ``current``; and what was clamped (name -> (fitted, kept)).

    Three passes: ``a``, ``b``, ``g`` on the measured times less the exposed communication of
    ``current``; the communication factor on what the new compute leaves; ``a``, ``b``, ``g``
    again under the new factor."""
    return _refit_window(current, base, pool, _Window(pool, current.num_layers), config)


def _refit_window(
    current: CostModel, base: CostModel, pool: Sequence[Sample], win: _Window, config: RefitConfig
) -> tuple[CostModel, dict[str, tuple[float, float]]]:
    """:func:`refit_model` on ``pool`` already laid out as ``win``."""
    F = float(config.max_change)
    base_w = 1.0 / (win.y * win.y)  # relative residuals

    def compute_fit(model: CostModel) -> tuple[CostModel, float, dict[str, tuple[float, float]]]:
        target = win.y - win.exposed(model)
        theta, scale = _robust_nnls(win.X, target, win.y, base_w)
        fitted = theta if theta is not None else (model.a, model.b, model.g)
        clamped: dict[str, tuple[float, float]] = {}
        new = _clamped(current, win.X, fitted, F, clamped)
        return (
            new.with_(bandwidth_intra=model.bandwidth_intra, bandwidth_inter=model.bandwidth_inter),
            scale,
            clamped,
        )

    model, scale, clamped = compute_fit(current)
    comm_pool = [s for s in pool if _has_comm(s)] if config.fit_comm and current.models_comm else []
    if comm_pool:
        wanted = _comm_search(model, _Window(comm_pool, current.num_layers), scale, F)
        factor = min(max(wanted, 1.0 / F), F)
        if factor != 1.0:
            model, _, clamped = compute_fit(_scaled_links(model, current, factor))
        if factor != wanted:
            ref = _comm_factor(current, base)
            clamped["comm"] = (wanted * ref, factor * ref)
    return model, clamped


def _scaled_links(model: CostModel, current: CostModel, factor: float) -> CostModel:
    """``model`` with ``current``'s links ``factor`` times slower."""
    return model.with_(
        bandwidth_intra=None if current.bandwidth_intra is None else current.bandwidth_intra / factor,
        bandwidth_inter=None if current.bandwidth_inter is None else current.bandwidth_inter / factor,
    )


def _dot(X: np.ndarray, theta: Sequence[float]) -> np.ndarray:
    """``X @ theta`` elementwise (a BLAS product may round differently from one machine to another)."""
    out = X[:, 0] * theta[0]
    for j in range(1, X.shape[1]):
        out = out + X[:, j] * theta[j]
    return out


def _clamped(
    current: CostModel,
    X: np.ndarray,
    fitted: Sequence[float],
    F: float,
    clamped: dict[str, tuple[float, float]],
) -> CostModel:
    """``current`` with ``a``, ``b``, ``g`` moved to ``fitted``, each within a factor ``F``."""
    old_pred = _median(_dot(X, (current.a, current.b, current.g)))
    kept = []
    for k, (name, new) in enumerate(zip(COEFFICIENTS, fitted)):
        old = getattr(current, name)
        if old > 0:
            lo, hi = old / F, old * F
        else:  # a term the model did not have may grow until it adds (F - 1) x the median prediction
            col = [float(v) for v in X[:, k] if v > 0]
            lo, hi = 0.0, ((F - 1) * old_pred / _median(col) if col and old_pred > 0 else 0.0)
        got = min(max(float(new), lo), hi)
        if got != new:
            clamped[name] = (float(new), got)
        kept.append(got)
    a, b, g = kept
    if a == 0 and b == 0 and g == 0:  # a model with no time at all is refused: keep the old one
        return current
    return current.with_(a=a, b=b, g=g)


def _comm_search(model: CostModel, win: _Window, scale: float, F: float) -> float:
    """The factor ``m`` on the links' time that fits ``win`` best by the biweight loss, searched
    over ``[1/F^2, F^2]`` (so that a clamp to ``[1/F, F]`` can say what was wanted): a geometric
    grid of ratio ``F^(1/16)``, then golden-section refinement between the best point's neighbours.
    Only ``sqrt`` and arithmetic, both exactly rounded: the same factor on every machine."""
    residual = win.y - _dot(win.X, (model.a, model.b, model.g))  # measured minus compute
    sc = max(scale, MIN_SCALE)

    def loss(m: float) -> float:
        u = (residual - win.exposed(model, m)) / win.y / sc
        v = u / TUKEY_C
        t = 1.0 - v * v
        rho = np.where(np.abs(u) < TUKEY_C, 1.0 - t * t * t, 1.0)  # Tukey's rho over c^2 / 6
        return math.fsum(rho.tolist())

    step = math.sqrt(math.sqrt(math.sqrt(math.sqrt(F))))
    up, down = [1.0], [1.0]
    for _ in range(32):
        up.append(up[-1] * step)
        down.append(down[-1] / step)
    grid = down[:0:-1] + up  # ascending, 1.0 at index 32
    losses = [loss(m) for m in grid]
    i = min(range(len(grid)), key=lambda j: (losses[j], abs(j - 32)))  # ties: nearest to 1
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    best, best_loss = grid[i], losses[i]
    golden = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(24):
        x1, x2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        l1, l2 = loss(x1), loss(x2)
        if l1 <= l2:
            hi, cand, cand_loss = x2, x1, l1
        else:
            lo, cand, cand_loss = x1, x2, l2
        if cand_loss < best_loss:
            best, best_loss = cand, cand_loss
    return best


def _median(values: Sequence[float] | np.ndarray) -> float:
    """The median (the mean of the two middle values for an even count): a sort, exact, so the
    same bits on every machine, for a list or a float64 array."""
    v = np.sort(values) if isinstance(values, np.ndarray) else sorted(values)
    n = len(v)
    if n == 0:
        return math.nan
    return float(v[n // 2]) if n % 2 else (float(v[n // 2 - 1]) + float(v[n // 2])) / 2


def _robust_nnls(
    X: np.ndarray, target: np.ndarray, y: np.ndarray, base_w: np.ndarray
) -> tuple[tuple[float, float, float] | None, float]:
    """Non-negative ``theta`` of ``target ~ X theta`` by iterated reweighting on the residuals
    relative to the measured ``y``; and the final scale of the relative residuals.

    The start is the better, by the median absolute relative residual, of least squares on
    relative residuals (which a sample far too fast drags: 16 times too fast, its residual is
    15, and its leverage as large) and on absolute ones (which a sample far too slow drags);
    from it, Tukey's biweight (which gives a wild sample no weight at all), the scale
    ``1.4826 x`` the median absolute relative residual, re-estimated at every iteration."""
    starts = [t for t in (_nnls(X, target, base_w), _nnls(X, target, base_w * y * y)) if t is not None]
    if not starts:
        return None, 1.0
    theta = min(starts, key=lambda t: _median(np.abs((target - _dot(X, t)) / y)))
    scale = 1.0
    for _ in range(ROBUST_ITERATIONS):
        rel = (target - _dot(X, theta)) / y
        scale = max(MAD_TO_SIGMA * _median(np.abs(rel)), MIN_SCALE)
        v = np.abs(rel) / scale / TUKEY_C
        t = 1.0 - v * v
        robust = np.where(v < 1.0, t * t, 0.0)
        if int(np.count_nonzero(robust > 0)) < X.shape[1]:
            break
        nxt = _nnls(X, target, base_w * robust)
        if nxt is None:
            break
        theta = nxt
    return theta, scale


def _nnls(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float, float] | None:
    """Weighted least squares with every coefficient >= 0: the best of the column subsets whose
    unconstrained solution is non-negative (three columns: seven subsets), solved in Python floats
    on exactly rounded sums (``math.fsum``)."""
    k = X.shape[1]
    scale = [float(np.max(np.abs(X[:, j]))) for j in range(k)]
    cols = [j for j in range(k) if scale[j] > 0]
    Z = [X[:, j] / scale[j] if scale[j] > 0 else X[:, j] for j in range(k)]
    wz = [w * Z[i] for i in range(k)]
    gram = [[0.0] * k for _ in range(k)]
    for i in range(k):
        for j in range(i, k):
            gram[i][j] = gram[j][i] = math.fsum((wz[i] * Z[j]).tolist())
    rhs = [math.fsum((wz[i] * y).tolist()) for i in range(k)]
    yy = math.fsum((w * y * y).tolist())
    best: tuple[float, list[float]] | None = None
    for size in range(len(cols), 0, -1):
        for subset in itertools.combinations(cols, size):
            sol = _solve([[gram[i][j] for j in subset] for i in subset], [rhs[i] for i in subset])
            if sol is None or any(v < 0 for v in sol):
                continue
            # weighted squared error y'Wy - 2 t'h + t'Gt, from the sums above
            terms = [yy]
            for p, i in enumerate(subset):
                terms.append(-2.0 * sol[p] * rhs[i])
                for q, j in enumerate(subset):
                    terms.append(sol[p] * sol[q] * gram[i][j])
            sse = math.fsum(terms)
            if best is None or sse < best[0]:
                full = [0.0] * k
                for j, v in zip(subset, sol):
                    full[j] = v
                best = (sse, full)
    if best is None:
        return None
    a, b, g = (best[1][j] / scale[j] if scale[j] > 0 else 0.0 for j in range(k))
    return a, b, g


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` for a (numerically) singular system."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    top = max((abs(a[i][i]) for i in range(n)), default=0.0)
    if top <= 0:
        return None
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) <= 1e-12 * top:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for j in range(c, n + 1):
                a[r][j] -= f * a[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - math.fsum(a[r][j] * x[j] for j in range(r + 1, n))) / a[r][r]
    return x


# ====================================================================== files


def write_schedule(path: str | os.PathLike, schedule: CostSchedule | CostRefit) -> Path:
    """Write ``schedule`` (or a refit's) to ``path`` atomically: a reader sees the old file or the new."""
    sched = schedule.schedule() if isinstance(schedule, CostRefit) else schedule
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(sched.to_json_dict(), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_schedule(path: str | os.PathLike) -> CostSchedule:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CostRefitError(f"cannot read the cost schedule {str(path)!r}: {err}") from err
    return CostSchedule.from_json_dict(data)


def wait_for_model(
    path: str | os.PathLike, step: int, *, timeout_s: float = 600.0, poll_s: float = 0.005
) -> CostModel:
    """The model of ``step`` from the schedule file at ``path``, waiting (up to ``timeout_s``) until
    the refit has published it: what a loader worker calls before planning ``step``."""
    deadline = time.monotonic() + timeout_s
    while True:
        sched = read_schedule(path)
        if sched.ready(step):
            return sched.model_for_step(step)
        if time.monotonic() > deadline:
            raise CostRefitError(
                f"waited {timeout_s:.0f} s for the cost model of step {step} in {str(path)!r}, which the refit "
                f"publishes after step {step - sched.lag} (it has seen steps up to {sched.last_step}): the lag "
                f"({sched.lag}) is shorter than the loader's look-ahead; raise it (lag_for_loader)"
            )
        time.sleep(poll_s)


def refined_cost_model(data: Any) -> CostModel:
    """The newest model in what a run leaves behind: a saved refit (:meth:`CostRefit.state_dict`),
    a schedule, a checkpoint dict or telemetry object holding one at any depth (up to 6), a list of
    telemetry records (the last that holds one), a ``bytescale-profile`` file's dict or a
    cost-model dict."""
    found = _find_refined(data, 0)
    if found is None:
        raise CostRefitError(
            "found no cost model in it: expected a saved cost refit (format "
            f"{REFIT_FORMAT!r}), a schedule, a telemetry record with 'cost_refit' or 'cost_model', or a "
            "cost-model file"
        )
    return found


def _find_refined(data: Any, depth: int) -> CostModel | None:
    if depth > 6:
        return None
    if isinstance(data, Mapping):
        if data.get("format") in (REFIT_FORMAT, SCHEDULE_FORMAT):
            versions = data.get("versions") or []
            if not versions:
                raise CostRefitError("the saved cost refit has no model version")
            return Version.from_json_dict(versions[-1]).cost_model
        for key in ("cost_refit", "cost_schedule"):
            if key in data:
                got = _find_refined(data[key], depth + 1)
                if got is not None:
                    return got
        if "cost_model" in data:
            return cost_model_from_json(data)
        if "a" in data and "b" in data:
            return CostModel.from_json_dict(dict(data))
        for value in data.values():
            if isinstance(value, (Mapping, list, tuple)):
                got = _find_refined(value, depth + 1)
                if got is not None:
                    return got
        return None
    if isinstance(data, (list, tuple)):
        for value in reversed(data):
            if isinstance(value, (Mapping, list, tuple)):
                got = _find_refined(value, depth + 1)
                if got is not None:
                    return got
    return None


__all__ = [
    "REFIT_FORMAT",
    "SCHEDULE_FORMAT",
    "CostRefit",
    "CostSchedule",
    "RefitConfig",
    "RefitReport",
    "Sample",
    "Version",
    "coefficients",
    "lag_for_loader",
    "predict_sample",
    "read_schedule",
    "refined_cost_model",
    "refit_model",
    "step_samples",
    "wait_for_model",
    "write_schedule",
]
