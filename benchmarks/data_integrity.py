"""What verified token stores and content fingerprints cost, on a store of about 1 GiB.

Measures, on this machine (page cache warm: the files were just written; a cold read is bound
by the disk instead):

* content hashing of a 1 GiB source file: xxh3-128 (what source fingerprints use) against
  hashlib's blake2b and sha256;
* building the store: total time, and the share spent on the per-block checksums;
* opening it: index checks only (``verify="lazy"``/``"none"``) and every block (``"full"``);
* reading every document in random order (best of ``--repeats``) with ``verify="none"``, ``"lazy"`` (first pass, which
  checks each block once, and a second pass) and a bare memmap slice (no checks at all).

Writes ``benchmarks/results/data_integrity.json``.

    python benchmarks/data_integrity.py [--gib 1.0] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from lightning_bytescale.data.sources import file_digest
from lightning_bytescale.data.store import BLOCK_BYTES, BlockSums, TokenStore, write_store

VOCAB = 50_000  # uint16 tokens


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def hashlib_file(path: Path, name: str) -> str:
    h = hashlib.new(name)
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_all(store: TokenStore, order: np.ndarray) -> int:
    total = 0
    for d in order:
        total += store.read(int(d)).size
    return total


def read_bare(store: TokenStore, order: np.ndarray) -> int:
    tokens, total = store.tokens, 0
    for d in order:
        lo = int(store.offsets[d])
        total += np.asarray(tokens[lo : lo + int(store.lengths[d])], dtype=np.int64).size
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="store size in GiB")
    ap.add_argument("--mean-doc", type=int, default=2048, help="mean document length in tokens")
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    ap.add_argument("--repeats", type=int, default=3, help="read passes per configuration (the best counts)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_integrity.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bytescale-integrity-", dir=args.workdir))
    gib = 2**30
    try:
        rng = np.random.default_rng(0)
        num_tokens = int(args.gib * gib) // 2
        tokens = rng.integers(0, VOCAB, size=num_tokens, dtype=np.uint16)
        lengths = np.maximum(
            1, rng.lognormal(np.log(args.mean_doc) - 0.5, 1.0, size=2 * num_tokens // args.mean_doc)
        )
        cuts = np.cumsum(lengths.astype(np.int64))
        cuts = cuts[cuts < num_tokens]
        bounds = np.concatenate([[0], cuts, [num_tokens]])
        num_docs = bounds.size - 1

        # 1. hashing a 1 GiB source file
        src = work / "source.bin"
        tokens.tofile(src)
        size = src.stat().st_size
        hashing = {}
        for name, fn in (
            ("xxh3_128", lambda: file_digest(src)),
            ("blake2b", lambda: hashlib_file(src, "blake2b")),
            ("sha256", lambda: hashlib_file(src, "sha256")),
        ):
            fn()  # warm the page cache and the code
            dt = min(timed(fn)[0] for _ in range(args.repeats))
            hashing[name] = {"seconds": round(dt, 3), "gb_per_s": round(size / dt / 1e9, 2)}
        src.unlink()

        # 2. building: total, and the checksum share (the same bytes in document-sized pieces)
        docs = (tokens[bounds[i] : bounds[i + 1]] for i in range(num_docs))
        build_s, store_dir = timed(lambda: write_store(work / "store", docs, None, VOCAB))
        raw = memoryview(tokens.view(np.uint8))
        pieces = [raw[2 * bounds[i] : 2 * bounds[i + 1]] for i in range(num_docs)]

        def checksums() -> None:
            sums = BlockSums(BLOCK_BYTES)
            for piece in pieces:
                sums.update(piece)
            sums.finish()

        sum_s = min(timed(checksums)[0] for _ in range(args.repeats))

        # 3. opening
        open_lazy_s, store = timed(lambda: TokenStore.open(store_dir))
        open_full_s = min(
            timed(lambda: TokenStore.open(store_dir, verify="full"))[0] for _ in range(args.repeats)
        )

        # 4. reading every document in random order (best of --repeats, configurations interleaved:
        #    the machine is shared, so single passes are noisy)
        order = np.random.default_rng(1).permutation(num_docs)
        reads: dict[str, float] = {}

        def best(name: str, seconds: float) -> None:
            reads[name] = min(seconds, reads.get(name, float("inf")))

        for _ in range(args.repeats):
            dt, n = timed(lambda: read_bare(TokenStore.open(store_dir, verify="none"), order))
            best("bare_memmap_slice", dt)
            best("verify_none", timed(lambda: read_all(TokenStore.open(store_dir, verify="none"), order))[0])
            lazy = TokenStore.open(store_dir)
            best("verify_lazy_first_pass", timed(lambda: read_all(lazy, order))[0])  # noqa: B023
            best("verify_lazy_second_pass", timed(lambda: read_all(lazy, order))[0])  # noqa: B023
        assert n == store.num_tokens

        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), {platform.python_version()}",
            "page_cache": "warm (files just written)",
            "store": {
                "tokens": store.num_tokens,
                "documents": num_docs,
                "tokens_bin_bytes": store.num_tokens * 2,
                "index_bytes": (store_dir / "index.bin").stat().st_size,
                "block_bytes": BLOCK_BYTES,
                "blocks": store.num_blocks,
            },
            "hash_1gib_file": {"bytes": size, **hashing},
            "build": {
                "seconds": round(build_s, 2),
                "checksum_seconds": round(sum_s, 3),
                "checksum_share": round(sum_s / build_s, 4),
            },
            "open": {
                "index_checks_seconds": round(open_lazy_s, 4),
                "full_verify_seconds": round(open_full_s, 3),
                "full_verify_gb_per_s": round(store.num_tokens * 2 / open_full_s / 1e9, 2),
            },  # fmt: skip
            "read_all_documents_random_order": {
                **{k: round(v, 3) for k, v in reads.items()},
                "us_per_document": {k: round(v / num_docs * 1e6, 2) for k, v in reads.items()},
                "lazy_first_pass_overhead_vs_none": round(
                    reads["verify_lazy_first_pass"] / reads["verify_none"] - 1, 3
                ),
                "checks_overhead_vs_bare": round(reads["verify_none"] / reads["bare_memmap_slice"] - 1, 3),
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
