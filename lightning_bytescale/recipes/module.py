"""The LightningModule the recipes train: the reference Llama on packed micro-batches.

``training_step(mb, batch_idx)`` receives one :class:`PackedMicroBatch` (the strategy runs the
rank's micro-batches and installs each one's attention layout) and returns
``token_loss(logits, mb.labels, mb.num_global_tokens)``: the micro-batch's share of the global
token-mean loss.  The model is built in ``configure_model`` so that large presets are created
directly on the device.  ``train_flops(lengths)`` feeds the telemetry's MFU estimate.

The module lays itself out on the strategy's mesh, so a recipe user changes only overrides
(``strategy.tensor_parallel_size``, ``strategy.pipeline_parallel_size``, ``model.fsdp``): in
``configure_model`` it shards the model over ``device_mesh["tensor_parallel"]`` with
:func:`~lightning_bytescale.parallel.parallelize_llama`, applies FSDP2 over
``device_mesh["data_parallel"]`` when ``fsdp=True``, and with pipelines replaces the model by this
rank's :class:`~lightning_bytescale.parallel.LlamaStage` (TP before the split), as
docs/tensor-parallel.md and docs/pipelines.md show for a module of one's own.
:meth:`PretrainModule.check_layout` refuses a layout the model cannot take before any process starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.distributed.fsdp import fully_shard

from lightning_bytescale.engine.batch import PackedMicroBatch
from lightning_bytescale.engine.loss import token_loss
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.lightning.compat import module_trainer
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.parallel import LlamaStage, PipelineModelError, check_heads, parallelize_llama

__all__ = ["PretrainModule", "warmup_cosine"]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PretrainModule(LightningModule):
    """Next-token pretraining of :class:`~lightning_bytescale.models.llama.LlamaModel`.

    Args:
        preset: a :meth:`LlamaConfig.preset` name (``tiny`` ... ``70b``).
        vocab: vocabulary size; None keeps the preset's (the recipe sets the tokenizer's).
        overrides: other :class:`LlamaConfig` fields, e.g. ``{"layers": 4}``.
        lr, weight_decay, betas: AdamW; weight decay applies to matrices only.
        warmup_steps, min_lr_ratio: the warm-up + cosine schedule over ``trainer.max_steps``.
        fsdp: FSDP2 (``fully_shard(..., reshard_after_forward=False)`` on every block, then the
            model) over the HDP ranks, ``device_mesh["data_parallel"]``; needs
            ``ByteScaleStrategy(tensor_parallel_size > 1)`` (the strategy builds a mesh only then)
            and no pipelines.
    """

    def __init__(
        self,
        preset: str = "tiny",
        vocab: int | None = None,
        overrides: dict[str, Any] | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        fsdp: bool = False,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ConfigError(f"lr must be positive, got {lr}")
        if len(betas) != 2:
            raise ConfigError(f"betas must be two numbers (beta1, beta2), got {list(betas)}")
        extra = dict(overrides or {})
        if vocab is not None:
            extra["vocab"] = int(vocab)
        self.config = LlamaConfig.preset(preset, **extra)  # validates the shape now, not at fit
        self.save_hyperparameters({"preset": preset, "model_config": vars(self.config).copy()})
        self.lr, self.weight_decay, self.betas = (
            float(lr),
            float(weight_decay),
            tuple(float(b) for b in betas),
        )
        self.warmup_steps, self.min_lr_ratio = int(warmup_steps), float(min_lr_ratio)
        self.fsdp = bool(fsdp)
        self._preset = preset
        self.model: LlamaModel | LlamaStage | None = None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (rows of its embedding): the data module checks its ids against it."""
        return int(self.config.vocab)

    def check_layout(self, tensor_parallel: int = 1, pipeline: int = 1) -> None:
        """Refuse a layout this model cannot take, naming the fix (the recipe calls it before launch).

        Tensor parallelism needs heads and key/value heads that ``tensor_parallel`` divides;
        pipeline stages need untied embeddings and at least one block per stage; ``fsdp`` needs
        tensor parallelism and no pipelines.
        """
        config = self.config
        if tensor_parallel > 1:
            check_heads(config.heads, config.kv_heads, tensor_parallel, model=f"the {self._preset} model")
        if pipeline > 1 and config.tie_embeddings:
            raise PipelineModelError(
                f"pipeline_parallel_size={pipeline}: the model ({self._shape()}) ties its input embedding to its "
                "output head, which the first and the last stage would both hold; untie them "
                "(model.overrides.tie_embeddings=false in the recipe) or use pipeline_parallel_size=1"
            )
        if pipeline > config.layers:
            raise PipelineModelError(
                f"pipeline_parallel_size={pipeline} is more stages than the model's {config.layers} blocks "
                f"({self._shape()}); use at most {config.layers} stages or a deeper model (model.overrides.layers)"
            )
        if self.fsdp and tensor_parallel == 1:
            raise ConfigError(
                "fsdp=True (model.fsdp) shards over the mesh's data_parallel dimension, which the strategy builds "
                "only with tensor_parallel_size > 1 (FSDP2 without TP is not built yet); set "
                "strategy.tensor_parallel_size=2 (or more), or use strategy.zero=1 to shard the optimizer state"
            )
        if self.fsdp and pipeline > 1:
            raise ConfigError(
                f"fsdp=True (model.fsdp) is not supported with pipeline_parallel_size={pipeline}: each stage already "
                "holds only its own blocks; drop model.fsdp (strategy.zero=1 shards a stage's optimizer state)"
            )

    def _shape(self) -> str:
        c = self.config
        return f"{c.layers} blocks, {c.heads} heads, {c.kv_heads} key/value heads"

    def configure_model(self) -> None:
        """Build the model, then lay it out on the strategy's mesh (module docstring); once."""
        if self.model is not None:
            return
        model = LlamaModel(self.config)
        mesh = self._layout_mesh()
        if mesh is None:  # one process, or a strategy without a mesh: the whole model
            if self.fsdp and module_trainer(self) is not None:
                self.check_layout()  # refuses fsdp without tensor parallelism
            self.model = model
            return
        names = mesh.mesh_dim_names or ()
        tp = mesh["tensor_parallel"]
        pipeline = mesh["pipeline"] if "pipeline" in names else None
        stages = pipeline.size() if pipeline is not None else 1
        self.check_layout(tensor_parallel=tp.size(), pipeline=stages)
        if tp.size() > 1:
            parallelize_llama(model, tp)
        if self.fsdp:
            dp = mesh["data_parallel"]
            for block in model.blocks:
                fully_shard(block, mesh=dp, reshard_after_forward=False)
            fully_shard(model, mesh=dp, reshard_after_forward=False)
        self.model = LlamaStage(model, pipeline.get_local_rank(), stages) if stages > 1 else model

    def _layout_mesh(self) -> Any:
        """The strategy's mesh (``ByteScaleStrategy(tensor_parallel_size or pipeline_parallel_size > 1)``), else None."""
        if module_trainer(self) is None:
            return None  # e.g. load_from_checkpoint in one process: the model stays whole
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return None
        return mesh

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.configure_model()
        if not isinstance(self.model, LlamaModel):
            raise ConfigError(
                f"this module holds stage {self.model.stage} of {self.model.stages} of its model "  # type: ignore[union-attr]
                "(pipeline_parallel_size > 1), which has no forward of its own: the strategy runs the stages"
            )
        return self.model(input_ids, position_ids)

    def training_step(self, mb: PackedMicroBatch, batch_idx: int) -> torch.Tensor:
        logits = self(mb.input_ids, mb.position_ids)
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    def validation_step(self, mb: PackedMicroBatch, batch_idx: int) -> torch.Tensor:
        return self.training_step(mb, batch_idx)

    def train_flops(self, lengths: Sequence[int]) -> float:
        """Forward+backward model FLOPs for a global batch of sequences with these lengths."""
        return float(sum(s * self.config.flops_per_token(s) for s in lengths))

    def configure_optimizers(self) -> Any:
        self.configure_model()
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        total = int(self.trainer.max_steps) if self.trainer.max_steps and self.trainer.max_steps > 0 else 0
        warmup, floor = self.warmup_steps, self.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, warmup, total, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
