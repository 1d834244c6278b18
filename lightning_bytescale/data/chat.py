"""Chat and prompt/completion records, from JSONL files or a Hugging Face ``datasets`` dataset.

Two record shapes, one per line (or row), mixed freely:

* ``{"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}``:
  a conversation, rendered with the tokenizer's chat template;
* ``{"prompt": ..., "completion": ...}``: both strings (the text is ``prompt + completion`` and
  the tokenizer's end-of-sequence token, no template), or both lists of messages (rendered
  with the chat template as one conversation, the completion's messages last).

Other keys of a message (``tool_calls``, ``name``, ``reasoning_content``, ...) are handed to
the template as they are.  A record is checked when it is read, and a bad one is a
:class:`DataError` naming its file and line (or dataset row) and what is wrong.  Records are
tokenized into ids and a loss mask by :mod:`.chat_encoder`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_bytescale.data.errors import DataError
from lightning_bytescale.data.sources import HFSource, JsonlSource, _hash

Messages = list[dict[str, Any]]


@dataclass
class ChatRecord:
    """One training example: a conversation, or a prompt and its completion."""

    messages: Messages | None = None
    prompt: str | Messages | None = None
    completion: str | Messages | None = None
    where: str = ""  # file:line or dataset row, for error messages

    @property
    def plain(self) -> bool:
        """A prompt/completion pair of strings (no chat template)."""
        return isinstance(self.prompt, str)

    def conversation(self) -> Messages:
        """The messages to render: ``messages``, or the prompt's followed by the completion's."""
        if self.messages is not None:
            return self.messages
        if self.plain:
            raise DataError(f"{self.where}: a prompt/completion of strings is not a conversation")
        return [*self.prompt, *self.completion]  # type: ignore[misc]

    @property
    def num_final(self) -> int:
        """How many messages at the end are the completion (the last one for a conversation)."""
        return len(self.completion) if self.messages is None and not self.plain else 1  # type: ignore[arg-type]


def _check_messages(value: Any, where: str, what: str) -> Messages:
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise DataError(
            f"{where}: {what} must be a non-empty list of messages {{'role': ..., 'content': ...}}, "
            f"got {type(value).__name__}"
        )
    out: Messages = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise DataError(f"{where}: {what}[{i}] is a {type(m).__name__}, not a message object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise DataError(f"{where}: {what}[{i}] has no 'role' (a string such as 'user' or 'assistant')")
        content = m.get("content")
        text_parts = isinstance(content, Sequence) and all(
            isinstance(part, Mapping) and part.get("type") == "text" for part in content
        )
        if content is not None and not isinstance(content, str) and not text_parts:
            raise DataError(
                f"{where}: {what}[{i}] ({role}) has content of type {type(content).__name__}; "
                f"use a string (or a list of {{'type': 'text', 'text': ...}} parts): only text is trained"
            )
        if content is None and role != "assistant":
            raise DataError(f"{where}: {what}[{i}] ({role}) has no 'content'")
        out.append(dict(m))
    return out


def parse_record(obj: Any, where: str, fields: ChatFields) -> ChatRecord:
    """A JSON object (or dataset row) as a :class:`ChatRecord`, checked."""
    if not isinstance(obj, Mapping):
        raise DataError(f"{where}: a record must be an object, got {type(obj).__name__}")
    if obj.get(fields.messages) is not None:
        return ChatRecord(messages=_check_messages(obj[fields.messages], where, fields.messages), where=where)
    prompt, completion = obj.get(fields.prompt), obj.get(fields.completion)
    if prompt is None or completion is None:
        raise DataError(
            f"{where}: no {fields.messages!r} and no {fields.prompt!r} + {fields.completion!r} "
            f"(keys: {sorted(obj)[:8]}); a chat record holds a list of messages "
            f"{{'role', 'content'}} or a prompt and a completion"
        )
    if isinstance(prompt, str) and isinstance(completion, str):
        return ChatRecord(prompt=prompt, completion=completion, where=where)
    if isinstance(prompt, str) or isinstance(completion, str):
        raise DataError(
            f"{where}: {fields.prompt!r} and {fields.completion!r} must both be strings or both lists of "
            f"messages, got {type(prompt).__name__} and {type(completion).__name__}"
        )
    return ChatRecord(
        prompt=_check_messages(prompt, where, fields.prompt),
        completion=_check_messages(completion, where, fields.completion),
        where=where,
    )


@dataclass(frozen=True)
class ChatFields:
    """Where a record keeps its parts."""

    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"


@dataclass
class ChatJsonlSource(JsonlSource):
    """Chat or prompt/completion records, one JSON object per line of JSONL file(s)."""

    field: str = "messages"  # the messages key (``prompt_field``/``completion_field`` for pairs)
    prompt_field: str = "prompt"
    completion_field: str = "completion"

    kind = "chat-jsonl"
    conversational = True

    @property
    def fields(self) -> ChatFields:
        return ChatFields(self.field, self.prompt_field, self.completion_field)

    def options(self) -> dict:
        return {**super().options(), "prompt": self.prompt_field, "completion": self.completion_field}

    def _document(self, p: Path, lineno: int, raw: bytes) -> Iterator[ChatRecord]:
        obj = self._parse(p, lineno, raw)
        if obj is not None:
            yield parse_record(obj, f"{p}:{lineno}", self.fields)


@dataclass
class ChatHFSource(HFSource):
    """Chat or prompt/completion records from a Hugging Face ``datasets`` dataset.

    ``name`` is what ``datasets.load_dataset`` takes: a hub name (pin ``revision``), a local
    folder, or a builder such as ``"json"`` with ``kwargs={"data_files": ...}``.
    """

    field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"

    conversational = True

    @property
    def fields(self) -> ChatFields:
        return ChatFields(self.field, self.prompt_field, self.completion_field)

    @property
    def fingerprint(self) -> str:
        return _hash("hf-chat", super().fingerprint, self.prompt_field, self.completion_field)

    def check_columns(self, names: list[str]) -> None:
        f = self.fields
        if f.messages not in names and not (f.prompt in names and f.completion in names):
            raise DataError(
                f"dataset {self.name!r} has neither a {f.messages!r} column nor {f.prompt!r} and "
                f"{f.completion!r} columns (columns: {names}); set the source's field, prompt_field "
                f"and completion_field options"
            )

    def iter_documents(self, vocab_size: int) -> Iterator[ChatRecord]:
        for i, row in enumerate(self.rows()):
            yield parse_record(row, f"dataset {self.name!r} ({self.split}) row {i}", self.fields)


def make_chat_source(opts: dict) -> ChatJsonlSource | ChatHFSource:
    """``{"path": ...}`` (JSONL files) or ``{"name": ...}`` (a ``datasets`` dataset), with options."""
    opts = {k: v for k, v in opts.items() if v is not None}  # a config lists both, one of them null
    has_path, has_name = "path" in opts, "name" in opts
    if has_path == has_name:
        raise DataError(
            "a chat source needs exactly one of `path` (JSONL file(s) or a glob) and `name` (a Hugging "
            f"Face dataset for datasets.load_dataset); got {sorted(opts) or 'neither'}. In a recipe: "
            "data.source.path=/data/chat.jsonl or data.source.name=<dataset>"
        )
    cls = ChatJsonlSource if has_path else ChatHFSource
    try:
        return cls(**opts)
    except TypeError as err:
        raise DataError(f"bad options for a chat source: {err}") from err
