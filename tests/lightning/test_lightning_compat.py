"""Fails loudly when a Lightning release renames a private name the strategy relies on.

Every private Lightning name is used only in ``lightning_bytescale/lightning/compat.py``; this
test checks each one still exists with the call shape we use.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_bytescale.lightning import compat as compat


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_private_functions_keep_their_call_shape():
    assert _params(compat._init_dist_connection)[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert "timeout" in _params(compat._init_dist_connection) or "kwargs" in _params(
        compat._init_dist_connection
    )
    assert _params(compat._get_default_process_group_backend_for_device) == ["device"]
    assert _params(compat._materialize_distributed_module) == ["module", "device"]
    assert _params(compat._optimizers_to_device) == ["optimizers", "device"]
    assert _params(compat.call_callback_hooks)[:2] == ["trainer", "hook_name"]
    assert _params(compat.call_module_hook)[:2] == ["trainer", "hook_name"]
    assert "start_method" in _params(compat._MultiProcessingLauncher.__init__)
    assert _params(compat._SubprocessScriptLauncher.__init__)[1:] == [
        "cluster_environment",
        "num_processes",
        "num_nodes",
    ]
    assert hasattr(compat._StrategyRegistry, "register")
    assert _params(compat._set_num_threads_if_needed) == ["num_processes"]
    assert _params(compat._ChildProcessObserver.__init__)[1:] == [
        "main_pid",
        "child_processes",
        "sleep_period",
    ]
    assert callable(getattr(compat._ChildProcessObserver, "_run", None))
    # the popen launcher swaps this module's ``subprocess`` while the ranks start
    assert compat.subprocess_script_module.subprocess.__name__ == "subprocess"
    assert compat._get_default_process_group_backend_for_device(torch.device("cpu")) == "gloo"
    assert compat._get_default_process_group_backend_for_device(torch.device("cuda", 0)) == "nccl"


def test_the_training_loop_keeps_its_result_collection_where_we_swap_it(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    loop = trainer.fit_loop.epoch_loop
    assert hasattr(loop, "_results")
    saved = loop._results
    with compat.discarded_logging(trainer):
        assert loop._results is not saved
    assert loop._results is saved
    assert compat.module_trainer(torch.nn.Module()) is None


def test_the_validation_loop_keeps_the_data_source_fit_validates_reads(tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    source = trainer.fit_loop.epoch_loop.val_loop._data_source
    assert callable(source.is_defined)
    assert compat.fit_validates(trainer) is False  # no module yet: nothing to validate


def test_logged_metrics_are_read_and_written_the_way_compat_does(tmp_path):
    """``epoch_reduced_metrics`` / ``log_into_results`` on a real result collection: one key, logged again."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    assert isinstance(type(trainer).__dict__["_evaluation_loop"], property)
    results = _ResultCollection(training=False)
    trainer.fit_loop.epoch_loop._results = results
    trainer.state.stage = "train"
    trainer.state.fn = "fit"
    assert trainer._results is results  # what compat reads
    reduce = pl.strategies.SingleDeviceStrategy(torch.device("cpu")).reduce
    results.log("validation_step", "acc", torch.tensor(2.0), on_step=False, on_epoch=True, sync_dist=True,
                sync_dist_fn=reduce, batch_size=3)  # fmt: skip
    results.log("validation_step", "local", torch.tensor(1.0), on_step=False, on_epoch=True, batch_size=3)
    (found,) = compat.epoch_reduced_metrics(trainer)
    assert (found.key, found.fx, found.name, found.is_tensor, found.dtype) == (
        "validation_step.acc",
        "validation_step",
        "acc",
        True,
        "float32",
    )
    assert found.options["reduce_fx"] == "mean"
    compat.log_into_results(trainer, found, torch.tensor(7.0), reduce)  # batch size 0: counts for nothing
    assert float(results["validation_step.acc"].compute()) == 2.0


def test_load_from_checkpoint_still_reads_through_the_loader_compat_wraps():
    import lightning.pytorch.core.saving as saving

    assert "pl_load(checkpoint_path" in inspect.getsource(saving._load_from_checkpoint)
    assert getattr(
        saving.pl_load, "loads_checkpoint_folders", False
    )  # installed when the strategy is imported


PACKAGE = Path(__file__).resolve().parents[2] / "lightning_bytescale"


def _private_lightning_names(tree: ast.AST) -> list[str]:
    """``lightning...`` imports of a private name or through a private module, in one module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning":
            parts = node.module.split(".")
            found += [
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") or any(p.startswith("_") for p in parts)
            ]
        elif isinstance(node, ast.Import):
            found += [
                a.name
                for a in node.names
                if a.name.split(".")[0] == "lightning" and any(p.startswith("_") for p in a.name.split("."))
            ]
    return found


def test_no_private_lightning_name_is_imported_outside_compat():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent.name == "lightning":
            continue
        names = _private_lightning_names(ast.parse(path.read_text(), str(path)))
        if names:
            offenders[str(path.relative_to(PACKAGE))] = names
    assert not offenders, f"import these through lightning_bytescale/lightning/compat.py: {offenders}"


def test_the_private_name_check_sees_an_offender():
    tree = ast.parse(
        "from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher\n"
        "import lightning.pytorch.trainer._private_module\n"
        "from lightning.pytorch import Trainer\n"
    )
    assert _private_lightning_names(tree) == [
        "lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher",
        "lightning.pytorch.trainer._private_module",
    ]
