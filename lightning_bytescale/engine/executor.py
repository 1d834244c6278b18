"""Run one HDP step on plain ``torch.distributed``: this rank's micro-batches, then one all-reduce.

First every rank of the group joins a tiny all-gather of the plan digest and step
(:func:`~lightning_bytescale.strategy_sync.check_plan_agreement`, the check the strategy makes),
so ranks that planned differently stop together before any ring exchange; a step planned for
another number of ranks is refused too.  Then each rank runs forward and backward on *its own*
micro-batches (their number differs between ranks), accumulating gradients locally, with no
barrier between micro-batches; ring micro-batches synchronise only the members of their ring,
through attention's P2P calls.  Then every rank -- also one with no micro-batch at all --
joins exactly one all-reduce (sum) of all gradients, flattened into one buffer that can also
carry extra scalars (the loss sum, token counts, per-rank busy time, non-finite flags).  Because every micro-batch's loss is already divided by the
global token count (:func:`~lightning_bytescale.engine.loss.token_loss`), that sum is the
gradient of the global token-mean loss.

The pieces are separate so that the Lightning strategy can reuse them:
:func:`run_micro_batch` / :func:`run_micro_batches` for the loop and
:func:`allreduce_gradients` for the synchronisation; :func:`run_step` composes the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.loss import IGNORE_INDEX, token_loss
from lightning_bytescale.strategy_sync import PlanDivergenceError, check_plan_agreement

ForwardFn = Callable[[nn.Module, PackedMicroBatch], torch.Tensor]
BackwardFn = Callable[[torch.Tensor], None]
ContextFactory = Callable[[PackedMicroBatch], AbstractContextManager]


class StepError(RuntimeError):
    """The ranks disagree about a step (e.g. they ran different plans)."""


class DivergentPlanError(StepError, PlanDivergenceError):
    """The ranks hold different plans (digests) for this step; raised on every rank before any P2P."""


class NonFiniteError(FloatingPointError):
    """A loss or gradient of the step is NaN or infinite (raised on every rank together)."""


def default_forward(model: nn.Module, mb: PackedMicroBatch) -> torch.Tensor:
    """``model(input_ids, position_ids) -> logits [T, V]``, then the global-token-normalised loss."""
    logits = model(mb.input_ids, mb.position_ids)
    return token_loss(logits, mb.labels, mb.num_global_tokens)


def move_micro_batch(mb: PackedMicroBatch, device: torch.device | str) -> PackedMicroBatch:
    """A copy of ``mb`` with its tensors (and the layout's ``cu_seqlens``) on ``device``."""
    device = torch.device(device)
    if mb.input_ids.device == device:
        return mb
    layout = dataclasses.replace(mb.layout, cu_seqlens=mb.layout.cu_seqlens.to(device))
    return dataclasses.replace(
        mb,
        input_ids=mb.input_ids.to(device, non_blocking=True),
        labels=mb.labels.to(device, non_blocking=True),
        position_ids=mb.position_ids.to(device, non_blocking=True),
        layout=layout,
    )


@dataclass
class MicroBatchResult:
    index: int
    loss: float  # this micro-batch's contribution to the global loss (already / global tokens)
    loss_tokens: int
    seconds: float
    ring_size: int
    seq_ids: tuple[int, ...] = ()
    grads_finite: bool | None = None  # accumulated gradients finite after it (None: not checked)


@dataclass
class LocalResult:
    """What one rank's micro-batch loop produced, before the all-reduce."""

    loss: torch.Tensor  # 0-d, detached: sum of this rank's loss contributions
    loss_tokens: int
    micro_batches: list[MicroBatchResult] = field(default_factory=list)

    @property
    def busy_seconds(self) -> float:
        return sum(m.seconds for m in self.micro_batches)

    @property
    def first_non_finite_gradient(self) -> MicroBatchResult | None:
        """The micro-batch after which the accumulated gradients first held a NaN or inf."""
        return next((m for m in self.micro_batches if m.grads_finite is False), None)


@dataclass
class StepResult:
    """One step's outcome on one rank (the reduced values are identical on every rank)."""

    loss: float  # global token-mean loss
    loss_tensor: torch.Tensor  # 0-d, the same value
    local: LocalResult  # this rank's own part
    busy_seconds: list[float]  # measured forward+backward time of every rank (index = group rank)
    extra: torch.Tensor | None = None  # the caller's extra values, summed over ranks

    @property
    def num_micro_batches(self) -> int:
        return len(self.local.micro_batches)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_micro_batch(
    model: nn.Module,
    mb: PackedMicroBatch,
    *,
    forward: ForwardFn | None = None,
    backward: BackwardFn | None = None,
    micro_batch_context: ContextFactory | None = None,
    sync_timing: bool = False,
    p2p_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, float]:
    """Forward and backward of one micro-batch inside its attention layout.

    Returns the detached loss contribution and the wall time.  ``micro_batch_context(mb)``
    (e.g. activation offload) wraps forward and backward, outside the attention context.
    ``p2p_group`` is the group ring attention sends on (default: the global group; ring peers
    are always global ranks).
    """
    from lightning_bytescale.attention import attention_context

    forward = forward or default_forward
    outer = micro_batch_context(mb) if micro_batch_context is not None else contextlib.nullcontext()
    device = mb.input_ids.device
    if sync_timing:
        _sync(device)
    start = time.perf_counter()
    with outer, attention_context(mb.layout, group=p2p_group):
        loss = forward(model, mb)
        if loss.dim() != 0:
            raise ValueError(f"forward must return a scalar loss, got shape {tuple(loss.shape)}")
        if backward is None:
            loss.backward()
        else:
            backward(loss)
    if sync_timing:
        _sync(device)
    return loss.detach(), time.perf_counter() - start


def _grads_finite(params: Sequence[nn.Parameter]) -> torch.Tensor | None:
    """A 0-d bool on the device: every ``.grad`` is finite (one max-abs pass; no host sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf))).all()


def run_micro_batches(
    model: nn.Module,
    micro_batches: Sequence[PackedMicroBatch],
    *,
    forward: ForwardFn | None = None,
    backward: BackwardFn | None = None,
    micro_batch_context: ContextFactory | None = None,
    sync_timing: bool = False,
    p2p_group: dist.ProcessGroup | None = None,
    check_finite: bool = False,
    params: Iterable[nn.Parameter] | None = None,
) -> LocalResult:
    """This rank's micro-batches in order, gradients accumulating locally, no barriers.

    Losses and token counts stay on the device until the loop ends (one host sync per step,
    not one per micro-batch), so the host can queue the next micro-batch's work early.
    ``check_finite`` also checks the accumulated gradients of ``params`` (default: the model's)
    after every micro-batch (one max-abs pass over them, kept on the device), so the
    micro-batch that first made them non-finite is known
    (:attr:`LocalResult.first_non_finite_gradient`).
    """
    checked = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
    losses: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    seconds: list[float] = []
    finite: list[torch.Tensor] = []
    for mb in micro_batches:
        loss, sec = run_micro_batch(
            model,
            mb,
            forward=forward,
            backward=backward,
            micro_batch_context=micro_batch_context,
            sync_timing=sync_timing,
            p2p_group=p2p_group,
        )
        losses.append(loss.to(torch.float64))
        counts.append((mb.labels != IGNORE_INDEX).sum())
        seconds.append(sec)
        if check_finite:
            flag = _grads_finite(checked)
            finite.append(flag if flag is not None else torch.ones((), dtype=torch.bool, device=loss.device))
    if not losses:
        return LocalResult(loss=torch.zeros((), dtype=torch.float64), loss_tokens=0)
    loss_values = torch.stack(losses).tolist()
    token_values = torch.stack(counts).tolist()
    finite_values: list[bool | None] = (
        [bool(f) for f in torch.stack([f.to(finite[0].device) for f in finite]).tolist()]
        if finite
        else [None] * len(losses)
    )
    results = [
        MicroBatchResult(mb.index, lv, int(tv), sec, mb.layout.ring_size, tuple(mb.seq_ids), fv)
        for mb, lv, tv, sec, fv in zip(micro_batches, loss_values, token_values, seconds, finite_values)
    ]
    return LocalResult(
        loss=torch.stack(losses).sum(), loss_tokens=int(sum(token_values)), micro_batches=results
    )


def _reduce_dtype(params: Sequence[nn.Parameter]) -> torch.dtype:
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.grad.dtype if p.grad is not None else p.dtype)
    return dtype


COUNT_BITS = 50  # counts must lie in [0, 2**50)


def _limb_bits(dtype: torch.dtype, world: int) -> int:
    """Bits per limb so that ``world`` limbs sum exactly in ``dtype`` (integers below 2**mantissa)."""
    mantissa = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}.get(dtype, 24)
    bits = mantissa - max(1, world - 1).bit_length()
    if bits < 1:
        raise ValueError(
            f"counts cannot be summed exactly in {dtype} over {world} ranks; pass reduce_dtype=torch.float32"
        )
    return min(COUNT_BITS, bits)


def _encode_counts(counts: torch.Tensor, bits: int) -> torch.Tensor:
    c = counts.detach().to("cpu", torch.float64).reshape(-1)
    if c.numel() and (
        bool((c < 0).any()) or bool((c != c.round()).any()) or float(c.max()) >= 2.0**COUNT_BITS
    ):
        raise ValueError(f"counts must be integers in [0, 2**{COUNT_BITS}), got {c.tolist()[:8]}")
    ints = c.to(torch.int64)
    limbs = [(ints >> (bits * i)) & ((1 << bits) - 1) for i in range(-(-COUNT_BITS // bits))]
    return torch.stack(limbs, dim=1).reshape(-1).to(torch.float64)  # [n * num_limbs], limb-minor


def _decode_counts(limbs: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    parts = limbs.to("cpu", torch.float64).round().to(torch.int64).reshape(n, -1)
    weights = torch.tensor([1 << (bits * i) for i in range(parts.shape[1])], dtype=torch.int64)
    return (parts * weights).sum(dim=1).to(torch.float64)


def allreduce_gradients(
    params: Iterable[nn.Parameter],
    group: dist.ProcessGroup | None = None,
    extra: torch.Tensor | None = None,
    *,
    counts: torch.Tensor | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """Sum every gradient (and ``extra``, ``counts``) over all ranks of ``group`` with ONE all-reduce.

    All gradients are flattened into one buffer (``reduce_dtype``; default the widest of the
    gradients' dtypes and float32, so bf16 gradients are summed in float32); a parameter
    without a gradient contributes zeros, so every rank -- also one that ran no micro-batch --
    sends the same shapes.  Afterwards every ``p.grad`` holds the sum.

    ``extra`` (floats: losses, times) is appended in the buffer's dtype.  ``counts`` (integers
    in ``[0, 2**50)``: token counts, flags, ids) are appended as limbs small enough that their
    sum is exact in the buffer's dtype, so they stay exact with float32 gradients too (sums
    must stay below 2**53).
    Returns one float64 tensor: ``extra`` summed, then ``counts`` summed (``None`` when neither
    was given).  Without an initialised process group this is the identity (single process).
    """
    params = [p for p in params if p.requires_grad]
    dtype = reduce_dtype or _reduce_dtype(params)
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if initialised else 1
    device = params[0].device if params else (extra.device if extra is not None else torch.device("cpu"))
    parts = [
        (p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device))
        for p in params
    ]
    n_extra = 0 if extra is None else extra.numel()
    if extra is not None:
        parts.append(extra.detach().reshape(-1).to(device))
    n_counts, bits = 0, 0
    if counts is not None:
        n_counts, bits = counts.numel(), _limb_bits(dtype, world)
        parts.append(_encode_counts(counts, bits).to(device))
    if not parts:
        return None
    flat = torch.cat([t.to(dtype) for t in parts])
    if initialised:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = view.to(p.dtype, copy=True)
        else:
            p.grad.copy_(view)
        offset += n
    if extra is None and counts is None:
        return None
    out = [flat[offset : offset + n_extra].to("cpu", torch.float64)]
    if counts is not None:
        out.append(_decode_counts(flat[offset + n_extra :], n_counts, bits))
    return torch.cat(out)


def _group_shape(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def _local_grads_finite(local: LocalResult, params: Sequence[nn.Parameter]) -> bool:
    """Whether this rank's accumulated gradients are finite (from the micro-batch checks if made)."""
    if local.micro_batches and local.micro_batches[-1].grads_finite is not None:
        return local.micro_batches[-1].grads_finite
    flag = _grads_finite(params)
    return True if flag is None else bool(flag)


def _raise_non_finite(
    local: LocalResult, bad_loss: list[int], bad_grad: list[int], named: Sequence[tuple[str, nn.Parameter]]
) -> None:
    mine = [
        f"non-finite loss in micro-batch {m.index} (sequences {list(m.seq_ids)})"
        for m in local.micro_batches
        if not math.isfinite(m.loss)
    ]
    first = local.first_non_finite_gradient
    if first is not None:
        mine.append(
            f"gradients first non-finite after micro-batch {first.index} (sequences {list(first.seq_ids)})"
        )
    params = [n for n, p in named if p.grad is not None and not bool(torch.isfinite(p.grad).all())][:5]
    raise NonFiniteError(
        f"non-finite values in this step: loss on rank(s) {bad_loss}, local gradients on rank(s) {bad_grad}"
        + (f"; on this rank: {', '.join(mine)}" if mine else "")
        + (f"; reduced gradients of {params}" if params else "")
        + ". Lower the learning rate, use float32/bf16 instead of float16, or inspect those sequences."
    )


def run_step(
    model: nn.Module,
    step: StepBatch,
    *,
    forward: ForwardFn | None = None,
    backward: BackwardFn | None = None,
    group: dist.ProcessGroup | None = None,
    micro_batch_context: ContextFactory | None = None,
    params: Iterable[nn.Parameter] | None = None,
    extra: torch.Tensor | None = None,
    sync_timing: bool = False,
    check_tokens: bool = True,
    check_finite: bool = True,
    p2p_group: dist.ProcessGroup | None = None,
    check_plan: bool = True,
) -> StepResult:
    """Forward+backward on this rank's micro-batches, then one gradient all-reduce.

    Before any micro-batch, ``check_plan`` all-gathers ``(step.digest, step.step)`` over
    ``group`` (two int64 per rank) and raises :class:`DivergentPlanError` on every rank when
    they differ, so no ring exchange starts on mismatched plans (turn it off when the caller
    already made that check, as ``ByteScaleStrategy`` does); then a step whose
    ``stats["world_size"]`` differs from the group's size is refused with :class:`StepError`.

    Gradients accumulate into ``p.grad`` (zero them before the step).  The same all-reduce
    carries the loss, the loss-token count (checked against ``step.num_global_tokens``: this
    catches ranks that ran different plans), every rank's busy time, per-rank non-finite flags
    (``check_finite``: the gradients are checked after every micro-batch, and every rank then
    raises :class:`NonFiniteError` together, naming the ranks, micro-batches and sequences;
    turn it off when a float16 grad scaler handles overflow) and the caller's ``extra`` values.
    """
    named = (
        list(model.named_parameters()) if params is None else [(f"param{i}", p) for i, p in enumerate(params)]
    )
    params = [p for _, p in named]
    world, me = _group_shape(group)
    if check_plan and dist.is_available() and dist.is_initialized():
        try:
            check_plan_agreement(step.digest, step.step, world, group=group)
        except PlanDivergenceError as err:
            raise DivergentPlanError(str(err)) from err
    planned = step.stats.get("world_size") if isinstance(step.stats, dict) else None
    if planned is not None and int(planned) != world:
        raise StepError(
            f"this step was planned for {planned} ranks but the process group has {world}; "
            "plan with world_size=dist.get_world_size(group)"
        )
    local = run_micro_batches(
        model,
        step.micro_batches,
        forward=forward,
        backward=backward,
        micro_batch_context=micro_batch_context,
        sync_timing=sync_timing,
        p2p_group=p2p_group,
        check_finite=check_finite,
        params=params,
    )
    busy = torch.zeros(world, dtype=torch.float64)
    busy[me] = local.busy_seconds
    flags = torch.zeros(2, world, dtype=torch.float64)  # bad loss, bad local gradients
    if check_finite:
        flags[0, me] = float(any(not math.isfinite(m.loss) for m in local.micro_batches))
        flags[1, me] = float(not _local_grads_finite(local, params))
    floats = [local.loss.detach().to("cpu", torch.float64).reshape(1), busy]
    if extra is not None:
        floats.append(extra.detach().to("cpu", torch.float64).reshape(-1))
    n_float = sum(t.numel() for t in floats)
    counts = torch.cat([torch.tensor([float(local.loss_tokens)], dtype=torch.float64), flags.reshape(-1)])
    reduced = allreduce_gradients(params, group=group, extra=torch.cat(floats), counts=counts)
    assert reduced is not None
    tokens = int(reduced[n_float])
    if check_tokens and tokens != step.num_global_tokens:
        raise StepError(
            f"the ranks' micro-batches hold {tokens} loss tokens but the global batch has "
            f"{step.num_global_tokens}; the ranks ran different plans or a token was dropped "
            "(compare the plan digests)"
        )
    flags = reduced[n_float + 1 :].reshape(2, world)
    if check_finite:
        bad_loss = [r for r in range(world) if flags[0, r] != 0]
        bad_grad = [r for r in range(world) if flags[1, r] != 0]
        if bad_loss or bad_grad or not math.isfinite(float(reduced[0])):
            _raise_non_finite(local, bad_loss, bad_grad, named)
    loss_tensor = reduced[0].clone()
    return StepResult(
        loss=float(loss_tensor),
        loss_tensor=loss_tensor,
        local=local,
        busy_seconds=[float(x) for x in reduced[1 : 1 + world]],
        extra=None if extra is None else reduced[1 + world : n_float].clone(),
    )
