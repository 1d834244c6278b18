"""``benchmarks/gpu_check.py``: a check that can fail, whose dry run covers its code on the CPU.

* ``python benchmarks/gpu_check.py --dry-run`` from the repository root, as docs/install.md
  says, with the packages a GPU machine lacks made unimportable (Hydra, OmegaConf, W&B, xxhash,
  matplotlib: the machine has torch, Lightning and numpy, and the wheels of wrapt and
  torchdata), imports the package from the repository and passes every section it can run
  on a CPU; its own checks hold (float64 Trainer run against the single-process reference,
  loopback rings against the dense reference, ring-flash-attention's varlen case within its
  tolerances, a Ulysses item of 2 gloo ranks against local attention, bit-identical offload hooks,
  FSDP2, a one-stage pipeline and checkpoints on ``ParallelDims(1)``'s mesh against the float64
  loop, and the 2+ GPU layouts on 2 gloo ranks: a bf16-mixed pipeline of two stages, FSDP2 with
  TP against the float64 loop, TP ``zero=1`` checkpoints resumed bit for bit, 2 backward
  all-reduces per block, ``bytescale-profile --tensor-parallel 2`` started plainly);
* with the package unimportable (a broken copy first on the path, as a checkout without its
  dependencies would be) it exits 2 and says why, instead of recording the error and exiting 0;
* a subsection that raises keeps what it recorded before the error, the report names the
  failed section, and the exit status is 1;
* with one GPU the 2+ GPU sections record a skip, and the run's budget is the one-GPU sum;
* the pipelines' flat-memory rule (CUDA only in the run) holds a flat series and refuses a
  growing one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

# Runs a script with the modules a GPU machine lacks unimportable (a finder that refuses them).
WITHOUT = """
import importlib.abc, runpy, sys
MISSING = {"hydra", "omegaconf", "wandb", "xxhash", "matplotlib", "requests", "urllib3"}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(args, cwd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_dry_run_from_the_repository_root_passes_every_section(tmp_path):
    out = tmp_path / "x.json"
    proc = _run(["benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["device"] == "cpu" and report["ok"] is True
    assert Path(report["package"]) == ROOT / "lightning_bytescale"  # this checkout's package
    for section in (
        "kernels",
        "ring",
        "host_syncs",
        "trainer",
        "mesh",
        "ranks",
        "tensor_parallel",
        "layouts",
        "ulysses",
        "offload",
        "flash_attn",
    ):
        assert report[section]["ok"], report[section]
        for name, sub in report[section].items():
            if isinstance(sub, dict):
                assert "error" not in sub, (section, name, sub.get("traceback"))

    kernels = report["kernels"]
    assert kernels["detected"]["varlen_attn_problem"] is None and kernels["detected"]["aten_problems"] == {}
    assert {c["dtype"]: c["ring"] for c in kernels["chosen"]["choices"]} == dict.fromkeys(
        ("float16", "bfloat16", "float32", "float64"), "cpu"
    )

    ring = report["ring"]
    cells = {(e["ring"], e["dtype"]) for e in ring["errors"]["cases"]}
    assert cells == {(n, d) for n in (2, 4, 8) for d in ("bfloat16", "float32", "float64")}
    assert all(
        max(e["max_err"].values()) <= 1e-10 for e in ring["errors"]["cases"] if e["dtype"] == "float64"
    )
    ref = ring["reference_varlen"]
    assert ref["heads"] == 5 and ref["dtype"] == "bfloat16" and [r["ring"] for r in ref["rings"]] == [2, 4, 8]
    assert all(r["rel_err_vs_float64"]["out"] <= ref["tolerance"]["out"] for r in ref["rings"])
    assert [s["ring"] for s in ring["throughput"]["rings"]] == [2, 4, 8]
    assert all(s["fraction_of_local"] > 0 for s in ring["throughput"]["rings"])

    syncs = report["host_syncs"]
    assert syncs["micro_batch"]["layout_on_host"] is True
    assert all("skipped" in syncs[k] for k in ("local_attention", "ring_loop", "micro_batch"))  # CUDA only

    trainer = report["trainer"]
    assert trainer["float64"]["max_param_diff"] <= 1e-10 and trainer["float64"]["max_param_change"] > 1e-4
    assert trainer["bf16_mixed"]["finite"] and trainer["bf16_mixed"]["steps"] == report["sizes"]["steps"]
    assert (
        trainer["mfu"]["mfu_median"] > 0
        and len(trainer["mfu"]["mfu_per_step"]) == report["sizes"]["mfu_steps"]
    )

    tp = report["tensor_parallel"]  # the GPU section's code on 2 gloo ranks: (1, 2), spawn launcher
    for name in ("bf16_mixed", "float64"):
        assert tp[name]["mesh"] == [1, 2] and tp[name]["backend"] == ["gloo", "gloo"], tp[name]
        assert tp[name]["steps"] == report["sizes"]["steps"] and tp[name]["lanes_agree"]
        assert tp[name]["dtensor_params"] > 0 and tp[name]["step_seconds_median"] > 0
    assert tp["bf16_mixed"]["ran"] and tp["bf16_mixed"]["finite"]
    assert tp["float64"]["max_param_diff"] <= 1e-10 and tp["float64"]["max_param_change"] > 1e-4

    mesh = report["mesh"]  # ParallelDims(1)'s mesh on a 1-rank gloo group
    assert mesh["host_tensor_refused"]["canary"]["host_tensor_refused"]  # a cuda-only group refuses
    for fp64 in (mesh["fsdp2"], mesh["pipeline"]["float64"]):
        assert fp64["max_param_diff"] <= 1e-10 and fp64["max_param_change"] > 1e-4
    assert mesh["fsdp2"]["dtensor_params"] > 0
    bf16 = mesh["pipeline"]["bf16_mixed"]
    assert bf16["head_dtypes"] == ["torch.bfloat16"] and bf16["stages_built"] == 1 and bf16["finite"]
    for name in ("checkpoint_sharded", "checkpoint_consolidated", "zero1_consolidated"):
        assert mesh[name]["max_abs_diff"] == 0 and mesh[name]["tensors"] > 0, mesh[name]

    ranks = report["ranks"]["run"]  # every 2+ GPU job ran on both gloo ranks
    assert ranks["world"] == 2 and ranks["problem"] is None
    assert ranks["jobs"] == {
        job: ["ok", "ok"]
        for job in (
            "tp_bf16",
            "tp_float64",
            "pipelines",
            "fsdp2_tp",
            "tp_zero1_checkpoints",
            "tp_allreduce_count",
        )
    }
    layouts = report["layouts"]
    pipe = layouts["pipelines_bf16"]
    assert pipe["mesh"] == [2, 1, 1] and pipe["head_dtypes"] == ["torch.bfloat16"]
    assert pipe["param_dtypes"] == ["torch.float32"] and pipe["steps"] == report["sizes"]["steps"]
    assert pipe["pipeline_bubble_median"] is not None and pipe["ranks_agree"]
    fsdp = layouts["fsdp2_tp"]
    assert fsdp["fsdp_driver"] and fsdp["mesh"] == [1, 2] and fsdp["max_param_diff"] <= 1e-10
    (consolidated, sharded) = layouts["tp_zero1_checkpoints"]["saves"]
    assert [consolidated["format"], sharded["format"]] == ["consolidated", "sharded"]
    assert all(
        r["max_abs_diff"] == 0 and r["tensors"] > 0 for r in consolidated["per_rank"] + sharded["per_rank"]
    )
    count = layouts["tp_allreduce_count"]
    assert count["backward_per_block"] == 2 and count["counts"] == {
        "1": {"forward": 3, "backward": 3},
        "2": {"forward": 5, "backward": 5},
    }
    profile = layouts["profile_tp"]
    assert (
        profile["returncode"] == 0
        and profile["tensor_parallel"] == 2
        and "torchrun" not in profile["command"]
    )

    ulysses = report["ulysses"]  # the 2+ GPU section's code on 2 gloo ranks (spawned), bfloat16
    (item,) = ulysses["errors"]["items"]
    assert ulysses["errors"]["members"] == 2 and item["mode"] == "ulysses" and item["ok"]
    assert max(item["rel_err_vs_float64"].values()) <= 2e-2
    assert max(item["rel_diff_vs_local"].values()) <= 1e-2  # the same kernel on the same rows
    timing = ulysses["throughput"]
    assert min(timing[k] for k in ("local_s", "ulysses_s", "ring_s")) > 0 and timing["members"] == 2

    offload = report["offload"]
    assert set(offload["cpu_hooks"]["bit_identical"]) == {"0.25", "0.5", "1.0"}
    assert all(offload["cpu_hooks"]["bit_identical"].values())

    flash = report["flash_attn"]["block"]
    assert "skipped" in flash and [r["kernel"] for r in flash["dry_run_kernels"]] == ["cpu", "math"]
    assert all(r["max_err_vs_math"] <= 1e-5 for r in flash["dry_run_kernels"])


def test_dry_run_fails_when_the_package_cannot_be_imported(tmp_path):
    """A checkout whose package does not import: exit 2, the reason on stderr, no report of passes."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "gpu_check.py")
    broken = tmp_path / "lightning_bytescale"
    broken.mkdir()
    (broken / "__init__.py").write_text("import a_dependency_this_machine_lacks\n")
    out = tmp_path / "x.json"
    proc = _run(["benchmarks/gpu_check.py", "--dry-run", "--out", str(out)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (
        "cannot import lightning_bytescale" in proc.stderr
        and "a_dependency_this_machine_lacks" in proc.stderr
    )
    assert not out.exists()


def _load_script(monkeypatch):
    """The script as a module (it puts the repository on ``sys.path``: restored after the test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_failing_subsection_keeps_what_it_measured_and_fails_the_run(tmp_path, monkeypatch):
    gpu_check = _load_script(monkeypatch)

    def broken_section(report, device, sizes):
        section = report.section("kernels")

        def measure_then_fail(sub):
            sub.append("rows", {"measured": 1})
            sub.append("rows", {"measured": 2})
            raise RuntimeError("the third measurement failed")

        section.run("first", lambda sub: sub.out.update(ok=True, value=3))
        section.run("second", measure_then_fail)
        section.run("third", lambda sub: sub.out.update(ok=True))  # still runs

    monkeypatch.setattr(gpu_check, "SECTIONS", {"kernels": broken_section})
    out = tmp_path / "x.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    kernels = report["kernels"]
    assert kernels["ok"] is False and report["ok"] is False
    assert kernels["first"]["value"] == 3 and kernels["third"]["ok"] is True
    assert kernels["second"]["rows"] == [{"measured": 1}, {"measured": 2}]
    assert "RuntimeError: the third measurement failed" in kernels["second"]["error"]


def test_a_spent_budget_fails_the_subsections_it_cuts(tmp_path, monkeypatch):
    gpu_check = _load_script(monkeypatch)

    def section(report, device, sizes):
        report.section("kernels").run("late", lambda sub: sub.out.update(ok=True))

    monkeypatch.setattr(gpu_check, "SECTIONS", {"kernels": section})
    out = tmp_path / "x.json"
    assert gpu_check.main(["--dry-run", "--out", str(out), "--budget-s", "-1"]) == 1
    late = json.loads(out.read_text())["kernels"]["late"]
    assert late["ok"] is False and "time budget" in late["skipped"]


def test_the_2_gpu_sections_record_a_skip_with_one_gpu_and_the_budget_is_the_one_gpu_sum(
    tmp_path, monkeypatch
):
    gpu_check = _load_script(monkeypatch)
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    report = gpu_check.Report(tmp_path / "x.json", {}, 60.0)
    cuda = gpu_check.torch.device("cuda", 0)
    for section in (gpu_check.ranks_section, gpu_check.tensor_parallel_section, gpu_check.layouts_section):
        section(report, cuda, gpu_check.GPU)  # no rank starts, no CUDA call beyond the count
    written = json.loads((tmp_path / "x.json").read_text())
    subsections = {
        "ranks": ("run",),
        "tensor_parallel": ("bf16_mixed", "float64"),
        "layouts": ("pipelines_bf16", "fsdp2_tp", "tp_zero1_checkpoints", "tp_allreduce_count", "profile_tp"),
    }
    for section, names in subsections.items():
        assert written[section]["ok"] is True  # a skip is not a failure
        for name in names:
            sub = written[section][name]
            assert "needs two or more GPUs; 1 visible" in sub["skipped"] and sub["gpus_visible"] == 1
    one_gpu = sum(v for k, v in gpu_check.SECTION_BUDGET_S.items() if k not in gpu_check.MULTI_GPU_SECTIONS)
    assert gpu_check.default_budget(dry_run=False) == one_gpu == 335  # the docstring's figure
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 2)
    assert gpu_check.default_budget(dry_run=False) == sum(gpu_check.SECTION_BUDGET_S.values())
    # a section judging the ranks' jobs starts them itself when "ranks" is not selected: their share counts
    budget = gpu_check.SECTION_BUDGET_S
    assert gpu_check.default_budget(dry_run=False, only=["layouts"]) == budget["layouts"] + budget["ranks"]


def test_the_flat_memory_rule_holds_a_flat_series_and_refuses_a_growing_one(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    from _layouts_check import FLAT_FROM_STEP, flat_peaks

    warm = [900, 950] + [1000] * FLAT_FROM_STEP  # the steps before FLAT_FROM_STEP may differ
    mib = 2**20
    assert flat_peaks(warm + [1000 + mib] * 15)  # within the slack
    assert not flat_peaks(warm + [1000 + k * mib for k in range(1, 16)])  # a buffer kept every step
    assert not flat_peaks(warm[:FLAT_FROM_STEP])  # nothing measured after the warm-up: not shown flat
