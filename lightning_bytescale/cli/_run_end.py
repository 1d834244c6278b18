"""How a ``bytescale-train`` run ends: where its checkpoint is, and the command that resumes it;
and no run folder left behind by a run that failed before its first step.
It loads Lightning: ``cli/train.py`` imports it only in the functions that build and run.

Every way a run ends prints its next step once, on rank 0: the summary of a finished run
(``checkpoint:`` and ``resume with:`` lines), the preemption message of a run stopped by SIGTERM or
Ctrl-C (:class:`ResumeHint`, given to the :class:`PreemptionCallback`), and the line of a run
interrupted before it could save (a second Ctrl-C).  The command repeats the run's own
command-line overrides with ``ckpt_path=`` (and ``trainer.max_steps=`` raised where the run
used up its steps): it starts a new run folder, as every ``bytescale-train`` does, and
trains on from the checkpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
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


def resume_command(overrides: list[str], checkpoint: Path | str, max_steps: int | None = None) -> str:
    """``bytescale-train <overrides> ckpt_path=<checkpoint> [trainer.max_steps=N]``, shell-quoted."""
    drop = {"ckpt_path"} | ({"trainer.max_steps"} if max_steps is not None else set())
    args = [o for o in overrides if _key(o) not in drop]
    path = str(Path(checkpoint).absolute()) if "://" not in str(checkpoint) else str(checkpoint)
    args.append(f"ckpt_path={path}" if _PLAIN.match(path) else f"ckpt_path='{path}'")  # Hydra's quotes
    if max_steps is not None:
        args.append(f"trainer.max_steps={max_steps}")
    return shlex.join(["bytescale-train", *args])


@dataclass
class ResumeHint:
    """The end of the preemption message under ``bytescale-train``: the command that resumes.

    Picklable (the spawn launcher sends the callbacks to its workers).
    """

    overrides: list[str] = field(default_factory=list)
    run_dir: str = ""
    slurm: bool = False

    def __call__(self, checkpoint: Path | str) -> str:
        text = f"Resume it with:\n  {resume_command(self.overrides, checkpoint)}"
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
