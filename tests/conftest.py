"""Test-session settings: offline W&B, one thread per process, and no environment leaks.

Lightning's launchers and process-group set-up write ``MASTER_PORT``, ``LOCAL_RANK`` and
friends into ``os.environ``.  A later test that starts a fresh training script would inherit
them, and Lightning would then believe its processes were created externally and wait for
ranks that never come.  So every test gets the environment back as it found it.

No test may leave a process behind: each test's new descendants of the pytest process must be
gone (after a short grace period) when it ends, else the test errors at teardown, naming
them, and they are killed.  The pytest process adopts orphans (a child subreaper), so a
grandchild whose parent died, the case a leaked rank is, still counts.

Tests marked ``gpu`` are skipped where CUDA is not available.

A test that joins torch's fake process group takes the ``fake_process_group`` fixture
(``tests/_fake_pg.py``): it leaves no process group, and no DTensor mesh cached on one, to the
tests after it (ranks forked from this process would inherit them).

tqdm's monitor thread is off: a Hugging Face save or load in the pytest process (a progress bar)
would start it and leave it running, and from then on ``tests/_ranks.py`` could not fork ranks
(a process with a second thread is not safe to fork): every later rank launch would import torch
anew in each spawned rank, which made the tests that start ranks about twice as slow.

One torch thread per process, even where ``OMP_NUM_THREADS`` was not exported: torch may be
imported before this file (a pytest plugin), and then its pool has the default size.  A pytest
process that ran a multi-threaded OpenMP region (a reference model) and then forks ranks leaves
them hung in their first matrix product (GNU OpenMP is not fork-safe): a rank's step watchdog
then ends it after 90 s.  ``scripts/test.sh`` exports ``OMP_NUM_THREADS=1``; this makes a plain
``pytest`` run behave the same.
"""

import os
import sys

import pytest
import torch
from _fake_pg import fake_world, forget_sharding_propagation
from _proc import become_subreaper, command_line, is_descendant, wait_gone
from tqdm.std import tqdm

from lightning_bytescale import proc as process_tree

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch may have been imported before this file
tqdm.monitor_interval = 0  # no monitor thread (the module docstring says why)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (``pytest.mark.usefixtures``), restored after it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fake_process_group():
    """``join(rank, world)``: this process as rank ``rank`` of a fake world, left clean after the test."""
    with fake_world() as join:
        yield join


@pytest.fixture(autouse=True)
def _forget_dtensor_meshes():
    """After each test, DTensor's cached sharding propagation is emptied (microseconds).

    A cached result holds the mesh of the world it was computed in; a rank a later test forks
    from this process inherits it and fails on the dead world's group names (``tests/_fake_pg.py``).
    Tests should leave their worlds through ``fake_world``; this is the net under the ones that do not.
    """
    yield
    if "torch.distributed.tensor" in sys.modules:
        forget_sharding_propagation()


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Helpers that live for the whole session once started, by a test or by a library: not leaks.
SESSION_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "wandb-core",
    "compile_worker",
)
LEFTOVER_GRACE_S = 5.0
become_subreaper()


def _session_helper(pid: int) -> bool:
    command = command_line(pid, limit=400)
    return any(name in command for name in SESSION_HELPERS)


@pytest.fixture(autouse=True)
def _no_leftover_processes(request):
    before = process_tree.pids()  # a listing, not a walk: cheap enough for every test
    yield
    new = [
        p
        for p in sorted(process_tree.pids() - before)
        if process_tree.is_alive(p) and is_descendant(p) and not _session_helper(p)
    ]
    left = wait_gone(new, LEFTOVER_GRACE_S) if new else []
    if not left:
        return
    described = "; ".join(f"pid {p}: {command_line(p)}" for p in left)
    for pid in left:
        process_tree.signal_all([*process_tree.descendants(pid), pid])
    pytest.fail(
        f"{request.node.nodeid} left {len(left)} process(es) running {LEFTOVER_GRACE_S:g} s after it ended "
        f"(now killed): {described}. End every process a test starts, e.g. run it in its own session and "
        "kill its process group in a finally block.",
        pytrace=False,
    )
