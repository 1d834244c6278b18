"""Where a training step's CPU time goes, per function: ``bytescale`` against plain ``ddp``.

Run: ``python benchmarks/step_overhead.py`` (about 2-3 minutes on 2 cores; the committed file:
``--rounds 6``, 2.5 minutes); writes
``benchmarks/results/step_overhead.json``.

The throughput benchmark (``strategy_throughput.py``) measures wall time, which on a shared
2-core machine moves by several percent from run to run.  This one measures what a step
*costs*: every rank accounts its main thread's CPU time (``time.thread_time``) to the innermost
of a fixed list of functions it is in (exclusive time: a function's own time, its listed callees
counted apart), for the same all-short steps as ``strategy_throughput.py``'s ``all_short``
setting (4 gloo ranks, lengths 64..512, C = 512), planned with the default cost model and
without ``balance``'s refinement, so the plans are DDP's token shares and both sides run the same
micro-batches.  Three configurations, interleaved over ``--rounds``:

* ``ddp``: Lightning's ``DDPStrategy``, one backward per micro-batch under ``no_sync`` except the
  last (the benchmark's DDP user, who logs the loss every step with ``LightningModule.log``);
* ``bytescale``: ``ByteScaleStrategy`` with its defaults (plan-digest check, the gradient
  finiteness check once a step, loss-normalisation probe, watchdog, preemption, the loss
  logged every step);
* ``bytescale_unchecked``: the same with those checks off, to show what they cost.

Reported per configuration: milliseconds of CPU per rank and step for each function (median
over rounds of the mean over ranks and steps), grouped into *model* (forward, backward, the
optimizer: the same work on both sides), *loop* (Lightning's loop and data fetching) and
*machinery* (everything the strategy or the DDP user's loop adds).  The accounting's own cost
per call, calibrated on empty calls before the ranks start (:func:`calibrate`), is taken out
of every figure; inside a real step it is larger than in the calibration loop, so items made of
many small calls (the gradient hooks) are still somewhat over-stated.  Apart from those, each
configuration reports ``other_threads_ms``: the CPU of each rank's other threads (gloo's workers
run the asynchronous collectives there), which the main-thread figures do not see.  The
machinery and other-thread figures are what the all-short wall-time ratio is made of when both
sides run the same plan.

Last, ``collective_cpu_ms`` times one gloo collective of each kind the HDP step issues (the
plan-digest all-gather, the step's scalars, a first gradient bucket), alone and many times in a
row, on 4 ranks sharing the 2 cores and on 2 ranks a core each: what a collective costs a rank in
CPU, whatever it carries, when its ranks share cores.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import strategy_throughput as bench
import torch
import torch.distributed as dist
from _common import free_port, init_gloo, run_parser, run_ranks, write_rank
from lightning.pytorch.loops import fetchers
from lightning.pytorch.loops import training_epoch_loop as epoch_loop
from torch.nn.parallel import DistributedDataParallel

from lightning_bytescale.engine import executor, grad_sync
from lightning_bytescale.lightning import strategy as strategy_module
from lightning_bytescale.models.llama import LlamaModel

CONFIGS: dict[str, dict[str, Any] | None] = {
    "ddp": None,
    "bytescale": {},
    "bytescale_unchecked": {
        "check_finite": False,
        "check_loss_normalization": False,
        "check_attention": False,
        "check_parameters_every_n_steps": 0,
        "log_loss": False,
        "watchdog": False,
        "preemption": False,
    },
}

MODEL = ("model forward", "autograd backward", "optimizer step")
LOOP = ("Lightning loop", "data fetch")

_totals: dict[str, float] = {}
_calls: dict[str, int] = {}  # accounted calls of each label
_callee_calls: dict[str, int] = {}  # accounted calls made from inside each label
_stack: list[list[Any]] = []


def _account(owner: Any, name: str, label: str) -> None:
    """Charge the main thread's CPU time inside ``owner.name`` to ``label`` (exclusive of callees)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        _stack.append([label, 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            _, inner = _stack.pop()
            spent = time.thread_time() - start
            _totals[label] = _totals.get(label, 0.0) + spent - inner
            _calls[label] = _calls.get(label, 0) + 1
            if _stack:
                _stack[-1][1] += spent
                _callee_calls[_stack[-1][0]] = _callee_calls.get(_stack[-1][0], 0) + 1

    setattr(owner, name, timed)


class _Probe:
    """A loop of empty calls, to measure what the accounting itself costs per call."""

    @staticmethod
    def empty() -> None:
        return None

    @staticmethod
    def loop(n: int) -> None:
        for _ in range(n):
            _Probe.empty()


def calibrate(n: int = 200_000) -> dict[str, float]:
    """Seconds of CPU the accounting adds per accounted call: to the call's own label (``inner``:
    its clock reads and book-keeping inside the measured span) and to its caller's (``outer``).

    An accounted loop of ``n`` empty calls is timed with the calls plain and then accounted: the
    empty call's own figure is its inner cost (the empty body is part of it, which makes the
    correction a little too small), and what the loop's figure grows by is the outer cost.
    """
    plain_start = time.thread_time()
    _Probe.loop(n)
    plain = time.thread_time() - plain_start
    _account(_Probe, "loop", "probe loop")
    _account(_Probe, "empty", "probe call")
    _Probe.loop(n)
    inner = _totals.pop("probe call") / n
    outer = max(0.0, (_totals.pop("probe loop") - plain) / n)
    for table in (_calls, _callee_calls):
        table.pop("probe call", None)
        table.pop("probe loop", None)
    return {"inner": inner, "outer": outer}


CALIBRATION = {"inner": 0.0, "outer": 0.0}  # set by main() before the ranks start
CALLS: dict[str, dict[str, float]] = {}  # accounted calls per rank and step, each configuration's last run
OTHER_THREADS: dict[str, float] = {}  # CPU ms per rank and step of the ranks' other threads, the last run


def _install() -> None:
    """The accounted functions: the model's work, the loop's, and each side's machinery."""
    plain: list[tuple[Any, str, str]] = [
        (epoch_loop._TrainingEpochLoop, "advance", "Lightning loop"),
        (fetchers._PrefetchDataFetcher, "__next__", "data fetch"),
        (LlamaModel, "forward", "model forward"),
        (torch.Tensor, "backward", "autograd backward"),
        (torch.optim.AdamW, "step", "optimizer step"),
        (bench.LM, "training_step", "user training_step"),
        (DistributedDataParallel, "forward", "DDP forward wrapper"),
        (pl.LightningModule, "log", "LightningModule.log"),
        (dist, "all_reduce", "collective calls"),
        (dist, "all_gather", "collective calls"),
        (dist, "broadcast", "collective calls"),
        (executor, "run_micro_batch", "run_micro_batch"),
        (executor, "_grads_finite", "finiteness checks"),
        (executor, "start_plan_agreement", "plan digest check"),
        (strategy_module, "check_step", "plan digest check"),
        (strategy_module, "sync_step", "sync_step (scalars, reports)"),
        (executor, "_start_scalars", "sync_step (scalars, reports)"),
        (executor._PendingScalars, "wait", "sync_step (scalars, reports)"),
        (grad_sync.BucketedGradSync, "local_grads_finite", "finiteness checks"),
        (grad_sync.BucketedGradSync, "prepare", "gradient buckets (zero, views)"),
        (grad_sync.BucketedGradSync, "_on_grad", "gradient hooks"),
        (grad_sync.BucketedGradSync, "_launch", "gradient buckets (launch)"),
        (grad_sync.BucketedGradSync, "_complete", "gradient buckets (wait)"),
        (grad_sync.BucketedGradSync, "finish", "gradient buckets (wait)"),
    ]
    for name in ("training_step", "_sync", "optimizer_step", "backward", "_beat", "_named_params"):
        plain.append((strategy_module.ByteScaleStrategy, name, f"strategy {name}"))
    for owner, name, label in plain:
        _account(owner, name, label)


class _Collect(pl.Callback):
    """Starts counting after ``warmup`` steps; each rank writes its totals at the end.

    Besides the accounted functions it records the CPU of the rank's whole process against its
    main thread's over the measured steps: the difference is what the process's other threads
    (gloo's workers, which run the asynchronous collectives, and the watchdog) spent.
    """

    def __init__(self, out: Path, warmup: int) -> None:
        self.out, self.warmup, self.steps = out, warmup, 0
        self.process0 = self.thread0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.warmup:
            for table in (_totals, _calls, _callee_calls):
                table.clear()
            self.process0, self.thread0 = time.process_time(), time.thread_time()
        if trainer.global_step >= self.warmup:
            self.steps += 1

    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        path = self.out.with_name(f"{self.out.name}.{trainer.global_rank}")
        other = (time.process_time() - self.process0) - (time.thread_time() - self.thread0)
        row = {
            "steps": self.steps,
            "totals": _totals,
            "calls": _calls,
            "callee_calls": _callee_calls,
            "other_threads_s": other,
        }
        path.write_text(json.dumps(row))


def _corrected(rank: dict[str, Any], label: str) -> float:
    """A label's seconds less what the accounting of its own calls and of its callees' added."""
    spent = rank["totals"].get(label, 0.0)
    spent -= CALIBRATION["inner"] * rank["calls"].get(label, 0)
    spent -= CALIBRATION["outer"] * rank["callee_calls"].get(label, 0)
    return max(0.0, spent)


def run(config: str, steps: int, warmup: int, tmp: Path) -> dict[str, float]:
    """One run of ``config``; returns CPU ms per rank and step for each accounted function, the
    accounting's own cost taken out (:func:`calibrate`)."""
    out = tmp / f"overhead-{config}"
    options = CONFIGS[config]
    trainer_cls: Callable[..., pl.Trainer] = pl.Trainer

    def with_collector(*args: Any, **kwargs: Any) -> pl.Trainer:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), _Collect(out, warmup)]
        return trainer_cls(*args, **kwargs)

    strategy_cls = bench.ByteScaleStrategy
    bench.pl.Trainer = with_collector  # type: ignore[misc]
    if options is not None:
        bench.ByteScaleStrategy = functools.partial(strategy_cls, **options)  # type: ignore[misc]
    try:
        bench.run("ddp" if options is None else "bytescale", "all_short", "balance", steps, tmp, warmup)
    finally:
        bench.pl.Trainer = trainer_cls  # type: ignore[misc]
        bench.ByteScaleStrategy = strategy_cls  # type: ignore[misc]
    ranks = [json.loads(out.with_name(f"{out.name}.{r}").read_text()) for r in range(bench.WORLD)]
    labels = sorted(set().union(*(r["totals"] for r in ranks)))
    CALLS[config] = {
        label: statistics.mean(r["calls"].get(label, 0) / max(r["steps"], 1) for r in ranks)
        for label in labels
    }
    OTHER_THREADS[config] = 1e3 * statistics.mean(r["other_threads_s"] / max(r["steps"], 1) for r in ranks)
    return {
        label: 1e3 * statistics.mean(_corrected(r, label) / max(r["steps"], 1) for r in ranks)
        for label in labels
    }


def summarise(runs: list[dict[str, float]]) -> dict[str, Any]:
    labels = sorted(set().union(*runs))
    per_function = {label: statistics.median(r.get(label, 0.0) for r in runs) for label in labels}
    groups = {
        "model": sum(v for k, v in per_function.items() if k in MODEL),
        "loop": sum(v for k, v in per_function.items() if k in LOOP),
        "machinery": sum(v for k, v in per_function.items() if k not in MODEL + LOOP),
    }
    return {
        "ms_per_rank_step": dict(sorted(per_function.items(), key=lambda kv: -kv[1])),
        "groups_ms": groups,
        "total_ms": sum(groups.values()),
        "rounds": len(runs),
    }


def _digest_all_gather(world: int) -> Callable[[], None]:
    outs, mine = [torch.zeros(4, dtype=torch.int64) for _ in range(world)], torch.zeros(4, dtype=torch.int64)
    return lambda: dist.all_gather(outs, mine, async_op=True).wait()


def _all_reduce_of(tensor: torch.Tensor) -> Callable[[int], Callable[[], None]]:
    return lambda world: lambda: dist.all_reduce(tensor, async_op=True).wait()


# one collective of each kind HDP's step issues, alone: label -> (world -> a callable that runs it once)
COLLECTIVES: dict[str, Callable[[int], Callable[[], None]]] = {
    "plan-digest all-gather (4 int64 a rank)": _digest_all_gather,
    "step scalars all-reduce (256 float64)": _all_reduce_of(torch.zeros(256, dtype=torch.float64)),
    "first gradient bucket all-reduce (1 MiB float32)": _all_reduce_of(torch.zeros(262144)),
}


def _collective_rank(rank: int, world: int, port: int, parts: str, calls: int) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, world, port, 120.0)
    row = {}
    for label, build in COLLECTIVES.items():
        once = build(world)
        for _ in range(10):
            once()
        dist.barrier()
        process0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
        for _ in range(calls):
            once()
        process, thread = time.process_time() - process0, time.thread_time() - thread0
        row[label] = {
            "process_ms": 1e3 * process / calls,
            "main_thread_ms": 1e3 * thread / calls,
            "wall_ms": 1e3 * (time.perf_counter() - wall0) / calls,
        }
        dist.barrier()
    dist.destroy_process_group()
    write_rank(parts, "collective", rank, row)


def collective_costs(world: int, calls: int = 200) -> dict[str, dict[str, float]]:
    """CPU a rank spends on one gloo collective of each kind in :data:`COLLECTIVES`, issued
    asynchronously and waited for at once, ``calls`` times in a row (mean over ranks)."""
    with tempfile.TemporaryDirectory() as parts:
        rows = run_ranks(_collective_rank, (world, free_port(), parts, calls), world, parts, "collective")
    return {
        label: {key: statistics.mean(r[label][key] for r in rows) for key in rows[0][label]}
        for label in COLLECTIVES
    }


def main() -> None:
    args = run_parser(__doc__, "step_overhead", steps=24, warmup=4, rounds=2).parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # one thread a rank; and forked ranks must not inherit an OpenMP pool
    # the default cost model, unrefined: the plans are DDP's token shares, so both sides run the same work
    setting = bench.SHORT["all_short"]
    bench.SHORT["all_short"] = (*setting[:4], None, *setting[5:])
    bench.make_plan = functools.partial(bench.make_plan, options={"refine": False})
    CALIBRATION.update(calibrate())  # in the parent, before any rank is forked
    _install()
    names = list(CONFIGS)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    other: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.rounds):
            for name in names[::-1] if i % 2 else names:
                runs[name].append(run(name, args.steps, args.warmup, Path(d)))
                other[name].append(OTHER_THREADS[name])
                print(f"round {i} {name}: {sum(runs[name][-1].values()):.1f} ms/rank-step", file=sys.stderr)
    result = {
        "setup": {
            "world": bench.WORLD,
            "data": "all_short: uniform 64..512 tokens, C = 512, 4096 tokens a step",
            "plans": "balance with the default cost model and refine=False: DDP's token shares",
            "steps_per_run": args.steps,
            "warmup_steps": args.warmup,
            "rounds": args.rounds,
            "measure": (
                "main-thread CPU ms per rank and step, exclusive of the other listed functions, less the "
                "accounting's own cost per call (calibrated on empty calls)"
            ),
            "accounting_us_per_call": {k: 1e6 * v for k, v in CALIBRATION.items()},
            "other_threads": (
                "other_threads_ms: CPU ms per rank and step of each rank's other threads (its process's "
                "CPU less its main thread's, over the measured steps; median over rounds), not in total_ms"
            ),
            "unchecked_options": CONFIGS["bytescale_unchecked"],
        },
        **{
            name: {
                **summarise(runs[name]),
                "calls_per_rank_step": CALLS[name],
                "other_threads_ms": statistics.median(other[name]),
            }
            for name in names
        },
    }
    # what one collective costs a rank, alone: 4 ranks on the 2 cores as above, and 2 ranks a core each
    result["collective_cpu_ms"] = {f"{w} ranks": collective_costs(w) for w in (bench.WORLD, 2)}
    result["setup"]["collectives"] = (
        "collective_cpu_ms: one gloo collective of each kind HDP's step issues, alone (asynchronous, waited "
        "for at once, 200 in a row): CPU ms per call of a rank's process (all threads) and of its main "
        "thread, and wall ms; mean over ranks; 4 ranks on the 2 cores, and 2 ranks a core each"
    )
    ddp, hdp = result["ddp"]["groups_ms"], result["bytescale"]["groups_ms"]
    result["machinery_over_ddp_ms"] = hdp["machinery"] - ddp["machinery"]
    result["total_over_ddp"] = result["bytescale"]["total_ms"] / result["ddp"]["total_ms"]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name in names:
        print(
            name,
            json.dumps(result[name]["groups_ms"]),
            f"total {result[name]['total_ms']:.1f} ms, other threads {result[name]['other_threads_ms']:.1f} ms",
        )
    print(f"machinery over ddp: {result['machinery_over_ddp_ms']:.1f} ms/rank-step")
    for ranks, costs in result["collective_cpu_ms"].items():
        for label, c in costs.items():
            print(
                f"{ranks}: {label}: {c['process_ms']:.2f} ms CPU ({c['main_thread_ms']:.2f} main), {c['wall_ms']:.2f} ms wall"
            )


if __name__ == "__main__":
    main()
