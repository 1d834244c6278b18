"""Fails loudly when a Lightning release renames a private name the strategy relies on.

Every private Lightning name is used only in ``lightning_bytescale/lightning/compat.py``; this
test checks each one still exists with the call shape we use.
"""

from __future__ import annotations

import inspect

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
    assert _params(compat._sync_ddp_if_available)[:2] == ["result", "group"]
    assert _params(compat.call_callback_hooks)[:2] == ["trainer", "hook_name"]
    assert _params(compat.call_module_hook)[:2] == ["trainer", "hook_name"]
    assert "start_method" in _params(compat._MultiProcessingLauncher.__init__)
    assert _params(compat._SubprocessScriptLauncher.__init__)[1:] == [
        "cluster_environment",
        "num_processes",
        "num_nodes",
    ]
    assert hasattr(compat._StrategyRegistry, "register")
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
