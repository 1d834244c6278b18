"""Timing on a device: the fastest of a few runs, with the device synchronised around each.

The minimum is the least noisy statistic on a shared machine (load only ever adds time), and
a CUDA run is timed from the host only after the queued kernels have finished.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
