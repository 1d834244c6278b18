"""The step watchdog: a stuck rank ends itself with one clear message and leaves nothing behind.

The firing cases run in a subprocess (the watchdog ends its process with ``os._exit``); the
process tree is checked in ``/proc`` afterwards.  In-process tests use long timeouts only.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
from _lifecycle import run_python

from lightning_bytescale import proc
from lightning_bytescale.engine.watchdog import EXIT_STEP_TIMEOUT, StepWatchdog

PHASE = "micro-batch 3 of step 12 (ring [0, 2], sequences [5])"

STUCK = f"""
import json, os, subprocess, sys, time
from lightning_bytescale.engine.watchdog import StepWatchdog

# a loader worker, say (its output goes elsewhere: it must not hold the test's pipes open)
worker = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
)
print(json.dumps({{"pid": os.getpid(), "worker": worker.pid}}), flush=True)
dog = StepWatchdog(0.5, rank=3, **json.loads(sys.argv[1])).start()


def stuck_in_user_code():
    time.sleep(120)


dog.beat({PHASE!r})
stuck_in_user_code()
print("NOT STOPPED", flush=True)
"""


def test_a_stuck_step_ends_the_process_with_one_message_and_no_survivors():
    run = run_python(STUCK, "{}", timeout=60)
    started = json.loads(run.stdout.splitlines()[0])
    assert run.returncode == EXIT_STEP_TIMEOUT, run.output
    assert "NOT STOPPED" not in run.stdout
    err = run.stderr
    assert err.count("step watchdog") == 1, err
    assert "rank 3: step watchdog: no progress for" in err
    assert "(timeout 0.5 s)" in err and PHASE in err
    assert "stuck_in_user_code" in err  # the stuck thread's stack names the user's function
    assert f"pid {started['pid']}" in err and f"[{started['worker']}]" in err
    assert "raise the timeout (ByteScaleStrategy(timeout=...))" in err
    assert not proc.is_alive(started["worker"]), "the stuck rank's child outlived it"


def test_the_exit_code_and_the_timeout_option_are_configurable():
    options = {"exit_code": 77, "timeout_option": "strategy.step_timeout", "kill_children": False}
    run = run_python(STUCK, json.dumps(options), timeout=60)
    started = json.loads(run.stdout.splitlines()[0])
    try:
        assert run.returncode == 77, run.output
        assert "raise the timeout (strategy.step_timeout)" in run.stderr
        assert "child process" not in run.stderr
    finally:
        proc.signal_all([started["worker"]])


BEATING = """
import sys, time
from lightning_bytescale.engine.watchdog import StepWatchdog

mode = sys.argv[1]
with StepWatchdog(0.3, rank=0) as dog:
    end = time.monotonic() + 1.5
    if mode == "beats":
        while time.monotonic() < end:  # five times the timeout, with a beat every 50 ms
            dog.beat("forward")
            time.sleep(0.05)
    elif mode == "idle":
        dog.beat("forward")
        dog.idle()
        time.sleep(1.5)
    elif mode == "never":
        time.sleep(1.5)
print("survived", flush=True)
"""


@pytest.mark.parametrize("mode", ["beats", "idle", "never"])
def test_beats_keep_it_alive_and_idle_or_no_step_times_nothing(mode):
    run = run_python(BEATING, mode, timeout=60)
    assert run.returncode == 0, run.output
    assert run.stdout.strip() == "survived"
    assert "step watchdog" not in run.stderr


GIL_HELD = """
import ctypes
from lightning_bytescale.engine.watchdog import StepWatchdog

dog = StepWatchdog(0.3, rank=2, grace_s=0.5).start()
dog.beat("inside a C call that keeps the interpreter lock")
ctypes.PyDLL(None).sleep(60)  # PyDLL does not release the lock: the watchdog thread cannot run
"""


def test_the_backstop_ends_a_thread_that_never_releases_the_interpreter_lock():
    run = run_python(GIL_HELD, timeout=30)
    assert run.returncode == 1, run.output
    assert "Timeout (" in run.stderr and "most recent call first" in run.stderr


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"timeout_s": 0}, "must be positive"),
        ({"timeout_s": -1.0}, "must be positive"),
        ({"timeout_s": math.nan}, "finite number of seconds"),
        ({"timeout_s": math.inf}, "finite number of seconds"),
        ({"timeout_s": True}, "finite number of seconds"),
        ({"timeout_s": "10"}, "finite number of seconds"),
        ({"rank": -1}, "non-negative integer"),
        ({"exit_code": 0}, "would report a stuck rank as a success"),
        ({"exit_code": 256}, "1..255"),
    ],
)
def test_bad_arguments_name_the_option(kwargs, needle):
    args = {"timeout_s": 10.0, "rank": 0} | kwargs
    timeout_s, rank = args.pop("timeout_s"), args.pop("rank")
    with pytest.raises(ValueError, match="StepWatchdog") as info:
        StepWatchdog(timeout_s, rank, **args)
    assert needle in str(info.value)


def test_start_and_stop_are_idempotent_and_it_starts_idle():
    dog = StepWatchdog(600, rank=1, backstop=False)
    assert not dog.running
    dog.stop()  # stopping a watchdog that never started is fine
    with dog:
        thread = dog._thread
        assert dog.running and thread is not None and thread.daemon
        assert dog.start() is dog and dog._thread is thread  # no second thread
        assert dog._mark is None  # idle until the first beat
        dog.beat("step 1")
        assert dog._mark is not None and dog._mark[1] == "step 1" and dog._mark[2] == threading.get_ident()
        dog.idle()
        assert dog._mark is None
    assert not dog.running and not thread.is_alive()
    dog.stop()
    dog.start()  # a stopped watchdog can start again
    try:
        assert dog.running
    finally:
        dog.stop()


def test_the_message_names_rank_phase_seconds_children_and_fix():
    dog = StepWatchdog(20, rank=5, backstop=False)
    text = dog.message(21.04, "micro-batch 1 of step 3 (ring [5, 6], sequences [9])", "  File x\n", [11, 12])
    assert text.startswith("[ByteScale] rank 5: step watchdog: no progress for 21.0 s (timeout 20 s)")
    assert "micro-batch 1 of step 3 (ring [5, 6], sequences [9])" in text
    assert "its 2 child process(es) [11, 12]" in text and f"exit code {EXIT_STEP_TIMEOUT}" in text
    assert "look at that code on rank 5" in text and "ByteScaleStrategy(timeout=...)" in text


PER_PHASE = """
import time
from lightning_bytescale.engine.watchdog import StepWatchdog

dog = StepWatchdog(60, rank=1).start()
dog.beat("forward")  # the watchdog's own 60 s
time.sleep(0.5)
dog.beat("ring exchange of micro-batch 2", 0.4)  # this phase: 0.4 s
time.sleep(60)
"""


def test_a_phase_can_have_its_own_limit():
    run = run_python(PER_PHASE, timeout=60)
    assert run.returncode == EXIT_STEP_TIMEOUT, run.output
    assert "(timeout 0.4 s) in ring exchange of micro-batch 2." in run.stderr
    assert "slower than 0.4 s" in run.stderr


@pytest.mark.parametrize("bad", [0, -1.0, math.nan])
def test_a_phase_limit_must_be_positive(bad):
    dog = StepWatchdog(60, rank=0, backstop=False)
    with pytest.raises(ValueError, match="beat timeout_s must be positive"):
        dog.beat("forward", bad)


def test_short_steps_keep_the_armed_backstop_instead_of_re_arming_it(monkeypatch):
    """``faulthandler`` starts a thread per arming: steps shorter than half a grace reuse the timer."""
    from lightning_bytescale.engine import watchdog as module

    armed: list[float] = []
    clock = [1000.0]
    monkeypatch.setattr(module.faulthandler, "dump_traceback_later", lambda s, **kw: armed.append(s))
    monkeypatch.setattr(module.faulthandler, "cancel_dump_traceback_later", lambda: None)
    monkeypatch.setattr(module, "_monotonic", lambda: clock[0])
    dog = StepWatchdog(60, rank=0, grace_s=20)
    dog._armable = True  # as after start(), without the watchdog thread
    for _ in range(40):  # 40 steps of 0.2 s: 8 s, less than half the grace
        dog.beat("micro-batch 0")
        clock[0] += 0.2
        dog.idle()
    assert armed == [80.0]  # armed once, for the first step's limit plus the grace
    clock[0] += 3.0  # the next step starts 11 s after the armed one: more than half a grace
    dog.beat("micro-batch 0")
    assert armed == [80.0, 80.0]  # re-armed for this step
    assert dog._backstop_at == clock[0] + 80.0
    dog.beat("the gradient all-reduce", 600.0)  # a later beat in the step does not re-arm
    assert len(armed) == 2
