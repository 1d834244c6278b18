"""The on-disk cache of ``cost_model="auto"``: one file per (model, device, software, precision, kernel).

A measured cost model depends on what runs and where: the model's structure and parameter
dtypes, the device (its name; on the CPU also the threads torch uses), torch's (and CUDA's)
version, the run's precision, the attention kernel the model will use, and the measurement's own
settings (lengths, capacity or memory budget, layers).  :func:`cache_key` collects exactly these;
its digest names the file, and the file repeats the key, so a changed model, dtype or kernel
finds no file (or a file whose key differs) and is measured again, while an unchanged one is
read back without measuring anything.

Files are written atomically (a temporary file renamed into place), so a reader sees a whole
file or none; a file that does not parse or holds another key is reported and measured over.
:meth:`CostCache.lock` (``filelock``) lets concurrent starts on one machine measure once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from torch import nn

CACHE_FORMAT = "bytescale-auto-cost/1"
CACHE_ENV = "BYTESCALE_COST_CACHE"


def default_cache_dir() -> Path:
    """``$BYTESCALE_COST_CACHE``, else ``~/.cache/lightning_bytescale/cost``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "lightning_bytescale" / "cost"


def model_fingerprint(model: nn.Module) -> str:
    """sha256 of the model's structure: every module's class and ``extra_repr``, every parameter's
    and buffer's name, shape, dtype and ``requires_grad``, and the config's ``repr`` when it has one."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        cls = type(module)
        h.update(f"m|{name}|{cls.__module__}.{cls.__qualname__}|{module.extra_repr()}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"p|{name}|{tuple(p.shape)}|{p.dtype}|{p.requires_grad}\n".encode())
    for name, b in model.named_buffers():
        h.update(f"b|{name}|{tuple(b.shape)}|{b.dtype}\n".encode())
    config = getattr(model, "config", None)
    if config is not None:
        h.update(f"c|{config!r}\n".encode())
    return h.hexdigest()


def device_name(device: torch.device) -> str:
    """What the device is: the GPU's name and compute capability, or the CPU's model and torch's threads."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} (sm{major}{minor})"
    if device.type == "cpu":
        return f"{_cpu_model()} ({torch.get_num_threads()} threads)"
    return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cache_key(
    model: nn.Module,
    device: torch.device,
    *,
    precision: str | None,
    attention_kernel: str,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Everything a measured cost model depends on (``settings``: the measurement's own options)."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    return {
        "format": CACHE_FORMAT,
        "model": model_fingerprint(model),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "param_dtypes": dtypes,
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "precision": precision,
        "attention_kernel": attention_kernel,
        **settings,
    }


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class CostCache:
    """One cache file: ``<directory>/auto-<digest of key>.json`` holding ``{"key", "record"}``."""

    directory: Path
    key: dict[str, Any]

    @property
    def path(self) -> Path:
        return Path(self.directory) / f"auto-{key_digest(self.key)[:24]}.json"

    def lock(self, timeout_s: float) -> FileLock:
        """A lock beside the file (``<file>.lock``), so concurrent starts measure once."""
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.path) + ".lock", timeout=timeout_s)

    def read(self) -> dict[str, Any] | None:
        """The stored record, or ``None`` when there is no usable file for this key (a damaged one
        is reported and will be measured over)."""
        path = self.path
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ValueError(f"format {data.get('format') if isinstance(data, dict) else None!r}")
            if data.get("key") != json.loads(json.dumps(self.key, default=str)):
                raise ValueError("the file holds another key")
            record = data["record"]
            if not isinstance(record, dict):
                raise ValueError("no record")
            return record
        except (OSError, ValueError, KeyError) as err:
            warnings.warn(
                f"cost-model cache file {path} cannot be used ({err}); measuring again and rewriting it",
                stacklevel=3,
            )
            return None

    def write(self, record: dict[str, Any]) -> Path:
        """Write ``record`` atomically (a temporary file in the same folder, renamed into place)."""
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(
                    {"format": CACHE_FORMAT, "key": self.key, "record": record}, f, indent=1, default=str
                )
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


__all__ = [
    "CACHE_ENV",
    "CACHE_FORMAT",
    "CostCache",
    "cache_key",
    "default_cache_dir",
    "device_name",
    "key_digest",
    "model_fingerprint",
]
