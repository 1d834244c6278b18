"""The planner registry: planner names -> planning functions, shared by every entry point.

It lives apart from :mod:`.planners` so that :class:`~.config.PlannerConfig` can check a
planner name (and a planner's own options) without importing every planner.  Built-in
planners are registered by dotted path and imported on first use; :func:`register_planner`
adds more, and a name registered there works everywhere a planner name is accepted: the
strategy, the data module, the recipes, ``make_plan`` and the command lines.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from lightning_bytescale.planner.errors import PlanError

PlannerFn = Callable[..., "object"]

#: The options :func:`~.planners.make_plan` passes to every planner by keyword.  A planner's
#: own extra options are the other keyword parameters its function names.
COMMON_OPTIONS = (
    "world_size",
    "capacity",
    "cost_model",
    "cp_size",
    "seed",
    "offload",
    "slack",
    "num_buckets",
    "pipeline_degree",
    "max_micro_batches",
    "ranks_per_node",
    "comm_aware",
)

_REGISTRY: dict[str, PlannerFn | str] = {
    "static": "lightning_bytescale.planner.planners:plan_static",
    "naive": "lightning_bytescale.planner.planners:plan_naive",
    "balance": "lightning_bytescale.planner.balance:plan_balance",
    "megatron_dcp": "lightning_bytescale.planner.peers:plan_megatron_dcp",
    "verl_kk": "lightning_bytescale.planner.peers:plan_verl_kk",
    "lpt": "lightning_bytescale.planner.peers:plan_lpt",
}


def register_planner(name: str, fn: PlannerFn | None = None):
    """Register ``fn(lengths, *, world_size, capacity, **options) -> Plan`` under ``name``.

    Usable as a decorator (``@register_planner("mine")``).  The function receives every
    :data:`COMMON_OPTIONS` by keyword and should accept ``**kwargs`` for those it ignores.
    Options of its own are the keyword parameters it names (``def mine(lengths, *, world_size,
    capacity, my_knob=1, **kwargs)``): ``PlannerConfig(planner="mine", options={"my_knob": 2})``
    or ``make_plan(..., planner="mine", my_knob=2)`` pass them; other names are refused.
    """
    if not isinstance(name, str) or not name:
        raise PlanError(f"a planner name must be a non-empty string, got {name!r}")

    def deco(f: PlannerFn) -> PlannerFn:
        if not callable(f):
            raise PlanError(f"register_planner({name!r}) needs a function, got {type(f).__name__}")
        _REGISTRY[name] = f
        return f

    return deco if fn is None else deco(fn)


def available_planners() -> list[str]:
    """Every registered planner name, sorted."""
    return sorted(_REGISTRY)


def planner_names() -> list[str]:
    """Every registered planner name in registration order: the built-ins (``static``,
    ``naive``, ``balance``, then the peers) first, as error messages list them."""
    return list(_REGISTRY)


def get_planner(name: str) -> PlannerFn:
    """The planning function registered as ``name`` (imported on first use)."""
    fn = _REGISTRY.get(name)
    if fn is None:
        raise PlanError(f"unknown planner {name!r}; choose from {available_planners()}")
    if isinstance(fn, str):
        mod, attr = fn.split(":")
        fn = getattr(importlib.import_module(mod), attr)
        _REGISTRY[name] = fn
    return fn


def planner_own_options(name: str) -> tuple[str, ...]:
    """The keyword options planner ``name`` takes besides :data:`COMMON_OPTIONS`, sorted."""
    params = list(inspect.signature(get_planner(name)).parameters.values())
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p.name for p in params[1:] if p.kind in kinds]  # the first parameter takes the lengths
    return tuple(sorted(n for n in named if n not in COMMON_OPTIONS))
