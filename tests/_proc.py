"""Process-tree helpers for tests: who of a process group is still alive, and the leak check's own reads."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from lightning_bytescale import proc


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


# ------------------------------------------------ the process-leak check (conftest) and test_proc
def is_descendant(pid: int, root: int | None = None) -> bool:
    """Whether ``pid`` descends from ``root`` (default: this process), by walking up its parents."""
    ancestor = os.getpid() if root is None else root
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        row = proc.info(pid)
        if row is None:
            return False
        if row.ppid == ancestor:
            return True
        pid = row.ppid
    return False


def command_line(pid: int, limit: int = 160) -> str:
    """``pid``'s command line (arguments joined by spaces), cut to ``limit`` characters."""
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace") or "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wait_gone(pids: Iterable[int], timeout_s: float, poll_s: float = 0.02) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to exit; returns those still alive then."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pending if proc.is_alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(poll_s)


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants instead of init (Linux 3.4+).

    Then a grandchild whose parent exits stays a descendant of this process, so
    ``proc.descendants`` still finds it.  Returns whether the kernel agreed.
    """
    return proc._prctl(PR_SET_CHILD_SUBREAPER, 1)
