"""Synthetic chat data and a small chat tokenizer: SFT examples that need no download.

:func:`records` yields conversations (``messages``) and prompt/completion pairs whose answers
follow from their questions (arithmetic, reversing words, sorting numbers, counting letters,
capitals), so a small model visibly learns them.  Some have a system message, some several
turns.  :func:`train_tokenizer` trains a byte-level BPE tokenizer with ChatML's special tokens on
such text.  The package ships a sample of both (``lightning_bytescale/data/samples``: the
recipe preset ``hf_sft_cpu_smoke`` uses it); ``python -m lightning_bytescale.data.synthetic_chat
--out <folder>`` writes them again, and the store-build benchmark generates 100 MB with
:func:`write_jsonl`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from lightning_bytescale.data.chat_encoder import CHATML

SAMPLES_DIR = Path(__file__).with_name("samples")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa", "Norway": "Oslo", "Chile": "Santiago",
    "Greece": "Athens", "India": "New Delhi", "Brazil": "Brasilia", "Poland": "Warsaw",
}  # fmt: skip
_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "seven",
    "window",
    "bright",
    "garden",
    "silver",
    "ocean",
    "paper",
    "little",
    "winter",
    "yellow",
    "orange",
    "tiger",
    "music",
    "quiet",
    "rocket",
    "planet",
    "forest",
    "candle",
    "mirror",
    "purple",
    "dragon",
]
_SYSTEMS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one sentence.",
    "You answer questions about numbers and words.",
)


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randrange(2, 13), rng.randrange(2, 13)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 2:
        words = rng.sample(_WORDS, rng.randrange(2, 6))
        return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))
    if kind == 3:
        nums = [rng.randrange(100) for _ in range(rng.randrange(3, 7))]
        return (
            f"Sort these numbers: {', '.join(map(str, nums))}",
            f"Sorted: {', '.join(map(str, sorted(nums)))}.",
        )
    if kind == 4:
        word = rng.choice(_WORDS)
        letter = rng.choice(word)
        return (
            f"How many times does '{letter}' appear in '{word}'?",
            f"'{letter}' appears {word.count(letter)} times in '{word}'.",
        )
    country = rng.choice(sorted(_CAPITALS))
    return f"What is the capital of {country}?", f"The capital of {country} is {_CAPITALS[country]}."


def records(n: int, seed: int = 0, *, max_turns: int = 3, pairs: float = 0.1) -> Iterator[dict]:
    """``n`` records: conversations of 1 to ``max_turns`` turns and a ``pairs`` share of prompt/completion pairs."""
    rng = random.Random(seed)
    for _ in range(n):
        if rng.random() < pairs:
            question, answer = _task(rng)
            yield {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"}
            continue
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(rng.randrange(1, max_turns + 1)):
            question, answer = _task(rng)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        yield {"messages": messages}


def write_jsonl(path: str | Path, recs: Iterable[dict], max_bytes: int | None = None) -> int:
    """Write records as JSONL (stopping after ``max_bytes``); returns the bytes written."""
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        for rec in recs:
            line = json.dumps(rec, ensure_ascii=False) + "\n"
            fh.write(line)
            written += len(line.encode())
            if max_bytes is not None and written >= max_bytes:
                break
    return written


def _texts(recs: Iterable[dict]) -> Iterator[str]:
    for rec in recs:
        if "messages" in rec:
            yield "\n".join(m["content"] for m in rec["messages"])
        else:
            yield rec["prompt"] + rec["completion"]


def train_tokenizer(recs: Iterable[dict], vocab_size: int = 1024):
    """A byte-level BPE tokenizer (``tokenizers``) with ChatML's special tokens, trained on ``recs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional dependency

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(recs), trainer=trainer)
    return tok


def write_samples(folder: str | Path, n: int = 600, vocab_size: int = 1024, seed: int = 0) -> Path:
    """The shipped sample: ``chat.jsonl``, ``tokenizer.json`` and ``chat_template.jinja`` (ChatML)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "chat.jsonl", records(n, seed))
    train_tokenizer(records(4 * n, seed + 1), vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(SAMPLES_DIR), help="folder to write the sample into")
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)
    print(write_samples(args.out, args.records, args.vocab_size))


if __name__ == "__main__":
    main()
