"""``ByteScaleStrategy(pipeline_parallel_size=2)`` under a real Trainer (gloo, fork launcher, float64) against one process.

The LightningModule builds a 3-block tiny Llama with untied embeddings (stage 0 holds two blocks,
stage 1 one) and, in ``configure_model``, replaces it by this rank's ``LlamaStage`` (the user
contract of docs/pipelines.md); its ``training_step`` is never called under pipelines (the last
stage computes the token loss in torch's schedule).  The data reads the strategy's mesh as
``ByteScaleDataModule`` does: every rank plans the global batch for the pipelines (the balance
planner with ``pipeline_degree=2``: PP-Balance) and builds its pipeline's ``PipelineStepBatch``
with its stage's ring ranks.  The reference is an independent single process on whole sequences
(plain causal SDPA, the loss over all tokens, ``torch.nn.utils.clip_grad_norm_``, AdamW with weight
decay, a learning-rate schedule), from the same initial weights.

* ``(pipeline=2, data_parallel=2)``: six steps; every global batch holds a sequence longer than C,
  a ring item across both pipelines, and PP-Balance gives the pipelines different micro-batch
  counts.
* ``(2, 1)``: four steps, one pipeline.
* ``(2, 2)`` with ``ByteScaleDataModule``: three steps of synthetic documents planned by the data
  module on the strategy's mesh, against one process on the data module's global batches.
* ``(2, 1, 2)``: three steps, one pipeline whose stages are each sharded over a TP group of two.
* ZeRO per stage: the ``(2, 2)`` run with ``zero=1`` and ``zero=2``, and ``(2, 2, 2)`` with ``zero=2``
  (per stage and lane); each rank keeps optimizer state (ZeRO-2: gradients after the sync) only
  for the parameters it owns, the HDP ranks of a stage together for all of them.
* A sharded checkpoint of the ``(2, 2)`` run at step 3, resumed on ``(2, 2)`` to step 6 (``zero=0``
  and ``zero=1``: the owners' files hold the state).
* ``(2, 2)`` with validation: ``val/loss`` through the forward-only schedule against one process's
  token mean on held-out batches; the sharded checkpoint exported as one ``LlamaModel`` with the
  same held-out loss; ``trainer.validate`` and ``trainer.test`` from it.
* The refusals at construction, in ``Trainer(...)`` and at set-up (a module without its stage,
  ``trainer.predict``).

Clipping acts in every step (the max norm is below the gradient norms).  Parameters (gathered over
the stages from every rank's own ones) and the loss logged on every rank, first stages included,
must equal the reference to 1e-10.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from _strategy_helpers import QUIET, TinyLM, global_batch, reference
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import ParallelDimsError, PipelineModelError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

INIT_SEED = 1234  # _strategy_helpers' (TinyLM and the reference)
MAX_NORM = 0.05  # below the gradient norms: clipping acts in every step
TOLERANCE = 1e-10
STAGES = 2
DATA_CAPACITY = 96  # the data-module run: a few documents longer than C (rings)


def _config(vocab: int = 64) -> LlamaConfig:
    return LlamaConfig.preset("tiny", layers=3, tie_embeddings=False, vocab=vocab)


def _capacity(dp: int) -> int:
    return 24 if dp > 1 else 48  # two pipelines: the long sequence is a ring item; one: it fits


def _plan(k: int, lengths: list[int], dp: int):
    from lightning_bytescale.planner import make_plan

    return make_plan(
        tuple(lengths),
        world_size=dp,
        capacity=_capacity(dp),
        planner="balance",
        pipeline_degree=STAGES,
        seed=k,
    )


class PipelineSteps(Dataset):
    """Item ``k``: this pipeline's micro-batches of global batch ``k``, with this stage's ring ranks."""

    def __init__(self, pmesh, steps: int) -> None:
        self.pmesh, self.steps = pmesh, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int):
        from lightning_bytescale.parallel import build_pipeline_step

        seqs = global_batch(k)
        plan = _plan(k, [len(s) for s in seqs], self.pmesh.dims.data_parallel)
        return build_pipeline_step(
            plan,
            self.pmesh.hdp_rank,
            lambda j: seqs[j],
            stages=STAGES,
            step=k,
            ring_ranks=self.pmesh.ring_ranks,
        )


class PipelineLM(TinyLM):
    """TinyLM's optimizer and schedule; built whole (the same seed on every rank), replaced by this rank's stage in configure_model."""

    def __init__(
        self, split: bool = True, data_steps: int = 0, tensor_parallel: bool = False, vocab: int = 64
    ) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(_config(vocab))
        self.split, self.data_steps, self.tensor_parallel = split, data_steps, tensor_parallel

    def train_dataloader(self):
        """The pipeline's steps, read with the strategy's mesh (as ByteScaleDataModule does)."""
        steps = PipelineSteps(self.trainer.strategy.parallel_mesh, self.data_steps)
        return StatefulDataLoader(steps, batch_size=None, shuffle=False)

    def configure_model(self) -> None:
        from lightning_bytescale.parallel import LlamaStage

        mesh = self.device_mesh
        assert mesh.mesh_dim_names == ("pipeline", "data_parallel", "tensor_parallel")
        if self.tensor_parallel and not isinstance(self.model, LlamaStage):  # TP before the split
            from lightning_bytescale.parallel import parallelize_llama

            parallelize_llama(self.model, mesh["tensor_parallel"])
        if self.split and not isinstance(self.model, LlamaStage):
            self.model = LlamaStage(self.model, mesh["pipeline"].get_local_rank(), mesh["pipeline"].size())

    def training_step(self, mb, batch_idx):
        raise AssertionError("training_step is not called under pipelines")


class Recorder(pl.Callback):
    """Every rank writes the logged losses, the pipelines' micro-batch counts and its stage's parameters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.with_grads: list[list[str]] = []  # per step: the parameters holding a gradient after the sync

    def on_after_backward(self, trainer, pl_module):
        self.with_grads.append(sorted(n for n, p in pl_module.named_parameters() if p.grad is not None))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(
            {
                "step": batch.step.step,
                "logged": float(trainer.callback_metrics["train/loss"]),
                "counts": list(batch.counts),
                "rings": sum(mb.layout.ring is not None for mb in batch.micro_batches),
            }
        )

    def on_train_end(self, trainer, pl_module):
        pmesh = trainer.strategy.parallel_mesh
        r = trainer.global_rank
        names = {p: n for n, p in pl_module.named_parameters()}
        state = sorted(names[p] for p, entry in trainer.optimizers[0].state.items() if entry)
        report = {
            "rows": self.rows,
            "coords": [pmesh.stage, pmesh.hdp_rank, list(pmesh.ring_ranks)],
            "stage_params": sorted(names.values()),
            "optimizer_state": state,  # the parameters this rank keeps optimizer state for
            "with_grads": self.with_grads,
        }
        (self.out / f"report_{r}.json").write_text(json.dumps(report))
        from torch.distributed.tensor import DTensor

        state = pl_module.state_dict()
        params = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()
        }
        torch.save(params, self.out / f"params_{r}.pt")


def _fit(out: Path, world: int, steps: int, **options) -> None:
    """``steps`` optimizer steps on ``world`` CPU ranks; ``options``: ``data_steps``, ``ckpt_every``, ``resume``,
    ``module`` and the strategy's own."""
    data_steps, ckpt_every = options.pop("data_steps", steps), options.pop("ckpt_every", None)
    resume, module = options.pop("resume", None), options.pop("module", None) or PipelineLM()
    datamodule, extra_callbacks = options.pop("datamodule", None), options.pop("callbacks", [])
    trainer_options = {k: options.pop(k) for k in ("limit_val_batches",) if k in options}
    module.data_steps = data_steps
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MASTER_PORT", None)
    capacity = options.pop("capacity", None) or _capacity(
        world // (STAGES * options.get("tensor_parallel_size", 1))
    )
    strategy = ByteScaleStrategy(
        pipeline_parallel_size=STAGES, capacity=capacity, start_method="fork", timeout=120, **options
    )
    callbacks: list[pl.Callback] = [*extra_callbacks, Recorder(out)]
    if ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=ckpt_every))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="64-true", default_root_dir=out,
        max_steps=steps, gradient_clip_val=MAX_NORM, callbacks=callbacks,
        **{**QUIET, "enable_checkpointing": bool(ckpt_every), **trainer_options},
    )  # fmt: skip
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)


def _reference(steps: int, **options) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, whole sequences, float64 (the shared reference): parameters, losses and gradient norms."""
    norms: list[float] = []

    def clip(params: list[torch.nn.Parameter]) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))

    expected, losses = reference(steps, clip_grads=clip, **{"config": _config(), **options})
    return expected, losses, norms


def _check(out: Path, world: int, steps: int, first_step: int = 0, tp: int = 1, **reference_options) -> dict:
    expected, losses, norms = _reference(steps, **reference_options)
    assert min(norms) > MAX_NORM, "clipping must act in every step"
    dp = world // (STAGES * tp)
    reports = [json.loads((out / f"report_{r}.json").read_text()) for r in range(world)]
    worst_param = worst_loss = 0.0
    seen: set[str] = set()
    for r, rep in enumerate(reports):
        got = torch.load(out / f"params_{r}.pt")
        assert got.keys() <= expected.keys()
        seen |= got.keys()
        for k, v in got.items():
            worst_param = max(worst_param, (v - expected[k]).abs().max().item())
        rows = rep["rows"]
        assert [row["step"] for row in rows] == list(range(first_step, steps))
        per_step = [abs(row["logged"] - losses[row["step"]]) for row in rows]
        worst_loss = max(worst_loss, max(per_step))
        if r == 0:
            print("loss differences per step:", " ".join(f"{d:.1e}" for d in per_step))
        stage, hdp, lane = r // (dp * tp), r // tp % dp, r % tp  # the stage outermost, TP inner
        assert rep["coords"][:2] == [stage, hdp]
        ring_peers = [(stage * dp + h) * tp + lane for h in range(dp)]
        assert rep["coords"][2] == ring_peers  # this stage (and lane) of every pipeline
    assert seen == expected.keys(), "the stages together must hold every parameter"
    return {"param": worst_param, "loss": worst_loss, "reports": reports}


def _assert_exact(result: dict, label: str) -> None:
    print(
        f"{label}: max parameter difference {result['param']:.3e}, max loss difference {result['loss']:.3e}"
    )
    assert result["param"] <= TOLERANCE, result["param"]
    assert result["loss"] <= TOLERANCE, result["loss"]


def _check_zero_partition(reports: list[dict], zero: int, dp: int, tp: int = 1) -> None:
    """Each stage's optimizer state (ZeRO-2: its gradients after the sync) split over the stage's HDP ranks.

    Without ZeRO every rank keeps the state of its whole stage; with ZeRO the ranks of a stage (and
    lane) keep disjoint parts that together are the stage's parameters, each part a proper one, and
    with ZeRO-2 a rank holds after every step's sync exactly the gradients of the parameters it owns.
    """
    for stage, lane in [(s, t) for s in range(STAGES) for t in range(tp)]:
        ranks = [reports[(stage * dp + h) * tp + lane] for h in range(dp)]  # the stage outermost, TP inner
        params = set(ranks[0]["stage_params"])
        parts = [set(rep["optimizer_state"]) for rep in ranks]
        if not zero:
            assert all(part == params for part in parts), "without ZeRO every rank keeps its stage's state"
            continue
        assert sum(map(len, parts)) == len(params) and set().union(*parts) == params, (
            f"stage {stage}: the HDP ranks' optimizer states {parts} must split the stage's parameters"
        )
        assert all(part and part != params for part in parts), f"stage {stage}: one rank kept everything"
        for rep, part in zip(ranks, parts):
            held = {name for step in rep["with_grads"] for name in step}
            if zero == 2:
                assert held == part, "ZeRO-2: a rank holds only the gradients it owns after the sync"
            else:
                assert held == params


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_2x2_pp_balance_with_rings_equals_one_process(tmp_path, zero):
    """ZeRO-1/2 per stage: each stage's optimizer state (and gradients) split over its two HDP ranks."""
    steps = 6
    _fit(tmp_path, 4, steps, zero=zero)
    result = _check(tmp_path, 4, steps)
    _assert_exact(result, f"(2, 2) zero={zero}")
    _check_zero_partition(result["reports"], zero, dp=2)
    rows = [row for rep in result["reports"] for row in rep["rows"]]
    assert all(row["rings"] for row in rows), "every global batch holds a ring item across the pipelines"
    assert any(row["counts"][0] != row["counts"][1] for row in rows), "PP-Balance gave no pipeline more"


def test_2x1_one_pipeline_equals_one_process(tmp_path):
    steps = 4
    _fit(tmp_path, 2, steps)
    _assert_exact(_check(tmp_path, 2, steps), "(2, 1)")


def test_2x1x2_tensor_parallel_stages_equal_one_process(tmp_path):
    """Four ranks: one pipeline of two stages, each sharded over a TP group of two."""
    steps = 3
    _fit(tmp_path, 4, steps, module=PipelineLM(tensor_parallel=True), tensor_parallel_size=2)
    _assert_exact(_check(tmp_path, 4, steps, tp=2), "(2, 1, 2)")


def test_2x2x2_zero2_per_stage_and_lane_equals_one_process(tmp_path):
    """Eight ranks: two pipelines of two stages, each stage sharded over a TP group of two, ZeRO-2 per stage and lane."""
    steps = 3
    _fit(tmp_path, 8, steps, module=PipelineLM(tensor_parallel=True), tensor_parallel_size=2, zero=2)
    result = _check(tmp_path, 8, steps, tp=2)
    _assert_exact(result, "(2, 2, 2) zero=2")
    _check_zero_partition(result["reports"], 2, dp=2, tp=2)


def _data_module(cache: Path, **standalone):
    from lightning_bytescale import ByteScaleDataModule

    return ByteScaleDataModule(
        {"kind": "synthetic", "name": "github", "num_samples": 120, "scale": 1 / 256},
        cache_dir=cache, tokens_per_step=512, num_workers=0, capacity=DATA_CAPACITY, **standalone,
    )  # fmt: skip


def test_2x2_with_the_bytescale_data_module_equals_one_process(tmp_path):
    """ByteScaleDataModule on the strategy's mesh: PP-Balance for the two pipelines, padded pipeline batches."""
    steps = 3
    _fit(
        tmp_path, 4, steps, module=PipelineLM(vocab=257), datamodule=_data_module(tmp_path / "cache"),
        capacity=DATA_CAPACITY,
    )  # fmt: skip
    plain = _data_module(tmp_path / "cache", rank=0, world_size=2)  # the same global batches, in one process
    plain.prepare_data()
    plain.setup("fit")
    dataset = plain.train_dataloader().dataset

    def batches(k: int) -> list[torch.Tensor]:
        return [torch.as_tensor(dataset.tokens(int(i)), dtype=torch.long) for i in dataset.sample_ids(0, k)]

    result = _check(tmp_path, 4, steps, config=_config(257), batches=batches)
    _assert_exact(result, "(2, 2) data module")
    rows = result["reports"][0]["rows"]
    print(
        "micro-batches per pipeline:",
        [row["counts"] for row in rows],
        "ring micro-batches:",
        [r["rings"] for r in rows],
    )
    assert any(row["rings"] for row in rows), "a document longer than C must run as a ring item"


def _optimizer_writers(folder: Path) -> dict[str, set[int]]:
    """Parameter name -> the ranks whose files hold its optimizer state in the folder (DCP's metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    paths = metadata.planner_data or {}
    writers: dict[str, set[int]] = {}
    for index, info in metadata.storage_data.items():
        path = paths.get(index.fqn, (index.fqn,))
        if path[0] == "optimizer_0":  # DCP names each rank's file __<rank>_<n>.distcp
            writers.setdefault(path[1], set()).add(int(info.relative_path.split("_")[2]))
    return writers


@pytest.mark.parametrize("zero", [0, 1])
def test_sharded_checkpoint_resumes_exactly_on_2x2(tmp_path, zero):
    steps = 6
    first = tmp_path / "first"
    _fit(first, 4, 3, data_steps=steps, ckpt_every=3, zero=zero)
    folder = first / "ckpt" / "epoch=0-step=3.ckpt"
    assert is_sharded_checkpoint(folder), (
        "with pipelines checkpoint_format='auto' must write a sharded folder"
    )
    saved = [json.loads((first / f"report_{r}.json").read_text()) for r in range(4)]
    owners = {name: {r} for r, rep in enumerate(saved) for name in rep["optimizer_state"]}
    writers = _optimizer_writers(folder)
    assert set(writers) == {name for rep in saved for name in rep["stage_params"]}, (
        "every stage's state saved"
    )
    if zero:  # DCP keeps one copy of each entry; under ZeRO only the owner offers it
        assert writers == owners, "under ZeRO each parameter's state is written by its owner alone"
    second = tmp_path / "second"
    _fit(second, 4, steps, resume=folder, zero=zero)
    result = _check(second, 4, steps, first_step=3)
    _assert_exact(result, f"resumed (2, 2) zero={zero}")
    _check_zero_partition(result["reports"], zero, dp=2)


def test_a_module_without_a_stage_is_refused(tmp_path):
    # the fork launcher re-raises a rank's error with its traceback: the class and the fix are named there
    with pytest.raises(
        Exception,
        match=f"{PipelineModelError.__name__}: .*exactly one pipeline stage, a lightning_bytescale.parallel.DecoderStage"
        ".*configure_model.*a DecoderStage subclass of your own",
    ):
        _fit(tmp_path, 2, 1, module=PipelineLM(split=False))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be a positive integer"),
        (
            {"pipeline_parallel_size": 2, "checkpoint_format": "consolidated"},
            "checkpoint_format='consolidated'",
        ),
        (
            {"pipeline_parallel_size": 2, "pipeline_degree": 3},
            "pipeline_degree=3 but pipeline_parallel_size=2",
        ),
    ],
)
def test_refused_at_construction(options, match):
    with pytest.raises(ConfigError, match=match):
        ByteScaleStrategy(**options)


def test_planner_config_follows_pipeline_parallel_size():
    assert ByteScaleStrategy(pipeline_parallel_size=2).planner_config.pipeline_degree == 2
    assert ByteScaleStrategy().planner_config.pipeline_degree == 1


def test_sizes_that_do_not_fit_the_world_are_refused_in_the_trainer(tmp_path):
    with pytest.raises(ParallelDimsError, match="pipeline_parallel_size=2"):
        pl.Trainer(
            accelerator="cpu", devices=3, strategy=ByteScaleStrategy(pipeline_parallel_size=2, start_method="fork"),
            default_root_dir=tmp_path, **QUIET,
        )  # fmt: skip


VAL_BATCHES = (100, 101)  # held-out global batches: not among the training ones


class HeldOutSteps(PipelineSteps):
    """Item ``k``: this pipeline's micro-batches of the held-out global batch ``VAL_BATCHES[k]``."""

    def __len__(self) -> int:
        return len(VAL_BATCHES)

    def __getitem__(self, k: int):
        return super().__getitem__(VAL_BATCHES[k])


class EvaluatedPipelineLM(PipelineLM):
    def validation_step(self, mb, batch_idx):
        raise AssertionError("not called under pipelines: the last stage computes the token loss")

    def val_dataloader(self):
        return StatefulDataLoader(
            HeldOutSteps(self.trainer.strategy.parallel_mesh, 0), batch_size=None, shuffle=False
        )

    def test_step(self, mb, batch_idx):
        raise AssertionError("not called under pipelines: the last stage computes the token loss")

    def test_dataloader(self):
        return self.val_dataloader()

    def predict_step(self, mb, batch_idx):
        raise AssertionError("refused before any batch")

    def predict_dataloader(self):
        return self.val_dataloader()


class ValLoss(pl.Callback):
    """Every rank writes the ``val/loss`` it logged and how many validation batches held a ring item."""

    def __init__(self, out: Path) -> None:
        self.out, self.rings = out, 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rings += any(mb.layout.ring is not None for mb in batch.micro_batches)

    def on_validation_end(self, trainer, pl_module):
        row = {"val_loss": float(trainer.callback_metrics["val/loss"]), "rings": self.rings}
        (self.out / f"val_{trainer.global_rank}.json").write_text(json.dumps(row))


def _held_out_loss(state: dict[str, torch.Tensor]) -> float:
    """The token mean of the cross-entropy over the held-out batches, one process, whole sequences."""
    from _strategy_helpers import causal_sdpa

    model = LlamaModel(_config(), attention_fn=causal_sdpa).double()
    model.load_state_dict(state)  # strict: every tensor of the unsplit model, nothing else
    ce, tokens = 0.0, 0
    with torch.no_grad():
        for k in VAL_BATCHES:
            for s in global_batch(k):
                logits = model(s, torch.arange(len(s)))
                ce += float(torch.nn.functional.cross_entropy(logits[:-1], s[1:], reduction="sum"))
                tokens += len(s) - 1
    return ce / tokens


def test_2x2_validates_exactly_and_its_checkpoint_exports_as_one_model(tmp_path):
    """One run on ``(2, 2)``: two steps, a sharded checkpoint, validation through the forward-only schedule.

    The logged ``val/loss`` (every rank) is the one-process token mean over the held-out batches
    (a ring item among them) with the reference's trained weights; the checkpoint folder exported
    with ``--model-only model.`` loads strictly into one unsplit ``LlamaModel`` whose held-out loss
    is the same, and so does ``export_consolidated``'s file; ``trainer.validate`` and
    ``trainer.test`` from the folder on ``(2, 2)`` give the same loss.
    """
    from lightning_bytescale.lightning.checkpoint import export_consolidated, main

    steps = 2
    _fit(
        tmp_path, 4, steps, module=EvaluatedPipelineLM(), ckpt_every=steps, callbacks=[ValLoss(tmp_path)],
        limit_val_batches=None,
    )  # fmt: skip
    _assert_exact(_check(tmp_path, 4, steps), "(2, 2) with validation")
    expected, _, _ = _reference(steps)
    want = _held_out_loss({k.removeprefix("model."): v for k, v in expected.items()})
    rows = [json.loads((tmp_path / f"val_{r}.json").read_text()) for r in range(4)]
    worst = max(abs(row["val_loss"] - want) for row in rows)
    print(f"val/loss {rows[0]['val_loss']!r}, one process {want!r}: max difference {worst:.1e}")
    assert worst <= TOLERANCE, worst
    assert all(row["rings"] for row in rows), "a held-out batch must hold a ring item across the pipelines"

    (folder,) = (tmp_path / "ckpt").glob(f"*step={steps}.ckpt")
    assert is_sharded_checkpoint(folder)
    assert main([str(folder), str(tmp_path / "model.pt"), "--model-only", "model."]) == 0
    exported = torch.load(tmp_path / "model.pt")
    got = _held_out_loss(exported)
    assert abs(got - want) <= TOLERANCE and abs(got - rows[0]["val_loss"]) <= TOLERANCE, (got, want)
    whole = torch.load(export_consolidated(folder, tmp_path / "all.ckpt"), weights_only=False)["state_dict"]
    assert abs(_held_out_loss({k.removeprefix("model."): v for k, v in whole.items()}) - want) <= TOLERANCE
    print(f"exported model's held-out loss {got!r} (difference {abs(got - want):.1e})")

    # trainer.validate / trainer.test from the pipelined checkpoint: the same forward-only schedule
    for run, key in (("validate", "val/loss"), ("test", "test/loss")):
        os.environ.pop("MASTER_PORT", None)
        trainer = pl.Trainer(
            accelerator="cpu", devices=4, precision="64-true", default_root_dir=tmp_path, **QUIET,
            strategy=ByteScaleStrategy(
                pipeline_parallel_size=STAGES, capacity=_capacity(2), start_method="fork", timeout=120
            ),
        )  # fmt: skip
        (metrics,) = getattr(trainer, run)(EvaluatedPipelineLM(), ckpt_path=folder, weights_only=False)
        print(f"trainer.{run}: {key} {metrics[key]!r} (difference {abs(metrics[key] - want):.1e})")
        assert abs(metrics[key] - want) <= TOLERANCE, (run, metrics, want)


def test_prediction_is_refused_at_set_up(tmp_path):
    os.environ.pop("MASTER_PORT", None)
    module = EvaluatedPipelineLM(data_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, precision="64-true", default_root_dir=tmp_path, **QUIET,
        strategy=ByteScaleStrategy(pipeline_parallel_size=STAGES, capacity=48, start_method="fork", timeout=60),
    )  # fmt: skip
    with pytest.raises(
        Exception, match=r"ConfigError: trainer.predict\(\) is not supported with pipeline_parallel_size=2"
    ):
        trainer.predict(module)
