"""How a ``bytescale-train`` run ends: where its checkpoint is, and the command that resumes it;
and no run folder left behind by a run that failed before its first step.
It loads Lightning: ``cli/train.py`` imports it only in the functions that build and run.

Every way a run ends prints its next step once, on rank 0: the summary of a finished run
(``checkpoint:`` and ``resume with:`` lines), the preemption message of a run stopped by SIGTERM or
Ctrl-C (:class:`ResumeHint`, given to the :class:`PreemptionCallback`), and the line of a run
interrupted before it could save (a second Ctrl-C).  The command starts the way the user started
this run (:func:`launch_prefix`: ``.venv/bin/bytescale-train``, ``python -m
lightning_bytescale.cli.train``, ``torchrun ... -m ...``), repeats the run's own command-line
overrides with ``ckpt_path=`` (and ``trainer.max_steps=`` raised where the run used up its
steps), and names the run's folder (``hydra.run.dir=``): the resumed run writes beside the first
one and, with W&B, logs into the same W&B run (:mod:`~lightning_bytescale.lightning.wandb_run`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint

_PLAIN = re.compile(r"^[A-Za-z0-9_./:@+-]+$")
_STEP = re.compile(r"step=(\d+)")
_CHECKPOINT = re.compile(r"\.ckpt$|^hpc_ckpt_")


def command_overrides() -> list[str]:
    """This run's command-line overrides (Hydra's ``overrides.task``), or none outside Hydra."""
    if not HydraConfig.initialized():
        return []
    return [str(o) for o in HydraConfig.get().overrides.task]


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


DEFAULT_PREFIX = ("bytescale-train",)


def _runs_by_shebang(interpreter: str, script: str) -> bool:
    """Whether ``script`` is an executable whose ``#!`` line names ``interpreter`` (a console script
    the shell started through its shebang, not a script the user handed to Python)."""
    try:
        with open(script, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return False
    return first.startswith(b"#!") and first[2:].strip().split(b" ")[0] == os.fsencode(interpreter)


def _as_typed(program: str) -> str:
    """``program`` by its bare name where the shell finds that same file on ``PATH``, else as given."""
    name = os.path.basename(program)
    found = shutil.which(name)
    if found and os.path.realpath(found) == os.path.realpath(program):
        return name
    return program


def _parent_command() -> list[str] | None:
    """The command line of this process's parent (Linux ``/proc``), or None."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    parts = [os.fsdecode(p) for p in raw.split(b"\0") if p]
    return parts or None


def launch_prefix(
    argv: Sequence[str] | None = None,
    orig_argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    parent: Sequence[str] | None = None,
) -> list[str]:
    """The command that started this run, without its arguments: what a resume command starts with.

    ``sys.orig_argv`` (the interpreter's own command line) minus the arguments after the script or
    module (``sys.argv[1:]``): ``python -m lightning_bytescale.cli.train`` and ``python
    recipes/pretrain.py`` as typed; a console script started through its ``#!`` line as the script
    (``.venv/bin/bytescale-train``, or ``bytescale-train`` where ``PATH`` finds that file); under
    torchrun (``TORCHELASTIC_RUN_ID``) the command line of the torchrun process that started this
    rank (``torchrun --nproc-per-node 4 -m lightning_bytescale.cli.train``).  Falls back to
    ``bytescale-train``.
    """
    argv = list(sys.argv if argv is None else argv)
    typed = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in environ:
        above = _parent_command() if parent is None else list(parent)
        if above and len(above) > len(argv) - 1 and above[len(above) - len(argv) + 1 :] == argv[1:]:
            typed = above
    n = len(argv) - 1
    if not typed or len(typed) <= n or typed[len(typed) - n :] != argv[1:]:
        return list(DEFAULT_PREFIX)
    prefix = typed[: len(typed) - n]
    if len(prefix) >= 2 and _runs_by_shebang(prefix[0], prefix[1]):
        prefix = prefix[1:]  # the shell ran the script; the interpreter came from its #! line
    if prefix and "-c" in prefix:
        return list(DEFAULT_PREFIX)  # python -c "...": nothing a user can type again
    return [_as_typed(prefix[0]), *prefix[1:]]


def resume_command(
    overrides: list[str],
    checkpoint: Path | str,
    max_steps: int | None = None,
    *,
    prefix: Sequence[str] = DEFAULT_PREFIX,
    run_dir: Path | str | None = None,
) -> str:
    """``<prefix> <overrides> ckpt_path=<checkpoint> [trainer.max_steps=N] [hydra.run.dir=<run_dir>]``, shell-quoted.

    With ``run_dir`` the resumed run writes into the same folder (unless the overrides already
    name one with ``hydra.run.dir=``).
    """
    drop = {"ckpt_path"} | ({"trainer.max_steps"} if max_steps is not None else set())
    args = [o for o in overrides if _key(o) not in drop]
    path = str(Path(checkpoint).absolute()) if "://" not in str(checkpoint) else str(checkpoint)
    args.append(f"ckpt_path={path}" if _PLAIN.match(path) else f"ckpt_path='{path}'")  # Hydra's quotes
    if max_steps is not None:
        args.append(f"trainer.max_steps={max_steps}")
    if run_dir is not None and not any(_key(o) == "hydra.run.dir" for o in args):
        folder = str(Path(run_dir).absolute())
        args.append(f"hydra.run.dir={folder}" if _PLAIN.match(folder) else f"hydra.run.dir='{folder}'")
    return shlex.join([*prefix, *args])


@dataclass
class ResumeHint:
    """The end of the preemption message under ``bytescale-train``: the command that resumes.

    Picklable (the spawn launcher sends the callbacks to its workers).
    """

    overrides: list[str] = field(default_factory=list)
    run_dir: str = ""
    slurm: bool = False
    prefix: list[str] = field(default_factory=lambda: list(DEFAULT_PREFIX))

    def __call__(self, checkpoint: Path | str) -> str:
        command = resume_command(self.overrides, checkpoint, prefix=self.prefix, run_dir=self.run_dir or None)
        text = f"Resume it with:\n  {command}"
        if self.slurm:
            text += (
                "\n  (a requeued SLURM job resumes from it by itself only in the same run folder: "
                f"hydra.run.dir={self.run_dir})"
            )
        return text


def checkpoint_step(path: Path | str) -> int | None:
    """The step in a checkpoint's name (``epoch=0-step=200.ckpt``; ``last.ckpt`` through its link)."""
    text = str(path)
    if "://" not in text:
        text = os.path.realpath(text)
    found = _STEP.findall(os.path.basename(text))
    return int(found[-1]) if found else None


def newest_checkpoint(run_dir: Path | str, dirpath: Path | str | None) -> Path | None:
    """The newest checkpoint this run folder holds: a preemption one or the ``last`` one."""
    candidates: list[Path] = []
    root = Path(run_dir)
    if root.is_dir():
        candidates += [p for p in root.iterdir() if p.name.startswith("hpc_ckpt_")]
    if dirpath is not None and Path(dirpath).is_dir():
        last = Path(dirpath) / "last.ckpt"
        candidates += [last] if last.exists() else list(Path(dirpath).glob("*.ckpt"))
    if not candidates:
        return None
    return max(candidates, key=lambda p: p.lstat().st_mtime)


def named_resume_error(ckpt_path: str | None, run_dir: Path | str, dirpath: Path | str | None) -> str | None:
    """The one-line error for ``ckpt_path=hpc`` or ``ckpt_path=last`` under ``bytescale-train``:
    Lightning looks for them in this run's own folder, which is new; None where one is there."""
    if ckpt_path not in ("hpc", "last") or newest_checkpoint(run_dir, dirpath) is not None:
        return None
    earlier = [
        p
        for folder in Path(run_dir).parent.glob("*")
        if folder != Path(run_dir) and folder.is_dir()
        for p in [newest_checkpoint(folder, folder / "checkpoints")]
        if p is not None
    ]
    text = (
        f"ckpt_path={ckpt_path} looks for a checkpoint in this run's own folder, and every run has a new "
        "one; give the checkpoint's path"
    )
    if earlier:
        newest = max(earlier, key=lambda p: p.lstat().st_mtime)
        text += f": the newest of {Path(run_dir).parent} is ckpt_path={newest.absolute()}"
    else:
        text += ", e.g. ckpt_path=outputs/<name>/<date>/checkpoints/last.ckpt"
    return text


def _holds_a_checkpoint(folder: Path) -> bool:
    return any(_CHECKPOINT.search(p.name) for p in folder.rglob("*"))


def fresh_run_folder(run_dir: Path | str) -> bool:
    """Whether the run folder holds only what Hydra wrote for this run (checked before it starts)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return True
    return all(p.name == ".hydra" or p.suffix == ".log" for p in folder.iterdir())


def remove_unused_run_folder(run_dir: Path | str, was_fresh: bool, name: str | None = None) -> bool:
    """Delete the folder of a run that failed before its first step (call it only then), when
    the folder was new (:func:`fresh_run_folder`) and holds no checkpoint: what is left is
    Hydra's config and log, and loggers' files without a metric; True when it was removed.
    The folder above goes too when it is empty and named ``name`` (Hydra's ``outputs/<name>``)."""
    folder = Path(run_dir)
    if not was_fresh or not folder.is_dir() or _holds_a_checkpoint(folder):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    parent = folder.parent  # outputs/<name>/: gone too when this was its only run
    if name is not None and parent.name == name and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
    return not folder.exists()


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint``, restored without a warning in a new run folder.

    Every ``bytescale-train`` run has its own folder, so a resumed checkpoint's ``dirpath`` is
    an earlier run's, and Lightning's "The dirpath has changed" warning (once per rank) says
    nothing new.  What Lightning drops then is dropped here too: only ``best_model_path`` is
    restored, so no file of the earlier run is ever deleted.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath", self.dirpath) != self.dirpath:
            self.best_model_path = state_dict["best_model_path"]
            return
        super().load_state_dict(state_dict)
