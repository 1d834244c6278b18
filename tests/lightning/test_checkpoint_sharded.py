"""Sharded checkpoints (``torch.distributed.checkpoint``): exact resume on the same and on other world sizes.

A 2-rank float64 run trains ``N + M`` steps and, after step ``N``, saves a sharded checkpoint
(under the preemption checkpoint's name, ``hpc_ckpt_1.ckpt``) and a consolidated one.  Runs
resumed from the folder (with ``ckpt_path="hpc"`` on 2 ranks, with the path on 3 ranks and on
1) must end with the parameters and logged losses of that uninterrupted run, with ZeRO on and
off when saving and when loading (so ZeRO state is re-partitioned, gathered and split).  The
folder exported to one file must equal the consolidated save, and loads into a plain
single-process model and optimizer that continue to the same parameters.  A preemption stop
(the flag a SIGTERM sets) saves a sharded folder that resumes on 3 ranks to the independent
single-process reference; ``bytescale-train`` resumes from its sharded ``last.ckpt``.
In-process unit tests cover the folder layout and the errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import _strategy_helpers as ts  # TinyLM, Recorder, causal_sdpa, the global batches
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _recipe_helpers import run_train
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.errors import CheckpointError, ConfigError
from lightning_bytescale.lightning.checkpoint import (
    META_FILE,
    export_consolidated,
    is_sharded_checkpoint,
    load_sharded,
    main,
    model_state,
    save_sharded,
    sharded_optimizer_state,
)
from lightning_bytescale.lightning.preemption import (
    EXIT_PREEMPTED,
    PreemptionCallback,
    checkpoint_path,
)
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.planner import make_plan

CAPACITY = 48  # the longest sequence of ts.global_batch fits one rank, so 1 rank can resume
SAVE_AT, MORE = 2, 2  # save after step SAVE_AT, then MORE steps


# ----------------------------------------------------------------------------- runs
class StepData(Dataset):
    """Item ``k``: this rank's StepBatch of ``ts.global_batch(k)``, planned for the current world."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

    def __len__(self) -> int:
        return ts.STEPS_PER_EPOCH

    def __getitem__(self, k: int):
        seqs = ts.global_batch(k)
        plan = make_plan(tuple(len(s) for s in seqs), world_size=self.world, seed=0, capacity=CAPACITY)
        return build_step(plan, self.rank, lambda j: seqs[j], step=k)


class StepDataModule(pl.LightningDataModule):
    def train_dataloader(self):
        t = self.trainer
        return StatefulDataLoader(StepData(t.world_size, t.global_rank), batch_size=None, num_workers=0)


class SaveBoth(pl.Callback):
    """After step SAVE_AT: the strategy's format to the preemption name, and a consolidated file."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != SAVE_AT:
            return
        trainer.save_checkpoint(checkpoint_path(trainer))  # what a preemption stop saves
        opt = trainer.optimizers[0]
        local = opt.optim if hasattr(opt, "optim") else opt  # ZeRO: this rank's partition
        names = {id(p): n for n, p in pl_module.named_parameters()}
        owned = [names[id(p)] for g in local.param_groups for p in g["params"]]
        (Path(trainer.default_root_dir) / f"owned_{trainer.global_rank}.json").write_text(json.dumps(owned))
        strategy = trainer.strategy
        chosen, strategy.checkpoint_format = strategy.checkpoint_format, "consolidated"
        trainer.save_checkpoint(Path(trainer.default_root_dir) / "consolidated.ckpt")
        strategy.checkpoint_format = chosen


def fit(
    out: Path,
    world: int,
    *,
    zero: bool,
    steps: int,
    resume=None,
    root: Path | None = None,
    save: bool = False,
    callbacks: list[pl.Callback] = (),
):
    out.mkdir(parents=True, exist_ok=True)
    trainer = ts.quiet_trainer(
        root or out,
        world,
        ByteScaleStrategy(
            capacity=CAPACITY,
            zero=int(zero),
            start_method="fork",
            timeout=60,
            # "auto" saves sharded exactly when optimizer state is sharded: ask for it otherwise
            checkpoint_format="auto" if zero else "sharded",
        ),
        max_steps=steps,
        gradient_clip_val=ts.CLIP,
        callbacks=[ts.Recorder(out), *([SaveBoth()] if save else []), *callbacks],
    )
    trainer.fit(ts.TinyLM(), datamodule=StepDataModule(), ckpt_path=resume)


def _assert_same(a, b, where: str = "checkpoint") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        )
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _continue_plainly(ckpt: dict) -> dict[str, torch.Tensor]:
    """One process, no strategy: the exported checkpoint's model, AdamW and scheduler, MORE more steps."""
    model = LlamaModel(LlamaConfig.preset("tiny"), attention_fn=ts.causal_sdpa).double()
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    opt = torch.optim.AdamW(model.parameters(), lr=ts.LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    opt.load_state_dict(ckpt["optimizer_states"][0])  # after the scheduler set its lr, as Lightning does
    sched.load_state_dict(ckpt["lr_schedulers"][0])
    for k in range(SAVE_AT, SAVE_AT + MORE):
        seqs = ts.global_batch(k)
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        for s in seqs:
            logits = model(s, torch.arange(len(s)))
            (F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ts.CLIP)
        opt.step()
        sched.step()
    return {f"model.{k}": v for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- multi-process
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("zero", "resumes"),
    [
        (True, [(2, True), (3, True), (1, False)]),  # ZeRO shards re-partitioned, then gathered on one rank
        (False, [(2, False), (3, True), (1, False)]),  # full state split into ZeRO shards on 3 ranks
    ],
    ids=["saved-with-zero", "saved-without-zero"],
)
def test_resume_from_a_sharded_checkpoint_equals_the_uninterrupted_run(tmp_path, zero, resumes):
    had_group = dist.is_available() and dist.is_initialized()
    full = tmp_path / "full"
    try:
        fit(full, 2, zero=zero, steps=SAVE_AT + MORE, save=True)
        folder = full / "hpc_ckpt_1.ckpt"
        assert is_sharded_checkpoint(folder), sorted(p.name for p in full.iterdir())
        files = sorted(p.name for p in folder.glob("*.distcp"))
        assert files == ["__0_0.distcp", "__1_0.distcp"], files  # one per rank
        writers = {
            i.fqn: s.relative_path for i, s in FileSystemReader(folder).read_metadata().storage_data.items()
        }
        model_writers = {f for k, f in writers.items() if k.startswith("state_dict.")}
        assert model_writers == set(files)  # each replicated tensor once, the writes spread over the ranks
        if zero:  # each optimizer entry written by the rank whose ZeRO partition holds it: nothing gathered
            for r in range(2):
                for name in json.loads((full / f"owned_{r}.json").read_text()):
                    mine = {f for k, f in writers.items() if k.startswith(f"optimizer_0.{name}.")}
                    assert mine == {f"__{r}_0.distcp"}, (name, mine)
        expected = torch.load(full / "params_0.pt")
        losses = [row["logged"] for row in ts.read_rows(full)][SAVE_AT:]
        reference, ref_losses = ts.reference(SAVE_AT + MORE)
        assert _max_diff(expected, reference) <= 1e-10  # the uninterrupted run is the right run

        for world, zero_now in resumes:
            out = tmp_path / f"resumed_{world}_{zero_now}"
            # the same world resumes the way a preempted job does: Lightning's "hpc" lookup finds the folder
            resume = "hpc" if world == 2 else folder
            fit(
                out,
                world,
                zero=zero_now,
                steps=SAVE_AT + MORE,
                resume=resume,
                root=full if world == 2 else None,
            )
            for r in range(world):
                rows = ts.read_rows(out, r)
                assert [row["step"] for row in rows] == list(range(SAVE_AT, SAVE_AT + MORE)), rows
                assert [row["logged"] for row in rows] == pytest.approx(losses, abs=1e-12, rel=0)
                err = _max_diff(torch.load(out / f"params_{r}.pt"), expected)
                assert err <= 1e-12, (
                    f"{world} ranks (zero={zero_now}), rank {r}: parameters differ by {err:.3e}"
                )

        exported = export_consolidated(folder, tmp_path / "exported.ckpt")
        ckpt = torch.load(exported, weights_only=False)
        _assert_same(ckpt, torch.load(full / "consolidated.ckpt", weights_only=False))
        err = _max_diff(_continue_plainly(ckpt), expected)
        assert err <= 1e-10, f"the exported checkpoint continued in one process differs by {err:.3e}"
    finally:
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()


class Preempt(pl.Callback):
    """Rank 1 is asked to stop during step SAVE_AT - 1, as a SIGTERM would; the stop saves after that step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SAVE_AT - 1 and trainer.global_rank == 1:
            callback = next(c for c in trainer.callbacks if isinstance(c, PreemptionCallback))
            callback.handler.request("SIGTERM")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_preemption_stop_saves_a_sharded_folder_that_resumes_on_another_world(tmp_path):
    had_group = dist.is_available() and dist.is_initialized()
    run = tmp_path / "preempted"
    try:
        with pytest.raises(Exception, match=f"exit code {EXIT_PREEMPTED}"):
            fit(run, 2, zero=True, steps=SAVE_AT + MORE, callbacks=[Preempt()])
        folder = run / "hpc_ckpt_1.ckpt"
        assert is_sharded_checkpoint(folder), sorted(p.name for p in run.iterdir())
        assert torch.load(folder / META_FILE, weights_only=False)["global_step"] == SAVE_AT
        out = tmp_path / "resumed"
        fit(out, 3, zero=True, steps=SAVE_AT + MORE, resume="hpc", root=run)
        expected, losses = ts.reference(SAVE_AT + MORE)
        for r in range(3):
            rows = ts.read_rows(out, r)
            assert [row["step"] for row in rows] == list(range(SAVE_AT, SAVE_AT + MORE)), rows
            assert [row["logged"] for row in rows] == pytest.approx(losses[SAVE_AT:], abs=1e-12)
        ts.assert_params_equal(out, 3, expected)
    finally:
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- in-process units
class Small(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(3, 4, dtype=torch.float64)
        self.b = torch.nn.Linear(4, 2, dtype=torch.float64)
        self.register_buffer("count", torch.tensor([7.0], dtype=torch.float64))


def _trained(seed: int = 0) -> tuple[Small, torch.optim.Optimizer]:
    model = Small(seed)
    opt = torch.optim.Adam([{"params": model.a.parameters()}, {"params": model.b.parameters(), "lr": 0.01}])
    for _ in range(2):
        model.b(model.a(torch.ones(5, 3, dtype=torch.float64))).square().sum().backward()
        opt.step()
    return model, opt


def _save(model: Small, opt: torch.optim.Optimizer, path: Path) -> None:
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [sharded_optimizer_state(opt, model)],
        "global_step": 2,
        "loops": {"note": "anything Lightning keeps"},
    }
    save_sharded(checkpoint, path, rank=0)


def test_a_folder_round_trips_and_exports_what_the_optimizer_itself_saves(tmp_path):
    model, opt = _trained()
    folder = tmp_path / "step=2.ckpt"
    _save(model, opt, folder)
    assert is_sharded_checkpoint(folder) and (folder / META_FILE).is_file()

    fresh = Small(seed=1)
    fresh_opt = torch.optim.Adam(
        [{"params": fresh.a.parameters()}, {"params": fresh.b.parameters(), "lr": 0.01}]
    )
    loaded = load_sharded(folder, fresh, [fresh_opt])
    assert loaded["global_step"] == 2 and loaded["loops"] == {"note": "anything Lightning keeps"}
    _assert_same(dict(fresh.state_dict()), dict(model.state_dict()))  # read in place into the module
    fresh_opt.load_state_dict(loaded["optimizer_states"][0])
    _assert_same(fresh_opt.state_dict(), opt.state_dict())

    assert main([str(folder), str(tmp_path / "one.ckpt")]) == 0
    one = torch.load(tmp_path / "one.ckpt", weights_only=False)
    _assert_same(one["optimizer_states"][0], opt.state_dict())
    _assert_same(one["state_dict"], dict(model.state_dict()))
    # --model-only PREFIX: the state dict of the module under that attribute, loadable by it alone
    assert main([str(folder), str(tmp_path / "a.pt"), "--model-only", "a."]) == 0
    other = Small(seed=2)
    other.a.load_state_dict(torch.load(tmp_path / "a.pt"))  # strict: a's names, nothing of b
    _assert_same(dict(other.a.state_dict()), dict(model.a.state_dict()))
    with pytest.raises(CheckpointError, match=r"no model tensor .* prefix 'model\.'.*e\.g\. 'model\.'"):
        model_state(folder, "model.")

    _save(model, opt, folder)  # saving again replaces the folder
    assert is_sharded_checkpoint(folder)


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    model, opt = _trained()
    folder = tmp_path / "last.ckpt"
    _save(model, opt, folder)
    newer, newer_opt = _trained(seed=1)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", disk_full)  # DCP's small items and rank 0's meta.pt
        with pytest.raises(BaseException, match="No space left"):  # DCP: a BaseException
            _save(newer, newer_opt, folder)
    fresh = Small(seed=2)
    load_sharded(folder, fresh)
    _assert_same(dict(fresh.state_dict()), dict(model.state_dict()))  # the earlier checkpoint, whole
    assert len(list(tmp_path.iterdir())) == 2  # and the half-written one beside it
    _save(newer, newer_opt, folder)  # the next save clears it away
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    load_sharded(folder, fresh)
    _assert_same(dict(fresh.state_dict()), dict(newer.state_dict()))


def test_mismatches_and_bad_paths_are_named(tmp_path):
    model, opt = _trained()
    folder = tmp_path / "ckpt"
    _save(model, opt, folder)

    class Renamed(Small):
        def __init__(self) -> None:
            super().__init__()
            self.c = self.b
            del self.b

    with pytest.raises(CheckpointError, match=r"does not match the model: missing \['c.bias', 'c.weight'\]"):
        load_sharded(folder, Renamed())
    other = Small()
    with pytest.raises(
        CheckpointError, match=r"group 0 of optimizer 0 differs.*saved but not optimized now \['a.bias'\]"
    ):
        load_sharded(
            folder, other, [torch.optim.Adam([{"params": [other.a.weight]}, {"params": [other.b.weight]}])]
        )
    with pytest.raises(CheckpointError, match=r"the run has 2 optimizer\(s\) but the checkpoint .* has 1"):
        load_sharded(folder, other, [opt, opt])
    with pytest.raises(CheckpointError, match="not a sharded checkpoint folder"):
        load_sharded(tmp_path, other)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is a folder that is not a checkpoint"):
        _save(model, opt, tmp_path / "notes")
    with pytest.raises(ConfigError, match="local or mounted file system"):
        _save(model, opt, "s3://bucket/ckpt")


def test_the_option_is_validated_and_auto_follows_zero():
    with pytest.raises(
        ConfigError, match=r"checkpoint_format must be one of \['auto', 'sharded', 'consolidated'\]"
    ):
        ByteScaleStrategy(checkpoint_format="folder")
    assert ByteScaleStrategy().checkpoint_format == "auto"
    strategy = ByteScaleStrategy()
    assert not strategy.sharded_checkpoints  # no optimizer, or an unsharded one: one file
    assert ByteScaleStrategy(checkpoint_format="sharded").sharded_checkpoints


def _refuse_state_not_shaped_like_its_dtensor_parameter(rank: int, port: int, folder: str) -> None:
    from _ranks import init_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init_gloo(rank, 1, port)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(
            distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Shard(0)])
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        factored = {"w": {"row_factor": torch.zeros(4, dtype=torch.float64)}}  # an Adafactor-like state
        state = {"state": factored, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
        save_sharded({"state_dict": model.state_dict(), "optimizer_states": [state]}, folder, rank=0)
        with pytest.raises(CheckpointError) as caught:
            load_sharded(folder, model, [opt])
        Path(folder, "error.txt").write_text(str(caught.value))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_optimizer_state_not_shaped_like_its_dtensor_parameter_is_refused_on_load(tmp_path):
    from _ranks import free_port, run_ranks

    folder = tmp_path / "ckpt"
    run_ranks(_refuse_state_not_shaped_like_its_dtensor_parameter, 1, free_port(), str(folder), timeout_s=100)
    assert (folder / "error.txt").read_text() == (
        "the checkpoint's optimizer state 'row_factor' of 'w' has shape (4,), not its DTensor parameter's (4, 3): "
        "a sharded checkpoint reads a DTensor parameter's state into its shards only when it is shaped like the "
        "parameter (AdamW, SGD with momentum) or a scalar; use ByteScaleStrategy(checkpoint_format='consolidated') "
        "with this optimizer"
    )


# ----------------------------------------------------------------------------- the recipe
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_resumes_from_its_sharded_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    common = [
        "experiment=cpu_smoke",
        "trainer.devices=1",
        "strategy.checkpoint_format=sharded",
        "logger=csv",
        "trainer.enable_checkpointing=true",
        f"run_dir={run}",
        f"hydra.run.dir={run}",
    ]
    first = run_train([*common, "trainer.max_steps=2"], tmp_path)
    assert "cpu_smoke: 2 steps" in first.stdout
    last = run / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last), sorted(p.name for p in (run / "checkpoints").iterdir())
    second = run_train([*common, "trainer.max_steps=4", f"ckpt_path={last}"], tmp_path)
    assert "cpu_smoke: 2 steps (resumed; step 4 now)" in second.stdout, second.stdout[-2000:]
