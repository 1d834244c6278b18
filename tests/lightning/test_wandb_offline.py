"""The offline W&B run reader: LevelDB-log framing (records across 32 KiB blocks) and a real
wandb-written run file (wandb runs in a subprocess, never in the pytest process)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import pytest

from lightning_bytescale.lightning.wandb_offline import (
    WandbFileError,
    find_run_files,
    has_wandb_api_key,
    iter_records,
    read_run,
    wandb_offline_by_default,
)

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK = 32 * 1024


def _frame(payloads: list[bytes]) -> bytes:
    """An independent LevelDB-log writer (checksums are not verified by the reader)."""
    out = bytearray(b":W&B" + struct.pack("<HB", 0xBEE1, 0))
    for payload in payloads:
        first, rest = True, payload
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < 7:
                out += b"\0" * left
                continue
            chunk, rest = rest[: left - 7], rest[left - 7 :]
            kind = (1 if first else 4) if not rest else (2 if first else 3)
            out += struct.pack("<IHB", zlib.crc32(chunk), len(chunk), kind) + chunk
            first = False
            if not rest:
                break
    return bytes(out)


def _history(step: int, **values) -> bytes:
    record = pb.Record()
    for key, value in {"trainer/global_step": step, **values}.items():
        item = record.history.item.add()
        item.key = key
        item.value_json = json.dumps(value)
    return record.SerializeToString()


def test_framing_across_blocks(tmp_path):
    big = "x" * (3 * BLOCK)  # one record spanning FIRST, MIDDLE..., LAST fragments
    config = pb.Record()
    item = config.config.update.add()
    item.key, item.value_json = "strategy", json.dumps({"planner": "balance"})
    summary = pb.Record()
    item = summary.summary.update.add()
    item.key, item.value_json = "train/loss", "1.25"
    payloads = [config.SerializeToString()]
    payloads += [_history(i, **{"train/loss": 5.0 - i}) for i in range(500)]  # crosses many blocks
    payloads += [_history(500, blob=big), summary.SerializeToString()]
    path = tmp_path / "run-abc.wandb"
    path.write_bytes(_frame(payloads))
    run = read_run(path)
    assert [row["trainer/global_step"] for row in run.history] == list(range(501))
    assert run.column("train/loss")[:3] == [5.0, 4.0, 3.0]
    assert run.history[-1]["blob"] == big
    assert run.config["strategy"] == {"planner": "balance"}
    assert run.summary == {"train/loss": 1.25}
    assert find_run_files(tmp_path) == [path]


def test_rejects_a_file_that_is_not_a_run(tmp_path):
    path = tmp_path / "run-x.wandb"
    path.write_bytes(b"not a run")
    with pytest.raises(WandbFileError, match="not a W&B run file"):
        list(iter_records(path))
    with pytest.raises(WandbFileError, match="does not exist"):
        read_run(tmp_path / "missing")


def test_truncated_tail_is_ignored(tmp_path):
    data = _frame([_history(0, a=1), _history(1, a=2)])
    path = tmp_path / "run-t.wandb"
    path.write_bytes(data[:-3])  # the writer died mid-record
    assert [row["a"] for row in read_run(path).history] == [1]


def test_reads_a_real_offline_run(tmp_path):
    script = textwrap.dedent(
        f"""
        import wandb
        run = wandb.init(project="t", dir={str(tmp_path)!r}, mode="offline", config={{"lr": 0.5}},
                         settings=wandb.Settings(x_disable_stats=True, console="off"))
        for i in range(3):
            run.log({{"train/loss": 1.0 / (i + 1), "trainer/global_step": i}})
        run.log({{"h": wandb.Histogram([1, 2, 3]), "trainer/global_step": 3}})
        run.summary["final"] = 42
        wandb.finish()
        """
    )
    env = {**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env)
    files = find_run_files(tmp_path)
    assert len(files) == 1 and files[0].parent.name.startswith("offline-run-")
    run = read_run(files[0].parent)
    assert run.project == "t" and run.run_id in files[0].name
    assert run.column("train/loss") == [1.0, 0.5, pytest.approx(1 / 3)]
    assert run.history[-1]["h/_type"] == "histogram"
    assert run.config["lr"] == 0.5
    assert run.summary["final"] == 42


def test_offline_decision(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "absent"))
    assert not has_wandb_api_key() and wandb_offline_by_default()
    monkeypatch.setenv("WANDB_MODE", "online")
    assert not wandb_offline_by_default()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_offline_by_default()  # an explicit WANDB_MODE wins over the key
    monkeypatch.delenv("WANDB_MODE")
    assert not wandb_offline_by_default()
