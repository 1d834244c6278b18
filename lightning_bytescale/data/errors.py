"""Errors the data pipeline raises, each naming the cause and the fix.

All are ``ByteScaleError`` and ``ValueError`` subclasses so callers that catch bad input generically still work.
"""

from __future__ import annotations

from lightning_bytescale.errors import ByteScaleError


class DataError(ByteScaleError, ValueError):
    """Bad data or a bad data configuration."""


class StoreNotFoundError(DataError):
    """No token store exists at the expected folder (it was never built, or the source changed)."""


class CorruptIndexError(DataError):
    """The token store's files are missing, truncated or inconsistent."""


class CorruptTokensError(CorruptIndexError):
    """A block of ``tokens.bin`` does not match the checksum written when the store was built."""


class OutOfVocabularyError(DataError):
    """A stored token id is outside the vocabulary (of the store's tokenizer or of the model)."""


class EmptySampleError(DataError):
    """A document has too few tokens and the empty-sample policy is ``"error"``."""


class LongDocumentError(DataError):
    """A document is longer than the context length and the long-document policy is ``"error"``."""


class ContextLengthError(DataError):
    """``context_length`` is longer than the planner can place on the run's HDP ranks (capacity x ranks, or
    what offload holds): longer documents would be cut short without the user asking."""


class EmptyDatasetError(DataError):
    """No sample is left to train on."""


class ResumeMismatchError(DataError):
    """A saved loader position does not belong to this dataset or batching configuration."""
