"""GPU check of what CPU tests cannot see: kernels, host syncs, rings, the Trainer, every layout the machine holds, offload.

Run from the repository root, on a machine with torch, Lightning and numpy (and the pure-Python
wheels of docs/install.md): the package is imported from this repository, not from what is
installed.

    python benchmarks/gpu_check.py                            # writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json   # CPU, tiny sizes (CI)

Sections, each made of subsections; a subsection that fails records its error and traceback
next to what it had measured before it, and the others still run; the JSON is rewritten after
every subsection, so a run cut short keeps what it finished:

* ``kernels``: the torch features detected (``torch_features.report()``), the ring block kernel
  ``select_kernel`` picks and the local kernel ``local_kernel`` picks for each dtype;
* ``ring``: loopback rings (all members on this GPU, the P2P code path with in-memory transfers
  on the communication stream) of 2, 4, 8 in bfloat16 / float32 / float64 against a dense
  float64 reference; ring-flash-attention's reference varlen case (5 heads, head size 128,
  ``cu_seqlens = [0, 128, 1248, 4240]``, bfloat16) against float64 and against local attention
  on the same inputs, with the tolerances in :data:`REFERENCE_TOLERANCE`; throughput as a
  fraction of local attention on the same tokens (one causal sequence, N x 8K tokens, forward
  and backward; goal 0.85);
* ``host_syncs``: host-device synchronisations counted (``torch.cuda.set_sync_debug_mode("warn")``)
  in local attention and in the ring loop, forward and backward (goal and check: 0), and in one
  whole micro-batch of our Llama under bf16 autocast after the strategy's ``batch_to_device``
  (recorded with where they come from: torch's own kernels may synchronise);
* ``trainer``: ``Trainer(strategy="bytescale", accelerator="gpu", devices=1)`` fits 20 steps
  in ``bf16-mixed`` (loss finite and falling) and in ``64-true``, where parameters must match
  an independent single-process float64 loop to 1e-10; the gradient finiteness flag on NaN,
  inf and huge values with no host synchronisation; and a larger Llama in ``bf16-mixed`` with
  its MFU (``TelemetryCallback``: model FLOPs over step time and the device's peak);
* ``mesh`` (one GPU, the torch floor): this process as a 1-rank NCCL group, ``ParallelDims(1)``'s
  mesh: the group refuses a host tensor (so a host tensor on the paths below fails here as on
  eight GPUs); FSDP2 through ``run_parallel_step(..., fsdp=FSDPStepDriver(...))`` and a one-stage
  pipeline through ``run_pipeline_step``, float64 against the single-process loop (1e-10), the
  pipeline also in bf16 autocast (head logits bfloat16, one stage built, flat peak memory); a
  sharded and a consolidated checkpoint and ZeRO-1's consolidated optimizer state, saved and
  loaded bit for bit, the peak device memory of each save and load (:func:`mesh_section`);
* ``ranks`` (2+ GPUs): one start of 2 ranks (4 with four GPUs or more) running the Trainer jobs of
  the next two sections (``benchmarks/_layouts_check.py``), each job with its own NCCL group;
* ``tensor_parallel``: ``ByteScaleStrategy(tensor_parallel_size=2)`` when two or more GPUs are
  visible (``(1, 2)``, or ``(2, 2)`` with four), NCCL, the reference Llama with ``parallelize_llama``
  (``benchmarks/_tp_check.py``): ``bf16-mixed`` (it ran, the lanes log the same finite losses, the
  step time) and ``64-true`` against the single-process float64 loop to 1e-10; with fewer GPUs a
  skip with the reason; the dry run trains the same code on 2 gloo CPU ranks;
* ``layouts`` (2+ GPUs): ``pipeline_parallel_size=2`` in ``bf16-mixed`` for 20 steps (the head's
  logits bfloat16, ``max_memory_allocated`` flat from step 3, the measured bubble), FSDP2 on
  ``(1, 2)`` in float64 against the loop, TP checkpoints with ``zero=1`` (consolidated and
  sharded, resumed bit for bit, save and load peaks), the all-reduces per block (2 in backward,
  ``CommDebugMode``), and ``bytescale-profile --tensor-parallel 2`` started plainly, not under
  torchrun (:func:`layouts_section`);
* ``ulysses``: Ulysses items of 2, 4 or 8 members on as many GPUs (NCCL P2P; a hybrid item too
  with four or more) in bfloat16 against float64 and against local attention on the same inputs,
  with the tolerances of :data:`ULYSSES_VS_LOCAL`; the time of a Ulysses item and of a ring of the
  same size on one causal sequence against local flash attention on one GPU; with fewer GPUs a
  skip with the reason; the dry run runs it on 2 gloo CPU ranks;
* ``offload``: activation offload on CUDA through ``benchmarks/gpu_offload_overlap.py``:
  gradients bit-identical to no offload, raw copy/compute overlap, step time and peak memory
  against the ratio;
* ``flash_attn``: flash-attn's kernels against PyTorch's, or ``skipped`` when not installed.

Exit status: 0 when every section passed, 1 when one did not (an error, a check not met, or a
subsection the time budget cut), 2 when the package cannot be imported or CUDA is missing.
``--dry-run`` runs every section's code on the CPU with tiny sizes (``accelerator="cpu"``, the
``cpu`` block kernel); what only CUDA can measure is recorded as skipped.  The device rule is the
only thing swapped: the same functions run with gloo for NCCL and the host for the GPU, the 2+
GPU sections on 2 spawned gloo ranks, the profiler on ``--device cpu``; a 1-rank group of torch's
fake backend registered for ``cuda`` only stands in for NCCL's refusal of host tensors.

Time budget (:data:`SECTION_BUDGET_S`, estimates, not measurements): 335 s of sections on one GPU
(under 7 minutes with the start-up); on 2+ GPUs the ``ranks``, ``tensor_parallel``, ``layouts``
and ``ulysses`` sections add 350 s, 685 s in all, plus the start-up and the ranks' own start
(at most :data:`RANKS_START_S`): under 14 minutes.  ``--budget-s`` overrides the sum.

Never run on a GPU: no GPU was available where this script was written.  Its GPU paths (NCCL
groups, ``cuda:<rank>`` devices, the peak-memory readings, the host-sync counts, the spawned CUDA
profiler workers, flash-attn, offload on CUDA streams) and the time budgets have run only as the
dry run's CPU/gloo stand-ins (``tests/packed_attention/test_attention_gpu_check.py``) and, for
the package's collectives, under the fake-NCCL test tier (``tests/fake_nccl``).  The first GPU
run is the first real test of this script: read its JSON, not only its exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package of this repository, whatever else is installed
sys.path.insert(1, str(ROOT / "benchmarks"))  # gpu_offload_overlap

RESULTS = ROOT / "benchmarks" / "results" / "gpu_check.json"


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
    reference_cu: tuple[int, ...]  # ring-flash-attention's varlen case
    reference_heads: tuple[int, int]  # heads (key/value heads too), head size
    mfu_preset: str
    mfu_layers: int
    mfu_capacity: int
    mfu_steps: int


GPU = Sizes(
    20, 1024, "small", (1531, 403, 64), (8, 2, 64), 8192, (32, 8, 128), 5, (4096, 16384),
    (0, 128, 1248, 4240), (5, 128), "1b", 8, 8192, 12,
)  # fmt: skip
DRY = Sizes(
    4, 64, "tiny", (45, 13), (4, 2, 16), 64, (4, 2, 16), 1, (),
    (0, 8, 78, 265), (5, 32), "tiny", 2, 64, 3,
)  # fmt: skip
RING_SIZES = (2, 4, 8)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# float64: absolute error; bfloat16 / float32: error relative to the reference's largest magnitude
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-3, "float64": 1e-10}
# The reference varlen case in bfloat16, errors relative to the float64 reference's largest
# magnitude.  A bf16 block output is rounded once per ring step (2**-8 relative) and merged in
# float32, so the ring may sit a few roundings from float64, no more: out 2e-2, gradients 4e-2.
# Against local attention on the same bf16 inputs (the one-device baseline the ring replaces),
# the ring's own error may exceed local attention's by at most LOCAL_MARGIN x, plus 2e-3.
# (ring-flash-attention's test prints these differences without thresholds.)
REFERENCE_TOLERANCE = {"out": 2e-2, "dq": 4e-2, "dk": 4e-2, "dv": 4e-2}
LOCAL_MARGIN = 2.0
GOAL_FRACTION_OF_LOCAL = 0.85
# Each section's share of the run's time on one H200 at the GPU sizes, in seconds.  The run's budget
# (--budget-s) is their sum over the sections this machine runs: on one GPU the 2+ GPU sections
# record a skip at once, so the budget is the one-GPU sum, 335 s, which with the start-up (Python,
# torch, Lightning, CUDA: well under a minute) keeps one GPU under 7 minutes; with two or more GPUs
# the 2+ GPU sections add 350 s (685 s in all).  No subsection starts
# after the run's budget (it is cut, and fails); a section past its own share is marked
# ``over_budget`` in the JSON and printed; the 2+ GPU jobs not started within their sections'
# shares are cut (and fail).  None of these has been measured on a GPU yet: the JSON records each
# section's seconds next to its share.
SECTION_BUDGET_S = {
    # one GPU
    "kernels": 15,
    "ring": 60,
    "host_syncs": 20,
    "trainer": 90,
    "mesh": 60,
    "offload": 60,
    "flash_attn": 30,
    # two or more GPUs
    "ranks": 180,  # the Trainer jobs of the next two (benchmarks/_layouts_check.py), one start of the ranks
    "tensor_parallel": 20,
    "layouts": 60,  # with bytescale-profile --tensor-parallel 2
    "ulysses": 90,
}
MULTI_GPU_SECTIONS = ("ranks", "tensor_parallel", "layouts", "ulysses")


# ----------------------------------------------------------------------------- the report
class Report:
    """The JSON report: sections of subsections, rewritten after every subsection."""

    def __init__(self, out: Path, header: dict, budget_s: float, selected: list[str] | None = None) -> None:
        self.out, self.data, self.budget_s = out, dict(header), budget_s
        self.selected = selected  # the sections this run was asked for (None: all)
        self.cache: dict = {}  # what several sections share (the 2+ GPU ranks' run)
        self.start = time.perf_counter()
        out.parent.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def save(self) -> None:
        self.data["wall_s"] = self.elapsed()
        self.out.write_text(json.dumps(self.data, indent=1, default=str) + "\n")

    def section(self, name: str) -> Section:
        return Section(self, name)

    def failed(self) -> list[str]:
        """Sections that did not pass."""
        return [name for name, sec in self.data.items() if isinstance(sec, dict) and sec.get("ok") is False]


class Section:
    """One section: its subsections run in order, each catching its own exception."""

    def __init__(self, report: Report, name: str) -> None:
        self.report, self.name = report, name
        self.data: dict = report.data.setdefault(name, {})
        self.t0 = time.perf_counter()

    def run(self, name: str, fn: Callable[[Sub], None]) -> dict:
        sub = Sub(self.report, self.data.setdefault(name, {}))
        t0 = time.perf_counter()
        if self.report.over_budget():
            sub.out.update(
                ok=False,
                skipped=f"the time budget of {self.report.budget_s:.0f} s was spent before it started",
            )
        else:
            try:
                fn(sub)
            except Exception as err:  # recorded next to what was measured; the next subsection runs
                sub.out.update(
                    ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()
                )
        sub.out["seconds"] = time.perf_counter() - t0
        self.close()
        status = sub.out.get("ok", "recorded")
        print(f"[gpu_check] {self.name}.{name}: ok={status} in {sub.out['seconds']:.1f} s", flush=True)
        return sub.out

    def close(self) -> None:
        subs = [v for v in self.data.values() if isinstance(v, dict)]
        self.data["ok"] = all(s.get("ok", True) is not False for s in subs)
        self.data["seconds"] = time.perf_counter() - self.t0
        budget = None if self.report.data.get("dry_run") else SECTION_BUDGET_S.get(self.name)
        if (
            budget is not None
        ):  # the section's share of the run's budget (GPU seconds): recorded, an overrun named
            self.data["budget_s"] = budget
            self.data["over_budget"] = self.data["seconds"] > budget
        self.report.save()


class Sub:
    """What one subsection writes into: ``out``, with ``append`` saving the report after each row."""

    def __init__(self, report: Report, out: dict) -> None:
        self.report, self.out = report, out

    def append(self, key: str, row: dict) -> None:
        self.out.setdefault(key, []).append(row)
        self.report.save()


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


def _random(shapes, device: torch.device, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Normal tensors of ``shapes`` in ``dtype``, drawn on ``device`` (float64 draws for float64)."""
    g = torch.Generator(device).manual_seed(seed)
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    return [torch.randn(*s, generator=g, dtype=draw, device=device).to(dtype) for s in shapes]


def count_host_syncs(fn: Callable[[], None], device: torch.device) -> dict:
    """Host-device synchronisations in ``fn`` (after one warm-up run), from CUDA's sync debug mode.

    On CPU ``fn`` runs (its code is exercised) and nothing is counted.
    """
    fn()
    if device.type != "cuda":
        return {"skipped": "counted on CUDA only (dry run)"}
    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    return {"count": len(syncs), "where": where[:20]}


# ----------------------------------------------------------------------------- kernels
def kernels_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    section = report.section("kernels")

    def detected(sub: Sub) -> None:
        from lightning_bytescale.packed_attention import torch_features
        from lightning_bytescale.packed_attention.cuda_kernels import flash_attn_status

        sub.out.update(torch_features.report())
        status = flash_attn_status()
        sub.out["flash_attn"] = status if isinstance(status, str) else "installed"
        if device.type == "cuda":
            sub.out["capability"] = list(torch.cuda.get_device_capability(device))

    def chosen(sub: Sub) -> None:
        from lightning_bytescale.packed_attention import select_kernel
        from lightning_bytescale.packed_attention.local import local_kernel

        dim = sizes.reference_heads[1]
        for name, dtype in {"float16": torch.float16, **DTYPES}.items():
            q = torch.empty(8, 2, dim, device=device, dtype=dtype)
            sub.append(
                "choices",
                {"dtype": name, "ring": select_kernel(device, dtype, dim), "local": local_kernel(q)},
            )
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
            by = {c["dtype"]: c for c in sub.out["choices"]}
            sub.out["ok"] = (
                by["bfloat16"]["ring"] in ("flash_attn", "flash")
                and by["bfloat16"]["local"] in ("flash_attn", "varlen")
                and by["float32"]["ring"] == "efficient"
            )

    section.run("detected", detected)
    section.run("chosen", chosen)


# ----------------------------------------------------------------------------- ring
def _ring_errors(device: torch.device, sizes: Sizes, n: int, dtype_name: str) -> dict:
    from lightning_bytescale.packed_attention import loopback_ring_attention, select_kernel
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard, zigzag_unshard

    dtype = DTYPES[dtype_name]
    heads, kv_heads, dim = sizes.error_heads
    lens = sizes.error_lens
    t = sum(lens)
    low = _random(
        [(t, heads, dim), (t, kv_heads, dim), (t, kv_heads, dim), (t, heads, dim)], device, dtype, n
    )
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


def _reference_case(device: torch.device, sizes: Sizes, rings: tuple[int, ...], sub: Sub) -> None:
    """ring-flash-attention's varlen case: float64 and local attention on the same bf16 inputs as references."""
    from lightning_bytescale.packed_attention import (
        AttentionLayout,
        attention,
        attention_context,
        loopback_ring_attention,
        select_kernel,
    )
    from lightning_bytescale.packed_attention.local import local_kernel
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard, zigzag_unshard

    cu = sizes.reference_cu
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    heads, dim = sizes.reference_heads
    t = cu[-1]
    q, k, v, dout = _random([(t, heads, dim)] * 4, device, torch.bfloat16, 4240)
    names = ("out", "dq", "dk", "dv")

    def grads_of(run, dtype: torch.dtype) -> list[torch.Tensor]:
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = run(*leaves)
        out.backward(dout.to(dtype))
        return [out.detach(), *(x.grad for x in leaves)]

    # the same bf16 inputs, in float64 (gradients in float64 too) and through local attention
    ref = grads_of(lambda *x: dense_attention(*x, lens), torch.float64)

    def local_run(*x):
        with attention_context(AttentionLayout(cu, tuple(lens))):
            return attention(*x)

    local = grads_of(local_run, torch.bfloat16)
    local_err = {n: _rel_err(a, b) for n, a, b in zip(names, local, ref)}
    sub.out.update(
        cu_seqlens=list(cu),
        heads=heads,
        head_dim=dim,
        dtype="bfloat16",
        tolerance=REFERENCE_TOLERANCE,
        local_margin=LOCAL_MARGIN,
        local={"kernel": local_kernel(q), "rel_err_vs_float64": local_err},
    )
    for n in rings:
        layouts = ring_layouts(lens, n)
        parts = [[p.requires_grad_() for p in zigzag_shard(x, layouts)] for x in (q, k, v)]
        outs = loopback_ring_attention(*parts, layouts)
        torch.autograd.backward(outs, zigzag_shard(dout, layouts))
        got = [zigzag_unshard(outs, layouts).detach()] + [
            zigzag_unshard([p.grad for p in ps], layouts) for ps in parts
        ]
        err = {name: _rel_err(a, b) for name, a, b in zip(names, got, ref)}
        vs_local = {name: _rel_err(a, b) for name, a, b in zip(names, got, local)}
        ok = all(
            err[name] <= REFERENCE_TOLERANCE[name] and err[name] <= LOCAL_MARGIN * local_err[name] + 2e-3
            for name in names
        )
        row = {
            "ring": n,
            "kernel": select_kernel(device, torch.bfloat16, dim),
            "rel_err_vs_float64": err,
            "rel_diff_vs_local": vs_local,
            "ok": ok,
        }
        sub.append("rings", row)
    sub.out["ok"] = all(r["ok"] for r in sub.out["rings"])


def _ring_speed(
    device: torch.device, sizes: Sizes, n: int, dtype: torch.dtype, impl: str | None = None
) -> dict:
    from lightning_bytescale.packed_attention import attention, loopback_ring_attention, select_kernel
    from lightning_bytescale.packed_attention.local import local_kernel
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard

    heads, kv_heads, dim = sizes.speed_heads
    total = n * sizes.tokens_per_member
    q, k, v, dout = _random(
        [(total, heads, dim), (total, kv_heads, dim), (total, kv_heads, dim), (total, heads, dim)],
        device,
        dtype,
        0,
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


def ring_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    section = report.section("ring")

    def errors(sub: Sub) -> None:
        for n in RING_SIZES:
            for name in DTYPES:
                sub.append("cases", _ring_errors(device, sizes, n, name))
        sub.out["ok"] = all(c["ok"] for c in sub.out["cases"])

    def throughput(sub: Sub) -> None:
        speed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        sub.out["goal_fraction_of_local"] = GOAL_FRACTION_OF_LOCAL
        for n in RING_SIZES:
            if report.over_budget():
                sub.out.update(ok=False, cut=f"the time budget was spent before ring {n}")
                return
            sub.append("rings", _ring_speed(device, sizes, n, speed_dtype))
        sub.out["meets_goal"] = all(
            r["fraction_of_local"] >= GOAL_FRACTION_OF_LOCAL for r in sub.out["rings"]
        )

    section.run("errors", errors)
    section.run("reference_varlen", lambda sub: _reference_case(device, sizes, RING_SIZES, sub))
    section.run("throughput", throughput)


# ----------------------------------------------------------------------------- host syncs
def host_syncs_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    from lightning_bytescale.packed_attention import (
        AttentionLayout,
        attention,
        attention_context,
        loopback_ring_attention,
    )
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard

    section = report.section("host_syncs")
    heads, kv_heads, dim = sizes.error_heads
    half = torch.bfloat16
    lens = list(sizes.error_lens)

    def local_attention(sub: Sub) -> None:
        t = sum(lens)
        q, k, v = _random([(t, heads, dim), (t, kv_heads, dim), (t, kv_heads, dim)], device, half, 1)
        layout = AttentionLayout((0, *torch.tensor(lens).cumsum(0).tolist()), tuple(lens))

        def run() -> None:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            with attention_context(layout):
                out = attention(*leaves)
            out.backward(torch.ones_like(out))

        sub.out.update(count_host_syncs(run, device), goal=0)
        if "count" in sub.out:
            sub.out["ok"] = sub.out["count"] == 0

    def ring_loop(sub: Sub) -> None:
        layouts = ring_layouts(lens, 4)
        t = sum(lens)
        full = _random([(t, heads, dim), (t, kv_heads, dim), (t, kv_heads, dim)], device, half, 2)
        parts = [zigzag_shard(x, layouts) for x in full]

        def run() -> None:
            ps = [[p.detach().requires_grad_() for p in xs] for xs in parts]
            outs = loopback_ring_attention(*ps, layouts)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        sub.out.update(count_host_syncs(run, device), goal=0, ring=4)
        if "count" in sub.out:
            sub.out["ok"] = sub.out["count"] == 0

    def micro_batch(sub: Sub) -> None:
        from lightning_bytescale import ByteScaleStrategy
        from lightning_bytescale.engine.executor import run_micro_batch
        from lightning_bytescale.engine.micro_batch import build_step
        from lightning_bytescale.models import LlamaConfig, LlamaModel
        from lightning_bytescale.planner import make_plan

        cfg = LlamaConfig.preset(sizes.preset)
        torch.manual_seed(0)
        model = LlamaModel(cfg).to(device)
        seqs = _sequences(0, cfg.vocab, sizes.capacity)
        plan = make_plan([len(s) for s in seqs], world_size=1, capacity=sizes.capacity)
        step = ByteScaleStrategy().batch_to_device(build_step(plan, 0, lambda j: seqs[j]), device)
        mb = step.micro_batches[0]
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)

        def run() -> None:
            with autocast:
                run_micro_batch(model, mb)

        layout = mb.layout
        sub.out.update(
            count_host_syncs(run, device),
            sequences=len(layout.seq_lens),
            tokens=layout.num_slots,
            layout_on_host=isinstance(layout.cu_seqlens, tuple),
            note="forward and backward of one micro-batch; torch's own kernels (embedding backward) may synchronise",
        )
        sub.out["ok"] = sub.out["layout_on_host"]
        if "count" in sub.out:
            sub.out["meets_goal"] = sub.out["count"] == 0

    section.run("local_attention", local_attention)
    section.run("ring_loop", ring_loop)
    section.run("micro_batch", micro_batch)


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


def _fit(device: torch.device, cfg, init, *, steps: int, capacity: int, precision: str, callbacks=()):
    """``Trainer(strategy=ByteScaleStrategy)`` on one device; the LightningModule, with its losses."""
    import lightning.pytorch as pl
    from _common import QUIET_TRAINER  # benchmarks/_common.py
    from torch.utils.data import Dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_bytescale import ByteScaleStrategy, token_loss
    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.models import LlamaModel
    from lightning_bytescale.planner import make_plan

    class Steps(Dataset):
        def __len__(self) -> int:
            return steps

        def __getitem__(self, k: int):
            seqs = _sequences(k, cfg.vocab, capacity)
            plan = make_plan([len(s) for s in seqs], world_size=1, capacity=capacity)
            return build_step(plan, 0, lambda j: seqs[j], step=k)

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return StatefulDataLoader(Steps(), batch_size=None, shuffle=False, num_workers=0)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaModel(cfg)
            self.model.load_state_dict(init)
            self.losses: list[float] = []
            self.metrics: list[dict] = []

        def training_step(self, mb, batch_idx):
            return token_loss(self.model(mb.input_ids, mb.position_ids), mb.labels, mb.num_global_tokens)

        def train_flops(self, lengths) -> float:
            return float(sum(cfg.flops_per_token(s) * s for s in lengths))

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))
            for cb in callbacks:
                if getattr(cb, "last_metrics", None) is not None:
                    self.metrics.append(dict(cb.last_metrics))

        def configure_optimizers(self):
            # float64: SGD with momentum, linear in the gradient, so the exactness check compares
            # gradients, not AdamW's amplification of rounding in near-zero components
            if precision == "64-true":
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)

    module = LM()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.pop("MASTER_PORT", None)
        trainer = pl.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            strategy=ByteScaleStrategy(planner="balance", capacity=capacity),
            precision=precision,
            max_steps=steps,
            num_sanity_val_steps=0,
            default_root_dir=tmp,
            callbacks=list(callbacks),
            **QUIET_TRAINER,
        )
        trainer.fit(module, datamodule=Data())
    return module


def _reference_fit(cfg, init, sizes: Sizes, device: torch.device):
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
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for k in range(sizes.steps):
        seqs = [s.to(device) for s in _sequences(k, cfg.vocab, sizes.capacity)]
        n = sum(len(s) - 1 for s in seqs)
        opt.zero_grad()
        for s in seqs:
            logits = model(s, torch.arange(len(s), device=device))
            (F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n).backward()
        opt.step()
    return model


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


def trainer_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    section = report.section("trainer")
    cfg = LlamaConfig.preset(sizes.preset)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in LlamaModel(cfg).state_dict().items()}

    def bf16_mixed(sub: Sub) -> None:
        losses = _fit(
            device, cfg, init, steps=sizes.steps, capacity=sizes.capacity, precision="bf16-mixed"
        ).losses
        k = max(1, len(losses) // 4)
        sub.out.update(
            steps=len(losses),
            losses=losses,
            finite=all(math.isfinite(x) for x in losses),
            first_quarter_mean=sum(losses[:k]) / k,
            last_quarter_mean=sum(losses[-k:]) / k,
        )
        sub.out["falls"] = sub.out["last_quarter_mean"] < sub.out["first_quarter_mean"]
        sub.out["ok"] = bool(sub.out["finite"] and sub.out["falls"] and len(losses) == sizes.steps)

    def float64(sub: Sub) -> None:
        exact = _fit(device, cfg, init, steps=sizes.steps, capacity=sizes.capacity, precision="64-true")
        reference = _reference_fit(cfg, init, sizes, device)
        got = {n: p.detach() for n, p in exact.model.named_parameters()}
        errs = {n: _max_err(got[n], p) for n, p in reference.named_parameters()}
        worst = max(errs, key=errs.get)
        sub.out.update(
            steps=len(exact.losses),
            max_param_diff=errs[worst],
            worst_param=worst,
            max_param_change=max(_max_err(got[n], init[n].to(got[n])) for n in got),
            param_device=str(next(iter(got.values())).device),
            tolerance=1e-10,
        )
        sub.out["ok"] = bool(
            sub.out["max_param_diff"] <= 1e-10
            and sub.out["max_param_change"] > 1e-4  # the run really trained
            and sub.out["steps"] == sizes.steps
        )

    def mfu(sub: Sub) -> None:
        from lightning_bytescale.lightning.telemetry import TelemetryCallback, peak_tflops_for_device

        big = LlamaConfig.preset(sizes.mfu_preset, layers=sizes.mfu_layers)
        torch.manual_seed(1)
        big_init = LlamaModel(big).state_dict()
        telemetry = TelemetryCallback(charts_every_n_steps=0, prog_bar=False)
        module = _fit(
            device, big, big_init, steps=sizes.mfu_steps, capacity=sizes.mfu_capacity,
            precision="bf16-mixed", callbacks=(telemetry,),
        )  # fmt: skip
        warm = module.metrics[2:] or module.metrics  # the first steps pay start-up costs
        values = [m["perf/mfu"] for m in warm if "perf/mfu" in m]
        sub.out.update(
            preset=sizes.mfu_preset,
            layers=sizes.mfu_layers,
            params=big.num_params(),
            capacity=sizes.mfu_capacity,
            steps=len(module.losses),
            losses=module.losses,
            mfu_per_step=[m.get("perf/mfu") for m in module.metrics],
            tokens_per_s_per_step=[m.get("perf/tokens_per_s") for m in module.metrics],
            mfu_median=statistics.median(values) if values else None,
            tflops_per_device_median=statistics.median(m["perf/tflops_per_device"] for m in warm)
            if warm
            else None,
            peak_tflops=peak_tflops_for_device(device),
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        )
        sub.out["ok"] = bool(
            len(module.losses) == sizes.mfu_steps
            and all(math.isfinite(x) for x in module.losses)
            and sub.out["mfu_median"] is not None
            and sub.out["mfu_median"] > 0
        )

    section.run("bf16_mixed", bf16_mixed)
    section.run("float64", float64)
    section.run("finite_flags", lambda sub: sub.out.update(_finite_flags(device)))
    section.run("mfu", mfu)


# ----------------------------------------------------------------------------- mesh (one GPU)
# The layouts of the torch floor on one GPU, where the strategy builds no mesh (it builds one only
# with TP or PP > 1): this process is a world of one rank, and ParallelDims(1)'s mesh is built on
# it.  On CUDA the group is NCCL, which refuses a host tensor in any collective whatever the world
# size, so a host tensor on these paths fails here exactly as it would on eight GPUs; gloo, the
# dry run's backend, takes host tensors, so the dry run runs the same code but cannot see that.
HOST_TENSOR_ERROR = (
    "No backend type associated with device type cpu"  # c10d's words (NCCL, any cuda-only backend)
)
SAVE_PEAK_TENSORS = 3  # a save may hold this many of the largest tensor on the device at once


def _leave_world() -> None:
    """Destroy this process's default process group, if any (the Trainer's group of one stays after a fit)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _one_rank_world(device: torch.device) -> None:
    """This process as a whole world of one rank: NCCL on CUDA, gloo in the dry run."""
    from datetime import timedelta

    import torch.distributed as dist

    _leave_world()
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
        timeout=timedelta(seconds=120), **({"device_id": device} if cuda else {}),
    )  # fmt: skip


def _host_tensor_refused(group=None) -> dict:
    """All-reduce a host tensor on ``group``: refused with c10d's :data:`HOST_TENSOR_ERROR` on a cuda-only group."""
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.zeros(2), group=group)
    except RuntimeError as err:
        text = str(err).splitlines()[0][:200]
        return {"host_tensor_refused": HOST_TENSOR_ERROR in text, "error": text}
    return {"host_tensor_refused": False}


def _cuda_only_canary() -> dict:
    """Dry run: :func:`_host_tensor_refused` on a 1-rank group of torch's fake backend registered for ``cuda`` only.

    What the GPU run shows on its NCCL group, on a CPU (the dry run's checks then run on gloo).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

    name = "gpu_check_cuda_only"
    if name not in dist.Backend.backend_list:
        dist.Backend.register_backend(name, _create_fake_pg, extended_api=True, devices=["cuda"])
    _leave_world()
    dist.init_process_group(name, store=FakeStore(), rank=0, world_size=1)
    try:
        return {"backend": name, **_host_tensor_refused()}
    finally:
        dist.destroy_process_group()


def mesh_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    """One GPU, the torch floor, a 1-rank NCCL group: FSDP2, a pipeline, ZeRO-1 and checkpoints on ``ParallelDims(1)``'s mesh.

    * ``host_tensor_refused``: the group refuses a host tensor (``dist.all_reduce(torch.zeros(2))``
      raises c10d's :data:`HOST_TENSOR_ERROR`), so the subsections below fail where the package
      sends one; the dry run shows it on a 1-rank group registered for ``cuda`` only;
    * ``fsdp2``: ``fully_shard`` on every block and the root over ``pmesh.dp_mesh``,
      ``FSDPStepDriver`` and ``run_parallel_step(..., fsdp=...)`` for ``steps`` steps in float64
      (SGD with momentum) against the single-process float64 loop of ``trainer`` (1e-10);
    * ``pipeline``: the model as one pipeline stage (``LlamaStage``; the pipeline group is the
      world of one) through ``run_pipeline_step`` with ``StageSchedules``: float64 against the
      same loop (1e-10), then ``steps`` steps under bf16 autocast with AdamW on batches of one
      shape: the head's logits in bfloat16, finite losses, one stage built for every step, the
      stage bubble, and on CUDA each step's peak ``max_memory_allocated`` flat from step
      ``FLAT_FROM_STEP`` on (``_layouts_check.flat_peaks``);
    * ``checkpoint_sharded`` / ``checkpoint_consolidated``: a float32 FSDP2 model with AdamW state
      after two steps, saved as a sharded folder (``save_sharded``, the strategy's format) and as
      one consolidated file (the strategy's ``model_state`` / ``optimizer_state``: whole tensors
      on rank 0's host), each loaded back into the model and optimizer after zeroing them (bit for
      bit what was saved); on CUDA the peak device memory of each save and load beyond what was
      allocated before, a save's under :data:`SAVE_PEAK_TENSORS` of the largest tensor (gathering
      everything on the device would need the whole state);
    * ``zero1_consolidated``: ZeRO-1 on the mesh (``lane_zero``) after two steps: its consolidated
      optimizer state (the owners broadcast their AdamW state, ``step`` included) saved and
      loaded back, bit for bit, with the peaks (recorded, not judged: while it is gathered every
      rank of a lane holds the lane's whole state on the device, by design).
    """
    import torch.distributed as dist
    from _layouts_check import (  # benchmarks/_layouts_check.py: the state helpers the 2+ GPU jobs share
        FLAT_FROM_STEP,
        compare_states,
        device_peak,
        flat_peaks,
        local_state,
        state_sizes,
        zero_state,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_bytescale import ByteScaleStrategy
    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.lightning import checkpoint as ckpt
    from lightning_bytescale.lightning import mesh as mesh_
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import (
        FSDPStepDriver,
        LlamaStage,
        ParallelDims,
        ParallelMesh,
        StageSchedules,
        build_pipeline_step,
        run_parallel_step,
        run_pipeline_step,
    )
    from lightning_bytescale.planner import make_plan

    section = report.section("mesh")
    cuda = device.type == "cuda"
    canary = None if cuda else _cuda_only_canary()  # before this section's own group exists
    _one_rank_world(device)
    pmesh = ParallelDims(1).build(device.type)

    class OneStageMesh(ParallelMesh):
        """``ParallelDims(1)``'s mesh as the pipeline of one stage (it has no ``"pipeline"`` dimension)."""

        @property
        def pp_group(self):
            return dist.group.WORLD

    one_stage = OneStageMesh(pmesh.dims, pmesh.mesh, pmesh.rank)
    cfg = LlamaConfig.preset(sizes.preset, tie_embeddings=False)  # a pipeline stage refuses tied embeddings
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in LlamaModel(cfg).state_dict().items()}
    reference: list[torch.nn.Module] = []
    to_device = ByteScaleStrategy().batch_to_device  # what the strategy does to a step's batch

    def model(dtype: torch.dtype) -> LlamaModel:
        m = LlamaModel(cfg)
        m.load_state_dict(init)
        return m.to(device=device, dtype=dtype)

    def sharded(dtype: torch.dtype) -> tuple[LlamaModel, FSDPStepDriver]:
        m = model(dtype)
        for block in m.blocks:
            fully_shard(block, mesh=pmesh.dp_mesh, reshard_after_forward=False)
        fully_shard(m, mesh=pmesh.dp_mesh, reshard_after_forward=False)
        return m, FSDPStepDriver(m, pmesh.dp_group)

    def plan_of(seqs: list[torch.Tensor]):
        return make_plan([len(s) for s in seqs], world_size=1, capacity=sizes.capacity)

    def step_of(k: int, seqs: list[torch.Tensor]):
        return to_device(
            build_step(plan_of(seqs), 0, seqs.__getitem__, step=k, ring_ranks=pmesh.ring_ranks), device
        )

    def pipeline_batch(k: int, seqs: list[torch.Tensor]):
        return build_pipeline_step(
            plan_of(seqs), 0, seqs.__getitem__, stages=1, step=k, ring_ranks=pmesh.ring_ranks
        )

    def fixed_shape(k: int) -> list[torch.Tensor]:
        """Step ``k``'s sequences: the same lengths every step (every step packs alike), learnable tokens."""
        g = torch.Generator().manual_seed(10_000 + k)
        c = sizes.capacity
        out = []
        for n in (c, 3 * c // 4, c // 2, c // 2, c // 4):
            a, b = torch.randint(0, cfg.vocab, (2,), generator=g).tolist()
            out.append((a + (b % 7 + 1) * torch.arange(n)) % cfg.vocab)
        return out

    def against_reference(out: dict, trained: torch.nn.Module, losses: list[float]) -> bool:
        """``trained``'s parameters after ``steps`` float64 steps against the single-process loop's (1e-10)."""
        if not reference:
            reference.append(_reference_fit(cfg, init, sizes, device))
        got = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in trained.named_parameters()
        }
        errs = {n: _max_err(got[n], p) for n, p in reference[0].named_parameters()}
        worst = max(errs, key=errs.get)
        change = max(_max_err(got[n], init[n].to(got[n])) for n in errs)
        out.update(steps=len(losses), losses=losses, max_param_diff=errs[worst], worst_param=worst,
                   max_param_change=change, tolerance=1e-10)  # fmt: skip
        return bool(errs[worst] <= 1e-10 and change > 1e-4 and len(losses) == sizes.steps)

    def host_tensor_refused(sub: Sub) -> None:
        sub.out["group"] = {"backend": str(dist.get_backend(pmesh.dp_group)), "world": dist.get_world_size()}
        if cuda:
            sub.out.update(_host_tensor_refused(pmesh.dp_group))
        else:
            sub.out.update(canary=canary, note="dry run: the subsections below run on gloo, which takes host "
                           "tensors; only a GPU run (or tests/fake_nccl) sees a host tensor reach a collective")  # fmt: skip
            sub.out["host_tensor_refused"] = canary["host_tensor_refused"]
        sub.out["ok"] = sub.out["host_tensor_refused"]

    def fsdp2(sub: Sub) -> None:
        m, driver = sharded(torch.float64)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for k in range(sizes.steps):
            opt.zero_grad(set_to_none=True)
            result = run_parallel_step(
                m, step_of(k, _sequences(k, cfg.vocab, sizes.capacity)), pmesh, fsdp=driver
            )
            opt.step()
            losses.append(result.loss)
        sub.out["dtensor_params"] = sum(isinstance(p, DTensor) for p in m.parameters())
        sub.out["units"] = len(driver.units)
        sub.out["ok"] = against_reference(sub.out, m, losses) and sub.out["dtensor_params"] > 0

    def pipeline(sub: Sub) -> None:
        m = model(torch.float64)
        stage = LlamaStage(m, 0, 1)
        schedules = StageSchedules(stage, one_stage)
        opt = torch.optim.SGD(stage.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for k in range(sizes.steps):
            opt.zero_grad(set_to_none=True)
            batch = pipeline_batch(k, _sequences(k, cfg.vocab, sizes.capacity))
            losses.append(run_pipeline_step(stage, batch, one_stage, schedules=schedules).loss)
            opt.step()
        float64 = sub.out.setdefault("float64", {})
        exact = float64["ok"] = against_reference(float64, m, losses)
        # bf16 autocast (what the strategy enters from the precision plugin), AdamW, one batch shape
        m = model(torch.float32)
        stage = LlamaStage(m, 0, 1)
        head_dtypes: set[str] = set()
        stage.part("head").register_forward_hook(lambda mod, a, out: head_dtypes.add(str(out.dtype)))
        schedules = StageSchedules(stage, one_stage)
        opt = torch.optim.AdamW(stage.parameters(), lr=3e-3, weight_decay=0.1)
        rows = []
        for k in range(sizes.steps):
            opt.zero_grad(set_to_none=True)
            batch = pipeline_batch(k, fixed_shape(k))

            def one_step(batch=batch):
                return run_pipeline_step(
                    stage, batch, one_stage, schedules=schedules,
                    compute_context=lambda: torch.autocast(device.type, dtype=torch.bfloat16),
                )  # fmt: skip

            result, peak = device_peak(device, lambda: (one_step(), opt.step())[0])
            rows.append({"loss": result.loss, "micro_batches": len(batch.micro_batches),
                         "bubble": result.stage_bubble, "peak_bytes": peak})  # fmt: skip
        flat = flat_peaks([r["peak_bytes"] for r in rows]) if cuda else None
        losses = [r["loss"] for r in rows]
        sub.out["bf16_mixed"] = {
            "steps": len(rows), "rows": rows, "head_dtypes": sorted(head_dtypes), "stages_built": schedules.built,
            "finite": all(math.isfinite(x) for x in losses), "peak_flat_from_step": FLAT_FROM_STEP,
            "peak_flat": flat, "bubble_median": statistics.median(r["bubble"] for r in rows),
        }  # fmt: skip
        bf16 = sub.out["bf16_mixed"]
        bf16["ok"] = bool(
            bf16["head_dtypes"] == ["torch.bfloat16"] and bf16["finite"] and bf16["stages_built"] == 1
            and len(rows) == sizes.steps and flat is not False
        )  # fmt: skip
        sub.out["ok"] = exact and bf16["ok"]

    def trained_fsdp2() -> tuple[LlamaModel, torch.optim.Optimizer]:
        m, driver = sharded(torch.float32)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
        for k in range(2):
            opt.zero_grad(set_to_none=True)
            run_parallel_step(m, step_of(k, _sequences(k, cfg.vocab, sizes.capacity)), pmesh, fsdp=driver)
            opt.step()
        return m, opt

    def judged_peaks(
        sub: Sub,
        saved: dict[str, torch.Tensor],
        save_peak: int | None,
        load_peak: int | None,
        judged: bool = True,
    ) -> bool:
        sizes_ = state_sizes(saved)
        sub.out.update(sizes_, save_peak_bytes=save_peak, load_peak_bytes=load_peak)
        if save_peak is None:
            sub.out["peaks"] = "measured on CUDA only (dry run)"
            return True
        if not judged:  # ZeRO-1: the lane's whole optimizer state is on every rank while it is gathered
            sub.out["peaks"] = (
                "recorded: LaneZero.materialized gives every rank of a lane its whole state on the device"
            )
            return True
        sub.out["save_peak_limit_bytes"] = SAVE_PEAK_TENSORS * sizes_["largest_tensor_bytes"]
        return save_peak <= sub.out["save_peak_limit_bytes"]

    def checkpoint_sharded(sub: Sub) -> None:
        m, opt = trained_fsdp2()
        saved = local_state(m, opt)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "sharded.ckpt")

            def save() -> None:
                state = {
                    "state_dict": m.state_dict(),
                    "optimizer_states": [ckpt.sharded_optimizer_state(opt, m)],
                }
                ckpt.save_sharded(state, path, rank=0, barrier=dist.barrier)

            _, save_peak = device_peak(device, save)
            zero_state(m, opt)

            def load() -> None:
                loaded = ckpt.load_sharded(path, m, [opt], keeps_state=mesh_.keeps_state)
                opt.load_state_dict(loaded["optimizer_states"][0])

            _, load_peak = device_peak(device, load)
        sub.out.update(compare_states(saved, local_state(m, opt)))
        within = judged_peaks(sub, saved, save_peak, load_peak)
        sub.out["ok"] = bool(within and sub.out["max_abs_diff"] == 0 and not sub.out["only_one_side"])

    def checkpoint_consolidated(sub: Sub, zero: bool = False) -> None:
        if zero:  # ZeRO-1 on the mesh: plain parameters, each one's AdamW state kept by its owner
            m = model(torch.float32)
            opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
            mesh_.lane_zero([opt], pmesh, 1)
            for k in range(2):
                opt.zero_grad(set_to_none=True)
                run_parallel_step(m, step_of(k, _sequences(k, cfg.vocab, sizes.capacity)), pmesh)
                opt.step()
        else:
            m, opt = trained_fsdp2()
        saved = local_state(m, opt)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "consolidated.ckpt")

            def save() -> None:
                torch.save(
                    {"state_dict": mesh_.model_state(m), "optimizer_states": [mesh_.optimizer_state(m, opt)]},
                    path,
                )

            _, save_peak = device_peak(device, save)
            zero_state(m, opt)

            def load() -> None:
                state = torch.load(path, weights_only=False)
                mesh_.load_model_state(m, state["state_dict"], strict=True)
                mesh_.load_optimizer_states(m, [opt], state["optimizer_states"])

            _, load_peak = device_peak(device, load)
        sub.out.update(compare_states(saved, local_state(m, opt)))
        within = judged_peaks(sub, saved, save_peak, load_peak, judged=not zero)
        sub.out["ok"] = bool(within and sub.out["max_abs_diff"] == 0 and not sub.out["only_one_side"])

    try:
        section.run("host_tensor_refused", host_tensor_refused)
        section.run("fsdp2", fsdp2)
        section.run("pipeline", pipeline)
        section.run("checkpoint_sharded", checkpoint_sharded)
        section.run("checkpoint_consolidated", checkpoint_consolidated)
        section.run("zero1_consolidated", lambda sub: checkpoint_consolidated(sub, zero=True))
    finally:
        _leave_world()


# ----------------------------------------------------------------------------- 2+ GPUs: one start of the ranks
# The tensor_parallel and layouts sections judge Trainer jobs run in one start of the ranks
# (benchmarks/_layouts_check.py, the ranks section): world = 4 with four GPUs or more, else 2; NCCL
# on GPUs, gloo on 2 CPU ranks in the dry run.  A job that has not started within the ranks' share
# of the budget (SECTION_BUDGET_S["ranks"]) is cut, and its subsection fails.
SECTION_JOBS = {
    "tensor_parallel": ("tp_bf16", "tp_float64"),
    "layouts": ("pipelines", "fsdp2_tp", "tp_zero1_checkpoints", "tp_allreduce_count"),
}
JOB_TIMEOUT_S = 120.0  # a job's process-group timeout: a collective that waits longer fails the job
RANKS_START_S = 60.0  # the ranks' start (imports, NCCL) and a rank's last report, on top of the budgets


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _gpus_or_skip(section: Section, subsections: tuple[str, ...]) -> int | None:
    """The GPUs visible, or ``None`` after recording a skip in every subsection when fewer than two are."""
    visible = torch.cuda.device_count()
    if visible >= 2:
        return visible
    reason = f"needs two or more GPUs; {visible} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})"
    for name in subsections:
        section.run(name, lambda sub: sub.out.update(skipped=reason, gpus_visible=visible))
    return None


@dataclass
class RanksRun:
    """What the ranks wrote: each job's per-rank reports (``None`` where a rank wrote none) and rank 0's tensors."""

    world: int
    reports: dict[str, list[dict | None]]
    tensors: dict[str, dict[str, torch.Tensor]]
    problem: str | None  # how the ranks ended when not all of them finished every job
    seconds: float

    def job(self, name: str) -> list[dict]:
        """The job's reports, every rank's; raises with the reason when a rank has none or one failed."""
        reports = self.reports[name]
        for rank, rep in enumerate(reports):
            if rep is None:
                why = self.problem or "a job before it failed or the budget was spent"
                raise RuntimeError(f"rank {rank} did not run {name}: {why}")
            if "error" in rep:
                raise RuntimeError(
                    f"{name} failed on rank {rank}: {rep['error']}\n{rep.get('traceback', '')}"
                )
        return reports  # type: ignore[return-value]


def _ranks_run(report: Report, device: torch.device, sizes: Sizes, world: int, init: dict) -> RanksRun:
    """The jobs of the selected 2+ GPU sections, once, in ``world`` spawned ranks (cached on the report)."""
    import _layouts_check  # benchmarks/_layouts_check.py
    import torch.multiprocessing as mp
    from _common import free_port  # benchmarks/_common.py

    if "ranks" in report.cache:
        return report.cache["ranks"]
    every = report.selected is None or "ranks" in report.selected
    jobs = [job for s, names in SECTION_JOBS.items() if every or s in report.selected for job in names]
    budget = SECTION_BUDGET_S["ranks"]
    spec = {
        "accelerator": "gpu" if device.type == "cuda" else "cpu", "preset": sizes.preset, "steps": sizes.steps,
        "capacity": sizes.capacity, "init": init, "timeout_s": JOB_TIMEOUT_S, "deadline": time.time() + budget,
    }  # fmt: skip
    t0 = time.perf_counter()
    problem = None
    with tempfile.TemporaryDirectory() as tmp:
        ranks = mp.start_processes(
            _layouts_check.rank_main, args=(world, free_port(), tmp, jobs, spec), nprocs=world,
            start_method="spawn", join=False,
        )  # fmt: skip
        hard_stop = time.time() + budget + JOB_TIMEOUT_S + RANKS_START_S
        try:
            while not ranks.join(timeout=2):
                if time.time() > hard_stop:
                    problem = f"the ranks were still running {budget + JOB_TIMEOUT_S + RANKS_START_S:.0f} s after they started; ended"
                    break
        except Exception as err:  # a rank ended with an error (a store wait timed out: a peer is stuck)
            problem = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"
        finally:
            for proc in ranks.processes:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        folder = Path(tmp)
        reports = {
            job: [
                json.loads(p.read_text()) if (p := folder / f"{job}.rank{r}.json").exists() else None
                for r in range(world)
            ]
            for job in jobs
        }
        tensors = {job: torch.load(folder / f"{job}.pt") for job in jobs if (folder / f"{job}.pt").exists()}
    run = RanksRun(world, reports, tensors, problem, time.perf_counter() - t0)
    report.cache["ranks"] = run
    return run


def ranks_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    """The jobs of ``tensor_parallel`` and ``layouts``, run once in 2 ranks (4 with four GPUs or more); those sections judge them.

    ``run`` records the world, each job's outcome per rank (``ok``, its error, or ``not run``)
    and how the ranks ended; it fails only when the ranks did not end by themselves (a job that
    failed fails its own subsection).  With fewer than two GPUs a skip with the reason; the dry
    run starts 2 gloo CPU ranks.
    """
    section = report.section("ranks")
    if device.type == "cuda":
        visible = _gpus_or_skip(section, ("run",))
        if visible is None:
            return
        world = _mesh_world(visible)
    else:
        world = 2

    def run(sub: Sub) -> None:
        ranks = _ranks_run(report, device, sizes, world, _tp_init(sizes))

        def outcome(rep: dict | None) -> str:
            return "not run" if rep is None else rep["error"].splitlines()[0] if "error" in rep else "ok"

        sub.out.update(
            world=world, budget_s=SECTION_BUDGET_S["ranks"], ranks_seconds=ranks.seconds, problem=ranks.problem,
            jobs={job: [outcome(rep) for rep in reps] for job, reps in ranks.reports.items()},
            job_seconds={job: [None if rep is None else rep["seconds"] for rep in reps]
                         for job, reps in ranks.reports.items()},
        )  # fmt: skip
        sub.out["ok"] = ranks.problem is None

    section.run("run", run)


def _mesh_world(visible: int) -> int:
    """Ranks of the 2+ GPU runs: ``(2, 2)`` with four GPUs or more, else ``(1, 2)``."""
    return 4 if visible >= 4 else 2


def _tp_init(sizes: Sizes) -> dict[str, torch.Tensor]:
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    return {k: v.clone() for k, v in LlamaModel(LlamaConfig.preset(sizes.preset)).state_dict().items()}


def _against_float64(
    sub: Sub, cfg, init, sizes: Sizes, device: torch.device, got: dict[str, torch.Tensor]
) -> bool:
    """Rank 0's gathered parameters after ``steps`` float64 steps against the single-process loop (1e-10)."""
    reference = _reference_fit(cfg, init, sizes, device)
    errs = {n: _max_err(got[n].to(p), p) for n, p in reference.named_parameters()}
    worst = max(errs, key=errs.get)
    sub.out.update(
        max_param_diff=errs[worst],
        worst_param=worst,
        max_param_change=max(_max_err(got[n], init[n].to(got[n])) for n in errs),
        tolerance=1e-10,
    )
    return bool(errs[worst] <= 1e-10 and sub.out["max_param_change"] > 1e-4)


def _ran_on_mesh(sub: Sub, reports: list[dict], world: int, sizes: Sizes, backend: str) -> bool:
    """The Trainer ran on every rank of ``(world // 2, 2)`` on ``backend``, the lanes logged the same losses."""
    losses = [[row["loss"] for row in rep["rows"]] for rep in reports]
    seconds = [row["seconds"] for row in reports[0]["rows"]]
    warm = seconds[2:] or seconds  # the first steps pay start-up costs
    sub.out.update(
        world=world,
        mesh=reports[0]["mesh"],
        backend=[rep["backend"] for rep in reports],
        devices=[rep["device"] for rep in reports],
        steps=len(losses[0]),
        losses=losses[0],
        lanes_agree=all(ls == losses[0] for ls in losses),
        step_seconds=seconds,
        step_seconds_median=statistics.median(warm) if warm else None,
        dtensor_params=reports[0]["dtensor_params"],
    )
    return bool(
        all(b == backend for b in sub.out["backend"])
        and sub.out["mesh"] == [world // 2, 2]
        and all(len(ls) == sizes.steps for ls in losses)
        and sub.out["lanes_agree"]
        and sub.out["dtensor_params"] > 0
    )


def tensor_parallel_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    """``ByteScaleStrategy(tensor_parallel_size=2)`` on 2 GPUs (4 when visible: ``(2, 2)``), NCCL.

    :mod:`_tp_check`'s module and data, run as the ``tp_bf16`` and ``tp_float64`` jobs of the
    ranks (``benchmarks/_layouts_check.py``): the reference Llama sharded by ``parallelize_llama``
    in ``configure_model`` under ``Trainer(strategy=ByteScaleStrategy(tensor_parallel_size=2))``,
    in ``bf16-mixed`` (it ran on every rank, the lanes log the same finite losses, step time) and
    in ``64-true`` against the single-process float64 loop (1e-10).  With fewer than two GPUs both
    subsections record a skip with the reason.  The dry run trains the same code on 2 gloo CPU
    ranks.
    """
    from lightning_bytescale.models import LlamaConfig

    section = report.section("tensor_parallel")
    if device.type == "cuda":
        visible = _gpus_or_skip(section, ("bf16_mixed", "float64"))
        if visible is None:
            return
        world, backend = _mesh_world(visible), "nccl"
    else:
        world, backend = 2, "gloo"
    cfg = LlamaConfig.preset(sizes.preset)
    init = _tp_init(sizes)

    def bf16_mixed(sub: Sub) -> None:
        reports = _ranks_run(report, device, sizes, world, init).job("tp_bf16")
        ok = _ran_on_mesh(sub, reports, world, sizes, backend)
        sub.out["finite"] = all(math.isfinite(x) for x in sub.out["losses"])
        sub.out["ran"] = True
        sub.out["ok"] = bool(ok and sub.out["finite"])

    def float64(sub: Sub) -> None:
        run = _ranks_run(report, device, sizes, world, init)
        ok = _ran_on_mesh(sub, run.job("tp_float64"), world, sizes, backend)
        sub.out["ok"] = _against_float64(sub, cfg, init, sizes, device, run.tensors["tp_float64"]) and ok

    section.run("bf16_mixed", bf16_mixed)
    section.run("float64", float64)


def _profile_tp(device: torch.device, sizes: Sizes, out: Path) -> dict:
    """``bytescale-profile --tensor-parallel 2`` started plainly (no torchrun variables): it starts its own two ranks."""
    import subprocess

    from lightning_bytescale.profiler import load_profile

    cuda = device.type == "cuda"
    lengths, budget = ("256,512,1024", "8GiB") if cuda else ("16,32,48", "64MiB")
    args = ["--model", sizes.preset, "--lengths", lengths, "--device", device.type, "--memory-budget", budget,
            "--tensor-parallel", "2", "--repeats", "1", "--warmup", "1" if cuda else "0",
            "--timeout", str(int(JOB_TIMEOUT_S)), "-o", str(out)]  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    }
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from lightning_bytescale.cli.profile import main; sys.exit(main())"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
        timeout=JOB_TIMEOUT_S + RANKS_START_S,
    )  # fmt: skip
    result: dict = {"command": "bytescale-profile " + " ".join(args), "returncode": proc.returncode,
                    "seconds": time.perf_counter() - t0}  # fmt: skip
    if proc.returncode != 0:
        result["output"] = (proc.stdout + proc.stderr)[-3000:]
        return result
    prof = load_profile(out)
    result.update(tensor_parallel=prof.tensor_parallel, capacity=prof.capacity, lengths=list(prof.lengths))
    return result


def layouts_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    """The strategy's other layouts on 2 GPUs (4 when visible), NCCL: the jobs of ``benchmarks/_layouts_check.py``.

    * ``pipelines_bf16``: ``pipeline_parallel_size=2`` (one pipeline of two stages per two GPUs)
      in ``bf16-mixed`` for ``steps`` steps on one batch shape: the last stage's head computes in
      bfloat16 (the strategy enters the precision plugin's context), the parameters stay float32,
      every rank logs the same finite losses, each step's peak ``max_memory_allocated`` is flat
      from step ``FLAT_FROM_STEP`` on (no stage or buffer outlives its step), and the measured
      bubble of every pipeline per step (recorded);
    * ``fsdp2_tp``: ``tensor_parallel_size=2`` with ``fully_shard`` over the data-parallel
      dimension (on ``(1, 2)`` a group of one; ``(2, 2)`` with four GPUs) in ``64-true`` against
      the single-process float64 loop (1e-10), the strategy's ``FSDPStepDriver`` in use;
    * ``tp_zero1_checkpoints``: ``tensor_parallel_size=2, zero=1``: after three steps a
      consolidated and a sharded checkpoint (peak device memory of each save recorded), each
      resumed by a run that starts from zeros: every rank's parameters and optimizer state right
      after the load equal, bit for bit, what it held at the save, and the resumed step's loss is
      finite (load peaks recorded);
    * ``tp_allreduce_count``: ``CommDebugMode`` over one forward and backward of the reference
      Llama sharded by ``parallelize_llama``, 1 and 2 blocks: 2 all-reduces per block in the
      backward, 2 per block plus the head's in all;
    * ``profile_tp``: ``bytescale-profile --tensor-parallel 2`` started plainly (not under
      torchrun), so it starts its two ranks itself (spawned on CUDA), and writes a cost model of
      one tensor-parallel group of 2.

    With fewer than two GPUs every subsection records a skip with the reason; the dry run runs
    the same jobs on 2 gloo CPU ranks (no device memory to read) and the profiler on the CPU.
    """
    from _layouts_check import FLAT_FROM_STEP, finite

    from lightning_bytescale.models import LlamaConfig

    names = ("pipelines_bf16", "fsdp2_tp", "tp_zero1_checkpoints", "tp_allreduce_count", "profile_tp")
    section = report.section("layouts")
    if device.type == "cuda":
        visible = _gpus_or_skip(section, names)
        if visible is None:
            return
        world, backend = _mesh_world(visible), "nccl"
    else:
        world, backend = 2, "gloo"
    cuda = device.type == "cuda"
    init = _tp_init(sizes)

    def ranks() -> RanksRun:
        return _ranks_run(report, device, sizes, world, init)

    def pipelines_bf16(sub: Sub) -> None:
        reports = ranks().job("pipelines")
        last = [r for r in reports if r["stage"] == 1]
        losses = [[row["loss"] for row in r["rows"]] for r in reports]
        bubbles = [row["pipeline_bubble"] for row in reports[0]["rows"]]
        sub.out.update(
            world=world, mesh=reports[0]["mesh"], backend=[r["backend"] for r in reports],
            devices=[r["device"] for r in reports], steps=len(losses[0]), losses=losses[0],
            head_dtypes=sorted({d for r in last for d in r["head_dtypes"]}),
            param_dtypes=sorted({d for r in reports for d in r["param_dtypes"]}),
            ranks_agree=all(ls == losses[0] for ls in losses),
            micro_batches=[row["micro_batches"] for row in reports[0]["rows"]],
            pipeline_bubble_per_step=bubbles,
            pipeline_bubble_median=_median([b[0] for b in bubbles[1:] if b]),
            peak_bytes_per_rank=[[row["peak_bytes"] for row in r["rows"]] for r in reports],
            peak_flat_from_step=FLAT_FROM_STEP, peak_flat=[r["peak_flat"] for r in reports],
        )  # fmt: skip
        sub.out["ok"] = bool(
            all(b == backend for b in sub.out["backend"]) and sub.out["mesh"] == [2, world // 2, 1]
            and sub.out["head_dtypes"] == ["torch.bfloat16"] and sub.out["param_dtypes"] == ["torch.float32"]
            and sub.out["ranks_agree"] and finite(losses[0]) and len(losses[0]) == sizes.steps
            and (not cuda or all(sub.out["peak_flat"]))
        )  # fmt: skip

    def fsdp2_tp(sub: Sub) -> None:
        run = ranks()
        reports = run.job("fsdp2_tp")
        ok = _ran_on_mesh(sub, reports, world, sizes, backend)
        sub.out["fsdp_driver"] = all(r["fsdp_driver"] for r in reports)
        exact = _against_float64(
            sub, LlamaConfig.preset(sizes.preset), init, sizes, device, run.tensors["fsdp2_tp"]
        )
        sub.out["ok"] = bool(ok and exact and sub.out["fsdp_driver"])

    def tp_zero1_checkpoints(sub: Sub) -> None:
        reports = ranks().job("tp_zero1_checkpoints")
        sub.out.update(world=world, state_bytes_per_rank=[r["state"] for r in reports])
        ok = True
        for fmt in ("consolidated", "sharded"):
            rows = [r["saves"][fmt] for r in reports]
            sub.append("saves", {"format": fmt, "per_rank": rows})
            ok = ok and all(
                row["max_abs_diff"] == 0 and not row["only_one_side"] and row["tensors"] > 0
                and row["sharded_folder"] == (fmt == "sharded") and len(row["resumed_losses"]) == 1
                and finite(row["resumed_losses"])
                for row in rows
            )  # fmt: skip
        sub.out["ok"] = bool(ok)

    def tp_allreduce_count(sub: Sub) -> None:
        (first, *_) = reports = ranks().job("tp_allreduce_count")
        counts = {int(k): v for k, v in first["counts"].items()}
        per_block = counts[2]["backward"] - counts[1]["backward"]
        sub.out.update(
            mesh=first["mesh"], backend=first["backend"], counts=counts, backward_per_block=per_block,
            expected_backward="2 per block + 1 (the untied head)",
            lanes_agree=all(r["counts"] == first["counts"] for r in reports),
        )  # fmt: skip
        sub.out["ok"] = bool(
            per_block == 2
            and all(counts[n]["backward"] == 2 * n + 1 for n in (1, 2))
            and sub.out["lanes_agree"]
        )

    def profile_tp(sub: Sub) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            sub.out.update(_profile_tp(device, sizes, Path(tmp, "cost_model.json")))
        sub.out["ok"] = sub.out["returncode"] == 0 and sub.out.get("tensor_parallel") == 2

    section.run("pipelines_bf16", pipelines_bf16)
    section.run("fsdp2_tp", fsdp2_tp)
    section.run("tp_zero1_checkpoints", tp_zero1_checkpoints)
    section.run("tp_allreduce_count", tp_allreduce_count)
    section.run("profile_tp", profile_tp)


# ----------------------------------------------------------------------------- ulysses
# Ulysses (and, on 4 GPUs or more, hybrid) items of N members on N GPUs against local attention in
# bfloat16 on the same inputs.  Errors are relative to the float64 reference's largest magnitude.
# Against float64: the ring's bounds (REFERENCE_TOLERANCE; the exchange moves values unchanged and
# the local kernel runs on whole sequences, so Ulysses rounds no more than local attention, and at
# most LOCAL_MARGIN x local's error + 2e-3).  Against local attention on the same bf16 inputs: out
# and dq within 1e-2 (the same kernel on the same rows, per head), dk and dv within 2e-2 (a key/value
# head that several members read gets its gradient summed over them in bf16, one rounding per
# member; the hybrid's ring merges blocks in float32 as the ring does).
ULYSSES_VS_LOCAL = {"out": 1e-2, "dq": 1e-2, "dk": 2e-2, "dv": 2e-2}


def _ulysses_rank(rank: int, world: int, port: int, out: str, dry_run: bool) -> None:
    """One member of the Ulysses section's items (a spawned process, NCCL on ``cuda:rank`` or gloo on the CPU)."""
    from dataclasses import replace
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_bytescale.packed_attention import AttentionLayout, attention, attention_context
    from lightning_bytescale.packed_attention.local import local_kernel
    from lightning_bytescale.packed_attention.loopback import ring_layouts, zigzag_shard

    sizes = DRY if dry_run else GPU
    device = torch.device("cpu") if dry_run else torch.device("cuda", rank)
    if not dry_run:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo" if dry_run else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300), **({} if dry_run else {"device_id": device}),
    )  # fmt: skip
    names = ("out", "dq", "dk", "dv")

    def inputs(lens: list[int], heads: tuple[int, int, int], seed: int) -> list[torch.Tensor]:
        """q, k, v and the output's gradient of packed whole sequences: the same on every rank."""
        h, kv, dim = heads
        t = sum(lens)
        shapes = [(t, h, dim), (t, kv, dim), (t, kv, dim), (t, h, dim)]
        return [x.to(device) for x in _random(shapes, torch.device("cpu"), torch.bfloat16, seed)]

    def run(layout: AttentionLayout, q, k, v, dout) -> list[torch.Tensor]:
        """Attention under ``layout``, forward and backward: the output and q, k, v's gradients."""
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with attention_context(layout):
            o = attention(*leaves)
        o.backward(dout)
        return [o.detach(), *(x.grad for x in leaves)]

    def errors(mode: str, u: int | None) -> dict:
        lens = list(sizes.error_lens)
        full = inputs(lens, sizes.error_heads, 39)
        ref_in = [x.double().requires_grad_() for x in full[:3]]
        ref_out = dense_attention(*ref_in, lens)
        ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, full[3].double())]
        local = run(AttentionLayout((0, *torch.tensor(lens).cumsum(0).tolist()), tuple(lens)), *full)
        layouts = ring_layouts(lens, world)
        mine = run(
            replace(layouts[rank], mode=mode, ulysses_size=u), *(zigzag_shard(x, layouts)[rank] for x in full)
        )
        # this member's rows of the references (zero on padding slots, as its output and gradients are)
        scale = [float(r.abs().max()) for r in ref]
        vs = lambda other: {  # noqa: E731
            n: _max_err(a, zigzag_shard(b, layouts)[rank]) / s
            for n, a, b, s in zip(names, mine, other, scale)
        }
        return {
            "mode": mode,
            "ulysses_size": u,
            "rel_err_vs_float64": vs(ref),
            "rel_diff_vs_local": vs(local),
            "local_rel_err_vs_float64": {n: _rel_err(a, b) for n, a, b in zip(names, local, ref)},
        }

    def timing() -> dict:
        total = world * sizes.tokens_per_member
        full = inputs([total], sizes.speed_heads, 7)
        layouts = ring_layouts([total], world)
        parts = [zigzag_shard(x, layouts)[rank] for x in full]

        def best(fn: Callable[[], object]) -> float:
            """Best wall time over the iterations, every member done (an item ends with its slowest member)."""
            fn()
            _sync(device)
            dist.barrier()
            times = []
            for _ in range(max(sizes.iters, 2)):
                start = time.perf_counter()
                fn()
                _sync(device)
                dist.barrier()
                times.append(time.perf_counter() - start)
            return min(times)

        seconds = {
            m: best(lambda m=m: run(replace(layouts[rank], mode=m), *parts)) for m in ("ulysses", "ring")
        }
        whole = AttentionLayout((0, total), (total,))
        seconds["local"] = best(
            lambda: run(whole, *full) if rank == 0 else None
        )  # one GPU, the whole sequence
        return {
            "seconds": seconds,
            "local_kernel": local_kernel(full[0]),
            "tokens": total,
            "heads": list(sizes.speed_heads),
        }

    cases = [("ulysses", None)] + ([("hybrid", 2)] if world >= 4 else [])
    report = {"device": str(device), "errors": [errors(m, u) for m, u in cases], "timing": timing()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


def ulysses_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    """Ulysses items of ``N`` members on ``N`` GPUs (2, 4 or 8, as many as are visible), NCCL P2P.

    ``errors``: a Ulysses item (and with 4 GPUs or more a hybrid item of 2 a "node") of
    ``error_lens`` in bfloat16, output and q/k/v gradients against float64 and against local
    attention on the same inputs (:data:`ULYSSES_VS_LOCAL`).  ``throughput``: forward and backward
    of one causal sequence of ``N x tokens_per_member`` tokens: a Ulysses item and a zigzag ring
    of ``N`` members, against local attention on one GPU (``fraction_of_local`` is local's time
    over ``N`` times the item's: 1.0 keeps all of one GPU's throughput); timings are recorded,
    never judged.  With fewer than two GPUs both record a skip; the dry run runs the same code on
    2 gloo CPU ranks (CPU timings predict nothing).
    """
    import socket

    import torch.multiprocessing as mp

    section = report.section("ulysses")
    if device.type == "cuda":
        visible = _gpus_or_skip(section, ("errors", "throughput"))
        if visible is None:
            return
        world = max(n for n in (2, 4, 8) if n <= visible)
    else:
        world = 2
    ranks: list[dict] = []

    def start() -> list[dict]:
        if not ranks:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(
                    _ulysses_rank,
                    args=(world, port, tmp, device.type != "cuda"),
                    nprocs=world,
                    start_method="spawn",
                )
                ranks.extend(json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world))
        return ranks

    def errors(sub: Sub) -> None:
        results = start()
        sub.out.update(members=world, dtype="bfloat16", tolerance_vs_float64=REFERENCE_TOLERANCE,
                       local_margin=LOCAL_MARGIN, tolerance_vs_local=ULYSSES_VS_LOCAL)  # fmt: skip
        for i, case in enumerate(results[0]["errors"]):
            worst = {key: {n: max(r["errors"][i][key][n] for r in results) for n in ULYSSES_VS_LOCAL}
                     for key in ("rel_err_vs_float64", "rel_diff_vs_local")}  # fmt: skip
            local = case["local_rel_err_vs_float64"]
            ok = all(
                worst["rel_err_vs_float64"][n] <= min(REFERENCE_TOLERANCE[n], LOCAL_MARGIN * local[n] + 2e-3)
                and worst["rel_diff_vs_local"][n] <= ULYSSES_VS_LOCAL[n]
                for n in ULYSSES_VS_LOCAL
            )
            row = {"mode": case["mode"], "ulysses_size": case["ulysses_size"], **worst,
                   "local_rel_err_vs_float64": local, "ok": ok}  # fmt: skip
            sub.append("items", row)
        sub.out["ok"] = all(r["ok"] for r in sub.out["items"])

    def throughput(sub: Sub) -> None:
        timing = start()[0]["timing"]
        t = timing["seconds"]
        sub.out.update(
            members=world, tokens=timing["tokens"], heads=timing["heads"], dtype="bfloat16",
            local_kernel=timing["local_kernel"], local_s=t["local"], ulysses_s=t["ulysses"], ring_s=t["ring"],
            ulysses_fraction_of_local=t["local"] / (world * t["ulysses"]),
            ring_fraction_of_local=t["local"] / (world * t["ring"]),
            ulysses_speedup_over_ring=t["ring"] / t["ulysses"],
        )  # fmt: skip
        if device.type != "cuda":
            sub.out["note"] = "CPU dry run: gloo timings say nothing about NVLink"
        sub.out["ok"] = all(math.isfinite(v) and v > 0 for v in t.values())

    section.run("errors", errors)
    section.run("throughput", throughput)


# ----------------------------------------------------------------------------- offload
def _offload_identity_cpu(sizes: Sizes) -> dict:
    """Dry run: the offloader's hooks on CPU leave gradients bit-identical at r = 0.25 / 0.5 / 1.0."""
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.offload.offloader import ActivationOffloader
    from lightning_bytescale.packed_attention import AttentionLayout, attention_context

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.preset(sizes.preset, layers=4))
    ids = torch.randint(0, model.config.vocab, (48,))
    layout = AttentionLayout((0, 30, 48), (30, 18))
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
    return {
        "bit_identical": equal,
        "offloaded_bytes": offloader.stats.offloaded_bytes,
        "ok": all(equal.values()),
    }


def offload_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    section = report.section("offload")
    if device.type != "cuda":
        section.run("cpu_hooks", lambda sub: sub.out.update(_offload_identity_cpu(sizes)))
        section.run("cuda", lambda sub: sub.out.update(skipped="needs CUDA (dry run)"))
        return
    import gpu_offload_overlap as overlap  # benchmarks/gpu_offload_overlap.py

    def correctness(sub: Sub) -> None:
        sub.out.update(overlap.correctness())  # r = 0.5 / 1.0 and 1.0 / 0.25 on two micro-batches
        sub.out["ok"] = bool(sub.out["bit_identical"] or not sub.out["baseline_deterministic"])

    def model(sub: Sub) -> None:
        for row in overlap.model_sweep("1b", 4, list(sizes.offload_lengths), [0.0, 0.25, 0.5, 1.0]):
            sub.append("rows", row)

    section.run("correctness", correctness)
    section.run("raw_overlap", lambda sub: sub.out.update(overlap.raw_overlap()))
    section.run("model", model)


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
    q, k, v, dout = _random(
        [(tokens, h, d), (tokens, hkv, d), (tokens, hkv, d), (tokens, h, d)], device, dtype, 2
    )
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


def flash_attn_section(report: Report, device: torch.device, sizes: Sizes) -> None:
    from lightning_bytescale.packed_attention.cuda_kernels import flash_attn_status

    section = report.section("flash_attn")
    status = flash_attn_status()
    installed = not isinstance(status, str)
    if device.type != "cuda":
        # the comparison code on the CPU kernels, so a dry run exercises it
        def dry(sub: Sub) -> None:
            sub.out["skipped"] = "flash-attn not installed" if not installed else "needs CUDA (dry run)"
            sub.out["dry_run_kernels"] = _kernel_block(device, torch.float32, ["cpu", "math"], 96, (4, 2, 16))

        section.run("block", dry)
        return
    if not installed:
        section.run("block", lambda sub: sub.out.update(skipped="flash-attn not installed", reason=status))
        return
    import flash_attn

    def block(sub: Sub) -> None:
        sub.out["version"] = getattr(flash_attn, "__version__", "?")
        sub.out["rows"] = _kernel_block(
            device, torch.bfloat16, ["flash_attn", "flash", "efficient"], 8192, sizes.speed_heads
        )
        sub.out["ok"] = all(r["rel_err_vs_math"] <= TOLERANCE["bfloat16"] for r in sub.out["rows"])

    def ring(sub: Sub) -> None:
        for name in ("flash_attn", "flash"):
            sub.append("rings", _ring_speed(device, sizes, 4, torch.bfloat16, impl=name))

    section.run("block", block)
    section.run("ring", ring)


# ----------------------------------------------------------------------------- main
SECTIONS: dict[str, Callable[[Report, torch.device, Sizes], None]] = {
    "kernels": kernels_section,
    "ring": ring_section,
    "host_syncs": host_syncs_section,
    "trainer": trainer_section,
    "mesh": mesh_section,
    "ranks": ranks_section,
    "tensor_parallel": tensor_parallel_section,
    "layouts": layouts_section,
    "ulysses": ulysses_section,
    "offload": offload_section,
    "flash_attn": flash_attn_section,
}


def default_budget(dry_run: bool, only: list[str] | None = None) -> float:
    """The sum of :data:`SECTION_BUDGET_S` over the sections that run here (the 2+ GPU ones skip on one GPU).

    A section that judges the ranks' jobs (:data:`SECTION_JOBS`) starts them itself when ``ranks``
    is not selected, so their share counts too.
    """
    names = [s for s in SECTIONS if not only or s in only]
    if "ranks" not in names and any(s in SECTION_JOBS for s in names):
        names.append("ranks")
    if not dry_run and torch.cuda.device_count() < 2:
        names = [s for s in names if s not in MULTI_GPU_SECTIONS]
    return float(sum(SECTION_BUDGET_S[s] for s in names))


def run(dry_run: bool, out: Path, only: list[str] | None = None, budget_s: float | None = None) -> Report:
    """Run the sections in order; the JSON is rewritten after every subsection."""
    device = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
    sizes = DRY if dry_run else GPU
    if budget_s is None:
        budget_s = default_budget(dry_run, only)
    import lightning_bytescale

    header = {
        "dry_run": dry_run,
        "device": "cpu" if dry_run else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "package": str(Path(lightning_bytescale.__file__).resolve().parent),
        "sizes": asdict(sizes),
        "budget_s": budget_s,
        "section_budget_s": SECTION_BUDGET_S,
    }
    report = Report(out, header, budget_s, only)
    for name, section in SECTIONS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            section(report, device, sizes)
        except Exception as err:  # a section's own set-up failed: recorded, the next section runs
            report.data.setdefault(name, {}).update(
                ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()
            )
            report.data[name]["seconds"] = time.perf_counter() - t0
            report.save()
            print(f"[gpu_check] {name}: ok=False ({type(err).__name__}: {err})", flush=True)
        if report.data.get(name, {}).get("over_budget"):
            print(f"[gpu_check] {name} took {report.data[name]['seconds']:.0f} s, over its share of "
                  f"{SECTION_BUDGET_S[name]} s (SECTION_BUDGET_S)", flush=True)  # fmt: skip
    report.data["ok"] = not report.failed()
    report.save()
    return report


def _package_problem() -> str | None:
    try:
        import lightning_bytescale  # noqa: F401
        from lightning_bytescale import ByteScaleStrategy  # noqa: F401
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: every section but CUDA")
    ap.add_argument(
        "--only", default="", help=f"comma-separated sections to run (default: all of {', '.join(SECTIONS)})"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip (and fail) subsections that would start after this many seconds (default: the sum of "
        "SECTION_BUDGET_S over the sections that run here; 335 s on one GPU)",
    )
    args = ap.parse_args(argv)
    problem = _package_problem()
    if problem is not None:
        print(
            f"gpu_check: cannot import lightning_bytescale from {ROOT} ({problem}); run it from a checkout "
            "with the dependencies docs/install.md lists",
            file=sys.stderr,
        )
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)
    report = run(args.dry_run, args.out, [s for s in args.only.split(",") if s] or None, args.budget_s)
    failed = report.failed()
    print(
        f"[gpu_check] wrote {args.out} in {report.elapsed():.1f} s; "
        + (f"FAILED: {failed}" if failed else "all passed")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
