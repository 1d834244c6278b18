"""HF models under ``Trainer(strategy=ByteScaleStrategy(...))`` equal one process, exactly.

For 2 and 3 ranks, with and without a loss mask: three optimizer steps of tiny float64 HF models
(every family in ``TRAINED_FAMILIES``) through the real Trainer, the real strategy (fork
launcher, gloo), the balance planner with a capacity small enough that the long sequences are
sharded over rings, and ``HFCausalLM`` (checkpoints read by rank 0 only, the other ranks filled
by the strategy's broadcast) end with the same parameters, to 1e-10, as the same checkpoints run
with ``attn_implementation="sdpa"`` on each sequence alone in this process: an independent
reference with its own loss, optimizer and learning-rate factors.

One launch trains all families together: the LightningModule holds one ``HFCausalLM`` per family
and returns the sum of their losses.  The families share no parameter, AdamW and weight decay
act per parameter and there is no gradient clipping, so each family's trajectory is exactly the
one it would have alone (the per-family reference checks precisely that).

One run also offloads half of every micro-batch's activations of the HF decoder layers (the
strategy finds them), the memory saving that replaces HF gradient checkpointing here, and runs the
ring items of its second and third steps as Ulysses items (the heads split over both ranks by an
all-to-all inside the "bytescale" attention).

The loss mask is what the data side produces for chat data: labels -100 on masked positions
(here a "prompt" prefix of each sequence and a scattered pattern) and ``num_global_tokens``
counting only trained tokens, the same on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

pytest.importorskip("transformers")

from _strategy_helpers import quiet_trainer  # noqa: E402
from test_hf_families import TRAINED_FAMILIES, VOCAB, tiny_config  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_bytescale import ByteScaleStrategy  # noqa: E402
from lightning_bytescale.engine.micro_batch import build_step  # noqa: E402
from lightning_bytescale.hf import HFCausalLM  # noqa: E402
from lightning_bytescale.planner import make_plan  # noqa: E402

pytestmark = pytest.mark.multiprocess

CAPACITY = 16
STEPS = 3
LR = 0.02
WEIGHT_DECAY = 0.1
OPTIM = dict(lr=LR, weight_decay=WEIGHT_DECAY, warmup_steps=1, schedule="cosine", min_lr_ratio=0.2)
LR_FACTORS = [1.0, 1.0, 0.2]  # warmup 1/1, then a cosine from 1 to 0.2 over the remaining two steps


# ----------------------------------------------------------------------------- data
def global_batch(step: int, world: int) -> list[torch.Tensor]:
    """Short sequences plus long ones that need a ring (one of ``world`` ranks at the longest)."""
    g = torch.Generator().manual_seed(100 * world + step)
    lengths = torch.randint(2, CAPACITY, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
    lengths.append(int(torch.randint(CAPACITY + 2, 2 * CAPACITY + 1, (1,), generator=g)))
    if world >= 3:
        lengths.append(int(torch.randint(2 * CAPACITY + 2, 3 * CAPACITY + 1, (1,), generator=g)))
    return [torch.randint(1, VOCAB, (s,), generator=g) for s in lengths]


def masked(seq: int, pos: int, length: int) -> bool:
    """Whether the label at ``pos`` (the token at ``pos + 1``) is left out of the loss."""
    return pos < length // 4 or (3 * pos + seq) % 5 == 0


def trained_tokens(lengths: list[int], mask: bool) -> int:
    return sum(1 for j, s in enumerate(lengths) for p in range(s - 1) if not (mask and masked(j, p, s)))


class StepData(Dataset):
    """Item ``k``: this rank's StepBatch of global batch ``k``, loss-masked on request."""

    def __init__(
        self, world: int, rank: int, mask: bool, offload_ratio: float = 0.0, ulysses: bool = False
    ) -> None:
        self.world, self.rank, self.mask, self.offload_ratio = world, rank, mask, offload_ratio
        self.ulysses = ulysses

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, k: int):
        seqs = global_batch(k, self.world)
        lengths = [len(s) for s in seqs]
        plan = make_plan(lengths, world_size=self.world, capacity=CAPACITY, planner="balance")
        if self.ulysses and k > 0:
            for mbs in plan.ranks:
                for mb in mbs:
                    if mb.ring is not None:
                        mb.mode = "ulysses"
        batch = build_step(plan, self.rank, lambda j: seqs[j], step=k)
        for mb in batch.micro_batches:
            mb.offload_ratio = self.offload_ratio
        if self.mask:
            n = trained_tokens(lengths, mask=True)
            for mb in batch.micro_batches:
                seq = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(mb.layout.slots))
                for i, (j, p) in enumerate(zip(seq.tolist(), mb.position_ids.tolist())):
                    if p < lengths[j] and masked(j, p, lengths[j]):
                        mb.labels[i] = -100
                mb.num_global_tokens = n
            batch.num_global_tokens = n
        return batch


class StepDataModule(pl.LightningDataModule):
    def __init__(self, mask: bool, offload_ratio: float, ulysses: bool = False) -> None:
        super().__init__()
        self.mask, self.offload_ratio, self.ulysses = mask, offload_ratio, ulysses

    def train_dataloader(self):
        t = self.trainer
        data = StepData(t.world_size, t.global_rank, self.mask, self.offload_ratio, self.ulysses)
        return StatefulDataLoader(data, batch_size=None, shuffle=False, num_workers=0)


# ----------------------------------------------------------------------------- model
class Families(pl.LightningModule):
    """One HFCausalLM per family, trained together: the loss is the sum of theirs."""

    def __init__(self, folders: dict[str, str]) -> None:
        super().__init__()
        self.members = nn.ModuleDict({f: HFCausalLM(path, **OPTIM) for f, path in folders.items()})

    def configure_model(self) -> None:
        for member in self.members.values():
            member.trainer = self.trainer
            member.configure_model()

    def training_step(self, mb, batch_idx):
        return sum(member.training_step(mb, batch_idx) for member in self.members.values())

    def configure_optimizers(self):
        first = next(iter(self.members.values()))
        return first.optim.build(self.named_parameters(), total_steps=self.trainer.max_steps)


class Recorder(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.step_stats
        offloader = trainer.strategy.offloader
        offloaded = offloader.stats.offloaded_bytes if offloader is not None else 0
        modes = sorted({mb.layout.mode for mb in batch.micro_batches if mb.layout.ring is not None})
        self.rows.append(
            {
                "loss": float(outputs["loss"]),
                "cp_degrees": stats["cp_degrees"],
                "offloaded": offloaded,
                "modes": modes,
            }
        )

    def on_train_end(self, trainer, pl_module):
        r = trainer.global_rank
        loads = {f: m.load_report.weights for f, m in pl_module.members.items()}
        (self.out / f"rows_{r}.json").write_text(json.dumps({"rows": self.rows, "loads": loads}))
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out / f"params_{r}.pt"
        )


def fit(out: Path, folders: dict[str, str], world: int, mask: bool, offload: bool) -> None:
    strategy = ByteScaleStrategy(
        planner="balance",
        capacity=CAPACITY,
        start_method="fork",
        timeout=60,
        offload=offload,
        offloader_options={"keep_last": 0, "min_bytes": 0} if offload else None,
    )
    trainer = quiet_trainer(out, world, strategy, max_steps=STEPS, callbacks=[Recorder(out)])
    data = StepDataModule(mask, 0.5 if offload else 0.0, ulysses=offload)
    trainer.fit(Families(folders), datamodule=data)


# ----------------------------------------------------------------------------- reference
def reference(folder: str, world: int, mask: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, each sequence alone, sdpa, float64: parameters after STEPS steps and the losses."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float64)
    model.train()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    losses = []
    for k in range(STEPS):
        seqs = global_batch(k, world)
        n = trained_tokens([len(s) for s in seqs], mask)
        opt.zero_grad()
        total = 0.0
        for j, seq in enumerate(seqs):
            s = len(seq)
            logits = model(input_ids=seq[None], position_ids=torch.arange(s)[None], use_cache=False).logits[0]
            labels = torch.tensor(
                [-100 if mask and masked(j, p, s) else int(seq[p + 1]) for p in range(s - 1)]
            )
            loss = F.cross_entropy(logits[:-1], labels, ignore_index=-100, reduction="sum") / n
            loss.backward()
            total += loss.item()
        for group in opt.param_groups:
            group["lr"] = LR * LR_FACTORS[k]
        opt.step()
        losses.append(total)
    return model.state_dict(), losses


def checkpoints(root: Path) -> dict[str, str]:
    folders = {}
    for i, family in enumerate(TRAINED_FAMILIES):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float64)
        folders[family] = str(root / family)
        model.save_pretrained(folders[family])
    return folders


@pytest.mark.parametrize(
    ("world", "mask", "offload"),
    [(2, False, False), (3, False, False), (2, True, False), (3, True, False), (2, True, True)],
    ids=["2-all-tokens", "3-all-tokens", "2-loss-mask", "3-loss-mask", "2-loss-mask-offload-ulysses"],
)
def test_hf_families_equal_one_process(tmp_path, world, mask, offload):
    folders = checkpoints(tmp_path / "ckpt")
    out = tmp_path / "run"
    out.mkdir()
    fit(out, folders, world, mask, offload)

    results = {f: reference(path, world, mask) for f, path in folders.items()}
    want_losses = [sum(results[f][1][k] for f in folders) for k in range(STEPS)]
    for r in range(world):
        record = json.loads((out / f"rows_{r}.json").read_text())
        # only rank 0 read the checkpoints; the others were filled by the broadcast
        assert set(record["loads"].values()) == {"checkpoint" if r == 0 else "broadcast"}
        assert [row["loss"] for row in record["rows"]] == pytest.approx(want_losses, abs=1e-12, rel=0)
        if offload:  # the decoder layers' activations went through the host (bit-identical gradients)
            assert all(row["offloaded"] > 0 for row in record["rows"])
            assert [row["modes"] for row in record["rows"]] == [["ring"], ["ulysses"], ["ulysses"]]
        degrees = [d for row in record["rows"] for d in row["cp_degrees"]]
        assert max(degrees) == world and 1 in degrees  # long sequences on rings, short ones local
        got = torch.load(out / f"params_{r}.pt")
        for family, (want, _) in results.items():
            for name, value in want.items():
                err = (got[f"members.{family}.model.{name}"] - value).abs().max().item()
                assert err <= 1e-10, f"rank {r} {family} {name} differs from one process by {err:.3e}"
    # the run trained: parameters moved well beyond the tolerance
    first = AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.float64).state_dict()
    moved = max((results["llama"][0][k] - v).abs().max().item() for k, v in first.items())
    assert moved > 1e-3
