"""``HFCausalLM`` under ``ByteScaleStrategy(pipeline_parallel_size=2)`` on 4 CPU ranks, against one process.

A tiny 3-layer Qwen3 with untied embeddings, saved as a checkpoint; ``HFCausalLM`` loads it on
every rank and, in ``configure_model``, replaces it by this rank's ``HFDecoderStage`` (stage 0:
the embedding and layers 0-1, stage 1: layer 2, the norm and ``lm_head``).  The data plans each
global batch for the two pipelines with the balance planner (``pipeline_degree=2``: PP-Balance,
different micro-batch counts per pipeline) and every batch holds a sequence longer than C, a ring
item across both pipelines.  Float64, clipping acting in every step, AdamW with weight decay.  The
reference loads the same checkpoint in one process with ``"sdpa"`` on each whole sequence.
Parameters (every stage's, by name) and the loss logged on every rank must agree to 1e-10; the
run's sharded checkpoint, exported as a Hugging Face folder (``export_pretrained``), loads with
``from_pretrained`` as the reference's weights (1e-10) with its loss on a held-out batch, which the
``val/loss`` the run logged at the epoch's end (the forward-only schedule of the HF stages) equals.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")

from _hf_strategy import fit_hf, hf_reference  # noqa: E402
from _parallel import pipeline_batch  # noqa: E402
from _strategy_helpers import global_batch  # noqa: E402
from test_hf_families import tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_bytescale import ByteScaleStrategy  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CAPACITY = 24
STEPS = 5  # step 4: PP-Balance gives the pipelines 3 and 4 micro-batches
STAGES = 2
OPTIM = {"lr": 1e-2, "weight_decay": 0.1, "max_norm": 0.05}
FAMILY = "qwen3"
HELD_OUT = 100  # the global batch validated on (not trained on)


def _step(pmesh, k: int):
    """This pipeline's micro-batches of global batch ``k`` (PP-Balance), with this stage's ring ranks."""
    from lightning_bytescale.planner import make_plan

    seqs = global_batch(k)
    plan = make_plan(
        tuple(len(s) for s in seqs), world_size=pmesh.dims.data_parallel, capacity=CAPACITY,
        planner="balance", pipeline_degree=STAGES, seed=k,
    )  # fmt: skip
    return pipeline_batch(plan, pmesh, seqs, k)


class Recorder(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(
            {
                "logged": float(trainer.callback_metrics["train/loss"]),
                "counts": list(batch.counts),
                "rings": sum(mb.layout.ring is not None for mb in batch.micro_batches),
            }
        )

    def on_validation_end(self, trainer, pl_module):
        (self.out / f"val_{trainer.global_rank}.json").write_text(
            str(float(trainer.callback_metrics["val/loss"]))
        )

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.out / "last.ckpt")  # every rank: a sharded folder of every stage
        r = trainer.global_rank
        stage = type(pl_module.model).__name__
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.out / f"final_{r}.pt"
        )
        (self.out / f"report_{r}.json").write_text(json.dumps({"rows": self.rows, "stage": stage}))


def _checkpoint(path: Path) -> Path:
    config = tiny_config(FAMILY)
    config.num_hidden_layers, config.tie_word_embeddings = 3, False
    config.layer_types = config.layer_types[:1] * 3
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(path)
    return path


def test_hf_qwen3_pipelines_2x2_under_the_strategy_equal_one_process(tmp_path):
    path = _checkpoint(tmp_path / "checkpoint")
    strategy = ByteScaleStrategy(
        pipeline_parallel_size=STAGES, capacity=CAPACITY, start_method="fork", timeout=120
    )
    fit_hf(tmp_path, path, strategy, Recorder(tmp_path), STEPS, _step, held_out=(HELD_OUT,), **OPTIM)
    expected, losses = hf_reference(path, STEPS, **OPTIM)
    worst_param = worst_loss = 0.0
    seen: set[str] = set()
    for r in range(4):
        got = torch.load(tmp_path / f"final_{r}.pt")
        rep = json.loads((tmp_path / f"report_{r}.json").read_text())
        assert rep["stage"] == "HFDecoderStage"
        assert got.keys() <= expected.keys(), sorted(got.keys() - expected.keys())
        seen |= got.keys()
        worst_param = max(worst_param, max((v - expected[k]).abs().max().item() for k, v in got.items()))
        worst_loss = max(worst_loss, max(abs(row["logged"] - ref) for row, ref in zip(rep["rows"], losses)))
        assert len(rep["rows"]) == STEPS and all(row["rings"] > 0 for row in rep["rows"]), rep["rows"]
    counts = [row["counts"] for row in rep["rows"]]
    assert any(len(set(c)) > 1 for c in counts), counts  # PP-Balance: different counts per pipeline
    assert seen == expected.keys(), "the stages together must hold every parameter"
    print(f"HF {FAMILY} pipelines (2, 2): max parameter difference {worst_param:.3e}, loss {worst_loss:.3e}")
    assert worst_param <= 1e-10 and worst_loss <= 1e-10, (worst_param, worst_loss)

    # the sharded checkpoint as one Hugging Face folder: the reference's weights, its held-out loss
    from lightning_bytescale.hf.export import main as export

    # python -m lightning_bytescale.hf.export FOLDER OUT
    assert export([str(tmp_path / "last.ckpt"), str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    assert exported.config._attn_implementation == "sdpa"
    state = exported.state_dict()
    assert {f"model.{k}" for k in state} == expected.keys()
    worst_export = max((state[k.removeprefix("model.")] - v).abs().max().item() for k, v in expected.items())
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float64)
    reference.load_state_dict({k.removeprefix("model."): v for k, v in expected.items()})
    got, want = _held_out_loss(exported), _held_out_loss(reference)
    print(
        f"exported HF folder: max parameter difference {worst_export:.3e}, held-out loss {got!r} vs {want!r}"
    )
    assert worst_export <= 1e-10 and abs(got - want) <= 1e-10, (worst_export, got, want)
    # the validation at the epoch's end, through the HF stages' forward-only schedule: the same loss
    logged = [float((tmp_path / f"val_{r}.json").read_text()) for r in range(4)]
    print(f"val/loss {logged[0]!r}: max difference {max(abs(v - want) for v in logged):.1e}")
    assert max(abs(v - want) for v in logged) <= 1e-10, (logged, want)


def _held_out_loss(model) -> float:
    """The token mean of the cross-entropy over a held-out global batch, whole sequences, one process."""
    ce, tokens = 0.0, 0
    with torch.no_grad():
        for s in global_batch(HELD_OUT):
            logits = model(
                input_ids=s[None], position_ids=torch.arange(len(s))[None], use_cache=False
            ).logits[0]
            ce += float(torch.nn.functional.cross_entropy(logits[:-1], s[1:], reduction="sum"))
            tokens += len(s) - 1
    return ce / tokens
