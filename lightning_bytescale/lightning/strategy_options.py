"""The checks of ``ByteScaleStrategy``'s arguments, each failing with a ``ConfigError`` that names the fix.

The strategy's planner arguments are ``PlannerConfig``'s fields (:func:`strategy_planner_config`
builds the one config the strategy and the data module plan with, :func:`planner_view` keeps
the strategy's attributes views of it); the other arguments are checked here too, so the
strategy's ``__init__`` only stores what passed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from torch import nn

from lightning_bytescale.errors import ConfigError, CostModelHeadsError
from lightning_bytescale.models.heads import lane_heads, model_heads
from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.modes import RING_ONLY, parse_modes

#: DistributedDataParallel's own options: refused by name (the model is not wrapped in DDP).
DDP_ONLY = frozenset(
    {
        "find_unused_parameters",
        "static_graph",
        "gradient_as_bucket_view",
        "broadcast_buffers",
        "ddp_comm_hook",
        "ddp_comm_state",
        "ddp_comm_wrapper",
        "model_averaging_period",
    }
)

START_METHODS = ("popen", "spawn", "fork", "forkserver")


def as_timedelta(timeout: float | int | timedelta | None) -> timedelta | None:
    """The process-group timeout from seconds or a ``timedelta`` (``None``: the backend's default)."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=float(timeout))


def strategy_planner_config(
    planner: str | PlannerConfig, defaults: dict[str, Any], *, pipelines: int = 1, **given: Any
) -> PlannerConfig:
    """The strategy's :class:`PlannerConfig`: ``planner`` itself when it is one (the other
    planner arguments then stay at their ``defaults``), else one built from the arguments.

    ``offload=None`` means off here (the strategy offloads only when asked), and an
    ``ActivationOffloader`` means on.  ``pipeline_degree`` follows ``pipelines`` (the strategy's
    ``pipeline_parallel_size``): the planner plans the pipelines the strategy runs.
    """
    offloader = hasattr(given["offload"], "micro_batch_context")
    if isinstance(planner, PlannerConfig):
        clash = sorted(
            k
            for k, v in given.items()
            if v is not defaults[k] and v != defaults[k] and not (k == "offload" and offloader)
        )
        if clash:
            raise ConfigError(
                f"ByteScaleStrategy got planner=PlannerConfig(...) and also {', '.join(clash)}; give the planner "
                f"options one way: inside the PlannerConfig (config.replace({clash[0]}=...)) or as keyword arguments"
            )
        config = planner
        if offloader or planner.offload is None:
            config = planner.replace(offload=offloader)
    else:
        if offloader:  # an ActivationOffloader: the planner only needs "on"
            given["offload"] = True
        elif given["offload"] is None:
            given["offload"] = False
        given["options"] = given["options"] or {}
        if (
            given["pipeline_degree"] == 1
        ):  # set here, so that the options that need pipelines are checked with it
            given["pipeline_degree"] = pipelines
        config = PlannerConfig.from_options(planner=planner, **given)
    if config.pipeline_degree not in (1, pipelines):
        raise ConfigError(
            f"pipeline_degree={config.pipeline_degree} but pipeline_parallel_size={pipelines}: the planner plans the "
            f"pipelines the strategy runs. Give ByteScaleStrategy(pipeline_parallel_size={config.pipeline_degree}) "
            "and leave pipeline_degree at 1"
        )
    return config.replace(pipeline_degree=pipelines) if config.pipeline_degree != pipelines else config


def planner_view(name: str, read: Callable[[Any], Any] | None = None) -> property:
    """A strategy attribute that reads ``planner_config.<name>``; setting it is refused, naming the constructor option.

    The planner options have one door under the strategy, its constructor (``PlannerConfig``):
    the data module plans with ``strategy.planner_config``, and a run's options are fixed before
    its first plan.  ``read(strategy)`` reads it elsewhere (``offload``: the offloader itself when
    one was given, where the planner only keeps "on").
    """

    def get(self: Any) -> Any:
        return getattr(self.planner_config, name) if read is None else read(self)

    def set_(self: Any, value: Any) -> None:
        raise ConfigError(
            f"strategy.{name} cannot be set after the strategy is made: pass ByteScaleStrategy({name}={value!r}) "
            f"(or planner=PlannerConfig({name}=...)) and Trainer(strategy=that strategy) instead of the name "
            f"'bytescale' (in a recipe: the override strategy.{name}=...)"
        )

    return property(get, set_, doc=f"``planner_config.{name}`` (read-only: set it in the constructor).")


def refuse_unknown_options(unknown: dict[str, Any], valid: Iterable[str]) -> None:
    """A ``ConfigError`` for keyword arguments the strategy does not take, naming the closest valid one."""
    if not unknown:
        return
    ddp_only = sorted(DDP_ONLY & unknown.keys())
    if ddp_only:
        raise ConfigError(
            f"{ddp_only} are DistributedDataParallel options; ByteScaleStrategy does not wrap the model in DDP "
            "(it all-reduces gradients itself), so remove them."
        )
    valid = list(valid)
    parts = []
    for key in sorted(unknown):
        close = difflib.get_close_matches(key, valid, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(
        f"ByteScaleStrategy got unknown option(s) {', '.join(parts)}; valid options: {', '.join(valid)}"
    )


def check_step_options(
    *,
    check_parameters_every_n_steps: Any,
    start_method: Any,
    offloader_options: Any,
    gradient_sync: Any,
    bucket_cap_mb: Any,
    watchdog: Any,
) -> None:
    """The strategy's other arguments: each refused with the values it takes."""
    if not isinstance(check_parameters_every_n_steps, int) or check_parameters_every_n_steps < 0:
        raise ConfigError(
            "check_parameters_every_n_steps must be a non-negative integer (0 turns the check off), "
            f"got {check_parameters_every_n_steps!r}"
        )
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}")
    if offloader_options is not None and not isinstance(offloader_options, dict):
        raise ConfigError(f"offloader_options must be a dict, got {type(offloader_options).__name__}")
    if gradient_sync not in ("bucketed", "flat"):
        raise ConfigError(f"gradient_sync must be 'bucketed' or 'flat', got {gradient_sync!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
        raise ConfigError(f"bucket_cap_mb must be a positive number of megabytes, got {bucket_cap_mb!r}")
    if not isinstance(watchdog, bool) and not (isinstance(watchdog, (int, float)) and watchdog > 0):
        raise ConfigError(f"watchdog must be True, False or a positive number of seconds, got {watchdog!r}")


def check_cost_model_heads(
    config: PlannerConfig, module: nn.Module | None, tensor_parallel_size: int
) -> None:
    """Refuse a cost model whose heads are not the model's, where the model's config names them.

    A cost model with heads (``CostModel.attention_heads`` / ``kv_heads``: one tensor-parallel
    lane's, as ``bytescale-profile`` records them) lets ``balance`` run items as Ulysses or hybrid
    groups whose sizes divide those heads; heads of another model would plan groups this model
    cannot split, refused only at the first attention call (``UlyssesHeadsError``).  Nothing is
    checked when the cost model names no heads, the ``modes`` option is ring-only, or the model's
    heads cannot be read (:func:`~lightning_bytescale.models.heads.model_heads`: the reference
    Llama's or a Hugging Face config; ``HFCausalLM`` builds its model in ``configure_model``, so
    the strategy checks again at set-up).
    """
    cost = config.cost_model
    if cost is None or cost.attention_heads is None or module is None:
        return
    if parse_modes(config.options.get("modes")) == RING_ONLY:
        return
    found = model_heads(module)
    if found is None:
        return
    tp = tensor_parallel_size
    want = lane_heads(*found, tp)
    if (cost.attention_heads, cost.kv_heads) == want:
        return
    lane = f" (one lane of tensor_parallel_size={tp} holds {want[0]} and {want[1]})" if tp > 1 else ""
    raise CostModelHeadsError(
        f"the cost model {cost.name!r} names attention_heads={cost.attention_heads}, kv_heads={cost.kv_heads}, but the "
        f"model has {found[0]} query and {found[1]} key/value heads{lane}: the planner would run Ulysses items of "
        f"sizes its heads do not split. Profile this model (bytescale-profile records its heads), give the cost "
        f"model attention_heads={want[0]}, kv_heads={want[1]}, or plan rings only "
        "(ByteScaleStrategy(options={'modes': ('ring',)}))"
    )


__all__ = [
    "DDP_ONLY",
    "START_METHODS",
    "as_timedelta",
    "check_cost_model_heads",
    "check_step_options",
    "planner_view",
    "refuse_unknown_options",
    "strategy_planner_config",
]
