"""Data: sources, tokenizers, the verified memory-mapped token store, policies, sampler and step loader."""

from lightning_bytescale.data.errors import (
    ContextLengthError,
    CorruptIndexError,
    CorruptTokensError,
    DataError,
    EmptyDatasetError,
    EmptySampleError,
    LongDocumentError,
    OutOfVocabularyError,
    ResumeMismatchError,
    StoreNotFoundError,
)
from lightning_bytescale.data.policy import Samples, make_samples
from lightning_bytescale.data.prune import PruneAction, prune_cache
from lightning_bytescale.data.sampler import GlobalBatching, TokenBudgetBatchSampler
from lightning_bytescale.data.source_spec import make_source
from lightning_bytescale.data.sources import (
    FileStamp,
    HFSource,
    JsonlSource,
    SyntheticSource,
    TextFilesSource,
)
from lightning_bytescale.data.store import TokenStore, write_store
from lightning_bytescale.data.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "ContextLengthError",
    "CorruptIndexError",
    "CorruptTokensError",
    "DataError",
    "EmptyDatasetError",
    "EmptySampleError",
    "FileStamp",
    "GlobalBatching",
    "HFSource",
    "JsonTokenizer",
    "JsonlSource",
    "LongDocumentError",
    "OutOfVocabularyError",
    "PruneAction",
    "ResumeMismatchError",
    "Samples",
    "StoreNotFoundError",
    "SyntheticSource",
    "TextFilesSource",
    "TokenBudgetBatchSampler",
    "TokenStore",
    "load_tokenizer",
    "make_samples",
    "make_source",
    "prune_cache",
    "write_store",
]
