"""Tokens/s of ByteScaleStrategy on 4 CPU ranks: planners on long-tail data, and HDP vs plain DDP.

Run: ``python benchmarks/strategy_throughput.py`` (about 75 s on 2 cores); writes
``benchmarks/results/strategy.json``.

* Long-tail data (the ``byted`` length mix scaled from 2M to the context length 4 x C): the
  same global batches for ``balance``, ``naive`` and ``static`` (cp_size 4).
* All-short data (64..512 tokens): ``bytescale`` (balance) against Lightning's plain ``ddp``
  with the same model and the same global batches; DDP ranks get equal-token shares, packed
  into one local micro-batch each.

Throughput is global tokens per second of wall time inside the training step (micro-batches,
gradient all-reduce and optimizer step; data loading is outside), after two warm-up steps; the per-rank measured busy
time, its imbalance and the planned imbalance come from ``strategy.step_stats``.  The machine
is shared, so every configuration runs ``--rounds`` times, interleaved with the others, and
the fastest measured step counts (``tokens_per_s``; the mean is kept as ``tokens_per_s_mean``
and every step's wall time is in the JSON).  ``static`` runs one round only: it is several
times slower, and a second round would not change the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
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


def long_tail_lengths(step: int) -> list[int]:
    lengths = sample_global_batch(
        "byted", TOKENS_PER_STEP, context_length=WORLD * CAPACITY, seed=step, mode="scale"
    )
    return [max(2, s) for s in lengths]


def short_lengths(step: int) -> list[int]:
    g = torch.Generator().manual_seed(10_000 + step)
    out, have = [], 0
    while have < TOKENS_PER_STEP:
        s = min(int(torch.randint(64, 513, (1,), generator=g)), TOKENS_PER_STEP - have)
        s = max(s, 2)
        out.append(s)
        have += s
    return out


def tokens_of(lengths: list[int], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, VOCAB, (s,), generator=g) for s in lengths]


class HDPData(Dataset):
    def __init__(self, data: str, planner: str, world: int, rank: int, steps: int) -> None:
        self.data, self.planner, self.world, self.rank, self.steps = data, planner, world, rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int):
        lengths = long_tail_lengths(k) if self.data == "long_tail" else short_lengths(k)
        seqs = tokens_of(lengths, k)
        opts = {"cp_size": self.world} if self.planner == "static" else {}
        t0 = time.perf_counter()
        plan = make_plan(
            tuple(lengths), world_size=self.world, capacity=CAPACITY, planner=self.planner, **opts
        )
        plan_ms = (time.perf_counter() - t0) * 1e3
        batch = build_step(plan, self.rank, lambda j: seqs[j], step=k)
        batch.stats = dict(batch.stats, plan_ms=plan_ms, lengths=list(lengths))
        return batch


class DDPData(Dataset):
    """Plain data parallelism: rank r gets an equal-token share of the same global batch,
    packed best-fit into local micro-batches of at most C tokens (the granularity HDP uses)."""

    def __init__(self, world: int, rank: int, steps: int) -> None:
        self.world, self.rank, self.steps = world, rank, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> list[PackedMicroBatch]:
        lengths = short_lengths(k)
        seqs = tokens_of(lengths, k)
        n = sum(s - 1 for s in lengths)
        loads = [0] * self.world
        mine = []
        for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
            r = min(range(self.world), key=lambda r: (loads[r], r))
            loads[r] += lengths[j]
            if r == self.rank:
                mine.append(j)
        packs: list[list[int]] = []
        for j in mine:  # best fit into packs of <= CAPACITY tokens
            fits = [p for p in packs if sum(lengths[i] for i in p) + lengths[j] <= CAPACITY]
            if fits:
                max(fits, key=lambda p: sum(lengths[i] for i in p)).append(j)
            else:
                packs.append([j])
        return [_pack(p, lengths, seqs, n) for p in packs]


def _pack(js: list[int], lengths: list[int], seqs: list[torch.Tensor], n: int) -> PackedMicroBatch:
    ids = torch.cat([seqs[j] for j in js])
    labels = torch.cat([torch.cat([seqs[j][1:], torch.tensor([-100])]) for j in js])
    cu = torch.zeros(len(js) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor([lengths[j] for j in js]), 0)
    layout = AttentionLayout(cu_seqlens=cu, seq_lens=tuple(lengths[j] for j in js))
    return PackedMicroBatch(ids, labels, layout.positions(), layout, tuple(js), n)


class DataModule(pl.LightningDataModule):
    def __init__(self, kind: str, data: str, planner: str, steps: int) -> None:
        super().__init__()
        self.kind, self.data, self.planner, self.steps = kind, data, planner, steps

    def train_dataloader(self):
        t = self.trainer
        if self.kind == "ddp":
            ds: Dataset = DDPData(t.world_size, t.global_rank, self.steps)
        else:
            ds = HDPData(self.data, self.planner, t.world_size, t.global_rank, self.steps)
        return torch.utils.data.DataLoader(
            ds, batch_size=None, shuffle=False, num_workers=1, prefetch_factor=2
        )


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaModel(LlamaConfig.preset("small"))

    def training_step(self, mb, batch_idx):
        if isinstance(self.trainer.strategy, ByteScaleStrategy):
            return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)
        loss = torch.zeros(())
        for part in mb:  # plain DDP: this rank's packed micro-batches, one backward
            with attention_context(part.layout):
                logits = self.model(part.input_ids, part.position_ids)
            loss = loss + token_loss(logits, part.labels, part.num_global_tokens)
        # DDP averages gradients over ranks: scale to the same global token mean
        return loss * self.trainer.world_size

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Timer(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows, self.t0 = out, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        wall = time.perf_counter() - self.t0
        stats = dict(getattr(trainer.strategy, "step_stats", {}) or {})
        tokens = stats.get("tokens") or sum(short_lengths(batch_idx))
        self.rows.append({"wall_s": wall, "tokens": tokens, "stats": stats})

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.rows))


def run(kind: str, data: str, planner: str, steps: int, tmp: Path, warmup: int = 2) -> dict:
    os.environ.pop("MASTER_PORT", None)
    out = tmp / f"{kind}-{data}-{planner}.json"
    if kind == "ddp":
        strategy: object = pl.strategies.DDPStrategy(start_method="fork", process_group_backend="gloo")
    else:
        strategy = ByteScaleStrategy(planner=planner, capacity=CAPACITY, start_method="fork", timeout=300)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[Timer(out)],
    )
    trainer.fit(LM(), datamodule=DataModule(kind, data, planner, steps))
    rows = json.loads(out.read_text())[warmup:]
    wall = sum(r["wall_s"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    fastest = min(rows, key=lambda r: r["wall_s"] / r["tokens"])
    result = {
        "steps_measured": len(rows),
        "tokens_per_s": fastest["tokens"] / fastest["wall_s"],
        "tokens_per_s_mean": tokens / wall,
        "step_wall_s": [r["wall_s"] for r in rows],
    }
    if kind != "ddp":
        s = [r["stats"] for r in rows]
        mean = lambda key: sum(x[key] for x in s) / len(s)  # noqa: E731
        result.update(
            max_over_mean_measured=mean("max_over_mean_measured"),
            max_over_mean_planned=mean("max_over_mean_planned"),
            bubble_fraction=mean("bubble_fraction"),
            ring_mbytes_per_step=mean("ring_bytes") / 2**20,
            micro_batches_per_rank=[sum(x["num_micro_batches"][r] for x in s) / len(s) for r in range(WORLD)],
            mean_cp_degree=sum(sum(x["cp_degrees"]) / max(len(x["cp_degrees"]), 1) for x in s) / len(s),
            plan_ms=mean("plan_ms"),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per run, including --warmup")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of every run left out")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the best counts")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "strategy.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    start = time.perf_counter()
    results: dict = {
        "setup": {
            "world": WORLD,
            "capacity": CAPACITY,
            "tokens_per_step": TOKENS_PER_STEP,
            "model": "llama small (dim 128, 4 layers, vocab 512), float32",
            "long_tail_data": f"byted length mix scaled to context {WORLD * CAPACITY}",
            "short_data": "uniform 64..512 tokens",
            "steps_per_run": args.steps,
            "warmup_steps": args.warmup,
            "rounds": args.rounds,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, gloo",
        },
        "long_tail": {},
        "all_short": {},
    }
    configs = [
        ("long_tail", "balance", "bytescale", "long_tail", "balance"),
        ("long_tail", "naive", "bytescale", "long_tail", "naive"),
        ("long_tail", "static", "bytescale", "long_tail", "static"),
        ("all_short", "bytescale", "bytescale", "short", "balance"),
        ("all_short", "ddp", "ddp", "short", "balance"),
    ]
    rounds: dict[tuple[str, str], list[dict]] = {(c[0], c[1]): [] for c in configs}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.rounds):
            for group, name, kind, data, planner in configs:
                if name == "static" and i > 0:
                    continue  # 5-10x slower than the others: one round is enough to place it
                res = run(kind, data, planner, args.steps, Path(d), args.warmup)
                rounds[(group, name)].append(res)
                print(group, name, f"{res['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    for (group, name), runs in rounds.items():
        best = max(runs, key=lambda r: r["tokens_per_s"])
        results[group][name] = dict(best, tokens_per_s_all_rounds=[r["tokens_per_s"] for r in runs])
    lt, sh = results["long_tail"], results["all_short"]
    results["ratios"] = {
        "balance_over_static": lt["balance"]["tokens_per_s"] / lt["static"]["tokens_per_s"],
        "balance_over_naive": lt["balance"]["tokens_per_s"] / lt["naive"]["tokens_per_s"],
        "bytescale_over_ddp_short": sh["bytescale"]["tokens_per_s"] / sh["ddp"]["tokens_per_s"],
    }
    results["wall_s"] = time.perf_counter() - start
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["ratios"], indent=2))


if __name__ == "__main__":
    main()
