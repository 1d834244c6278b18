"""One-GPU check of what CPU tests cannot see: the strategy under a CUDA Trainer, ring kernels, offload.

Writes one JSON (``--out``) with four sections; each catches its own exception and records
it, so one failing section does not lose the others:

* ``trainer``: ``Trainer(strategy="bytescale", accelerator="gpu", devices=1)`` fits 20 steps
  in ``bf16-mixed`` (loss finite and falling) and in ``64-true``, where parameters must match
  an independent single-process float64 loop (whole sequences, plain causal SDPA, the same
  initial weights, SGD with momentum) to 1e-10; and the gradient finiteness flag (max-abs
  norm) on NaN, inf and huge finite values in three dtypes, with no host synchronisation;
* ``ring``: ring attention through the loopback ring (all members on this GPU, the P2P code
  path with in-memory transfers on the communication stream), N = 2, 4, 8, in bfloat16 /
  float32 / float64, max error of output and input gradients against a dense float64
  reference; throughput as a fraction of local attention on the same tokens (one causal
  sequence, N x 8K tokens, forward + backward; goal 0.85); and whether the ring loop runs
  without a host synchronisation (``torch.cuda.set_sync_debug_mode("error")``);
* ``offload``: activation offload on CUDA through ``benchmarks/gpu_offload_overlap.py``
  (imported): gradients bit-identical to no offload at r = 0.25 / 0.5 / 1.0, raw copy/compute
  overlap, step time and peak memory against r;
* ``flash_attn``: flash-attn's kernels against PyTorch's (accuracy and time of one varlen
  block, and the ring's throughput with each), or ``{"skipped": "flash-attn not installed"}``.

``--dry-run`` runs every section on the CPU with tiny sizes through the same code
(``accelerator="cpu"``, the ``cpu`` block kernel); CUDA-only measurements are recorded as
skipped.  It is what CI runs.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for gpu_offload_overlap

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run: a real GPU check or a CPU dry run."""

    steps: int
    capacity: int
    preset: str
    error_lens: tuple[int, ...]
    error_heads: tuple[int, int, int]  # query heads, key/value heads, head size
    tokens_per_member: int
    speed_heads: tuple[int, int, int]
    iters: int
    offload_lengths: tuple[int, ...]


GPU = Sizes(20, 1024, "small", (1531, 403, 64), (8, 2, 64), 8192, (32, 8, 128), 5, (4096, 16384))
DRY = Sizes(4, 64, "tiny", (45, 13), (4, 2, 16), 64, (4, 2, 16), 1, ())
RING_SIZES = (2, 4, 8)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# float64: absolute error; bfloat16 / float32: error relative to the reference's largest magnitude
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-3, "float64": 1e-10}


# ----------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    """Best wall time of ``fn`` over ``iters`` runs after one warm-up (device synchronised)."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens) -> torch.Tensor:
    """Reference: per-sequence causal softmax attention of packed ``[T, H, D]`` (GQA by repetition)."""
    g = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for s in seq_lens:
        qs, ks, vs = (x[start : start + s].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        scores = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        outs.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
        start += s
    return torch.cat(outs)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute error over the reference's largest magnitude."""
    return _max_err(a, b) / max(float(b.detach().abs().max()), 1e-300)


# ----------------------------------------------------------------------------- trainer
def _sequences(step: int, vocab: int, capacity: int) -> list[torch.Tensor]:
    """Learnable sequences (arithmetic progressions mod vocab), lengths up to ``capacity``."""
    g = torch.Generator().manual_seed(step)
    lens = torch.randint(
        capacity // 8, capacity + 1, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g
    )
    out = []
    for s in lens.tolist():
        a, b = torch.randint(0, vocab, (2,), generator=g).tolist()
        out.append((a + (b % 7 + 1) * torch.arange(s)) % vocab)
    return out


def trainer_section(device: torch.device, sizes: Sizes) -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import Dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_bytescale import ByteScaleStrategy, token_loss
    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.planner import make_plan

    cfg = LlamaConfig.preset(sizes.preset)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in LlamaModel(cfg).state_dict().items()}

    def optimizer(params, precision: str) -> torch.optim.Optimizer:
        # bf16: AdamW, to see the loss fall; float64: SGD with momentum, linear in the gradient,
        # so the exactness check compares gradients, not AdamW's amplification of rounding in
        # near-zero components
        if precision == "64-true":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)

    class Steps(Dataset):
        def __len__(self) -> int:
            return sizes.steps

        def __getitem__(self, k: int):
            seqs = _sequences(k, cfg.vocab, sizes.capacity)
            plan = make_plan([len(s) for s in seqs], world_size=1, capacity=sizes.capacity)
            return build_step(plan, 0, lambda j: seqs[j], step=k)

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return StatefulDataLoader(Steps(), batch_size=None, shuffle=False, num_workers=0)

    class LM(pl.LightningModule):
        def __init__(self, precision: str) -> None:
            super().__init__()
            self.precision_name = precision
            self.model = LlamaModel(cfg)
            self.model.load_state_dict(init)
            self.losses: list[float] = []

        def training_step(self, mb, batch_idx):
            return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return optimizer(self.parameters(), self.precision_name)

    def fit(precision: str) -> LM:
        module = LM(precision)
        with tempfile.TemporaryDirectory() as tmp:
            os.environ.pop("MASTER_PORT", None)
            trainer = pl.Trainer(
                accelerator="gpu" if device.type == "cuda" else "cpu",
                devices=1,
                strategy=ByteScaleStrategy(planner="balance", capacity=sizes.capacity),
                precision=precision,
                max_steps=sizes.steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                use_distributed_sampler=False,
                num_sanity_val_steps=0,
                default_root_dir=tmp,
            )
            trainer.fit(module, datamodule=Data())
        return module

    out: dict = {}
    start = time.perf_counter()
    mixed = fit("bf16-mixed")
    losses = mixed.losses
    k = max(1, len(losses) // 4)
    out["bf16_mixed"] = {
        "steps": len(losses),
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "first_quarter_mean": sum(losses[:k]) / k,
        "last_quarter_mean": sum(losses[-k:]) / k,
        "seconds": time.perf_counter() - start,
    }
    out["bf16_mixed"]["falls"] = (
        out["bf16_mixed"]["last_quarter_mean"] < out["bf16_mixed"]["first_quarter_mean"]
    )

    start = time.perf_counter()
    exact = fit("64-true")
    reference = _reference_fit(cfg, init, sizes, device, lambda params: optimizer(params, "64-true"))
    got = {n: p.detach() for n, p in exact.model.named_parameters()}
    errs = {n: _max_err(got[n], p) for n, p in reference.named_parameters()}
    worst = max(errs, key=errs.get)
    out["float64"] = {
        "steps": len(exact.losses),
        "max_param_diff": errs[worst],
        "worst_param": worst,
        "max_param_change": max(_max_err(got[n], init[n].to(got[n])) for n in got),
        "param_device": str(next(iter(got.values())).device),
        "seconds": time.perf_counter() - start,
    }
    out["ok"] = bool(
        out["bf16_mixed"]["finite"]
        and out["bf16_mixed"]["falls"]
        and out["bf16_mixed"]["steps"] == sizes.steps
        and out["float64"]["max_param_diff"] <= 1e-10
        and out["float64"]["max_param_change"] > 1e-4  # the run really trained
        and out["float64"]["steps"] == sizes.steps
    )
    out["finite_flags"] = _finite_flags(device)
    out["ok"] = out["ok"] and out["finite_flags"]["ok"]
    return out


def _finite_flags(device: torch.device) -> dict:
    """The gradient finiteness flag (max-abs norm on a GPU): exact on NaN, inf, huge and tiny values.

    On CUDA it is also run with synchronising calls turned into errors: the flag must stay on
    the device until the step's one host sync.
    """
    from lightning_bytescale.engine.finite import all_finite

    cases = {
        "finite": ([1.0, -2.0, 3e38, -3e38], True),  # an L2 norm of these overflows; the flag must not
        "nan": ([1.0, float("nan"), 2.0], False),
        "inf": ([1.0, float("inf")], False),
        "-inf": ([-float("inf"), 0.0], False),
    }
    got: dict[str, bool] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for name, (values, _) in cases.items():
            big = torch.zeros(1 << 16, dtype=dtype)  # several reduction blocks
            big[-len(values) :] = torch.tensor(values, dtype=dtype)
            x = big.to(device)
            _sync(device)
            previous = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                flag = all_finite([x])
            finally:
                if previous is not None:
                    torch.cuda.set_sync_debug_mode(previous)
            got[f"{name}/{dtype}".replace("torch.", "")] = bool(flag)
    ok = all(got[k] == cases[k.split("/")[0]][1] for k in got)
    return {"ok": ok, "flags": got}


def _reference_fit(cfg, init, sizes: Sizes, device: torch.device, make_optimizer):
    """Single process, float64, whole sequences, plain causal SDPA (no plan, no strategy)."""
    from lightning_bytescale.models import LlamaModel

    def causal_sdpa(q, k, v):
        g = q.shape[1] // k.shape[1]
        qh, kh, vh = (
            q.transpose(0, 1),
            k.repeat_interleave(g, 1).transpose(0, 1),
            v.repeat_interleave(g, 1).transpose(0, 1),
        )
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)

    model = LlamaModel(cfg, attention_fn=causal_sdpa)
    model.load_state_dict(init)
    model = model.double().to(device)
    opt = make_optimizer(model.parameters())
    for k in range(sizes.steps):
        seqs = [s.to(device) for s in _sequences(k, cfg.vocab, sizes.capacity)]
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        for s in seqs:
            logits = model(s, torch.arange(len(s), device=device))
            (F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n).backward()
        opt.step()
    return model


# ----------------------------------------------------------------------------- ring
def _ring_errors(device: torch.device, sizes: Sizes, n: int, dtype_name: str) -> dict:
    from lightning_bytescale.packed_attention import loopback_ring_attention, select_kernel
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard, zigzag_unshard

    dtype = DTYPES[dtype_name]
    heads, kv_heads, dim = sizes.error_heads
    lens = sizes.error_lens
    g = torch.Generator().manual_seed(n)
    q, k, v, dout = (
        torch.randn(sum(lens), h, dim, generator=g, dtype=torch.float64).to(device)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    low = [x.to(dtype) for x in (q, k, v, dout)]
    # the reference sees the same rounded inputs, in float64
    ref_in = [x.detach().double().clone().requires_grad_() for x in low[:3]]
    ref_out = dense_attention(*ref_in, lens)
    ref_grads = torch.autograd.grad(ref_out, ref_in, low[3].double())
    layouts = ring_layouts(lens, n)
    parts = [[p.requires_grad_() for p in zigzag_shard(x, layouts)] for x in low[:3]]
    outs = loopback_ring_attention(*parts, layouts)
    torch.autograd.backward(outs, zigzag_shard(low[3], layouts))
    got = [zigzag_unshard(outs, layouts)] + [zigzag_unshard([p.grad for p in ps], layouts) for ps in parts]
    pairs = list(zip(("out", "dq", "dk", "dv"), got, (ref_out, *ref_grads)))
    errs = {name: _max_err(a, b) for name, a, b in pairs}
    rel = {name: _rel_err(a, b) for name, a, b in pairs}
    judged = errs if dtype == torch.float64 else rel
    return {
        "ring": n,
        "dtype": dtype_name,
        "kernel": select_kernel(device, dtype, dim),
        "seq_lens": list(lens),
        "max_err": errs,
        "rel_err": rel,
        "tolerance": TOLERANCE[dtype_name],
        "judged_on": "max_err" if dtype == torch.float64 else "rel_err",
        "ok": max(judged.values()) <= TOLERANCE[dtype_name],
    }


def _ring_speed(
    device: torch.device, sizes: Sizes, n: int, dtype: torch.dtype, impl: str | None = None
) -> dict:
    from lightning_bytescale.packed_attention import attention, loopback_ring_attention, select_kernel
    from lightning_bytescale.packed_attention.local import local_kernel
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard

    heads, kv_heads, dim = sizes.speed_heads
    total = n * sizes.tokens_per_member
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(total, h, dim, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads, heads)
    )
    layouts = ring_layouts([total], n)
    parts = [zigzag_shard(x, layouts) for x in (q, k, v)]
    douts = zigzag_shard(dout, layouts)

    def local() -> None:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        attention(qq, kk, vv).backward(dout)

    def ring() -> None:
        ps = [[p.detach().requires_grad_() for p in xs] for xs in parts]
        torch.autograd.backward(loopback_ring_attention(*ps, layouts, impl=impl), douts)

    t_local = _timed(local, device, sizes.iters)
    t_ring = _timed(ring, device, sizes.iters)
    flops = 2 * 2 * total * total * heads * dim / 2 * 3.5  # causal: half the scores; fwd 1 + bwd 2.5
    return {
        "ring": n,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens_per_member": sizes.tokens_per_member,
        "heads": [heads, kv_heads, dim],
        "ring_kernel": impl or select_kernel(device, dtype, dim),
        "local_kernel": local_kernel(q),
        "local_s": t_local,
        "ring_s": t_ring,
        "fraction_of_local": t_local / t_ring,
        "ring_tflops": flops / t_ring / 1e12,
        "local_tflops": flops / t_local / 1e12,
    }


def _host_sync_free(device: torch.device, sizes: Sizes) -> dict:
    """Run a loopback ring (after a warm-up) with synchronising CUDA calls turned into errors."""
    from lightning_bytescale.packed_attention import loopback_ring_attention
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard

    heads, kv_heads, dim = sizes.error_heads
    layouts = ring_layouts([2048, 77], 4)
    g = torch.Generator().manual_seed(1)
    full = [
        torch.randn(2125, h, dim, generator=g).to(device, torch.bfloat16) for h in (heads, kv_heads, kv_heads)
    ]
    parts = [zigzag_shard(x, layouts) for x in full]

    def run() -> None:
        ps = [[p.detach().requires_grad_() for p in xs] for xs in parts]
        outs = loopback_ring_attention(*ps, layouts)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    run()
    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
        result = {"ok": True}
    except RuntimeError as err:
        result = {"ok": False, "error": str(err)[:500]}
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    return result


def ring_section(device: torch.device, sizes: Sizes) -> dict:
    errors = [_ring_errors(device, sizes, n, name) for n in RING_SIZES for name in DTYPES]
    speed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    speed = [_ring_speed(device, sizes, n, speed_dtype) for n in RING_SIZES]
    out: dict = {"errors": errors, "throughput": speed, "goal_fraction_of_local": 0.85}
    if device.type == "cuda":
        out["host_sync_free"] = _host_sync_free(device, sizes)
    else:
        out["host_sync_free"] = {"skipped": "needs CUDA (dry run)"}
    out["ok"] = all(e["ok"] for e in errors) and out["host_sync_free"].get("ok", True)
    out["meets_goal"] = all(s["fraction_of_local"] >= 0.85 for s in speed)
    return out


# ----------------------------------------------------------------------------- offload
def _offload_identity_cpu(sizes: Sizes) -> dict:
    """Dry run: the offloader's hooks on CPU leave gradients bit-identical at r = 0.25 / 0.5 / 1.0."""
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.offload.offloader import ActivationOffloader
    from lightning_bytescale.packed_attention import attention_context
    from lightning_bytescale.packed_attention.layout import AttentionLayout

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.preset(sizes.preset, layers=4))
    ids = torch.randint(0, model.config.vocab, (48,))
    layout = AttentionLayout(torch.tensor([0, 30, 48]), (30, 18))
    offloader = ActivationOffloader(model.blocks, keep_last=0, min_bytes=0)

    def grads(ctx) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with ctx, attention_context(layout):
            F.cross_entropy(model(ids, layout.positions())[:-1], ids[1:]).backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = grads(contextlib.nullcontext())
    equal = {
        str(r): all(torch.equal(a, b) for a, b in zip(ref, grads(offloader.context(0, r))))
        for r in (0.25, 0.5, 1.0)
    }
    return {"bit_identical": equal, "offloaded_bytes": offloader.stats.offloaded_bytes}


def offload_section(device: torch.device, sizes: Sizes) -> dict:
    if device.type != "cuda":
        out = {"cpu_hooks": _offload_identity_cpu(sizes)}
        out["cuda"] = {"skipped": "needs CUDA (dry run)"}
        out["ok"] = all(out["cpu_hooks"]["bit_identical"].values())
        return out
    import gpu_offload_overlap as overlap  # benchmarks/gpu_offload_overlap.py

    out = {"correctness": overlap.correctness()}  # r = 0.5 / 1.0 and 1.0 / 0.25 on two micro-batches
    out["raw_overlap"] = overlap.raw_overlap()
    out["model"] = overlap.model_sweep("1b", 4, list(sizes.offload_lengths), [0.0, 0.25, 0.5, 1.0])
    c = out["correctness"]
    out["ok"] = bool(c["bit_identical"] or not c["baseline_deterministic"])
    return out


# ----------------------------------------------------------------------------- flash-attn
def _kernel_block(
    device: torch.device, dtype: torch.dtype, names: list[str], tokens: int, heads
) -> list[dict]:
    """Accuracy (vs ``math`` in float64) and forward+backward time of one causal varlen block per kernel."""
    from lightning_bytescale.packed_attention import kernels
    from lightning_bytescale.packed_attention.segments import Segments

    h, hkv, d = heads
    lens = [tokens // 2, tokens // 4, tokens - tokens // 2 - tokens // 4]
    seg = {"q_seg": Segments.of(lens), "k_seg": Segments.of(lens)}
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(tokens, x, d, generator=g).to(device, dtype) for x in (h, hkv, hkv, h))
    # accuracy on the two shorter sequences (math builds [H, T, T])
    seg_small = {"q_seg": Segments.of(lens[1:]), "k_seg": Segments.of(lens[1:])}
    ref, _ = kernels.block_forward(
        *(x[lens[0] :].double() for x in (q, k, v)), causal=True, scale=d**-0.5, impl="math", **seg_small
    )
    rows = []
    for name in names:
        out, lse = kernels.block_forward(q, k, v, causal=True, scale=d**-0.5, impl=name, **seg)

        def step(name=name, out=out, lse=lse) -> None:
            kernels.block_forward(q, k, v, causal=True, scale=d**-0.5, impl=name, **seg)
            kernels.block_backward(dout, q, k, v, out, lse, causal=True, scale=d**-0.5, impl=name, **seg)

        rows.append(
            {
                "kernel": name,
                "max_err_vs_math": _max_err(out[lens[0] :], ref),
                "rel_err_vs_math": _rel_err(out[lens[0] :], ref),
                "fwd_bwd_s": _timed(step, device, 3),
            }
        )
    return rows


def flash_attn_section(device: torch.device, sizes: Sizes) -> dict:
    from lightning_bytescale.packed_attention.cuda_kernels import flash_attn_status

    status = flash_attn_status()
    installed = not isinstance(status, str)
    if device.type != "cuda":
        # the comparison code on the CPU kernels, so a dry run exercises it
        rows = _kernel_block(device, torch.float32, ["cpu", "math"], 96, (4, 2, 16))
        return {
            "skipped": "flash-attn not installed" if not installed else "needs CUDA (dry run)",
            "dry_run_kernels": rows,
        }
    if not installed:
        return {"skipped": "flash-attn not installed", "reason": status}
    import flash_attn

    names = ["flash_attn", "flash", "efficient"]
    out = {
        "version": getattr(flash_attn, "__version__", "?"),
        "block": _kernel_block(device, torch.bfloat16, names, 8192, sizes.speed_heads),
        "ring": [
            _ring_speed(device, sizes, 4, torch.bfloat16, impl=name) for name in ("flash_attn", "flash")
        ],
    }
    out["ok"] = all(r["rel_err_vs_math"] <= TOLERANCE["bfloat16"] for r in out["block"])
    return out


# ----------------------------------------------------------------------------- main
SECTIONS: dict[str, Callable[[torch.device, Sizes], dict]] = {
    "trainer": trainer_section,
    "ring": ring_section,
    "offload": offload_section,
    "flash_attn": flash_attn_section,
}


def run(dry_run: bool, out: Path, only: list[str] | None = None, budget_s: float = 420.0) -> dict:
    """Run the sections in order; the JSON is rewritten after each one, so a killed run keeps the finished ones."""
    device = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
    sizes = DRY if dry_run else GPU
    report: dict = {
        "dry_run": dry_run,
        "device": "cpu" if dry_run else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sizes": sizes.__dict__,
        "budget_s": budget_s,
    }
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, section in SECTIONS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        if t0 - start > budget_s:
            report[name] = {"skipped": f"time budget of {budget_s:.0f} s spent before this section"}
        else:
            try:
                report[name] = section(device, sizes)
            except Exception as err:  # recorded; the other sections still run
                report[name] = {
                    "ok": False,
                    "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc(),
                }
        report[name]["seconds"] = time.perf_counter() - t0
        report["wall_s"] = time.perf_counter() - start
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(
            f"[gpu_check] {name}: ok={report[name].get('ok')} in {report[name]['seconds']:.1f} s", flush=True
        )
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: every section but CUDA")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip sections that would start after this")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)
    report = run(args.dry_run, args.out, [s for s in args.only.split(",") if s] or None, args.budget_s)
    print(f"[gpu_check] wrote {args.out} in {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
