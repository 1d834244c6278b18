"""The README's own example trains: extracted from README.md and run as a script (2 processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _recipe_helpers import LAUNCHER_VARS

REPO = Path(__file__).resolve().parents[1]


def _readme_example() -> str:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    examples = [b for b in blocks if "trainer.fit(" in b and "class LM" in b]
    assert examples, "README.md lost its runnable LightningModule example"
    return examples[0]


@pytest.mark.timeout(300)
def test_readme_example_trains(tmp_path):
    code = _readme_example()
    assert "max_steps=20" in code
    code = code.replace("max_steps=20", "max_steps=2, logger=False, enable_checkpointing=False")
    script = tmp_path / "example.py"
    code += '    print("GLOBAL_STEP", trainer.global_step, flush=True)\n'
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", BYTESCALE_DATA_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "GLOBAL_STEP 2" in proc.stdout, proc.stdout[-3000:]
