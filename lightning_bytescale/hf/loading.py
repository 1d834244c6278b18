"""Where an HF model comes from: a checkpoint (local folder or hub name) or a config, plus overrides.

:class:`ModelSource` resolves the config once (with ``config_overrides`` applied before the
config's own derived fields are computed, so ``use_sliding_window=False`` also clears the
window), then either loads the checkpoint's weights, initialises from the config, or builds
the same model with *uninitialised* weights (:meth:`ModelSource.build_empty`).  The last is
for ranks that receive their weights from rank 0's broadcast: they never open the checkpoint
files, so a node does not hold one copy of the checkpoint in host memory per rank.

Offline-friendly: with ``HF_HUB_OFFLINE=1`` (or ``local_files_only=True``) nothing is
downloaded and a hub name must already be in the local cache.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights
from transformers.utils import is_accelerate_available

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.hf.attention import ATTN_IMPLEMENTATION

_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for no network access."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or os.sep in name and not _is_hub_id(name)


def _is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


@dataclass
class ModelSource:
    """A model to build: ``name_or_path`` (folder, hub name, model type, config or config dict)."""

    name_or_path: Any
    from_config: bool = False
    config_overrides: dict[str, Any] = field(default_factory=dict)
    revision: str | None = None
    trust_remote_code: bool = False
    local_files_only: bool | None = None
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.config_overrides = dict(self.config_overrides or {})
        self.model_kwargs = dict(self.model_kwargs or {})
        if isinstance(self.name_or_path, (PretrainedConfig, dict)):
            self.from_config = True
        elif isinstance(self.name_or_path, os.PathLike):
            self.name_or_path = os.fspath(self.name_or_path)
        elif not isinstance(self.name_or_path, str) or not self.name_or_path:
            raise ConfigError(
                "name_or_path must be a local folder, a hub name, a model type (with from_config=True), a "
                f"transformers config or its dict; got {self.name_or_path!r}"
            )
        for key in ("labels", "attn_implementation", "config"):
            if key in self.model_kwargs:
                raise ConfigError(
                    f"model_kwargs may not set {key!r}: HFCausalLM sets the attention and config itself"
                )

    @property
    def offline(self) -> bool:
        return hub_offline() if self.local_files_only is None else bool(self.local_files_only)

    def _hub_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"trust_remote_code": self.trust_remote_code}
        if self.revision is not None:
            kw["revision"] = self.revision
        if self.offline:
            kw["local_files_only"] = True
        return kw

    def _check_path(self) -> None:
        name = self.name_or_path
        if isinstance(name, str) and _looks_like_path(name) and not Path(name).expanduser().is_dir():
            raise ConfigError(
                f"name_or_path={name!r} looks like a local folder but there is no such folder; give the folder "
                "that holds config.json (and the weights), or a hub name such as 'Qwen/Qwen2.5-0.5B'"
            )

    def _read_config(self, overrides: dict[str, Any]) -> Any:
        """The config with ``overrides`` given at construction, so derived fields follow them."""
        name = self.name_or_path
        if isinstance(name, (PretrainedConfig, dict)):
            fields = name.to_dict() if isinstance(name, PretrainedConfig) else dict(name)
            kind = fields.get("model_type")
            if kind not in CONFIG_MAPPING:
                raise ConfigError(f"a config dict needs a known 'model_type', got {kind!r}")
            cls = type(name) if isinstance(name, PretrainedConfig) else CONFIG_MAPPING[kind]
            return cls.from_dict(copy.deepcopy({**fields, **overrides}))
        self._check_path()
        if self.from_config and name in CONFIG_MAPPING and not Path(name).exists():
            return AutoConfig.for_model(name, **overrides)
        try:
            return AutoConfig.from_pretrained(name, **self._hub_kwargs(), **overrides)
        except OSError as err:
            offline = " (offline: HF_HUB_OFFLINE or local_files_only is set)" if self.offline else ""
            raise ConfigError(
                f"cannot read the config of {name!r}{offline}: {err}. Give a local folder with config.json, a "
                "hub name that is cached (or reachable), or with from_config=True a model type such as 'llama'"
            ) from err

    def config(self) -> Any:
        """The config with ``config_overrides`` applied and ``"bytescale"`` attention selected."""
        base = self._read_config({})
        known = base.to_dict()
        unknown = [k for k in self.config_overrides if k not in known and not hasattr(base, k)]
        if unknown:
            hints = {k: difflib.get_close_matches(k, list(known), n=1) for k in unknown}
            said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise ConfigError(
                f"config_overrides names field(s) that {type(base).__name__} does not have: {said}"
            )
        if not self.config_overrides:
            config = base
        else:
            try:
                config = self._read_config(self.config_overrides)
            except Exception as err:  # transformers' validators raise their own error types
                raise ConfigError(
                    f"config_overrides {self.config_overrides} do not fit {type(base).__name__}: {err}. A config "
                    "that lists layer_types needs a matching layer_types override when num_hidden_layers changes"
                ) from err
        config._attn_implementation = ATTN_IMPLEMENTATION
        return config

    def _model_kwargs(self, dtype: torch.dtype) -> dict[str, Any]:
        return {**self.model_kwargs, "attn_implementation": ATTN_IMPLEMENTATION, "dtype": dtype}

    def load(self, config: Any, dtype: torch.dtype, device: torch.device | None = None) -> nn.Module:
        """The checkpoint's weights (``from_pretrained``).

        On an accelerator with ``accelerate`` installed the weights go straight from the files
        to ``device`` (``device_map``); otherwise they are loaded on the CPU, whatever device
        context the caller is in (transformers reads a device context as a ``device_map``,
        which needs ``accelerate``), and the strategy moves the model afterwards.
        """
        kwargs = {**self._hub_kwargs(), **self._model_kwargs(dtype)}
        if device is not None and device.type != "cpu" and is_accelerate_available():
            kwargs.setdefault("device_map", {"": device})
            return AutoModelForCausalLM.from_pretrained(self.name_or_path, config=config, **kwargs)
        with torch.device("cpu"):
            return AutoModelForCausalLM.from_pretrained(self.name_or_path, config=config, **kwargs)

    def build(self, config: Any, dtype: torch.dtype) -> nn.Module:
        """A freshly initialised model (``from_config``)."""
        kw = {"trust_remote_code": self.trust_remote_code} if self.trust_remote_code else {}
        return AutoModelForCausalLM.from_config(config, **kw, **self._model_kwargs(dtype))

    def build_empty(self, config: Any, dtype: torch.dtype) -> nn.Module:
        """The same model with uninitialised weights (filled by rank 0's broadcast); ties kept."""
        with no_init_weights():
            model = self.build(config, dtype)
        model.tie_weights()
        return model
