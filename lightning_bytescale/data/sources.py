"""Where documents come from: text files, JSONL, synthetic length distributions, HF datasets.

A source yields documents in a fixed, deterministic order, either as text (tokenized by the
store builder) or, for synthetic data, directly as token arrays.  Each source has a
``fingerprint`` that changes when its content may have changed (paths, sizes, modification
times, options), so a cached token store is rebuilt only when needed.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import inspect
import json
import os
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Protocol

import numpy as np

from lightning_bytescale.data.errors import DataError

Document = str | np.ndarray


class Source(Protocol):
    @property
    def fingerprint(self) -> str: ...

    def iter_documents(self, vocab_size: int) -> Iterator[Document]: ...


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_stamp(paths: Sequence[Path]) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        st = p.stat()
        out.append((str(p), st.st_size, st.st_mtime_ns))
    return out


def default_corpus() -> str:
    """Python's standard library source tree: real text, present on every machine."""
    return sysconfig.get_paths()["stdlib"]


@dataclass
class TextFilesSource:
    """Every file under a folder (matching ``pattern``, recursively) or matching a glob.

    Each file is one document, read as UTF-8 (undecodable bytes replaced).  Files are taken in
    sorted path order.
    """

    path: str | None = None  # folder or glob; None: Python's stdlib source tree
    pattern: str = "*.py"  # used when ``path`` is a folder
    max_files: int | None = None
    exclude: tuple[str, ...] = ("site-packages", "dist-packages", "__pycache__")  # folder names

    def files(self) -> list[Path]:
        path = self.path or default_corpus()
        if os.path.isdir(path):
            skip = set(self.exclude)
            found = sorted(
                p
                for p in Path(path).rglob(self.pattern)
                if p.is_file() and not skip.intersection(p.relative_to(path).parts[:-1])
            )
        else:
            found = sorted(Path(p) for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
        if self.max_files is not None:
            found = found[: self.max_files]
        if not found:
            where = f"folder {path} (pattern {self.pattern!r})" if os.path.isdir(path) else f"glob {path!r}"
            raise DataError(f"no text files found in {where}; check the path or the pattern")
        return found

    @property
    def fingerprint(self) -> str:
        return _hash("text", _file_stamp(self.files()))

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        for p in self.files():
            yield p.read_text(encoding="utf-8", errors="replace")


@dataclass
class JsonlSource:
    """One document per line of JSONL file(s): the string at ``field`` of each object."""

    path: str | Sequence[str] = ""
    field: str = "text"

    def files(self) -> list[Path]:
        pats = [self.path] if isinstance(self.path, str) else list(self.path)
        found: list[Path] = []
        for pat in pats:
            hits = sorted(globlib.glob(str(pat), recursive=True))
            if not hits:
                raise DataError(f"JSONL source {pat!r} matches no file")
            found.extend(Path(h) for h in hits)
        return found

    @property
    def fingerprint(self) -> str:
        return _hash("jsonl", self.field, _file_stamp(self.files()))

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        for p in self.files():
            with open(p, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"{p}:{lineno}: not valid JSON ({err.msg})") from err
                    if not isinstance(obj, dict) or self.field not in obj:
                        raise DataError(
                            f"{p}:{lineno}: no field {self.field!r}; set the source's `field` option "
                            f"to the key that holds the text"
                        )
                    text = obj[self.field]
                    if not isinstance(text, str):
                        raise DataError(f"{p}:{lineno}: field {self.field!r} is not a string")
                    yield text


def _sample_lengths(name: str, n: int, seed: int) -> np.ndarray:
    try:
        from lightning_bytescale.planner import distributions
    except ImportError as err:  # pragma: no cover - the planner package always ships it
        raise DataError("synthetic sources need lightning_bytescale.planner.distributions") from err
    fn = getattr(distributions, "sample_lengths", None)
    if fn is None:  # pragma: no cover
        raise DataError("lightning_bytescale.planner.distributions has no sample_lengths()")
    params = inspect.signature(fn).parameters
    kwargs: dict = {}
    if "seed" in params:
        kwargs["seed"] = seed
    elif "rng" in params:
        kwargs["rng"] = np.random.default_rng(seed)
    return np.asarray(fn(name, n, **kwargs), dtype=np.int64)


@dataclass
class SyntheticSource:
    """``num_samples`` documents whose lengths follow the paper's ``github`` or ``byted`` mix.

    The distributions are defined at a 2M-token reference context.  ``context`` rescales every
    length by ``context / 2M`` (the same shape at a CPU-sized context; for example 8192), or
    ``scale`` multiplies lengths directly.  Tokens are uniform random ids, deterministic from
    ``seed``.  Lengths are at least 1 (the empty-sample policy then drops 1-token documents).
    """

    name: str = "github"
    num_samples: int = 1000
    seed: int = 0
    scale: float = 1.0
    context: int | None = None

    def lengths(self) -> np.ndarray:
        if self.num_samples < 1:
            raise DataError(f"synthetic source needs num_samples >= 1, got {self.num_samples}")
        from lightning_bytescale.planner.distributions import REFERENCE_CONTEXT

        raw = _sample_lengths(self.name, self.num_samples, self.seed)
        scale = self.scale if self.context is None else self.context / REFERENCE_CONTEXT
        return np.maximum(1, np.round(raw * scale)).astype(np.int64)

    @property
    def fingerprint(self) -> str:
        return _hash("synthetic", self.name, self.num_samples, self.seed, self.scale, self.context)

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        rng = np.random.default_rng([self.seed, 1])
        for n in self.lengths():
            yield rng.integers(0, vocab_size, size=int(n), dtype=np.int64)


@dataclass
class HFSource:
    """A Hugging Face ``datasets`` dataset (installed separately), the string at ``field``."""

    name: str = ""
    config: str | None = None
    split: str = "train"
    field: str = "text"
    revision: str | None = None
    kwargs: dict = dc_field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return _hash("hf", self.name, self.config, self.split, self.field, self.revision, self.kwargs)

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        try:
            import datasets
        except ImportError as err:
            raise DataError(
                "the Hugging Face source needs the `datasets` package: pip install datasets "
                "(or pip install 'lightning-bytescale[hf]')"
            ) from err
        ds = datasets.load_dataset(
            self.name, self.config, split=self.split, revision=self.revision, **self.kwargs
        )
        if self.field not in ds.column_names:
            raise DataError(
                f"dataset {self.name!r} has no column {self.field!r} (columns: {ds.column_names}); "
                f"set the source's `field` option"
            )
        for row in ds:
            yield row[self.field]


def make_source(spec: str | dict | Source | None) -> Source:
    """Build a source from a short spec.

    * ``None``: Python's stdlib ``*.py`` files;
    * ``"github"`` / ``"byted"``: synthetic (``{"kind": "synthetic", ...}`` for options);
    * ``"hf:<name>"``: a Hugging Face dataset;
    * a path ending in ``.jsonl`` (or a glob of them): JSONL with field ``text``;
    * any other path or glob: text files;
    * a dict with ``kind`` in ``text | jsonl | synthetic | hf`` and that kind's options.
    """
    if spec is None:
        return TextFilesSource()
    if isinstance(spec, Mapping):  # a dict, or a Hydra/OmegaConf mapping
        opts = dict(spec)
        kind = opts.pop("kind", None)
        kinds = {"text": TextFilesSource, "jsonl": JsonlSource, "synthetic": SyntheticSource, "hf": HFSource}
        if kind not in kinds:
            raise DataError(f"unknown source kind {kind!r}; use one of {sorted(kinds)}")
        try:
            return kinds[kind](**opts)
        except TypeError as err:
            raise DataError(f"bad options for a {kind!r} source: {err}") from err
    if isinstance(spec, str):
        if spec in ("github", "byted"):
            return SyntheticSource(name=spec)
        if spec.startswith("hf:"):
            return HFSource(name=spec[3:])
        if spec.endswith(".jsonl"):
            return JsonlSource(path=spec)
        return TextFilesSource(path=spec)
    return spec
