"""``benchmarks/gpu_check.py --dry-run``: the one-GPU check runs end to end on CPU and writes its JSON.

The dry run takes every section's code path on the CPU with tiny sizes (``accelerator="cpu"``,
the ``cpu`` block kernel), so a script that will run once on a lent GPU is known to work
before it gets there.  Its own checks must pass: the float64 Trainer run equals the
single-process reference, the loopback ring matches the dense reference in every dtype and
ring size, offload hooks leave gradients bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "x.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    for section in ("trainer", "ring", "offload", "flash_attn"):
        assert "error" not in report[section], report[section].get("traceback")

    trainer = report["trainer"]
    assert trainer["ok"], trainer
    assert trainer["float64"]["max_param_diff"] <= 1e-10
    assert trainer["bf16_mixed"]["finite"] and trainer["bf16_mixed"]["steps"] == report["sizes"]["steps"]

    ring = report["ring"]
    assert ring["ok"], ring
    cells = {(e["ring"], e["dtype"]) for e in ring["errors"]}
    assert cells == {(n, d) for n in (2, 4, 8) for d in ("bfloat16", "float32", "float64")}
    assert all(max(e["max_err"].values()) <= 1e-10 for e in ring["errors"] if e["dtype"] == "float64")
    assert [s["ring"] for s in ring["throughput"]] == [2, 4, 8]
    assert all(s["fraction_of_local"] > 0 for s in ring["throughput"])

    offload = report["offload"]
    assert offload["ok"] and all(offload["cpu_hooks"]["bit_identical"].values())
    assert set(offload["cpu_hooks"]["bit_identical"]) == {"0.25", "0.5", "1.0"}

    flash = report["flash_attn"]
    assert "skipped" in flash and [r["kernel"] for r in flash["dry_run_kernels"]] == ["cpu", "math"]
    assert all(r["max_err_vs_math"] <= 1e-5 for r in flash["dry_run_kernels"])
