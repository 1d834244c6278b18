"""Every layout from the recipes (issue 37, item 2), in one process.

* the layout keys are schema keys (``strategy.tensor_parallel_size``, ``strategy.pipeline_parallel_size``,
  ``model.fsdp``, ``model.tensor_parallel`` for Hugging Face models) and the presets use them;
* ``PretrainModule.configure_model`` lays the model out on the strategy's mesh itself, checked on
  a fake process group of 4 ranks (no data moves; the placements and the stage are what count):
  TP shards the projections column- and row-wise, FSDP2 adds the data-parallel dimension, a
  pipeline keeps this rank's stage;
* a layout the model cannot take is refused before launch, and an unknown ``+strategy.*`` or
  ``+model.*`` key gets the same "did you mean" line as a misspelt key.

The runs of ``bytescale-train`` on 4 ranks are in ``test_recipe_layout_runs.py``.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _fake_pg import fake_world
from torch.distributed.tensor import DTensor, Shard

from lightning_bytescale.cli.train import added_key_error, override_typo
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.parallel import LlamaStage, PipelineModelError, TensorParallelHeadsError
from lightning_bytescale.recipes.config import compose_pretrain
from lightning_bytescale.recipes.module import PretrainModule


def _compose(*overrides: str):
    return compose_pretrain([*overrides, "run_dir=/tmp/unused"], hydra_config=False)


def test_the_layout_keys_are_schema_keys_and_the_presets_use_them():
    cfg = _compose(
        "experiment=cpu_smoke", "strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=1"
    )
    assert cfg.strategy.tensor_parallel_size == 2 and cfg.model.fsdp is False
    tp, pp = _compose("experiment=cpu_smoke_tp"), _compose("experiment=cpu_smoke_pp")
    assert (tp.strategy.tensor_parallel_size, tp.trainer.devices, tp.model.preset) == (2, 4, "tiny")
    assert (pp.strategy.pipeline_parallel_size, pp.trainer.devices, pp.model.preset) == (2, 4, "tiny")
    for size in ("256k", "512k", "1m", "2m"):  # the paper's d_tp = 2
        assert _compose(f"experiment=paper_7b_{size}").strategy.tensor_parallel_size == 2
    hf = _compose("model=hf", "model.name_or_path=llama")
    assert hf.model.tensor_parallel is None  # follows the strategy


@contextmanager
def _fake_world(world: int = 4):
    """A fake process group of ``world`` ranks in this process (this is rank 0): meshes and DTensors
    build, collectives do nothing.  Left through ``tests/_fake_pg.py``, which also forgets the
    meshes DTensor cached on it (ranks a later test forks from this process would inherit them)."""
    assert not dist.is_initialized()
    with fake_world() as join:
        join(0, world)
        yield


def _laid_out(module: PretrainModule, dims: dict[str, int]) -> PretrainModule:
    """``module.configure_model()`` as the strategy calls it: the mesh set, a trainer attached."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    module._trainer = SimpleNamespace()  # configure_model reads the mesh only under a trainer
    module._device_mesh = mesh
    module.configure_model()
    return module


def _placements(module: PretrainModule) -> dict[str, tuple]:
    return {n: tuple(p.placements) for n, p in module.named_parameters() if isinstance(p, DTensor)}


def test_tensor_parallelism_shards_the_projections_over_the_lanes():
    with _fake_world():
        module = _laid_out(
            PretrainModule(preset="tiny", vocab=257), {"data_parallel": 2, "tensor_parallel": 2}
        )
        found = _placements(module)
    assert found["model.blocks.0.attn.wq.weight"] == (Shard(0),)  # ColwiseParallel
    assert found["model.blocks.0.attn.wk.weight"] == (Shard(0),)
    assert found["model.blocks.1.attn.wo.weight"] == (Shard(1),)  # RowwiseParallel
    assert found["model.blocks.1.mlp.w2.weight"] == (Shard(1),)
    assert found["model.blocks.0.mlp.w1.weight"] == (Shard(0),)
    assert found["model.lm_head.weight"] == (Shard(0),)  # the head, its logits gathered
    assert found["model.embed.weight"] == (Shard(0),)  # untied: the vocabulary sharded
    norms = [n for n, p in module.named_parameters() if "norm" in n]
    assert norms and not any(n in found for n in norms)  # norms stay plain replicated tensors
    local = module.model.blocks[0].attn.wq.weight.to_local()
    assert local.shape[0] * 2 == module.model.blocks[0].attn.wq.weight.shape[0]


def test_fsdp_adds_the_data_parallel_dimension_around_the_tp_shards():
    with _fake_world():
        module = _laid_out(
            PretrainModule(preset="tiny", vocab=257, fsdp=True), {"data_parallel": 2, "tensor_parallel": 2}
        )
        found = _placements(module)
        meshes = {n: tuple(p.device_mesh.mesh_dim_names) for n, p in module.named_parameters()}
    wq, wo, norm = (found[f"model.{n}.weight"] for n in ("blocks.0.attn.wq", "blocks.0.attn.wo", "norm"))
    # FSDP2 over the data-parallel ranks (a _StridedShard over TP's column shards), then TP's own shards
    assert meshes["model.blocks.0.attn.wq.weight"] == ("data_parallel", "tensor_parallel")
    assert wq[0].dim == 0 and wq[1] == Shard(0)
    assert wo[0].dim == 0 and wo[1] == Shard(1)
    assert meshes["model.norm.weight"] == ("data_parallel",) and norm == (Shard(0),)  # FSDP2 only
    assert len(found) == len(meshes)  # every parameter is a DTensor


def test_a_pipeline_keeps_this_ranks_stage():
    with _fake_world():
        module = _laid_out(
            PretrainModule(preset="tiny", vocab=257),
            {"pipeline": 2, "data_parallel": 2, "tensor_parallel": 1},
        )
    assert isinstance(module.model, LlamaStage)
    assert (module.model.stage, module.model.stages) == (0, 2)  # global rank 0 is stage 0
    names = {n for n, _ in module.named_parameters()}
    assert any(n.startswith("model.blocks.0.") for n in names)
    assert not any(n.startswith("model.blocks.1.") for n in names)  # stage 1's block
    with pytest.raises(ConfigError, match="stage 0 of 2 of its model"):
        module(torch.zeros(4, dtype=torch.long))


def test_a_layout_the_model_cannot_take_is_refused_by_name():
    module = PretrainModule(preset="tiny", vocab=257)  # 4 heads, 2 key/value heads, 2 blocks, untied
    module.check_layout(tensor_parallel=2, pipeline=2)
    with pytest.raises(TensorParallelHeadsError, match="tensor_parallel_size in"):
        module.check_layout(tensor_parallel=4)
    with pytest.raises(PipelineModelError, match="more stages than the model's 2 blocks"):
        module.check_layout(pipeline=3)
    with pytest.raises(PipelineModelError, match="tie_embeddings=false"):
        PretrainModule(preset="tiny", overrides={"tie_embeddings": True}).check_layout(pipeline=2)
    fsdp = PretrainModule(preset="tiny", fsdp=True)
    with pytest.raises(ConfigError, match="strategy.tensor_parallel_size=2"):
        fsdp.check_layout()
    with pytest.raises(ConfigError, match="not supported with pipeline_parallel_size=2"):
        fsdp.check_layout(tensor_parallel=2, pipeline=2)


def test_the_recipe_checks_the_layout_before_launch(tmp_path):
    from lightning_bytescale.cli.train import _before_launch_error, build

    cfg = compose_pretrain(
        ["experiment=cpu_smoke", "strategy.tensor_parallel_size=4", "trainer.devices=4", "~logger",
         f"run_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}"],
        hydra_config=False,
    )  # fmt: skip
    with pytest.raises(TensorParallelHeadsError) as err:
        build(cfg)
    assert "4 attention heads" not in _before_launch_error(err.value)  # tiny has 4 heads: its 2 KV heads fail
    assert "key/value heads" in _before_launch_error(err.value)


def test_a_hugging_face_model_follows_the_strategys_tensor_parallelism():
    from lightning_bytescale.cli.train import _model_for_layout

    tp2, tp1 = SimpleNamespace(tensor_parallel_size=2), SimpleNamespace(tensor_parallel_size=1)
    assert _model_for_layout({"tensor_parallel": None}, tp2)["tensor_parallel"] is True
    assert _model_for_layout({"tensor_parallel": None}, tp1)["tensor_parallel"] is False
    with pytest.raises(ConfigError, match="every lane of an HDP rank would run the whole model"):
        _model_for_layout({"tensor_parallel": False}, tp2)
    with pytest.raises(ConfigError, match="needs strategy.tensor_parallel_size > 1"):
        _model_for_layout({"tensor_parallel": True}, tp1)
    assert _model_for_layout({"preset": "tiny"}, tp2) == {"preset": "tiny"}  # the reference Llama has none


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["+strategy.tensor_paralel_size=2"],
         "strategy.tensor_paralel_size is not a key of the strategy config (StrategyConfig): did you mean "
         "strategy.tensor_parallel_size? (strategy.tensor_parallel_size=2)"),
        (["+strategy.plannr=static"],
         "strategy.plannr is not a key of the strategy config (StrategyConfig): did you mean strategy.planner? "
         "(strategy.planner=static)"),
        (["+model.tensor_parallel=true"],
         "model.tensor_parallel is not a key of the model config (ModelConfig): did you mean "
         "strategy.tensor_parallel_size? (strategy.tensor_parallel_size=2)"),
        (["+strategy.fsdp=true"],
         "strategy.fsdp is not a key of the strategy config (StrategyConfig): did you mean model.fsdp? "
         "(model.fsdp=true)"),
        (["+strategy.gradient_sylc=flat"],
         "strategy.gradient_sylc is not a key of the strategy config (StrategyConfig): did you mean "
         "strategy.gradient_sync? (+strategy.gradient_sync=flat)"),
    ],
)  # fmt: skip
def test_an_unknown_added_key_gets_the_did_you_mean_line_of_a_typo(args, line):
    assert added_key_error(args) == line


def test_added_keys_the_target_takes_are_left_alone():
    for args in (
        ["+strategy.gradient_sync=flat"],  # a ByteScaleStrategy argument the schema does not list
        ["+model.overrides.layers=3"],  # a key under a dict field
        ["model=hf", "model.name_or_path=llama", "+model.config_overrides.num_hidden_layers=2"],
        ["strategy.tensor_parallel_size=2"],  # no +
    ):
        assert added_key_error(args) is None, args
    nothing = added_key_error(["+strategy.zzzq=1"])
    assert nothing.startswith(
        "strategy.zzzq is not a key of the strategy config (StrategyConfig) nor an argument"
    )
    assert "tensor_parallel_size" in nothing  # it lists the keys
    assert override_typo(["strategy.tensor_paralel_size=2"]).endswith(
        "did you mean strategy.tensor_parallel_size? (strategy.tensor_parallel_size=2)"
    )
