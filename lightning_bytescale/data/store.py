"""The token store: all documents' tokens in one flat memory-mapped file, a length index, checksums.

Built once (``prepare_data``), then opened memory-mapped on every rank (``setup``), so no rank
holds the corpus in memory and workers share pages through the OS cache.

Files in a store folder:

* ``tokens.bin``: every document's tokens back to back, ``uint16`` when the vocabulary fits,
  else ``uint32``;
* ``index.bin``: a 64-byte header (magic ``BSTOKIDX``, format version, token item size,
  document count, token count, vocabulary size, checksum block size, end-of-document id, the
  index's own checksum), one ``uint32`` length per document (offsets are the running sum,
  computed at load), then one ``uint64`` xxh3 checksum per block of ``tokens.bin``;
* ``meta.json``: what the store was built from (source and tokenizer fingerprints, files).

Nothing is trusted silently:

* opening checks the header, every size against every other, the lengths' sum and the
  index's own checksum (so lengths shifted by a few tokens with an unchanged sum are caught);
* token blocks are checked against their checksums when first read in a process
  (``verify="lazy"``, the default: opening stays O(index), and a block costs one xxh3 pass,
  about 0.1 ms per MiB), all at open (``"full"``) or not at all (``"none"``);
* every read checks its ids against the vocabulary, and that a document ends with the
  end-of-document token when the tokenizer appends one.

Any inconsistency raises :class:`CorruptIndexError` (or :class:`CorruptTokensError`) naming the
store, what is wrong and ``rebuild=True``; an id outside the vocabulary raises
:class:`OutOfVocabularyError` naming the store and the document.

The *content hash* (:attr:`TokenStore.content_hash`) is the xxh3-128 of ``index.bin``: it
covers every length and, through the block checksums, every token, costs nothing beyond
reading the index, and does not depend on where the store lies.  Ranks compare it (through the
step digest) so that ranks reading different data stop before any exchange.

Builds take a file lock beside the store (``<store>.lock``), remove what a killed build left
behind, write into a temporary folder and rename it into place, so readers never see half a
store and concurrent builders never collide.
"""

from __future__ import annotations

import glob
import json
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

from lightning_bytescale.data.errors import (
    CorruptIndexError,
    CorruptTokensError,
    DataError,
    EmptyDatasetError,
    OutOfVocabularyError,
    StoreNotFoundError,
)
from lightning_bytescale.data.sources import Document

MAGIC = b"BSTOKIDX"
VERSION = 2
# magic, version, itemsize, num_docs, num_tokens, vocab_size, block_bytes, eos_id + 1 (0: none), index checksum
_HEADER = struct.Struct("<8sIIQQQIIQ")
_HASH_AT = _HEADER.size - 8  # byte offset of the index checksum inside the header
HEADER_BYTES = 64
BLOCK_BYTES = 1 << 20  # checksum granularity of tokens.bin
TOKENS_FILE, INDEX_FILE, META_FILE = "tokens.bin", "index.bin", "meta.json"
STORE_FILES = (TOKENS_FILE, INDEX_FILE, META_FILE)
LAST_USED_FILE = "last_used"
VERIFY_MODES = ("lazy", "full", "none")
LEFTOVER_MARKS = (".tmp-", ".old-")  # a build's temporary folder, a replaced store being removed


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def rebuild_hint(directory: Path) -> str:
    return (
        f"Rebuild it: pass rebuild=True to ByteScaleDataModule and run prepare_data() again "
        f"(or delete the folder {directory})."
    )


# ----------------------------------------------------------------------------------- building
_LOCKS: dict[str, FileLock] = {}


def store_lock(directory: str | Path) -> FileLock:
    """The build lock of a store folder: ``<folder>.lock`` beside it, one object per process.

    Re-entrant in one thread, so a caller may hold it around :func:`write_store`.
    """
    path = str(Path(directory).absolute()) + ".lock"
    lock = _LOCKS.get(path)
    if lock is None:
        lock = _LOCKS[path] = FileLock(path)
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
) -> Path:
    """Tokenize ``documents`` and write a store at ``directory``, atomically and under its lock.

    Text documents are encoded ``batch_docs`` at a time with ``encode_batch``; token arrays are
    stored as they are.  ``eos_id``: the end-of-document token the tokenizer appends (checked on
    every read when all documents end with it).  If a complete store already exists (another
    process finished it first) it is kept and ``documents`` is not read, unless ``replace``.
    Folders left by killed builds of this store are removed first.  Returns the store folder.
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
                _build(
                    tmp, directory, documents, encode_batch, vocab_size, meta, batch_docs, eos_id, block_bytes
                )
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


def _build(
    tmp, directory, documents, encode_batch, vocab_size, meta, batch_docs, eos_id, block_bytes
) -> None:
    dtype = token_dtype(vocab_size)
    lengths: list[int] = []
    sums = BlockSums(block_bytes)
    ends_with_eos = eos_id is not None
    with open(tmp / TOKENS_FILE, "wb") as fh:
        pending: list[str] = []

        def put(ids) -> None:
            nonlocal ends_with_eos
            arr = _checked_doc(np.asarray(ids), vocab_size, len(lengths), directory)
            raw = arr.astype(dtype, copy=False).tobytes()
            fh.write(raw)
            sums.update(raw)
            lengths.append(int(arr.size))
            if arr.size and ends_with_eos and int(arr[-1]) != eos_id:
                ends_with_eos = False

        def flush_text() -> None:
            if not pending:
                return
            if encode_batch is None:
                raise DataError("text documents need a tokenizer (encode_batch)")
            for ids in encode_batch(pending):
                put(ids)
            pending.clear()

        for doc in documents:
            if isinstance(doc, str):
                pending.append(doc)
                if len(pending) >= batch_docs:
                    flush_text()
            else:
                flush_text()
                put(doc)
        flush_text()
    if not lengths:
        raise EmptyDatasetError(
            f"the source yielded no documents (store {directory}); check the source's path, glob or split"
        )
    num_tokens = int(sum(lengths))
    eos = eos_id if ends_with_eos else None
    index = encode_index(
        np.asarray(lengths, dtype=np.uint32),
        sums.finish(),
        dtype.itemsize,
        num_tokens,
        vocab_size,
        block_bytes,
        eos,
    )
    with open(tmp / INDEX_FILE, "wb") as fh:
        fh.write(index)
    info = dict(
        meta or {},
        num_docs=len(lengths),
        num_tokens=num_tokens,
        vocab_size=vocab_size,
        eos_id=eos,
        content_hash=xxhash.xxh3_128_hexdigest(index),
        build_id=secrets.token_hex(8),
    )
    (tmp / META_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))


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
) -> bytes:
    """The bytes of ``index.bin`` (header with its checksum, lengths, block checksums)."""
    eos = 0 if eos_id is None else eos_id + 1
    head = _HEADER.pack(MAGIC, VERSION, itemsize, lengths.size, num_tokens, vocab_size, block_bytes, eos, 0)
    head = head.ljust(HEADER_BYTES, b"\0")
    body = lengths.astype("<u4", copy=False).tobytes() + block_sums.astype("<u8", copy=False).tobytes()
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
@dataclass
class TokenStore:
    """A verified, memory-mapped store.  Picklable: workers reopen the files lazily.

    ``vocab_limit``: ids must be below it (the store's vocabulary, or a smaller model's).
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
    _verified: np.ndarray | None = None  # bool [num_blocks]: blocks checked in this process
    _tokens: np.memmap | None = None
    _raw: np.ndarray | None = None  # uint8 view of _tokens

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
        )  # fmt: skip
        if verify == "full":
            store.verify_blocks()
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
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            path = self.directory / TOKENS_FILE
            want = self.num_tokens * self.dtype.itemsize
            try:
                size = path.stat().st_size
            except OSError as err:
                raise DataError(f"cannot read token store {self.directory}: {err.strerror or err}") from err
            if size != want:
                raise CorruptIndexError(
                    f"token store {self.directory} changed while in use: {path} has {size} bytes, it had "
                    f"{want} when opened (rebuilt or pruned under a running job?). "
                    + rebuild_hint(self.directory)
                )
            if self.num_tokens == 0:
                self._tokens = np.zeros(0, dtype=self.dtype)  # np.memmap refuses empty files
            else:
                self._tokens = np.memmap(path, dtype=self.dtype, mode="r")
        return self._tokens

    # ------------------------------------------------------------------------------ reading
    def read(self, doc: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[start, start + length)`` of document ``doc`` as ``int64``, checked."""
        doc_len = int(self.lengths[doc])
        n = doc_len - start if length is None else length
        if start < 0 or n < 0 or start + n > doc_len:
            raise DataError(
                f"tokens [{start}, {start + n}) are outside document {doc} of token store "
                f"{self.directory} ({doc_len} tokens)"
            )
        base = int(self.offsets[doc]) + start
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

    # ---------------------------------------------------------------------------- verifying
    def verify_blocks(self, blocks: Iterable[int] | None = None) -> int:
        """Check token blocks against their checksums (all by default); returns how many were checked."""
        todo = range(self.num_blocks) if blocks is None else blocks
        if self._verified is None:
            self._verified = np.zeros(self.num_blocks, dtype=bool)
        raw = self._bytes()
        checked = 0
        for b in todo:
            if self._verified[b]:
                continue
            lo = b * self.block_bytes
            block = raw[lo : lo + self.block_bytes]
            if xxhash.xxh3_64_intdigest(memoryview(block)) != int(self.block_sums[b]):
                raise self._bad_block(b, block)
            self._verified[b] = True
            checked += 1
        return checked

    def _bytes(self) -> np.ndarray:
        """``tokens.bin`` as bytes (a view of the mapping, made once)."""
        if self._raw is None:
            self._raw = self.tokens.view(np.uint8) if self.num_tokens else np.zeros(0, np.uint8)
        return self._raw

    def _verify_span(self, lo_token: int, hi_token: int) -> None:
        size = self.dtype.itemsize
        first, last = lo_token * size // self.block_bytes, (hi_token * size - 1) // self.block_bytes
        done = self._verified
        if done is None or not (done[first] and done[last] and (last - first < 2 or done[first:last].all())):
            self.verify_blocks(range(first, last + 1))

    def _bad_block(self, b: int, block: np.ndarray) -> CorruptTokensError:
        size = self.dtype.itemsize
        lo, hi = b * self.block_bytes // size, (b * self.block_bytes + block.size) // size
        docs = np.searchsorted(self.offsets, [lo, hi - 1], side="right") - 1
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
            f"documents {int(docs[0])}-{int(docs[1])}) does not match the checksum written when the store "
            f"was built (the file was modified or damaged on disk){extra}. " + rebuild_hint(self.directory)
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokens"] = state["_raw"] = None  # never pickle the mapped data; reopen in the worker
        return state


def _decode_index(
    raw: bytes, tok_size: int, index: Path, directory: Path
) -> tuple[np.ndarray, np.ndarray, dict]:
    def corrupt(why: str) -> CorruptIndexError:
        return CorruptIndexError(f"token store index {index} is corrupt: {why}. " + rebuild_hint(directory))

    if len(raw) < HEADER_BYTES:
        raise corrupt(f"the file has {len(raw)} bytes, less than its {HEADER_BYTES}-byte header")
    magic, version, itemsize, num_docs, num_tokens, vocab, block_bytes, eos, check = _HEADER.unpack(
        raw[: _HEADER.size]
    )
    if magic != MAGIC:
        raise corrupt(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise corrupt(f"format version {version}, this package reads version {VERSION}")
    if itemsize not in (2, 4) or np.dtype(f"uint{8 * itemsize}") != token_dtype(vocab):
        raise corrupt(f"token item size {itemsize} does not fit vocabulary size {vocab}")
    if block_bytes == 0 or block_bytes % itemsize:
        raise corrupt(f"checksum block size {block_bytes} is not a positive multiple of {itemsize}")
    num_blocks = -(-num_tokens * itemsize // block_bytes)
    want = HEADER_BYTES + 4 * num_docs + 8 * num_blocks
    if len(raw) != want:
        raise corrupt(
            f"{len(raw)} bytes, but the header announces {num_docs} documents and {num_blocks} checksum "
            f"blocks ({want} bytes)"
        )
    zeroed = raw[:_HASH_AT] + b"\0" * 8 + raw[_HASH_AT + 8 :]
    if xxhash.xxh3_64_intdigest(zeroed) != check:
        raise corrupt("its checksum does not match its contents (lengths or checksums were modified)")
    if tok_size != itemsize * num_tokens:
        raise corrupt(
            f"{directory / TOKENS_FILE} has {tok_size} bytes, but the index announces {num_tokens} tokens "
            f"of {itemsize} bytes"
        )
    lengths = np.frombuffer(raw, dtype="<u4", count=num_docs, offset=HEADER_BYTES).astype(np.int64)
    if int(lengths.sum()) != num_tokens:
        raise corrupt(f"document lengths sum to {int(lengths.sum())}, not {num_tokens}")
    sums = np.frombuffer(raw, dtype="<u8", count=num_blocks, offset=HEADER_BYTES + 4 * num_docs).astype(
        np.uint64
    )
    head = dict(
        itemsize=itemsize, vocab=int(vocab), block_bytes=int(block_bytes), eos=None if eos == 0 else eos - 1
    )
    return lengths, sums, head
