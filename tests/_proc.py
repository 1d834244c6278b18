"""Process-tree helpers for tests that kill ranks: who of a process group is still alive."""

from __future__ import annotations

import time
from pathlib import Path


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from /proc."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def group_alive(pgid: int, wait_s: float = 5.0) -> bool:
    """Whether a process of the group is still alive after up to ``wait_s`` (killed ones take a moment)."""
    deadline = time.monotonic() + wait_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False
