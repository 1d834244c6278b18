"""``bytescale-data`` (or ``python -m lightning_bytescale.data``): list, verify and prune the token stores of a cache.

* ``list``: every store with its size, documents, tokens, content hash and last use;
* ``verify STORE...``: check every block of ``tokens.bin`` against its checksum (exit 1 on damage);
* ``prune``: remove stale stores, leftovers of killed builds, incomplete stores and, with
  ``--unused-days N``, stores not prepared for N days (``--dry-run`` only lists them).

The cache defaults to the data module's: ``$BYTESCALE_DATA_CACHE`` or
``~/.cache/lightning_bytescale/data``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_bytescale.data.errors import DataError
from lightning_bytescale.data.prune import (
    STORE_PREFIX,
    default_cache_dir,
    folder_bytes,
    last_used,
    prune_cache,
)
from lightning_bytescale.data.store import TokenStore


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _list(cache: Path) -> int:
    for folder in sorted(cache.glob(STORE_PREFIX + "*")):
        if not folder.is_dir():
            continue
        idle = (time.time() - last_used(folder)) / 86400
        try:
            store = TokenStore.open(folder, verify="none")
            facts = f"{store.num_docs} docs, {store.num_tokens} tokens, content {store.content_hash[:16]}"
        except DataError as err:
            facts = f"unusable: {str(err).split('. ')[0]}"
        print(f"{folder}  {_mib(folder_bytes(folder))}  used {idle:.1f} days ago  {facts}")
    return 0


def _verify(stores: Sequence[str]) -> int:
    bad = 0
    for path in stores:
        start = time.perf_counter()
        try:
            store = TokenStore.open(path, verify="full")
        except DataError as err:
            print(f"DAMAGED {path}: {err}")
            bad += 1
            continue
        dt = time.perf_counter() - start
        print(
            f"ok {path}: {store.num_blocks} blocks, {_mib(store.num_tokens * store.dtype.itemsize)} in {dt:.2f} s"
        )
    return 1 if bad else 0


def _prune(cache: Path, unused_days: float | None, dry_run: bool) -> int:
    actions = prune_cache(cache, unused_days=unused_days, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for act in actions:
        print(f"{verb} {act.path} ({act.reason}: {act.detail}; {_mib(act.bytes)})")
    total = sum(a.bytes for a in actions)
    print(f"{verb} {len(actions)} folder(s), {_mib(total)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bytescale-data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "prune"):
        p = sub.add_parser(name)
        p.add_argument("--cache-dir", type=Path, default=None, help="the token store cache folder")
        if name == "prune":
            p.add_argument(
                "--unused-days", type=float, default=None, help="also remove stores unused this long"
            )
            p.add_argument(
                "--dry-run", action="store_true", help="list what would be removed, remove nothing"
            )
    p = sub.add_parser("verify")
    p.add_argument("stores", nargs="+", help="store folders to check block by block")
    args = parser.parse_args(argv)
    if args.command == "verify":
        return _verify(args.stores)
    cache = args.cache_dir or default_cache_dir()
    if args.command == "list":
        return _list(cache)
    return _prune(cache, args.unused_days, args.dry_run)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
