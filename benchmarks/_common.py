"""What the multi-rank CPU benchmarks share: gloo ranks on loopback, resident-memory readings, the machine.

The benchmarks run as scripts (``python benchmarks/<name>.py``), so this folder is on
``sys.path`` and they import this module as ``_common``; so do the ranks they spawn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join the gloo process group of ``world_size`` ranks meeting at ``127.0.0.1:port``."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` reading in KiB, e.g. ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Reset the peak resident set (``VmHWM``) to the current one; returns it (KiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_kib("VmRSS")


def machine() -> dict[str, Any]:
    """The machine a result was measured on."""
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg": os.getloadavg(),
    }


def write_rank(parts: str | Path, stem: str, rank: int, row: dict) -> None:
    """A rank's result, as ``parts/<stem>_<rank>.json`` for :func:`run_ranks` to read."""
    Path(parts, f"{stem}_{rank}.json").write_text(json.dumps(row))


def run_ranks(
    worker: Callable[..., None], args: tuple, world_size: int, parts: str | Path, stem: str
) -> list[dict]:
    """Spawn ``worker(rank, *args)`` on ``world_size`` fresh processes; their :func:`write_rank` results by rank."""
    mp.start_processes(worker, args=args, nprocs=world_size, start_method="spawn")
    return [json.loads(Path(parts, f"{stem}_{rank}.json").read_text()) for rank in range(world_size)]


def parts_folder(out: str | Path) -> Path:
    """The folder beside the result file ``out`` (``<out>.parts``) where the ranks write theirs."""
    parts = Path(out).with_suffix(".parts")
    parts.mkdir(parents=True, exist_ok=True)
    return parts


def remove_parts(parts: Path) -> None:
    """Remove a :func:`parts_folder` and the ranks' results in it."""
    for f in parts.iterdir():
        f.unlink()
    parts.rmdir()


def plan_options(strategy: Any) -> dict[str, Any]:
    """A ByteScaleStrategy's planner options as ``make_plan`` keywords, as ``ByteScaleDataModule``
    passes them (unset ones left to the planner; the seed is the planner's default here)."""
    opts = {k: v for k, v in strategy.planner_options().items() if v is not None}
    opts.pop("seed", None)
    return opts


def run_parser(doc: str, name: str, *, steps: int, warmup: int, rounds: int) -> argparse.ArgumentParser:
    """The options of a benchmark of interleaved runs: steps, warm-up, rounds and its result file."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps, help="steps per run, including --warmup")
    parser.add_argument("--warmup", type=int, default=warmup, help="first steps of every run left out")
    parser.add_argument(
        "--rounds", type=int, default=rounds, help="interleaved repetitions; the medians count"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / f"{name}.json"))
    return parser


# A Trainer that only trains: no logger, checkpoints, progress bar, summary or sampler swap.
QUIET_TRAINER = dict(
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
)
