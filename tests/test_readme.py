"""The README's own example trains: extracted from README.md and run as a script (2 processes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _recipe_helpers import run_doc_script

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
    code += '    print("GLOBAL_STEP", trainer.global_step, flush=True)\n'
    proc = run_doc_script(code, tmp_path, timeout=280)
    assert "GLOBAL_STEP 2" in proc.stdout, proc.stdout[-3000:]
