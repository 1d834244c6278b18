"""Read an offline W&B run without a network or a W&B account.

wandb 0.31 writes an offline run only into its append-only transaction log
``<save_dir>/wandb/offline-run-*/run-<id>.wandb`` (no ``wandb-summary.json``), and ships no Python
reader for it.  The file is a 7-byte header (``:W&B``, a 2-byte magic, a 1-byte version) followed
by LevelDB-log framing: 32 KiB blocks counted from the start of the file, each record with a
7-byte header ``<IHB`` (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last); a block tail too
short for a header is zero padding.  Every record is a ``wandb_internal_pb2.Record``.

This module also decides whether a run should be offline: it is when no API key is available.
"""

from __future__ import annotations

import json
import netrc
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_bytescale.errors import ByteScaleError

__all__ = [
    "OfflineRun",
    "WandbFileError",
    "find_run_files",
    "has_wandb_api_key",
    "iter_records",
    "read_run",
    "wandb_offline_by_default",
]

_FILE_HEADER = 7
_BLOCK = 32 * 1024
_REC_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class WandbFileError(ByteScaleError, ValueError):
    """The file is not a W&B transaction log, or it is truncated/corrupt."""


def _frames(data: bytes) -> Iterator[bytes]:
    """Yield the logical records of a LevelDB-log framed byte string (after the file header)."""
    pos = _FILE_HEADER
    pending: list[bytes] = []
    while pos < len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _REC_HEADER:  # zero padding at a block tail
            pos += left_in_block
            continue
        if pos + _REC_HEADER > len(data):
            break
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pos += _REC_HEADER
        if kind == 0 and length == 0:  # preallocated/zeroed tail
            pos += left_in_block - _REC_HEADER
            continue
        if pos + length > len(data):
            break  # a record still being written when the file was read
        chunk = data[pos : pos + length]
        pos += length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = [chunk]
        elif kind == _MIDDLE:
            pending.append(chunk)
        elif kind == _LAST:
            pending.append(chunk)
            yield b"".join(pending)
            pending = []
        else:
            raise WandbFileError(f"unknown LevelDB-log record type {kind} at byte {pos - length - 7}")


def iter_records(path: str | os.PathLike[str]) -> Iterator[Any]:
    """Yield every ``wandb_internal_pb2.Record`` stored in a ``run-*.wandb`` file, in order."""
    # here, not at the top: wandb takes about 0.4 s to import, and bytescale-train imports this
    # module for wandb_offline_by_default / find_run_files before anything needs a record
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER or data[:4] != b":W&B":
        raise WandbFileError(f"{path} is not a W&B run file (missing ':W&B' header)")
    for raw in _frames(data):
        record = pb.Record()
        record.ParseFromString(raw)
        yield record


def _key(item: Any) -> str:
    if getattr(item, "nested_key", None):
        return "/".join(item.nested_key)
    return item.key


def _value(value_json: str) -> Any:
    try:
        return json.loads(value_json)
    except json.JSONDecodeError:
        return value_json


@dataclass
class OfflineRun:
    """What an offline run recorded: one dict per history row, the summary and the config."""

    path: Path
    run_id: str = ""
    project: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> set[str]:
        """Every key that appears in at least one history row."""
        return {k for row in self.history for k in row}

    def column(self, key: str) -> list[Any]:
        """The values of ``key`` in the rows that have it, in logging order."""
        return [row[key] for row in self.history if key in row]


def read_run(path: str | os.PathLike[str]) -> OfflineRun:
    """Parse a run: ``path`` is a ``run-*.wandb`` file or a run directory (or ``latest-run``)."""
    file = Path(path)
    if not file.exists():
        raise WandbFileError(f"{file} does not exist; pass a run-*.wandb file or an offline-run-* folder")
    if file.is_dir():
        found = sorted(file.glob("run-*.wandb"))
        if not found:
            raise WandbFileError(f"no run-*.wandb file in {file}")
        file = found[0]
    run = OfflineRun(path=file)
    for record in iter_records(file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_key(it): _value(it.value_json) for it in record.history.item})
        elif kind == "summary":
            for it in record.summary.update:
                run.summary[_key(it)] = _value(it.value_json)
            for it in record.summary.remove:
                run.summary.pop(_key(it), None)
        elif kind == "config":
            for it in record.config.update:
                run.config[_key(it)] = _value(it.value_json)
        elif kind == "run":
            run.run_id = record.run.run_id
            run.project = record.run.project
            for it in record.run.config.update:
                run.config[_key(it)] = _value(it.value_json)
    return run


def find_run_files(save_dir: str | os.PathLike[str]) -> list[Path]:
    """All ``run-*.wandb`` files under ``save_dir`` (newest directory last)."""
    return sorted(Path(save_dir).rglob("run-*.wandb"), key=lambda p: p.parent.name)


def has_wandb_api_key() -> bool:
    """True when W&B can authenticate: ``WANDB_API_KEY`` is set or ~/.netrc has api.wandb.ai."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].rstrip("/")
    netrc_path = os.environ.get("NETRC", os.path.join(os.path.expanduser("~"), ".netrc"))
    try:
        auth = netrc.netrc(netrc_path).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def wandb_offline_by_default() -> bool:
    """The offline decision when the config leaves it open.

    ``WANDB_MODE`` wins when set (``offline``/``dryrun`` -> offline, ``online`` -> online);
    otherwise a run is online only when an API key is available.
    """
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun"):
        return True
    if mode == "online":
        return False
    return not has_wandb_api_key()
