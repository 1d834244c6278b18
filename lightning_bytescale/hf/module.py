"""`HFCausalLM`: fine-tune a Hugging Face causal LM under ``ByteScaleStrategy``.

The LightningModule a user needs for an HF model: it builds or loads the model in
``configure_model`` with ``attn_implementation="bytescale"``, refuses configs the packed
attention would train wrongly (:mod:`.checks`), feeds each packed micro-batch as
``input_ids [1, T]`` / ``position_ids [1, T]`` and returns ``mb.loss(logits)``: the token loss
over the global token count, so training equals one process on the whole batch.

Loading a checkpoint on N ranks: under ``ByteScaleStrategy`` only global rank 0 reads the
checkpoint files; the other ranks build the same model from its config with uninitialised
weights, and the strategy's broadcast of rank 0's parameters and buffers (right after
``configure_model``) fills them.  Before that broadcast the ranks compare the structure of
their models (names, shapes, dtypes, tied weights) in one small collective, so a mismatch is a
clear error rather than a broadcast of misaligned buffers.  With ``tensor_parallel=True`` no rank
builds the whole model on its device: the model is sharded on the meta device and the whole
weights stay on a host (:meth:`HFCausalLM._load_shards`).
"""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.hf.attention import (
    ATTN_IMPLEMENTATION,
    layout_from_positions,
    register,
)
from lightning_bytescale.hf.checks import check_config, check_model
from lightning_bytescale.hf.loading import ModelSource
from lightning_bytescale.hf.optim import OptimizerOptions
from lightning_bytescale.lightning import compat
from lightning_bytescale.lightning.strategy import ByteScaleStrategy
from lightning_bytescale.packed_attention import attention_context
from lightning_bytescale.packed_attention.calls import count_attention_calls
from lightning_bytescale.packed_attention.context import current_scope
from lightning_bytescale.parallel import DecoderStage

LOAD_ON = ("rank_zero", "every_rank")


@dataclass
class LoadReport:
    """How this rank got its weights: ``checkpoint``, ``config`` (random init) or ``broadcast``."""

    weights: str
    seconds: float
    rank: int


def _refuse_labels(module: nn.Module, args: tuple, kwargs: dict) -> None:
    if kwargs.get("labels") is not None:
        raise ConfigError(
            "labels= was passed to the Hugging Face model: its built-in loss is a mean over this "
            "micro-batch's tokens, which weights tokens differently on each rank and micro-batch and breaks "
            "the global token normalisation. Call the model without labels and return "
            "mb.loss(logits) (lightning_bytescale.token_loss(logits, mb.labels, mb.num_global_tokens))"
        )


def _checkpointing(model: nn.Module) -> bool:
    """Whether the HF model recomputes layers in backward (the property's v5 and older names)."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else None
    return bool(getattr(model, name or "is_gradient_checkpointing", False))


def structure_digest(model: nn.Module) -> str:
    """A hash of the names, shapes and dtypes of the parameters and buffers, and of which are tied."""
    seen: dict[int, str] = {}
    rows = []
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        rows.append((name, tuple(t.shape), str(t.dtype), seen.setdefault(id(t), name)))
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


class HFCausalLM(pl.LightningModule):
    """A Hugging Face causal LM trained on packed micro-batches.

    ``name_or_path``: a local folder or hub name (its weights are loaded), or with
    ``from_config=True`` a folder/hub name/model type (``"llama"``) whose config is initialised
    from scratch; a ``transformers`` config (or its dict) always builds from config.
    ``config_overrides`` change config fields before the model is built.  ``dtype`` is the
    dtype the weights are built or loaded in (default: the precision plugin's default dtype,
    e.g. float64 under ``precision="64-true"``, float32 under ``"bf16-mixed"``).
    ``load_on="rank_zero"`` (default) reads a checkpoint on global rank 0 only under
    ``ByteScaleStrategy`` (the others receive rank 0's weights); ``"every_rank"`` loads it on
    every rank.  ``tensor_parallel=True`` shards the model over ``device_mesh["tensor_parallel"]``
    with its own plan (:func:`~lightning_bytescale.hf.tensor_parallel.parallelize_hf`) in
    ``configure_model`` while it is on the meta device, so each rank allocates only its shards;
    the whole weights are read (or initialised) on global rank 0's host (``load_on="every_rank"``:
    on every rank's host) and each rank keeps its parts, one tensor at a time; it needs
    ``ByteScaleStrategy(tensor_parallel_size > 1)``.  Under ``ByteScaleStrategy(pipeline_parallel_size=P)``
    ``configure_model`` replaces the model by this rank's
    :class:`~lightning_bytescale.hf.pipeline.HFDecoderStage` (every rank builds or loads the whole
    model first, whatever ``load_on``; docs/pipelines.md).  Optimizer: AdamW with ``lr``, ``weight_decay``, ``betas``, ``eps``,
    ``warmup_steps``, ``schedule`` (``constant``/``linear``/``cosine``) and ``min_lr_ratio``.
    """

    def __init__(
        self,
        name_or_path: Any,
        *,
        from_config: bool = False,
        config_overrides: dict[str, Any] | None = None,
        dtype: torch.dtype | str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        local_files_only: bool | None = None,
        load_on: str = "rank_zero",
        model_kwargs: dict[str, Any] | None = None,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        tensor_parallel: bool = False,
    ) -> None:
        super().__init__()
        if load_on not in LOAD_ON:
            raise ConfigError(f"load_on must be one of {LOAD_ON}, got {load_on!r}")
        self.source = ModelSource(
            name_or_path,
            from_config=from_config,
            config_overrides=dict(config_overrides or {}),
            revision=revision,
            trust_remote_code=trust_remote_code,
            local_files_only=local_files_only,
            model_kwargs=dict(model_kwargs or {}),
        )
        self.optim = OptimizerOptions(
            lr=lr,
            weight_decay=weight_decay,
            betas=tuple(betas),
            eps=eps,
            warmup_steps=warmup_steps,
            schedule=schedule,
            min_lr_ratio=min_lr_ratio,
        )
        self.load_on = load_on
        self.tensor_parallel = bool(tensor_parallel)
        self.weights_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model: nn.Module | None = None
        self.load_report: LoadReport | None = None
        self._attention_layers = 0
        self.save_hyperparameters(ignore=["name_or_path"])
        self.hparams["name_or_path"] = (
            name_or_path.to_dict() if isinstance(name_or_path, PretrainedConfig) else name_or_path
        )

    # ------------------------------------------------------------------ model
    def _broadcast_fills_weights(self) -> bool:
        """Whether this run's strategy gives every rank rank 0's parameters after ``configure_model``."""
        trainer = compat.module_trainer(self)
        if (
            trainer is None
            or trainer.world_size <= 1
            or self.source.from_config
            or self.load_on != "rank_zero"
            or self._pipeline() is not None  # each stage starts from its own HDP rank 0: every rank loads
        ):
            return False
        return isinstance(trainer.strategy, ByteScaleStrategy)

    def configure_model(self) -> None:
        """Build or load the model (once), with ``"bytescale"`` attention, after checking its config."""
        if self.model is not None:
            return
        register()
        config = self.source.config()
        check_config(config, training=True)
        dtype = self.weights_dtype or torch.get_default_dtype()
        rank = self.global_rank
        started = time.perf_counter()
        tp_mesh = self._tensor_parallel_mesh() if self.tensor_parallel else None
        if tp_mesh is not None:  # the structure only: each rank gets its shards below
            with torch.device("meta"):
                model, weights = self.source.build_empty(config, dtype), "broadcast"
        elif self._broadcast_fills_weights() and rank != 0:
            model, weights = self.source.build_empty(config, dtype), "broadcast"
        elif self.source.from_config:
            model, weights = self.source.build(config, dtype), "config"
        else:
            device = self.trainer.strategy.root_device if compat.module_trainer(self) is not None else None
            model, weights = self.source.load(config, dtype, device), "checkpoint"
        check_model(model, training=True)
        model.register_forward_pre_hook(_refuse_labels, with_kwargs=True)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._attention_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        self.model = model
        if tp_mesh is not None:
            weights = self._load_shards(config, dtype, tp_mesh)
        elif self._broadcast_fills_weights():
            self._check_same_structure()
        self.load_report = LoadReport(weights, time.perf_counter() - started, rank)
        pipeline = self._pipeline()
        if pipeline is not None:  # docs/pipelines.md: the model is replaced by this rank's stage
            from lightning_bytescale.hf.pipeline import HFDecoderStage

            self.model = HFDecoderStage(self.model, pipeline.get_local_rank(), pipeline.size())

    def _pipeline(self) -> Any:
        """The ``"pipeline"`` dimension of the device mesh under ``ByteScaleStrategy(pipeline_parallel_size > 1)``."""
        mesh = self.device_mesh if compat.module_trainer(self) is not None else None
        if mesh is None or "pipeline" not in (mesh.mesh_dim_names or ()) or mesh["pipeline"].size() == 1:
            return None
        return mesh["pipeline"]

    def _tensor_parallel_mesh(self) -> Any:
        """``tensor_parallel=True``: the ``"tensor_parallel"`` dimension of the device mesh (a ``ConfigError`` without one)."""
        mesh = self.device_mesh
        if mesh is None:
            raise ConfigError(
                "HFCausalLM(tensor_parallel=True) needs a device mesh with a 'tensor_parallel' dimension: train "
                "it with ByteScaleStrategy(tensor_parallel_size=N), N > 1"
            )
        return mesh["tensor_parallel"]

    def _load_shards(self, config: Any, dtype: torch.dtype, tp_mesh: Any) -> str:
        """``tensor_parallel=True``: shard the meta-device model, give each rank storage for its shards only, fill them.

        The whole weights are read (or, ``from_config``, initialised) on the host, never on a device:
        by global rank 0, whose tensors then travel one at a time and each rank keeps its part, or,
        with ``load_on="every_rank"`` and a checkpoint, by every rank, which keeps its parts of its own
        copy.  Returns how this rank got its weights.
        """
        from lightning_bytescale.hf.tensor_parallel import parallelize_hf
        from lightning_bytescale.parallel.materialize import (
            fill_from_whole,
            named_tensors,
            to_empty_keeping_ties,
        )

        assert self.model is not None
        every_rank = self.load_on == "every_rank" and not self.source.from_config
        distributed = dist.is_available() and dist.is_initialized()
        src = None if every_rank or not distributed else 0
        if src is not None:
            self._check_same_structure()  # before any tensor travels
        parallelize_hf(self.model, tp_mesh)
        trainer = compat.module_trainer(self)
        device = trainer.strategy.root_device if trainer is not None else tp_mesh.device_type
        to_empty_keeping_ties(self.model, device)
        host, weights = None, "broadcast"
        if src is None or dist.get_rank() == src:
            with torch.device("cpu"):  # the host: transformers reads a device context as a device_map
                if self.source.from_config:
                    host, weights = self.source.build(config, dtype), "config"
                else:
                    host, weights = self.source.load(config, dtype), "checkpoint"
        fill_from_whole(self.model, dict(named_tensors(host)) if host is not None else None, src=src)
        return weights

    def _check_same_structure(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        mine = structure_digest(self.model)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        odd = [r for r, d in enumerate(gathered) if d != gathered[0]]
        if odd:
            raise ConfigError(
                f"ranks {odd} built a model whose parameters, shapes, dtypes or tied weights differ from rank 0's "
                f"{type(self.model).__name__}, so rank 0's weights cannot be broadcast to them. Give every rank "
                "the same config, config_overrides and dtype, or set load_on='every_rank'"
            )

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise ConfigError(
                "HFCausalLM has no model yet: it is built in configure_model, which the Trainer calls; outside "
                "a Trainer call module.configure_model() first"
            )
        if isinstance(self.model, DecoderStage):
            raise ConfigError(
                f"HFCausalLM holds stage {self.model.stage} of {self.model.stages} of its model "
                "(ByteScaleStrategy(pipeline_parallel_size > 1)); forward and save_pretrained need the whole model. "
                "Run them with pipeline_parallel_size=1 (e.g. from the sharded checkpoint)"
            )
        return self.model

    # ---------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Logits ``[T, V]`` of one packed micro-batch (``input_ids``, ``position_ids``: ``[T]``)."""
        model = self._require_model()  # a labels= keyword is refused by the model's pre-hook
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ConfigError(
                f"HFCausalLM takes packed input_ids [T] and position_ids [T], got {tuple(input_ids.shape)} and "
                f"{tuple(position_ids.shape)}"
            )
        if _checkpointing(model):
            raise ConfigError(
                "gradient checkpointing of the HF model recomputes attention during backward, outside the "
                "micro-batch's attention layout (ring attention cannot be recomputed there); turn it off "
                "(model.activation_checkpointing_disable()) and use the strategy's activation offload instead"
            )
        # Under the strategy the micro-batch's layout is installed; called directly, the sequences are
        # the runs of consecutive positions (whether or not the model hands position_ids to attention).
        layout = (
            nullcontext()
            if current_scope() is not None
            else attention_context(layout_from_positions(position_ids, input_ids.shape[0]))
        )
        with count_attention_calls() as counted, layout:
            out = model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **kwargs)
        if self._attention_layers and counted.calls != self._attention_layers:
            raise ConfigError(
                f'{type(model).__name__} ran attn_implementation="{ATTN_IMPLEMENTATION}" in {counted.calls} of '
                f"its {self._attention_layers} layers; the other layers mix tokens another way and would "
                "attend across packed sequences. This model cannot train on packed micro-batches"
            )
        return out.logits[0]

    def training_step(self, mb: Any, batch_idx: int) -> torch.Tensor:
        return mb.loss(self(mb.input_ids, mb.position_ids))

    def validation_step(self, mb: Any, batch_idx: int) -> torch.Tensor:
        return mb.loss(self(mb.input_ids, mb.position_ids))

    def test_step(self, mb: Any, batch_idx: int) -> torch.Tensor:
        return mb.loss(self(mb.input_ids, mb.position_ids))

    # --------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> dict[str, Any]:
        total = None
        if self.optim.schedule != "constant":
            steps = self.trainer.estimated_stepping_batches
            total = int(steps) if steps != float("inf") else None
        return self.optim.build(self.named_parameters(), total)

    # ------------------------------------------------------------------ export
    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Write the (fine-tuned) HF model as a ``from_pretrained`` folder (call it on one rank)."""
        self._require_model().save_pretrained(path, **kwargs)
