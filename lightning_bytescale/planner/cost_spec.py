"""What ``cost_model=`` may name, and how a preset's name is told apart from a file's.

Every entry point (``PlannerConfig``, the strategy, the data module, the recipes' YAML,
``bytescale-plan --cost-model``) takes one *cost-model spec*:

* a :class:`~lightning_bytescale.planner.cost_model.CostModel`, or its JSON dict;
* ``None``: the planner's default, the paper preset (unchanged);
* a **name**, from the closed set :data:`COST_MODEL_NAMES`, matched exactly (case included):
  ``"paper"`` (:meth:`CostModel.paper_preset`, the same model ``None`` gives, digest for digest),
  ``"slow-link"`` (:func:`~lightning_bytescale.planner.cost_presets.slow_link_preset`) and
  ``"auto"`` (measured on the run's device at set-up: the torch floor resolves it,
  :func:`lightning_bytescale.profiler.auto_cost_model`; the pure floor cannot and says so);
* a **file**: an ``os.PathLike``, or a string that is not a name and names an existing file or
  ends in ``.json`` (a ``bytescale-profile`` file or a cost-model dict).

A name wins over a file of the same name in the working directory: write ``./paper`` to load
such a file.  A string that is neither (``"papr"``, ``"Paper"``, ``"profile.jsn"``) is a
:class:`~lightning_bytescale.planner.errors.CostModelSpecError` listing the names, with the
closest one, and saying that a file must exist.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_bytescale.planner.cost_model import CostModel, load_cost_model
from lightning_bytescale.planner.cost_presets import PRESETS
from lightning_bytescale.planner.errors import CostModelSpecError

AUTO = "auto"
#: Every name ``cost_model=`` takes; anything else given as a string is a file.
COST_MODEL_NAMES: tuple[str, ...] = (AUTO, *sorted(PRESETS))


def is_auto(spec: Any) -> bool:
    """Whether ``spec`` asks for the model measured at set-up (exactly the string ``"auto"``)."""
    return isinstance(spec, str) and spec == AUTO


def is_name(spec: Any) -> bool:
    """Whether ``spec`` is one of :data:`COST_MODEL_NAMES` (exact match)."""
    return isinstance(spec, str) and spec in COST_MODEL_NAMES


def looks_like_file(spec: str) -> bool:
    """A string that is not a name is a file when it exists or ends in ``.json``."""
    return spec.endswith(".json") or Path(spec).is_file()


def resolve_cost_model(spec: Any) -> CostModel | None:
    """The :class:`CostModel` ``spec`` names (``None`` stays ``None``: the planner's default).

    ``"auto"`` cannot be resolved here (nothing on this floor can measure a model): it raises a
    :class:`CostModelSpecError` naming the torch-floor function that measures it.  A missing or
    unusable file raises :class:`~lightning_bytescale.planner.errors.PlanError` from
    :func:`~lightning_bytescale.planner.cost_model.load_cost_model`.
    """
    if spec is None or isinstance(spec, CostModel):
        return spec
    if isinstance(spec, Mapping):
        return CostModel.from_json_dict(dict(spec))
    if isinstance(spec, os.PathLike):
        return load_cost_model(spec)
    if not isinstance(spec, str):
        raise CostModelSpecError(
            "cost_model must be None, a CostModel, its dict or the path of a bytescale-profile file, or one of "
            f"the names {', '.join(COST_MODEL_NAMES)}; got {type(spec).__name__}"
        )
    if spec == AUTO:
        raise CostModelSpecError(
            "cost_model='auto' is measured on the run's device at set-up, which the planner cannot do: resolve "
            "it with lightning_bytescale.profiler.auto_cost_model(model, ...) and pass the CostModel it returns "
            "(or pass 'paper', a CostModel or a bytescale-profile file)"
        )
    if spec in PRESETS:
        return PRESETS[spec]()
    if looks_like_file(spec):
        return load_cost_model(spec)
    raise CostModelSpecError(unknown_spec_message(spec))


def unknown_spec_message(spec: str) -> str:
    """Why ``spec`` is neither a name nor a file, with the closest name."""
    by_lower = {n.lower(): n for n in COST_MODEL_NAMES}
    close = difflib.get_close_matches(spec.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
    return (
        f"cost_model {spec!r} is neither a cost model name nor an existing file{hint}. The names are "
        f"{', '.join(repr(n) for n in COST_MODEL_NAMES)} (matched exactly); anything else is read as a file, "
        "which must exist (or end in .json): write one with bytescale-profile -o FILE"
    )


__all__ = [
    "AUTO",
    "COST_MODEL_NAMES",
    "is_auto",
    "is_name",
    "looks_like_file",
    "resolve_cost_model",
    "unknown_spec_message",
]
