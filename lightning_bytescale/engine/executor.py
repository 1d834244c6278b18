"""The one HDP step loop: this rank's micro-batches, then one all-reduce; used by tests and the strategy.

First every rank of the group starts a tiny all-gather of the plan digest and step
(:func:`check_step`, :func:`~lightning_bytescale.engine.step_checks.start_plan_agreement`);
it is checked where the step first depends on it -- before this rank's first ring
micro-batch, before its gradient buckets can launch, at the latest after its loop -- so ranks
that planned differently stop together before any ring exchange, while the round trip runs
behind the local micro-batches; a step planned for another number of ranks is refused too.
Then each rank runs forward and backward on *its own*
micro-batches (:func:`run_micro_batches`; their number differs between ranks), accumulating
gradients locally, with no barrier between micro-batches; ring micro-batches synchronise only
the members of their ring, through attention's P2P calls.  Then every rank -- also one with
no micro-batch at all -- joins exactly one all-reduce (sum, :func:`sync_step`) of all
gradients, flattened into one buffer that also carries the step's scalars: the loss sum, the
exact loss-token count, per-rank reports (busy time, ring traffic, the first non-finite
micro-batch), stop requests, the verdict of the loss-normalisation probe, the attention check's
counts (:mod:`~lightning_bytescale.engine.attention_check`) and, every few
steps, parameter fingerprints.  Because every micro-batch's loss is already divided by the
global token count (:func:`~lightning_bytescale.engine.loss.token_loss`), that sum is the
gradient of the global token-mean loss.  With the bucketed sync (the strategy's default,
:mod:`~lightning_bytescale.engine.grad_sync`) the gradients are summed in buckets launched
during or right after the last backward, and the scalars in one float64 all-reduce after
them, on every backend alike: every rank issues the plan check first, then its ring
transfers, then the buckets, then the scalars (the cross-communicator rule, docs/engine.md).

:func:`run_step` composes the three.  ``ByteScaleStrategy`` calls the same
:func:`run_micro_batches` (with the precision plugin's backward as ``backward``) in its
``training_step`` and :func:`sync_step` before the optimizer step, so the float64
equivalence tests of this module cover the path a ``Trainer`` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_bytescale.engine import fingerprint as fp
from lightning_bytescale.engine.attention_check import AttentionVerdict, check_attention
from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.engine.comm_device import HOST, comm_device
from lightning_bytescale.engine.finite import all_finite
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.loss import IGNORE_INDEX, token_loss
from lightning_bytescale.engine.loss_check import LossScaling, is_probe_candidate, probe_forward, verdict
from lightning_bytescale.engine.results import LocalResult, MicroBatchResult, StepResult
from lightning_bytescale.engine.runner import (
    DEFAULT_CHECKS,
    DEFAULT_COMPUTE,
    FLAT_SYNC,
    BackwardFn,
    Compute,
    ContextFactory,
    ForwardFn,
    InFlight,
    NamedParams,
    PhaseFn,
    SyncOptions,
    trained,
)
from lightning_bytescale.engine.step_checks import (
    SLOT,
    PlanAgreement,
    RankReport,
    StepChecks,
    describe_non_finite,
    start_plan_agreement,
)
from lightning_bytescale.engine.zero import drop_unowned_gradients, reduce_gradients_to_owners
from lightning_bytescale.errors import (
    ConfigError,
    LossNormalizationError,
    NonFiniteError,
    ParameterDivergenceError,
    PlanDivergenceError,
    PlanWorldSizeError,
)


def default_forward(model: nn.Module, mb: PackedMicroBatch) -> torch.Tensor:
    """``model(input_ids, position_ids) -> logits [T, V]``, then the global-token-normalised loss."""
    logits = model(mb.input_ids, mb.position_ids)
    return token_loss(logits, mb.labels, mb.num_global_tokens)


def move_micro_batch(mb: PackedMicroBatch, device: torch.device | str) -> PackedMicroBatch:
    """A copy of ``mb`` with its tensors on ``device``; the layout is host metadata and stays."""
    device = torch.device(device)
    if mb.input_ids.device == device:
        return mb
    return dataclasses.replace(
        mb,
        input_ids=mb.input_ids.to(device, non_blocking=True),
        labels=mb.labels.to(device, non_blocking=True),
        position_ids=mb.position_ids.to(device, non_blocking=True),
    )


def describe_micro_batch(mb: PackedMicroBatch, step: int | None = None) -> str:
    """Where a rank is, for watchdogs and error messages: micro-batch, step, ring, sequences."""
    where = f"micro-batch {mb.index}" + (f" of step {step}" if step is not None else "")
    if mb.layout.ring is not None:
        where += f" (ring {list(mb.layout.ring)}, sequences {list(mb.seq_ids)})"
    return where


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
    probe: list[LossScaling] | None = None,
    forward_only: bool = False,
    attention: AttentionVerdict | None = None,
) -> tuple[torch.Tensor, float]:
    """Forward and backward (none with ``forward_only``) of one micro-batch inside its attention layout.

    Returns the detached loss contribution and the wall time.  ``micro_batch_context(mb)``
    (e.g. activation offload) wraps forward and backward, outside the attention context.
    ``p2p_group`` is the group ring attention sends on (default: the global group; ring peers
    are always global ranks).  When ``probe`` is a list, the loss-normalisation probe
    (:mod:`~lightning_bytescale.engine.loss_check`) runs first and its verdict is appended.
    With ``attention`` the forward's packed attention calls are counted into it
    (:mod:`~lightning_bytescale.engine.attention_check`).
    """
    from lightning_bytescale.packed_attention import attention_context, count_attention_calls

    forward = forward or default_forward
    outer = micro_batch_context(mb) if micro_batch_context is not None else contextlib.nullcontext()
    device = mb.input_ids.device
    if sync_timing:
        _sync(device)
    start = time.perf_counter()
    with outer, attention_context(mb.layout, group=p2p_group):
        probed = probe_forward(lambda x: forward(model, x), mb) if probe is not None else None
        counting = count_attention_calls() if attention is not None else contextlib.nullcontext()
        with counting as counted:
            loss = forward(model, mb)
        if attention is not None:
            attention.add(mb, counted.calls)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(
                f"forward must return a scalar loss tensor (token_loss(logits, mb.labels, "
                f"mb.num_global_tokens)), got {shape}"
            )
        if probe is not None and probed is not None:
            probe.append(verdict(float(loss.detach()), float(probed)))
        if forward_only:
            pass
        elif backward is None:
            loss.backward()
        else:
            backward(loss)
    if sync_timing:
        _sync(device)
    return loss.detach(), time.perf_counter() - start


def _device_events(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    """A start/end event pair to time a micro-batch on a CUDA device without a host sync."""
    if device.type != "cuda":
        return None
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _grads_finite(params: Sequence[nn.Parameter]) -> torch.Tensor | None:
    """A 0-d bool on the device: every ``.grad`` is finite (:func:`~lightning_bytescale.engine.finite.all_finite`)."""
    return all_finite([p.grad for p in params if p.grad is not None])


def _comm_counters() -> tuple[float, float]:
    """``(bytes sent, seconds blocked waiting)`` of this process's ring exchanges so far."""
    from lightning_bytescale.packed_attention import comm_stats

    stats = comm_stats()
    return float(stats.get("bytes_sent", 0.0)), float(stats.get("wait_s", 0.0))


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
    check_loss_scaling: bool = False,
    on_phase: PhaseFn | None = None,
    step: int | None = None,
    grad_sync: BucketedGradSync | None = None,
    plan_check: StepCheck | None = None,
    locate_non_finite: bool = False,
    forward_only: bool = False,
    check_attention: bool = False,
) -> LocalResult:
    """This rank's micro-batches in order, gradients accumulating locally, no barriers.

    ``forward_only`` (evaluation and prediction): the same loop without any backward, gradient
    check or gradient sync; ``forward`` still returns a 0-d tensor per micro-batch.

    Losses and token counts stay on the device until the loop ends (one host sync per step,
    not one per micro-batch), so the host can queue the next micro-batch's work early.
    ``check_finite`` also checks the accumulated gradients of ``params`` (default: the model's)
    once, after the last micro-batch (one pass over them, see :func:`_grads_finite`; with
    ``grad_sync`` one pass over each bucket's flat buffer, which the gradients are views of).
    A NaN or inf stays in an accumulated sum, so that one check sees every micro-batch's; with
    ``locate_non_finite`` the check runs after every micro-batch instead (one pass each), so
    the micro-batch that first made them non-finite is known
    (:attr:`LocalResult.first_non_finite_gradient`).  Each micro-batch's loss is checked in
    both cases (it is read anyway).  ``check_loss_scaling`` probes the first
    micro-batch without a ring whose loss is not zero (:mod:`~lightning_bytescale.engine.loss_check`;
    one extra forward without gradients and one host sync to read both losses) and records the
    verdict in :attr:`LocalResult.loss_scaling`.  ``check_attention`` counts the packed attention
    calls of every micro-batch's forward (host integers, no synchronisation) into
    :attr:`LocalResult.attention` (:mod:`~lightning_bytescale.engine.attention_check`).  ``sync_timing`` measures each micro-batch's
    device time: with CUDA events on a GPU (no host synchronisation inside the loop), with
    synchronised wall time elsewhere.  ``on_phase(text)`` is called before each micro-batch
    with where the rank is (for a watchdog and error messages).  ``grad_sync`` points the
    gradients at its buckets before the first micro-batch; the last micro-batch's backward
    (after the plan check) launches the buckets as they become final when it exchanges nothing
    point-to-point (a local micro-batch), and every bucket not launched yet is launched right
    after it returns -- all of them after a ring's backward, so every ring transfer of the step
    is issued before any bucket collective (docs/engine.md, the cross-communicator rule).  Call
    :func:`sync_step` with the same ``grad_sync`` afterwards.

    ``plan_check`` (from :func:`check_step` with ``wait=False``) is waited for -- and raises on
    every rank if the ranks' plans or data differ -- before the first micro-batch with a ring
    (its point-to-point transfers), before the backward of the last micro-batch when
    ``grad_sync`` is given (it launches gradient all-reduces), and at the latest after the
    loop: no P2P transfer or gradient collective of this rank runs on a divergent plan, and the
    check's round trip overlaps the local micro-batches before that point.
    """
    compute = Compute(
        forward=forward, backward=backward, micro_batch_context=micro_batch_context, sync_timing=sync_timing,
        p2p_group=p2p_group, on_phase=on_phase, forward_only=forward_only,
    )  # fmt: skip
    checks = StepChecks(
        finite_gradients=check_finite, loss_scaling=check_loss_scaling, locate_non_finite=locate_non_finite,
        attention=check_attention,
    )  # fmt: skip
    return micro_batch_loop(model, micro_batches, step, compute, checks, grad_sync, plan_check, params)


def micro_batch_loop(
    model: nn.Module,
    micro_batches: Sequence[PackedMicroBatch],
    step: int | None,
    compute: Compute,
    checks: StepChecks,
    grad_sync: BucketedGradSync | None,
    plan_check: StepCheck | None,
    params: Iterable[nn.Parameter] | None,
) -> LocalResult:
    """:func:`run_micro_batches` with its inputs as records: how a micro-batch runs, what the step checks.

    The runners call this; :func:`run_micro_batches` says what each part does (``step``: the
    step's number, for phases; ``params``: the parameters whose gradients are checked).
    """
    forward, backward, on_phase = compute.forward, compute.backward, compute.on_phase
    forward_only, check_finite = compute.forward_only, checks.finite_gradients
    check_loss_scaling, locate_non_finite = checks.loss_scaling, checks.locate_non_finite
    if forward_only and (grad_sync is not None or check_loss_scaling):
        raise ConfigError("forward_only runs no backward: pass neither grad_sync nor check_loss_scaling")
    checked = [p for p in (model.parameters() if params is None else params) if p.requires_grad]

    def confirm_plan() -> None:
        if plan_check is not None and not plan_check.done:
            if on_phase is not None:
                on_phase(f"the plan digest check of step {step} (waits on every rank)")
            plan_check.wait()

    def last_backward(loss: torch.Tensor, *, exchanges: bool) -> None:
        """The step's last backward on this rank; the gradient buckets launch in it or right after.

        The cross-communicator rule (docs/engine.md): hooks launch buckets only in a backward
        without ring exchanges (``exchanges``); after one with them every bucket is launched
        once it has returned, so every ring transfer of the step is issued before any bucket.
        """
        assert grad_sync is not None
        confirm_plan()  # this backward launches the gradient buckets: the plan must agree first
        grad_sync.track_finite = check_finite
        if not exchanges:
            grad_sync.arm()
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        grad_sync.launch()  # every gradient is final: the buckets not launched yet go now

    losses: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    seconds: list[float] = []
    finite: list[torch.Tensor] = []  # gradient checks, after the micro-batches at finite_at
    finite_at: list[int] = []
    verdicts: list[LossScaling] = []
    attention = AttentionVerdict() if checks.attention else None
    timers: list[tuple[int, tuple[torch.cuda.Event, torch.cuda.Event]]] = []
    sent0, wait0 = _comm_counters()
    if grad_sync is not None:
        grad_sync.prepare()  # gradients accumulate into the sync's buckets
    for position, mb in enumerate(micro_batches):
        last = position == len(micro_batches) - 1
        if mb.layout.ring is not None:
            confirm_plan()  # before this micro-batch's point-to-point transfers
        if on_phase is not None:
            on_phase(describe_micro_batch(mb, step))
        probing = check_loss_scaling and (
            mb.probe_ring  # every member of this ring probes it: their exchanges must match
            or (is_probe_candidate(mb) and all(v == LossScaling.UNCHECKED for v in verdicts))
        )
        events = _device_events(mb.input_ids.device) if compute.sync_timing else None
        if events is not None:
            events[0].record()
        loss, sec = run_micro_batch(
            model,
            mb,
            forward=forward,
            backward=(
                functools.partial(last_backward, exchanges=mb.layout.ring is not None)
                if last and grad_sync is not None
                else backward
            ),
            micro_batch_context=compute.micro_batch_context,
            sync_timing=compute.sync_timing and events is None,
            p2p_group=compute.p2p_group,
            probe=verdicts if probing else None,
            forward_only=forward_only,
            attention=attention,
        )
        if events is not None:
            events[1].record()
            timers.append((len(seconds), events))
        losses.append(loss.to(torch.float64))
        loss_dtype = loss.dtype
        counts.append((mb.labels != IGNORE_INDEX).sum())
        seconds.append(sec)
        if check_finite and not forward_only and (last or locate_non_finite):
            # After the last backward, buckets are being summed in place: the sync answers for
            # this rank's own values (recorded at launch), so a non-finite gradient is not blamed
            # on a rank whose buffer another rank's NaN has just reached.
            # With a sync the gradients are views of a few bucket buffers: one pass per buffer.
            flag = grad_sync.local_grads_finite() if grad_sync is not None else _grads_finite(checked)
            finite.append(flag if flag is not None else torch.ones((), dtype=torch.bool, device=loss.device))
            finite_at.append(position)
    confirm_plan()
    sent1, wait1 = _comm_counters()
    scaling = next((v for v in verdicts if v != LossScaling.UNCHECKED), LossScaling.UNCHECKED)
    attention = attention or AttentionVerdict()
    if not losses:
        return LocalResult(
            loss=torch.zeros((), dtype=torch.float64),
            loss_tokens=0,
            loss_scaling=scaling,
            attention=attention,
        )
    loss_values = torch.stack(losses).tolist()  # the loop's one host synchronisation
    token_values = torch.stack(counts).tolist()
    for i, (start, end) in timers:  # device time of each micro-batch, read after that sync
        end.synchronize()
        seconds[i] = start.elapsed_time(end) / 1000.0
    finite_values: list[bool | None] = [None] * len(losses)
    if finite:
        for position, flag in zip(finite_at, torch.stack([f.to(finite[0].device) for f in finite]).tolist()):
            finite_values[position] = bool(flag)
    results = [
        MicroBatchResult(mb.index, lv, int(tv), sec, mb.layout.ring_size, tuple(mb.seq_ids), fv)
        for mb, lv, tv, sec, fv in zip(micro_batches, loss_values, token_values, seconds, finite_values)
    ]
    return LocalResult(
        loss=torch.stack(losses).sum(),
        loss_tokens=int(sum(token_values)),
        micro_batches=results,
        ring_bytes=sent1 - sent0,
        ring_wait_s=wait1 - wait0,
        loss_scaling=scaling,
        loss_dtype=loss_dtype,
        attention=attention,
    )


def _reduce_dtype(params: Sequence[nn.Parameter]) -> torch.dtype:
    if not params:  # only the step's scalars (every gradient reduced elsewhere, e.g. by FSDP2): exact
        return torch.float64
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
        raise ConfigError(
            f"counts cannot be summed exactly in {dtype} over {world} ranks; pass reduce_dtype=torch.float32"
        )
    return min(COUNT_BITS, bits)


def _encode_counts(counts: torch.Tensor, bits: int) -> torch.Tensor:
    c = counts.detach().to("cpu", torch.float64).reshape(-1)
    if c.numel() and (
        bool((c < 0).any()) or bool((c != c.round()).any()) or float(c.max()) >= 2.0**COUNT_BITS
    ):
        raise ConfigError(f"counts must be integers in [0, 2**{COUNT_BITS}), got {c.tolist()[:8]}")
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
    Returns one float64 tensor on the host: ``extra`` summed, then ``counts`` summed (``None``
    when neither was given), read back in one copy.  The buffer is made on the group's device
    (:func:`~lightning_bytescale.engine.comm_device.comm_device`: CUDA for NCCL, the host for
    gloo), whatever device ``extra`` lives on.  Without an initialised process group this is the
    identity (single process).
    """
    params = [p for p in params if p.requires_grad]
    dtype = reduce_dtype or _reduce_dtype(params)
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if initialised else 1
    # the group's device (CUDA for NCCL, the host for gloo); alone, where the gradients are
    device = comm_device(group) if initialised else (params[0].device if params else HOST)
    parts = [
        (
            p.grad.reshape(-1).to(device)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=dtype, device=device)
        )
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
            p.grad = view.to(p.device, p.dtype, copy=True)
        else:
            p.grad.copy_(view)
        offset += n
    if extra is None and counts is None:
        return None
    scalars = flat[offset:].to(HOST, torch.float64)  # one copy back: [extra | count limbs]
    out = [scalars[:n_extra]]
    if counts is not None:
        out.append(_decode_counts(scalars[n_extra:], n_counts, bits))
    return torch.cat(out)


@dataclass
class _PendingScalars:
    """A float64 all-reduce of ``[floats | count limbs]`` in flight; :meth:`wait` decodes it."""

    flat: torch.Tensor
    work: object
    n_floats: int
    n_counts: int
    bits: int

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()  # type: ignore[attr-defined]
            self.work = None  # a finished work still holds the group's native state
        host = self.flat.to(HOST)  # one copy back
        floats = host[: self.n_floats]
        return torch.cat([floats, _decode_counts(host[self.n_floats :], self.n_counts, self.bits)])


def _start_scalars(
    floats: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None
) -> _PendingScalars:
    """Start the step's small all-reduce (sum) of ``floats`` and exact integer ``counts`` in float64.

    The buffer is made on the group's device (:func:`~lightning_bytescale.engine.comm_device.comm_device`).
    """
    world, _ = _group_shape(group)
    bits = _limb_bits(torch.float64, world)
    device = comm_device(group)
    flat = torch.cat(
        [floats.detach().reshape(-1).to(device, torch.float64), _encode_counts(counts, bits).to(device)]
    )
    work = None
    if dist.is_available() and dist.is_initialized():
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _PendingScalars(flat, work, floats.numel(), counts.numel(), bits)


def _group_shape(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


# The step buffer: floats [loss | world x SLOT reports | caller's extra], then exact integer
# counts [loss tokens | stop requests | probe verdicts (3) | attention-check counts (4) | has-grad per parameter |
# (fingerprint per parameter | model fingerprint per rank)].
COUNT_HEAD = 9  # loss tokens, stop flag, 3 loss-probe verdicts, 4 attention-check counts


def _fingerprint_counts(params: Sequence[nn.Parameter], world: int, rank: int) -> torch.Tensor:
    mine = fp.fingerprints(list(params))
    per_rank = torch.zeros(world, dtype=torch.int64)
    per_rank[rank] = fp.combine(mine)
    return torch.cat([mine, per_rank])


def _check_fingerprints(
    reduced: torch.Tensor, mine: torch.Tensor, names: Sequence[str], world: int, step: int
) -> None:
    """Raise :class:`ParameterDivergenceError` unless every rank holds the same parameters."""
    n = len(names)
    sums = reduced[:n].to(torch.int64)
    per_rank = [int(x) for x in reduced[n:].tolist()]
    differing = [names[i] for i in range(n) if int(sums[i]) != world * int(mine[i])]
    if not differing and len(set(per_rank)) == 1:
        return
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(per_rank):
        groups.setdefault(value, []).append(rank)
    majority = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    odd = sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)
    shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
    raise ParameterDivergenceError(
        f"The ranks hold different parameters before the optimizer step of step {step}: ranks {odd} differ "
        f"from ranks {majority}; first parameters that differ: {shown or 'unknown'}. All ranks must train "
        "one model: ByteScaleStrategy broadcasts rank 0's parameters at set-up, so this means a model or "
        "state changed on some ranks only afterwards (a checkpoint loaded on one node, a callback that edits "
        "weights per rank, a non-deterministic optimizer). Find what changed those parameters, then resume "
        "from a checkpoint."
    )


def _check_loss_scaling(verdicts: dict[LossScaling, int], step: int) -> None:
    if verdicts.get(LossScaling.PER_MICRO_BATCH, 0):
        raise LossNormalizationError(
            f"training_step returns a loss that does not depend on mb.num_global_tokens (checked at step "
            f"{step} on {verdicts[LossScaling.PER_MICRO_BATCH]} rank(s) by running one micro-batch again with "
            "num_global_tokens doubled: the loss stayed the same). That is a per-micro-batch mean, such as "
            "F.cross_entropy(logits, labels): it weights tokens by their micro-batch's size and trains a different "
            "model than one process on the whole batch. Return mb.loss(logits), i.e. "
            "lightning_bytescale.token_loss(logits, mb.labels, mb.num_global_tokens). If your loss is normalised "
            "another way on purpose, pass ByteScaleStrategy(check_loss_normalization=False)."
        )


def sync_step(
    params: Sequence[nn.Parameter] | Sequence[tuple[str, nn.Parameter]],
    step: StepBatch,
    local: LocalResult,
    *,
    group: dist.ProcessGroup | None = None,
    extra: torch.Tensor | None = None,
    check_tokens: bool = True,
    check_finite: bool = True,
    check_parameters: bool = False,
    stop_request: bool = False,
    grad_sync: BucketedGradSync | None = None,
    owners: Mapping[int, int] | None = None,
) -> StepResult:
    """The step's all-reduce: gradients, loss, token count, reports, flags; then the checks.

    ``params`` are the trained parameters (or ``(name, parameter)`` pairs, so errors can name
    them), identical in order on every rank.  Afterwards every ``p.grad`` holds the sum over
    ranks; a parameter that no rank produced a gradient for is left with ``grad = None``, as in
    a single process.  Raises on every rank together:

    * :class:`PlanDivergenceError` when the ranks' loss tokens do not add up to
      ``step.num_global_tokens`` (``check_tokens``: ranks ran different plans or lost tokens);
    * :class:`ParameterDivergenceError` when ``check_parameters`` and the ranks' parameter
      fingerprints differ (naming the ranks and the first parameters);
    * :class:`LossNormalizationError` when a rank's loss-normalisation probe found a
      per-micro-batch mean;
    * :class:`~lightning_bytescale.errors.MissingPackedAttentionError` when a micro-batch's
      forward made no packed attention call on some rank (the attention check's counts);
    * :class:`NonFiniteError` when ``check_finite`` and a loss or gradient was not finite
      (naming ranks, micro-batches and sequences).

    ``stop_request`` (this rank wants to stop at this step boundary, e.g. after SIGTERM) is
    OR-ed over ranks into :attr:`StepResult.stop_requested`.  ``check_parameters`` must be the
    same on every rank (it changes the buffer's size).

    Without ``grad_sync`` everything is ONE all-reduce of one flat buffer (every gradient copied
    into it).  With a :class:`~lightning_bytescale.engine.grad_sync.BucketedGradSync` (armed by
    :func:`run_micro_batches`), the gradients were summed in buckets overlapped with the last
    backward (this launches any left and waits), and the scalars travel in one small float64
    all-reduce on ``group`` once the buckets are done -- one order on every rank and every
    backend, the last of the step's communication, and never two communicators at once (the
    cross-communicator rule of docs/engine.md).  On NCCL waiting for the buckets is a stream
    wait, so the host does not block before it issues the scalars.

    ``owners`` (ZeRO-2 without buckets, ``id(parameter) -> global rank``; a bucketed sync has
    its own): each gradient is reduced to its owner instead
    (:func:`~lightning_bytescale.engine.zero.reduce_gradients_to_owners`, one reduce per owner)
    and the other ranks drop it; then the scalars travel in the small float64 all-reduce.
    """
    named = [(item if isinstance(item, tuple) else (f"param{i}", item)) for i, item in enumerate(params)]
    named = [(n, p) for n, p in named if p.requires_grad]
    plist = [p for _, p in named]
    world, me = _group_shape(group)
    reports = torch.zeros(world, SLOT, dtype=torch.float64)
    reports[me] = torch.tensor(local.report().encode(), dtype=torch.float64)
    device = comm_device(group)  # where the step's scalars travel (the loss stays on its device until then)
    floats = [local.loss.detach().to(device, torch.float64).reshape(1), reports.reshape(-1).to(device)]
    if extra is not None:
        floats.append(extra.detach().to(device, torch.float64).reshape(-1))
    head = torch.zeros(COUNT_HEAD, dtype=torch.int64)
    head[0] = local.loss_tokens
    head[1] = int(bool(stop_request))
    if local.loss_scaling != LossScaling.UNCHECKED:
        head[1 + int(local.loss_scaling)] = 1
    head[5:9] = torch.tensor(local.attention.as_counts(), dtype=torch.int64)
    produced = grad_sync.produced if grad_sync is not None else (lambda p: p.grad is not None)
    has_grad = torch.tensor([produced(p) for p in plist], dtype=torch.int64)
    counts = [head, has_grad]
    mine = None
    if check_parameters:
        mine = _fingerprint_counts(plist, world, me)
        counts.append(mine)
    t0 = time.perf_counter()
    if grad_sync is not None and owners is not None:
        raise ConfigError(
            "sync_step got both grad_sync and owners: a bucketed sync reduces to its own owners "
            "(BucketedGradSync(..., owners=...)); pass owners to sync_step only without grad_sync"
        )
    if grad_sync is None and owners is None:
        reduced = allreduce_gradients(plist, group=group, extra=torch.cat(floats), counts=torch.cat(counts))
    elif grad_sync is None:
        reduce_gradients_to_owners(plist, owners, group=group)  # ZeRO-2: the gradients, then the scalars
        reduced = _start_scalars(torch.cat(floats), torch.cat(counts), group).wait()
    else:
        # One order on every rank and every backend: the buckets not launched yet (all of them
        # on a rank without micro-batches), their completion, then the scalars.
        grad_sync.finish()
        reduced = _start_scalars(torch.cat(floats), torch.cat(counts), group).wait()
    allreduce_s = time.perf_counter() - t0
    assert reduced is not None
    n_float = 1 + world * SLOT + (0 if extra is None else extra.numel())
    ints = reduced[n_float:].to(torch.int64)
    for p, count in zip(plist, ints[COUNT_HEAD : COUNT_HEAD + len(plist)].tolist()):
        if count == 0:  # no rank produced a gradient: leave it None, as a single process would
            p.grad = None
    tokens = int(ints[0])
    if check_tokens and tokens != step.num_global_tokens:
        raise PlanDivergenceError(
            f"the ranks' micro-batches hold {tokens} loss tokens at step {step.step} but the global batch has "
            f"{step.num_global_tokens}: the ranks ran different plans or a token was dropped. Check that every "
            "rank uses the same data, seed and planner options (compare the plan digests)."
        )
    if mine is not None:
        start = COUNT_HEAD + len(plist)
        _check_fingerprints(ints[start:].double(), mine, [n for n, _ in named], world, step.step)
    verdicts = {LossScaling(k): int(ints[1 + k]) for k in (1, 2, 3)}
    _check_loss_scaling(verdicts, step.step)
    attention = AttentionVerdict(*(int(x) for x in ints[5:9].tolist()))
    check_attention(attention, step.step)
    rank_reports = [
        RankReport.decode(row) for row in reduced[1 : 1 + world * SLOT].reshape(world, SLOT).tolist()
    ]
    if check_finite and (
        any(r.bad_micro_batch is not None for r in rank_reports) or not math.isfinite(float(reduced[0]))
    ):
        raise NonFiniteError(describe_non_finite(rank_reports, step.step))
    loss_tensor = reduced[0].clone()
    return StepResult(
        loss=float(loss_tensor),
        loss_tensor=loss_tensor,
        local=local,
        reports=rank_reports,
        extra=None if extra is None else reduced[1 + world * SLOT : n_float].clone(),
        stop_requested=bool(int(ints[1])),
        loss_scaling=verdicts,
        allreduce_s=allreduce_s,
        attention=attention,
    )


@dataclass
class StepCheck:
    """The pre-P2P checks of one step, started by :func:`check_step` (``wait=False``).

    :meth:`wait` waits for the plan-key all-gather (if one was started), raises on every rank
    if the ranks disagree, then refuses a step planned for another number of ranks.  It is
    idempotent; ``done`` says whether it has run.
    """

    agreement: PlanAgreement | None
    planned: int | None
    world: int
    done: bool = False

    def wait(self) -> None:
        self.done = True
        if self.agreement is not None:
            self.agreement.wait()
        if self.planned is not None and int(self.planned) != self.world:
            raise PlanWorldSizeError(
                f"this step was planned for {self.planned} ranks but the process group has {self.world}; "
                "plan with world_size=dist.get_world_size(group)"
            )


def check_step(
    step: StepBatch,
    group: dist.ProcessGroup | None = None,
    *,
    check_plan: bool = True,
    wait: bool = True,
) -> StepCheck:
    """Before any P2P: the ranks agree on the plan and data, and it was made for this world.

    ``check_plan`` all-gathers ``(step.digest, step.step, planned world, step.data_identity)``
    over ``group`` and raises :class:`PlanDivergenceError` (or :class:`PlanWorldSizeError`) on
    every rank together, before any ring exchange.  Without it, or without a process group, a
    step whose ``stats["world_size"]`` differs from the group's size is still refused.

    Every rank must call it at the same point (the all-gather is a collective).  With ``wait``
    (default) it checks at once.  ``wait=False`` only starts the all-gather and returns the
    :class:`StepCheck` to pass to :func:`run_micro_batches` (``plan_check``), which waits for
    it right before this rank's first P2P transfer or gradient collective of the step, so the
    round trip overlaps the local micro-batches before that point.
    """
    world, _ = _group_shape(group)
    stats = step.stats if isinstance(step.stats, dict) else {}
    planned = stats.get("world_size") or len(stats.get("micro_batch_counts", ())) or None
    agreement = None
    if check_plan and dist.is_available() and dist.is_initialized():
        agreement = start_plan_agreement(
            step.digest,
            step.step,
            world,
            plan_world=planned,
            group=group,
            data_identity=getattr(step, "data_identity", "") or "",
            async_op=not wait,
        )
    check = StepCheck(agreement, planned, world)
    if wait or agreement is None:  # without a collective in flight there is nothing to overlap
        check.wait()
    return check


class HDPRunner:
    """Plain HDP's step runner: every rank is one HDP rank of ``group`` (``None``: the default group, the world).

    :meth:`run` starts the plan check (:func:`check_step`, waited for before the first ring
    exchange or gradient bucket), runs this rank's micro-batches (:func:`run_micro_batches`)
    and leaves the gradients on the parameters; :meth:`sync` is :func:`sync_step` over
    ``group``, once (a second call returns the first result).  ``sync`` (:class:`SyncOptions`):
    the bucketed sync for the trained parameters (``buckets``), ZeRO-2's owners for the flat sync
    (every gradient all-reduced, then each rank keeps the ones it owns), and the stop request the
    sync carries.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, sync: SyncOptions = FLAT_SYNC) -> None:
        self.group, self.options = group, sync

    def run(
        self,
        model: nn.Module,
        batch: StepBatch,
        *,
        compute: Compute = DEFAULT_COMPUTE,
        checks: StepChecks = DEFAULT_CHECKS,
        params: NamedParams | None = None,
    ) -> InFlight:
        """The plan check started, then this rank's micro-batches, forward and backward."""
        named = trained(model, params)
        compute.waits(f"the plan digest check of step {batch.step}")
        plan_check = check_step(batch, self.group, check_plan=checks.plan, wait=False)
        grad_sync = self.options.buckets([p for _, p in named if p.requires_grad])
        local = micro_batch_loop(
            model,
            batch.micro_batches,
            batch.step,
            compute,
            checks,
            grad_sync,
            plan_check,
            [p for _, p in named],
        )
        step = InFlight.started(batch, named, local, checks, compute)
        step.grad_sync = grad_sync
        return step

    def sync(self, step: InFlight, *, extra: torch.Tensor | None = None) -> StepResult:
        """The step's one all-reduce (or its buckets and the scalars) and its checks, on every rank."""
        if step.synced:
            return step.result  # type: ignore[return-value]
        checks, batch = step.checks, step.batch
        step.compute.waits(f"the gradient all-reduce of step {batch.step}")
        result = sync_step(
            step.named, batch, step.local, group=self.group, extra=extra, check_tokens=checks.tokens,
            check_finite=checks.finite, check_parameters=checks.parameters, stop_request=self.options.stop(),
            grad_sync=step.grad_sync,
        )  # fmt: skip
        owners = self.options.owners
        if (
            owners is not None and step.grad_sync is None
        ):  # ZeRO-2 after the flat all-reduce: keep what it owns
            drop_unowned_gradients([p for _, p in step.named], owners, dist.get_rank())
        return step.finish(result)

    def evaluate(
        self, model: nn.Module, batch: StepBatch, *, compute: Compute, name: str = "evaluation"
    ) -> LocalResult:
        """The plan check, then ``compute.forward`` on each micro-batch of this rank, no backward."""
        plan_check = check_step(batch, self.group, wait=False)
        return micro_batch_loop(
            model,
            batch.micro_batches,
            batch.step,
            compute,
            StepChecks(finite_gradients=False),
            None,
            plan_check,
            None,
        )

    def close(self) -> None:
        close = getattr(self.options.buckets, "close", None)
        if callable(close):
            close()


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
    check_loss_scaling: bool = False,
    check_parameters: bool = False,
    grad_sync: BucketedGradSync | None = None,
    locate_non_finite: bool = False,
) -> StepResult:
    """:func:`check_step`, :func:`run_micro_batches`, then :func:`sync_step`: one whole HDP step.

    Gradients accumulate into ``p.grad`` (zero them before the step).  See the three functions
    for the checks (plan and data agreement before any P2P; token count, parameter
    fingerprints, loss normalisation and finiteness in the one all-reduce, raised on every
    rank together) and for ``extra`` (the caller's values, summed over ranks).  It is
    :class:`HDPRunner`'s ``run`` then ``sync``.
    """
    named = (
        list(model.named_parameters()) if params is None else [(f"param{i}", p) for i, p in enumerate(params)]
    )
    runner = HDPRunner(group, SyncOptions(buckets=lambda _params: grad_sync))
    compute = Compute(
        forward=forward, backward=backward, micro_batch_context=micro_batch_context, sync_timing=sync_timing,
        p2p_group=p2p_group,
    )  # fmt: skip
    checks = StepChecks.of_flags(
        check_plan, check_tokens, check_finite, locate_non_finite, check_loss_scaling, check_parameters
    )
    return runner.sync(runner.run(model, step, compute=compute, checks=checks, params=named), extra=extra)
