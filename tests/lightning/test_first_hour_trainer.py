"""``trainer.test`` and ``trainer.predict`` with ByteScaleDataModule on two ranks (issue 17, item 1).

The test metric must equal the mean loss of the held-out documents computed by one plain forward
per document (float64), and predict must see every sample of its split exactly once over the ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from test_strategy_same_model import PredictionSaver

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
from lightning_bytescale.recipes.module import PretrainModule

CAP = 48


class EvalModule(PretrainModule):
    """The recipe's model with a summed test loss and per-micro-batch predictions."""

    def on_test_epoch_start(self):
        self.test_total = torch.zeros((), dtype=torch.float64)

    def test_step(self, mb, batch_idx):
        loss = self.training_step(mb, batch_idx)  # this micro-batch's part of the step's mean loss
        self.test_total += loss.detach()
        return loss

    def on_test_epoch_end(self):
        self.log("test/loss", self.trainer.strategy.reduce(self.test_total, reduce_op="sum"))

    def predict_step(self, mb, batch_idx):
        logits = self(mb.input_ids, mb.position_ids)
        valid = mb.layout.valid()
        seq = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(mb.layout.slots))
        return {
            "step": batch_idx,
            "seq": seq[valid],
            "pos": mb.layout.positions()[valid],
            "token": mb.input_ids[valid],
            "logits": logits[valid],
        }


def _corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(11)
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as fh:
        for i in range(40):
            fh.write(json.dumps({"text": f"{i} " + "ab c" * int(rng.integers(1, 20))}) + "\n")
    return path


def _dm(tmp_path: Path, **kw) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), capacity=CAP, context_length=2 * CAP,
        tokens_per_step=3000, num_workers=0, val_fraction=0.1, test_fraction=0.2, seed=4, **kw,
    )  # fmt: skip


def _trainer(tmp_path: Path, callbacks=()) -> pl.Trainer:
    os.environ.pop("MASTER_PORT", None)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=ByteScaleStrategy(capacity=CAP, start_method="fork", timeout=60),
        precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, default_root_dir=tmp_path, callbacks=list(callbacks),
    )  # fmt: skip


def _reference(dm: ByteScaleDataModule, samples, state) -> tuple[PretrainModule, list[np.ndarray]]:
    model = PretrainModule(preset="tiny", vocab=257)
    model.configure_model()
    model.model.double().load_state_dict(state)
    return model, [
        dm.store.read(int(d), int(s), int(n)) for d, s, n in zip(samples.doc, samples.start, samples.length)
    ]


def test_trainer_test_and_predict_read_the_held_out_splits(tmp_path):
    torch.manual_seed(0)
    model = EvalModule(preset="tiny", vocab=257)
    model.configure_model()  # one set of weights for both runs (the ranks would each make their own)
    dm = _dm(tmp_path)
    saver = PredictionSaver(tmp_path)
    _trainer(tmp_path, [saver]).predict(model, datamodule=dm, return_predictions=False)
    saved = [torch.load(tmp_path / f"pred_{r}.pt", weights_only=False) for r in range(2)]

    host = _dm(tmp_path, rank=0, world_size=2)
    host.prepare_data()
    host.setup("predict")
    for name, value in model.model.state_dict().items():
        assert torch.equal(saved[0]["state"][name], value.double())
    ref, docs = _reference(host, host.test_samples, saved[0]["state"])  # predict reads the test split
    # rebuild every sequence of every step from both ranks' micro-batches
    seqs: dict[tuple[int, int], dict[int, tuple[int, torch.Tensor]]] = {}
    for s in saved:
        for row in (out for step in s["rows"] for out in step):
            for j, p, t, lg in zip(
                row["seq"].tolist(), row["pos"].tolist(), row["token"].tolist(), row["logits"]
            ):
                assert p not in seqs.setdefault((row["step"], j), {}), "a token predicted twice"
                seqs[(row["step"], j)][p] = (t, lg)
    assert len(seqs) == len(docs)
    ordered = [seqs[k] for k in sorted(seqs)]
    with torch.no_grad():
        for got, want in zip(ordered, docs):
            assert [got[p][0] for p in range(len(got))] == want.tolist()
            logits = torch.stack([got[p][1] for p in range(len(got))])
            expect = ref(torch.as_tensor(want, dtype=torch.long), torch.arange(len(want)))
            assert (logits - expect).abs().max().item() < 1e-9

    # trainer.test: the held-out loss equals a plain forward over the test split's documents
    metrics = _trainer(tmp_path).test(model, datamodule=_dm(tmp_path), verbose=False)
    with torch.no_grad():
        total, count = 0.0, 0
        for want in docs:
            ids = torch.as_tensor(want, dtype=torch.long)
            logits = ref(ids[:-1], torch.arange(len(ids) - 1))
            total += F.cross_entropy(logits, ids[1:], reduction="sum").item()
            count += len(ids) - 1
    assert len(host.test_dataloader()) == 1  # one step: its mean loss is the split's
    assert abs(metrics[0]["test/loss"] - total / count) < 1e-9
