"""A user's mistake is printed once, by one rank, and its hints lead somewhere (issue 29, items 1-3).

* the vocabulary check finds the model's vocabulary on the README's own module pattern
  (``self.model = LlamaModel(...)``, no ``vocab_size`` attribute);
* an error every rank raises alike is printed once, with one traceback, by the lowest rank that
  raised it; a different error of another rank is still printed;
* the plain-DataLoader error names only what exists.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from lightning_bytescale import ByteScaleDataModule
from lightning_bytescale.data import OutOfVocabularyError
from lightning_bytescale.lightning.datamodule import model_vocab_size
from lightning_bytescale.models import LlamaConfig, LlamaModel


class ReadmeLM(pl.LightningModule):
    """The README's module: the model is an attribute; the LightningModule has no ``vocab_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaModel(LlamaConfig.preset("tiny"))  # vocab 64: smaller than the byte tokenizer's 257


def _corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"document {i} " + "xyz " * (i % 7 + 1)}) + "\n" for i in range(30))
    )
    return path


def test_the_vocabulary_is_found_on_the_readme_module_pattern(tmp_path):
    module = ReadmeLM()
    assert model_vocab_size(module) == 64  # the first nn.Embedding: model.embed
    dm = ByteScaleDataModule(
        source=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), capacity=64, context_length=64,
        tokens_per_step=256, num_workers=0,
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    with pytest.raises(OutOfVocabularyError, match=r"vocab_size=64: .* the tokenizer has 257 tokens"):
        dm.check_vocabulary(model_vocab_size(module))
    assert model_vocab_size(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
