"""Host memory of getting an HF checkpoint onto a rank: reading it vs receiving rank 0's broadcast.

Under ``ByteScaleStrategy``, ``HFCausalLM`` reads the checkpoint files on global rank 0 only
(``ModelSource.load``); every other rank builds the same model with uninitialised weights
(``ModelSource.build_empty``) and receives rank 0's values in the strategy's broadcast.  This
script writes a float32 Llama checkpoint, then measures, each in a fresh process, what each path
costs in host memory: resident memory right after the call, then peak resident set
(``VmHWM``), anonymous and file-backed resident memory after every tensor has been written once
(as the broadcast writes them), and wall time, minus a process that only imports the same
libraries.

On the CPU the model itself lives in host memory, so both paths end holding one copy; the
difference is the checkpoint files mapped and read (page cache, shared between processes) and
transient copies.  On a GPU the empty build allocates on the device (host: nothing), and the
loading rank holds the weights in host memory unless ``accelerate`` lets it load straight to
the device.

    .venv/bin/python benchmarks/hf_load_memory.py            # ~0.5 GB checkpoint
    .venv/bin/python benchmarks/hf_load_memory.py --layers 4 # smaller
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "hf_load_memory.json"


def _status_mb() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024.0
    return fields


def child(mode: str, folder: str) -> None:
    import torch

    from lightning_bytescale.hf.loading import ModelSource

    source = ModelSource(folder)
    config = source.config()
    started = time.perf_counter()
    if mode == "checkpoint":
        model = source.load(config, torch.float32)
    elif mode == "broadcast":
        model = source.build_empty(config, torch.float32)
    else:
        model = None
    seconds = time.perf_counter() - started
    after_call = _status_mb()
    n = 0
    if model is not None:  # what the strategy's broadcast does next on every rank: write every tensor
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.mul_(1)
                n += t.numel()
    print(
        json.dumps({"mode": mode, "seconds": seconds, "params": n, "after_call": after_call, **_status_mb()})
    )


def measure(mode: str, folder: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--folder", folder],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["imports", "checkpoint", "broadcast"])
    parser.add_argument("--folder")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.folder)
        return

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        cfg = AutoConfig.for_model(
            "llama",
            vocab_size=32000,
            hidden_size=args.hidden,
            intermediate_size=int(args.hidden * 2.75),
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 128,
        )
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(tmp)
        ckpt_mb = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors")) / 2**20
        del model
        runs: dict[str, list[dict]] = {m: [] for m in ("imports", "checkpoint", "broadcast")}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(measure(mode, tmp))
    base = {k: min(r[k] for r in runs["imports"]) for k in ("VmHWM", "RssAnon", "RssFile")}
    summary = {}
    for mode in ("checkpoint", "broadcast"):
        best = min(runs[mode], key=lambda r: r["VmHWM"])
        summary[mode] = {
            "seconds": round(min(r["seconds"] for r in runs[mode]), 3),
            "after_call_rss_mb": round(
                best["after_call"]["RssAnon"]
                + best["after_call"]["RssFile"]
                - base["RssAnon"]
                - base["RssFile"],
                1,
            ),
            "peak_rss_mb": round(best["VmHWM"] - base["VmHWM"], 1),
            "rss_anon_mb": round(best["RssAnon"] - base["RssAnon"], 1),
            "rss_file_mb": round(best["RssFile"] - base["RssFile"], 1),
        }
    result = {
        "what": (
            "host memory above an import-only process, float32 Llama, CPU, best of repeats: resident right "
            "after the call, and after writing every tensor once (as the broadcast does)"
        ),
        "params": runs["checkpoint"][0]["params"],
        "checkpoint_mb": round(ckpt_mb, 1),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        **summary,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
