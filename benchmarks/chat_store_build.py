"""How fast a chat token store is built: tokens/s of ``prepare_data`` on ~100 MB of chat JSONL.

Generates synthetic conversations whose messages are real text (chunks of Python's standard
library: prose, docstrings and code), trains a 32K byte-level BPE tokenizer with ChatML's special
tokens on part of it, then builds the loss-masked store (ChatML template, ``loss_on="assistant"``)
with 1 and 2 tokenizing processes, each from a fresh cache.  Also times the two halves of the
work on a sample (rendering the template and locating the assistant's text, and the tokenizer
itself), and the same bytes as plain text for comparison.  Prints and writes JSON
(``benchmarks/results/chat_store_build.json``).

    python benchmarks/chat_store_build.py --mb 100 --workers 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from lightning_bytescale.data.chat import ChatRecord
from lightning_bytescale.data.chat_encoder import CHATML, ChatEncoder
from lightning_bytescale.data.synthetic_chat import SPECIAL_TOKENS, train_tokenizer, write_jsonl
from lightning_bytescale.data.tokenizer import JsonTokenizer
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

RESULTS = Path(__file__).with_name("results") / "chat_store_build.json"


def stdlib_chunks(seed: int) -> list[str]:
    """Paragraph-sized pieces of the standard library's sources."""
    rng = random.Random(seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines = text.splitlines()
        i = 0
        while i < len(lines):
            n = rng.randrange(4, 40)
            chunks.append("\n".join(lines[i : i + n]))
            i += n
    return chunks


def conversations(chunks: list[str], seed: int):
    """Endless conversations of 1-4 turns (a third with a system message), each message a chunk."""
    rng = random.Random(seed)
    asks = ("Explain this:", "What does this do?", "Rewrite this more simply:", "Continue:", "Summarise:")
    while True:
        messages = []
        if rng.random() < 0.33:
            messages.append({"role": "system", "content": "You are a careful programming assistant."})
        for _ in range(rng.randrange(1, 5)):
            messages.append({"role": "user", "content": f"{rng.choice(asks)}\n{rng.choice(chunks)}"})
            messages.append({"role": "assistant", "content": rng.choice(chunks)})
        yield {"messages": messages}


def build(source: dict, tokenizer: Path, cache: Path, workers: int, **kw) -> dict:
    dm = ByteScaleDataModule(
        source=source,
        tokenizer=str(tokenizer),
        cache_dir=cache,
        tokenize_workers=workers,
        progress=False,
        **kw,
    )
    start = time.perf_counter()
    dm.prepare_data()
    seconds = time.perf_counter() - start
    meta = json.loads((dm.store_dir / "meta.json").read_text())
    return {
        "workers": workers,
        "seconds": round(seconds, 2),
        "documents": meta["num_docs"],
        "tokens": meta["num_tokens"],
        "loss_tokens": meta["loss_tokens"],
        "tokens_per_s": round(meta["num_tokens"] / seconds),
        "mb_per_s": None,
    }


def phases(records: list[dict], tokenizer: Path) -> dict:
    """Per-record cost of rendering + locating assistant spans, and of tokenizing the rendered text."""
    tok = JsonTokenizer(tokenizer)
    enc = ChatEncoder(tok, "assistant", "chatml")
    recs = [ChatRecord(messages=r["messages"], where="bench") for r in records]
    start = time.perf_counter()
    texts = [enc.spans(r)[0] for r in recs]
    render = time.perf_counter() - start
    start = time.perf_counter()
    n = sum(len(e.ids) for e in tok.backend.encode_batch(texts, add_special_tokens=False))
    tokenize = time.perf_counter() - start
    return {
        "records": len(recs),
        "render_and_spans_us_per_record": round(1e6 * render / len(recs), 1),
        "tokenize_us_per_record": round(1e6 * tokenize / len(recs), 1),
        "tokens_per_record": round(n / len(recs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="size of the generated JSONL")
    parser.add_argument("--workers", default="1,2", help="tokenizing processes to compare")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--plain", action="store_true", help="also build the same text as plain documents")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        chunks = stdlib_chunks(0)
        data = folder / "chat.jsonl"
        gen = conversations(chunks, 1)
        t0 = time.perf_counter()
        size = write_jsonl(data, gen, max_bytes=int(args.mb * 2**20))
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sample = conversations(chunks, 2)
        train_recs = [next(sample) for _ in range(4000)]
        tok = train_tokenizer(train_recs, args.vocab)
        tok_path = folder / "tokenizer.json"
        tok.save(str(tok_path))
        (folder / "chat_template.jinja").write_text(CHATML)
        train_s = time.perf_counter() - t0
        source = {"kind": "chat", "path": str(data)}
        runs = []
        for w in [int(x) for x in args.workers.split(",")]:
            load = os.getloadavg()[0]
            row = build(source, tok_path, folder / f"cache{w}", w)
            row["mb_per_s"] = round(size / 2**20 / row["seconds"], 2)
            row["load_before"] = round(load, 2)
            runs.append(row)
            print(json.dumps(row), flush=True)
        result = {
            "what": "chat token store build (ByteScaleDataModule.prepare_data), ChatML, loss_on=assistant",
            "jsonl_bytes": size,
            "generate_s": round(gen_s, 1),
            "tokenizer": {
                "kind": "byte-level BPE",
                "vocab_size": tok.get_vocab_size(),
                "special": SPECIAL_TOKENS,
                "train_s": round(train_s, 1),
            },  # fmt: skip
            "runs": runs,
            "phases": phases(train_recs[:2000], tok_path),
            "machine": {
                "cpus": len(os.sched_getaffinity(0)),
                "python": platform.python_version(),
                "platform": platform.platform(),
                "note": "a shared machine: other jobs ran on the same cores (load_before)",
            },
        }
        if args.plain:
            text = folder / "text.jsonl"
            write_jsonl(text, ({"text": "\n".join(m["content"] for m in r["messages"])} for r in conversations(chunks, 1)),
                        max_bytes=int(args.mb * 2**20))  # fmt: skip
            dm = ByteScaleDataModule(
                source=str(text), tokenizer=str(tok_path), cache_dir=folder / "plain", progress=False
            )
            t0 = time.perf_counter()
            dm.prepare_data()
            secs = time.perf_counter() - t0
            meta = json.loads((dm.store_dir / "meta.json").read_text())
            result["plain_text"] = {"seconds": round(secs, 2), "tokens": meta["num_tokens"],
                                    "tokens_per_s": round(meta["num_tokens"] / secs)}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
