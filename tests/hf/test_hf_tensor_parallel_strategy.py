"""``HFCausalLM(tensor_parallel=True)`` under ``ByteScaleStrategy(tensor_parallel_size=2)`` on 4 ranks, against one process.

A tiny Qwen3 (per-head ``q_norm`` / ``k_norm``: the plan's ``replicated_with_grad_allreduce``
style) saved as a checkpoint and loaded by global rank 0 only (``load_on="rank_zero"``: the other
ranks build it empty and receive rank 0's whole weights before sharding), float64, sharded in
``configure_model`` by transformers' own plan
(``parallelize_hf`` over ``device_mesh["tensor_parallel"]``), trained with the balance planner and
rings for four steps (one in which HDP rank 1 runs no micro-batch), clipping in every step.  The
reference loads the same checkpoint in one process with ``"sdpa"`` attention on each whole sequence, the same AdamW parameter groups.  Parameters and
logged losses must agree to 1e-10.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")

from _hf_strategy import fit_hf, hf_reference  # noqa: E402
from _strategy_helpers import global_batch  # noqa: E402
from test_hf_families import tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_bytescale import ByteScaleStrategy  # noqa: E402
from lightning_bytescale.engine.micro_batch import build_step  # noqa: E402
from lightning_bytescale.hf import HFCausalLM  # noqa: E402
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CAPACITY = 24
STEPS = 4
IDLE_STEP = 2
OPTIM = {"lr": 1e-2, "weight_decay": 0.1, "max_norm": 0.05}
FAMILY = "qwen3"


def _plan(k: int, lengths: list[int]) -> Plan:
    from lightning_bytescale.planner import make_plan

    if k == IDLE_STEP:  # HDP rank 0 runs everything, HDP rank 1 nothing
        mbs = [MicroBatch([Piece(j, ((0, n),))]) for j, n in enumerate(lengths)]
        return Plan(
            world_size=2, capacity=48, planner="hand", lengths=tuple(lengths), ranks=[mbs, []]
        ).validate()
    return make_plan(tuple(lengths), world_size=2, capacity=CAPACITY, planner="balance", seed=k)


def _step(pmesh, k: int):
    seqs = global_batch(k)
    plan = _plan(k, [len(s) for s in seqs])
    return build_step(plan, pmesh.hdp_rank, lambda j: seqs[j], step=k, ring_ranks=pmesh.ring_ranks)


def _full(module) -> dict[str, torch.Tensor]:
    from lightning_bytescale.lightning.mesh import full_state_dict

    return {k: v.detach().clone() for k, v in full_state_dict(module).items()}


def _bytes(t: torch.Tensor, whole: bool) -> int:
    from torch.distributed.tensor import DTensor

    local = t if whole or not isinstance(t, DTensor) else t.to_local()
    return local.numel() * local.element_size()


class Recorder(pl.Callback):
    """Per rank: the tensor memory ``configure_model`` held at its peak and the weights it left, the losses, the final weights."""

    def __init__(self, out: Path) -> None:
        self.out, self.losses = out, []

    def setup(self, trainer, pl_module, stage):  # before the Trainer calls configure_model
        from _live_bytes import LiveBytes

        configure, r = pl_module.configure_model, trainer.global_rank

        def measured() -> None:
            with LiveBytes() as live:
                configure()
            model = pl_module.model
            tensors = list({id(t): t for t in (*model.parameters(), *model.buffers())}.values())
            self.memory = {
                "peak": live.peak,
                "held": live.live,
                "shards": sum(_bytes(t, whole=False) for t in tensors),
                "whole_model": sum(_bytes(t, whole=True) for t in tensors),
                "largest_whole": max(_bytes(t, whole=True) for t in tensors),
            }
            torch.save(_full(pl_module), self.out / f"start_{r}.pt")  # before the strategy's broadcast

        pl_module.configure_model = measured

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        self.sharded = sum(isinstance(p, DTensor) for p in pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_end(self, trainer, pl_module):
        final = _full(pl_module)
        r = trainer.global_rank
        torch.save(final, self.out / f"final_{r}.pt")
        (self.out / f"report_{r}.json").write_text(
            json.dumps({"losses": self.losses, "sharded": self.sharded, "memory": self.memory})
        )


def _checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(FAMILY), dtype=torch.float64).save_pretrained(path)
    return path


def test_hf_qwen3_with_transformers_tp_plan_under_the_strategy_equals_one_process(tmp_path):
    path = _checkpoint(tmp_path / "checkpoint")
    strategy = ByteScaleStrategy(tensor_parallel_size=2, capacity=CAPACITY, start_method="fork", timeout=120)
    fit_hf(tmp_path, path, strategy, Recorder(tmp_path), STEPS, _step, tensor_parallel=True, **OPTIM)
    expected, losses = hf_reference(path, STEPS, **OPTIM)
    initial = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).state_dict()
    worst_param = worst_loss = 0.0
    for r in range(4):
        got = torch.load(tmp_path / f"final_{r}.pt")
        rep = json.loads((tmp_path / f"report_{r}.json").read_text())
        start = torch.load(
            tmp_path / f"start_{r}.pt"
        )  # as configure_model left it: the checkpoint's, exactly
        assert start.keys() == {f"model.{k}" for k in initial}
        assert all(torch.equal(start[f"model.{k}"], v) for k, v in initial.items()), r
        # the model is sharded on the meta device: no rank allocates it whole; rank 0 reads it on its
        # host, the others hold their shards and one whole tensor at a time (and its part while cut)
        memory = rep["memory"]
        print(f"rank {r} configure_model: {memory}")
        if r > 0:
            assert memory["peak"] <= memory["shards"] + 2 * memory["largest_whole"], memory
            assert memory["peak"] < memory["whole_model"], memory
        assert memory["held"] < memory["shards"] + 1024, memory  # no whole tensor left
        assert rep["sharded"] > 0, "parallelize_hf sharded nothing"
        shared = [k for k in expected if k in got]
        assert len(shared) == len(expected)
        worst_param = max(worst_param, max((got[k] - expected[k]).abs().max().item() for k in shared))
        worst_loss = max(worst_loss, max(abs(a - b) for a, b in zip(rep["losses"], losses)))
    print(
        f"HF {FAMILY} (2, 2): max parameter difference {worst_param:.3e}, max loss difference {worst_loss:.3e}"
    )
    assert worst_param <= 1e-10 and worst_loss <= 1e-10, (worst_param, worst_loss)


def test_tensor_parallel_without_a_mesh_is_refused():
    from lightning_bytescale.errors import ConfigError

    module = HFCausalLM(tiny_config(FAMILY), dtype=torch.float64, tensor_parallel=True)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=N"):
        module.configure_model()
