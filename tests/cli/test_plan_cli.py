"""The ``bytescale-plan`` command: help, inputs, byte-identical JSON, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lightning_bytescale.cli.plan import load_lengths, main
from lightning_bytescale.planner import Plan


def _run(args, hashseed="0"):
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    return subprocess.run(
        [sys.executable, "-m", "lightning_bytescale.cli.plan", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--world-size" in out and "--distribution" in out and "--json" in out


def test_json_is_byte_identical_across_processes_and_validates(tmp_path):
    args = ["--distribution", "byted", "--tokens", "300000", "--world-size", "12", "--capacity", "8192"]
    args += ["--context-length", "65536"]
    here, there = tmp_path / "here.json", tmp_path / "there.json"
    assert main([*args, "--json", str(here)]) == 0
    # another process, another string-hash seed: the same bytes
    r = _run([*args, "--json", str(there)], hashseed="12345")
    assert r.returncode == 0, r.stderr
    assert "max_over_mean" in r.stdout
    assert here.read_bytes() == there.read_bytes()
    data = json.loads(there.read_bytes())
    plan = Plan.from_json_dict(data)
    plan.validate()
    assert data["digest"] == plan.digest()
    assert set(data["stats"]) >= {"max_over_mean", "ring_bytes", "cp_degree_histogram"}


@pytest.mark.parametrize("planner", ["static", "naive", "balance"])
def test_length_files(tmp_path, planner, capsys):
    lengths = [5, 17, 16, 1, 33, 2, 9]
    files = {
        "a.json": json.dumps(lengths),
        "b.txt": "# lengths\n" + "\n".join(map(str, lengths)) + "\n\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    np.save(tmp_path / "c.npy", np.array(lengths, dtype=np.int64))
    for name in ["a.json", "b.txt", "c.npy"]:
        assert load_lengths(str(tmp_path / name)) == lengths
        out = tmp_path / f"{name}.plan.json"
        args = [
            "--lengths",
            str(tmp_path / name),
            "--world-size",
            "5",
            "--capacity",
            "16",
            "--planner",
            planner,
        ]
        assert main([*args, "--json", str(out)]) == 0
        Plan.from_json_dict(json.loads(out.read_text())).validate()


def test_errors_exit_2_with_the_cause(tmp_path, capsys):
    p = tmp_path / "l.txt"
    p.write_text("5\n100\n")
    assert main(["--lengths", str(p), "--world-size", "2", "--capacity", "8", "--no-offload"]) == 2
    err = capsys.readouterr().err
    assert "sequence 1 has length 100" in err
    p.write_text("5\nx\n")
    assert main(["--lengths", str(p), "--world-size", "2", "--capacity", "8"]) == 2
    assert "l.txt:2" in capsys.readouterr().err
    assert main(["--lengths", str(tmp_path / "missing.json"), "--world-size", "2", "--capacity", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--distribution", "github", "--world-size", "2", "--capacity", "8"]) == 2
    assert "--tokens" in capsys.readouterr().err


def test_modes_in_the_plan_file(tmp_path, capsys):
    """With the heads given, items run in other modes where they end sooner; --json shows each
    micro-batch's mode and the statistics per mode; --modes ring gives the ring-only plan."""
    args = [
        "--distribution",
        "prolong512k",
        "--tokens",
        str(64 * 8192 * 4),
        "--context-length",
        str(512 * 1024),
    ]
    args += ["--world-size", "64", "--capacity", "8192", "--no-offload"]
    heads = ["--attention-heads", "32", "--kv-heads", "8"]
    chosen, ring_only = tmp_path / "modes.json", tmp_path / "ring.json"
    assert main([*args, *heads, "--json", str(chosen)]) == 0
    assert "mode_counts" in capsys.readouterr().out
    assert main([*args, *heads, "--modes", "ring", "--json", str(ring_only)]) == 0
    data, ring = json.loads(chosen.read_text()), json.loads(ring_only.read_text())
    modes = {mb["mode"] for entry in data["ranks"] for mb in entry["micro_batches"]}
    assert modes > {"ring"} and {mb["mode"] for e in ring["ranks"] for mb in e["micro_batches"]} == {"ring"}
    stats = data["stats"]
    assert sum(stats["mode_counts"].values()) == stats["ring_items"]
    assert stats["ring_bytes"] == pytest.approx(sum(stats["comm_bytes_by_mode"].values()))
    assert stats["makespan"] < ring["stats"]["makespan"]
    Plan.from_json_dict(data).validate()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--modes", "ulysses"], "lacks 'ring'"),
        (["--modes", "ring,ulysses"], "need the cost model's attention_heads"),
        (["--planner", "naive", "--modes", "ring"], "balance chooses attention modes"),
        (["--attention-heads", "32"], "go together"),
    ],
)
def test_modes_errors_exit_2(extra, match, capsys):
    args = ["--distribution", "github", "--tokens", "200000", "--world-size", "8", "--capacity", "8192"]
    assert main([*args, *extra]) == 2
    assert match in capsys.readouterr().err
