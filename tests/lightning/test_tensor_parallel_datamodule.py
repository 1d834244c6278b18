"""``ByteScaleDataModule`` under ``ByteScaleStrategy(tensor_parallel_size=2)`` on ``(2, 2)``, against one process.

What a user runs: the data module (a small synthetic byte-token corpus in a temporary cache)
plans every global batch for the two HDP ranks, and every TP lane reads its HDP rank's share
with its lane's ring ranks; the model is ``test_tensor_parallel_strategy``'s reference Llama,
sharded by ``parallelize_llama`` in ``configure_model`` (a 257-word vocabulary for the bytes).
Four steps of AdamW with weight decay and clipping in every step, float64, the balance planner
with rings (sequences up to twice the capacity of 48).

The reference is one process on whole sequences (plain causal SDPA, the loss over every token
of the global batch, ``clip_grad_norm_``) on the same global batches, read here from a data
module built the same way (the strategy's options, the mesh's HDP rank and count): each rank
records the ``data_identity`` of every batch it trained on, which must be the one the test
reads, and the sequences it held, which must be its HDP rank's share of the plan, the same on
both lanes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import QUIET, datamodule_batches
from test_tensor_parallel_strategy import INIT_SEED, MAX_NORM, TOLERANCE, TPLM, Recorder, reference_steps

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

STEPS = 4
CAPACITY = 48  # per HDP rank: the pool of two holds 96 tokens, so the longest samples need a ring
CONFIG = LlamaConfig.preset("tiny", vocab=257, tie_embeddings=False)


def _strategy() -> ByteScaleStrategy:
    return ByteScaleStrategy(tensor_parallel_size=2, capacity=CAPACITY, start_method="fork", timeout=120)


def _data(cache: Path) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 80, "scale": 1 / 512},
        cache_dir=cache, tokens_per_step=160, num_workers=0,
    )  # fmt: skip


class ByteTPLM(TPLM):
    """``TPLM`` (sharded in ``configure_model``) over the data module's byte tokens."""

    def __init__(self) -> None:
        super().__init__(tied=False)
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(CONFIG)


class Shares(pl.Callback):
    """Every rank writes, per step, the batch it read: its data identity and the sequences of its micro-batches."""

    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        seqs = sorted(int(j) for mb in batch.micro_batches for j in mb.seq_ids)
        self.rows.append({"step": batch.step, "identity": batch.data_identity, "seqs": seqs})

    def on_train_end(self, trainer, pl_module):
        (self.out / f"shares_{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def _global_batches(cache: Path) -> tuple[list[list[torch.Tensor]], list[str], list]:
    """The run's global batches as the data module of HDP rank 0 plans them: sequences, identities, plans."""
    return datamodule_batches(_strategy(), _data(cache), 4, STEPS)


def test_2x2_with_the_datamodule_equals_one_process_on_its_global_batches(tmp_path):
    cache = tmp_path / "cache"
    _data(cache).prepare_data()  # the store, before the ranks start (they would build the same one)
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=_strategy(), precision="64-true", default_root_dir=tmp_path,
        max_steps=STEPS, gradient_clip_val=MAX_NORM, limit_val_batches=0,
        callbacks=[Recorder(tmp_path), Shares(tmp_path)], **QUIET,
    )  # fmt: skip
    trainer.fit(ByteTPLM(), datamodule=_data(cache))

    batches, identities, plans = _global_batches(cache)
    assert any(mb.ring is not None for plan in plans for mbs in plan.ranks for mb in mbs), "no ring ran"
    model, losses, norms = reference_steps(CONFIG, batches)
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert min(norms) > MAX_NORM, "clipping must act in every step"
    worst_param = worst_loss = 0.0
    for r in range(4):
        hdp = r // 2
        shares = json.loads((tmp_path / f"shares_{r}.json").read_text())
        assert [row["step"] for row in shares] == list(range(STEPS))
        for k, row in enumerate(shares):
            assert row["identity"] == identities[k], f"rank {r} trained step {k} on another global batch"
            want = sorted(p.seq for mb in plans[k].ranks[hdp] for p in mb.pieces)
            assert row["seqs"] == want, f"rank {r} (HDP rank {hdp}) read another share in step {k}"
        rows = json.loads((tmp_path / f"report_{r}.json").read_text())["rows"]
        for k, row in enumerate(rows):
            assert row["loss_tokens"] == sum(len(s) - 1 for s in batches[k])  # each token once, not per lane
            assert row["num_micro_batches"] == [len(mbs) for mbs in plans[k].ranks]
            worst_loss = max(worst_loss, abs(row["logged"] - losses[k]))
        got = torch.load(tmp_path / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
    print(
        f"\n(2, 2) with ByteScaleDataModule: max parameter difference {worst_param:.3e}, loss {worst_loss:.3e}"
    )
    assert worst_param <= TOLERANCE and worst_loss <= TOLERANCE, (worst_param, worst_loss)
