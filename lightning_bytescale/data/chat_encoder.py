"""Chat records to token ids and a loss mask, with a Hugging Face tokenizer and its chat template.

``loss_on`` chooses the trained tokens:

* ``"assistant"``: every assistant message of a conversation (its content and what the template
  writes up to the next message: the end-of-turn token, so the model learns to stop); for a
  prompt/completion pair, the completion;
* ``"completion"``: only the final assistant message (a conversation whose last message is not
  the assistant's has nothing to train); for a pair, the completion;
* ``"all"``: every token (the store then keeps no mask).

How the assistant text is found in the rendered conversation: a template with
``{% generation %}`` blocks marks it itself (transformers' assistant tracker).  Otherwise each
assistant message ``i`` spans from the end of the conversation before it rendered with the
generation prompt (``messages[:i]``, ``add_generation_prompt=True``) to the end of the
conversation up to it (``messages[:i + 1]``).  That holds only if the template renders a prefix of
the conversation as a prefix of the whole; a template that rewrites earlier turns (drops their
reasoning, say) is refused with an error naming the record, rather than training on the wrong
tokens.  The rendered text is tokenized once, with character offsets; a token is trained if
one of its characters lies in a trained span.

A prompt/completion pair of strings uses no template: the prompt is tokenized with the
tokenizer's special tokens (its BOS, say), the completion without, then the end-of-sequence token
is appended and trained with the completion.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_bytescale.data.chat import ChatRecord, Messages
from lightning_bytescale.data.encode import MaskedTokens
from lightning_bytescale.data.errors import DataError

LOSS_ON = ("assistant", "completion", "all")

# ChatML (Qwen's layout): what a tokenizer without a template of its own can use
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def resolve_template(spec: str | None, tokenizer) -> str:
    """The template text: ``spec`` (a built-in name, a ``.jinja`` file or template text) or the tokenizer's."""
    if spec is None:
        own = getattr(tokenizer, "chat_template", lambda: None)()
        if own:
            return own
        raise DataError(
            f"the tokenizer {getattr(tokenizer, 'path', tokenizer)} has no chat template, which chat data "
            f"need: pass chat_template= (a .jinja file, the template text, or {sorted(BUILTIN_TEMPLATES)} "
            f"for a tokenizer that has ChatML's <|im_start|> and <|im_end|> tokens), or point tokenizer= at "
            f"a model folder whose tokenizer has one"
        )
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    if "{" not in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DataError(
                f"chat_template={spec!r} is neither a built-in template {sorted(BUILTIN_TEMPLATES)}, nor a "
                f"file, nor template text"
            )
        return path.read_text()
    return spec


@dataclass
class Spans:
    """Character spans ``[start, end)`` of a rendered text that are trained, sorted."""

    starts: np.ndarray
    ends: np.ndarray

    def token_mask(self, offsets: np.ndarray) -> np.ndarray:
        """Whether each token (character offsets ``[n, 2]``) has a character inside a span."""
        if offsets.size == 0 or self.starts.size == 0:
            return np.zeros(len(offsets), dtype=bool)
        lo = offsets[:, 0]
        hi = np.maximum(offsets[:, 1], lo + 1)  # a zero-width token counts as its position
        k = np.searchsorted(self.ends, lo, side="right")  # the first span that ends after the token starts
        inside = k < self.starts.size
        out = np.zeros(lo.size, dtype=bool)
        out[inside] = self.starts[k[inside]] < hi[inside]
        return out


class ChatEncoder:
    """Encodes :class:`ChatRecord`s for the token store: ids plus (unless ``loss_on="all"``) a mask.

    ``tokenizer`` is a :class:`~lightning_bytescale.data.tokenizer.BackendTokenizer` (a
    ``tokenizers`` JSON file or an ``AutoTokenizer`` folder).  Picklable: the store builder
    sends it to its worker processes.
    """

    def __init__(self, tokenizer, loss_on: str = "assistant", chat_template: str | None = None) -> None:
        if loss_on not in LOSS_ON:
            raise DataError(f"loss_on={loss_on!r}; use one of {LOSS_ON}")
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise DataError(
                f"chat data need a Hugging Face tokenizer (a tokenizers JSON file or a tokenizer folder), "
                f"not {type(tokenizer).__name__}; set tokenizer= to one"
            )
        self.loss_on = loss_on
        self.backend = backend
        self.template_spec = chat_template
        self.template = resolve_template(chat_template, tokenizer)
        self.special = dict(tokenizer.special_tokens())
        self.vocab_size = int(tokenizer.vocab_size)
        self.end_id = tokenizer.eos_id  # appended after a plain completion
        self.eos_id = None  # documents end with whatever the template writes
        self.tracked = bool(_GENERATION_TAG.search(self.template))
        self._fingerprint = hashlib.sha256(
            repr(
                ("chat-v1", tokenizer.fingerprint, self.template, loss_on, sorted(self.special.items()))
            ).encode()
        ).hexdigest()[:16]

    @property
    def fingerprint(self) -> str:
        return f"chat-{self._fingerprint}"

    @property
    def loss_mask(self) -> bool:
        """Whether the store keeps a mask (every ``loss_on`` but ``"all"``)."""
        return self.loss_on != "all"

    # ----------------------------------------------------------------------------- rendering
    def render(self, messages: Messages, add_generation_prompt: bool = False, where: str = "") -> str:
        text, _ = self._render(messages, add_generation_prompt, False, where)
        return text

    def _render(self, messages, add_generation_prompt, track, where) -> tuple[str, list]:
        # optional dependency (the hf extra): only chat templates need it, not plain-text data
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, spans = render_jinja_template(
                conversations=[messages], chat_template=self.template, add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=track, **self.special,
            )  # fmt: skip
        except Exception as err:
            raise DataError(f"{where}: the chat template failed on this record: {err}") from err
        return texts[0], (spans[0] if track else [])

    def spans(self, record: ChatRecord) -> tuple[str, Spans]:
        """The rendered conversation and its trained character spans."""
        messages = record.conversation()
        where = record.where
        roles = [m["role"] for m in messages]
        final = len(messages) - record.num_final
        if self.loss_on == "all":
            text = self.render(messages, where=where)
            return text, Spans(np.array([0]), np.array([len(text)]))
        if self.loss_on == "completion" or record.messages is None:
            chosen = [i for i in range(final, len(messages)) if roles[i] == "assistant"]
        else:
            chosen = [i for i, r in enumerate(roles) if r == "assistant"]
        if self.tracked:
            text, tracked = self._render(messages, False, True, where)
            assistants = [i for i, r in enumerate(roles) if r == "assistant"]
            if len(tracked) != len(assistants):
                raise DataError(
                    f"{where}: the chat template's {{% generation %}} blocks marked {len(tracked)} spans for "
                    f"{len(assistants)} assistant messages; the template must wrap each assistant message once"
                )
            pick = {i: span for i, span in zip(assistants, tracked)}
            pairs = [pick[i] for i in chosen]
        else:
            text = self.render(messages, where=where)
            pairs = [self._prefix_span(messages, i, text, where) for i in chosen]
        starts = np.array([a for a, _ in pairs], dtype=np.int64)
        ends = np.array([b for _, b in pairs], dtype=np.int64)
        return text, Spans(starts, ends)

    def _prefix_span(self, messages: Messages, i: int, full: str, where: str) -> tuple[int, int]:
        before = self.render(messages[:i], add_generation_prompt=True, where=where)
        upto = full if i == len(messages) - 1 else self.render(messages[: i + 1], where=where)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(
                f"{where}: the chat template renders the conversation up to message {i} differently from the "
                f"same messages inside the whole conversation (it rewrites earlier turns, for example by "
                f"dropping their reasoning), so the assistant's tokens cannot be located. Use "
                f"loss_on='completion' (only the last assistant message), or a template whose assistant "
                f"content is wrapped in {{% generation %}} ... {{% endgeneration %}}"
            )
        return len(before), len(upto)

    # ------------------------------------------------------------------------------ encoding
    def encode_batch(self, records: Sequence[ChatRecord]) -> list[MaskedTokens | np.ndarray]:
        """Ids and masks of ``records`` (plain arrays with ``loss_on="all"``), in order."""
        out: list[MaskedTokens | np.ndarray | None] = [None] * len(records)
        texts, spans, rows = [], [], []
        for k, record in enumerate(records):
            if not isinstance(record, ChatRecord):
                raise DataError(f"chat data must be chat records, got {type(record).__name__}")
            if record.plain:
                out[k] = self._encode_plain(record)
            else:
                text, sp = self.spans(record)
                texts.append(text)
                spans.append(sp)
                rows.append(k)
        if texts:
            for k, enc, sp in zip(rows, self.backend.encode_batch(texts, add_special_tokens=False), spans):
                ids = np.asarray(enc.ids, dtype=np.int64)
                mask = sp.token_mask(np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2))
                out[k] = self._result(ids, mask)
        return out  # type: ignore[return-value]

    def _encode_plain(self, record: ChatRecord) -> MaskedTokens | np.ndarray:
        prompt = np.asarray(self.backend.encode(record.prompt, add_special_tokens=True).ids, dtype=np.int64)
        completion = np.asarray(
            self.backend.encode(record.completion, add_special_tokens=False).ids, dtype=np.int64
        )
        if self.end_id is not None and (completion.size == 0 or int(completion[-1]) != self.end_id):
            completion = np.append(completion, self.end_id)
        ids = np.concatenate([prompt, completion])
        mask = np.zeros(ids.size, dtype=bool)
        mask[prompt.size :] = True
        if self.loss_on == "all":
            mask[:] = True
        return self._result(ids, mask)

    def _result(self, ids: np.ndarray, mask: np.ndarray) -> MaskedTokens | np.ndarray:
        if not self.loss_mask:
            return ids
        mask = mask.copy()
        mask[:1] = False
        return MaskedTokens(ids, mask)

    def decode_trained(self, ids: np.ndarray, mask: np.ndarray) -> list[str]:
        """The trained runs of a document as text (to inspect what a mask trains)."""
        runs, start = [], None
        for i, m in enumerate([*mask.tolist(), False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                runs.append(self.backend.decode([int(t) for t in ids[start:i]], skip_special_tokens=False))
                start = None
        return runs
