"""Tokenizers that turn document text into token ids for the token store.

Two kinds, behind one small protocol (``vocab_size``, ``eos_id``, ``fingerprint``,
``encode_batch``):

* :class:`ByteTokenizer`, the default: UTF-8 bytes are the tokens (ids 0-255), and id 256 is
  the end-of-document token appended to every document.  ``vocab_size`` is 257.  It needs no
  download and no file, and it never fails on any text.
* :class:`JsonTokenizer`: any tokenizer saved as a Hugging Face ``tokenizers`` JSON file.  Its
  end-of-document token is looked up among common names (``</s>``, ``<|endoftext|>``,
  ``<eos>``, ``[SEP]``) or given explicitly; with none, no token is appended.
* :class:`HFTokenizer`: ``transformers.AutoTokenizer`` from a local folder (a model's folder),
  run through its fast backend; its end-of-sequence token is the tokenizer's own.

Both Hugging Face kinds also give what chat data need: the fast backend (batched, with
character offsets), the special tokens' strings and the tokenizer's chat template.
"""

from __future__ import annotations

import hashlib
import json
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
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
# files of a tokenizer folder that decide how text becomes ids (hashed into the fingerprint)
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model",
)  # fmt: skip


def _digest(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _folder_template(folder: Path) -> str | None:
    """The chat template saved beside a tokenizer (``chat_template.jinja`` or ``tokenizer_config.json``)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text()).get("chat_template")
        except (OSError, ValueError):
            return None
        return _named_template(value)
    return None


def _named_template(value) -> str | None:
    """A template string, or the ``default`` one of a list/dict of named templates."""
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, dict):
        return value.get("default")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


class BackendTokenizer:
    """A tokenizer run by a Hugging Face ``tokenizers`` backend (fast, batched, with offsets).

    Text documents are encoded without special tokens, and the end-of-document token is
    appended when there is one.  Chat data use :attr:`backend`, :meth:`special_tokens` and
    :meth:`chat_template` (see :mod:`.chat_encoder`).
    """

    _tok = None
    vocab_size: int
    eos_id: int | None
    _template: str | None = None

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer``."""
        return self._tok

    def _find(self, names: Sequence[str]) -> int | None:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ... as strings: what chat templates read."""
        out = {}
        bos = self._find(_BOS_NAMES)
        if bos is not None:
            out["bos_token"] = self._tok.id_to_token(bos)
        if self.eos_id is not None:
            out["eos_token"] = self._tok.id_to_token(self.eos_id)
        return out

    def chat_template(self) -> str | None:
        """The tokenizer's own chat template, if it has one."""
        return self._template

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        out = []
        for enc in self._tok.encode_batch(list(texts), add_special_tokens=False):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if self.eos_id is not None and ids.size:
                ids = np.append(ids, self.eos_id)
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class JsonTokenizer(BackendTokenizer):
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``).

    A chat template saved beside it (``chat_template.jinja``, or ``chat_template`` in
    ``tokenizer_config.json``) is its chat template.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None, append_eos: bool = True) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer  # optional dependency
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
            self.eos_id = self._find((eos_token,) if eos_token else _EOS_NAMES)
            if eos_token and self.eos_id is None:
                raise DataError(f"eos_token {eos_token!r} is not in the vocabulary of {self.path}")
        self._digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self._template = _folder_template(self.path.parent)

    @property
    def fingerprint(self) -> str:
        return f"json-{self._digest}-eos{self.eos_id}"


class HFTokenizer(BackendTokenizer):
    """``transformers.AutoTokenizer`` from a local folder (a model's folder works): its fast
    ``tokenizers`` backend, its special tokens and its chat template.  Needs ``transformers``.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None, append_eos: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise DataError(f"tokenizer folder {self.path} does not exist")
        try:
            from transformers import AutoTokenizer  # optional dependency (the hf extra)
        except ImportError as err:
            raise DataError(
                "a tokenizer folder needs transformers: pip install 'lightning-bytescale[hf]' (or give the "
                "path of its tokenizer.json file, which needs only `tokenizers`)"
            ) from err
        try:
            tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as err:
            raise DataError(f"cannot load a tokenizer from {self.path} with AutoTokenizer: {err}") from err
        self._tok = getattr(tok, "backend_tokenizer", None)
        if self._tok is None:
            raise DataError(
                f"the tokenizer in {self.path} ({type(tok).__name__}) has no fast `tokenizers` backend; save it "
                f"with a tokenizer.json (transformers converts most tokenizers: tok.save_pretrained(folder))"
            )
        self.vocab_size = len(tok)
        self.eos_id = None
        if append_eos:
            if eos_token:
                self.eos_id = self._find((eos_token,))
                if self.eos_id is None:
                    raise DataError(f"eos_token {eos_token!r} is not in the vocabulary of {self.path}")
            elif tok.eos_token_id is not None:
                self.eos_id = int(tok.eos_token_id)
        self._special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        self._template = _named_template(getattr(tok, "chat_template", None)) or _folder_template(self.path)
        self._digest = _digest([self.path / f for f in _TOKENIZER_FILES if (self.path / f).is_file()])

    @property
    def fingerprint(self) -> str:
        return f"hf-{self._digest}-eos{self.eos_id}"

    def special_tokens(self) -> dict[str, str]:
        out = dict(self._special)
        if self.eos_id is not None:
            out["eos_token"] = self._tok.id_to_token(self.eos_id)
        return out


def load_tokenizer(spec: str | Path | Tokenizer | None = None) -> Tokenizer:
    """``None`` or ``"byte"``: the byte-level default; a ``tokenizers`` JSON file; a tokenizer folder
    (``AutoTokenizer``, a model's folder works)."""
    if spec is None or (isinstance(spec, str) and spec == "byte"):
        return ByteTokenizer()
    if isinstance(spec, (str, Path)):
        path = Path(spec).expanduser()
        if path.is_dir():
            return HFTokenizer(path)
        return JsonTokenizer(path)
    return spec
