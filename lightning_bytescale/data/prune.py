"""Removing token stores nobody needs: stale versions, leftovers of killed builds, unused stores.

A store folder is named after the fingerprint of its source's content, so every edit of a
corpus makes a new store and the old one stays behind.  :func:`prune_cache` removes, from a
cache folder:

* ``leftover``: temporary folders of builds that were killed (or replaced stores whose removal
  was interrupted);
* ``incomplete``: store folders that lack one of their files;
* ``unusable``: stores whose index is damaged or of another format version (older releases);
* ``stale``: stores of a file source whose files changed or vanished since the build (their
  recorded content digests no longer match; a size change is enough, else the file is hashed);
  with ``source_key`` given, instead every store of that source except those in ``keep``;
* ``unused``: with ``unused_days``, stores not prepared for that many days.

Nothing is removed while its build lock is held, nor anything in ``keep``.  A store that a
*running* job reads must not be pruned: its loader workers reopen the files by path.

``python -m lightning_bytescale.data prune --cache-dir DIR [--unused-days N] [--dry-run]`` runs
it from a shell; ``ByteScaleDataModule(prune_stale=True)`` prunes the older stores of its own
source after ``prepare_data``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from filelock import Timeout

from lightning_bytescale.data.errors import DataError
from lightning_bytescale.data.sources import FileStamp, file_digest, stamps_from_lists
from lightning_bytescale.data.store import (
    LAST_USED_FILE,
    LEFTOVER_MARKS,
    META_FILE,
    STORE_FILES,
    TokenStore,
    read_meta,
    store_lock,
)

STORE_PREFIX = "store-"


def default_cache_dir() -> Path:
    """``$BYTESCALE_DATA_CACHE``, else ``~/.cache/lightning_bytescale/data``."""
    env = os.environ.get("BYTESCALE_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lightning_bytescale" / "data"


@dataclass(frozen=True)
class PruneAction:
    """One folder removed (or, in a dry run, that would be)."""

    path: Path
    reason: str  # leftover | incomplete | unusable | stale | unused
    detail: str
    bytes: int


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def last_used(store: Path) -> float:
    """When a store was last prepared (``last_used`` stamp, else its build time)."""
    for name in (LAST_USED_FILE, META_FILE):
        try:
            return (store / name).stat().st_mtime
        except OSError:
            continue
    return store.stat().st_mtime


def _source_changed(rows: list) -> str | None:
    """Why a store's recorded files no longer match the disk (None: they all match)."""
    for stamp in stamps_from_lists(rows):
        path = Path(stamp.path)
        try:
            size = path.stat().st_size
        except OSError:
            return f"{stamp.path} is gone"
        if size != stamp.size:
            return f"{stamp.path} changed size ({stamp.size} -> {size} bytes)"
        now: FileStamp = file_digest(path)
        if now.digest != stamp.digest:
            return f"{stamp.path} changed content"
    return None


def _verdict(store: Path, source_key: str | None, unused_days: float | None) -> tuple[str, str] | None:
    name = store.name
    base = next((name[: name.index(m)] for m in LEFTOVER_MARKS if m in name), None)
    if base is not None:
        return "leftover", f"left by an unfinished build or replacement of {base}"
    missing = [f for f in STORE_FILES if not (store / f).is_file()]
    if missing:
        return "incomplete", f"{', '.join(missing)} missing"
    try:
        TokenStore.open(store, verify="none")  # reads the index only
    except DataError as err:  # damaged, or written in another format version
        return "unusable", str(err).split(". ")[0]
    meta = read_meta(store) or {}
    if source_key is not None:
        if meta.get("source_key") == source_key:
            return "stale", "an older version of the data module's source"
        return None
    rows = meta.get("files")
    if rows:
        why = _source_changed(rows)
        if why:
            return "stale", why
    if unused_days is not None:
        idle = (time.time() - last_used(store)) / 86400
        if idle > unused_days:
            return "unused", f"not prepared for {idle:.1f} days"
    return None


def prune_cache(
    cache_dir: str | Path,
    *,
    keep: Iterable[str | Path] = (),
    source_key: str | None = None,
    unused_days: float | None = None,
    dry_run: bool = False,
) -> list[PruneAction]:
    """Remove stale, incomplete, leftover (and, with ``unused_days``, unused) stores; see the module doc."""
    cache = Path(cache_dir)
    if not cache.is_dir():
        return []
    kept = {Path(p).absolute() for p in keep}
    actions: list[PruneAction] = []
    for folder in sorted(cache.glob(STORE_PREFIX + "*")):
        if not folder.is_dir() or folder.absolute() in kept:
            continue
        owner = folder.name
        for mark in LEFTOVER_MARKS:
            owner = owner.split(mark)[0]
        lock = store_lock(cache / owner)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue  # a build of this store is running
        try:
            verdict = _verdict(folder, source_key, unused_days)
            if verdict is None:
                continue
            size = folder_bytes(folder)
            if not dry_run:
                shutil.rmtree(folder)
            actions.append(PruneAction(folder, verdict[0], verdict[1], size))
        finally:
            lock.release()
    return actions
