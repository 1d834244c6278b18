"""Where documents come from: text files, JSONL, synthetic length distributions, HF datasets.

A source yields documents in a fixed, deterministic order, either as text (tokenized by the
store builder) or, for synthetic data, directly as token arrays.  Each source has a
``fingerprint`` that changes when its content may have changed, so a cached token store is
rebuilt exactly when needed.  File sources fingerprint the *content* of every file (xxh3-128,
about 9 GB/s from the page cache), not sizes and modification times, which ``cp -p``,
``rsync -t`` or ``tar`` keep across an edit.  They also record the digest of the bytes they
actually read (:attr:`FileSourceMixin.last_read`), so a file edited while a store is built is
caught instead of being half-read.

Text folders skip binary files (a NUL byte among the first 8,000 bytes, as git decides) and
warn with their count; JSONL must be UTF-8, and a line that is not fails naming the file and
line.  Every ``OSError`` on the way becomes a :class:`DataError` naming the file (the cause is
kept as ``__cause__``).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import json
import mmap
import os
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from lightning_bytescale.data.errors import DataError
from lightning_bytescale.planner import distributions

Document = str | np.ndarray

BINARY_PROBE_BYTES = 8000  # git's heuristic: a NUL byte in the first 8000 bytes means binary
_READ_CHUNK = 64 << 20
_COUNT_BYTES = 256 << 20  # JSONL sources up to this size count their lines exactly for the progress bar


class Source(Protocol):
    @property
    def fingerprint(self) -> str: ...

    def iter_documents(self, vocab_size: int) -> Iterator[Document]: ...


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FileStamp:
    """A file as it was hashed: its path, size and xxh3-128 content digest."""

    path: str
    size: int
    digest: str

    def as_list(self) -> list:
        return [self.path, self.size, self.digest]


def file_digest(path: str | Path) -> FileStamp:
    """Hash a file's content (xxh3-128), raising :class:`DataError` if it cannot be read.

    The file is memory-mapped (no copy through a read buffer: about twice the speed of
    ``readinto``); files that cannot be mapped (empty, special) are read in chunks.
    """
    h = xxhash.xxh3_128()
    try:
        with open(path, "rb") as fh:
            try:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                mapped = None
            if mapped is not None:
                with mapped:
                    view = memoryview(mapped)
                    try:
                        for start in range(0, len(view), _READ_CHUNK):
                            h.update(view[start : start + _READ_CHUNK])
                    finally:
                        view.release()
                    size = len(mapped)
            else:
                size = 0
                while chunk := fh.read(_READ_CHUNK):
                    h.update(chunk)
                    size += len(chunk)
    except OSError as err:
        raise _read_error(path, err) from err
    return FileStamp(str(path), size, h.hexdigest())


def _lines(path: Path) -> Iterator[bytes]:
    """A file's lines as bytes; an ``OSError`` (a folder, no permission) becomes a :class:`DataError`."""
    try:
        with open(path, "rb") as fh:
            yield from fh
    except OSError as err:
        raise _read_error(path, err) from err


def missing_folder(path: str | Path) -> str | None:
    """Why ``path`` (a file, a folder or a glob) finds nothing when what it names does not exist:
    ``"the folder /data/corpus does not exist (/data exists)"``; None when it exists."""
    text = str(path)
    base = text
    if globlib.has_magic(text):  # the fixed part before the first wildcard
        fixed = []
        for part in Path(text).parts:
            if globlib.has_magic(part):
                break
            fixed.append(part)
        base = str(Path(*fixed)) if fixed else "."
    if os.path.exists(base):
        return None
    above = Path(os.path.abspath(base)).parent
    while not above.exists() and above != above.parent:
        above = above.parent
    what = "the folder" if globlib.has_magic(text) or not Path(base).suffix else "the path"
    return f"{what} {base} does not exist ({above} exists); check the path"


def _read_error(path: str | Path, err: OSError) -> DataError:
    return DataError(
        f"cannot read source file {path}: {err.strerror or err}; check the path and its permissions"
    )


def changed_files(before: Sequence[FileStamp], after: Sequence[FileStamp]) -> list[str]:
    """What differs between two hashings of a source, one line per file (``path: what``)."""
    old = {s.path: s for s in before}
    new = {s.path: s for s in after}
    out = []
    for path in sorted(old.keys() | new.keys()):
        a, b = old.get(path), new.get(path)
        if a is None:
            out.append(f"{path}: new")
        elif b is None:
            out.append(f"{path}: removed")
        elif a.digest != b.digest:
            how = "same size" if a.size == b.size else f"{a.size} -> {b.size} bytes"
            out.append(f"{path}: content changed ({how})")
    return out


def stamps_from_lists(rows: Sequence[Sequence]) -> list[FileStamp]:
    return [FileStamp(str(p), int(n), str(d)) for p, n, d in rows]


def default_corpus() -> str:
    """Python's standard library source tree: real text, present on every machine."""
    return sysconfig.get_paths()["stdlib"]


class FileSourceMixin:
    """Shared by file sources: content fingerprints and the digests of what was read."""

    kind = "files"

    def files(self) -> list[Path]:  # pragma: no cover - every file source defines it
        raise NotImplementedError

    def options(self) -> dict:
        """What selects and reads the files (not their content)."""
        raise NotImplementedError  # pragma: no cover

    @property
    def key(self) -> str:
        """The source's identity without its content: stores of older versions share it."""
        return _hash(self.kind, self.options())

    def stamps(self) -> list[FileStamp]:
        return [file_digest(p) for p in self.files()]

    def fingerprint_of(self, stamps: Sequence[FileStamp]) -> str:
        return _hash(self.kind, self.options(), [s.as_list() for s in stamps])

    @property
    def fingerprint(self) -> str:
        return self.fingerprint_of(self.stamps())

    @property
    def last_read(self) -> list[FileStamp]:
        """Stamps of the bytes the last full pass of :meth:`iter_documents` read."""
        return list(getattr(self, "_last_read", []))

    def _start_pass(self) -> list[FileStamp]:
        read: list[FileStamp] = []
        self._last_read = read
        return read


@dataclass
class TextFilesSource(FileSourceMixin):
    """Every file under a folder (matching ``pattern``, recursively) or matching a glob.

    Each file is one document, read as UTF-8: undecodable bytes are replaced (the files and the
    first line are named in a warning); binary files are skipped and counted in a warning.
    Files are taken in sorted path order.
    """

    path: str | None = None  # folder or glob; None: Python's stdlib source tree
    pattern: str = "*.py"  # used when ``path`` is a folder
    max_files: int | None = None
    exclude: tuple[str, ...] = ("site-packages", "dist-packages", "__pycache__")  # folder names

    kind = "text"

    def options(self) -> dict:
        return {
            "path": os.path.abspath(self.path or default_corpus()),
            "pattern": self.pattern,
            "max_files": self.max_files,
            "exclude": list(self.exclude),
        }

    def files(self) -> list[Path]:
        path = self.path or default_corpus()
        try:
            if os.path.isdir(path):
                skip = set(self.exclude)
                found = sorted(
                    p
                    for p in Path(path).rglob(self.pattern)
                    if p.is_file() and not skip.intersection(p.relative_to(path).parts[:-1])
                )
            else:
                found = sorted(Path(p) for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
        except OSError as err:
            raise _read_error(err.filename or path, err) from err
        if self.max_files is not None:
            found = found[: self.max_files]
        if not found:
            missing = missing_folder(path)
            if missing is not None:
                raise DataError(f"text source {str(path)!r}: {missing}")
            where = f"folder {path} (pattern {self.pattern!r})" if os.path.isdir(path) else f"glob {path!r}"
            raise DataError(
                f"no text files found in {where}; check the path, or choose the files: {PATTERN_HOW}"
            )
        return found

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        read = self._start_pass()
        binary: list[Path] = []
        replaced: list[str] = []
        for p in self.files():
            try:
                data = p.read_bytes()
            except OSError as err:
                raise _read_error(p, err) from err
            read.append(FileStamp(str(p), len(data), xxhash.xxh3_128_hexdigest(data)))
            if b"\0" in data[:BINARY_PROBE_BYTES]:
                binary.append(p)
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as err:
                line = data.count(b"\n", 0, err.start) + 1
                replaced.append(f"{p}:{line}")
                text = data.decode("utf-8", errors="replace")
            yield text
        self.skipped_binary = [str(p) for p in binary]
        if binary:
            warnings.warn(
                f"skipped {len(binary)} binary file(s) of {len(read)} in the text source {self.path or default_corpus()} "
                f"(first: {binary[0]}); select text files only with a narrower glob or {PATTERN_HOW}",
                stacklevel=2,
            )
        if replaced:
            warnings.warn(
                f"{len(replaced)} file(s) of the text source are not valid UTF-8; their undecodable bytes "
                f"became U+FFFD (first: {replaced[0]}); re-encode them as UTF-8 to keep their text",
                stacklevel=2,
            )


@dataclass
class JsonlSource(FileSourceMixin):
    """One document per line of JSONL file(s): the string at ``field`` of each object.

    Lines must be UTF-8: an invalid byte fails naming the file and line, unless
    ``encoding_errors="replace"``.
    """

    path: str | Sequence[str] = ""
    field: str = "text"
    encoding_errors: str = "strict"  # or "replace"

    kind = "jsonl"

    def __post_init__(self) -> None:
        if self.encoding_errors not in ("strict", "replace"):
            raise DataError(f"encoding_errors={self.encoding_errors!r}; use 'strict' or 'replace'")

    def options(self) -> dict:
        pats = [self.path] if isinstance(self.path, str) else list(self.path)
        return {
            "path": [os.path.abspath(p) for p in pats],
            "field": self.field,
            "errors": self.encoding_errors,
        }

    def files(self) -> list[Path]:
        pats = [self.path] if isinstance(self.path, str) else list(self.path)
        found: list[Path] = []
        for pat in pats:
            hits = sorted(globlib.glob(str(pat), recursive=True))
            if not hits:
                missing = missing_folder(pat)
                raise DataError(f"JSONL source {pat!r}: {missing or 'matches no file'}")
            for h in hits:
                if os.path.isdir(h):
                    raise DataError(
                        f"JSONL source {pat!r} matches the folder {h}, not a file; point at the files "
                        f"inside it (for example {os.path.join(h, '*.jsonl')!r})"
                    )
                found.append(Path(h))
        return found

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        read = self._start_pass()
        for p in self.files():
            h, size = xxhash.xxh3_128(), 0
            for lineno, raw in enumerate(_lines(p), 1):
                h.update(raw)
                size += len(raw)
                yield from self._document(p, lineno, raw)
            read.append(FileStamp(str(p), size, h.hexdigest()))

    def count_hint(self) -> int | None:
        """About how many documents there are, for a progress bar's total: the files' lines,
        counted up to 256 MiB of files, estimated from the first MiB's line length beyond."""
        sizes: list[tuple[Path, int]] = []
        with contextlib.suppress(OSError):
            sizes = [(p, p.stat().st_size) for p in self.files()]
        if not sizes:
            return None
        total_bytes = sum(n for _, n in sizes)
        try:
            if total_bytes <= _COUNT_BYTES:
                lines = 0
                for p, _ in sizes:
                    with open(p, "rb") as fh:
                        while chunk := fh.read(_READ_CHUNK):
                            lines += chunk.count(b"\n")
                return lines
            with open(sizes[0][0], "rb") as fh:
                head = fh.read(1 << 20)
        except OSError:
            return None
        per_line = len(head) / max(1, head.count(b"\n"))
        return int(total_bytes / per_line)

    def _parse(self, p: Path, lineno: int, raw: bytes) -> dict | None:
        """One line as a JSON object (None for a blank line); errors name the file and line."""
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if self.encoding_errors == "strict":
                raise DataError(
                    f"{p}:{lineno}: not valid UTF-8 (byte {err.start + 1} of the line is "
                    f"{raw[err.start : err.start + 1]!r}); re-encode the file as UTF-8 (for example "
                    f"`iconv -f latin1 -t utf-8`), or set the source's encoding_errors='replace'"
                ) from err
            line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            return None
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{p}:{lineno}: not valid JSON ({err.msg})") from err
        if not isinstance(obj, dict):
            raise DataError(f"{p}:{lineno}: a JSON {type(obj).__name__}, not an object")
        return obj

    def _document(self, p: Path, lineno: int, raw: bytes) -> Iterator[Document]:
        obj = self._parse(p, lineno, raw)
        if obj is None:
            return
        if self.field not in obj:
            if "messages" in obj or {"prompt", "completion"} <= obj.keys():
                what = "a 'messages' list" if "messages" in obj else "a prompt and a completion"
                raise DataError(
                    f"{p}:{lineno}: no field {self.field!r}: this is a chat record ({what}), not a text "
                    f"document; train it as chat data: {chat_how(p)}"
                )
            raise DataError(
                f"{p}:{lineno}: no field {self.field!r} (its keys: {sorted(obj)[:10]}); name the key that "
                f"holds the text: {FIELD_HOW}"
            )
        text = obj[self.field]
        if not isinstance(text, str):
            raise DataError(f"{p}:{lineno}: field {self.field!r} is not a string")
        yield text


def _sample_lengths(name: str, n: int, seed: int) -> np.ndarray:
    return np.asarray(distributions.sample_lengths(name, n, seed=seed), dtype=np.int64)


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
        raw = _sample_lengths(self.name, self.num_samples, self.seed)
        scale = self.scale if self.context is None else self.context / distributions.REFERENCE_CONTEXT
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

    def rows(self) -> Iterator[dict]:
        """The dataset's rows (``datasets.load_dataset``)."""
        try:
            import datasets  # optional (the hf extra): only this source needs it
        except ImportError as err:
            raise DataError(
                "the Hugging Face source needs the `datasets` package: pip install datasets "
                "(or pip install 'lightning-bytescale[hf]')"
            ) from err
        ds = datasets.load_dataset(
            self.name, self.config, split=self.split, revision=self.revision, **self.kwargs
        )
        self.check_columns(list(ds.column_names))
        yield from ds

    def check_columns(self, names: list[str]) -> None:
        """Raise a :class:`DataError` naming what is missing if the rows lack a needed column."""
        if self.field not in names:
            raise DataError(
                f"dataset {self.name!r} has no column {self.field!r} (columns: {names}); name the column "
                f"that holds the text: {FIELD_HOW}"
            )

    def iter_documents(self, vocab_size: int) -> Iterator[Document]:
        for row in self.rows():
            yield row[self.field]


FIELD_HOW = (
    "data.field=<key> on the bytescale-train command line, ByteScaleDataModule(field='<key>') in Python"
)


def chat_how(path: str | Path) -> str:
    """How to train the chat records of ``path``, on the command line and in Python."""
    return (
        f"data=chat data.source.path={path} on the bytescale-train command line (with data.tokenizer=<a "
        f"tokenizer with a chat template>), ByteScaleDataModule(source={{'kind': 'chat', 'path': '{path}'}}, "
        "tokenizer=...) in Python"
    )


PATTERN_HOW = (
    "data.pattern='*.md' on the bytescale-train command line, ByteScaleDataModule(pattern='*.md') in Python"
)
