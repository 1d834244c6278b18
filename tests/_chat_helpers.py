"""The chat tests' word-level vocabulary and tokenizer, a conversation, and ChatML written by hand.

Shared by ``tests/data`` and ``tests/lightning`` (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
WORDS = [
    "user",
    "assistant",
    "system",
    "hi",
    "hello",
    "there",
    "bye",
    "ok",
    "what",
    "is",
    "two",
    "four",
    "?",
    ".",
]
VOCAB = {w: i for i, w in enumerate([*SPECIAL, *WORDS])}


def word_tokenizer(path: Path, bos: bool = True) -> Path:
    """A word-level ``tokenizers`` JSON file (with a BOS post-processor) at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])]
        )
    tok.save(str(path))
    return path


CONVERSATION = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ok bye"},
]
CONTENT_WORDS = ["hi", "hello", "there", "bye", "ok", "what", "is", "two", "four", "?", "."]


def by_hand(messages: list[dict], loss_on: str) -> tuple[list[int], list[int]]:
    """ChatML ids and the mask written without the template: the assistant's words and end token."""
    ids, mask = [], []
    last = len(messages) - 1
    for k, m in enumerate(messages):
        words = [VOCAB[w] for w in m["content"].split()]
        ids += [VOCAB["<|im_start|>"], VOCAB[m["role"]], *words, VOCAB["<|im_end|>"]]
        trained = m["role"] == "assistant" and (loss_on == "assistant" or k == last)
        mask += [0, 0, *([int(trained)] * (len(words) + 1))]
    mask[:1] = [0]
    return ids, mask
