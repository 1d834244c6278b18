"""The Lightning contract of ``ByteScaleStrategy``, feature by feature, against one process or DDP's behaviour.

Each fixture runs a few Trainer runs on 2 CPU ranks (fork launcher, gloo, float64) and their
single-process references on the same global batches (``_contract.py``); each test checks
one row of the contract table in ``docs/strategy.md`` (``_contract.FEATURES``, which names it).
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _contract import (
    FEATURES,
    REFUSED_CALLS,
    ROOT,
    TIMEOUT_S,
    WORLD,
    ContractData,
    ContractModule,
    WholeBatches,
    close,
    docs_block,
    max_difference,
    params,
    read,
    render,
    sequences,
    trainer,
)
from _strategy_helpers import CLIP, INIT_SEED, make_plan
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateFinder,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lightning_bytescale import ByteScaleDataModule
from lightning_bytescale.errors import CollectiveInMicroBatchError, GradientAccumulationError
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

pytestmark = pytest.mark.multiprocess

MAIN = {
    "max_steps": 6,
    "limit_train_batches": 4,
    "limit_val_batches": 2,
    "val_check_interval": 2,
    "num_sanity_val_steps": 1,
    "gradient_clip_val": CLIP,
    "log_every_n_steps": 1,
}


def _main_callbacks(out: Path) -> list[pl.Callback]:
    return [
        ModelCheckpoint(dirpath=out / "best", monitor="val/loss", save_top_k=2, filename="{step}"),
        ModelCheckpoint(dirpath=out / "steps", every_n_train_steps=2, save_top_k=-1, filename="{step}"),
        EarlyStopping(monitor="val/loss", patience=1),
        LearningRateMonitor(logging_interval="step"),
        _CallbackRecorder(str(out)),
    ]


class _CallbackRecorder(pl.Callback):
    """What the callbacks decided, per rank, at the end of training."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        best = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor)
        stop = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
        row = {
            "best_score": float(best.best_model_score),
            "best_k": sorted(float(v) for v in best.best_k_models.values()),
            "best_name": Path(best.best_model_path).name,
            "stop_best": float(stop.best_score),
            "stop_wait": stop.wait_count,
            "stopped_epoch": stop.stopped_epoch,
            "global_step": trainer.global_step,
        }
        (Path(self.out) / f"callbacks_{trainer.global_rank}.json").write_text(__import__("json").dumps(row))

    def teardown(self, trainer, pl_module, stage):
        # a forked rank ends with os._exit, which runs no atexit handler: W&B would not write its run
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and trainer.is_global_zero:
                logger.experiment.finish()


# ----------------------------------------------------------------------------- the training runs
@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> dict[str, Path]:
    """The main fit (hooks, logging, collectives, callbacks, loggers), ZeRO-2, zeroed gradients, resume."""
    out = tmp_path_factory.mktemp("contract_fits")
    runs = {name: out / name for name in ("main", "ref", "zero2", "zero2_ref", "zeroed", "resume")}
    start = time.perf_counter()
    main = runs["main"]
    loggers = [
        CSVLogger(main, name="csv"),
        TensorBoardLogger(main, name="tb"),
        WandbLogger(save_dir=str(main), offline=True, project="contract"),
    ]
    t = trainer(True, main, logger=loggers, callbacks=_main_callbacks(main), **MAIN)
    t.fit(ContractModule(str(main), "main", hdp=True, record_grads=True, probe_collectives=True),
          datamodule=ContractData(True))  # fmt: skip
    zero2 = runs["zero2"]
    t = trainer(True, zero2, strategy_options={"zero": 2}, max_steps=2, gradient_clip_val=0.01,
                gradient_clip_algorithm="value", enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=zero2 / "ckpt", every_n_train_steps=2, filename="{step}")])  # fmt: skip
    t.fit(ContractModule(str(zero2), "zero2", hdp=True, record_grads=True), datamodule=ContractData(True))
    zeroed = runs["zeroed"]
    t = trainer(True, zeroed, max_steps=2, limit_val_batches=0)
    t.fit(ContractModule(str(zeroed), "zeroed", hdp=True, sgd=True, zero_grads_in_hook=True),
          datamodule=ContractData(True))  # fmt: skip
    resume = runs["resume"]
    t = trainer(True, resume, **{**MAIN, "num_sanity_val_steps": 0})
    t.fit(ContractModule(str(resume), "resume", hdp=True), datamodule=ContractData(True),
          ckpt_path=main / "steps" / "step=2.ckpt")  # fmt: skip
    # the single-process references, on the same global batches
    ref = runs["ref"]
    t = trainer(False, ref, logger=[CSVLogger(ref, name="csv")], callbacks=_main_callbacks(ref), **MAIN)
    t.fit(ContractModule(str(ref), "ref", hdp=False, record_grads=True), datamodule=ContractData(False))
    zero2_ref = runs["zero2_ref"]
    t = trainer(False, zero2_ref, max_steps=2, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    t.fit(
        ContractModule(str(zero2_ref), "zero2_ref", hdp=False, record_grads=True),
        datamodule=ContractData(False),
    )
    runs["seconds"] = time.perf_counter() - start  # type: ignore[assignment]
    return runs


def _both(run: Path, tag: str, stage: str = "fit") -> list[dict]:
    return [read(run, tag, stage, r) for r in range(WORLD)]


def test_batch_hooks_run_once_per_step_with_the_global_loss(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rank, rec in enumerate(_both(fits["main"], "main")):
        assert [s for _, s in rec["train_batch_start"]] == [s for _, s in ref["train_batch_start"]]
        assert rec["before_zero_grad"] == ref["before_zero_grad"]
        rows, expected = rec["train_batch_end"], ref["train_batch_end"]
        assert [r["step"] for r in rows] == [r["step"] for r in expected]
        for got, want in zip(rows, expected):
            assert close(got["loss"], want["loss"]), (rank, got["loss"], want["loss"])
            assert got["logged"] == got["loss"]  # train/loss: the same global value


def test_training_step_dict_keeps_its_extra_keys(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rec in _both(fits["main"], "main"):
        for got, want in zip(rec["train_batch_end"], ref["train_batch_end"]):
            assert got["tokens_list"] and got["tokens_entries"] is not None
            assert got["tokens_total"] == want["tokens_total"]  # every micro-batch of every rank, once


def test_on_before_backward_gets_the_global_loss(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rec in _both(fits["main"], "main"):
        assert len(rec["before_backward"]) == len(ref["before_backward"])
        for (loss, visible), (want, _) in zip(rec["before_backward"], ref["before_backward"]):
            assert close(loss, want) and not visible


def test_on_after_backward_sees_final_gradients(fits):
    ref = torch.load(fits["ref"] / "ref_fit_0_grads.pt")
    for rank in range(WORLD):
        grads = torch.load(fits["main"] / f"main_fit_{rank}_grads.pt")
        assert len(grads) == len(ref)
        for step, (got, want) in enumerate(zip(grads, ref)):
            for name, g in want.items():
                assert got[name] is not None, (rank, step, name)
                err = float((got[name] - g).abs().max())
                assert err <= 1e-10, f"rank {rank} step {step} {name}: gradient differs by {err:.2e}"
    # zeroing the gradients there: no update on any rank (SGD, no weight decay)
    torch.manual_seed(INIT_SEED)
    initial = ContractModule("", "", hdp=True).double().state_dict()
    for rank in range(WORLD):
        assert max_difference(params(fits["zeroed"], "zeroed", "fit", rank), initial) == 0.0


def test_zero2_on_after_backward_sees_the_owned_final_gradients(fits):
    ref = torch.load(fits["zero2_ref"] / "zero2_ref_fit_0_grads.pt")
    owners: dict[str, int] = {}
    for rank in range(WORLD):
        for step, (got, want) in enumerate(
            zip(torch.load(fits["zero2"] / f"zero2_fit_{rank}_grads.pt"), ref)
        ):
            for name, g in want.items():
                if got[name] is None:
                    continue
                owners.setdefault(name, rank)
                assert owners[name] == rank, f"{name} has a gradient on two ranks under zero=2"
                assert float((got[name] - g).abs().max()) <= 1e-10, (rank, step, name)
    assert set(owners) == set(ref[0]) and set(owners.values()) == set(range(WORLD))
    for rank in range(WORLD):
        assert (
            max_difference(
                params(fits["zero2"], "zero2", "fit", rank), params(fits["zero2_ref"], "zero2_ref", "fit")
            )
            <= 1e-10
        )


def test_on_before_optimizer_step_and_clipping_match_one_process(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rec in _both(fits["main"], "main"):
        assert len(rec["before_optimizer_step"]) == len(ref["before_optimizer_step"])
        for got, want in zip(rec["before_optimizer_step"], ref["before_optimizer_step"]):
            assert close(got, want), (got, want)  # the squared norm before clipping
    # clipping by norm (main) and by value (zero2) give one process's parameters: the tests above


def test_parameters_equal_one_process_in_float64(fits):
    want = params(fits["ref"], "ref", "fit")
    for rank in range(WORLD):
        err = max_difference(params(fits["main"], "main", "fit", rank), want)
        assert err <= 1e-10, f"rank {rank}: parameters differ from one process by {err:.2e}"


def test_collectives_inside_the_micro_batch_loops_are_refused_at_once(fits):
    for rec in _both(fits["main"], "main"):
        for hook, safe in (
            ("training_step", "on_train_batch_end"),
            ("validation_step", "on_validation_batch_end"),
        ):
            rows = rec.get(f"refusal/{hook}", [])
            if not rows:  # this rank ran no micro-batch where the probe runs
                continue
            assert [name for name, _, _ in rows] == list(REFUSED_CALLS)
            for name, kind, message in rows:
                assert kind == CollectiveInMicroBatchError.__name__, (hook, name, kind, message)
                assert hook in message and safe in message, message
    assert any(rec.get("refusal/training_step") for rec in _both(fits["main"], "main"))


def test_epoch_values_logged_in_the_loops_are_reduced_over_ranks(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rec in _both(fits["main"], "main"):
        assert rec["train_epoch_end"] == ref["train_epoch_end"]  # train/tokens: a sum over ranks and steps
        assert len(rec["val_end"]) == len(ref["val_end"]) > 0
        for got, want in zip(rec["val_end"], ref["val_end"]):
            assert close(got["ce_sum"], want["ce_sum"]) and close(got["token_mean"], want["token_mean"])
            assert got["metric_sum"] == pytest.approx(want["metric_sum"], rel=1e-6)


def test_sync_dist_in_once_per_step_hooks_reduces_over_ranks(fits):
    for rec in _both(fits["main"], "main"):
        assert all(row["ranks"] == WORLD for row in rec["val_end"])  # on_validation_epoch_end: a sum
    metrics = _csv(fits["main"])
    assert [round(v, 12) for v in metrics["cb/loss"]] == [round(v, 12) for v in metrics["train/loss"]]


def test_val_and_test_loss_are_the_exact_token_mean(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rec in _both(fits["main"], "main"):
        for got, want in zip(rec["val_end"], ref["val_end"]):
            assert close(got["loss"], want["loss"], 1e-12), (got["loss"], want["loss"])


def test_collectives_in_once_per_step_hooks_work(fits):
    for rec in _both(fits["main"], "main"):
        for row in rec["train_batch_end"]:
            assert row["gathered"] == [float(r) for r in range(WORLD)]
            assert row["broadcast"] == 7  # rank 0's value on every rank


def test_model_checkpoint_and_early_stopping_match_one_process(fits):
    import json

    want = json.loads((fits["ref"] / "callbacks_0.json").read_text())
    for rank in range(WORLD):
        got = json.loads((fits["main"] / f"callbacks_{rank}.json").read_text())
        assert close(got["best_score"], want["best_score"], 1e-12)
        assert all(close(a, b, 1e-12) for a, b in zip(got["best_k"], want["best_k"]))
        assert (got["best_name"], got["stop_wait"], got["stopped_epoch"], got["global_step"]) == (
            want["best_name"], want["stop_wait"], want["stopped_epoch"], want["global_step"]
        )  # fmt: skip
        assert close(got["stop_best"], want["stop_best"], 1e-12)
    assert sorted(p.name for p in (fits["main"] / "best").iterdir()) == sorted(
        p.name for p in (fits["ref"] / "best").iterdir()
    )


def _csv(run: Path) -> dict[str, list[float]]:
    import csv

    (path,) = run.glob("csv/*/metrics.csv")
    columns: dict[str, list[float]] = {}
    for row in csv.DictReader(path.open()):
        for key, value in row.items():
            if value not in ("", None) and key not in ("epoch", "step"):
                columns.setdefault(key, []).append(float(value))
    return columns


def test_learning_rates_and_loggers_match_one_process(fits):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_bytescale.lightning.wandb_offline import find_run_files, read_run

    got, want = _csv(fits["main"]), _csv(fits["ref"])
    for key in ("train/loss", "val/loss", "lr-AdamW"):
        assert len(got[key]) == len(want[key]) > 0, key
        assert all(close(a, b) for a, b in zip(got[key], want[key])), (key, got[key], want[key])
    for rank in range(WORLD):
        lrs = [row["lr"] for row in read(fits["main"], "main", "fit", rank)["train_batch_end"]]
        assert lrs == [row["lr"] for row in read(fits["ref"], "ref", "fit")["train_batch_end"]]
    (tb,) = fits["main"].glob("tb/*")
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(want["train/loss"], rel=1e-6)
    (run_file,) = find_run_files(fits["main"])
    run = read_run(run_file)
    assert run.column("train/loss") == pytest.approx(want["train/loss"], rel=1e-12)
    assert run.column("val/loss") == pytest.approx(want["val/loss"], rel=1e-12)


def test_loop_options_give_the_steps_of_one_process(fits):
    ref = read(fits["ref"], "ref", "fit")
    for rec in _both(fits["main"], "main"):
        assert rec["validation_start"] == ref["validation_start"]  # sanity check first, then every 2 steps
        assert rec["train_batch_start"] == ref["train_batch_start"]  # limit_train_batches=4, max_steps=6


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(fits):
    for rank in range(WORLD):
        err = max_difference(
            params(fits["resume"], "resume", "fit", rank), params(fits["main"], "main", "fit", 0)
        )
        assert err <= 1e-12, f"rank {rank}: the resumed run differs by {err:.2e}"


def test_load_from_checkpoint_reads_files_and_sharded_folders(fits):
    for ckpt, run, tag in ((fits["main"] / "steps" / "step=6.ckpt", fits["main"], "main"),
                           (fits["zero2"] / "ckpt" / "step=2.ckpt", fits["zero2"], "zero2")):  # fmt: skip
        loaded = ContractModule.load_from_checkpoint(
            ckpt, out="", tag="", hdp=True, weights_only=False
        ).double()
        err = max_difference(loaded.state_dict(), params(run, tag, "fit"))
        assert err <= 1e-7, (ckpt, err)  # the module is built in float32, the run trained in float64
    from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint, read_consolidated

    folder = fits["zero2"] / "ckpt" / "step=2.ckpt"
    assert is_sharded_checkpoint(folder)
    with pytest.raises(IsADirectoryError):
        torch.load(folder)
    state = read_consolidated(folder)["state_dict"]
    assert max_difference(state, params(fits["zero2"], "zero2", "fit")) == 0.0


# ----------------------------------------------------------------------------- precision, callbacks, loop
class _FinderRecord(LearningRateFinder):
    """The LR finder as a callback, writing what it found on every rank."""

    def __init__(self, out: str) -> None:
        super().__init__(min_lr=1e-4, max_lr=0.5, num_training_steps=14, early_stop_threshold=None)
        self.out = out

    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        import json

        row = {
            "suggestion": self.optimal_lr.suggestion(),
            **{k: list(v) for k, v in self.optimal_lr.results.items()},
        }
        (Path(self.out) / f"finder_{trainer.global_rank}.json").write_text(json.dumps(row))


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> dict[str, Path]:
    """Lower precisions, SWA with check_val_every_n_epoch, the LR finder, fast_dev_run."""
    out = tmp_path_factory.mktemp("contract_features")
    runs: dict[str, Path] = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        run = runs[precision] = out / precision
        t = trainer(True, run, precision=precision, max_steps=2, limit_val_batches=0, gradient_clip_val=CLIP)
        t.fit(ContractModule(str(run), precision, hdp=True), datamodule=ContractData(True))
    for hdp in (True, False):
        run = runs[f"swa_{hdp}"] = out / f"swa_{hdp}"
        t = trainer(hdp, run, max_epochs=3, limit_train_batches=2, limit_val_batches=1, check_val_every_n_epoch=2,
                    callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1)])  # fmt: skip
        t.fit(ContractModule(str(run), "swa", hdp=hdp), datamodule=ContractData(hdp))
        run = runs[f"finder_{hdp}"] = out / f"finder_{hdp}"
        t = trainer(hdp, run, max_steps=1, limit_val_batches=0, callbacks=[_FinderRecord(str(run))])
        t.fit(ContractModule(str(run), "finder", hdp=hdp), datamodule=ContractData(hdp))
    run = runs["fast_dev_run"] = out / "fast_dev_run"
    trainer(True, run, fast_dev_run=True).fit(
        ContractModule(str(run), "fast", hdp=True), datamodule=ContractData(True)
    )
    return runs


def test_lower_precisions_train_alike_on_every_rank(features, tmp_path):
    ref_run = tmp_path / "ref"
    t = trainer(False, ref_run, max_steps=2, limit_val_batches=0, gradient_clip_val=CLIP)
    t.fit(ContractModule(str(ref_run), "ref", hdp=False), datamodule=ContractData(False))
    want = params(ref_run, "ref", "fit")
    torch.manual_seed(INIT_SEED)
    moved = max_difference(ContractModule("", "", hdp=True).double().state_dict(), want)
    losses = [row["loss"] for row in read(ref_run, "ref", "fit")["train_batch_end"]]
    # float32 rounding, amplified where AdamW normalises small gradients
    assert max_difference(params(features["32-true"], "32-true", "fit"), want) <= 1e-3 * moved
    for precision, tolerance in (("32-true", 1e-6), ("bf16-mixed", 2e-2), ("bf16-true", 5e-2)):
        got = [params(features[precision], precision, "fit", r) for r in range(WORLD)]
        assert max_difference(got[0], got[1]) == 0.0, precision  # the same model on every rank
        assert all(torch.isfinite(v).all() for v in got[0].values())
        for rank in range(WORLD):
            rows = read(features[precision], precision, "fit", rank)["train_batch_end"]
            assert [r["loss"] for r in rows] == pytest.approx(losses, rel=tolerance), precision


def test_stochastic_weight_averaging_matches_one_process(features):
    want = params(features["swa_False"], "swa", "fit")
    ref = read(features["swa_False"], "swa", "fit")
    for rank in range(WORLD):
        assert max_difference(params(features["swa_True"], "swa", "fit", rank), want) <= 1e-10
        assert read(features["swa_True"], "swa", "fit", rank)["validation_start"] == ref["validation_start"]


def test_lr_finder_matches_one_process(features):
    import json

    want = json.loads((features["finder_False"] / "finder_0.json").read_text())
    for rank in range(WORLD):
        got = json.loads((features["finder_True"] / f"finder_{rank}.json").read_text())
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9)
        assert got["suggestion"] == pytest.approx(want["suggestion"], rel=1e-12)


def test_fast_dev_run_runs_one_step(features):
    for rank in range(WORLD):
        rec = read(features["fast_dev_run"], "fast", "fit", rank)
        assert [s for _, s in rec["train_batch_start"]] == [0] and len(rec["validation_start"]) == 1


class _Overfit(pl.LightningModule):
    """Records which global batches each epoch trains on (``ByteScaleDataModule``'s byte tokens)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(LlamaConfig.preset("tiny", vocab=257))
        self.out, self.seen = out, []

    def training_step(self, mb, batch_idx):
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def validation_step(self, mb, batch_idx):
        return mb.loss(self.model(mb.input_ids, mb.position_ids))

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append([self.current_epoch, batch.step, batch.data_identity])  # which samples

    def on_train_end(self):
        (Path(self.out) / f"seen_{self.global_rank}.json").write_text(__import__("json").dumps(self.seen))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_overfit_batches_repeats_the_first_batches(tmp_path):
    import json

    data = ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 120, "scale": 1 / 256},
        cache_dir=tmp_path / "cache", tokens_per_step=1024, val_fraction=0.2, num_workers=0,
    )  # fmt: skip
    t = trainer(True, tmp_path, strategy_options={"capacity": 96}, precision="32-true", max_epochs=2,
                overfit_batches=2)  # fmt: skip
    t.fit(_Overfit(str(tmp_path)), datamodule=data)
    for rank in range(WORLD):
        seen = json.loads((tmp_path / f"seen_{rank}.json").read_text())
        assert [(e, s) for e, s, _ in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [d for e, _, d in seen if e == 0] == [d for e, _, d in seen if e == 1]  # the same batches


# ----------------------------------------------------------------------------- entry points, refusals
@pytest.fixture(scope="module")
def entries(tmp_path_factory, fits) -> dict[str, Path]:
    """validate, test and predict from the main run's last checkpoint; a validation set one rank never sees."""
    out = tmp_path_factory.mktemp("contract_entries")
    ckpt = fits["main"] / "steps" / "step=6.ckpt"
    runs: dict[str, Path] = {}
    for hdp in (True, False):
        run = runs[f"eval_{hdp}"] = out / f"eval_{hdp}"
        t = trainer(hdp, run)
        # in float64 from the start: one process's strategy loads a checkpoint before the precision
        # plugin converts the module (ByteScaleStrategy after), so a float32 module would round it
        module = ContractModule(str(run), "eval", hdp=hdp).double()
        t.validate(module, datamodule=ContractData(hdp), ckpt_path=ckpt, weights_only=False)
        t.test(module, datamodule=ContractData(hdp), ckpt_path=ckpt, weights_only=False)
    run = runs["predict"] = out / "predict"
    trainer(True, run).predict(ContractModule(str(run), "predict", hdp=True), datamodule=ContractData(True),
                               ckpt_path=ckpt, weights_only=False)  # fmt: skip
    run = runs["lonely"] = out / "lonely"
    trainer(True, run).validate(ContractModule(str(run), "lonely", hdp=True),
                                datamodule=ContractData(True, {"val": 1}, batches=_one_short_sequence))  # fmt: skip
    return runs


def _one_short_sequence(split: str, step: int) -> list[torch.Tensor]:
    return [torch.arange(5) % 7]


def test_validate_and_test_match_one_process(entries):
    for stage in ("validate", "test"):
        key = "val_end" if stage == "validate" else "test_end"
        (want,) = read(entries["eval_False"], "eval", stage)[key]
        for rank in range(WORLD):
            (got,) = read(entries["eval_True"], "eval", stage, rank)[key]
            for k in ("loss", "ce_sum", "token_mean"):
                assert close(got[k], want[k], 1e-12), (stage, k, got[k], want[k])
    # a validation set of one short sequence: rank 1 runs no micro-batch in the whole epoch
    for rank in range(WORLD):
        (got,) = read(entries["lonely"], "lonely", "validate", rank)["val_end"]
        assert got["ranks"] == WORLD and got["token_mean"] == pytest.approx(got["loss"], rel=1e-12)
        assert got["metric_sum"] == pytest.approx(got["ce_sum"], rel=1e-6)  # a torchmetrics.Metric too


def test_predict_covers_the_global_batch(entries, fits):
    module = ContractModule("", "", hdp=False).double()
    module.load_state_dict(
        torch.load(fits["main"] / "steps" / "step=6.ckpt", weights_only=False)["state_dict"]
    )
    data = WholeBatches("predict", ContractData(False).steps["predict"])
    with torch.no_grad():
        want = [module.predict_step(data[k], k)["logit_sum"] for k in range(len(data))]
    per_rank = [read(entries["predict"], "predict", "predict", r)["predict"] for r in range(WORLD)]
    assert all(len(rows) == len(want) for rows in per_rank)
    for k, total in enumerate(want):
        outputs = [out for rows in per_rank for out in rows[k]]  # every micro-batch of every rank
        assert all(isinstance(rows[k], list) for rows in per_rank)
        assert set().union(*(out["seq_ids"] for out in outputs)) == set(range(len(data[k])))
        assert close(sum(out["logit_sum"] for out in outputs), total), (k, total)


def test_gradient_accumulation_is_refused_by_name(tmp_path):
    module = ContractModule(str(tmp_path), "gas", hdp=True)
    for options in ({"callbacks": [GradientAccumulationScheduler({0: 2})]}, {"accumulate_grad_batches": 2}):
        t = trainer(True, tmp_path, max_steps=2, **options)
        with pytest.raises(GradientAccumulationError, match="tokens_per_step") as info:
            t.fit(module, datamodule=ContractData(True))
        name = "GradientAccumulationScheduler" if "callbacks" in options else "accumulate_grad_batches"
        assert name in str(info.value)
        assert not list(tmp_path.glob("gas_*"))  # refused before any rank started


class _Manual(ContractModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


def test_manual_optimization_is_refused(tmp_path):
    t = trainer(True, tmp_path, max_steps=1)
    with pytest.raises(Exception, match="automatic optimization"):
        t.fit(_Manual(str(tmp_path), "manual", hdp=True), datamodule=ContractData(True))


def _uneven(split: str, step: int) -> list[torch.Tensor]:
    """Global batches from the 5th on: the first gives the 2 ranks 3 and 4 micro-batches."""
    return sequences(split, step + 4)


def test_a_collective_in_training_step_fails_at_once(tmp_path):
    seqs = _uneven("train", 0)
    counts = [len(r) for r in make_plan([len(s) for s in seqs], WORLD, "balance", 0).ranks]
    assert len(set(counts)) > 1, counts  # where a collective per micro-batch cannot pair up
    t = trainer(True, tmp_path, max_steps=2)
    start = time.perf_counter()
    with pytest.raises(Exception) as info:
        t.fit(ContractModule(str(tmp_path), "uncaught", hdp=True, uncaught_collective=True),
              datamodule=ContractData(True, batches=_uneven))  # fmt: skip
    assert time.perf_counter() - start < TIMEOUT_S  # not the process-group timeout
    text = str(info.value)
    assert (
        CollectiveInMicroBatchError.__name__ in text
        and "training_step" in text
        and "on_train_batch_end" in text
    )


# ----------------------------------------------------------------------------- the table
def test_the_docs_table_is_the_suite():
    text = (ROOT / "docs" / "strategy.md").read_text()
    assert docs_block(text) == render(), "run: python tests/lightning/_contract.py --write-docs"
    for feature in FEATURES:
        assert feature.verdict in ("works", "refused"), feature
        path, _, name = feature.test.partition("::")
        assert f"def {name}(" in (ROOT / "tests" / path).read_text(), (
            f"{feature.name}: no test {feature.test}"
        )
