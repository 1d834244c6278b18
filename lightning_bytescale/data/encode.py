"""Tokenizing a source for the token store: batched, in several processes, in source order, visibly.

The store builder reads documents one by one; this module turns them into token arrays (or
:class:`MaskedTokens` for loss-masked data) ``batch_docs`` at a time.  Encoding is the slow
part of a build (a chat template rendered in Python, a tokenizer run), so batches go to
``num_proc`` worker processes; results come back in source order, so a store is byte-identical
whatever the number of processes.  The first ``inline_batches`` batches are encoded in this
process: a small source never pays for starting workers.

Workers are forked where the platform allows it (as PyTorch's DataLoader does), else spawned;
the encoder is sent to them once.  A progress bar (``tqdm``) counts documents and tokens while
the store is built.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from lightning_bytescale.data.errors import DataError

EncodeBatch = Callable[[list], list]


@dataclass
class MaskedTokens:
    """A document's token ids and its loss mask.

    ``mask[i]`` is true when token ``i`` is a loss target: the prediction of token ``i`` (the
    label at position ``i - 1``) is trained.  The first token of a document is never a target.
    """

    ids: np.ndarray
    mask: np.ndarray  # bool, same length as ``ids``

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids)
        self.mask = np.asarray(self.mask, dtype=bool)
        if self.mask.shape != self.ids.shape:
            raise DataError(
                f"a loss mask of shape {self.mask.shape} does not match its {self.ids.shape} token ids"
            )

    @property
    def loss_tokens(self) -> int:
        """Tokens whose prediction is trained (the first token has nothing before it)."""
        return int(self.mask[1:].sum())


Encoded = np.ndarray | MaskedTokens

_WORKER_ENCODE: EncodeBatch | None = None


def _init_worker(encode_batch: EncodeBatch) -> None:
    global _WORKER_ENCODE
    _WORKER_ENCODE = encode_batch
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already


def _encode_in_worker(batch: list) -> list[Encoded]:
    assert _WORKER_ENCODE is not None
    return encode_mixed(batch, _WORKER_ENCODE)


def encode_mixed(batch: list, encode_batch: EncodeBatch | None) -> list[Encoded]:
    """Encode the documents of ``batch`` that are not token arrays yet, keeping the order."""
    raw = [i for i, d in enumerate(batch) if not isinstance(d, (np.ndarray, MaskedTokens))]
    if not raw:
        return list(batch)
    if encode_batch is None:
        raise DataError(f"documents of type {type(batch[raw[0]]).__name__} need a tokenizer (encode_batch)")
    encoded = encode_batch([batch[i] for i in raw])
    if len(encoded) != len(raw):
        raise DataError(f"the tokenizer returned {len(encoded)} documents for a batch of {len(raw)}")
    out = list(batch)
    for i, e in zip(raw, encoded):
        out[i] = e
    return out


def _batches(documents: Iterator, batch_docs: int) -> Iterator[list]:
    while batch := list(islice(documents, batch_docs)):
        yield batch


def _context() -> multiprocessing.context.BaseContext:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def encode_documents(
    documents: Iterable,
    encode_batch: EncodeBatch | None,
    *,
    batch_docs: int = 256,
    num_proc: int = 1,
    inline_batches: int = 2,
) -> Iterator[Encoded]:
    """Encoded documents in source order; ``num_proc > 1`` encodes batches in worker processes.

    In this process, token arrays pass straight through (a batch in progress is encoded
    first).  The workers are started only after ``inline_batches`` batches were encoded here,
    and stopped when the stream ends, fails or is abandoned.
    """
    if batch_docs < 1:
        raise DataError(f"batch_docs={batch_docs} must be at least 1")
    if num_proc < 1:
        raise DataError(f"num_proc={num_proc} must be at least 1 (1: tokenize in this process)")
    it = iter(documents)
    pending: list = []
    encoded_batches = 0
    for doc in it:
        if isinstance(doc, (np.ndarray, MaskedTokens)) and not pending:
            yield doc
            continue
        pending.append(doc)
        if len(pending) >= batch_docs or isinstance(doc, (np.ndarray, MaskedTokens)):
            yield from encode_mixed(pending, encode_batch)
            pending = []
            encoded_batches += 1
            if num_proc > 1 and encoded_batches >= inline_batches:
                break
    else:
        if pending:
            yield from encode_mixed(pending, encode_batch)
        return
    first = list(islice(it, batch_docs))
    if not first:
        return
    with _context().Pool(num_proc, initializer=_init_worker, initargs=(encode_batch,)) as pool:
        for out in pool.imap(_encode_in_worker, _chain(first, _batches(it, batch_docs)), chunksize=1):
            yield from out
        pool.close()
        pool.join()


def _chain(first: list, rest: Iterator[list]) -> Iterator[list]:
    yield first
    yield from rest


class BuildProgress:
    """Documents and tokens written so far, as a ``tqdm`` bar (on a terminal) and one closing log line.

    ``show``: ``None`` shows the bar when stderr is a terminal; ``True`` / ``False`` force it.
    """

    def __init__(self, label: str, total: int | None = None, show: bool | None = None) -> None:
        self.docs = 0
        self.tokens = 0
        self.started = time.perf_counter()
        if show is None:
            show = sys.stderr.isatty()
        self._bar = None
        if show:
            from tqdm.auto import tqdm  # only on a terminal; tqdm is not one of this floor's dependencies

            self._bar = tqdm(total=total, desc=label, unit=" docs", dynamic_ncols=True, mininterval=0.5)

    def update(self, tokens: int) -> None:
        self.docs += 1
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(1)
            if self.docs % 1024 == 0:
                self._bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
            self._bar.close()
            self._bar = None
