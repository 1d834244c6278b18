"""One table at the end of a sweep: steps, tokens/s and loss of every job, side by side.

A sweep (``bytescale-train -m ...``, ``experiment=compare_planners``) prints one closing line
per job, between thousands of lines of Lightning output.  Each job also writes its figures to
``summary.json`` in its run folder (:func:`write_job_summary`); :class:`SweepTable`, a Hydra
callback set in ``conf/pretrain.yaml``, reads them when the sweep ends and prints them together,
with each job's tokens/s relative to the first job's (the first planner of
``strategy.planner=static,naive,balance``), and the columns that say why one job is faster
(:class:`~lightning_bytescale.lightning.run_summary.RunSummary`'s figures): the mean number of
micro-batches an HDP rank runs a step, the share of tokens in sequences sharded over rings, the
measured balance (slowest rank's busy time over the mean) and, with pipelines, the measured
bubble.  When every job ends at the same loss, one line says what that means: the jobs changed
where tokens are computed, not what is trained.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

SUMMARY_FILE = "summary.json"


def write_job_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Write one job's figures to ``<run_dir>/summary.json``."""
    path = Path(run_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return path


def _job_number(folder: Path) -> int:
    head = folder.name.split("_", 1)[0]
    return int(head) if head.isdigit() else math.inf  # type: ignore[return-value]


def read_sweep(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The summaries of a sweep's jobs, in job order (jobs that wrote none are left out)."""
    found = []
    for path in Path(sweep_dir).glob(f"*/{SUMMARY_FILE}"):
        try:
            found.append((_job_number(path.parent), json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return [summary for _, summary in sorted(found, key=lambda item: item[0])]


def _percent(value: Any) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, (int, float)) else "-"


def _number(value: Any, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


#: (heading, summary key, format) of the columns after tokens/s; the bubble only where a job has one.
WHY_COLUMNS = (
    ("micro-batches/rank", "run/micro_batches_per_rank", _number),
    ("ring tokens", "run/ring_token_share", _percent),
    ("busy max/mean", "run/busy_max_over_mean", _number),
    ("bubble", "run/pipeline_bubble", _percent),
)


def format_table(jobs: list[dict[str, Any]]) -> str:
    """The sweep's table; tokens/s relative to the first job that has a figure.

    Columns: steps, tokens/s, relative tokens/s, the columns of :data:`WHY_COLUMNS` that some job
    reports, and the last loss; then :func:`exactness_line` when it applies.
    """
    base = next((j["run/tokens_per_s"] for j in jobs if j.get("run/tokens_per_s")), None)
    why = [c for c in WHY_COLUMNS if any(isinstance(j.get(c[1]), (int, float)) for j in jobs)]
    rows = [("job", "steps", "tokens/s", "vs first", *(c[0] for c in why), "last loss")]
    for job in jobs:
        rate = job.get("run/tokens_per_s")
        loss = job.get("loss")
        rows.append(
            (
                job.get("overrides") or job.get("name", "?"),
                str(int(job.get("run/steps", 0))),
                f"{rate:,.0f}" if rate else "-",
                f"{rate / base:.2f}x" if rate and base else "-",
                *(fmt(job.get(key)) for _, key, fmt in why),
                f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    same = exactness_line(jobs)
    return "\n".join(lines + ([same] if same else []))


def exactness_line(jobs: list[dict[str, Any]]) -> str | None:
    """One line when two or more jobs that trained the same steps end at the same loss (to 4 decimals)."""
    losses = [j.get("loss") for j in jobs]
    steps = {int(j.get("run/steps", 0)) for j in jobs}
    if len(jobs) < 2 or len(steps) != 1 or not all(isinstance(v, (int, float)) for v in losses):
        return None
    if len({f"{v:.4f}" for v in losses}) != 1:
        return None
    return (
        f"The last loss is the same for every job ({losses[0]:.4f}): the jobs changed where tokens are "
        "computed, not what is trained. This is the exactness guarantee: every planner trains exactly as one "
        "process on the whole global batch, so compare them by tokens/s alone."
    )


class SweepTable(Callback):
    """Hydra callback: print every job's steps, tokens/s and loss when a sweep ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        jobs = read_sweep(sweep_dir)
        if not jobs:
            return
        print(f"[bytescale-train] sweep {sweep_dir}:\n{format_table(jobs)}", flush=True)


__all__ = [
    "SUMMARY_FILE",
    "WHY_COLUMNS",
    "SweepTable",
    "exactness_line",
    "format_table",
    "read_sweep",
    "write_job_summary",
]
