"""docs/tensor-parallel.md's port of a ``ModelParallelStrategy`` model runs as it is written (issue 37, item 9):
its own transformer, tensor parallelism with ``parallelize_module`` and FSDP2 on 4 CPU processes."""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

import pytest
from _recipe_helpers import run_doc_script

REPO = Path(__file__).resolve().parents[1]


def _porting_script() -> str:
    text = (REPO / "docs" / "tensor-parallel.md").read_text()
    section = text.split("## Porting a `ModelParallelStrategy` model", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "trainer.fit(" in b]
    assert len(blocks) == 1, "the porting section lost its runnable script"
    return blocks[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_porting_script_trains(tmp_path):
    code = _porting_script()
    assert "max_steps=20" in code and "devices=4" in code
    code = code.replace("max_steps=20", "max_steps=2, logger=False, enable_checkpointing=False")
    assert "source=None" in code  # the whole standard library: its json package is enough here
    code = code.replace("source=None", f"source={os.path.join(sysconfig.get_paths()['stdlib'], 'json')!r}")
    proc = run_doc_script(code, tmp_path, timeout=380)
    assert re.search(r"^step 2: loss \d+\.\d+$", proc.stdout, flags=re.M), proc.stdout[-3000:]
