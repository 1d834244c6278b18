"""``ByteScaleStrategy(tensor_parallel_size=2)`` under a real Trainer (gloo, fork launcher, float64) against one process.

The LightningModule is written as for Lightning's ``ModelParallelStrategy``: its ``configure_model``
applies ``parallelize_llama(self.model, self.device_mesh["tensor_parallel"])``.  The data reads
the strategy's mesh as ``ByteScaleDataModule`` does: every rank plans the global batch for the
HDP ranks and builds its HDP rank's share with its lane's ring ranks.  The reference is an
independent single process on whole sequences (plain causal SDPA, the loss over all tokens,
``torch.nn.utils.clip_grad_norm_``, AdamW with weight decay).

* ``(data_parallel=2, tensor_parallel=2)``: ten steps, the balance planner with rings (sequences
  longer than C), and one hand plan in which HDP rank 1 runs no micro-batch; untied embeddings
  (the vocabulary is sharded).
* ``(1, 2)``: four steps, tied embeddings (replicated on both lanes).

Resuming from a step-3 checkpoint of a ``(2, 2)`` run, consolidated and sharded (every rank
writes its own DTensor shards), to ``(2, 2)``, ``(1, 2)`` and ZeRO-1, and with FSDP2, must end
where one process ends.  :class:`CheckpointProbe` checks that a sharded save and load gather no
DTensor and that each rank reads exactly the elements of its own shards.

Clipping acts in every step (the max norm is below the gradient norms).  Parameters (gathered
from the shards), the logged losses and ``val/loss`` after the last step (two held-out global
batches, one with an idle HDP rank on ``(2, 2)``) must equal the reference to 1e-10, the step statistics
must count each HDP rank once, and no process group may be made after set-up.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _strategy_helpers import QUIET, causal_sdpa, global_batch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale import ByteScaleStrategy, token_loss
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint, main, read_consolidated
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

INIT_SEED = 1234
LR = 1e-2
MAX_NORM = 0.05  # below the gradient norms: clipping acts in every step
TOLERANCE = 1e-10
IDLE_STEP = 2  # on data_parallel=2: HDP rank 1 runs no micro-batch
VAL_STEPS, VAL_SEED = 2, 7  # validation after the last step: two global batches of another seed


def _capacity(dp: int) -> int:
    return 24 if dp > 1 else 48  # one HDP rank holds every sequence (no ring); two need rings


def _idle_plan(lengths: list[int], capacity: int) -> Plan:
    """HDP rank 0 runs every sequence (one per micro-batch), HDP rank 1 nothing."""
    mbs = [MicroBatch([Piece(j, ((0, n),))]) for j, n in enumerate(lengths)]
    plan = Plan(world_size=2, capacity=capacity, planner="hand", lengths=tuple(lengths), ranks=[mbs, []])
    return plan.validate()


def _plan(k: int, lengths: list[int], dp: int) -> Plan:
    from lightning_bytescale.planner import make_plan

    cap = _capacity(dp)
    if dp == 2 and k == IDLE_STEP:
        return _idle_plan(lengths, 48)
    return make_plan(tuple(lengths), world_size=dp, capacity=cap, planner="balance", seed=k)


class MeshSteps(Dataset):
    """Item ``k``: this HDP rank's share of global batch ``k``, with this lane's ring ranks."""

    def __init__(self, pmesh, steps: int, seed: int = 0) -> None:
        self.pmesh, self.steps, self.seed = pmesh, steps, seed

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int):
        seqs = global_batch(k, self.seed)
        plan = _plan(k if self.seed == 0 else k + 1, [len(s) for s in seqs], self.pmesh.dims.data_parallel)
        return build_step(
            plan, self.pmesh.hdp_rank, lambda j: seqs[j], step=k, ring_ranks=self.pmesh.ring_ranks
        )


class MeshData(pl.LightningDataModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def train_dataloader(self):
        pmesh = self.trainer.strategy.parallel_mesh
        return StatefulDataLoader(MeshSteps(pmesh, self.steps), batch_size=None, shuffle=False)

    def val_dataloader(self):
        pmesh = self.trainer.strategy.parallel_mesh
        return StatefulDataLoader(MeshSteps(pmesh, VAL_STEPS, seed=VAL_SEED), batch_size=None, shuffle=False)


class TPLM(pl.LightningModule):
    """A model written for ModelParallelStrategy: built whole, sharded in configure_model."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(INIT_SEED)
        self.model = LlamaModel(LlamaConfig.preset("tiny", tie_embeddings=tied))
        self.heads_seen: set[tuple[int, int]] = set()

    def configure_model(self) -> None:
        from lightning_bytescale.packed_attention import attention
        from lightning_bytescale.parallel import parallelize_llama

        if self.device_mesh is None:  # load_from_checkpoint in one process: the model stays whole
            return
        assert self.device_mesh.mesh_dim_names == ("data_parallel", "tensor_parallel")
        parallelize_llama(self.model, self.device_mesh["tensor_parallel"])

        def recording_attention(q, k, v):
            self.heads_seen.add((q.shape[1], k.shape[1]))
            return attention(q, k, v)

        self.model.attention_fn = recording_attention

    def training_step(self, mb, batch_idx):
        logits = self.model(mb.input_ids, mb.position_ids)
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    def validation_step(self, mb, batch_idx):
        logits = self.model(mb.input_ids, mb.position_ids)
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


class TPFSDPLM(TPLM):
    """The same, with FSDP2 over the HDP ranks around the tensor-parallel blocks (ModelParallelStrategy style)."""

    reshard_after_forward = False

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        if self.device_mesh is None:
            return
        dp = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=dp, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.model, mesh=dp, reshard_after_forward=self.reshard_after_forward)


class MetaTPLM(TPLM):
    """Built on the meta device (no memory) and sharded there; the strategy gives each rank its shards.

    The values are rank 0's draws of each module's ``reset_parameters`` (``LlamaModel``'s own
    initialisation, in the order the eager model draws), from the reference's seed.
    """

    def __init__(self, tied: bool) -> None:
        pl.LightningModule.__init__(self)
        with torch.device("meta"):
            self.model = LlamaModel(LlamaConfig.preset("tiny", tie_embeddings=tied))
        self.heads_seen = set()

    def configure_model(self) -> None:
        super().configure_model()
        assert all(p.is_meta for p in self.parameters())
        torch.manual_seed(INIT_SEED)  # what set-up draws from (as seed_everything would leave it)


def _process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


class Recorder(pl.Callback):
    """Every rank writes the logged losses, step statistics, micro-batch counts and gathered parameters."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.groups_after_setup = -1

    def on_train_start(self, trainer, pl_module):
        from _parallel import CallLog

        self.groups_after_setup = _process_groups()
        self.calls = CallLog()  # this rank's torch.distributed calls from here on

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.step_stats
        self.rows.append(
            {
                "step": batch.step,
                "logged": float(trainer.callback_metrics["train/loss"]),
                "loss_tokens": stats["loss_tokens"],
                "num_micro_batches": stats["num_micro_batches"],
                "rings": sum(mb.layout.ring is not None for mb in batch.micro_batches),
                "ring_peers": sorted(
                    {r for mb in batch.micro_batches if mb.layout.ring is not None for r in mb.layout.ring}
                ),
            }
        )

    def on_train_end(self, trainer, pl_module):
        pmesh = trainer.strategy.parallel_mesh
        full = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in pl_module.state_dict().items()
        }
        report = {
            "rows": self.rows,
            "coords": [pmesh.hdp_rank, pmesh.lane, list(pmesh.ring_ranks)],
            "groups_after_setup": self.groups_after_setup,
            "groups_at_end": _process_groups(),
            "p2p_peers": sorted(
                {p for name, _, ps in self.calls.events if name == "batch_isend_irecv" for p in ps}
            ),
            "p2p_groups": sorted({r for name, r, _ in self.calls.events if name == "batch_isend_irecv"}),
            "group_calls": sum(
                e[0] in ("new_group", "new_subgroups", "split_group") for e in self.calls.events
            ),
            "heads_seen": sorted(pl_module.heads_seen),
            "val_loss": float(trainer.callback_metrics.get("val/loss", float("nan"))),
            "dtensor_params": sum(isinstance(p, DTensor) for p in pl_module.parameters()),
        }
        r = trainer.global_rank
        (self.out / f"report_{r}.json").write_text(json.dumps(report))
        torch.save(full, self.out / f"params_{r}.pt")


def _fit(
    out: Path,
    world: int,
    *,
    steps: int,
    tied: bool,
    module: type[TPLM] = TPLM,
    data_steps: int | None = None,
    ckpt_every: int | None = None,
    resume: Path | None = None,
    extra_callbacks: tuple[pl.Callback, ...] = (),
    **strategy_options,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MASTER_PORT", None)
    dp = world // 2
    strategy = ByteScaleStrategy(
        tensor_parallel_size=2, capacity=_capacity(dp), start_method="fork", timeout=120, **strategy_options
    )
    callbacks: list[pl.Callback] = [Recorder(out), *extra_callbacks]
    if ckpt_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=ckpt_every))
    options = {**QUIET, "enable_checkpointing": bool(ckpt_every)}
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="64-true", default_root_dir=out,
        max_steps=steps, gradient_clip_val=MAX_NORM, callbacks=callbacks, **options,
    )  # fmt: skip
    trainer.fit(module(tied), datamodule=MeshData(data_steps or steps), ckpt_path=resume)


def reference_steps(
    config: LlamaConfig, batches: Iterable[list[torch.Tensor]]
) -> tuple[LlamaModel, list[float], list[float]]:
    """One process, whole sequences, float64, AdamW with clipping: the model, the losses and gradient norms."""
    torch.manual_seed(INIT_SEED)
    model = LlamaModel(config, attention_fn=causal_sdpa).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, norms = [], []
    for seqs in batches:
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        total = 0.0
        for s in seqs:
            loss = F.cross_entropy(model(s, torch.arange(len(s)))[:-1], s[1:], reduction="sum") / n
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(total)
    return model, losses, norms


def _reference(steps: int, tied: bool) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process, whole sequences, float64: parameters, losses and gradient norms."""
    config = LlamaConfig.preset("tiny", tie_embeddings=tied)
    model, losses, norms = reference_steps(config, (global_batch(k) for k in range(steps)))
    with torch.no_grad():  # the validation loss of the final model: every token of the batches once
        seqs = [s for k in range(VAL_STEPS) for s in global_batch(k, VAL_SEED)]
        ce = sum(F.cross_entropy(model(s, torch.arange(len(s)))[:-1], s[1:], reduction="sum") for s in seqs)
        losses.append(float(ce) / sum(len(s) - 1 for s in seqs))
    return {f"model.{k}": v for k, v in model.state_dict().items()}, losses, norms


def _check(out: Path, world: int, steps: int, tied: bool) -> dict:
    expected, losses, norms = _reference(steps, tied)
    val_loss = losses.pop()
    assert min(norms) > MAX_NORM, "clipping must act in every step"
    dp = world // 2
    reports = [json.loads((out / f"report_{r}.json").read_text()) for r in range(world)]
    worst_param = worst_loss = 0.0
    for r, rep in enumerate(reports):
        got = torch.load(out / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            worst_param = max(worst_param, (got[k] - v).abs().max().item())
        worst_loss = max(worst_loss, abs(rep["val_loss"] - val_loss))
        if r == 0:
            print(f"val/loss difference {abs(rep['val_loss'] - val_loss):.1e}")
        rows = rep["rows"]
        assert [row["step"] for row in rows] == list(range(steps))
        per_step = [abs(row["logged"] - loss) for row, loss in zip(rows, losses)]
        worst_loss = max(worst_loss, max(per_step))
        if r == 0:
            print("loss differences per step:", " ".join(f"{d:.1e}" for d in per_step))
        assert rep["coords"][:2] == [r // 2, r % 2]  # TP inner: HDP rank g // 2, lane g % 2
        assert rep["coords"][2] == [g for g in range(world) if g % 2 == r % 2]
        assert rep["heads_seen"] == [[2, 1]], "attention must get this lane's 4/2 heads and 2/2 KV heads"
        assert rep["dtensor_params"] > 0
        assert rep["groups_at_end"] == rep["groups_after_setup"] > 0, "a process group made after set-up"
        assert rep["group_calls"] == 0
        # every ring transfer goes to the same lane of another HDP rank, on the one global group
        assert set(rep["p2p_peers"]) <= {g for g in range(world) if g % 2 == r % 2 and g != r}
        assert rep["p2p_groups"] in ([], [list(range(world))])
        for k, row in enumerate(rows):
            seqs = global_batch(k)
            assert row["loss_tokens"] == sum(len(s) - 1 for s in seqs)  # each token once, not per lane
            plan = _plan(k, [len(s) for s in seqs], dp)
            assert row["num_micro_batches"] == [len(m) for m in plan.ranks]  # one report per HDP rank
            assert set(row["ring_peers"]) <= set(rep["coords"][2]), "a ring left this lane"
    return {"param": worst_param, "loss": worst_loss, "reports": reports}


def test_2x2_balance_with_rings_and_an_idle_hdp_rank_equals_one_process(tmp_path):
    steps = 10
    _fit(tmp_path, 4, steps=steps, tied=False)
    result = _check(tmp_path, 4, steps, tied=False)
    print(f"(2, 2): max parameter difference {result['param']:.3e}, max loss difference {result['loss']:.3e}")
    assert result["param"] <= TOLERANCE, result["param"]
    assert result["loss"] <= TOLERANCE, result["loss"]
    rows = result["reports"][0]["rows"]
    assert rows[IDLE_STEP]["num_micro_batches"][1] == 0, "HDP rank 1 must run no micro-batch in one step"
    assert any(row["rings"] for rep in result["reports"] for row in rep["rows"]), "no ring ran"
    assert [rep["p2p_peers"] for rep in result["reports"]] == [[2], [3], [0], [1]]


def _equals_one_process(out: Path, what: str, world: int, steps: int, tied: bool, module: type[TPLM]) -> dict:
    """Train ``module`` on ``world`` ranks and check it against one process (``_check``) to ``TOLERANCE``."""
    _fit(out, world, steps=steps, tied=tied, module=module)
    result = _check(out, world, steps, tied=tied)
    print(f"{what}: max parameter difference {result['param']:.3e}, max loss difference {result['loss']:.3e}")
    assert result["param"] <= TOLERANCE, result["param"]
    assert result["loss"] <= TOLERANCE, result["loss"]
    return result


def test_1x2_tied_embeddings_equals_one_process(tmp_path):
    _equals_one_process(tmp_path, "(1, 2)", 2, steps=4, tied=True, module=TPLM)


def test_1x2_meta_device_model_equals_one_process(tmp_path):
    """A model built on the meta device is accepted with TP, materialised with each rank's shards only, exactly."""
    _equals_one_process(tmp_path, "(1, 2) meta", 2, steps=3, tied=False, module=MetaTPLM)


def test_2x2_fsdp2_on_data_parallel_around_tp_equals_one_process(tmp_path):
    # three steps include IDLE_STEP: HDP rank 1 runs no micro-batch but joins every FSDP collective
    result = _equals_one_process(tmp_path, "(2, 2) FSDP2", 4, steps=3, tied=False, module=TPFSDPLM)
    assert result["reports"][0]["rows"][IDLE_STEP]["num_micro_batches"][1] == 0


def test_fsdp2_reshard_after_forward_is_refused_at_set_up(tmp_path):
    from torch.multiprocessing.spawn import ProcessRaisedException

    class Resharding(TPFSDPLM):
        reshard_after_forward = True

    with pytest.raises(ProcessRaisedException, match=r"reshard_after_forward=True"):
        _fit(tmp_path, 2, steps=1, tied=False, module=Resharding)


class CheckpointProbe(pl.Callback):
    """Per rank: DTensor redistributions (gathers) inside each checkpoint save and inside the load,
    the tensor elements a sharded load reads, what the loaded optimizer state looks like.

    ``DTensor.redistribute`` is what ``full_tensor`` and torch's full-state-dict gathers call.
    With ``consolidated`` set, after step ``RESUME_AT`` the same state is also saved as one file there.
    Each consolidated save also records the tensor memory it held at its peak (``_live_bytes.LiveBytes``),
    the bytes of the tensors in the checkpoint dict Lightning built on this rank, and the whole bytes
    of the model's state and of its largest tensor.
    """

    def __init__(self, out: Path, consolidated: Path | None = None) -> None:
        self.out, self.consolidated = out, consolidated
        self.window: str | None = None
        self.gathers: dict[str, int] = {}
        self.saves: dict[str, dict] = {}
        self.read_elements = 0

    def _count(self, name: str, fn):
        def counted(*args, **kwargs):
            self.window = name
            self.gathers.setdefault(name, 0)
            try:
                return fn(*args, **kwargs)
            finally:
                self.window = None

        return counted

    def setup(self, trainer, pl_module, stage):
        import math

        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.planner import LoadItemType

        probe, redistribute, read_data = self, DTensor.redistribute, FileSystemReader.read_data

        def counting_redistribute(self, *args, **kwargs):
            if probe.window is not None:
                probe.gathers[probe.window] += 1
            return redistribute(self, *args, **kwargs)

        def counting_read_data(self, plan, planner):
            items = [i for i in plan.items if i.type == LoadItemType.TENSOR]
            probe.read_elements += sum(math.prod(i.lengths) for i in items)
            return read_data(self, plan, planner)

        DTensor.redistribute = counting_redistribute  # in this rank's process only (forked)
        FileSystemReader.read_data = counting_read_data
        strategy = trainer.strategy
        for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"):
            setattr(strategy, name, self._count("load", getattr(strategy, name)))
        save = trainer.save_checkpoint

        def measured_save(path, *args, **kwargs):
            from _live_bytes import LiveBytes

            name = f"save {Path(path).name}"
            if trainer.strategy.sharded_checkpoints:  # nothing is gathered (the counts show it)
                return self._count(name, save)(path, *args, **kwargs)
            with LiveBytes() as live:
                self._count(name, save)(path, *args, **kwargs)
            self.saves[name] = {"peak": live.peak, **self._held}

        trainer.save_checkpoint = measured_save

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        from torch.utils._pytree import tree_leaves

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))  # DTensor: whole

        whole = list(pl_module.state_dict().values())  # AdamW's moments are shaped like their parameters
        local = [p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
        self._held = {
            "in_checkpoint": nbytes(tree_leaves([checkpoint["state_dict"], checkpoint["optimizer_states"]])),
            "whole_model": nbytes(whole),
            "largest_whole": max(nbytes([t]) for t in whole),
            # ZeRO on the mesh gives every rank its lane's whole AdamW state for the save (LaneZero.materialized)
            "lane_state": 2 * nbytes(local) if trainer.strategy.zero else 0,
        }

    def on_train_start(self, trainer, pl_module):
        from lightning_bytescale.lightning.mesh import keeps_state

        opt = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        local = sum(
            t.to_local().numel() if isinstance(t, DTensor) else t.numel()
            for t in pl_module.state_dict().values()
        )
        local += sum(
            v.to_local().numel() if isinstance(v, DTensor) else v.numel()
            for st in opt.state.values()
            for v in st.values()
            if torch.is_tensor(v)
        )
        unlike = [  # state of a DTensor parameter that is not a DTensor on its mesh and placements
            names[id(p)]
            for p, st in opt.state.items()
            for v in st.values()
            if isinstance(p, DTensor)
            and v.shape == p.shape
            and not (
                isinstance(v, DTensor) and v.device_mesh == p.device_mesh and v.placements == p.placements
            )
        ]
        self.loaded = {
            "local_elements": local,
            "kept": sorted(names[id(p)] for p in opt.state),
            "owned": sorted(n for n, p in pl_module.named_parameters() if keeps_state(opt, p)),
            "unlike_parameter": unlike,
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.consolidated is not None and trainer.global_step == RESUME_AT:
            strategy = trainer.strategy
            chosen, strategy.checkpoint_format = strategy.checkpoint_format, "consolidated"
            trainer.save_checkpoint(self.consolidated)
            strategy.checkpoint_format = chosen

    def on_train_end(self, trainer, pl_module):
        report = {
            "gathers": self.gathers,
            "saves": self.saves,
            "read_elements": self.read_elements,
            **getattr(self, "loaded", {}),
        }
        (self.out / f"probe_{trainer.global_rank}.json").write_text(json.dumps(report))


def _probes(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"probe_{r}.json").read_text()) for r in range(world)]


RESUME_AT, RESUME_TO = 3, 6


def _check_resumed(out: Path, world: int, what: str) -> None:
    """Parameters and the logged losses of steps 3-5 of a resumed run equal one process's to 1e-10."""
    expected, losses, _ = _reference(RESUME_TO, tied=False)
    worst_param = worst_loss = 0.0
    for r in range(world):
        got = torch.load(out / f"params_{r}.pt")
        worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
        rows = json.loads((out / f"report_{r}.json").read_text())["rows"]
        assert [row["step"] for row in rows] == list(range(RESUME_AT, RESUME_TO))
        worst_loss = max(worst_loss, max(abs(row["logged"] - losses[row["step"]]) for row in rows))
    print(f"resume {what}: max parameter difference {worst_param:.3e}, loss {worst_loss:.3e}")
    assert worst_param <= TOLERANCE and worst_loss <= TOLERANCE, (what, worst_param, worst_loss)


def _resume(
    tmp_path: Path,
    module: type[TPLM],
    worlds: tuple[tuple[str, int, dict], ...],
    checkpoint_format: str = "consolidated",
    consolidated: Path | None = None,
    **save_options,
) -> Path:
    """Three steps on (2, 2) with a checkpoint, then to six steps from it on each of ``worlds``; the checkpoint."""
    total = RESUME_TO
    first = tmp_path / "first"
    probe = CheckpointProbe(first, consolidated)
    _fit(
        first, 4, steps=RESUME_AT, tied=False, module=module, data_steps=total, ckpt_every=RESUME_AT,
        checkpoint_format=checkpoint_format, extra_callbacks=(probe,), **save_options,
    )  # fmt: skip
    (ckpt,) = (first / "ckpt").glob("*.ckpt")
    sharded = checkpoint_format != "consolidated"
    assert is_sharded_checkpoint(ckpt) == sharded
    for rep in _probes(first, 4):  # a consolidated save gathers (the probe sees it); a sharded one must not
        assert (rep["gathers"][f"save {ckpt.name}"] == 0) == sharded, rep["gathers"]
    print(f"DTensor redistributions per save on rank 0: {_probes(first, 4)[0]['gathers']}")
    for r, rep in enumerate(_probes(first, 4)):  # a consolidated save: whole tensors on rank 0's host only
        for name, save in rep["saves"].items():
            if sharded and (consolidated is None or name != f"save {consolidated.name}"):
                continue
            print(f"rank {r} {name}: {save}")
            if r == 0:  # the whole model and the optimizer state
                assert save["in_checkpoint"] > save["whole_model"], save
            else:  # nothing kept; while gathering, one whole tensor at a time (and the collective's buffer)
                assert save["in_checkpoint"] == 0, save
                assert save["peak"] <= 3 * save["largest_whole"] + save["lane_state"], save
                assert 3 * save["largest_whole"] < save["whole_model"], save
    for name, world, options in worlds:
        out = tmp_path / name
        _fit(
            out, world, steps=total, tied=False, module=module, data_steps=total, resume=ckpt,
            extra_callbacks=(CheckpointProbe(out),), **options,
        )  # fmt: skip
        _check_resumed(out, world, f"{module.__name__} {checkpoint_format} (2, 2) -> {name}")
        for rep in _probes(out, world):
            assert rep["kept"] == rep["owned"], "a rank must keep the optimizer state of what it owns, only"
            assert rep["unlike_parameter"] == [], rep["unlike_parameter"]
            if sharded:  # no gather, and each rank reads its own shards' elements, not whole tensors
                assert rep["gathers"]["load"] == 0, rep["gathers"]
                assert rep["read_elements"] == rep["local_elements"], rep
        if sharded and world == 4 and not options:
            total_elements = sum(
                math.prod(md.size) for md in FileSystemReader(ckpt).read_metadata().state_dict_metadata.values()
                if hasattr(md, "size")
            )  # fmt: skip
            assert all(rep["read_elements"] < total_elements for rep in _probes(out, world))
            read = [rep["read_elements"] for rep in _probes(out, world)]
            print(f"{name}: tensor elements read per rank {read} of the folder's {total_elements}")
    return ckpt


@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_resume_is_exact_on_the_same_and_another_mesh(tmp_path, checkpoint_format):
    worlds = (("2x2", 4, {}), ("1x2", 2, {}))
    consolidated = tmp_path / "consolidated.ckpt" if checkpoint_format == "sharded" else None
    if checkpoint_format == "sharded":
        worlds += (
            ("2x2-zero1", 4, {"zero": 1}),
        )  # a folder written without ZeRO, each owner reading its part
    folder = _resume(tmp_path, TPLM, worlds, checkpoint_format, consolidated)
    if consolidated is None:
        return
    # without a process group the folder reads whole, equal to the consolidated save of the same state
    whole = torch.load(consolidated, weights_only=False)
    read = read_consolidated(folder)
    assert read["state_dict"].keys() == whole["state_dict"].keys()
    for k, v in whole["state_dict"].items():
        assert not isinstance(read["state_dict"][k], DTensor) and torch.equal(read["state_dict"][k], v), k
    (groups,) = read["optimizer_states"][0]["param_groups"]
    order = whole["optimizer_states"][0]["param_groups"][0]["params"]  # parameter names (torch's full state)
    assert len(groups["params"]) == len(order)
    by_name = dict(zip(order, groups["params"]))
    for name, state in whole["optimizer_states"][0]["state"].items():
        mine = read["optimizer_states"][0]["state"][by_name[name]]
        assert mine.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(mine[key], value), (name, key)
    assert main([str(folder), str(tmp_path / "exported.ckpt")]) == 0
    exported = torch.load(tmp_path / "exported.ckpt", weights_only=False)
    for k, v in whole["state_dict"].items():
        assert torch.equal(exported["state_dict"][k], v), k
    # the exported file (optimizer state indexed, as PyTorch saves it) resumes a TP run too
    out = tmp_path / "from-exported-1x2"
    _fit(out, 2, steps=RESUME_TO, tied=False, data_steps=RESUME_TO, resume=tmp_path / "exported.ckpt")
    _check_resumed(out, 2, "TPLM exported (2, 2) -> 1x2")
    default = torch.get_default_dtype()
    torch.set_default_dtype(
        torch.float64
    )  # the module as the float64 run built it, so the values fit exactly
    try:
        loaded = TPLM.load_from_checkpoint(folder, tied=False)
    finally:
        torch.set_default_dtype(default)
    for k, v in whole["state_dict"].items():
        assert torch.equal(loaded.state_dict()[k], v), k


@pytest.mark.parametrize("checkpoint_format", ["consolidated", "auto"])
def test_resume_with_fsdp2_is_exact(tmp_path, checkpoint_format):
    """``"auto"`` with FSDP2 is a sharded folder: each rank writes and reads its shards of both dimensions."""
    _resume(tmp_path, TPFSDPLM, (("2x2", 4, {}),), checkpoint_format)


# ----------------------------------------------------------------------------- refusals (no processes)
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be a positive integer"),
    ],
)
def test_construction_refuses_what_tp_cannot_run(options, match):
    with pytest.raises(ConfigError, match=match):
        ByteScaleStrategy(**options)


def test_auto_checkpoints_are_sharded_with_tp_when_the_hdp_ranks_hold_different_state():
    from types import SimpleNamespace

    strategy = ByteScaleStrategy(tensor_parallel_size=2)
    strategy.parallel_mesh = SimpleNamespace()
    assert not strategy.sharded_checkpoints  # plain TP: every HDP rank of a lane holds the same state
    strategy.fsdp = object()  # FSDP2 splits it over the HDP ranks
    assert strategy.sharded_checkpoints
    assert ByteScaleStrategy(tensor_parallel_size=2, checkpoint_format="sharded").sharded_checkpoints


def test_trainer_refuses_a_tp_size_that_does_not_divide_the_world():
    from lightning_bytescale.lightning.mesh import check_world
    from lightning_bytescale.parallel import ParallelDimsError

    with pytest.raises(ParallelDimsError, match=r"tensor_parallel_size=2 does not divide the world of 3"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=ByteScaleStrategy(tensor_parallel_size=2), **QUIET)
    with pytest.raises(ParallelDimsError, match=r"larger than the 2 ranks of a node"):
        check_world(4, num_processes=2, num_nodes=2)  # 2 nodes of 2: a TP group would span both
    with pytest.raises(ParallelDimsError, match=r"does not divide the 6 ranks of a node"):
        check_world(4, num_processes=6, num_nodes=2)
    assert check_world(2, num_processes=4, num_nodes=2).data_parallel == 4


def test_default_builds_no_mesh():
    strategy = ByteScaleStrategy()
    assert strategy.tensor_parallel_size == 1 and strategy.parallel_mesh is None


def test_datamodule_plans_for_hdp_ranks_and_reads_its_hdp_ranks_share_with_the_lanes_ring_ranks(tmp_path):
    """Under tensor_parallel_size=2 on 4 ranks, global rank 3 is HDP rank 1 of 2, lane 1 (rings with 1 and 3)."""
    from types import SimpleNamespace

    from lightning_bytescale import ByteScaleDataModule
    from lightning_bytescale.parallel import ParallelDims

    dims = ParallelDims(4, tensor_parallel=2)
    pmesh = SimpleNamespace(dims=dims, hdp_rank=dims.hdp_rank(3), lane=1, ring_ranks=dims.lane_ranks(1))
    strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=96)
    strategy.parallel_mesh = pmesh
    dm = ByteScaleDataModule(
        source={"kind": "synthetic", "name": "github", "num_samples": 120, "scale": 1 / 256},
        cache_dir=tmp_path / "cache",
        tokens_per_step=512,
        num_workers=0,
    )
    dm.prepare_data()
    dm.trainer = SimpleNamespace(global_rank=3, world_size=4, strategy=strategy, overfit_batches=0)
    assert (dm.rank, dm.world_size) == (1, 2)
    dm.setup("fit")
    assert dm.pool_tokens(None) == 2 * 96  # capacity is per HDP rank
    loader = dm.train_dataloader()
    dataset = loader.dataset
    assert (dataset.rank, dataset.world_size, dataset.ring_ranks) == (1, 2, (1, 3))
    batch = next(iter(loader))
    assert batch.stats["world_size"] == 2
    for mb in batch.micro_batches:
        assert mb.layout.ring is None or set(mb.layout.ring) <= {1, 3}


@pytest.mark.parametrize(("given", "expected"), [(8, 4), (None, 4), (1, 1)])
def test_the_planner_counts_hdp_ranks_per_node_as_the_simulator_does(given, expected):
    """ranks_per_node counts devices; with tensor_parallel_size=2 a node holds half as many HDP ranks."""
    from types import SimpleNamespace

    from lightning_bytescale import ByteScaleDataModule
    from lightning_bytescale.parallel import ParallelDims
    from lightning_bytescale.planner.cost_model import CostModel
    from lightning_bytescale.sim.scenario import get_scenario

    dims = ParallelDims(16, tensor_parallel=2, ranks_per_node=8)
    strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=96, ranks_per_node=given)
    strategy.parallel_mesh = SimpleNamespace(dims=dims, hdp_rank=0, lane=0, ring_ranks=dims.lane_ranks(0))
    dm = ByteScaleDataModule(source="github", num_workers=0)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=16, strategy=strategy, overfit_batches=0)
    assert CostModel.paper_preset().ranks_per_node == 8  # what None falls back to
    assert dm.planner_options()["ranks_per_node"] == expected
    assert dm.world_size == dims.data_parallel
    if given == 8:
        scenario = get_scenario("paper-7b-github-2m").with_(gpus=16, gpus_per_node=8, tensor_parallel=2)
        assert (scenario.ranks, scenario.ranks_per_node) == (dm.world_size, expected)
