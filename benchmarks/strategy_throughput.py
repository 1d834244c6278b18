"""Tokens/s of ByteScaleStrategy on CPU ranks: planners on long-tail data, and HDP vs plain DDP.

Run: ``python benchmarks/strategy_throughput.py`` (about 1-2 minutes a round on 2 cores, more
when they are shared with other jobs; the committed file: ``--rounds 12 --max-minutes 25``, all
12 rounds in 14 minutes on an otherwise idle machine); writes ``benchmarks/results/strategy.json``.

* Long-tail data (the ``byted`` length mix scaled from 2M to the context length 4 x C): the
  same global batches for ``balance``, ``naive`` and ``static`` (cp_size 4) with the strategy's
  default ``offload=False``, and ``balance_offload``: ``balance`` with
  ``ByteScaleStrategy(offload=True)``, which plans selective activation offload (a sequence
  may hold more than C tokens a rank, the excess of its activations offloaded) and runs it
  (on CPU the "host" is a store of copies, so the copies cost what they cost).  All of them
  are given the cost model fitted on this CPU (below), as a user who ran ``bytescale-profile``
  would; each loader plans with its strategy's own ``planner_options()``, as
  ``ByteScaleDataModule`` does.  Until December 2026 the long-tail runs used the planner's
  default cost model (the paper preset, fitted on a GPU cluster) and no offload.
* ``long_tail_w2``: the same mix on 2 ranks, a core each (context 2 x C, 2048 tokens a step,
  so each rank's share is as on 4 ranks; ``static`` with cp_size 2), for ``balance``, ``naive``
  and ``static``: on 4 ranks sharing 2 cores a step costs the ranks' total CPU, whatever the
  balance, and ring members also wait for a core at every ring step.
* All-short data, every sequence fits one rank's micro-batch: ``bytescale`` (planner
  ``balance``) against Lightning's plain ``ddp``, in two settings.  ``all_short``: lengths
  uniform in 64..512, C = 512, 4096 tokens a step.  ``all_short_2k``: lengths uniform in
  64..2048, C = 2048, 16384 tokens a step.  In both the planner is given the cost model fitted
  on this CPU on lengths 64..2048 (``benchmarks/results/strategy_comm_aware.json``: each
  micro-batch costs a fixed 3.6 ms, and the quadratic attention term equals the linear one at
  about 1,500 tokens), what a user gets from ``bytescale-profile``, so HDP balances the ranks
  by that cost while DDP balances tokens (``--check-costs`` prints both per-rank costs).  With
  the default (paper) cost model the ``all_short`` plans equal DDP's token shares, and the pair
  measures only the step machinery: ``benchmarks/step_overhead.py`` accounts for that per
  function.
* The same two all-short settings on 2 ranks, a core each (``all_short_w2``: 2048 tokens a
  step; ``all_short_2k_w2``: 8192), so each rank's share is as large as in the 4-rank setting.
  Four ranks on two cores time-share them: a rank that reaches the gradient sync early gives
  its core to another, so the step takes about the ranks' total CPU time over 2 whatever the
  balance, and the 4-rank pairs compare the two sides' CPU per step.  With a core per rank, as
  every rank of a cluster has a device of its own, the step takes as long as its slowest rank,
  which is what the planner balances.

The all-short comparison is made fair on every count a DDP user controls:

* the same model (same seed), the same optimizer (AdamW, lr 1e-4), the same global batches
  (the same sequences each step) and the same loss (token sum over the global token count;
  DDP averages gradients over ranks, so its loss is scaled by the world size);
* the same device-memory limit: no micro-batch holds more than C tokens.  HDP obeys it by
  construction.  Each DDP rank gets an equal-token share of the global batch (longest first,
  to the least-loaded rank), packs it best-fit into micro-batches of at most C tokens, and
  accumulates over them with one backward per micro-batch under ``no_sync`` except the last,
  whose backward runs DDP's bucketed all-reduce overlapped with it (``manual_backward`` in a
  LightningModule with manual optimization: what a DDP user must do when a share does not fit
  in one micro-batch; Lightning's ``accumulate_grad_batches`` cannot, since the number of
  micro-batches differs between ranks and steps).  A single backward over a whole share would
  hold the activations of all its packs at once, over the limit;
* both log the loss every step with ``LightningModule.log``, as a user does (ByteScaleStrategy
  logs the global token mean by default; the DDP module logs its rank's share, which needs no
  collective; until December 2026 the DDP side logged nothing);
* both run their defaults otherwise: DDP with 25 MB buckets; ByteScaleStrategy with its
  checks on (plan digest, finiteness, loss-normalisation probe, watchdog, preemption);
* after every run rank 0's parameters are kept, and the JSON reports how far the ``bytescale``
  and ``ddp`` parameters of the same round are apart after the same steps
  (``max_param_diff_vs_ddp``): the two train the same model.

What differs is what is compared: HDP balances ranks by the planner's cost model (attention is
quadratic in a sequence's length) and may give ranks different numbers of micro-batches; DDP
balances tokens.

Throughput is global tokens per second of wall time inside the training step (micro-batches,
gradient sync and optimizer step; data loading and planning run in the loader's worker and
are outside), after ``--warmup`` steps.  The machine is shared, so every configuration runs
``--rounds`` times, interleaved (round i runs every configuration once before round i + 1, in
reverse order every other round and from a place that moves, so that each pair's two sides take
turns to go first),
and the headline ``tokens_per_s`` is the **median over rounds** of each round's measured
tokens / measured wall time; ``tokens_per_s_all_rounds`` has every round, ``step_wall_s``
every measured step of every round, ``load_avg`` the 1-minute load average before each run.
``static`` runs in every round too (``--static-rounds`` limits it to the first rounds, for a
quicker look): its ratio to ``balance`` is only meaningful between medians over the same
rounds, since the load on a shared machine drifts from round to round.  The per-rank measured busy time, its imbalance and the
planned imbalance come from ``strategy.step_stats``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from _common import plan_options
from torch.utils.data import Dataset

import lightning_bytescale  # noqa: F401  (registers the strategies)
from lightning_bytescale import ByteScaleStrategy, attention_context, token_loss
from lightning_bytescale.engine.batch import PackedMicroBatch
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.planner import make_plan
from lightning_bytescale.planner.distributions import sample_global_batch

WORLD = 4
CAPACITY = 512
TOKENS_PER_STEP = 4096
VOCAB = 512


# long-tail settings: ranks (the context is ranks x C, a sequence may span every rank) and
# tokens per step.  ``long_tail_w2``: 2 ranks, a core each, each rank's share as on 4 ranks.
LONG = {"long_tail": (WORLD, TOKENS_PER_STEP), "long_tail_w2": (2, TOKENS_PER_STEP // 2)}


def long_tail_lengths(step: int, setting: str = "long_tail") -> list[int]:
    world, tokens = LONG[setting]
    lengths = sample_global_batch("byted", tokens, context_length=world * CAPACITY, seed=step, mode="scale")
    return [max(2, s) for s in lengths]


def lengths_of(data: str, step: int) -> list[int]:
    """One step's sequence lengths in a setting (long-tail or all-short)."""
    return long_tail_lengths(step, data) if data in LONG else short_lengths(step, data)


# all-short settings: (shortest, longest, capacity C, tokens per step, cost model for HDP, ranks).
# The ``_w2`` settings run 2 ranks on the 2 cores, a core each (as every rank of a cluster has a
# device of its own), with each rank's share as large as in the 4-rank setting of the same name.
SHORT = {
    "all_short": (64, 512, CAPACITY, TOKENS_PER_STEP, "fitted", WORLD),
    "all_short_2k": (64, 2048, 2048, 16384, "fitted", WORLD),
    "all_short_w2": (64, 512, CAPACITY, TOKENS_PER_STEP // 2, "fitted", 2),
    "all_short_2k_w2": (64, 2048, 2048, 16384 // 2, "fitted", 2),
}
# each all-short setting's bytescale/ddp ratio in the file's ``ratios`` (all_short_2k: ..._short_2k)
RATIO_KEYS = {setting: "bytescale_over_ddp_" + setting.removeprefix("all_") for setting in SHORT}
FITTED = Path(__file__).parent / "results" / "strategy_comm_aware.json"


def fitted_cost_model() -> dict:
    """The cost model the profiler fitted on this CPU (the comm-aware benchmark's file)."""
    return json.loads(FITTED.read_text())["cost_model"]


def short_lengths(step: int, setting: str = "all_short") -> list[int]:
    lo, hi, _, total, _, _ = SHORT[setting]
    g = torch.Generator().manual_seed(10_000 + step)
    out, have = [], 0
    while have < total:
        s = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), total - have)
        s = max(s, 2)
        out.append(s)
        have += s
    return out


def capacity_of(data: str) -> int:
    return SHORT[data][2] if data in SHORT else CAPACITY


def world_of(data: str) -> int:
    """Ranks of a setting: 4 (on the 2 cores) unless the setting says otherwise (the ``_w2`` ones: 2)."""
    return SHORT[data][5] if data in SHORT else LONG[data][0]


LONG_TAIL_COST = "fitted"  # the long-tail planners' cost model, like the short settings'


def cost_model_of(data: str) -> dict | None:
    use = SHORT[data][4] if data in SHORT else LONG_TAIL_COST
    return fitted_cost_model() if use == "fitted" else None


def ddp_shares(lengths: list[int], world: int, capacity: int) -> list[list[list[int]]]:
    """Every rank's packs: equal-token shares (longest first, to the least-loaded rank), best fit
    into packs of <= ``capacity`` tokens."""
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += lengths[j]
        shares[r].append(j)
    out = []
    for mine in shares:
        packs: list[list[int]] = []
        for j in mine:
            fits = [p for p in packs if sum(lengths[i] for i in p) + lengths[j] <= capacity]
            if fits:
                max(fits, key=lambda p: sum(lengths[i] for i in p)).append(j)
            else:
                packs.append([j])
        out.append(packs)
    return out


def tokens_of(lengths: list[int], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, VOCAB, (s,), generator=g) for s in lengths]


class HDPData(Dataset):
    """Plans every step with the strategy's own planner options (``strategy.planner_options()``,
    what ``ByteScaleDataModule`` passes), so the plan and the strategy agree (offload included)."""

    def __init__(self, data: str, opts: dict, world: int, rank: int, steps: int) -> None:
        self.data, self.opts, self.world, self.rank, self.steps = data, opts, world, rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int):
        lengths = lengths_of(self.data, k)
        seqs = tokens_of(lengths, k)
        t0 = time.perf_counter()
        plan = make_plan(tuple(lengths), world_size=self.world, **self.opts)
        plan_ms = (time.perf_counter() - t0) * 1e3
        batch = build_step(plan, self.rank, lambda j: seqs[j], step=k)
        batch.stats = dict(batch.stats, plan_ms=plan_ms, lengths=list(lengths))
        return batch


class DDPData(Dataset):
    """Plain data parallelism: rank r gets an equal-token share of the same global batch,
    packed best-fit into local micro-batches of at most C tokens (the granularity HDP uses)."""

    def __init__(self, data: str, world: int, rank: int, steps: int) -> None:
        self.data, self.world, self.rank, self.steps = data, world, rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> list[PackedMicroBatch]:
        lengths = short_lengths(k, self.data)
        seqs = tokens_of(lengths, k)
        n = sum(s - 1 for s in lengths)
        packs = ddp_shares(lengths, self.world, capacity_of(self.data))[self.rank]
        return [_pack(p, lengths, seqs, n) for p in packs]


def _pack(js: list[int], lengths: list[int], seqs: list[torch.Tensor], n: int) -> PackedMicroBatch:
    ids = torch.cat([seqs[j] for j in js])
    labels = torch.cat([torch.cat([seqs[j][1:], torch.tensor([-100])]) for j in js])
    cu = torch.zeros(len(js) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor([lengths[j] for j in js]), 0)
    layout = AttentionLayout(cu_seqlens=cu, seq_lens=tuple(lengths[j] for j in js))
    return PackedMicroBatch(ids, labels, layout.positions(), layout, tuple(js), n)


class DataModule(pl.LightningDataModule):
    def __init__(self, kind: str, data: str, steps: int) -> None:
        super().__init__()
        self.kind, self.data, self.steps = kind, data, steps

    def train_dataloader(self):
        t = self.trainer
        if self.kind == "ddp":
            ds: Dataset = DDPData(self.data, t.world_size, t.global_rank, self.steps)
        else:
            ds = HDPData(self.data, plan_options(t.strategy), t.world_size, t.global_rank, self.steps)
        return torch.utils.data.DataLoader(
            ds, batch_size=None, shuffle=False, num_workers=1, prefetch_factor=2
        )


class LM(pl.LightningModule):
    """Llama ``small``; ``ddp=True``: manual optimization, one backward per packed micro-batch."""

    def __init__(self, ddp: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(LlamaConfig.preset("small"))
        self.ddp = ddp
        self.automatic_optimization = not ddp

    def training_step(self, mb, batch_idx):
        if not self.ddp:  # ByteScaleStrategy: one call per micro-batch, the strategy does the rest
            return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)
        opt = self.optimizers()
        ddp_model = self.trainer.strategy.model  # the DistributedDataParallel wrapper
        world = self.trainer.world_size
        total = torch.zeros(())
        for i, part in enumerate(mb):  # this rank's packs of <= C tokens; only the last one syncs
            last = i == len(mb) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                with attention_context(part.layout):
                    logits = self.model(part.input_ids, part.position_ids)
                # DDP averages gradients over ranks: scale to the same global token mean
                loss = token_loss(logits, part.labels, part.num_global_tokens) * world
                self.manual_backward(loss)
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # what ByteScaleStrategy(log_loss=True) does for the HDP side (this rank's share, unreduced)
        self.log("train_loss", total / world, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)
        return total

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Timer(pl.Callback):
    def __init__(self, out: Path, data: str) -> None:
        self.out, self.data, self.rows, self.t0 = out, data, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        wall = time.perf_counter() - self.t0
        stats = dict(getattr(trainer.strategy, "step_stats", {}) or {})
        tokens = stats.get("tokens") or sum(lengths_of(self.data, batch_idx))
        self.rows.append({"wall_s": wall, "tokens": tokens, "stats": stats})

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))
            params = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            torch.save(params, self.out.with_suffix(".params.pt"))


def run(
    kind: str, data: str, planner: str, steps: int, tmp: Path, warmup: int = 2, offload: bool = False
) -> dict:
    os.environ.pop("MASTER_PORT", None)
    out = tmp / f"{kind}-{data}-{planner}{'-offload' if offload else ''}.json"
    if kind == "ddp":
        strategy: object = pl.strategies.DDPStrategy(start_method="fork", process_group_backend="gloo")
    else:
        strategy = ByteScaleStrategy(
            planner=planner,
            capacity=capacity_of(data),
            cost_model=cost_model_of(data),
            cp_size=world_of(data) if planner == "static" else None,
            offload=offload,
            start_method="fork",
            timeout=300,
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_of(data),
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Timer(out, data)],
    )
    load = os.getloadavg()[0]
    trainer.fit(LM(ddp=kind == "ddp"), datamodule=DataModule(kind, data, steps))
    rows = json.loads(out.read_text())[warmup:]
    wall = sum(r["wall_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    result = {
        "steps_measured": len(rows),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "step_wall_s": [r["wall_s"] for r in rows],
        "load_avg": load,
        "params": torch.load(out.with_suffix(".params.pt")),
    }
    if kind != "ddp":
        s = [r["stats"] for r in rows]
        result["stats"] = s
    return result


def summarise(kind: str, runs: list[dict], world: int = WORLD) -> dict:
    """Median over rounds (headline), every round, every step, and the HDP telemetry means."""
    per_round = [r["tokens_per_s"] for r in runs]
    out = {
        "rounds": len(runs),
        "steps_measured": sum(r["steps_measured"] for r in runs),
        "tokens_per_s": statistics.median(per_round),
        "tokens_per_s_mean": sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs),
        "tokens_per_s_all_rounds": per_round,
        "step_wall_s": [r["step_wall_s"] for r in runs],
        "load_avg": [r["load_avg"] for r in runs],
    }
    if kind != "ddp":
        s = [x for r in runs for x in r["stats"]]
        mean = lambda key: sum(x[key] for x in s) / len(s)  # noqa: E731
        out.update(
            max_over_mean_measured=mean("max_over_mean_measured"),
            max_over_mean_planned=mean("max_over_mean_planned"),
            bubble_fraction=mean("bubble_fraction"),
            ring_mbytes_per_step=mean("ring_bytes") / 2**20,
            micro_batches_per_rank=[sum(x["num_micro_batches"][r] for x in s) / len(s) for r in range(world)],
            mean_cp_degree=sum(sum(x["cp_degrees"]) / max(len(x["cp_degrees"]), 1) for x in s) / len(s),
            plan_ms=mean("plan_ms"),
            allreduce_ms=1e3 * mean("allreduce_s"),
            busy_ms_max_rank=1e3 * sum(max(x["busy_s"]) for x in s) / len(s),
        )
    return out


def cost_check(setting: str, steps: range) -> dict:
    """Per-rank cost of every step under the cost model fitted on this CPU: DDP's token shares
    against the ``balance`` plan (max over mean, and max over ranks in seconds)."""
    from lightning_bytescale.planner.cost_model import cost_model_from_json

    fit = cost_model_from_json(fitted_cost_model())
    _, _, capacity, _, use, world = SHORT[setting]
    ddp_imb, ddp_max, hdp_imb, hdp_max = [], [], [], []
    for k in steps:
        lengths = short_lengths(k, setting)
        per_rank = [
            sum(fit.local_time([lengths[i] for i in p]) for p in packs)
            for packs in ddp_shares(lengths, world, capacity)
        ]
        ddp_imb.append(max(per_rank) / statistics.mean(per_rank))
        ddp_max.append(max(per_rank))
        opts = {"cost_model": fitted_cost_model()} if use == "fitted" else {}
        plan = make_plan(tuple(lengths), world_size=world, capacity=capacity, planner="balance", **opts)
        # the plan's own rank times are under its cost model; recompute under the fitted one
        times = [0.0] * world
        for r in range(world):
            for mb in plan.ranks[r]:
                assert mb.is_local, "every all-short sequence fits one rank"
                times[r] += fit.local_time([lengths[piece.seq] for piece in mb.pieces])
        hdp_imb.append(max(times) / statistics.mean(times))
        hdp_max.append(max(times))
    return {
        "steps": [steps.start, steps.stop - 1],
        "ddp_max_over_mean": ddp_imb,
        "bytescale_max_over_mean": hdp_imb,
        "ddp_max_rank_s": ddp_max,
        "bytescale_max_rank_s": hdp_max,
        "predicted_bytescale_over_ddp": sum(ddp_max) / sum(hdp_max),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per run, including --warmup")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of every run left out")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved repetitions; the median counts")
    parser.add_argument(
        "--static-rounds", type=int, default=None, help="rounds that also run `static` (default: all)"
    )
    parser.add_argument(
        "--only", choices=("all", "all_short"), default="all", help="all_short: the HDP vs DDP pair alone"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "strategy.json"))
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no new round after this many minutes (the file records the rounds run)",
    )
    parser.add_argument(
        "--check-costs",
        action="store_true",
        help="print the per-rank cost check of the all-short settings and exit",
    )
    args = parser.parse_args()
    if args.check_costs:
        for setting in SHORT:
            print(setting, json.dumps(cost_check(setting, range(args.warmup, args.steps))))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    start = time.perf_counter()
    static_rounds = args.rounds if args.static_rounds is None else min(args.static_rounds, args.rounds)
    results: dict = {
        "setup": {
            "world": WORLD,
            "world_note": "4 ranks on the 2 cores, except the _w2 settings: 2 ranks, a core each",
            "capacity": CAPACITY,
            "tokens_per_step": TOKENS_PER_STEP,
            "model": "llama small (dim 128, 4 layers, vocab 512), float32, AdamW lr 1e-4",
            "long_tail_data": f"byted length mix scaled to context {WORLD * CAPACITY}",
            "long_tail_settings": {
                name: {
                    "ranks": ranks,
                    "context": ranks * CAPACITY,
                    "capacity": CAPACITY,
                    "tokens_per_step": tokens,
                    "static_cp_size": ranks,
                }
                for name, (ranks, tokens) in LONG.items()
            },
            "long_tail_cost_model": (
                "fitted on this CPU (strategy_comm_aware.json), for balance, naive and static"
                if LONG_TAIL_COST == "fitted"
                else "planner default (paper preset)"
            ),
            "short_data": "uniform 64..512 tokens",
            "short_settings": {
                name: {
                    "lengths": f"uniform {lo}..{hi}",
                    "ranks": ranks,
                    "capacity": cap,
                    "tokens_per_step": tokens,
                    "bytescale_cost_model": (
                        "fitted on this CPU (strategy_comm_aware.json)"
                        if use
                        else "planner default (paper preset)"
                    ),
                }
                for name, (lo, hi, cap, tokens, use, ranks) in SHORT.items()
            },
            "ddp_baseline": (
                "Lightning DDPStrategy (gloo, 25 MB buckets); each rank an equal-token share, packed "
                f"best-fit into micro-batches of <= {CAPACITY} tokens (the _2k settings: <= 2048), one "
                "backward each under no_sync except the last (manual optimization), same model, "
                "batches, loss and optimizer; the loss logged every step on both sides"
            ),
            "steps_per_run": args.steps,
            "warmup_steps": args.warmup,
            "rounds": args.rounds,
            "static_rounds": static_rounds,
            "headline": "tokens_per_s is the median over rounds of each round's tokens / wall time",
            "order": "interleaved; odd rounds in reverse order, the start moving by one place every two rounds",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, gloo",
        },
        **{setting: {} for setting in LONG},
        **{setting: {} for setting in SHORT},
    }
    # (group, name, kind, data, planner, offload)
    configs = [
        ("long_tail", "balance", "bytescale", "long_tail", "balance", False),
        ("long_tail", "balance_offload", "bytescale", "long_tail", "balance", True),
        ("long_tail", "naive", "bytescale", "long_tail", "naive", False),
        ("long_tail", "static", "bytescale", "long_tail", "static", False),
        ("long_tail_w2", "balance", "bytescale", "long_tail_w2", "balance", False),
        ("long_tail_w2", "naive", "bytescale", "long_tail_w2", "naive", False),
        ("long_tail_w2", "static", "bytescale", "long_tail_w2", "static", False),
        ("all_short", "bytescale", "bytescale", "all_short", "balance", False),
        ("all_short", "ddp", "ddp", "all_short", "balance", False),
        ("all_short_2k", "bytescale", "bytescale", "all_short_2k", "balance", False),
        ("all_short_2k", "ddp", "ddp", "all_short_2k", "balance", False),
        ("all_short_w2", "bytescale", "bytescale", "all_short_w2", "balance", False),
        ("all_short_w2", "ddp", "ddp", "all_short_w2", "balance", False),
        ("all_short_2k_w2", "bytescale", "bytescale", "all_short_2k_w2", "balance", False),
        ("all_short_2k_w2", "ddp", "ddp", "all_short_2k_w2", "balance", False),
    ]
    if args.only == "all_short":
        configs = [c for c in configs if c[0] in SHORT]
    rounds: dict[tuple[str, str], list[dict]] = {(c[0], c[1]): [] for c in configs}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        done = 0
        for i in range(args.rounds):
            # vary the order: a run right after another one (its processes still exiting, a
            # ring-heavy `static` run) can be slower, so odd rounds run in reverse (each pair's
            # two sides take turns to go first) and the start moves by one place every two rounds
            shift = (i // 2) % len(configs)
            order = configs[shift:] + configs[:shift]
            for group, name, kind, data, planner, offload in order[::-1] if i % 2 else order:
                if name == "static" and i >= static_rounds:
                    continue
                res = run(kind, data, planner, args.steps, Path(d), args.warmup, offload)
                rounds[(group, name)].append(res)
                print(
                    f"round {i} {group} {name}: {res['tokens_per_s']:.0f} tokens/s (load {res['load_avg']:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
            done = i + 1
            if args.max_minutes is not None and time.perf_counter() - start > 60 * args.max_minutes:
                break
    results["setup"]["rounds"] = done
    results["setup"]["static_rounds"] = min(static_rounds, done)
    for (group, name), runs in rounds.items():
        if not runs:
            continue
        results[group][name] = summarise("ddp" if name == "ddp" else "bytescale", runs, world_of(group))
    lt = results["long_tail"]
    initial = torch.cat([p.detach().reshape(-1) for p in LM().parameters()])
    medians = {}
    for setting in SHORT:
        sh = results[setting]
        short = rounds[(setting, "bytescale")], rounds[(setting, "ddp")]
        per_round = [h["tokens_per_s"] / d["tokens_per_s"] for h, d in zip(*short)]
        sh["bytescale_over_ddp_per_round"] = per_round
        medians[setting] = statistics.median(per_round)
        sh["max_param_diff_vs_ddp"] = max(
            float((h["params"] - d["params"]).abs().max()) for h, d in zip(*short)
        )
        sh["max_param_change"] = max(float((h["params"] - initial).abs().max()) for h in short[0])
        sh["cost_check"] = cost_check(setting, range(args.warmup, args.steps))
    nan = {"tokens_per_s": float("nan")}
    lt2 = results["long_tail_w2"]
    results["ratios"] = {
        "balance_over_static": lt.get("balance", nan)["tokens_per_s"] / lt.get("static", nan)["tokens_per_s"],
        "balance_over_naive": lt.get("balance", nan)["tokens_per_s"] / lt.get("naive", nan)["tokens_per_s"],
        "balance_offload_over_static": lt.get("balance_offload", nan)["tokens_per_s"]
        / lt.get("static", nan)["tokens_per_s"],
        "balance_over_static_w2": lt2.get("balance", nan)["tokens_per_s"]
        / lt2.get("static", nan)["tokens_per_s"],
        "balance_over_naive_w2": lt2.get("balance", nan)["tokens_per_s"]
        / lt2.get("naive", nan)["tokens_per_s"],
    }
    for setting, key in RATIO_KEYS.items():
        sh = results[setting]
        results["ratios"][key] = sh["bytescale"]["tokens_per_s"] / sh["ddp"]["tokens_per_s"]
        results["ratios"][f"{key}_median_of_rounds"] = medians[setting]
    results["machine_load"] = {
        "load_avg_1_5_15_before": list(load_before),
        "load_avg_1_5_15_after": list(os.getloadavg()),
        "note": "2 cores shared with other jobs; load_avg per run is in each configuration's entry",
    }
    results["wall_s"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["ratios"], indent=2))


if __name__ == "__main__":
    main()
