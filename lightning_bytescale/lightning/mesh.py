"""The names this module held before the layouts moved to the torch floor, for one release (import them from there).

ZeRO on the mesh is :mod:`lightning_bytescale.parallel.zero` (:class:`LaneZero`, :func:`keeps_state`),
consolidated checkpoints of DTensor state :mod:`lightning_bytescale.parallel.full_state`, the
run's sizes :func:`lightning_bytescale.parallel.layout.check_world`; what the strategy does with a
mesh is its layout's (:class:`~lightning_bytescale.parallel.layout.MeshLayout`).
"""

from __future__ import annotations

from lightning_bytescale.parallel.full_state import (
    full_state_dict,
    load_model_state,
    load_optimizer_states,
    model_state,
    optimizer_state,
)
from lightning_bytescale.parallel.layout import check_world
from lightning_bytescale.parallel.zero import LaneZero, gradient_owners, keeps_state, lane_zero

__all__ = [
    "LaneZero",
    "check_world",
    "full_state_dict",
    "gradient_owners",
    "keeps_state",
    "lane_zero",
    "load_model_state",
    "load_optimizer_states",
    "model_state",
    "optimizer_state",
]
