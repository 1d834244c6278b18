"""Tokenizers that turn document text into token ids for the token store.

Two kinds, behind one small protocol (``vocab_size``, ``eos_id``, ``fingerprint``,
``encode_batch``):

* :class:`ByteTokenizer`, the default: UTF-8 bytes are the tokens (ids 0-255), and id 256 is
  the end-of-document token appended to every document.  ``vocab_size`` is 257.  It needs no
  download and no file, and it never fails on any text.
* :class:`JsonTokenizer`: any tokenizer saved as a Hugging Face ``tokenizers`` JSON file.  Its
  end-of-document token is looked up among common names (``</s>``, ``<|endoftext|>``,
  ``<eos>``, ``[SEP]``) or given explicitly; with none, no token is appended.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from lightning_bytescale.data.errors import DataError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    @property
    def fingerprint(self) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (0-255) plus an end-of-document token (256)."""

    EOS = 256

    def __init__(self, append_eos: bool = True) -> None:
        self.append_eos = append_eos
        self.vocab_size = 257
        self.eos_id: int | None = self.EOS if append_eos else None

    @property
    def fingerprint(self) -> str:
        return f"byte-v1-eos{int(self.append_eos)}"

    def encode(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)
        if self.append_eos and ids.size:
            ids = np.append(ids, self.EOS)
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")


class JsonTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``)."""

    def __init__(self, path: str | Path, eos_token: str | None = None, append_eos: bool = True) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as err:  # pragma: no cover - tokenizers is a dev/hf dependency
            raise DataError(
                "a tokenizer JSON file needs the `tokenizers` package: pip install tokenizers"
            ) from err
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"tokenizer file {self.path} does not exist; pass a `tokenizers` JSON file")
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as err:
            raise DataError(f"cannot load tokenizer {self.path}: {err}") from err
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = None
        if append_eos:
            names = (eos_token,) if eos_token else _EOS_NAMES
            for name in names:
                tid = self._tok.token_to_id(name)
                if tid is not None:
                    self.eos_id = int(tid)
                    break
            if eos_token and self.eos_id is None:
                raise DataError(f"eos_token {eos_token!r} is not in the vocabulary of {self.path}")
        self._digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    @property
    def fingerprint(self) -> str:
        return f"json-{self._digest}-eos{self.eos_id}"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = []
        for enc in self._tok.encode_batch(list(texts), add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if self.eos_id is not None and ids.size:
                ids = np.append(ids, self.eos_id)
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str | Path | Tokenizer | None = None) -> Tokenizer:
    """``None`` or ``"byte"``: the byte-level default; a path: a ``tokenizers`` JSON file."""
    if spec is None or (isinstance(spec, str) and spec == "byte"):
        return ByteTokenizer()
    if isinstance(spec, (str, Path)):
        return JsonTokenizer(spec)
    return spec
