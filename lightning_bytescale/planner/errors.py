"""Errors the planner raises, so callers can tell bad input from a broken plan."""

from __future__ import annotations

from lightning_bytescale.errors import ByteScaleError, ConfigError


class PlanError(ByteScaleError, ValueError):
    """The input cannot be planned as given (bad length, capacity, world size or option).

    The message names the cause (sequence index and length, the option and its value) and
    the fix.
    """


class PlanValidationError(PlanError):
    """A plan breaks one of the invariants :meth:`Plan.validate` checks.

    The message names the rank and micro-batch (or sequence) at fault.
    """


class PlannerConfigError(PlanError, ConfigError):
    """A planner option is unknown or has a value no planner can use (``PlannerConfig``).

    Both a :class:`PlanError` (what ``make_plan`` raised for bad options before) and a
    :class:`~lightning_bytescale.errors.ConfigError` (what the strategy raises); the message
    names the option, its value and the fix (the closest valid name for a typo).
    """


class CostModelSpecError(PlannerConfigError):
    """``cost_model=`` is a string that is neither a cost-model name nor an existing file, or a
    name (``"auto"``) that only the torch floor can resolve.

    The message lists the names (``auto``, ``paper``, ``slow-link``, matched exactly) with the
    closest one, and says that anything else is read as a file that must exist.
    """


class CostRefitError(PlanError):
    """The cost-model refit cannot do what was asked: a bad option, a saved state it cannot
    read, or a step whose model is not known yet (the lag) or no longer kept.

    The message names the option, the state's field or the step, and the fix.
    """
