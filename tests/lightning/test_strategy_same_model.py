"""Every rank trains the same model: what users do without a seed, and what catches drift.

A model built without a seed differs on every rank: under the default launcher each rank is a
fresh Python process.  DDP makes ranks equal by broadcasting rank 0's state when it wraps the
model; ``ByteScaleStrategy`` does not wrap, so it broadcasts itself.  These tests build models
that really differ per rank (from a plain script under the default popen launcher, and from
``configure_model`` seeded from the OS per rank under the fork launcher), and check that all
ranks end equal and equal, in float64, to one process started from rank 0's initial weights.
They also check that the parameter fingerprints in the step's all-reduce catch a rank whose
parameters were changed behind the strategy's back, that the strategy is a
``ParallelStrategy`` (not a DDP one) that runs on one CPU device, and that its step goes
through the engine's own loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import (
    CAPACITY,
    CLIP,
    Recorder,
    StepDataModule,
    TinyLM,
    causal_sdpa,
    global_batch,
    quiet_trainer,
    read_rows,
    reference,
)
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.errors import ParameterDivergenceError
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).resolve().parents[1]  # on sys.path in the script: _strategy_helpers


def assert_trained_one_model(out: Path, world: int, steps: int) -> None:
    initial = [torch.load(out / f"init_{r}.pt") for r in range(world)]
    final = [torch.load(out / f"params_{r}.pt") for r in range(world)]
    # the ranks really started apart (else the test proves nothing) ...
    for r in range(1, world):
        assert any(not torch.equal(initial[0][k], initial[r][k]) for k in initial[0]), (
            f"rank {r} started equal"
        )
    # ... and ended as one model: bit-identical, and equal to one process from rank 0's weights
    for r in range(1, world):
        for k, v in final[0].items():
            assert torch.equal(v, final[r][k]), f"rank {r} parameter {k} differs from rank 0's"
    expected, _ = reference(steps, initial=initial[0])
    for k, v in expected.items():
        err = (final[0][k] - v).abs().max().item()
        assert err <= 1e-10, f"parameter {k} differs from the single-process run by {err:.3e}"


SCRIPT = """
import os, sys
import torch
import lightning.pytorch as pl
sys.path.insert(0, {tests!r})
from _strategy_helpers import CAPACITY, CLIP, Recorder, StepDataModule, TinyLM
from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel


class UnseededLM(TinyLM):
    def __init__(self):
        pl.LightningModule.__init__(self)  # no seed: every process draws its own weights
        self.model = LlamaModel(LlamaConfig.preset("tiny"))
        self.scheduler = True
        rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.save({{"model." + k: v.clone() for k, v in self.model.state_dict().items()}},
                   os.path.join({out!r}, f"init_{{rank}}.pt"))


if __name__ == "__main__":
    out = {out!r}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ByteScaleStrategy(capacity=CAPACITY, timeout=60),
        precision="64-true", max_steps={steps},
        gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[Recorder(__import__("pathlib").Path(out))], default_root_dir=out,
    )
    trainer.fit(UnseededLM(), datamodule=StepDataModule("balance"))
"""


def test_unseeded_model_from_a_plain_script_trains_one_model(tmp_path):
    """The README path: a plain script, strategy="bytescale" (popen launcher), no seed anywhere."""
    steps = 3
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(tests=str(TESTS), out=str(tmp_path), steps=steps)))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")
    }
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trained_one_model(tmp_path, 2, steps)


class ConfigureModelLM(TinyLM):
    """Builds its model in ``configure_model`` (after the ranks started), seeded from the OS per rank."""

    def __init__(self, out: Path) -> None:
        pl.LightningModule.__init__(self)
        self.out = out
        self.scheduler = True
        self.model: LlamaModel | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # what a fresh process would do
        self.model = LlamaModel(LlamaConfig.preset("tiny"))
        state = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        torch.save(state, self.out / f"init_{self.global_rank}.pt")


def _fit(out: Path, world: int, module: pl.LightningModule, steps: int, **strategy: object) -> pl.Trainer:
    out.mkdir(parents=True, exist_ok=True)
    trainer = quiet_trainer(
        out,
        world,
        ByteScaleStrategy(capacity=CAPACITY, start_method="fork", timeout=60, **strategy),
        max_steps=steps,
        gradient_clip_val=CLIP,
        callbacks=[Recorder(out)],
    )
    trainer.fit(module, datamodule=StepDataModule("balance"))
    return trainer


def test_model_built_in_configure_model_without_a_seed_trains_one_model_on_three_ranks(tmp_path):
    _fit(tmp_path, 3, ConfigureModelLM(tmp_path), steps=3)
    assert_trained_one_model(tmp_path, 3, steps=3)


class DriftingLM(TinyLM):
    """Rank 1 nudges one weight after step 1, behind the strategy's back."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 1 and self.global_rank == 1:
            with torch.no_grad():
                self.model.blocks[0].mlp.w2.weight[0, 0] += 1e-9


def test_parameter_drift_on_one_rank_stops_every_rank_naming_the_parameter(tmp_path):
    with pytest.raises(
        Exception, match=r"ranks \[1\] differ from ranks \[0\].*blocks\.0\.mlp\.w2\.weight"
    ) as info:
        _fit(tmp_path, 2, DriftingLM(), steps=4, check_parameters_every_n_steps=1)
    assert "ParameterDivergenceError" in str(info.value) or isinstance(info.value, ParameterDivergenceError)


def test_parameter_checks_can_be_turned_off_and_cost_no_extra_collective(tmp_path):
    """With the check off the drift goes unnoticed (the reason the check exists)."""
    _fit(tmp_path, 2, DriftingLM(), steps=3, check_parameters_every_n_steps=0)
    assert len(read_rows(tmp_path)) == 3


def test_is_a_parallel_strategy_not_ddp_and_runs_on_one_cpu_device(tmp_path, monkeypatch):
    """devices=1 in this process, and the step goes through the engine's run_micro_batch."""
    assert issubclass(ByteScaleStrategy, ParallelStrategy)
    assert not issubclass(ByteScaleStrategy, DDPStrategy)
    from lightning_bytescale.engine import executor

    calls: list[int] = []
    original = executor.run_micro_batch

    def counting(model, mb, **kwargs):
        calls.append(mb.index)
        return original(model, mb, **kwargs)

    monkeypatch.setattr(executor, "run_micro_batch", counting)
    import _strategy_helpers

    from lightning_bytescale.planner import make_plan

    def one_rank_plan(lengths, world, planner, seed):  # capacity 64: one rank holds every sequence
        return make_plan(tuple(lengths), world_size=world, seed=seed, planner=planner, capacity=64)

    monkeypatch.setattr(_strategy_helpers, "make_plan", one_rank_plan)
    had_group = torch.distributed.is_initialized()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=ByteScaleStrategy(capacity=64, timeout=30),
        precision="64-true", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, callbacks=[Recorder(tmp_path)], default_root_dir=tmp_path,
    )  # fmt: skip
    try:
        trainer.fit(TinyLM(), datamodule=StepDataModule("balance"))
    finally:
        if not had_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rows = read_rows(tmp_path)
    assert len(rows) == 2
    assert len(calls) == sum(sum(row["stats"]["num_micro_batches"]) for row in rows) > 0
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.process_group_backend == "gloo"


def test_rank_zero_state_broadcast_in_one_process_is_the_identity():
    from lightning_bytescale.engine.state_sync import broadcast_module_state

    model = LlamaModel(LlamaConfig.preset("tiny"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert broadcast_module_state(model) == 0  # no process group: nothing to do
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fingerprints_are_bit_exact_and_order_free():
    from lightning_bytescale.engine.fingerprint import combine, fingerprints, tensor_fingerprint

    x = torch.randn(10_000, dtype=torch.float64)
    y = x.clone()
    y[1234] = torch.nextafter(y[1234], torch.tensor(2.0, dtype=torch.float64))  # one ulp
    assert int(tensor_fingerprint(x)) != int(tensor_fingerprint(y))
    assert int(tensor_fingerprint(x)) == int(tensor_fingerprint(x.flip(0)))  # summation order is free
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        t = x.to(dtype)
        assert int(tensor_fingerprint(t)) == int(tensor_fingerprint(t.clone()))
    a, b = fingerprints([x, y]), fingerprints([y, x])
    assert combine(a) != combine(b)  # the model fingerprint depends on the parameter order
    assert all(0 <= int(v) < 2**32 for v in a)
    assert json.dumps([int(v) for v in a])  # plain integers


class MetaInitLM(ConfigureModelLM):
    """Builds its model on the meta device; the strategy materialises it on the rank's device."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = LlamaModel(LlamaConfig.preset("tiny"))

    def on_fit_start(self) -> None:  # after set-up: materialised and broadcast
        state = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        torch.save(state, self.out / f"start_{self.global_rank}.pt")


def test_meta_device_model_is_materialised_and_equal_on_every_rank(tmp_path):
    _fit(tmp_path, 2, MetaInitLM(tmp_path), steps=2)
    starts = [torch.load(tmp_path / f"start_{r}.pt") for r in range(2)]
    finals = [torch.load(tmp_path / f"params_{r}.pt") for r in range(2)]
    for k, v in starts[0].items():
        assert v.device.type == "cpu" and torch.isfinite(v).all(), k
        assert torch.equal(v, starts[1][k]), f"{k} differs between ranks after set-up"
        if k.endswith("norm.weight"):
            assert torch.equal(v, torch.ones_like(v)), f"{k} was not reset"
    for k, v in finals[0].items():
        assert torch.equal(v, finals[1][k]), k


class PredictingLM(TinyLM):
    def predict_step(self, mb, batch_idx):
        return {
            "seq_ids": list(mb.seq_ids),
            "ring": mb.layout.ring,
            "logits": self.model(mb.input_ids, mb.position_ids),
        }


class PredictionSaver(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rows.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        state = {k: v.clone() for k, v in pl_module.model.state_dict().items()}
        torch.save({"rows": self.rows, "state": state}, self.out / f"pred_{trainer.global_rank}.pt")


class PredictData(StepDataModule):
    def predict_dataloader(self):
        return self.train_dataloader()


def test_predict_runs_each_micro_batch_with_its_layout(tmp_path):
    """trainer.predict on StepBatches: per-micro-batch outputs; local ones equal a plain forward."""
    os.environ.pop("MASTER_PORT", None)
    module = PredictingLM()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ByteScaleStrategy(capacity=CAPACITY, start_method="fork", timeout=60),
        precision="64-true", logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_predict_batches=2, default_root_dir=tmp_path,
        callbacks=[PredictionSaver(tmp_path)],
    )  # fmt: skip
    trainer.predict(module, datamodule=PredictData("balance"), return_predictions=False)
    saved = [torch.load(tmp_path / f"pred_{r}.pt", weights_only=False) for r in range(2)]
    assert [len(s["rows"]) for s in saved] == [2, 2]  # one list of micro-batch outputs per step
    assert any(item["ring"] is not None for s in saved for row in s["rows"] for item in row)
    reference = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=causal_sdpa).double()
    reference.load_state_dict(saved[0]["state"])
    checked = 0
    for step, per_mb in enumerate(saved[0]["rows"] + saved[1]["rows"]):
        step = step % 2
        seqs = global_batch(step)
        for item in per_mb:
            if item["ring"] is not None:
                continue
            offset = 0
            for j in item["seq_ids"]:
                s = seqs[j]
                want = reference(s, torch.arange(len(s)))
                got = item["logits"][offset : offset + len(s)]
                assert (got - want).abs().max().item() < 1e-10
                offset += len(s)
                checked += 1
    assert checked > 0
