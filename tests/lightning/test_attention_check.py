"""The attention check: a model that does not call ``lightning_bytescale.attention`` stops before it trains.

A model with plain ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` attends across the
sequences packed into a micro-batch and, on a ring member, to its own shard only.  In the first
steps the strategy counts the packed attention calls of every micro-batch holding several
sequences and of every ring member (``lightning_bytescale/engine/attention_check.py``); the
counts ride in the step's all-reduce, so every rank raises the same
``MissingPackedAttentionError`` before the first optimizer step.  Pipelines add the calls of a
pipeline's stages (a head-only stage makes none).  Single-process cases first, then one
multi-process test (2 gloo ranks, fork launcher) with five short runs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import (
    CAPACITY,
    INIT_SEED,
    StepData,
    StepDataModule,
    TinyLM,
    causal_sdpa,
    quiet_trainer,
)

from lightning_bytescale import ByteScaleStrategy, attention, token_loss
from lightning_bytescale.engine import build_step, run_micro_batches
from lightning_bytescale.engine.attention_check import (
    ATTENTION_CHECK_STEPS,
    AttentionCheckWindow,
    AttentionVerdict,
    check_attention,
    pipeline_verdict,
)
from lightning_bytescale.errors import ConfigError, MissingPackedAttentionError
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.packed_attention import count_attention_calls, current_layout
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan


def _packed_step(lengths: list[list[int]]):
    """One rank; micro-batch ``i`` packs sequences of ``lengths[i]``."""
    flat = [s for mb in lengths for s in mb]
    seqs = [
        torch.randint(0, 64, (s,), generator=torch.Generator().manual_seed(j)) for j, s in enumerate(flat)
    ]
    ranks, j = [], 0
    for mb in lengths:
        ranks.append(MicroBatch([Piece(j + i, ((0, s),)) for i, s in enumerate(mb)]))
        j += len(mb)
    return build_step(Plan(1, max(map(sum, lengths)), "hand", tuple(flat), [ranks]), 0, lambda k: seqs[k])


def _forward(model, mb):
    return token_loss(model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)


@pytest.mark.parametrize(("attention_fn", "missed"), [(None, 0), (causal_sdpa, 1)], ids=["packed", "sdpa"])
def test_the_counts_of_a_rank(attention_fn, missed):
    model = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=attention_fn).double()
    step = _packed_step([[5, 7], [9], [3, 4, 2]])
    local = run_micro_batches(model, step.micro_batches, forward=_forward, check_attention=True)
    assert local.attention == AttentionVerdict(checked=3, missed_packed=2 * missed, missed_single=missed)
    assert run_micro_batches(model, step.micro_batches, forward=_forward).attention == AttentionVerdict()


def test_one_counter_for_every_caller():
    """The reference Llama's layers (and HF's "bytescale" attention) count through ``attention`` itself."""
    q = torch.randn(6, 4, 8)
    with count_attention_calls() as outer:
        attention(q, q, q)
        with count_attention_calls() as inner:
            LlamaModel(LlamaConfig.preset("tiny"))(torch.arange(6), torch.arange(6))
    assert (outer.calls, inner.calls) == (
        1 + LlamaConfig.preset("tiny").layers,
        LlamaConfig.preset("tiny").layers,
    )
    from lightning_bytescale.hf import count_attention_calls as hf_counter

    assert hf_counter is count_attention_calls


def test_nested_blocks_with_equal_counts_leave_cleanly():
    """The strategy's block around HF's per-forward block: both see the same calls, and each leaves its own."""
    q = torch.randn(6, 4, 8)
    with count_attention_calls() as outer:
        with count_attention_calls() as inner:
            attention(q, q, q)
        assert outer.calls == inner.calls == 1  # equal counts: leaving `inner` must not remove `outer`
        attention(q, q, q)
    assert (outer.calls, inner.calls) == (2, 1)


def test_the_error_names_the_call_and_the_way_out():
    check_attention(AttentionVerdict(checked=3), step=0)  # every checked micro-batch called it
    with pytest.raises(MissingPackedAttentionError) as info:
        check_attention(AttentionVerdict(checked=5, missed_packed=2, missed_ring=1, missed_single=1), step=4)
    message = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert "lightning_bytescale.attention(q, k, v)" in message and "check_attention=False" in message
    assert "step 4" in message and "2 packed micro-batch(es)" in message and "1 ring member(s)" in message
    assert "1 micro-batch(es) holding one whole sequence" in message


def test_the_window_closes_once_conclusive_or_after_its_steps():
    window = AttentionCheckWindow()
    window.record(AttentionVerdict())  # no micro-batch on any rank yet
    assert window.active
    window.record(AttentionVerdict(checked=1))
    assert not window.active
    idle = AttentionCheckWindow()
    for _ in range(ATTENTION_CHECK_STEPS):
        idle.record(AttentionVerdict())
    assert not idle.active


def test_pipelines_add_their_stages_calls():
    # two pipelines of two stages (global ranks 0, 1 and 2, 3): (calls, ring, packed, single) per rank
    head_only = [(2, 1, 2, 0), (0, 1, 2, 0), (4, 0, 1, 1), (0, 0, 1, 1)]  # last stages hold no attention
    assert pipeline_verdict(head_only, [(0, 1), (2, 3)]) == AttentionVerdict(checked=5)
    one_wrong = [(2, 1, 2, 0), (0, 1, 2, 0), (0, 0, 1, 1), (0, 0, 1, 1)]
    assert pipeline_verdict(one_wrong, [(0, 1), (2, 3)]) == AttentionVerdict(
        5, missed_packed=1, missed_single=1
    )
    nothing_to_check = [(0, 0, 0, 0)] * 4
    assert pipeline_verdict(nothing_to_check, [(0, 1), (2, 3)]) == AttentionVerdict()


# ----------------------------------------------------------------------------- under the Trainer
class SdpaLM(TinyLM):
    """A model ported from DDP: the reference Llama's layers with plain causal SDPA over the packed tokens.

    ``only_rank``: only that rank's local micro-batches use SDPA (the other ranks see nothing wrong).
    """

    def __init__(self, only_rank: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=self._attention)
        self.only_rank = only_rank

    def _attention(self, q, k, v):
        layout = current_layout()
        if self.only_rank is None or (self.global_rank == self.only_rank and layout.ring is None):
            return causal_sdpa(q, k, v)
        return attention(q, k, v)


class Outcome(pl.Callback):
    """Each rank writes its optimizer steps, and that it reached the end of training."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        with (self.out / f"stepped_{trainer.global_rank}").open("a") as f:
            f.write(f"{trainer.global_step}\n")

    def on_train_end(self, trainer, pl_module):
        (self.out / f"finished_{trainer.global_rank}").touch()


def _recording(check, out: Path):
    """``check_attention`` as the step runs it, also writing what it raises on each rank (the ranks are forked)."""

    def recorded(verdict, step):
        try:
            check(verdict, step)
        except Exception as err:
            (out / f"error_{torch.distributed.get_rank()}").write_text(f"{type(err).__name__}: {err}")
            raise

    return recorded


def _run(out: Path, module: pl.LightningModule, monkeypatch, **options) -> list[dict]:
    """Two ranks, two steps; each rank's error (``None``: none), optimizer steps and whether it finished."""
    from lightning_bytescale.engine import attention_check, executor

    out.mkdir(parents=True)
    monkeypatch.setattr(executor, "check_attention", _recording(attention_check.check_attention, out))
    strategy = ByteScaleStrategy(capacity=CAPACITY, start_method="fork", timeout=60, **options)
    trainer = quiet_trainer(out, 2, strategy, precision="32-true", max_steps=2, callbacks=[Outcome(out)])
    with contextlib.suppress(Exception):  # what each rank did is in its files
        trainer.fit(module, datamodule=StepDataModule("balance"))
    read = lambda name: (out / name).read_text() if (out / name).exists() else None  # noqa: E731
    return [
        {
            "error": read(f"error_{r}"),
            "steps": len((read(f"stepped_{r}") or "").split()),
            "finished": (out / f"finished_{r}").exists(),
        }
        for r in (0, 1)
    ]


TRAINED = [{"error": None, "steps": 2, "finished": True}] * 2


def _refused(outcomes: list[dict], what: str) -> str:
    errors = {o["error"] for o in outcomes}
    assert len(errors) == 1, f"every rank stops with the same error (printed once): {errors}"
    (error,) = errors
    assert error is not None and error.startswith("MissingPackedAttentionError"), error
    assert (
        what in error
        and "lightning_bytescale.attention(q, k, v)" in error
        and "check_attention=False" in error
    )
    assert all(o["steps"] == 0 and not o["finished"] for o in outcomes), (
        "refused before the first optimizer step"
    )
    return error


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_model_with_plain_sdpa_stops_before_the_first_optimizer_step(tmp_path, monkeypatch):
    import _strategy_helpers

    # rank 1 alone runs a local micro-batch of several sequences with SDPA at step 0: both ranks stop
    assert any(
        mb.layout.ring is None and len(mb.seq_ids) > 1 for mb in StepData(2, 1, "balance")[0].micro_batches
    )
    _refused(
        _run(tmp_path / "sdpa", SdpaLM(), monkeypatch), "packed micro-batch(es) holding several sequences"
    )
    _refused(
        _run(tmp_path / "rank1", SdpaLM(only_rank=1), monkeypatch),
        "packed micro-batch(es) holding several sequences",
    )
    assert _run(tmp_path / "opt-out", SdpaLM(), monkeypatch, check_attention=False) == TRAINED  # the way out

    # one long sequence per step, a ring over both ranks: no micro-batch packs two sequences
    monkeypatch.setattr(
        _strategy_helpers,
        "global_batch",
        lambda step, seed=0: [
            torch.randint(0, 64, (CAPACITY + 13,), generator=torch.Generator().manual_seed(step))
        ],
    )
    ring = StepData(2, 0, "balance")[0].micro_batches
    assert [(mb.layout.ring, len(mb.seq_ids)) for mb in ring] == [((0, 1), 1)]
    error = _refused(_run(tmp_path / "ring", SdpaLM(), monkeypatch), ": 2 ring member(s) holding a shard")
    assert "packed micro-batch" not in error and "whole sequence" not in error
    assert _run(tmp_path / "ring-llama", TinyLM(), monkeypatch) == TRAINED  # the reference Llama passes


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_pipeline_whose_stages_skip_packed_attention_stops(tmp_path):
    """One pipeline of two stages (2 ranks): its stages made no packed attention call, so it stops."""
    from test_pipeline_strategy import PipelineLM, _fit

    class SdpaPipelineLM(PipelineLM):
        def __init__(self) -> None:
            super().__init__()
            self.model.attention_fn = causal_sdpa  # LlamaStage takes the model's attention in configure_model

    with pytest.raises(Exception, match=r"MissingPackedAttentionError.*at step 0.*check_attention=False"):
        _fit(tmp_path, 2, 2, module=SdpaPipelineLM())
    assert not list(tmp_path.glob("report_*.json"))  # no rank reached the end of training
