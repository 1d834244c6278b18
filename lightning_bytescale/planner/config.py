"""`PlannerConfig`: every planning option in one frozen, validated, documented dataclass.

The strategy, the data module, the Hydra recipe (``strategy.*``), ``make_plan`` and the
command lines all build or take this one object, so an option means the same thing, has the
same default and fails with the same message everywhere.  Unknown option names are errors that
name the closest valid one (``unknown planner option 'slak': did you mean 'slack'?``);
planner names are checked against the registry, so a planner added with
:func:`~lightning_bytescale.planner.registry.register_planner` works from every entry point.

Pure Python: no framework imports (the planner floor).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_bytescale.planner.cost_model import CostModel, OffloadConfig
from lightning_bytescale.planner.cost_spec import resolve_cost_model
from lightning_bytescale.planner.errors import PlanError, PlannerConfigError
from lightning_bytescale.planner.modes import check_modes
from lightning_bytescale.planner.registry import planner_names, planner_own_options


@dataclass(frozen=True)
class PlannerConfig:
    """The options of the HDP planner for one run (docs/planner.md, "PlannerConfig").

    Build it directly, with :meth:`from_options` (flat keyword options, a planner's own
    options included), or change one with :meth:`replace`.  Values are checked and normalised
    when it is made: a cost-model path or dict becomes a :class:`CostModel`, an offload dict an
    :class:`OffloadConfig`.
    """

    planner: str = "balance"
    """A registered planner: ``"balance"`` (HDP, Alg. 2 on the communication-aware cost model),
    ``"naive"`` (HDP, Alg. 1: equal micro-batch counts), ``"static"`` (the fixed DP x CP
    baseline), the peers ``"megatron_dcp"``, ``"verl_kk"``, ``"lpt"``, or any name added with
    ``register_planner``."""

    capacity: int = 8192
    """C: the tokens one rank holds resident in one micro-batch (at least 2: a ring member holds
    two zigzag chunks).  ``bytescale-profile`` measures it for a model and a device."""

    cp_size: int | None = None
    """The ``static`` planner's context-parallel degree (``None``: the smallest divisor of the
    world size on which every sequence fits).  Other planners size rings per sequence."""

    offload: bool | OffloadConfig | None = None
    """Selective activation offload (Eq. 3): ``None`` (the planner's default: on for
    ``balance`` when the cost model has activation coefficients, off otherwise), ``True``,
    ``False``, or an :class:`OffloadConfig` (or its dict) with measured host-link bandwidths."""

    slack: float = 0.05
    """How far (a fraction of an item's time) a rank may lag the least-loaded ones and still
    take the item (``balance``), or how much longer a shrunk ring may run (``naive`` with
    ``offload_policy="pays"``).  A finite number >= 0; 0.05 is Megatron's 5%."""

    cost_model: CostModel | None = None
    """The cost model the planner balances on: ``None`` (the paper's preset), a
    :class:`CostModel`, its dict, a preset name (``"paper"``: the same as ``None``;
    ``"slow-link"``), or the path of a ``bytescale-profile`` JSON file (read once, when the config
    is made, so every rank plans with the same numbers).  Names are a closed set matched exactly;
    any other string is a file, which must exist (``planner/cost_spec.py``).  ``"auto"`` is
    measured at set-up by the torch floor (:func:`lightning_bytescale.profiler.auto_cost_model`)
    and refused here."""

    comm_aware: bool = True
    """Balance on ``linear + max(attention, ring transfer)``; ``False``: the paper's
    compute-only model (the ablation).  Micro-batch time estimates use the full model either
    way."""

    ranks_per_node: int | None = None
    """Ranks per node, for placing a ring inside one node where that ends earlier
    (``None``: the cost model's value)."""

    seed: int | None = None
    """The planning seed (the same on every rank).  ``None``: the caller's seed (the data
    module's ``seed``; 0 for ``make_plan``)."""

    num_buckets: int = 8
    """Buckets of about equal work that ``balance`` cuts the items into, longest first."""

    pipeline_degree: int = 1
    """Pipeline stages per data-parallel replica; above 1 ``balance`` runs PP-Balance on the
    1F1B load model.  ``ByteScaleStrategy(pipeline_parallel_size=P)`` sets it to ``P`` (any other
    value is refused there); the recipes do not run pipelines and keep 1."""

    max_micro_batches: int | None = None
    """With pipelines (``pipeline_degree`` > 1): the most micro-batches one pipeline runs in a
    step, at least ``pipeline_degree``.  torch's pipeline stages keep receive buffers for every
    micro-batch of the step (``2 n C dim`` activation elements on a middle stage,
    :func:`~lightning_bytescale.planner.pipeline.receive_buffer_bytes`), on top of what C bounds;
    ``balance`` gives no pipeline more, and a plan of another planner that needs more is refused.
    ``None``: no bound (the buffers grow with the count; docs/pipelines.md, "Receive buffers and reused stages")."""

    options: Mapping[str, Any] = field(default_factory=dict)
    """A planner's own keyword options, checked against its function's parameters: ``balance``
    takes ``pp_reading``, ``grow_rings`` and ``refine``, ``naive`` takes ``offload_policy``; a registered
    planner takes the keyword parameters it names.  An option of another registered planner is
    kept but not passed (so one set of options can drive several planners); any other name is
    an error naming the closest valid one."""

    def __post_init__(self) -> None:
        put = object.__setattr__
        names = planner_names()
        if not isinstance(self.planner, str) or self.planner not in names:
            close = difflib.get_close_matches(str(self.planner), names, n=1)
            raise PlannerConfigError(
                f"unknown planner {self.planner!r}: planner must be one of {', '.join(names)} (register more with "
                f"lightning_bytescale.planner.register_planner)"
                + (f"; did you mean {close[0]!r}?" if close else "")
            )
        cap = _integer("capacity", self.capacity, "a number of tokens")
        if cap < 2:
            raise PlannerConfigError(
                f"capacity must be >= 2, got {cap}: one rank's capacity must be at least 2 tokens (a ring member "
                "holds two zigzag chunks); raise capacity (bytescale-profile measures it)"
            )
        put(self, "capacity", cap)
        for name in ("cp_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None:
                value = _integer(name, value, "a positive integer or None")
                if value < 1:
                    raise PlannerConfigError(f"{name} must be a positive integer or None, got {value}")
                put(self, name, value)
        for name in ("num_buckets", "pipeline_degree"):
            value = _integer(name, getattr(self, name), "an integer >= 1")
            if value < 1:
                raise PlannerConfigError(f"{name} must be >= 1, got {value}")
            put(self, name, value)
        if self.max_micro_batches is not None:
            cap = _integer("max_micro_batches", self.max_micro_batches, "an integer or None")
            if self.pipeline_degree == 1:
                raise PlannerConfigError(
                    f"max_micro_batches={cap} bounds the micro-batches of a pipeline (its stages' receive buffers), "
                    "but pipeline_degree is 1: plan pipelines (ByteScaleStrategy(pipeline_parallel_size=P) sets "
                    "pipeline_degree) or leave max_micro_batches=None"
                )
            if cap < self.pipeline_degree:
                raise PlannerConfigError(
                    f"max_micro_batches must be >= pipeline_degree ({self.pipeline_degree}), got {cap}: a plan with "
                    "rings pads every pipeline to one micro-batch per stage"
                )
            put(self, "max_micro_batches", cap)
        if self.seed is not None:
            put(self, "seed", _integer("seed", self.seed, "an integer or None"))
        slack = self.slack
        if (
            isinstance(slack, bool)
            or not isinstance(slack, (int, float))
            or not math.isfinite(slack)
            or slack < 0
        ):
            raise PlannerConfigError(f"slack must be a finite number >= 0, got {slack!r}")
        put(self, "slack", float(slack))
        if not isinstance(self.comm_aware, bool):
            raise PlannerConfigError(f"comm_aware must be True or False, got {self.comm_aware!r}")
        put(self, "offload", _offload(self.offload))
        put(self, "cost_model", _cost_model(self.cost_model))
        put(self, "options", self._checked_options())
        if "modes" in self.planner_kwargs():  # balance's attention modes: checked now, not at the first step
            try:
                check_modes(self.options["modes"], self.cost_model or CostModel.paper_preset())
            except PlanError as err:
                raise PlannerConfigError(str(err)) from err

    # ------------------------------------------------------------------ building
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The option names, in declaration order (``options`` included)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, **kwargs: Any) -> PlannerConfig:
        """A config from flat keyword options: the fields, plus the planner's own options.

        A name that is neither a field nor an option of the chosen planner is an error naming
        the closest valid name.  ``options=`` (a mapping) may also hold the planner's own options.
        """
        own = set(cls.field_names())
        values = {k: v for k, v in kwargs.items() if k in own}
        extra = dict(values.pop("options", None) or {})
        extra.update({k: v for k, v in kwargs.items() if k not in own})
        return cls(**values, options=extra)

    def replace(self, **kwargs: Any) -> PlannerConfig:
        """This config with some options changed (the same names :meth:`from_options` takes)."""
        current = {f: getattr(self, f) for f in self.field_names() if f != "options"}
        return type(self).from_options(**{**current, **dict(self.options), **kwargs})

    def as_options(self) -> dict[str, Any]:
        """The config as flat ``make_plan`` keyword options (the planner's own ones included)."""
        out = {f: getattr(self, f) for f in self.field_names() if f != "options"}
        out.update(self.options)
        return out

    # ------------------------------------------------------------------ checks
    def _checked_options(self) -> dict[str, Any]:
        opts = self.options
        if opts is None:
            return {}
        if not isinstance(opts, Mapping):
            raise PlannerConfigError(
                f"options must be a mapping of the planner's own options, got {type(opts).__name__}"
            )
        out = {str(k): v for k, v in opts.items()}
        if not out:
            return out
        accepted = planner_own_options(self.planner)
        mine = [f for f in self.field_names() if f != "options"]
        others: list[str] | None = None
        for key in sorted(out):
            if key in accepted:
                continue
            if key in mine:
                raise PlannerConfigError(
                    f"planner option {key!r} is a PlannerConfig field; pass {key}=... itself, not inside options"
                )
            if others is None:
                others = sorted(
                    {o for name in planner_names() if name != self.planner for o in planner_own_options(name)}
                )
            if key in others:  # another planner's option: kept, not passed (one set drives several planners)
                continue
            close = difflib.get_close_matches(key, [*mine, *accepted, *others], n=1)
            hint = f": did you mean {close[0]!r}?" if close else ""
            takes = f"its own options: {', '.join(accepted)}" if accepted else "it has no options of its own"
            raise PlannerConfigError(
                f"unknown planner option {key!r}{hint} (planner {self.planner!r} takes the options "
                f"{', '.join(mine)}; {takes})"
            )
        return out

    def planner_kwargs(self) -> dict[str, Any]:
        """The entries of :attr:`options` the chosen planner takes (another planner's are left out)."""
        if not self.options:
            return {}
        accepted = planner_own_options(self.planner)
        return {k: v for k, v in self.options.items() if k in accepted}


def _integer(name: str, value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise PlannerConfigError(f"{name} must be {what}, got {value!r}")
    return int(value)


def _offload(value: Any) -> bool | OffloadConfig | None:
    if value is None or isinstance(value, (bool, OffloadConfig)):
        return value
    if isinstance(value, Mapping):
        try:
            return OffloadConfig.from_json_dict(dict(value))
        except (PlanError, TypeError) as err:
            raise PlannerConfigError(
                f"offload {dict(value)!r} is not an OffloadConfig dict ({err}); give layers_per_rank and "
                "optionally bandwidth_d2h / bandwidth_h2d in bytes/s"
            ) from err
    raise PlannerConfigError(
        f"offload must be None, True, False, an OffloadConfig or its dict, got {value!r}"
    )


def _cost_model(value: Any) -> CostModel | None:
    try:
        return resolve_cost_model(value)
    except PlannerConfigError:
        raise
    except (PlanError, TypeError, ValueError) as err:
        raise PlannerConfigError(
            str(err) if isinstance(value, (str, os.PathLike)) else f"cost_model: {err}"
        ) from err


__all__ = ["PlannerConfig", "PlannerConfigError"]
