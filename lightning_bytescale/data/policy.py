"""From documents to samples: the empty-sample and long-document policies.

A *sample* is what the sampler and the planner see as one sequence: a token range of one
stored document.  The policies run on the length index only (no token is read), in
``setup``, so the same store serves any context length or policy.

* Empty samples: a document with fewer than ``min_tokens`` tokens (default 2: a sequence of
  one token has no next token to predict, so it carries no loss) is dropped
  (``empty="drop"``, the default) or raises :class:`EmptySampleError` (``empty="error"``).
* Long documents (more than ``max_length`` tokens):
  ``split`` (default): cut into consecutive samples of ``max_length`` tokens, the last one
  shorter (dropped if it is below ``min_tokens``); ``truncate``: keep the first
  ``max_length`` tokens; ``drop``: skip the document; ``error``: raise
  :class:`LongDocumentError`.
* Loss-masked data (chats): a sample with no trained token (a conversation without an
  assistant answer, or one whose answer was truncated away) is empty too: dropped and counted
  (``no_loss_dropped``), or an :class:`EmptySampleError` under ``empty="error"``
  (:func:`drop_untrained`).  Conversations are never split: ``split`` is refused for them.
* If nothing is left, :class:`EmptyDatasetError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_bytescale.data.errors import (
    DataError,
    EmptyDatasetError,
    EmptySampleError,
    LongDocumentError,
)

LONG_POLICIES = ("split", "truncate", "drop", "error")
EMPTY_POLICIES = ("drop", "error")


@dataclass
class Samples:
    """Sample ``i`` is tokens ``start[i] : start[i] + length[i]`` of document ``doc[i]``."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    report: dict = field(default_factory=dict)
    loss_tokens: np.ndarray | None = None  # trained tokens per sample (loss-masked data only)

    def __len__(self) -> int:
        return int(self.length.size)

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())


def make_samples(
    doc_lengths: np.ndarray,
    max_length: int,
    long_policy: str = "split",
    empty_policy: str = "drop",
    min_tokens: int = 2,
    where: str = "the dataset",
) -> Samples:
    """Apply the policies to a length index; ``where`` names the data in error messages."""
    if long_policy not in LONG_POLICIES:
        raise DataError(f"long_document_policy={long_policy!r}; use one of {LONG_POLICIES}")
    if empty_policy not in EMPTY_POLICIES:
        raise DataError(f"empty_sample_policy={empty_policy!r}; use one of {EMPTY_POLICIES}")
    if max_length < min_tokens:
        raise DataError(f"the context length ({max_length}) must be at least min_tokens ({min_tokens})")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    docs = np.arange(lengths.size, dtype=np.int64)
    report = {"documents": int(lengths.size), "tokens_in": int(lengths.sum())}

    empty = lengths < min_tokens
    if empty.any() and empty_policy == "error":
        i = int(np.flatnonzero(empty)[0])
        raise EmptySampleError(
            f"document {i} of {where} has {int(lengths[i])} tokens (< {min_tokens}, nothing to "
            f"predict) and empty_sample_policy='error'; remove it or use empty_sample_policy='drop'"
        )
    report["empty_dropped"] = int(empty.sum())
    docs, lengths = docs[~empty], lengths[~empty]

    long = lengths > max_length
    report["long_documents"] = int(long.sum())
    if long.any():
        if long_policy == "error":
            i = int(np.flatnonzero(long)[0])
            raise LongDocumentError(
                f"document {int(docs[i])} of {where} has {int(lengths[i])} tokens, more than the "
                f"context length {max_length}, and long_document_policy='error'; raise the context "
                f"length (and the pool: world_size x capacity) or use split / truncate / drop"
            )
        if long_policy == "drop":
            docs, lengths = docs[~long], lengths[~long]
            starts = np.zeros_like(lengths)
        elif long_policy == "truncate":
            lengths = np.minimum(lengths, max_length)
            starts = np.zeros_like(lengths)
        else:  # split
            pieces = -(-lengths // max_length)
            docs = np.repeat(docs, pieces)
            first = np.repeat(np.cumsum(pieces) - pieces, pieces)
            starts = (np.arange(docs.size, dtype=np.int64) - first) * max_length
            lengths = np.minimum(np.repeat(lengths, pieces) - starts, max_length)
            tiny = lengths < min_tokens
            report["split_tails_dropped"] = int(tiny.sum())
            docs, starts, lengths = docs[~tiny], starts[~tiny], lengths[~tiny]
    else:
        starts = np.zeros_like(lengths)
    if lengths.size == 0:
        raise EmptyDatasetError(
            f"{where} has no samples left ({report['documents']} documents, "
            f"{report['empty_dropped']} empty, {report['long_documents']} longer than {max_length}); "
            f"check the source, or the policies and context length"
        )
    report.update(samples=int(lengths.size), tokens=int(lengths.sum()))
    return Samples(docs, starts, lengths, report)


def drop_untrained(
    samples: Samples, loss_tokens: np.ndarray, empty_policy: str = "drop", where: str = "the dataset"
) -> Samples:
    """Attach each sample's trained-token count and drop the samples that train nothing.

    ``loss_tokens[i]``: the loss targets of sample ``i`` (its mask without the first token).
    """
    loss_tokens = np.asarray(loss_tokens, dtype=np.int64)
    if loss_tokens.shape != samples.length.shape:
        raise DataError(f"{loss_tokens.size} loss-token counts for {len(samples)} samples")
    none = loss_tokens == 0
    if none.any() and empty_policy == "error":
        i = int(np.flatnonzero(none)[0])
        raise EmptySampleError(
            f"document {int(samples.doc[i])} of {where} has no trained token (its loss mask is empty: no "
            f"assistant answer, or it was truncated away) and empty_sample_policy='error'; remove it or use "
            f"empty_sample_policy='drop'"
        )
    report = dict(samples.report, no_loss_dropped=int(none.sum()))
    keep = ~none
    if not keep.any():
        raise EmptyDatasetError(
            f"{where} has no sample with a trained token ({len(samples)} samples, all masked out); check "
            f"loss_on, the records' roles (an assistant message is needed for loss_on='assistant' or "
            f"'completion') and the context length"
        )
    report.update(
        samples=int(keep.sum()), tokens=int(samples.length[keep].sum()), loss_tokens=int(loss_tokens.sum())
    )
    return Samples(samples.doc[keep], samples.start[keep], samples.length[keep], report, loss_tokens[keep])
