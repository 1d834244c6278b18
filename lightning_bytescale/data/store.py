"""The token store: all documents' tokens in one flat memory-mapped file, a length index, checksums.

Built once (``prepare_data``), then opened memory-mapped on every rank (``setup``), so no rank
holds the corpus in memory and workers share pages through the OS cache.

Files in a store folder:

* ``tokens.bin``: every document's tokens back to back, ``uint16`` when the vocabulary fits,
  else ``uint32``;
* ``mask.bin`` (loss-masked data only): one bit per token, little-endian bit order, set when
  the token is a loss target (its prediction is trained);
* ``index.bin``: a 64-byte header (magic ``BSTOKIDX``, format version, token item size,
  document count, token count, vocabulary size, checksum block size, end-of-document id,
  flags (bit 0: ``mask.bin`` exists), the largest token id, the index's own checksum), one
  ``uint32`` length per document (offsets are the running sum, computed at load), with a mask
  one ``uint32`` loss-token count per document, then one ``uint64`` xxh3 checksum per block of
  ``tokens.bin`` and, with a mask, one per block of ``mask.bin``;
* ``meta.json``: what the store was built from (source and tokenizer fingerprints, files).

The length index, and so every policy and plan, is by tokens: attention costs the same for a
token whether it is trained or not.  The mask only decides which labels reach the loss.

Nothing is trusted silently:

* opening checks the header, every size against every other, the lengths' sum and the
  index's own checksum (so lengths shifted by a few tokens with an unchanged sum are caught);
* token (and mask) blocks are checked against their checksums when first read in a process
  (``verify="lazy"``, the default: opening stays O(index), and a block costs one xxh3 pass,
  about 0.1 ms per MiB), all at open (``"full"``) or not at all (``"none"``);
* every read checks its ids against the vocabulary, and that a document ends with the
  end-of-document token when the tokenizer appends one.

Any inconsistency raises :class:`CorruptIndexError` (or :class:`CorruptTokensError`) naming the
store, what is wrong and ``rebuild=True``; an id outside the vocabulary raises
:class:`OutOfVocabularyError` naming the store and the document.

The *content hash* (:attr:`TokenStore.content_hash`) is the xxh3-128 of ``index.bin``: it
covers every length and, through the block checksums, every token and mask bit, costs nothing beyond
reading the index, and does not depend on where the store lies.  Ranks compare it (through the
step digest) so that ranks reading different data stop before any exchange.

Builds take a file lock beside the store (``<store>.lock``), remove what a killed build left
behind, write into a temporary folder and rename it into place, so readers never see half a
store and concurrent builders never collide.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import secrets
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash
from filelock import FileLock

from lightning_bytescale.data.encode import BuildProgress, MaskedTokens, encode_documents
from lightning_bytescale.data.errors import (
    CorruptIndexError,
    CorruptTokensError,
    DataError,
    EmptyDatasetError,
    OutOfVocabularyError,
    StoreNotFoundError,
)
from lightning_bytescale.data.sources import Document

log = logging.getLogger(__name__)

MAGIC = b"BSTOKIDX"
VERSION = 3
# magic, version, itemsize, num_docs, num_tokens, vocab_size, block_bytes, eos_id + 1 (0: none),
# flags, largest token id + 1 (0: unknown or no tokens), index checksum
_HEADER = struct.Struct("<8sIIQQQIIIIQ")
_HASH_AT = _HEADER.size - 8  # byte offset of the index checksum inside the header
HEADER_BYTES = 64
FLAG_MASK = 1  # the store has mask.bin and per-document loss-token counts
BLOCK_BYTES = 1 << 20  # checksum granularity of tokens.bin and mask.bin
TOKENS_FILE, INDEX_FILE, META_FILE, MASK_FILE = "tokens.bin", "index.bin", "meta.json", "mask.bin"
STORE_FILES = (TOKENS_FILE, INDEX_FILE, META_FILE)  # every store; mask.bin where the index says so
LAST_USED_FILE = "last_used"
VERIFY_MODES = ("lazy", "full", "none")
LEFTOVER_MARKS = (".tmp-", ".old-")
_SCAN_TOKENS = (
    1 << 24
)  # tokens compared at a time when searching the store for an id  # a build's temporary folder, a replaced store being removed


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def rebuild_hint(directory: Path) -> str:
    return (
        f"Rebuild it: pass rebuild=True to ByteScaleDataModule and run prepare_data() again "
        f"(or delete the folder {directory})."
    )


# ----------------------------------------------------------------------------------- building
_LOCKS: dict[tuple[int, str], FileLock] = {}


def store_lock(directory: str | Path) -> FileLock:
    """The build lock of a store folder: ``<folder>.lock`` beside it, one object per process.

    Re-entrant in one thread, so a caller may hold it around :func:`write_store`.
    """
    path = str(Path(directory).absolute()) + ".lock"
    key = (os.getpid(), path)  # a forked child makes its own: an inherited lock refuses to work
    lock = _LOCKS.get(key)
    if lock is None:
        lock = _LOCKS[key] = FileLock(path)
    return lock


def leftovers(directory: Path) -> list[Path]:
    """Folders that unfinished builds or replacements of this store left beside it."""
    out: list[Path] = []
    for p in directory.parent.glob(glob.escape(directory.name) + ".*-*"):
        rest = p.name[len(directory.name) :]
        if p.is_dir() and any(rest.startswith(mark) for mark in LEFTOVER_MARKS):
            out.append(p)
    return sorted(out)


def is_complete(directory: Path) -> bool:
    return all((directory / f).is_file() for f in STORE_FILES)


def make_dir(path: Path) -> Path:
    """``mkdir`` with the process's umask (``tempfile.mkdtemp`` would force mode 0700)."""
    os.mkdir(path, 0o777)
    return path


def write_store(
    directory: str | Path,
    documents: Iterable[Document],
    encode_batch,
    vocab_size: int,
    meta: dict | None = None,
    batch_docs: int = 256,
    *,
    eos_id: int | None = None,
    replace: bool = False,
    block_bytes: int = BLOCK_BYTES,
    loss_mask: bool = False,
    num_proc: int = 1,
    progress: bool | None = None,
    total: int | None = None,
) -> Path:
    """Tokenize ``documents`` and write a store at ``directory``, atomically and under its lock.

    Documents that are not token arrays (text, chat records) are encoded ``batch_docs`` at a
    time with ``encode_batch``, in ``num_proc`` processes (:mod:`.encode`); token arrays are
    stored as they are.  ``loss_mask``: every encoded document is a :class:`MaskedTokens` and
    the store keeps its mask (``mask.bin``).  ``eos_id``: the end-of-document token the
    tokenizer appends (checked on every read when all documents end with it).  ``progress``
    shows a bar while building (``None``: on a terminal); ``total`` is the expected number of
    documents, for the bar.  If a complete store already exists (another process finished it
    first) it is kept and ``documents`` is not read, unless ``replace``.  Folders left by killed
    builds of this store are removed first.  Returns the store folder.
    """
    directory = Path(directory)
    _check_block_bytes(block_bytes, token_dtype(vocab_size).itemsize)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with store_lock(directory):
            for old in leftovers(directory):
                shutil.rmtree(old, ignore_errors=True)
            if is_complete(directory) and not replace:
                return directory
            tmp = make_dir(directory.with_name(f"{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"))
            try:
                encoded = encode_documents(documents, encode_batch, batch_docs=batch_docs, num_proc=num_proc)
                bar = BuildProgress(f"tokenizing into {directory.name}", total, progress)
                try:
                    _build(tmp, directory, encoded, vocab_size, meta, eos_id, block_bytes, loss_mask, bar)
                finally:
                    bar.close()
                _publish(tmp, directory)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as err:
        raise DataError(
            f"cannot write the token store {directory}: {err.strerror or err}"
            f"{f' ({err.filename})' if err.filename else ''}; set cache_dir= (or $BYTESCALE_DATA_CACHE) "
            f"to a writable folder with enough free space"
        ) from err
    return directory


def _check_block_bytes(block_bytes: int, itemsize: int) -> None:
    if not (isinstance(block_bytes, int) and 0 < block_bytes < 2**32 and block_bytes % 4 == 0):
        raise DataError(f"block_bytes={block_bytes!r} must be a positive multiple of 4 below 2**32")
    if block_bytes % itemsize:
        raise DataError(f"block_bytes={block_bytes} must be a multiple of the token size {itemsize}")


class BlockSums:
    """xxh3-64 of every ``block_bytes`` of a byte stream, fed in pieces of any size (streamed)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.sums: list[int] = []
        self._hash = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data: bytes | memoryview) -> None:
        view, pos = memoryview(data), 0
        while pos < len(view):
            take = min(len(view) - pos, self.block_bytes - self._fill)
            self._hash.update(view[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == self.block_bytes:
                self.sums.append(self._hash.intdigest())
                self._hash.reset()
                self._fill = 0

    def finish(self) -> np.ndarray:
        if self._fill:
            self.sums.append(self._hash.intdigest())
            self._fill = 0
        return np.asarray(self.sums, dtype=np.uint64)


class BitWriter:
    """Packs a stream of booleans of any lengths into bytes (little-endian bit order)."""

    def __init__(self) -> None:
        self._rest = np.zeros(0, dtype=bool)

    def pack(self, bits: np.ndarray) -> bytes:
        bits = np.concatenate([self._rest, bits]) if self._rest.size else bits
        whole = bits.size - bits.size % 8
        self._rest = bits[whole:].copy()
        return np.packbits(bits[:whole], bitorder="little").tobytes()

    def finish(self) -> bytes:
        rest, self._rest = self._rest, np.zeros(0, dtype=bool)
        return np.packbits(rest, bitorder="little").tobytes() if rest.size else b""


@dataclass
class _Written:
    """What the builder learnt while writing the files (the index's contents)."""

    lengths: list[int] = field(default_factory=list)
    loss_counts: list[int] = field(default_factory=list)
    max_id: int = -1
    ends_with_eos: bool = True


def _build(
    tmp, directory, encoded, vocab_size, meta, eos_id, block_bytes, loss_mask, bar: BuildProgress
) -> None:
    dtype = token_dtype(vocab_size)
    sums, mask_sums, bits = BlockSums(block_bytes), BlockSums(block_bytes), BitWriter()
    seen = _Written(ends_with_eos=eos_id is not None)
    mask_fh = open(tmp / MASK_FILE, "wb") if loss_mask else None  # noqa: SIM115 - closed below
    try:
        with open(tmp / TOKENS_FILE, "wb") as fh:
            for doc in encoded:
                ids, mask = _split_encoded(doc, loss_mask, len(seen.lengths), directory)
                arr = _checked_doc(ids, vocab_size, len(seen.lengths), directory)
                raw = arr.astype(dtype, copy=False).tobytes()
                fh.write(raw)
                sums.update(raw)
                seen.lengths.append(int(arr.size))
                if arr.size:
                    seen.max_id = max(seen.max_id, int(arr.max()))
                    if seen.ends_with_eos and int(arr[-1]) != eos_id:
                        seen.ends_with_eos = False
                if mask_fh is not None:
                    mask = mask.copy()
                    mask[:1] = False  # the first token has nothing before it to predict it
                    seen.loss_counts.append(int(mask.sum()))
                    packed = bits.pack(mask)
                    mask_fh.write(packed)
                    mask_sums.update(packed)
                bar.update(int(arr.size))
        if mask_fh is not None:
            tail = bits.finish()
            mask_fh.write(tail)
            mask_sums.update(tail)
    finally:
        if mask_fh is not None:
            mask_fh.close()
    if not seen.lengths:
        raise EmptyDatasetError(
            f"the source yielded no documents (store {directory}); check the source's path, glob or split"
        )
    num_tokens = int(sum(seen.lengths))
    eos = eos_id if seen.ends_with_eos else None
    index = encode_index(
        np.asarray(seen.lengths, dtype=np.uint32),
        sums.finish(),
        dtype.itemsize,
        num_tokens,
        vocab_size,
        block_bytes,
        eos,
        max_id=seen.max_id if seen.max_id >= 0 else None,
        loss_counts=np.asarray(seen.loss_counts, dtype=np.uint32) if loss_mask else None,
        mask_sums=mask_sums.finish() if loss_mask else None,
    )
    with open(tmp / INDEX_FILE, "wb") as fh:
        fh.write(index)
    info = dict(
        meta or {},
        num_docs=len(seen.lengths),
        num_tokens=num_tokens,
        vocab_size=vocab_size,
        eos_id=eos,
        max_token_id=seen.max_id if seen.max_id >= 0 else None,
        loss_mask=bool(loss_mask),
        loss_tokens=int(sum(seen.loss_counts)) if loss_mask else None,
        build_seconds=round(bar.seconds, 3),
        content_hash=xxhash.xxh3_128_hexdigest(index),
        build_id=secrets.token_hex(8),
    )
    (tmp / META_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))
    log.info(
        "token store %s: %d documents, %d tokens in %.1f s (%.0f tokens/s)",
        directory, len(seen.lengths), num_tokens, bar.seconds, num_tokens / max(bar.seconds, 1e-9),
    )  # fmt: skip


def _split_encoded(doc, loss_mask: bool, i: int, directory: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """A document's ids and mask, checking that masks come exactly when the store keeps them."""
    if isinstance(doc, MaskedTokens):
        if not loss_mask:
            raise DataError(
                f"document {i} of store {directory} comes with a loss mask, but the store was not asked "
                f"to keep masks (write_store(..., loss_mask=True))"
            )
        return doc.ids, doc.mask
    if loss_mask:
        raise DataError(
            f"document {i} of store {directory} has no loss mask, but the store keeps one for every "
            f"document; the encoder must return MaskedTokens"
        )
    return np.asarray(doc), None


def _checked_doc(ids: np.ndarray, vocab_size: int, doc: int, directory: Path) -> np.ndarray:
    if ids.ndim != 1:
        raise DataError(
            f"document {doc} of store {directory}: token ids must be one-dimensional, got {ids.shape}"
        )
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"document {doc} of store {directory}: token ids must be integers, got {ids.dtype}")
    if ids.size >= 2**32:
        raise DataError(f"document {doc} has {ids.size} tokens; the store supports < 2**32 per document")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DataError(
            f"document {doc} has token ids outside [0, {vocab_size}); the tokenizer and vocab_size disagree"
        )
    return ids


def encode_index(
    lengths: np.ndarray,
    block_sums: np.ndarray,
    itemsize: int,
    num_tokens: int,
    vocab_size: int,
    block_bytes: int,
    eos_id: int | None,
    *,
    max_id: int | None = None,
    loss_counts: np.ndarray | None = None,
    mask_sums: np.ndarray | None = None,
) -> bytes:
    """The bytes of ``index.bin`` (header with its checksum, lengths, loss counts, block checksums).

    ``loss_counts`` and ``mask_sums`` go together: a store with a mask has both.
    """
    if (loss_counts is None) != (mask_sums is None):
        raise DataError("a loss-masked store needs both its loss counts and its mask checksums")
    eos = 0 if eos_id is None else eos_id + 1
    flags = FLAG_MASK if loss_counts is not None else 0
    top = 0 if max_id is None else max_id + 1
    head = _HEADER.pack(
        MAGIC, VERSION, itemsize, lengths.size, num_tokens, vocab_size, block_bytes, eos, flags, top, 0
    )
    head = head.ljust(HEADER_BYTES, b"\0")
    parts = [lengths.astype("<u4", copy=False).tobytes()]
    if loss_counts is not None:
        parts.append(loss_counts.astype("<u4", copy=False).tobytes())
    parts.append(block_sums.astype("<u8", copy=False).tobytes())
    if mask_sums is not None:
        parts.append(mask_sums.astype("<u8", copy=False).tobytes())
    body = b"".join(parts)
    check = xxhash.xxh3_64_intdigest(head + body)
    return head[:_HASH_AT] + struct.pack("<Q", check) + head[_HASH_AT + 8 :] + body


def _publish(tmp: Path, directory: Path) -> None:
    """Rename ``tmp`` into place; a store already there is moved aside first, then removed."""
    if directory.exists():
        old = directory.with_name(f"{directory.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(directory, old)
        os.rename(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, directory)


def read_meta(directory: Path) -> dict | None:
    """``meta.json`` of a store folder, or None when it is missing or unreadable."""
    try:
        return json.loads((Path(directory) / META_FILE).read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------- reading
def _map(path: Path, dtype: np.dtype, want_bytes: int, directory: Path) -> np.ndarray:
    """A store file memory-mapped read-only, after checking it still has the size it had at open."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise DataError(f"cannot read token store {directory}: {err.strerror or err}") from err
    if size != want_bytes:
        raise CorruptIndexError(
            f"token store {directory} changed while in use: {path} has {size} bytes, it had "
            f"{want_bytes} when opened (rebuilt or pruned under a running job?). " + rebuild_hint(directory)
        )
    if want_bytes == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap refuses empty files
    return np.memmap(path, dtype=dtype, mode="r")


def _blocks_to_check(lo_byte: int, hi_byte: int, block_bytes: int, done: np.ndarray | None) -> range | None:
    """The blocks of bytes ``[lo_byte, hi_byte)`` if any of them is not verified yet, else None."""
    first, last = lo_byte // block_bytes, (hi_byte - 1) // block_bytes
    if done is None or not (done[first] and done[last] and (last - first < 2 or done[first:last].all())):
        return range(first, last + 1)
    return None


def _verify_file_blocks(
    raw: np.ndarray, sums: np.ndarray, block_bytes: int, done: np.ndarray, blocks, bad
) -> int:
    """Check ``blocks`` of a mapped file against their checksums; ``bad(b, block)`` builds the error."""
    checked = 0
    for b in blocks:
        if done[b]:
            continue
        lo = b * block_bytes
        block = raw[lo : lo + block_bytes]
        if xxhash.xxh3_64_intdigest(memoryview(block)) != int(sums[b]):
            raise bad(b, block)
        done[b] = True
        checked += 1
    return checked


@dataclass
class TokenStore:
    """A verified, memory-mapped store.  Picklable: workers reopen the files lazily.

    ``vocab_limit``: ids must be below it (the store's vocabulary, or a smaller model's).
    Loss-masked stores (``has_mask``) also give each document's loss mask (:meth:`read_mask`)
    and loss-token count (``loss_counts``).
    """

    directory: Path
    lengths: np.ndarray  # int64 [num_docs]
    offsets: np.ndarray  # int64 [num_docs], start of each document in the token file
    vocab_size: int
    dtype: np.dtype
    block_sums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # uint64 [num_blocks]
    block_bytes: int = BLOCK_BYTES
    eos_id: int | None = None
    content_hash: str = ""
    verify: str = "lazy"
    vocab_limit: int = 0
    max_token_id: int | None = None  # the largest id in the store (None: unknown or no tokens)
    loss_counts: np.ndarray | None = None  # int64 [num_docs]: loss targets per document (mask only)
    mask_sums: np.ndarray | None = None  # uint64 [num_mask_blocks] (mask only)
    _verified: np.ndarray | None = None  # bool [num_blocks]: blocks checked in this process
    _tokens: np.memmap | None = None
    _raw: np.ndarray | None = None  # uint8 view of _tokens
    _mask_verified: np.ndarray | None = None  # bool [num_mask_blocks]
    _mask: np.ndarray | None = None  # uint8 map of mask.bin

    @classmethod
    def open(cls, directory: str | Path, verify: str = "lazy", vocab_limit: int | None = None) -> TokenStore:
        """Open and check a store; ``verify``: ``lazy`` (blocks on first read), ``full``, ``none``.

        ``vocab_limit``: the model's vocabulary size when it is smaller than the tokenizer's, so
        that an id the model cannot embed fails here, naming the document, instead of deep in
        the model.
        """
        if verify not in VERIFY_MODES:
            raise DataError(f"verify={verify!r}; use one of {VERIFY_MODES}")
        directory = Path(directory)
        if not directory.is_dir():
            raise StoreNotFoundError(
                f"no token store at {directory}; call the DataModule's prepare_data() (Lightning "
                f"does this on each node's local rank 0) before setup()"
            )
        missing = [f for f in STORE_FILES if not (directory / f).is_file()]
        if missing:
            raise CorruptIndexError(
                f"token store {directory} is incomplete: {', '.join(missing)} missing (a copy or a "
                f"clean-up removed files, or a build was interrupted by an older version). "
                + rebuild_hint(directory)
            )
        index = directory / INDEX_FILE
        try:
            raw = index.read_bytes()
            tok_size = (directory / TOKENS_FILE).stat().st_size
        except OSError as err:
            raise DataError(f"cannot read token store {directory}: {err.strerror or err}") from err
        lengths, sums, head = _decode_index(raw, tok_size, index, directory)
        offsets = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        limit = head["vocab"] if vocab_limit is None else min(int(vocab_limit), head["vocab"])
        if limit < 1:
            raise DataError(f"vocab_limit={vocab_limit} must be a positive vocabulary size")
        store = cls(
            directory, lengths, offsets, head["vocab"], np.dtype(f"uint{8 * head['itemsize']}"),
            block_sums=sums, block_bytes=head["block_bytes"], eos_id=head["eos"],
            content_hash=xxhash.xxh3_128_hexdigest(raw), verify=verify, vocab_limit=limit,
            max_token_id=head["max_id"], loss_counts=head["loss_counts"], mask_sums=head["mask_sums"],
        )  # fmt: skip
        if store.has_mask:
            _check_mask_file(directory, store.num_tokens)
        if verify == "full":
            store.verify_blocks()
            store.verify_mask_blocks()
        return store

    # -------------------------------------------------------------------------------- facts
    @property
    def num_docs(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_blocks(self) -> int:
        return int(self.block_sums.size)

    @property
    def has_mask(self) -> bool:
        """Whether the store keeps a loss mask (chat or prompt/completion data)."""
        return self.loss_counts is not None

    @property
    def num_loss_tokens(self) -> int:
        """Loss targets in the whole store (every token but each document's first, without a mask)."""
        if self.loss_counts is not None:
            return int(self.loss_counts.sum())
        return int(np.maximum(self.lengths - 1, 0).sum())

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            path = self.directory / TOKENS_FILE
            self._tokens = _map(path, self.dtype, self.num_tokens * self.dtype.itemsize, self.directory)
        return self._tokens

    @property
    def mask_bytes(self) -> np.ndarray:
        """``mask.bin`` mapped as bytes (loss-masked stores only)."""
        if not self.has_mask:
            raise DataError(f"token store {self.directory} has no loss mask (it was built without one)")
        if self._mask is None:
            path = self.directory / MASK_FILE
            self._mask = _map(path, np.dtype(np.uint8), -(-self.num_tokens // 8), self.directory)
        return self._mask

    # ------------------------------------------------------------------------------ reading
    def _doc_range(self, doc: int, start: int, length: int | None) -> tuple[int, int, int]:
        doc_len = int(self.lengths[doc])
        n = doc_len - start if length is None else length
        if start < 0 or n < 0 or start + n > doc_len:
            raise DataError(
                f"tokens [{start}, {start + n}) are outside document {doc} of token store "
                f"{self.directory} ({doc_len} tokens)"
            )
        return doc_len, int(self.offsets[doc]) + start, n

    def read(self, doc: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[start, start + length)`` of document ``doc`` as ``int64``, checked."""
        doc_len, base, n = self._doc_range(doc, start, length)
        if self.verify == "lazy" and n:
            self._verify_span(base, base + n)
        out = np.asarray(self.tokens[base : base + n], dtype=np.int64)
        if n and int(out.max()) >= self.vocab_limit:
            raise self._out_of_vocabulary(doc, out, start)
        if self.eos_id is not None and doc_len:
            last = (
                int(out[-1])
                if start + n == doc_len
                else int(self.tokens[int(self.offsets[doc]) + doc_len - 1])
            )
            if last != self.eos_id:
                raise CorruptIndexError(
                    f"token store {self.directory} is corrupt: document {doc} ({doc_len} tokens) does not end "
                    f"with the end-of-document token {self.eos_id} (it ends with {last}); index.bin and "
                    f"tokens.bin disagree on where documents start. " + rebuild_hint(self.directory)
                )
        return out

    def read_mask(self, doc: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """The loss mask (``bool``) of tokens ``[start, start + length)`` of document ``doc``.

        A whole document's mask is checked against its loss-token count in the index.
        """
        doc_len, base, n = self._doc_range(doc, start, length)
        raw = self.mask_bytes
        lo, hi = base >> 3, (base + n + 7) >> 3
        if self.verify == "lazy" and n:
            todo = _blocks_to_check(lo, hi, self.block_bytes, self._mask_verified)
            if todo is not None:
                self.verify_mask_blocks(todo)
        bits = np.unpackbits(np.asarray(raw[lo:hi]), bitorder="little")
        out = bits[base & 7 : (base & 7) + n].astype(bool)
        if start == 0 and n == doc_len and n:
            count = int(out[1:].sum())
            if out[0] or count != int(self.loss_counts[doc]):
                raise CorruptIndexError(
                    f"token store {self.directory} is corrupt: the loss mask of document {doc} has {count} "
                    f"loss tokens{' and marks its first token' if out[0] else ''}, the index says "
                    f"{int(self.loss_counts[doc])}; index.bin and {MASK_FILE} disagree. "
                    + rebuild_hint(self.directory)
                )
        return out

    def _out_of_vocabulary(self, doc: int, ids: np.ndarray, start: int) -> OutOfVocabularyError:
        pos = int(np.argmax(ids >= self.vocab_limit))
        whose = (
            f"the store's vocabulary (size {self.vocab_size})"
            if self.vocab_limit == self.vocab_size
            else f"the model's vocabulary (vocab_size={self.vocab_limit}; the tokenizer has {self.vocab_size})"
        )
        fix = (
            "The store is damaged. " + rebuild_hint(self.directory)
            if self.vocab_limit == self.vocab_size
            else "Give the model a vocabulary of at least the tokenizer's size, or use a tokenizer that fits the model."
        )
        return OutOfVocabularyError(
            f"token store {self.directory}: document {doc} holds token id {int(ids[pos])} at position "
            f"{start + pos}, outside {whose}. {fix}"
        )

    def first_out_of_vocabulary(self, limit: int) -> tuple[int, int, int] | None:
        """``(document, position, id)`` of the first id ``>= limit`` in the store, or None.

        Uses the index's largest id first, so a store that fits costs nothing; otherwise one
        pass over the tokens.
        """
        if self.max_token_id is not None and self.max_token_id < limit:
            return None
        tokens = self.tokens
        for lo in range(0, self.num_tokens, _SCAN_TOKENS):
            hits = np.flatnonzero(np.asarray(tokens[lo : lo + _SCAN_TOKENS]) >= limit)
            if hits.size:
                at = lo + int(hits[0])
                doc = int(np.searchsorted(self.offsets, at, side="right") - 1)
                return doc, at - int(self.offsets[doc]), int(tokens[at])
        return None

    # ---------------------------------------------------------------------------- verifying
    def verify_blocks(self, blocks: Iterable[int] | None = None) -> int:
        """Check token blocks against their checksums (all by default); returns how many were checked."""
        if self._verified is None:
            self._verified = np.zeros(self.num_blocks, dtype=bool)
        todo = range(self.num_blocks) if blocks is None else blocks
        return _verify_file_blocks(
            self._bytes(), self.block_sums, self.block_bytes, self._verified, todo, self._bad_block
        )

    def verify_mask_blocks(self, blocks: Iterable[int] | None = None) -> int:
        """Check ``mask.bin`` blocks against their checksums (all by default; none without a mask)."""
        if self.mask_sums is None:
            return 0
        if self._mask_verified is None:
            self._mask_verified = np.zeros(self.mask_sums.size, dtype=bool)
        todo = range(self.mask_sums.size) if blocks is None else blocks
        return _verify_file_blocks(
            self.mask_bytes, self.mask_sums, self.block_bytes, self._mask_verified, todo, self._bad_mask_block
        )

    def _bytes(self) -> np.ndarray:
        """``tokens.bin`` as bytes (a view of the mapping, made once)."""
        if self._raw is None:
            self._raw = self.tokens.view(np.uint8) if self.num_tokens else np.zeros(0, np.uint8)
        return self._raw

    def _verify_span(self, lo_token: int, hi_token: int) -> None:
        size = self.dtype.itemsize
        todo = _blocks_to_check(lo_token * size, hi_token * size, self.block_bytes, self._verified)
        if todo is not None:
            self.verify_blocks(todo)

    def _documents_of(self, lo: int, hi: int) -> tuple[int, int]:
        docs = np.searchsorted(self.offsets, [lo, hi - 1], side="right") - 1
        return int(docs[0]), int(docs[1])

    def _bad_block(self, b: int, block: np.ndarray) -> CorruptTokensError:
        size = self.dtype.itemsize
        lo, hi = b * self.block_bytes // size, (b * self.block_bytes + block.size) // size
        first, last = self._documents_of(lo, hi)
        ids = block.view(self.dtype)
        bad = np.flatnonzero(ids >= self.vocab_size)
        extra = ""
        if bad.size:
            at = lo + int(bad[0])
            doc = int(np.searchsorted(self.offsets, at, side="right") - 1)
            extra = (
                f"; document {doc} holds token id {int(ids[bad[0]])}, outside the vocabulary "
                f"(size {self.vocab_size})"
            )
        return CorruptTokensError(
            f"token store {self.directory} is corrupt: block {b} of {TOKENS_FILE} (tokens {lo}-{hi - 1}, "
            f"documents {first}-{last}) does not match the checksum written when the store "
            f"was built (the file was modified or damaged on disk){extra}. " + rebuild_hint(self.directory)
        )

    def _bad_mask_block(self, b: int, block: np.ndarray) -> CorruptTokensError:
        lo = b * self.block_bytes * 8
        hi = min(lo + block.size * 8, self.num_tokens)
        first, last = self._documents_of(lo, hi)
        return CorruptTokensError(
            f"token store {self.directory} is corrupt: block {b} of {MASK_FILE} (the loss mask of tokens "
            f"{lo}-{hi - 1}, documents {first}-{last}) does not match the checksum written when the store was "
            f"built (the file was modified or damaged on disk). " + rebuild_hint(self.directory)
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokens"] = state["_raw"] = state["_mask"] = None  # never pickle mapped data
        return state


def _check_mask_file(directory: Path, num_tokens: int) -> None:
    path = directory / MASK_FILE
    want = -(-num_tokens // 8)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptIndexError(
            f"token store {directory} is incomplete: its index announces a loss mask but {MASK_FILE} is "
            f"missing (a copy or a clean-up removed it). " + rebuild_hint(directory)
        ) from None
    except OSError as err:
        raise DataError(f"cannot read token store {directory}: {err.strerror or err}") from err
    if size != want:
        raise CorruptIndexError(
            f"token store index {directory / INDEX_FILE} is corrupt: {path} has {size} bytes, but the index "
            f"announces {num_tokens} tokens, one mask bit each ({want} bytes). " + rebuild_hint(directory)
        )


def _decode_index(
    raw: bytes, tok_size: int, index: Path, directory: Path
) -> tuple[np.ndarray, np.ndarray, dict]:
    def corrupt(why: str) -> CorruptIndexError:
        return CorruptIndexError(f"token store index {index} is corrupt: {why}. " + rebuild_hint(directory))

    if len(raw) < HEADER_BYTES:
        raise corrupt(f"the file has {len(raw)} bytes, less than its {HEADER_BYTES}-byte header")
    magic, version, itemsize, num_docs, num_tokens, vocab, block_bytes, eos, flags, top, check = (
        _HEADER.unpack(raw[: _HEADER.size])
    )
    if magic != MAGIC:
        raise corrupt(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise corrupt(f"format version {version}, this package reads version {VERSION}")
    if itemsize not in (2, 4) or np.dtype(f"uint{8 * itemsize}") != token_dtype(vocab):
        raise corrupt(f"token item size {itemsize} does not fit vocabulary size {vocab}")
    if block_bytes == 0 or block_bytes % itemsize:
        raise corrupt(f"checksum block size {block_bytes} is not a positive multiple of {itemsize}")
    if flags & ~FLAG_MASK:
        raise corrupt(f"unknown flags {flags:#x}")
    masked = bool(flags & FLAG_MASK)
    num_blocks = -(-num_tokens * itemsize // block_bytes)
    mask_bytes = -(-num_tokens // 8)
    num_mask_blocks = -(-mask_bytes // block_bytes) if masked else 0
    want = HEADER_BYTES + 4 * num_docs * (2 if masked else 1) + 8 * (num_blocks + num_mask_blocks)
    if len(raw) != want:
        what = f"{num_docs} documents{' with loss counts' if masked else ''}, {num_blocks} checksum blocks"
        if masked:
            what += f" and {num_mask_blocks} mask checksum blocks"
        raise corrupt(f"{len(raw)} bytes, but the header announces {what} ({want} bytes)")
    zeroed = raw[:_HASH_AT] + b"\0" * 8 + raw[_HASH_AT + 8 :]
    if xxhash.xxh3_64_intdigest(zeroed) != check:
        raise corrupt("its checksum does not match its contents (lengths or checksums were modified)")
    if tok_size != itemsize * num_tokens:
        raise corrupt(
            f"{directory / TOKENS_FILE} has {tok_size} bytes, but the index announces {num_tokens} tokens "
            f"of {itemsize} bytes"
        )
    at = HEADER_BYTES
    lengths = np.frombuffer(raw, dtype="<u4", count=num_docs, offset=at).astype(np.int64)
    at += 4 * num_docs
    if int(lengths.sum()) != num_tokens:
        raise corrupt(f"document lengths sum to {int(lengths.sum())}, not {num_tokens}")
    loss_counts = None
    if masked:
        loss_counts = np.frombuffer(raw, dtype="<u4", count=num_docs, offset=at).astype(np.int64)
        at += 4 * num_docs
        over = np.flatnonzero(loss_counts > np.maximum(lengths - 1, 0))
        if over.size:
            d = int(over[0])
            raise corrupt(
                f"document {d} has {int(loss_counts[d])} loss tokens but only {int(lengths[d])} tokens"
            )
    sums = np.frombuffer(raw, dtype="<u8", count=num_blocks, offset=at).astype(np.uint64)
    at += 8 * num_blocks
    mask_sums = (
        np.frombuffer(raw, dtype="<u8", count=num_mask_blocks, offset=at).astype(np.uint64)
        if masked
        else None
    )
    if top > vocab:
        raise corrupt(f"the largest token id {top - 1} is outside the vocabulary (size {vocab})")
    head = dict(
        itemsize=itemsize, vocab=int(vocab), block_bytes=int(block_bytes), eos=None if eos == 0 else eos - 1,
        max_id=None if top == 0 else int(top - 1), loss_counts=loss_counts, mask_sums=mask_sums,
    )  # fmt: skip
    return lengths, sums, head
