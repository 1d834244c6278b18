"""Fine-tuning on loss-masked chat data through the strategy on 2 ranks equals one process, exactly.

The whole path a user takes: a chat JSONL and a tokenizer JSON go through ``ByteScaleDataModule``
(chat template, mask in the token store, drop policy, sample table, per-rank ``StepBatch``es
with some conversations sharded over a ring of both ranks) into ``Trainer(strategy=
ByteScaleStrategy(...))`` and a float64 ``HFCausalLM`` (a tiny Llama), 3 AdamW steps.  The
reference runs in this process on the same checkpoint with ``attn_implementation="sdpa"``,
each conversation alone, its labels written from the stored ids and mask (``-100`` where the
target is not trained) and the loss divided by the global batch's trained tokens: parameters
must agree to 1e-10 and the logged losses to 1e-12.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_bytescale import ByteScaleStrategy  # noqa: E402
from lightning_bytescale.data.synthetic_chat import SAMPLES_DIR, records, write_jsonl  # noqa: E402
from lightning_bytescale.hf import HFCausalLM  # noqa: E402
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule  # noqa: E402

pytestmark = pytest.mark.multiprocess

WORLD, CAPACITY, STEPS, LR = 2, 48, 3, 0.02
DATA = dict(
    tokenizer=str(SAMPLES_DIR / "tokenizer.json"),
    capacity=CAPACITY,
    context_length=2 * CAPACITY - 8,  # longer than one rank: some conversations need the ring
    tokens_per_step=320,
    planner="balance",
    num_workers=0,
    tokenize_workers=1,
    seed=3,
)


class Recorder(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.step_stats
        self.rows.append(
            {"loss": float(outputs["loss"]), "cp_degrees": stats["cp_degrees"], "step": batch.step}
        )

    def on_train_end(self, trainer, pl_module):
        r = trainer.global_rank
        (self.out / f"rows_{r}.json").write_text(json.dumps(self.rows))
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
            self.out / f"params_{r}.pt",
        )


def checkpoint(folder: Path, vocab: int) -> str:
    config = AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(folder)
    return str(folder)


def data_module(source: str, cache: Path, **kw) -> ByteScaleDataModule:
    return ByteScaleDataModule(source={"kind": "chat", "path": source}, cache_dir=cache, **DATA, **kw)


def fit(out: Path, ckpt: str, source: str, cache: Path) -> None:
    os.environ.pop("MASTER_PORT", None)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, precision="64-true", max_steps=STEPS,
        strategy=ByteScaleStrategy(planner="balance", capacity=CAPACITY, start_method="fork", timeout=60),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[Recorder(out)], default_root_dir=out,
    )  # fmt: skip
    trainer.fit(HFCausalLM(ckpt, lr=LR), datamodule=data_module(source, cache))


def reference(ckpt: str, dm: ByteScaleDataModule) -> tuple[dict[str, torch.Tensor], list[float], int]:
    """One process: each sampled conversation alone (sdpa), labels from the stored ids and mask."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa", dtype=torch.float64)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    samples, store = dm.train_samples, dm.store
    batches = dm.train_dataloader().dataset.batching.batches(0)
    losses, masked = [], 0
    for k in range(STEPS):
        convs = []
        for i in batches[k].tolist():
            doc, start, n = int(samples.doc[i]), int(samples.start[i]), int(samples.length[i])
            ids, mask = store.read(doc, start, n), store.read_mask(doc, start, n)
            labels = torch.tensor([int(ids[p + 1]) if mask[p + 1] else -100 for p in range(n - 1)])
            convs.append((torch.from_numpy(ids), labels))
            masked += int((labels == -100).sum())
        trained = sum(int((lab != -100).sum()) for _, lab in convs)
        opt.zero_grad()
        total = 0.0
        for ids, labels in convs:
            s = ids.numel()
            logits = model(input_ids=ids[None], position_ids=torch.arange(s)[None], use_cache=False).logits[0]
            loss = F.cross_entropy(logits[:-1], labels, ignore_index=-100, reduction="sum") / trained
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return model.state_dict(), losses, masked


def test_masked_chat_training_on_two_ranks_equals_one_process(tmp_path):
    source = tmp_path / "chat.jsonl"
    write_jsonl(source, records(60, seed=11, max_turns=4))
    ckpt = checkpoint(tmp_path / "ckpt", vocab=875)
    out = tmp_path / "run"
    out.mkdir()
    fit(out, ckpt, str(source), tmp_path / "cache")

    dm = data_module(str(source), tmp_path / "cache", rank=0, world_size=WORLD)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.store.vocab_size == 875 and dm.train_samples.report["long_documents"] > 0  # some dropped
    want_params, want_losses, masked = reference(ckpt, dm)
    assert masked > 0  # the mask really removed labels
    for r in range(WORLD):
        rows = json.loads((out / f"rows_{r}.json").read_text())
        assert [row["loss"] for row in rows] == pytest.approx(want_losses, abs=1e-12, rel=0)
        degrees = [d for row in rows for d in row["cp_degrees"]]
        assert WORLD in degrees and 1 in degrees  # long conversations on the ring, short ones local
        got = torch.load(out / f"params_{r}.pt")
        for name, value in want_params.items():
            err = (got[name] - value).abs().max().item()
            assert err <= 1e-10, f"rank {r} {name} differs from one process by {err:.3e}"
    first = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    assert max((want_params[k] - v).abs().max().item() for k, v in first.items()) > 1e-3  # it trained
