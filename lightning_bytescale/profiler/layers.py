"""One transformer layer at one sequence length, ready to time and already counted.

The layer runs alone on inputs captured from a real forward of the whole model (a forward
pre-hook on the first block), so whatever arguments it takes (positions, rotary tables, masks)
are real; the bytes each layer saves for backward are counted in that forward through the
offloader's ``saved_tensors_hooks`` at ratio 0.  :func:`time_rounds` then times the lengths in
interleaved rounds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_bytescale.offload.offloader import OUTSIDE, ActivationOffloader
from lightning_bytescale.packed_attention.context import attention_context
from lightning_bytescale.packed_attention.layout import AttentionLayout
from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.timing import synchronize


def _layout(s: int) -> AttentionLayout:
    return AttentionLayout(cu_seqlens=(0, s), seq_lens=(s,))


def _model_loss(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids, pos)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _detach_args(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    grads_for: list[torch.Tensor] = []

    def fix(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            y = x.detach()
            if x.requires_grad and x.is_floating_point():
                y.requires_grad_(True)
                grads_for.append(y)
            return y
        return x

    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}, grads_for


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ProfileError(
        f"a layer returned {type(out).__name__}; expected a tensor (or a tuple starting with one)"
    )


@dataclass
class LengthRun:
    """One sequence length, ready to time: the layer alone (forward, forward+backward) and the model."""

    length: int
    layout: AttentionLayout
    forward: Callable[[], None]
    forward_backward: Callable[[], None]
    model_step: Callable[[], None]
    layer_bytes: float
    outside_bytes: float


def prepare_length(
    model: nn.Module, layers: list[nn.Module], s: int, vocab: int, device: torch.device
) -> LengthRun:
    """Length ``s`` of ``model``: one forward of the whole model counts the bytes every layer saves
    and captures ``layers[0]``'s real arguments; the returned runs replay that layer alone."""
    gen = torch.Generator().manual_seed(s)
    ids = torch.randint(0, vocab, (s,), generator=gen).to(device)
    labels = torch.randint(0, vocab, (s,), generator=gen).to(device)
    pos = torch.arange(s, device=device)
    layout = _layout(s)
    captured: dict[str, Any] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if "args" not in captured:
            captured["args"], captured["kwargs"] = args, kwargs

    handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    counter = ActivationOffloader(layers, min_bytes=0)
    try:
        with attention_context(layout), counter.context(0, 0.0) as stats:
            _model_loss(model, ids, pos, labels)
    finally:
        handle.remove()
        counter.remove()
    if "args" not in captured:
        raise ProfileError("the first layer never ran in the model's forward; check the layers you passed")
    per_layer = [b for layer, b in stats.layer_bytes.items() if layer != OUTSIDE]
    args, kwargs, leaves = _detach_args(captured["args"], captured["kwargs"])
    layer = layers[0]
    params = [p for p in layer.parameters() if p.requires_grad]
    with attention_context(layout), torch.no_grad():
        gout = torch.randn_like(_first_tensor(layer(*args, **kwargs)))

    def forward() -> None:
        _first_tensor(layer(*args, **kwargs))

    def forward_backward() -> None:
        out = _first_tensor(layer(*args, **kwargs))
        torch.autograd.backward(out, gout, inputs=leaves + params)

    def model_step() -> None:
        _model_loss(model, ids, pos, labels).backward()

    return LengthRun(
        s,
        layout,
        forward,
        forward_backward,
        model_step,
        statistics.fmean(per_layer) if per_layer else 0.0,
        float(stats.layer_bytes.get(OUTSIDE, 0)),
    )


def time_rounds(
    runners: list[LengthRun],
    what: str,
    device: torch.device,
    warmup: int,
    repeats: int,
    start_together: Callable[[], None] | None = None,
) -> list[float]:
    """Fastest of ``repeats`` runs per length, the lengths interleaved round by round so that a burst
    of load on a shared machine spreads over all lengths instead of bending one point.

    ``start_together`` (a tensor-parallel group's barrier) runs before each timed run, so the
    ranks of a group start each run at once and none counts the others' lag as its own time."""
    best = [math.inf] * len(runners)
    for rnd in range(warmup + repeats):
        for i, r in enumerate(runners):
            fn = getattr(r, what)
            with attention_context(r.layout):
                synchronize(device)
                if start_together is not None:
                    start_together()
                start = time.perf_counter()
                fn()
                synchronize(device)
                took = time.perf_counter() - start
            if rnd >= warmup:
                best[i] = min(best[i], took)
    return best
