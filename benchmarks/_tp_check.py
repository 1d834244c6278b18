"""``gpu_check.py``'s tensor-parallel run: ``ByteScaleStrategy(tensor_parallel_size=2)`` on 2 or 4 ranks.

The LightningModule is the one ``tests/lightning/test_tensor_parallel_strategy.py`` trains on the
CPU: the reference Llama built whole in ``__init__`` and sharded in ``configure_model`` with
``parallelize_llama(self.model, self.device_mesh["tensor_parallel"])``; the data plans each global
batch for the HDP ranks and packs this rank's HDP share with its lane's ring ranks.  On GPUs the
strategy runs it on NCCL, in the dry run on gloo (CPU).  Every rank writes a JSON file with the
logged losses and step times, and rank 0 the gathered parameters.

A module of its own (``benchmarks`` is on ``sys.path``), so the spawn launcher's ranks can unpickle
these classes: ``gpu_check.py`` has used CUDA before this runs, so its ranks cannot be forked.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from lightning_bytescale import ByteScaleStrategy, token_loss
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner import make_plan


def sequences(step: int, vocab: int, capacity: int) -> list[torch.Tensor]:
    """Learnable sequences (arithmetic progressions mod vocab), lengths up to ``capacity`` (as gpu_check's)."""
    g = torch.Generator().manual_seed(step)
    lens = torch.randint(
        capacity // 8, capacity + 1, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g
    )
    out = []
    for s in lens.tolist():
        a, b = torch.randint(0, vocab, (2,), generator=g).tolist()
        out.append((a + (b % 7 + 1) * torch.arange(s)) % vocab)
    return out


class MeshSteps(Dataset):
    """Item ``k``: this HDP rank's share of global batch ``k`` (planned for the HDP ranks), this lane's rings."""

    def __init__(self, pmesh, steps: int, vocab: int, capacity: int) -> None:
        self.pmesh, self.steps, self.vocab, self.capacity = pmesh, steps, vocab, capacity

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int):
        seqs = sequences(k, self.vocab, self.capacity)
        dp = self.pmesh.dims.data_parallel
        plan = make_plan([len(s) for s in seqs], world_size=dp, capacity=self.capacity, planner="balance")
        return build_step(
            plan, self.pmesh.hdp_rank, lambda j: seqs[j], step=k, ring_ranks=self.pmesh.ring_ranks
        )


class MeshData(pl.LightningDataModule):
    def __init__(self, steps: int, vocab: int, capacity: int) -> None:
        super().__init__()
        self.steps, self.vocab, self.capacity = steps, vocab, capacity

    def train_dataloader(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        pmesh = self.trainer.strategy.parallel_mesh
        data = MeshSteps(pmesh, self.steps, self.vocab, self.capacity)
        return StatefulDataLoader(data, batch_size=None, shuffle=False, num_workers=0)


class TPLlama(pl.LightningModule):
    """Built whole from ``init`` (every rank the same), sharded with ``parallelize_llama`` in ``configure_model``."""

    def __init__(self, preset: str, init: dict[str, torch.Tensor], optimizer: str) -> None:
        super().__init__()
        self.model = LlamaModel(LlamaConfig.preset(preset))
        self.model.load_state_dict(init)
        self.optimizer = optimizer

    def configure_model(self) -> None:
        from lightning_bytescale.parallel import parallelize_llama

        parallelize_llama(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, mb, batch_idx):
        return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)

    def configure_optimizers(self):
        if self.optimizer == "sgd":  # linear in the gradient: the float64 check compares gradients
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class Record(pl.Callback):
    """Per rank: the logged loss and the wall time of every step (device-synchronised), the mesh coordinates."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        seconds = time.perf_counter() - self.t0
        loss = float(trainer.callback_metrics["train/loss"])
        self.rows.append({"step": batch.step, "loss": loss, "seconds": seconds})

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        strategy = trainer.strategy
        pmesh = strategy.parallel_mesh
        full = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in pl_module.model.state_dict().items()
        }
        report = {
            "rows": self.rows,
            "coords": [pmesh.hdp_rank, pmesh.lane],
            "mesh": list(pmesh.mesh.mesh.shape),
            "backend": torch.distributed.get_backend(),
            "device": str(pl_module.device),
            "dtensor_params": sum(isinstance(p, DTensor) for p in pl_module.parameters()),
        }
        r = trainer.global_rank
        (self.out / f"tp_report_{r}.json").write_text(json.dumps(report))
        if r == 0:
            torch.save(full, self.out / "tp_params.pt")


def fit(
    out: Path,
    *,
    accelerator: str,
    world: int,
    preset: str,
    init: dict[str, torch.Tensor],
    steps: int,
    capacity: int,
    precision: str,
    start_method: str,
) -> dict:
    """Train on ``world`` ranks at ``(world // 2, 2)``; the ranks' reports (and rank 0's gathered parameters)."""
    from _common import QUIET_TRAINER  # benchmarks/_common.py

    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MASTER_PORT", None)
    cfg = LlamaConfig.preset(preset)
    strategy = ByteScaleStrategy(
        tensor_parallel_size=2, planner="balance", capacity=capacity, start_method=start_method, timeout=300
    )
    trainer = pl.Trainer(
        accelerator=accelerator, devices=world, strategy=strategy, precision=precision, max_steps=steps,
        num_sanity_val_steps=0, default_root_dir=out, callbacks=[Record(out)], **QUIET_TRAINER,
    )  # fmt: skip
    optimizer = "sgd" if precision == "64-true" else "adamw"
    trainer.fit(TPLlama(preset, init, optimizer), datamodule=MeshData(steps, cfg.vocab, capacity))
    reports = [json.loads((out / f"tp_report_{r}.json").read_text()) for r in range(world)]
    return {"reports": reports, "params": torch.load(out / "tp_params.pt")}
