"""Structured-config schemas for the Hydra groups under ``conf/`` (the packaged YAML).

Each group's YAML files start with ``defaults: [base_<group>, _self_]``, which attaches the
dataclass below as the schema: an unknown key or a value of the wrong type then fails when the
config is composed (with the key's full path in the message), before any process starts.
The primary config ``pretrain.yaml`` attaches `PretrainConfig` the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

# OmegaConf reads these annotations at runtime: keep them to the types it knows (int, float,
# bool, str, Enum, list/dict of those, ``X | None``, Any).  Closed choices are Enums, so that a
# typo fails at compose time listing the valid values; the recipe hands plain strings to the
# targets (``enum_to_str``).


class StartMethod(str, Enum):
    popen = "popen"
    spawn = "spawn"
    fork = "fork"


class LongDocumentPolicy(str, Enum):
    split = "split"
    truncate = "truncate"
    drop = "drop"
    error = "error"


class EmptySamplePolicy(str, Enum):
    drop = "drop"
    error = "error"


class BudgetMode(str, Enum):
    window = "window"
    strict = "strict"


class LossOn(str, Enum):
    assistant = "assistant"
    completion = "completion"
    all = "all"


class Split(str, Enum):
    train = "train"
    val = "val"
    test = "test"


class LRSchedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class LoadOn(str, Enum):
    rank_zero = "rank_zero"
    every_rank = "every_rank"


class CheckpointFormat(str, Enum):
    auto = "auto"
    sharded = "sharded"
    consolidated = "consolidated"


@dataclass
class PlannerSchema:
    """The planner's options: exactly the fields of `lightning_bytescale.planner.config.PlannerConfig`
    (a test keeps the two lists equal), which checks them when the strategy is built.

    ``planner`` is a plain string, not an Enum, so that a planner added with
    ``register_planner`` works from the recipes; `compose_pretrain` checks it against the registry.
    """

    planner: str = "balance"  # static | naive | balance | megatron_dcp | verl_kk | lpt | a registered one
    capacity: int = 2048  # token capacity C per rank and micro-batch
    cp_size: int | None = None  # ring size of the static planner (None: as needed)
    offload: bool = False  # let long sequences offload activations to need fewer ranks
    slack: float = 0.05  # balance scheduler slack (delta)
    cost_model: str | None = None  # a bytescale-profile JSON file (None: the planner's default)
    comm_aware: bool = True  # plan with ring communication in the cost model (False: compute only)
    ranks_per_node: int | None = None  # topology for ring placement (None: from the cost model)
    seed: int = "${seed}"  # type: ignore[assignment]  # planning seed, the same on every rank
    num_buckets: int = 8  # the balance scheduler's buckets of about equal work
    pipeline_degree: int = 1  # leave 1: the strategy sets it from pipeline_parallel_size
    max_micro_batches: int | None = None  # pipelines only: the most micro-batches one pipeline runs in a step
    options: dict[str, Any] = field(default_factory=dict)  # the planner's own, e.g. {pp_reading: round_robin}


@dataclass
class StrategyConfig(PlannerSchema):
    """`lightning_bytescale.lightning.strategy.ByteScaleStrategy` options: the planner's
    (`PlannerSchema`, docs/planner.md) and the strategy's own."""

    _target_: str = "lightning_bytescale.lightning.strategy.ByteScaleStrategy"
    # refit the cost model from the run's micro-batch times (docs/cost-model.md): None refines
    # cost_model=auto only and keeps an explicit model pinned; true/false force it
    refine_cost_model: bool | None = None
    # The layout (docs/recipes.md#layouts-tensor-parallelism-pipelines-fsdp2): the recipe's model
    # shards itself over the mesh these build (parallelize_llama / LlamaStage, HFCausalLM's own).
    tensor_parallel_size: int = 1  # N > 1: an HDP rank is N devices (TP inside a node); 1: no TP
    pipeline_parallel_size: int = 1  # P > 1: an HDP rank is a pipeline of P stages; 1: no pipelines
    zero: int = 0  # ZeRO level: 0 none, 1 optimizer state sharded, 2 optimizer state and gradients sharded
    zero1: bool | None = None  # the older spelling of zero=1 (True); leave None and set zero
    timeout: float = 300.0  # seconds before a collective or P2P wait fails
    # sharded: each rank writes its part of a checkpoint folder (loading reshards onto any world size);
    # consolidated: rank 0 gathers everything into one file; auto: sharded exactly when zero >= 1
    checkpoint_format: CheckpointFormat = CheckpointFormat.auto
    check_finite: bool = True  # stop on a non-finite loss/gradient, naming the rank and micro-batches
    locate_non_finite: bool = False  # check gradients after every micro-batch, naming the first bad one
    start_method: StartMethod = StartMethod.popen  # multirun forces spawn


@dataclass
class DataConfig:
    """`lightning_bytescale.lightning.datamodule.ByteScaleDataModule` options (docs/data.md)."""

    _target_: str = "lightning_bytescale.lightning.datamodule.ByteScaleDataModule"
    source: Any = None  # None: Python's stdlib sources; a path/glob, "github", "byted", "hf:<name>", a dict
    pattern: str | None = None  # a folder source's files, e.g. "*.md" (None: "*.py")
    field: str | None = None  # the JSONL key / dataset column of the text (None: "text"; chats: "messages")
    tokenizer: str | None = (
        "byte"  # "byte": UTF-8 bytes (vocab 257); a tokenizers JSON file; a tokenizer folder
    )
    cache_dir: str | None = None  # token stores; None: $BYTESCALE_DATA_CACHE or ~/.cache/...
    rebuild: bool = False
    tokens_per_step: int = 16384  # the global batch's token budget
    context_length: int | None = 4096  # longest sample (None: world_size * capacity)
    long_document_policy: LongDocumentPolicy | None = None  # None: split for text, drop for chats
    empty_sample_policy: EmptySamplePolicy = EmptySamplePolicy.drop
    min_tokens: int = 2
    budget_mode: BudgetMode = BudgetMode.window
    seed: int = "${seed}"  # type: ignore[assignment]
    shuffle: bool = True
    drop_last: bool = False
    val_fraction: float = 0.0
    test_fraction: float = 0.0  # held out for trainer.test (0: test reads the validation split)
    predict_split: Split | None = None  # what trainer.predict reads; None: test, else val, else train
    num_workers: int = 1  # loader workers that plan and pack the next steps (0: inline)
    prefetch_factor: int | None = None
    persistent_workers: bool = True  # keep the workers between epochs (a restart costs seconds)
    validate_plans: bool = True
    loss_on: LossOn | None = None  # trained tokens; None: assistant for chats, all for text
    chat_template: str | None = None  # chats: None (the tokenizer's), "chatml", a .jinja file or the text
    model_vocab_size: int | None = None  # None: read from the model (the recipe passes it)
    tokenize_workers: int | None = None  # store-build processes; None: one per core for chats, 1 for text
    progress: bool | None = None  # a bar while the store is built; None: on a terminal


@dataclass
class FileDataConfig(DataConfig):
    """`DataConfig` whose ``source`` (a path or glob) must be given: ``data=text`` / ``data=jsonl``."""

    source: Any = MISSING


@dataclass
class ChatDataConfig(DataConfig):
    """`DataConfig` for ``data=chat``: chat or prompt/completion records and an HF tokenizer (both given)."""

    source: Any = field(default_factory=lambda: {"kind": "chat", "path": None, "name": None})
    tokenizer: str | None = MISSING  # a tokenizers JSON file or a tokenizer folder (a model's folder)
    loss_on: LossOn | None = LossOn.assistant
    long_document_policy: LongDocumentPolicy | None = LongDocumentPolicy.drop


@dataclass
class ModelConfig:
    """`lightning_bytescale.recipes.module.PretrainModule` options."""

    _target_: str = "lightning_bytescale.recipes.module.PretrainModule"
    preset: str = "tiny"  # a LlamaConfig preset: tiny, small, 125m, 1b, 7b, 13b, 70b
    vocab: int | None = None  # None: the data module's tokenizer vocabulary
    overrides: dict[str, Any] = field(default_factory=dict)  # LlamaConfig fields, e.g. {layers: 4}
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    fsdp: bool = False  # FSDP2 over the HDP ranks (data_parallel), around strategy.tensor_parallel_size > 1


@dataclass
class HFModelConfig:
    """`lightning_bytescale.hf.HFCausalLM` options (docs/hf.md): a Hugging Face causal LM."""

    _target_: str = "lightning_bytescale.hf.module.HFCausalLM"
    name_or_path: str = MISSING  # a local folder or hub name; with from_config also a model type ("llama")
    from_config: bool = False  # initialise from the config instead of loading weights
    config_overrides: dict[str, Any] = field(
        default_factory=dict
    )  # config fields, e.g. {num_hidden_layers: 2}
    dtype: str | None = None  # weights' dtype; None: the precision's default
    revision: str | None = None
    trust_remote_code: bool = False
    local_files_only: bool | None = None  # None: HF_HUB_OFFLINE
    load_on: LoadOn = LoadOn.rank_zero  # rank_zero: only rank 0 reads the checkpoint
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: LRSchedule = LRSchedule.constant
    min_lr_ratio: float = 0.0
    # shard the model with its own TP plan (parallelize_hf); None: when strategy.tensor_parallel_size > 1
    tensor_parallel: bool | None = None


@dataclass
class TrainerConfig:
    """`lightning.pytorch.Trainer` arguments the recipes use (others: add them here)."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = 2
    num_nodes: int = 1
    precision: Any = "32-true"
    max_steps: int = -1
    max_epochs: int | None = None
    max_time: str | None = None  # "DD:HH:MM:SS": this run's training-time budget (not restored on resume)
    gradient_clip_val: float | None = 1.0
    log_every_n_steps: int = 1
    limit_train_batches: Any | None = None
    limit_val_batches: Any | None = 0
    num_sanity_val_steps: int = 0
    val_check_interval: Any | None = None
    check_val_every_n_epoch: int | None = 1  # None: an int val_check_interval counts the run's batches
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    use_distributed_sampler: bool = False
    accumulate_grad_batches: int = 1
    deterministic: Any | None = None
    default_root_dir: str | None = "${run_dir}"


@dataclass
class WandbLoggerConfig:
    """`lightning_bytescale.lightning.wandb_run.WandbRunLogger` (Lightning's ``WandbLogger`` without W&B's
    stale warnings); ``offline: null`` = offline unless an API key is set; ``id: null`` = a new run, or
    the run a resumed checkpoint names."""

    _target_: str = "lightning_bytescale.lightning.wandb_run.WandbRunLogger"
    project: str = "lightning-bytescale"
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    entity: str | None = None
    offline: bool | None = None
    save_dir: str = "${run_dir}"
    log_model: bool = False
    job_type: str = "pretrain"
    id: str | None = None  # the W&B run to log into; null: a new one, or the one ckpt_path's checkpoint names


@dataclass
class CSVLoggerConfig:
    _target_: str = "lightning.pytorch.loggers.CSVLogger"
    save_dir: str = "${run_dir}"
    name: str = "csv"
    version: Any | None = None
    flush_logs_every_n_steps: int = 10


@dataclass
class TensorBoardLoggerConfig:
    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    save_dir: str = "${run_dir}"
    name: str = "tensorboard"
    version: Any | None = None


@dataclass
class TelemetryConfig:
    """`lightning_bytescale.lightning.telemetry.TelemetryCallback` options."""

    _target_: str = "lightning_bytescale.lightning.telemetry.TelemetryCallback"
    peak_tflops: float | None = None  # per device; None: a table of GPUs, a nominal CPU core
    charts_every_n_steps: int = 50
    per_rank_limit: int = 64
    prog_bar: bool = True


@dataclass
class PretrainConfig:
    """The primary config: one group per component plus run-level keys."""

    strategy: Any = MISSING
    data: Any = MISSING
    model: Any = MISSING
    trainer: Any = MISSING
    logger: Any = None  # null: no logger
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    name: str = "pretrain"  # run name (W&B run name, output folder)
    seed: int = 1234
    run_dir: str = "${hydra:runtime.output_dir}"
    ckpt_path: str | None = None  # resume from this checkpoint, e.g. <run_dir>/checkpoints/last.ckpt
    checkpoint_every_n_steps: int | None = None  # None: a checkpoint at the end of training only
    float32_matmul_precision: str | None = None  # "high" on recent GPUs
    print_config: bool = False
    # a Hugging Face model (model=hf): write the trained model (and the data's tokenizer) here as a
    # from_pretrained folder at the end of the run; null: none
    hf_export_dir: str | None = None
