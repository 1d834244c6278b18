"""Resident saved-activation bytes and step time against the offload ratio, on CPU.

On CPU the "host" is a store of clones, so the time column measures the bookkeeping and copy
cost of the hooks, not PCIe; the byte columns are what a GPU run would keep on the device.
Writes ``benchmarks/results/offload_cpu.json``.

    python benchmarks/offload_cpu.py [--preset small] [--layers 8] [--length 2048]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch

from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.offload.offloader import OUTSIDE, ActivationOffloader
from lightning_bytescale.packed_attention import attention_context
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.planner.cost_model import OffloadConfig

RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "offload_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig.preset(args.preset, layers=args.layers)
    model = LlamaModel(cfg)
    s = args.length
    ids = torch.randint(0, cfg.vocab, (s,))
    layout = AttentionLayout(torch.tensor([0, s]), (s,))
    offloader = ActivationOffloader(model.blocks)
    link = OffloadConfig(layers_per_rank=args.layers)

    def step(ctx) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with ctx, attention_context(layout):
            logits = model(ids, torch.arange(s))
            torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).backward()
        return time.perf_counter() - start

    base = min(step(contextlib.nullcontext()) for _ in range(args.repeats))
    rows = []
    for r in RATIOS:
        times = []
        for _ in range(args.repeats):
            offloader.reset_peak()
            times.append(step(offloader.context(0, r)))
            gc.collect()
        st = offloader.pass_stats[0]
        layers_total = sum(b for i, b in st.layer_bytes.items() if i != OUTSIDE)
        layers_resident = sum(b for i, b in st.layer_resident_bytes.items() if i != OUTSIDE)
        rows.append(
            dict(
                ratio=r,
                offloaded_layers=list(st.offloaded_layers),
                saved_bytes=st.saved_bytes,
                resident_bytes=st.resident_bytes,
                offloaded_bytes=st.offloaded_bytes,
                peak_device_bytes=offloader.stats.peak_device_bytes,
                layer_resident_fraction=layers_resident / layers_total,
                eq3_resident_fraction=link.resident_fraction(r),
                seconds=min(times),
                overhead=min(times) / base - 1,
            )
        )
    print(f"{args.preset} preset, {args.layers} layers, {s} tokens, float32, baseline {base * 1e3:.1f} ms")
    print(
        f"{'r':>5} {'layers':>12} {'resident MB':>11} {'offload MB':>10} {'peak MB':>8} {'frac':>6} {'Eq3 f':>6} {'time':>8}"
    )
    for row in rows:
        print(
            f"{row['ratio']:>5.2f} {str(row['offloaded_layers']):>12} {row['resident_bytes'] / 1e6:>11.2f} "
            f"{row['offloaded_bytes'] / 1e6:>10.2f} {row['peak_device_bytes'] / 1e6:>8.2f} "
            f"{row['layer_resident_fraction']:>6.3f} {row['eq3_resident_fraction']:>6.3f} {row['overhead']:>+8.1%}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(preset=args.preset, layers=args.layers, length=s, baseline_seconds=base, device="cpu")
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
