"""What a user sees when the recipe starts: each log line once, no dependency deprecation noise."""

from __future__ import annotations

import pytest
from _recipe_helpers import run_train

pytestmark = pytest.mark.multiprocess


def test_recipe_prints_each_lightning_line_once_and_no_dependency_deprecations(tmp_path):
    proc = run_train(
        ["experiment=cpu_smoke", "trainer.devices=1", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )
    both = proc.stdout + proc.stderr
    assert both.count("Seed set to 1234") == 1, both[-3000:]
    assert both.count("`Trainer.fit` stopped") == 1, both[-3000:]
    assert "is deprecated" not in proc.stderr, proc.stderr[-3000:]
