"""From a source spec to a source: the one place that knows every kind of source.

A data module, a recipe or the ``bytescale-data`` command names its data as a short spec (a
path, a glob, ``"hf:<name>"``, ``"github"``) or a dict with a ``kind``.  Building the source
needs every kind, the plain ones of :mod:`.sources` and the chat ones of :mod:`.chat` (which
build on the plain ones), so it lives here, above both: :mod:`.chat` builds on :mod:`.sources`,
and :mod:`.sources` needs nothing of :mod:`.chat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_bytescale.data.chat import make_chat_source
from lightning_bytescale.data.errors import DataError
from lightning_bytescale.data.sources import HFSource, JsonlSource, Source, SyntheticSource, TextFilesSource

# the plain options of ByteScaleDataModule, and the sources that take each
SOURCE_OPTIONS = {"pattern": "a folder of text files", "field": "JSONL files or a Hugging Face dataset"}


def with_source_options(source: Source, spec: Any, **options: str | None) -> Source:
    """``source`` with ``pattern=`` / ``field=`` (the data module's plain arguments) applied.

    ``None`` leaves the source's own value.  An option the source does not take, or one that
    contradicts the same key in a dict ``spec``, fails naming both.
    """
    for name, value in options.items():
        if value is None:
            continue
        if not (dataclasses.is_dataclass(source) and name in {f.name for f in dataclasses.fields(source)}):
            raise DataError(
                f"{name}={value!r} is an option of {SOURCE_OPTIONS[name]}; this source ({type(source).__name__}) "
                f"has no {name!r}: leave {name} unset (data.{name}=null)"
            )
        if isinstance(spec, Mapping) and name in spec and spec[name] != value:
            raise DataError(
                f"{name}={value!r} contradicts the source's own {name}={spec[name]!r}; give it once "
                f"(data.{name}=... or in the source dict)"
            )
        source = dataclasses.replace(source, **{name: value})
    return source


def make_source(spec: str | dict | Source | None) -> Source:
    """Build a source from a short spec.

    * ``None``: Python's stdlib ``*.py`` files;
    * ``"github"`` / ``"byted"``: synthetic (``{"kind": "synthetic", ...}`` for options);
    * ``"hf:<name>"``: a Hugging Face dataset;
    * a path ending in ``.jsonl`` (or a glob of them): JSONL with field ``text``;
    * any other path or glob: text files;
    * a dict with ``kind`` in ``text | jsonl | synthetic | hf | chat`` and that kind's options
      (``chat``: chat or prompt/completion records from JSONL files, ``path``, or a Hugging Face
      dataset, ``name``; see :mod:`.chat`).
    """
    if spec is None:
        return TextFilesSource()
    if isinstance(spec, Mapping):  # a dict, or a Hydra/OmegaConf mapping
        opts = dict(spec)
        kind = opts.pop("kind", None)
        kinds = {"text": TextFilesSource, "jsonl": JsonlSource, "synthetic": SyntheticSource, "hf": HFSource}
        if kind == "chat":
            return make_chat_source(opts)
        if kind not in kinds:
            raise DataError(f"unknown source kind {kind!r}; use one of {sorted([*kinds, 'chat'])}")
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
