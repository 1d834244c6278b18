"""The token store: all documents' tokens in one flat memory-mapped file plus a length index.

Built once (``prepare_data``), then opened memory-mapped on every rank (``setup``), so no rank
holds the corpus in memory and workers share pages through the OS cache.

Files in a store folder:

* ``tokens.bin``: every document's tokens back to back, ``uint16`` when the vocabulary fits,
  else ``uint32``;
* ``index.bin``: a 64-byte header (magic ``BSTOKIDX``, format version, token item size,
  document count, token count, vocabulary size) then one ``uint32`` length per document
  (4 bytes a document; offsets are the running sum, computed at load);
* ``meta.json``: what the store was built from (source and tokenizer fingerprints).

Opening verifies the header and that the sizes agree with each other and with the token file;
anything inconsistent raises :class:`CorruptIndexError` naming the file and how to rebuild.
A store is built in a temporary folder and renamed into place, so readers never see a half
written one.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_bytescale.data.errors import CorruptIndexError, DataError, EmptyDatasetError
from lightning_bytescale.data.sources import Document

MAGIC = b"BSTOKIDX"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, itemsize, num_docs, num_tokens, vocab_size
HEADER_BYTES = 64
TOKENS_FILE, INDEX_FILE, META_FILE = "tokens.bin", "index.bin", "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_store(
    directory: str | Path,
    documents: Iterable[Document],
    encode_batch,
    vocab_size: int,
    meta: dict | None = None,
    batch_docs: int = 256,
) -> Path:
    """Tokenize ``documents`` and write a store at ``directory`` (atomically; replaces nothing).

    Text documents are encoded ``batch_docs`` at a time with ``encode_batch``; token arrays are
    stored as they are.  Returns the store folder.  If another process finished the same store
    first, its store is kept.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
    lengths: list[int] = []
    num_tokens = 0
    try:
        with open(tmp / TOKENS_FILE, "wb") as fh:
            pending: list[str] = []

            def flush_text() -> None:
                nonlocal num_tokens
                if not pending:
                    return
                if encode_batch is None:
                    raise DataError("text documents need a tokenizer (encode_batch)")
                for ids in encode_batch(pending):
                    num_tokens += _write_doc(fh, ids, dtype, vocab_size, lengths)
                pending.clear()

            for doc in documents:
                if isinstance(doc, str):
                    pending.append(doc)
                    if len(pending) >= batch_docs:
                        flush_text()
                else:
                    flush_text()
                    num_tokens += _write_doc(fh, np.asarray(doc), dtype, vocab_size, lengths)
            flush_text()
        if not lengths:
            raise EmptyDatasetError(
                f"the source yielded no documents (store {directory}); check the source's path, glob or split"
            )
        with open(tmp / INDEX_FILE, "wb") as fh:
            header = _HEADER.pack(MAGIC, VERSION, dtype.itemsize, len(lengths), num_tokens, vocab_size)
            fh.write(header.ljust(HEADER_BYTES, b"\0"))
            fh.write(np.asarray(lengths, dtype=np.uint32).tobytes())
        info = dict(meta or {}, num_docs=len(lengths), num_tokens=num_tokens, vocab_size=vocab_size)
        (tmp / META_FILE).write_text(json.dumps(info, indent=1, sort_keys=True))
        try:
            os.rename(tmp, directory)
        except OSError:
            if not (directory / META_FILE).exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent builder won; keep its store
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _write_doc(fh, ids: np.ndarray, dtype: np.dtype, vocab_size: int, lengths: list[int]) -> int:
    n = int(ids.size)
    if n >= 2**32:
        raise DataError(f"document {len(lengths)} has {n} tokens; the store supports < 2**32 per document")
    if n and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DataError(
            f"document {len(lengths)} has token ids outside [0, {vocab_size}); the tokenizer and "
            f"vocab_size disagree"
        )
    fh.write(ids.astype(dtype, copy=False).tobytes())
    lengths.append(n)
    return n


@dataclass
class TokenStore:
    """A verified, memory-mapped store.  Picklable: workers reopen the files lazily."""

    directory: Path
    lengths: np.ndarray  # int64 [num_docs]
    offsets: np.ndarray  # int64 [num_docs], start of each document in the token file
    vocab_size: int
    dtype: np.dtype
    _tokens: np.memmap | None = None

    @classmethod
    def open(cls, directory: str | Path) -> TokenStore:
        directory = Path(directory)
        index, tokens = directory / INDEX_FILE, directory / TOKENS_FILE
        if not index.is_file() or not tokens.is_file() or not (directory / META_FILE).is_file():
            raise DataError(
                f"no token store at {directory}; call the DataModule's prepare_data() (Lightning "
                f"does this on each node's local rank 0) before setup()"
            )

        def corrupt(why: str) -> CorruptIndexError:
            return CorruptIndexError(
                f"token store index {index} is corrupt: {why}. Delete the folder {directory} (or pass "
                f"rebuild=True to ByteScaleDataModule) and run prepare_data() again to rebuild it."
            )

        size = index.stat().st_size
        if size < HEADER_BYTES:
            raise corrupt(f"the file has {size} bytes, less than its {HEADER_BYTES}-byte header")
        with open(index, "rb") as fh:
            magic, version, itemsize, num_docs, num_tokens, vocab = _HEADER.unpack(
                fh.read(HEADER_BYTES)[: _HEADER.size]
            )
        if magic != MAGIC:
            raise corrupt(f"bad magic {magic!r} (expected {MAGIC!r})")
        if version != VERSION:
            raise corrupt(f"format version {version}, this package reads version {VERSION}")
        if itemsize not in (2, 4) or np.dtype(f"uint{8 * itemsize}") != token_dtype(vocab):
            raise corrupt(f"token item size {itemsize} does not fit vocabulary size {vocab}")
        if size != HEADER_BYTES + 4 * num_docs:
            raise corrupt(f"{size} bytes, but the header announces {num_docs} documents")
        tok_size = tokens.stat().st_size
        if tok_size != itemsize * num_tokens:
            raise corrupt(
                f"{tokens} has {tok_size} bytes, but the index announces {num_tokens} tokens of "
                f"{itemsize} bytes"
            )
        lengths = np.fromfile(index, dtype=np.uint32, offset=HEADER_BYTES).astype(np.int64)
        if int(lengths.sum()) != num_tokens:
            raise corrupt(f"document lengths sum to {int(lengths.sum())}, not {num_tokens}")
        offsets = np.zeros(num_docs, dtype=np.int64)
        if num_docs > 1:
            np.cumsum(lengths[:-1], out=offsets[1:])
        return cls(directory, lengths, offsets, int(vocab), np.dtype(f"uint{8 * itemsize}"))

    @property
    def num_docs(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            if self.num_tokens == 0:
                self._tokens = np.zeros(0, dtype=self.dtype)  # np.memmap refuses empty files
            else:
                self._tokens = np.memmap(self.directory / TOKENS_FILE, dtype=self.dtype, mode="r")
        return self._tokens

    def read(self, doc: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[start, start + length)`` of document ``doc`` as ``int64``."""
        n = int(self.lengths[doc]) - start if length is None else length
        base = int(self.offsets[doc]) + start
        return np.asarray(self.tokens[base : base + n], dtype=np.int64)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokens"] = None  # never pickle the mapped data; reopen in the worker
        return state
