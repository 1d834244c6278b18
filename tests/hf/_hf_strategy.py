"""Shared by the HF strategy tests: the data read with the strategy's mesh, and the single-process reference.

The reference trains a checkpoint on each whole sequence with ``"sdpa"``:
float64, the batches of ``_strategy_helpers.global_batch``, the loss summed over every sequence's
tokens and divided by their count, ``torch.nn.utils.clip_grad_norm_`` (which must act in every
step) and AdamW with ``HFCausalLM``'s parameter groups (no weight decay below two dimensions).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _strategy_helpers import global_batch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoModelForCausalLM


def hf_reference(
    path: Path, steps: int, *, lr: float, weight_decay: float, max_norm: float
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``HFCausalLM``-named parameters after ``steps`` steps (``model.`` + the HF names) and each step's loss."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float64)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for k in range(steps):
        seqs = global_batch(k)
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        total = 0.0
        for s in seqs:
            logits = model(
                input_ids=s[None], position_ids=torch.arange(len(s))[None], use_cache=False
            ).logits[0]
            loss = F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert norm > max_norm, "clipping must act in every step"
        opt.step()
        losses.append(total)
    return {f"model.{k}": v for k, v in model.state_dict().items()}, losses


class MeshSteps(Dataset):
    """Item ``k`` of ``steps``: ``make(pmesh, k)``, this rank's batch of global batch ``k`` on the strategy's mesh."""

    def __init__(self, pmesh: Any, steps: int, make: Callable[[Any, int], Any]) -> None:
        self.pmesh, self.steps, self.make = pmesh, steps, make

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> Any:
        return self.make(self.pmesh, k)


class MeshData(pl.LightningDataModule):
    """A data module whose loader yields :class:`MeshSteps` read with the strategy's mesh.

    ``held_out``: the global batches of the validation loader (none: no validation).
    """

    def __init__(self, steps: int, make: Callable[[Any, int], Any], held_out: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.steps, self.make, self.held_out = steps, make, held_out

    def train_dataloader(self) -> StatefulDataLoader:
        steps = MeshSteps(self.trainer.strategy.parallel_mesh, self.steps, self.make)
        return StatefulDataLoader(steps, batch_size=None, shuffle=False)

    def val_dataloader(self) -> StatefulDataLoader | list:
        if not self.held_out:
            return []
        pmesh, held_out = self.trainer.strategy.parallel_mesh, self.held_out
        steps = MeshSteps(pmesh, len(held_out), lambda mesh, k: self.make(mesh, held_out[k]))
        return StatefulDataLoader(steps, batch_size=None, shuffle=False)


def fit_hf(
    out: Path,
    checkpoint: Path,
    strategy: Any,
    recorder: pl.Callback,
    steps: int,
    make: Callable[[Any, int], Any],
    *,
    lr: float,
    weight_decay: float,
    max_norm: float,
    held_out: tuple[int, ...] = (),
    **module_options: Any,
) -> None:
    """``HFCausalLM`` of ``checkpoint`` (float64) trained ``steps`` steps on 4 CPU ranks with clipping at ``max_norm``
    (``held_out``: global batches validated on at the epoch's end)."""
    from _strategy_helpers import QUIET

    from lightning_bytescale.hf import HFCausalLM

    os.environ.pop("MASTER_PORT", None)
    module = HFCausalLM(
        str(checkpoint), dtype=torch.float64, lr=lr, weight_decay=weight_decay, local_files_only=True,
        **module_options,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, precision="64-true", default_root_dir=out,
        max_steps=steps, gradient_clip_val=max_norm, callbacks=[recorder], **QUIET,
    )  # fmt: skip
    trainer.fit(module, datamodule=MeshData(steps, make, held_out))
