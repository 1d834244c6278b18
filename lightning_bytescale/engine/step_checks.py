"""What ranks check about each other in a step: the same plan and data, and what each rank did.

A step makes two collectives on the one global process group: a tiny all-gather of the plan
digest and the data identity, checked *before* any ring exchange (so ranks that planned
differently, or read different data, stop before they can deadlock or train on wrong data),
and one all-reduce (sum, :func:`~lightning_bytescale.engine.executor.sync_step`) of the step's
scalars: the loss sum and, in per-rank slots (:class:`RankReport`), the measured busy time,
ring bytes, time blocked on ring transfers, micro-batch count and any non-finite report.

The all-gather is started asynchronously (:func:`start_plan_agreement`) and checked
(:meth:`PlanAgreement.wait`) only where the step would first depend on it: before this rank's
first ring micro-batch, before its gradient buckets can launch, and at the latest at the end
of its micro-batch loop.  Its round trip thus runs behind the local micro-batches instead of
being a barrier at the start of every step; every rank still sees the same gathered keys, so
all of them raise before any point-to-point transfer or gradient collective on a divergent plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_bytescale.engine.comm_device import comm_device
from lightning_bytescale.errors import PlanDivergenceError, PlanWorldSizeError

# Per-rank slot of the step buffer.
_BUSY, _RING_BYTES, _NUM_MB, _BAD_MB, _BAD_KIND, _RING_WAIT, _BAD_FROM, _SEQS = range(8)
MAX_REPORTED_SEQS = 8
SLOT = _SEQS + MAX_REPORTED_SEQS


def digest_key(digest: str) -> int:
    """A 60-bit integer key of a plan digest string, exactly representable in int64."""
    return int(hashlib.sha256(digest.encode()).hexdigest()[:15], 16)


@dataclass
class PlanAgreement:
    """The plan-key all-gather of one step, in flight; :meth:`wait` checks the gathered keys.

    Made by :func:`start_plan_agreement` on every rank.  :meth:`wait` is idempotent: the first
    call waits for the all-gather and raises on every rank if the keys differ; later calls
    return at once (or raise the same error again).
    """

    step: int
    world_size: int
    data_identity: str
    group: object | None
    gathered: list[torch.Tensor]
    work: Any = None
    done: bool = False
    error: Exception | None = None

    def wait(self) -> None:
        if self.error is not None:
            raise self.error
        if self.done:
            return
        self.done = True
        if self.work is not None:
            self.work.wait()
            self.work = None
        rows = torch.stack(self.gathered).tolist()  # one copy back
        try:
            _judge(rows, self.step, self.world_size, self.group, self.data_identity)
        except Exception as err:
            self.error = err
            raise


def start_plan_agreement(
    digest: str,
    step: int,
    world_size: int,
    plan_world: int | None = None,
    group: object | None = None,
    data_identity: str = "",
    *,
    async_op: bool = True,
) -> PlanAgreement:
    """Start the all-gather of ``(digest, step, plan world size, data identity)``; check it later.

    Every rank of ``group`` must call it at the same point of the step (it is a collective).
    Call :meth:`PlanAgreement.wait` before this rank's first point-to-point exchange or
    gradient collective of the step: see :func:`check_plan_agreement` for what it raises.
    ``async_op=False`` gathers before returning (the check itself still waits for ``wait``).
    """
    device = comm_device(group)  # NCCL gathers device tensors only, gloo host tensors
    data_key = digest_key(data_identity) if data_identity else 0
    mine = torch.tensor(
        [digest_key(digest), int(step), int(plan_world or 0), data_key], dtype=torch.long, device=device
    )
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    if async_op:
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
    else:
        work = None
        dist.all_gather(gathered, mine, group=group)
    return PlanAgreement(int(step), world_size, data_identity, group, gathered, work)


def check_plan_agreement(
    digest: str,
    step: int,
    world_size: int,
    plan_world: int | None = None,
    group: object | None = None,
    data_identity: str = "",
) -> None:
    """All-gather ``(digest, step, plan world size, data identity)``; raise on every rank if they disagree.

    Runs before any point-to-point exchange of the step, on every rank, so all ranks stop
    together (no rank is left waiting in a ring).  Raises :class:`PlanWorldSizeError` if a plan
    was made for another world size, :class:`PlanDivergenceError` naming the ranks that differ
    (and, when ``data_identity`` differs, the data each group of ranks reads).  ``data_identity``
    names what this rank reads (for example a token store's content hash); the step digest
    already covers it when the data module folds it in, the separate key only makes the
    message name the stores.  :func:`start_plan_agreement` is the same check, waited later.
    """
    start_plan_agreement(digest, step, world_size, plan_world, group, data_identity, async_op=False).wait()


def _judge(
    rows: list[list[int]], step: int, world_size: int, group: object | None, data_identity: str
) -> None:
    """Raise on every rank unless the gathered ``rows`` agree (they are the same on every rank)."""
    worlds = [row[2] for row in rows]
    wrong = [r for r, w in enumerate(worlds) if w and w != world_size]
    if wrong:
        raise PlanWorldSizeError(
            f"Ranks {wrong} hold plans made for {sorted({worlds[r] for r in wrong})} ranks, but the run has "
            f"{world_size}. The data module must plan with the trainer's world size (ByteScaleDataModule reads "
            "it from the trainer); when resuming on another world size, let it re-plan instead of reusing plans."
        )
    data_keys = [row[3] for row in rows]
    if len(set(data_keys)) > 1:
        # every rank saw the same gathered keys, so every rank is here: one more (error-path
        # only) collective gathers what each rank reads, so the message names every store
        names: list[object] = [None] * world_size
        dist.all_gather_object(names, data_identity, group=group)
        raise PlanDivergenceError(describe_data_divergence(data_keys, data_identity, step, names))
    keys = [(row[0], row[1]) for row in rows]
    if len(set(keys)) == 1:
        return
    raise PlanDivergenceError(describe_divergence(keys))


def _split_by_value(values: Sequence[object]) -> list[tuple[object, list[int]]]:
    """``[(value, ranks holding it)]``, the largest group first (ties: lowest rank first)."""
    groups: dict[object, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def describe_data_divergence(
    keys: Sequence[int], mine: str, step: int, names: Sequence[object] | None = None
) -> str:
    """The message for ranks that read different data (token stores with different contents).

    ``names`` (one per rank, from an all-gather) are what each rank reads; without them only
    this rank's ``mine`` is named.
    """
    ordered = _split_by_value(keys)
    majority = ordered[0][1]
    odd = sorted(r for _, ranks in ordered[1:] for r in ranks)
    if names is not None and len(names) == len(keys):
        parts = [f"ranks {ranks} read {names[ranks[0]]!r}" for _, ranks in ordered]
        mine_part = ""
    else:
        parts = [f"ranks {ranks} read data {int(key):015x}" for key, ranks in ordered]
        mine_part = f"; this rank reads {mine!r}"
    return (
        f"The ranks read different data at step {step}: ranks {odd} differ from ranks {majority} ("
        + "; ".join(parts)
        + f"{mine_part}). Every rank must read the same token store: a file edited or a "
        "store rebuilt on one node changes its content hash. Copy the same source files (or the same "
        "store folder) to every node, or rebuild the store everywhere (ByteScaleDataModule(rebuild=True)), "
        "then resume from the last checkpoint."
    )


def describe_divergence(keys: Sequence[tuple[int, int]]) -> str:
    """The message for ranks whose ``(digest key, step)`` pairs differ."""
    ordered = _split_by_value(keys)
    parts = [f"ranks {ranks} hold plan {key[0]:015x} for step {key[1]}" for key, ranks in ordered]
    majority = ordered[0][1]
    odd = sorted(r for _, ranks in ordered[1:] for r in ranks)
    return (
        f"The ranks disagree on this step's plan: ranks {odd} differ from ranks {majority} ("
        + "; ".join(parts)
        + "). Every rank must plan the same global batch from the same sequence lengths, seed and "
        "planner options; check that all ranks read the same data, use the same seed, and were "
        "given the same ByteScaleStrategy/ByteScaleDataModule options (and resumed from the same checkpoint)."
    )


@dataclass
class RankReport:
    """What one rank writes into its slot of the step buffer."""

    busy_s: float = 0.0
    ring_bytes: float = 0.0
    num_micro_batches: int = 0
    bad_micro_batch: int | None = None  # index of the first micro-batch with a non-finite value
    bad_kind: int = 0  # 1: loss, 2: gradient
    bad_seq_ids: tuple[int, ...] = ()
    ring_wait_s: float = 0.0  # seconds blocked waiting on ring transfers (exposed ring time)
    # a gradient check covers micro-batches bad_from..bad_micro_batch (None: exactly the one)
    bad_from: int | None = None

    @property
    def covers_several(self) -> bool:
        """A failed gradient check that covered several micro-batches (``bad_from..bad_micro_batch``)."""
        return (
            self.bad_kind == 2
            and self.bad_from is not None
            and self.bad_micro_batch is not None
            and self.bad_from < self.bad_micro_batch
        )

    def encode(self) -> list[float]:
        slot = [0.0] * SLOT
        slot[_BUSY] = self.busy_s
        slot[_RING_BYTES] = self.ring_bytes
        slot[_NUM_MB] = float(self.num_micro_batches)
        slot[_RING_WAIT] = self.ring_wait_s
        if self.bad_micro_batch is not None:
            slot[_BAD_MB] = float(self.bad_micro_batch + 1)
            slot[_BAD_KIND] = float(self.bad_kind)
            if self.bad_from is not None:
                slot[_BAD_FROM] = float(self.bad_from + 1)
            for i, s in enumerate(self.bad_seq_ids[:MAX_REPORTED_SEQS]):
                slot[_SEQS + i] = float(s + 1)
        return slot

    @classmethod
    def decode(cls, slot: Sequence[float]) -> RankReport:
        bad = int(round(slot[_BAD_MB]))
        since = int(round(slot[_BAD_FROM]))
        seqs = tuple(int(round(v)) - 1 for v in slot[_SEQS:] if round(v) > 0)
        return cls(
            busy_s=float(slot[_BUSY]),
            ring_bytes=float(slot[_RING_BYTES]),
            num_micro_batches=int(round(slot[_NUM_MB])),
            bad_micro_batch=bad - 1 if bad > 0 else None,
            bad_kind=int(round(slot[_BAD_KIND])),
            bad_seq_ids=seqs,
            ring_wait_s=float(slot[_RING_WAIT]),
            bad_from=since - 1 if since > 0 else None,
        )


def describe_non_finite(reports: Sequence[RankReport], step: int) -> str:
    """The message naming every rank, micro-batch and sequence with a non-finite loss or gradient."""
    bad_loss = [r for r, rep in enumerate(reports) if rep.bad_micro_batch is not None and rep.bad_kind == 1]
    bad_grad = [r for r, rep in enumerate(reports) if rep.bad_micro_batch is not None and rep.bad_kind != 1]
    lines = []
    for rank, rep in enumerate(reports):
        if rep.bad_micro_batch is None:
            continue
        seqs = list(rep.bad_seq_ids)
        more = ", first ids shown" if len(seqs) >= MAX_REPORTED_SEQS else ""
        if rep.bad_kind == 1:
            what = f"non-finite loss in micro-batch {rep.bad_micro_batch}"
        elif rep.covers_several:
            what = f"gradients non-finite after micro-batches {rep.bad_from}..{rep.bad_micro_batch}"
        else:
            what = f"gradients first non-finite after micro-batch {rep.bad_micro_batch}"
        lines.append(f"rank {rank}: {what} (sequences {seqs}{more})")
    return (
        f"Non-finite values at step {step}; the optimizer step was not taken: loss on rank(s) {bad_loss}, "
        f"local gradients on rank(s) {bad_grad}. "
        + "; ".join(lines)
        + ". Sequence ids index the global batch. Inspect those sequences, lower the learning rate, "
        "enable gradient clipping (Trainer(gradient_clip_val=...)), or use bf16/float32 instead of float16."
        + (
            " The gradients were checked once after several micro-batches: locate_non_finite=True checks "
            "them after every micro-batch and names the first one that made them non-finite."
            if any(rep.covers_several for rep in reports)
            else ""
        )
    )


@dataclass(frozen=True)
class StepChecks:
    """What one step checks, in one record instead of flags forwarded through every layer.

    A runner (:mod:`~lightning_bytescale.engine.runner`) hands it to its pieces: the plan check
    before the loop, the loop's own checks, and the checks of the step's sync, each of which
    raises on every rank together.
    """

    plan: bool = True
    """Before any ring exchange the ranks agree on the plan and the data (an all-gather of the digests)."""

    tokens: bool = True
    """The ranks' loss tokens add up to the global batch's (in the sync; off only for tests of pieces)."""

    finite: bool = True
    """A non-finite loss, or gradient where one was checked, stops the step in the sync (``NonFiniteError``)."""

    finite_gradients: bool = True
    """The loop checks the accumulated gradients too (off while a float16 ``GradScaler`` judges them)."""

    locate_non_finite: bool = False
    """Check the gradients after every micro-batch instead of once, to name the first bad one."""

    loss_scaling: bool = False
    """Probe the loss normalisation on one micro-batch (the first steps of a run)."""

    parameters: bool = False
    """Compare parameter fingerprints in the sync (every few steps: it costs one pass over the parameters)."""

    attention: bool = False
    """Count every micro-batch forward's packed attention calls, refused in the sync where one made none (the first steps)."""

    @classmethod
    def of_flags(
        cls,
        plan: bool,
        tokens: bool,
        finite: bool,
        locate_non_finite: bool,
        loss_scaling: bool,
        parameters: bool,
    ) -> StepChecks:
        """The checks the public step functions' flags ask for (their ``check_finite`` covers losses and gradients)."""
        return cls(plan, tokens, finite, finite, locate_non_finite, loss_scaling, parameters)
