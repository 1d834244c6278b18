"""Test-session settings: offline W&B, one thread per process, and no environment leaks.

Lightning's launchers and process-group set-up write ``MASTER_PORT``, ``LOCAL_RANK`` and
friends into ``os.environ``.  A later test that starts a fresh training script would inherit
them, and Lightning would then believe its processes were created externally and wait for
ranks that never come.  So every test gets the environment back as it found it.

Tests marked ``gpu`` are skipped where CUDA is not available.
"""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
