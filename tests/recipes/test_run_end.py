"""The end of a ``bytescale-train`` run says where its checkpoint is and prints the command that
resumes it, and that command resumes (issue 29, item 4): a finished run, SIGTERM (preemption)
and Ctrl-C (the first one saves at the next step boundary, as SIGTERM does)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _recipe_helpers import LAUNCHER_VARS, run_train, train_command

from lightning_bytescale.cli._run_end import resume_command
from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED, PreemptionHandler

SMOKE = ["experiment=cpu_smoke", "logger=csv", "trainer.enable_checkpointing=true"]


def _resume_args(text: str, max_steps: int | None = None) -> list[str]:
    """The arguments of the printed resume command (one line), which starts as the test started the
    run: ``train_command()`` (or ``bytescale-train`` where ``PATH`` finds that same script)."""
    typed = train_command()[0]
    starts = ("bytescale-train ", f"{typed} ")
    lines = [line for line in text.splitlines() if line.strip().startswith(starts)]
    lines += [line.split("resume with:", 1)[1] for line in text.splitlines() if "resume with:" in line]
    assert len(lines) == 1, text[-3000:]
    args = shlex.split(lines[0], comments=True)
    assert args[0] in ("bytescale-train", typed), args
    if max_steps is not None:
        args = [a for a in args if not a.startswith("trainer.max_steps=")] + [
            f"trainer.max_steps={max_steps}"
        ]
    return args[1:]


def _elsewhere(args: list[str], folder: Path) -> list[str]:
    """The printed command's arguments resumed into another folder than the one it names."""
    assert sum(a.startswith("hydra.run.dir=") for a in args) == 1, args  # it names the run's folder
    return [a for a in args if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={folder}"]


def test_the_resume_command_repeats_the_overrides_and_quotes_for_the_shell(tmp_path):
    odd = tmp_path / "with space" / "last.ckpt"
    command = resume_command(
        ["data=text", "data.source=/a b", "ckpt_path=/old.ckpt", "trainer.max_steps=3"], odd, 9
    )
    assert shlex.split(command) == [
        "bytescale-train", "data=text", "data.source=/a b", f"ckpt_path='{odd}'", "trainer.max_steps=9",
    ]  # fmt: skip


def test_a_second_ctrl_c_stops_at_once():
    handler = PreemptionHandler(("SIGTERM", "SIGINT"))
    handler._on_signal(signal.SIGINT, None)
    assert handler.requested and handler.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        handler._on_signal(signal.SIGINT, None)
    handler._on_signal(signal.SIGTERM, None)  # a second SIGTERM only repeats the request


@pytest.mark.multiprocess
def test_a_finished_run_prints_the_command_that_trains_on_from_its_checkpoint(tmp_path):
    first = run_train(
        [*SMOKE, "trainer.devices=1", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path
    )
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    assert f"  checkpoint: {last} (step 2)" in first.stdout, first.stdout[-2000:]
    args = _resume_args(first.stdout)
    assert f"ckpt_path={last}" in args and "trainer.max_steps=4" in args  # it used up its steps: 2 more
    second = run_train(_elsewhere(args, tmp_path / "b"), tmp_path)
    assert "cpu_smoke: 2 steps (resumed; step 4 now)" in second.stdout, second.stdout[-2000:]
    # item 6: the bar names the step limit, and no "dirpath has changed" warning per rank on resume
    assert "Epoch 0/-2" not in first.stdout and "(to step 2)" in first.stdout, first.stdout[-2000:]
    assert "dirpath has changed" not in second.stderr + second.stdout, second.stderr[-3000:]


def _stop_after_first_step(args: list[str], tmp: Path, sig: signal.Signals) -> subprocess.CompletedProcess:
    """Start the run in its own process group, send ``sig`` to the group once a step is logged."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY" and k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true",
               BYTESCALE_DATA_CACHE=str(tmp / "cache"), NETRC=str(tmp / "no-netrc"))  # fmt: skip
    run = tmp / "a"
    proc = subprocess.Popen(
        [*train_command(), *args, "logger.flush_logs_every_n_steps=1", f"hydra.run.dir={run}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            rows = [p.read_text().splitlines() for p in run.glob("csv/*/metrics.csv")]
            if rows and len(rows[0]) > 1:  # the header and a step
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before the signal"
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C, or a scheduler stopping the job
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "sig, devices", [(signal.SIGTERM, 1), (signal.SIGINT, 2)], ids=["SIGTERM", "Ctrl-C on 2 ranks"]
)
def test_a_stopped_run_saves_and_prints_the_command_that_resumes_it(tmp_path, sig, devices):
    args = [*SMOKE, f"trainer.devices={devices}", "trainer.max_steps=1000", "data.num_workers=1"]
    stopped = _stop_after_first_step(args, tmp_path, sig)
    both = stopped.stdout + stopped.stderr
    assert stopped.returncode == EXIT_PREEMPTED, both[-4000:]
    assert "Traceback" not in both and 'ckpt_path="hpc"' not in both, both[-4000:]
    found = re.findall(r"saved a checkpoint after step (\d+) to (\S+);", stopped.stderr)
    assert len(found) == 1, stopped.stderr[-3000:]  # once, from rank 0
    step, path = int(found[0][0]), Path(found[0][1])
    assert path == tmp_path / "a" / "hpc_ckpt_1.ckpt" and path.exists()
    assert ("Ctrl-C (SIGINT)" in stopped.stderr) is (sig == signal.SIGINT)
    args = _resume_args(stopped.stderr, max_steps=step + 1)
    assert f"ckpt_path={path}" in args
    resumed = run_train(_elsewhere(args, tmp_path / "b"), tmp_path)
    assert f"cpu_smoke: 1 steps (resumed; step {step + 1} now)" in resumed.stdout, resumed.stdout[-2000:]


@pytest.mark.multiprocess
def test_ckpt_path_hpc_names_the_newest_checkpoint_of_the_earlier_runs(tmp_path):
    """Lightning's "hpc" looks in the run's own folder, which is new under bytescale-train."""
    earlier = tmp_path / "outputs" / "cpu_smoke" / "2026-01-01_00-00-00"
    earlier.mkdir(parents=True)
    (earlier / "hpc_ckpt_1.ckpt").write_bytes(b"")
    proc = run_train(["experiment=cpu_smoke", "trainer.devices=1", "ckpt_path=hpc"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bytescale-train:")]
    assert len(lines) == 1 and f"ckpt_path={earlier / 'hpc_ckpt_1.ckpt'}" in lines[0], proc.stderr[-3000:]
    assert sorted(p.name for p in earlier.parent.iterdir()) == [earlier.name]  # its own folder removed
