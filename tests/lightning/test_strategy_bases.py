"""The three bases ``ByteScaleStrategy`` is built from, each on its own (single process, no ranks).

``ProcessGroupStrategy`` (what DDP's strategy does without wrapping the model), ``StepLoopHooks``
(Lightning's step hooks over the step loop) and ``LayoutCheckpointHooks`` (a layout's checkpoint
hooks).  The strategy's own suites run them together on ranks; here is what each base promises.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from lightning.fabric.strategies import _StrategyRegistry

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.errors import CollectiveInMicroBatchError
from lightning_bytescale.lightning.checkpoint_hooks import LayoutCheckpointHooks
from lightning_bytescale.lightning.process_strategy import ProcessGroupStrategy
from lightning_bytescale.lightning.step_hooks import StepLoopHooks


class _Named(ProcessGroupStrategy):
    strategy_name = "named_for_test"
    description = "a test strategy"


def test_a_named_subclass_registers_three_launchers_and_the_base_none():
    registry = _StrategyRegistry()
    ProcessGroupStrategy.register_strategies(registry)
    assert registry.available_strategies() == []  # the base is not a strategy to name
    _Named.register_strategies(registry)
    assert sorted(registry.available_strategies()) == [
        "named_for_test",
        "named_for_test_fork",
        "named_for_test_spawn",
    ]
    for name, method in (
        ("named_for_test", "popen"),
        ("named_for_test_spawn", "spawn"),
        ("named_for_test_fork", "fork"),
    ):
        assert registry[name]["strategy"] is _Named
        assert registry[name]["init_params"] == {"start_method": method}
        assert registry[name]["description"] == f"a test strategy with start_method '{method}'"
    strategy = registry.get("named_for_test_fork")
    assert isinstance(strategy, _Named) and strategy.start_method == "fork"


def test_the_timeout_in_seconds_and_refused_timeouts():
    assert ProcessGroupStrategy(timeout=90).timeout_seconds == 90.0
    assert ProcessGroupStrategy(timeout=timedelta(minutes=2)).timeout_seconds == 120.0
    assert ProcessGroupStrategy(timeout=None).timeout_seconds is None
    with pytest.raises(ValueError, match="timeout must be positive seconds"):
        ProcessGroupStrategy(timeout=0)


def test_collectives_without_a_process_group_are_local():
    """Before (or without) a process group every collective is this process's own value, as Lightning's are."""
    strategy = ProcessGroupStrategy()
    strategy.barrier()
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert strategy.is_distributed  # Lightning then leaves a distributed sampler alone


def test_the_strategy_takes_each_hook_from_its_base():
    """The bases' order: a layout's checkpoint hooks and the step hooks before Lightning's own, and the
    step loop's refusal of a collective before the base's (which refuses nothing)."""
    mro = ByteScaleStrategy.__mro__
    assert mro.index(LayoutCheckpointHooks) < mro.index(StepLoopHooks) < mro.index(ProcessGroupStrategy)
    for name, base in (
        ("save_checkpoint", LayoutCheckpointHooks),
        ("load_checkpoint", LayoutCheckpointHooks),
        ("lightning_module_state_dict", LayoutCheckpointHooks),
        ("training_step", StepLoopHooks),
        ("backward", StepLoopHooks),
        ("optimizer_step", StepLoopHooks),
        ("refuse_collective", StepLoopHooks),
        ("barrier", ProcessGroupStrategy),
        ("reduce", ProcessGroupStrategy),
        ("setup_environment", ByteScaleStrategy),
    ):
        assert getattr(ByteScaleStrategy, name) is base.__dict__[name], name


def test_a_collective_inside_the_micro_batch_loop_is_refused_by_name():
    strategy = ByteScaleStrategy()
    strategy._loop.in_loop = "training_step"
    for call, what in (
        (strategy.barrier, "trainer.strategy.barrier()"),
        (lambda: strategy.broadcast(1), "trainer.strategy.broadcast()"),
    ):
        with pytest.raises(CollectiveInMicroBatchError, match=what.replace("(", r"\(").replace(")", r"\)")):
            call()
    strategy._loop.in_loop = None
    strategy.barrier()  # outside the loop: no process group, nothing to wait for


def test_the_loop_options_are_the_constructor_arguments():
    options = ByteScaleStrategy(
        check_finite=False, locate_non_finite=True, check_attention=False, check_parameters_every_n_steps=7,
        log_loss=False, loss_name="my/loss", offloader_options={"min_bytes": 1}, timeout=42,
    ).loop_options  # fmt: skip
    assert (options.check_finite, options.locate_non_finite, options.check_attention) == (False, True, False)
    assert (options.check_parameters_every_n_steps, options.log_loss, options.loss_name) == (
        7,
        False,
        "my/loss",
    )
    assert dict(options.offloader_options) == {"min_bytes": 1} and options.pg_seconds == 42.0
    assert options.offload is False  # the strategy's default: off


def test_offload_reads_as_given_and_is_set_only_in_the_constructor():
    """``strategy.offload`` is the argument as given (an offloader stays that object; the planner keeps "on")."""
    from types import SimpleNamespace

    from lightning_bytescale.errors import ConfigError

    assert ByteScaleStrategy().offload is False and ByteScaleStrategy(offload=True).offload is True
    offloader = SimpleNamespace(micro_batch_context=lambda *a, **k: None)  # what the strategy takes as one
    strategy = ByteScaleStrategy(offload=offloader)
    assert strategy.offload is offloader and strategy.loop_options.offload is offloader
    assert strategy.planner_config.offload is not False  # the planner plans with offload on
    with pytest.raises(
        ConfigError, match=r"strategy.offload cannot be set.*ByteScaleStrategy\(offload=True\)"
    ):
        strategy.offload = True
