"""The pretrain recipe: compose the configs, build data, model, strategy, logger and callbacks, fit.

``bytescale-train [overrides]`` (this module's :func:`main`) and ``python recipes/pretrain.py``
run the same :func:`train`.  With no overrides it is the CPU quickstart.  Examples::

    bytescale-train strategy.planner=static strategy.cp_size=2 trainer.devices=2
    bytescale-train -m strategy.planner=static,naive,balance strategy=bytescale_spawn
    bytescale-train experiment=paper_7b_2m trainer.num_nodes=16
    bytescale-train logger=csv          # or logger=tensorboard; ~logger for none

torch and Lightning load only once a run is built (:func:`build`, :func:`train`): ``--help``,
``--cfg job`` and a config that does not compose answer in about a second instead of the
seconds Lightning takes to import (``tests/test_public_api.py`` checks ``--help``).  So the
imports of Lightning, torch and the floors that load them sit in the functions that need them.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from lightning_bytescale.lightning.wandb_offline import find_run_files, wandb_offline_by_default
from lightning_bytescale.recipes.config import PRIMARY, ConfigError, compose_pretrain, config_source
from lightning_bytescale.recipes.sweep_table import write_job_summary

log = logging.getLogger("lightning_bytescale.recipes")

__all__ = ["build", "main", "train"]


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _devices_count(devices: Any) -> int:
    if isinstance(devices, int):
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    return 2  # "auto" and friends: assume more than one


def _is_wandb(logger_cfg: Any) -> bool:
    """Whether a logger config builds a W&B logger (Lightning's ``WandbLogger`` or a subclass of it)."""
    target = str(logger_cfg.get("_target_", "")).rsplit(".", 1)[-1]
    return target.startswith("Wandb") and target.endswith("Logger")


def _prepare(cfg: DictConfig) -> None:
    """Decisions the YAML leaves open: W&B online/offline, the launcher in sweeps."""
    with open_dict(cfg):
        logger = cfg.get("logger")
        if logger is not None and _is_wandb(logger):
            if logger.get("offline") is None:
                logger.offline = wandb_offline_by_default()
            if logger.get("name") is None:
                logger.name = cfg.name
                if _is_multirun():  # one run per sweep job, grouped by the sweep's name
                    job = HydraConfig.get().job
                    logger.name = (
                        f"{cfg.name}/{job.get('num', 0)}:{job.get('override_dirname') or 'defaults'}"
                    )
                    if logger.get("group") is None:
                        logger.group = cfg.name
        strategy = cfg.strategy
        if (
            _is_multirun()
            and strategy.get("start_method", "popen") == "popen"
            and _devices_count(cfg.trainer.devices) > 1
        ):
            log.warning(
                "multirun with Lightning's popen launcher re-enters the sweep in every child process; "
                "using strategy.start_method=spawn for this sweep (set strategy=bytescale_spawn to silence this)."
            )
            strategy.start_method = "spawn"


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate every component of the recipe without fitting (also used by the tests)."""
    # here, not at the top: Lightning and torch load only when a run is built (module docstring)
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import WandbLogger

    from lightning_bytescale.cli._run_end import RunCheckpoint
    from lightning_bytescale.lightning.run_summary import RunSummary
    from lightning_bytescale.lightning.run_timer import RunTimer
    from lightning_bytescale.lightning.wandb_run import WandbRunId

    _prepare(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    if cfg.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)

    datamodule = instantiate(_plain(cfg.data))
    strategy = instantiate(_plain(cfg.strategy))
    model_cfg = _model_for_layout(_model_for_data(_plain(cfg.model), datamodule), strategy)
    model = instantiate(model_cfg)
    _check_layout(model, strategy, cfg.get("hf_export_dir"))  # before any process starts, as the data below
    if hasattr(datamodule, "model_vocab_size") and datamodule.model_vocab_size is None:
        # the vocabulary check before the first step compares the data with this
        datamodule.model_vocab_size = _model_vocab(model)
    logger = instantiate(_logger_config(cfg)) if cfg.get("logger") is not None else None
    callbacks = [instantiate(_plain(cfg.telemetry)), RunSummary()]
    if logger is not None and isinstance(logger, WandbLogger):
        callbacks.append(WandbRunId())  # the run id in every checkpoint: a resumed run logs into the same run
    trainer_cfg = _plain(cfg.trainer)
    max_time = trainer_cfg.pop("max_time", None)
    if max_time is not None:
        # Lightning's own max_time restores the elapsed time on resume; this one bounds each run
        callbacks.append(RunTimer(duration=max_time, interval="step"))
    if logger is not None:
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.trainer.get("enable_checkpointing", True):
        callbacks.append(
            RunCheckpoint(  # Lightning's ModelCheckpoint, quiet about the earlier run's folder
                dirpath=os.path.join(str(cfg.run_dir), "checkpoints"),
                save_last="link",  # last.ckpt: a link to the newest checkpoint, not a second copy
                every_n_train_steps=cfg.get("checkpoint_every_n_steps"),
            )
        )
    if trainer_cfg.get("enable_progress_bar", True):
        bar = _step_progress_bar()
        if bar is not None:
            callbacks.append(bar)
    stop = _stop_callback(strategy, cfg)
    if stop is not None:
        callbacks.append(stop)
    trainer = instantiate(
        trainer_cfg,
        strategy=strategy,
        logger=logger if logger is not None else False,
        callbacks=callbacks,
    )
    _validate_data(datamodule, strategy, trainer)
    return {
        "datamodule": datamodule,
        "model": model,
        "strategy": strategy,
        "logger": logger,
        "trainer": trainer,
    }


def _logger_config(cfg: DictConfig) -> dict[str, Any]:
    """The logger's config; a W&B logger resuming a checkpoint logs into the W&B run the checkpoint names."""
    from lightning_bytescale.lightning.wandb_run import checkpoint_wandb_run_id  # loads Lightning (see above)

    logger = _plain(cfg.logger)
    ckpt_path = cfg.get("ckpt_path")
    if _is_wandb(logger) and logger.get("id") is None and ckpt_path not in (None, "hpc", "last"):
        logger["id"] = checkpoint_wandb_run_id(str(ckpt_path))
    return logger


def _step_progress_bar() -> Any:
    """``Epoch 0 (to step 200)`` instead of Lightning's ``Epoch 0/-2``; None without ``rich``
    (Lightning's TQDM bar then, which shows no epoch limit)."""
    from lightning_bytescale.lightning.progress import StepProgressBar

    try:
        return StepProgressBar()
    except ModuleNotFoundError:
        return None


def _stop_callback(strategy: Any, cfg: DictConfig) -> Any:
    """The strategy's preemption callback, ending with the command that resumes this run.

    Under the default (popen) launcher Ctrl-C stops the same way as SIGTERM: a checkpoint at the
    next step boundary (a second Ctrl-C stops at once).  With spawn or fork the launching
    process holds no training state and Lightning's own Ctrl-C handling is kept.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_bytescale.cli._run_end import ResumeHint, command_overrides, launch_prefix
    from lightning_bytescale.lightning.preemption import PreemptionCallback, PreemptionHandler

    chosen = getattr(strategy, "preemption", False)
    if chosen is False:
        return None
    signals = ("SIGTERM",) if chosen is True else tuple(chosen)
    if chosen is True and getattr(strategy, "start_method", "popen") == "popen":
        signals += ("SIGINT",)
    hint = ResumeHint(
        command_overrides(),
        str(_output_dir(cfg).absolute()),
        SLURMEnvironment.detect(),
        prefix=launch_prefix(),
    )
    return PreemptionCallback(PreemptionHandler(signals), resume_hint=hint)


def _hdp_ranks(strategy: Any, world_size: int) -> int:
    """The ranks the planner plans for: the world over each HDP rank's devices (TP lanes x pipeline stages)."""
    per_rank = int(getattr(strategy, "tensor_parallel_size", 1)) * int(
        getattr(strategy, "pipeline_parallel_size", 1)
    )
    return max(1, world_size // per_rank)


def _model_for_layout(model_cfg: dict[str, Any], strategy: Any) -> dict[str, Any]:
    """A Hugging Face model's ``tensor_parallel`` from the strategy's layout where the config leaves it open.

    ``model.tensor_parallel: null`` (the default) shards the model with its own plan exactly when
    ``strategy.tensor_parallel_size > 1``; ``false`` under tensor parallelism would have every
    lane run the whole model, and ``true`` without it has no mesh to shard over: both are refused.
    """
    if "tensor_parallel" not in model_cfg:
        return model_cfg
    tp = int(getattr(strategy, "tensor_parallel_size", 1))
    chosen = model_cfg["tensor_parallel"]
    if chosen is None:
        model_cfg["tensor_parallel"] = tp > 1
    elif chosen and tp == 1:
        raise ConfigError(
            "model.tensor_parallel=true needs strategy.tensor_parallel_size > 1 (the mesh it shards over); set "
            "strategy.tensor_parallel_size=2 (or more), or drop model.tensor_parallel"
        )
    elif not chosen and tp > 1:
        raise ConfigError(
            f"model.tensor_parallel=false with strategy.tensor_parallel_size={tp}: every lane of an HDP rank would "
            "run the whole model on the same micro-batches; drop model.tensor_parallel (it follows the strategy) "
            "or set strategy.tensor_parallel_size=1"
        )
    return model_cfg


def _check_layout(model: Any, strategy: Any, hf_export_dir: str | None = None) -> None:
    """The model's own check of the strategy's layout (``PretrainModule.check_layout``), before launch."""
    sharded = int(getattr(strategy, "tensor_parallel_size", 1)) * int(
        getattr(strategy, "pipeline_parallel_size", 1)
    )
    if hf_export_dir and sharded > 1:
        raise ConfigError(
            "hf_export_dir writes the trained model from one process, which holds only its shard or stage with "
            "strategy.tensor_parallel_size or pipeline_parallel_size > 1; exporting a sharded model is not built "
            "yet: drop hf_export_dir (the checkpoint keeps the model) or train with both sizes 1"
        )
    check = getattr(model, "check_layout", None)
    if callable(check):
        check(
            tensor_parallel=int(getattr(strategy, "tensor_parallel_size", 1)),
            pipeline=int(getattr(strategy, "pipeline_parallel_size", 1)),
        )


def _validate_data(datamodule: Any, strategy: Any, trainer: Any) -> None:
    """Check the data options against the run's HDP ranks and planner before any process starts."""
    validate = getattr(datamodule, "validate", None)
    if not callable(validate):
        return
    config = getattr(strategy, "planner_config", None)
    if config is None:
        options = getattr(strategy, "planner_options", None)
        config = options() if callable(options) else None
    validate(world_size=_hdp_ranks(strategy, int(trainer.world_size)), planner_options=config)


def _before_launch_error(err: BaseException) -> str | None:
    """The one-line reason of a run that cannot start (raised while the recipe is built), printed
    instead of a traceback; None for anything else (a bug keeps its traceback)."""
    # here, not at the top: the data package loads torch (module docstring)
    from lightning_bytescale.data.errors import DataError

    if isinstance(err, MissingMandatoryValue):
        key = err.full_key or "a key"
        hint = ""
        if key == "data.source":
            hint = " (data=text and data=jsonl read your own files: data.source=/path/to/folder, a glob or a .jsonl file)"
        elif key.startswith("data.") or key.startswith("model."):
            hint = f" (this {key.split('.')[0]} config needs it)"
        return f"{key} has no value: give it on the command line, {key}=...{hint}"
    if isinstance(err, DataError):
        return f"{type(err).__name__}: {err}"
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, InstantiationException):
        cause = err.__cause__
        if isinstance(cause, (DataError, ConfigError, ValueError, TypeError, FileNotFoundError)):
            found = _before_launch_error(cause)
            return found or f"{type(cause).__name__}: {cause}"
        return str(err).splitlines()[0] + (f": {cause}" if cause is not None else "")
    return None


def _plain(node: DictConfig) -> dict[str, Any]:
    """A config node as plain Python (interpolations resolved, Enums as their string values)."""
    out = OmegaConf.to_container(node, resolve=True, enum_to_str=True, throw_on_missing=True)
    assert isinstance(out, dict)
    return out


def _model_for_data(model_cfg: dict[str, Any], datamodule: Any) -> dict[str, Any]:
    """The model's config with the data's vocabulary where the model leaves it open.

    The reference Llama (``vocab: null``) gets the tokenizer's vocabulary; so does a Hugging Face
    model built from its config (``from_config: true``) unless ``config_overrides`` sets
    ``vocab_size``.  A checkpoint keeps its own vocabulary (the data is checked against it).
    """
    vocab = None
    if "vocab" in model_cfg and model_cfg["vocab"] is None:
        vocab = _data_vocab(datamodule)
        if vocab is not None:
            model_cfg["vocab"] = vocab
    if model_cfg.get("from_config") and "vocab_size" not in (model_cfg.get("config_overrides") or {}):
        vocab = _data_vocab(datamodule)
        if vocab is not None:
            model_cfg["config_overrides"] = {**(model_cfg.get("config_overrides") or {}), "vocab_size": vocab}
    return model_cfg


def _model_vocab(model: Any) -> int | None:
    """The model's vocabulary size: a ``vocab_size`` attribute, or a Hugging Face model's config."""
    from lightning_bytescale.lightning.datamodule import model_vocab_size  # loads Lightning (see above)

    found = model_vocab_size(model)
    source = getattr(model, "source", None)
    if found is None and callable(getattr(source, "config", None)):
        config = source.config()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        value = getattr(text, "vocab_size", None)
        found = int(value) if isinstance(value, int) else None
    return found


def _data_vocab(datamodule: Any) -> int | None:
    for owner in (datamodule, getattr(datamodule, "tokenizer", None)):
        value = getattr(owner, "vocab_size", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _finish_wandb() -> None:
    """Close the W&B run (Lightning never does), so the offline file is complete and sweeps don't share a run."""
    wandb = sys.modules.get("wandb")  # only a run that imported it has one to close
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def _discard_offline_wandb_run() -> None:
    """Finish and delete the offline W&B run of a run that never trained (Lightning starts it
    before the data module's ``setup``), and its ``wandb`` folder when nothing else is left there."""
    wandb = sys.modules.get("wandb")  # only a run that imported it has one to discard
    run = wandb.run if wandb is not None else None
    if run is None:
        return
    folder = Path(run.dir).parent  # <save_dir>/wandb/offline-run-<time>-<id>
    wandb.finish(exit_code=2)
    if not folder.name.startswith("offline-run-"):
        return  # an online run exists on the server too: keep its local files
    shutil.rmtree(folder, ignore_errors=True)
    parent = folder.parent
    if parent.name == "wandb" and all(p.is_symlink() and not p.exists() for p in parent.iterdir()):
        shutil.rmtree(parent, ignore_errors=True)  # only links to the deleted run were left


def _one_line_per_log_message() -> None:
    """Under Hydra, let its handlers (console and the run's log file) print Lightning's messages once.

    Lightning adds its own console handler when it is imported before logging is configured;
    with Hydra's root handlers as well, every Lightning line would be printed twice.
    """
    import lightning.pytorch  # noqa: F401  (here, not at the top; its import decides whether it adds a handler)

    if not logging.getLogger().handlers:
        return
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True


def _output_dir(cfg: DictConfig) -> Path:
    """The folder Hydra made for this run (``run_dir`` outside Hydra)."""
    if HydraConfig.initialized():
        found = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", throw_on_missing=False)
        if found:
            return Path(str(found))
    return Path(str(cfg.run_dir))


def train(cfg: DictConfig) -> float | None:
    """Run the recipe; returns the last logged training loss (the value sweepers optimise).

    A run that fails before its first step leaves no run folder behind when the folder was new
    and holds no checkpoint (``cli/_run_end.py``).
    """
    from lightning_bytescale.cli._run_end import fresh_run_folder

    _one_line_per_log_message()
    if cfg.get("print_config"):
        print(OmegaConf.to_yaml(cfg, resolve=True))
    folder = _output_dir(cfg)
    fresh = os.environ.get("RANK", "0") == "0" and fresh_run_folder(folder)
    try:
        parts = _build(cfg)
    except BaseException:
        _remove_unused(cfg, folder, fresh)
        raise
    try:
        return _fit(cfg, parts)
    except BaseException:
        trainer = parts["trainer"]
        # with spawn or fork the steps ran in the workers: this process cannot tell
        popen = getattr(trainer.strategy, "start_method", "popen") == "popen"
        if trainer.is_global_zero and popen and trainer.global_step == 0:
            _remove_unused(cfg, folder, fresh)
        raise


def _remove_unused(cfg: DictConfig, folder: Path, fresh: bool) -> None:
    from lightning_bytescale.cli._run_end import remove_unused_run_folder

    # the log files stay open: their handlers write on into the unlinked files, never recreate them
    remove_unused_run_folder(folder, fresh, name=str(cfg.get("name")))


def _build(cfg: DictConfig) -> dict[str, Any]:
    try:
        return build(cfg)  # the data options are validated here, before any other process starts
    except Exception as err:
        reason = _before_launch_error(err)
        if reason is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank builds: one line, not one per rank
            print(f"bytescale-train: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _fit(cfg: DictConfig, parts: dict[str, Any]) -> float | None:
    trainer, logger = parts["trainer"], parts["logger"]
    if logger is not None:
        from lightning_bytescale.lightning.config_logger import ConfigLogger  # loads Lightning (see above)

        trainer.callbacks.append(ConfigLogger(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))
    from lightning_bytescale.cli._run_end import named_resume_error

    callback = trainer.checkpoint_callback
    wrong = named_resume_error(cfg.get("ckpt_path"), str(cfg.run_dir), getattr(callback, "dirpath", None))
    if wrong is not None:
        if trainer.is_global_zero:
            print(f"bytescale-train: {wrong}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    start = time.perf_counter()
    try:
        trainer.fit(parts["model"], datamodule=parts["datamodule"], ckpt_path=cfg.get("ckpt_path"))
    except SystemExit as err:
        from lightning_bytescale.lightning.preemption import PreemptedError  # loads Lightning (see above)

        if trainer.interrupted and not isinstance(err, PreemptedError) and trainer.is_global_zero:
            _report_interrupt(cfg, trainer)  # Lightning's Ctrl-C handling (a second Ctrl-C, or during set-up)
        raise
    except Exception as err:
        from lightning_bytescale.data.errors import DataError  # loads torch (see above)
        from lightning_bytescale.lightning.launcher import EXIT_SAME_ERROR, printed_by_a_lower_rank

        # A lower rank raised the same error and prints it: end without Hydra's report of it
        # (its traceback and "Error executing job" line, once per rank otherwise).
        silent = printed_by_a_lower_rank(err)
        if not isinstance(err, (DataError, ConfigError)) or trainer.global_step > 0:
            if silent:
                raise SystemExit(EXIT_SAME_ERROR) from None
            raise
        # bad data or a setting the run cannot take, found at set-up (the store read, the model
        # built on its ranks): one line, as before launch
        if silent:
            raise SystemExit(EXIT_SAME_ERROR) from None
        if trainer.is_global_zero:
            _discard_offline_wandb_run()
        print(f"bytescale-train: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        if trainer.is_global_zero:
            _finish_wandb()
    loss = trainer.callback_metrics.get("train/loss")
    if trainer.is_global_zero:
        exported = _export_hf(cfg, parts)
        _report(cfg, trainer, logger, loss, time.perf_counter() - start, exported)
    return float(loss) if loss is not None else None


def _export_hf(cfg: DictConfig, parts: dict[str, Any]) -> str | None:
    """``hf_export_dir``: the trained Hugging Face model and the data's tokenizer as a ``from_pretrained``
    folder (where this process holds the trained model: rank 0 of the default launcher); its path."""
    folder = cfg.get("hf_export_dir")
    model = parts["model"]
    if (
        not folder
        or getattr(model, "model", None) is None
        or not callable(getattr(model, "save_pretrained", None))
    ):
        return None
    path = Path(str(folder)).absolute()
    model.save_pretrained(str(path))
    tokenizer = cfg.data.get("tokenizer")
    if tokenizer and os.path.exists(str(tokenizer)):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # the hf extra (model=hf has it)

        if os.path.isdir(str(tokenizer)):
            saved = AutoTokenizer.from_pretrained(str(tokenizer))
        else:
            saved = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer))
        saved.save_pretrained(str(path))
    return str(path)


def _report(
    cfg: DictConfig, trainer: Any, logger: Any, loss: Any, seconds: float, exported: str | None = None
) -> None:
    # Under the spawn/fork launchers the fitted state stays in the workers: the step count and
    # tokens/s come back through callback_metrics (lightning/run_summary.py).
    from lightning_bytescale.lightning.run_summary import run_figures  # loads Lightning (see above)

    figures = run_figures(trainer)
    ran = int(figures.get("run/steps", 0))
    steps = f"{ran} steps" if ran else "no step"
    now = int(figures.get("run/global_step") or trainer.global_step)  # spawn: the state stayed in the workers
    if ran and cfg.get("ckpt_path") and now:
        steps += f" (resumed; step {now} now)"
    lines = [f"[bytescale-train] {_job_label(cfg)}: {steps} in {seconds:.1f} s"]
    if "run/tokens_per_s" in figures:
        lines[0] += f", {figures['run/tokens_per_s']:,.0f} tokens/s"
    if figures.get("run/first_loss") is not None:
        lines[0] += f", first loss {figures['run/first_loss']:.4f}"
    if loss is not None:
        lines[0] += f", last loss {float(loss):.4f}"
    lines.append(f"  outputs: {cfg.run_dir}")
    if exported is not None:
        lines.append(f"  Hugging Face model: {exported} (AutoModelForCausalLM.from_pretrained loads it)")
    lines += _checkpoint_lines(cfg, trainer, ran)
    lines += _wandb_lines(logger)
    print("\n".join(lines), flush=True)
    write_job_summary(
        cfg.run_dir,
        {
            "name": str(cfg.name),
            "overrides": _job_overrides(),
            "planner": str(cfg.strategy.get("planner")),
            "seconds": seconds,
            "loss": float(loss) if loss is not None else None,
            **figures,
        },
    )


def _wandb_lines(logger: Any) -> list[str]:
    """Where the offline W&B run is and how to upload it (with the folders of the runs it resumes)."""
    from lightning.pytorch.loggers import WandbLogger  # loads Lightning (see above)

    if not isinstance(logger, WandbLogger):
        return []
    runs = find_run_files(os.path.join(str(logger.save_dir), "wandb"))
    if not runs or "offline-run" not in runs[-1].parent.name:
        return []
    newest = runs[-1].parent
    run_id = newest.name.rsplit("-", 1)[-1]
    same = sorted({p.parent for p in runs if p.parent.name.rsplit("-", 1)[-1] == run_id})  # oldest first
    lines = [f"  offline W&B run: {newest}" + (f" (W&B run {run_id}, continued)" if len(same) > 1 else "")]
    lines.append(f"  upload it with:  wandb sync {' '.join(str(p) for p in same)}")
    return lines


def _job_overrides() -> str:
    if not HydraConfig.initialized():
        return ""
    return str(HydraConfig.get().job.get("override_dirname") or "")


def _job_label(cfg: DictConfig) -> str:
    """The run's name, and in a sweep the job's number and overrides."""
    if not _is_multirun():
        return str(cfg.name)
    job = HydraConfig.get().job
    return f"{cfg.name} job {job.get('num', 0)} ({_job_overrides() or 'defaults'})"


def _checkpoint_lines(cfg: DictConfig, trainer: Any, ran: int) -> list[str]:
    """Where the run's checkpoint is and the command that trains on from it."""
    from lightning_bytescale.cli._run_end import (
        checkpoint_step,
        command_overrides,
        launch_prefix,
        resume_command,
    )

    callback = trainer.checkpoint_callback
    if callback is None or callback.dirpath is None:
        return []
    last = Path(callback.dirpath) / "last.ckpt"
    if not last.exists():
        return []
    step = trainer.global_step or checkpoint_step(last)  # spawn: the state stayed in the workers
    limit = int(cfg.trainer.get("max_steps") or -1)
    more = None
    if step is not None and 0 < limit <= step:  # it used up its steps: resuming as it is would stop at once
        more = step + (ran or limit)
    where = f"  checkpoint: {last}" + (f" (step {step})" if step is not None else "")
    command = resume_command(
        command_overrides(), last, more, prefix=launch_prefix(), run_dir=_output_dir(cfg)
    )
    lines = [where, f"  resume with:  {command}"]
    if more is not None:
        lines[-1] += f"   # to step {more}"
    return lines


def _report_interrupt(cfg: DictConfig, trainer: Any) -> None:
    """Rank 0's lines after Lightning's Ctrl-C handling: the newest checkpoint and its command."""
    from lightning_bytescale.cli._run_end import (
        command_overrides,
        launch_prefix,
        newest_checkpoint,
        resume_command,
    )

    callback = trainer.checkpoint_callback
    found = newest_checkpoint(str(cfg.run_dir), getattr(callback, "dirpath", None))
    lines = [
        f"[bytescale-train] {cfg.name}: interrupted after step {trainer.global_step} without saving a checkpoint"
    ]
    if found is not None:
        lines.append(f"  newest checkpoint: {found}")
        command = resume_command(command_overrides(), found, prefix=launch_prefix(), run_dir=_output_dir(cfg))
        lines.append(f"  resume with:  {command}")
    else:
        lines.append(
            "  no checkpoint in this run (one Ctrl-C while training saves one at the next step; a second stops at once)"
        )
    print("\n".join(lines), file=sys.stderr, flush=True)


def _hydra_main() -> Any:
    # pkg://lightning_bytescale.recipes.conf (the packaged YAML), or $BYTESCALE_CONF_DIR;
    # Hydra's --config-dir adds a folder of new options, searched after it
    return hydra.main(version_base="1.3", config_path=config_source(), config_name=PRIMARY)(train)


def _unknown_key(err: BaseException) -> OmegaConfBaseException | None:
    """The OmegaConf error of a key the schema does not have, from a composition error's causes."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, (ConfigAttributeError, ConfigKeyError)) and getattr(seen, "full_key", None):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def override_typo(args: Sequence[str]) -> str | None:
    """The message for a command-line key the config does not have (``strategy.plannr=static``),
    naming the closest key; None when the overrides compose, fail for another reason, or name a
    key close to none of the schema's (Hydra's own message, add it with ``+``, stands).

    Hydra's own message proposes ``+strategy.plannr=static``, which adds the key and fails later in
    the component that gets it.  Only plain overrides are checked (no ``--`` flags but ``-m``).
    """
    overrides = [a for a in args if not a.startswith("-")]
    dotted = [a for a in overrides if "=" in a and "." in a.split("=", 1)[0] and a[0] not in "+~"]
    if not dotted or any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return None
    try:
        compose_pretrain(overrides, hydra_config=False)
    except ConfigError as err:
        found = _unknown_key(err)
        if found is None:
            return None
        full_key = str(getattr(found, "full_key", ""))
        parent, _, key = full_key.rpartition(".")
        schema = getattr(found, "object_type", None)
        names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
        if not close:
            return None  # Hydra's own message (add the key with +) stands
        given = next((a for a in dotted if a.split("=", 1)[0] == full_key), f"{full_key}=...")
        where = f"the {parent} config" + (f" ({schema.__name__})" if isinstance(schema, type) else "")
        fixed = f"{parent}.{close[0]}={given.split('=', 1)[1]}"
        return f"{full_key} is not a key of {where}: did you mean {parent}.{close[0]}? ({fixed})"
    return None


#: Layout keys that belong to another group than the one a user may first try (``+model.tensor_parallel_size``).
LAYOUT_KEYS = {
    "tensor_parallel": "strategy.tensor_parallel_size",
    "tensor_parallel_size": "strategy.tensor_parallel_size",
    "pipeline_parallel_size": "strategy.pipeline_parallel_size",
    "fsdp": "model.fsdp",
}
#: The groups whose ``+group.key=value`` overrides are checked against the schema and the target's arguments.
CHECKED_GROUPS = ("strategy", "model")


def _target_parameters(target: str) -> tuple[set[str], bool]:
    """The named arguments of a config's ``_target_`` and whether it takes any other keyword too
    (a ``**kwargs`` of a class outside this package; this package's classes refuse unknown ones)."""
    import inspect

    from hydra.utils import get_object

    try:
        found = get_object(target)
        signature = inspect.signature(found)
    except Exception:  # noqa: BLE001 - a target that does not load fails later, with its own error
        return set(), True
    named = {
        p.name
        for p in signature.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    own = str(getattr(found, "__module__", "")).startswith("lightning_bytescale.")
    return named, open_ended and not own


def added_key_error(args: Sequence[str]) -> str | None:
    """The message for ``+strategy.<key>=...`` or ``+model.<key>=...`` naming a key that neither the
    group's schema nor its target's constructor has (it would be refused later, or do nothing):
    the same "did you mean" line as a misspelt key; None when every such key is taken."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in args):
        return None
    overrides = [a for a in args if not a.startswith("-")]
    added = [a for a in overrides if a.startswith("+") and not a.startswith("++") and "=" in a]
    checked = [
        a for a in added if a[1:].split("=", 1)[0].split(".")[0] in CHECKED_GROUPS and "." in a.split("=")[0]
    ]
    if not checked:
        return None
    try:
        cfg = compose_pretrain(overrides, hydra_config=False)
    except ConfigError:
        return None  # Hydra's message (or override_typo's) says why
    for arg in checked:
        key, value = arg[1:].split("=", 1)
        group, name = key.split(".")[:2]
        node = cfg.get(group)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        schema = OmegaConf.get_type(node)
        fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set()
        if name in fields:
            continue  # a key under a dict field (+model.config_overrides.vocab_size=...)
        target = str(node["_target_"])
        params, open_ended = _target_parameters(target)
        if open_ended or name in params:
            continue  # a constructor argument the schema does not list: the constructor checks it
        names = sorted((fields | params) - {"_target_"})
        where = f"the {group} config" + (f" ({schema.__name__})" if isinstance(schema, type) else "")
        meant = LAYOUT_KEYS.get(name)
        if meant is None:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
            meant = f"{group}.{close[0]}" if close else None
        if meant is None:
            return (
                f"{key} is not a key of {where} nor an argument of {target.rsplit('.', 1)[-1]}, so it would do "
                f"nothing; the {group} keys are {', '.join(names)}"
            )
        if meant.endswith("_size") and value.lower() in ("true", "false"):
            value = "2"  # +model.tensor_parallel=true: the strategy's key takes a size
        meant_group, meant_name = meant.split(".", 1)
        listed = meant_name in fields if meant_group == group else True
        fixed = f"{'' if listed else '+'}{meant}={value}"
        return f"{key} is not a key of {where}: did you mean {meant}? ({fixed})"
    return None


def main() -> None:
    """Console script ``bytescale-train``: Hydra's command line over the packaged
    ``conf/pretrain.yaml`` (``pkg://lightning_bytescale.recipes.conf``)."""
    try:
        entry = _hydra_main()
        typo = override_typo(sys.argv[1:]) or added_key_error(sys.argv[1:])
    except ConfigError as err:
        print(f"bytescale-train: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if typo is not None:
        print(f"bytescale-train: {typo}", file=sys.stderr)
        raise SystemExit(2)
    entry()


if __name__ == "__main__":
    main()
