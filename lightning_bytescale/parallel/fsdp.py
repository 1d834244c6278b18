"""FSDP2 (``fully_shard``) on the data-parallel dimension when ranks run different numbers of micro-batches.

FSDP2's own schedule issues collectives per forward and backward: an all-gather of a unit's
parameters before it runs and a reduce-scatter of its gradients after its backward.  Under HDP
one rank runs three micro-batches while another runs none, so the ranks of the sharding group
would issue different numbers of collectives and hang (the same happens to every framework
that pads with dummy micro-batches instead).  :class:`FSDPStepDriver` makes the collectives one
per unit per step on every rank, whatever its micro-batch count:

* :meth:`~FSDPStepDriver.begin_step` (before the loop, after the step's digest all-gather was
  started and before any ring exchange): one all-gather per unit; the parameters then stay
  unsharded for all micro-batches (``reshard_after_forward=False``,
  ``set_reshard_after_backward(False)``), so FSDP gathers nothing inside a micro-batch;
* during the loop gradients accumulate unsharded on each rank
  (``set_requires_gradient_sync(False)``): no reduction at all, even in the last backward;
* :meth:`~FSDPStepDriver.finish_step` (after the loop, so after every ring transfer of the
  rank): one reduce-scatter per unit, in one fixed order (FSDP's own end-of-backward order over
  its units, the same on every rank), a rank that ran nothing -- or a parameter a rank did not
  use -- sending zeros, summed with divide factor 1
  (``set_gradient_divide_factor(1.0)``; the loss is already divided by the global token
  count), then every unit resharded.

Where the gradients land: FSDP's reduction writes each parameter's summed shard to the
*sharded* parameter's ``.grad`` (a DTensor of the parameter's placements), for nested units as
for the root, once the unit's reduce-scatter has run; the sharded parameters are registered on
the modules again by the reshard.  :meth:`~FSDPStepDriver.finish_step` checks that every
trained parameter has one.

Memory: this trades FSDP's per-layer gathering for exactness with uneven counts.  During the
step a rank holds the whole (data-parallel-unsharded) parameters and gradients, as ZeRO-2 does;
between steps only its shards and its share of the optimizer state.  Settings that would make
the number of collectives depend on the micro-batch count -- ``reshard_after_forward=True``
(FSDP2's default for non-root units) or an int, HSDP (a 2-D sharding mesh) -- are refused at
set-up (:class:`~lightning_bytescale.parallel.errors.FSDPSettingError`) naming the setting.

FSDP2 has no public call for "reduce the accumulated gradients now"; :meth:`finish_step` runs
the root state's end-of-backward callback -- the step FSDP itself takes for units whose
backward never ran -- with gradient sync switched on.  The private names (a unit's
``FSDPState`` and its param groups, the root's lazy init and that callback, each ``FSDPParam``'s
sharded and unsharded parameter) are used in this module only; ``tests/parallel`` runs them on
torch 2.11 (one param group per state) and 2.13 (a list of them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_bytescale.parallel.errors import FSDPSettingError


def _state(unit: FSDPModule) -> Any:
    return unit._get_fsdp_state()  # FSDP2 private: the unit's FSDPState


def _groups(unit: FSDPModule) -> list[Any]:
    """The unit's FSDPParamGroups (FSDP2 private: a list from torch 2.13, one group before)."""
    state = _state(unit)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The ``fully_shard`` units of ``model``, root first (module order)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class FSDPStepDriver:
    """One all-gather and one reduce-scatter per unit per step, however many micro-batches a rank runs.

    Make it once at set-up, after ``fully_shard`` was applied to ``model`` (the root last, as
    FSDP2 requires), on every rank; ``dp_group`` is the data-parallel process group the units
    must shard over (``None``: do not check).  Then per step: ``begin_step()``, the micro-batch
    loop, ``finish_step()``, the scalar sync (without the FSDP-managed parameters:
    :meth:`manages`), clipping and the optimizer step on the sharded parameters.
    """

    def __init__(self, model: nn.Module, dp_group: Any = None) -> None:
        units = fsdp_units(model)
        if not units or units[0] is not model:
            raise FSDPSettingError(
                "FSDPStepDriver needs fully_shard applied to the root module itself (after its blocks): "
                f"{type(model).__name__} is not an FSDP module. Call fully_shard(model, mesh=...) last in "
                "configure_model"
            )
        self.model, self.units = model, units
        for unit in units:
            self._check(unit, dp_group, root=unit is model)
        model.set_reshard_after_backward(False)  # recursive: every unit keeps its parameters gathered
        model.set_requires_gradient_sync(False)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)  # the loss is divided by the global token count already
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (PREMUL_SUM is NCCL-only)

    @staticmethod
    def _check(unit: FSDPModule, dp_group: Any, *, root: bool) -> None:
        name = type(unit).__name__
        state = _state(unit)
        for group in _groups(unit):
            mesh = group.mesh_info.mesh
            if mesh.ndim != 1:
                raise FSDPSettingError(
                    f"fully_shard on {name} uses a {mesh.ndim}-D mesh (HSDP), which is not supported with "
                    'per-rank micro-batch counts yet; shard over device_mesh["data_parallel"]'
                )
            if dp_group is not None:
                import torch.distributed as dist

                mine = sorted(dist.get_process_group_ranks(mesh.get_group()))
                expected = sorted(dist.get_process_group_ranks(dp_group))
                if mine != expected:
                    raise FSDPSettingError(
                        f"fully_shard on {name} shards over ranks {mine}, not over this rank's data-parallel "
                        f'group {expected}; pass mesh=device_mesh["data_parallel"]'
                    )
            auto_root = root and state._auto_reshard_after_forward  # FSDP keeps the root gathered itself
            if group.post_forward_mesh_info is not None and not auto_root:
                raise FSDPSettingError(
                    f"fully_shard on {name} has reshard_after_forward=True (FSDP2's default) or an int: it "
                    "gathers the parameters again in every micro-batch's forward and backward, so ranks with "
                    "different micro-batch counts issue different numbers of all-gathers and hang. Pass "
                    "fully_shard(..., reshard_after_forward=False), or call "
                    "model.set_reshard_after_forward(False) before the first step"
                )

    def _managed_ids(self) -> set[int]:
        return {
            id(fsdp_param.sharded_param)  # FSDP2 private: the parameter a unit shards
            for unit in self.units
            for group in _groups(unit)
            for fsdp_param in group.fsdp_params
        }

    def manages(self, param: torch.Tensor) -> bool:
        """Whether FSDP reduces ``param``'s gradient (leave it out of the data-parallel gradient sum)."""
        return id(param) in self._managed_ids()

    def unmanaged(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The ``(name, parameter)`` pairs whose gradients FSDP does not reduce (``ignored_params``)."""
        managed = self._managed_ids()
        return [(n, p) for n, p in named if id(p) not in managed]

    def begin_step(self) -> None:
        """All-gather every unit's parameters once (all ranks, same order), kept for the whole step."""
        root = _state(self.model)
        root._lazy_init()  # FSDP2 private: what its first forward does, needed on a rank without one
        handles = [unit.unshard(async_op=True) for unit in self.units]
        for handle in handles:
            if handle is not None:
                handle.wait()

    def _zero_unused_gradients(self) -> None:
        """A zero gradient for every gathered parameter without one, so every rank reduces every parameter.

        FSDP2 leaves a parameter without a gradient out of its reduce-scatter (torch 2.13's
        ``set_reduce_scatter_unused_params`` fills zeros, 2.11 has no such switch): a rank that
        ran no micro-batch, or did not use a parameter, would then send a smaller buffer.
        """
        for unit in self.units:
            for group in _groups(unit):
                for fsdp_param in group.fsdp_params:  # FSDP2 private: unsharded views and their gradients
                    param = fsdp_param.unsharded_param
                    if (
                        param.requires_grad
                        and param.grad is None
                        and fsdp_param.unsharded_accumulated_grad is None
                    ):
                        param.grad = torch.zeros_like(param)

    def finish_step(self) -> None:
        """One reduce-scatter per unit (after the rank's last ring exchange), then reshard every unit."""
        self._zero_unused_gradients()
        self.model.set_requires_gradient_sync(True)
        self.model.set_is_last_backward(True)  # the callback then waits for the reductions and clears
        try:
            # FSDP2 private: the end-of-backward callback runs each unit's post-backward (its
            # reduce-scatter) for the units whose backward has not run since: here all of them
            _state(self.model)._root_post_backward_final_callback()
        finally:
            self.model.set_requires_gradient_sync(False)
        for unit in self.units:
            unit.reshard()
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise FSDPSettingError(
                f"after the reduce-scatter parameters {missing[:5]} have no sharded gradient; FSDP put them "
                "elsewhere (a torch release whose FSDP2 internals changed?)"
            )


__all__ = ["FSDPStepDriver", "fsdp_units"]
