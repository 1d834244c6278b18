"""How well the refined cost model fits this machine: planned against measured micro-batch time.

One rank (a core, ``num_workers=0``) trains the reference Llama (``--preset``, default ``small``)
under ``ByteScaleStrategy(cost_model="paper", refine_cost_model=True)`` on the long-tailed
synthetic ``github`` documents at ``C = --capacity`` for ``--steps`` steps, with real wall-time
measurements.  Per step it records the median and worst relative error of planned against
measured micro-batch seconds under the model that planned the step (the refined one once the
refit applies) and under the paper preset (today's default), and the coefficients.  It trains
``--runs`` independent runs (default 5): on a shared 2-core machine whole steps slow down by half
now and then, which moves one run's figure by several points, so the JSON's verdict is the median
over runs, with every run's figure beside it; it says plainly whether that is within the issue's 15%.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cost_refinement.py   # benchmarks/results/cost_refinement.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import _common
import lightning.pytorch as pl
import torch

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy
from lightning_bytescale.models import LlamaConfig, LlamaModel

BAR = 0.15


class LM(pl.LightningModule):
    def __init__(self, preset: str, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(dataclasses.replace(LlamaConfig.preset(preset), vocab=vocab))

    def training_step(self, mb, batch_idx):
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Rows(pl.Callback):
    def __init__(self):
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, *args):
        s = trainer.strategy.step_stats
        self.rows.append(
            {
                "step": len(self.rows),
                "micro_batches": s["cost_error"]["count"],
                "refined_median": s["cost_error"]["median"],
                "refined_worst": s["cost_error"]["worst"],
                "paper_median": s["cost_base_error"]["median"],
                "paper_worst": s["cost_base_error"]["worst"],
                "coefficients": s["cost_coefficients"],
                "step_time_s": s.get("step_time_s"),
            }
        )


def run_once(args: argparse.Namespace) -> list[dict]:
    """One training run's per-step rows (a fresh model, data and refit)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = ByteScaleDataModule(
            source={"kind": "synthetic", "name": "github", "num_samples": 2000, "scale": 1 / 32},
            cache_dir=Path(tmp) / "cache", tokens_per_step=args.tokens_per_step, num_workers=0,
        )  # fmt: skip
        data.prepare_data()
        data.setup("fit")
        rows = Rows()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
            default_root_dir=tmp, callbacks=[rows],
            strategy=ByteScaleStrategy(capacity=args.capacity, cost_model="paper", refine_cost_model=True),
        )  # fmt: skip
        trainer.fit(LM(args.preset, data.vocab_size), datamodule=data)
    return rows.rows


def after_step_20(rows: list[dict]) -> dict:
    """The run's medians over its steps from step 20 on, against the bar."""
    late = [r for r in rows if r["step"] >= 20]
    refined = statistics.median(r["refined_median"] for r in late)
    paper = statistics.median(r["paper_median"] for r in late)
    return {
        "refined_median_error": refined,
        "paper_median_error": paper,
        "bar": BAR,
        "met": refined <= BAR,
        "verdict": (
            f"refined median relative error {refined:.1%} after step 20 "
            f"({'within' if refined <= BAR else 'NOT within'} {BAR:.0%}); the paper preset's on the same steps "
            f"{paper:.1%}"
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--tokens-per-step", type=int, default=4096)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--runs", type=int, default=5, help="independent runs; the verdict is their median")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "cost_refinement.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = []
    for _ in range(args.runs):
        rows = run_once(args)
        runs.append({"after_step_20": after_step_20(rows), "steps": rows})
        print(runs[-1]["after_step_20"]["verdict"], flush=True)
    errors = [r["after_step_20"]["refined_median_error"] for r in runs]
    median = statistics.median(errors)
    result = {
        "benchmark": "cost_refinement",
        "machine": _common.machine(),
        "settings": {**vars(args), "ranks": 1, "num_workers": 0, "data": "synthetic github, scale 1/32"},
        "over_runs": {
            "refined_median_error": median,
            "refined_errors_per_run": errors,
            "paper_errors_per_run": [r["after_step_20"]["paper_median_error"] for r in runs],
            "runs_within_bar": sum(e <= BAR for e in errors),
            "bar": BAR,
            "met": median <= BAR,
            "verdict": (
                f"over {len(runs)} runs the refined model's median relative error after step 20 is {median:.1%} "
                f"({'within' if median <= BAR else 'NOT within'} {BAR:.0%}); per run {min(errors):.1%} to "
                f"{max(errors):.1%}, {sum(e <= BAR for e in errors)} of {len(runs)} runs within"
            ),
        },
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(result["over_runs"]["verdict"])


if __name__ == "__main__":
    main()
