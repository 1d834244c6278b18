"""Data: sources, tokenizers, the memory-mapped token store, policies, sampler and step loader."""

from lightning_bytescale.data.errors import (
    CorruptIndexError,
    DataError,
    EmptyDatasetError,
    EmptySampleError,
    LongDocumentError,
    ResumeMismatchError,
)
from lightning_bytescale.data.policy import Samples, make_samples
from lightning_bytescale.data.sampler import GlobalBatching, TokenBudgetBatchSampler
from lightning_bytescale.data.sources import (
    HFSource,
    JsonlSource,
    SyntheticSource,
    TextFilesSource,
    make_source,
)
from lightning_bytescale.data.store import TokenStore, write_store
from lightning_bytescale.data.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "CorruptIndexError",
    "DataError",
    "EmptyDatasetError",
    "EmptySampleError",
    "GlobalBatching",
    "HFSource",
    "JsonTokenizer",
    "JsonlSource",
    "LongDocumentError",
    "ResumeMismatchError",
    "Samples",
    "SyntheticSource",
    "TextFilesSource",
    "TokenBudgetBatchSampler",
    "TokenStore",
    "load_tokenizer",
    "make_samples",
    "make_source",
    "write_store",
]
