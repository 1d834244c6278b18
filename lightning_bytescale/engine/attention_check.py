"""Catch a model whose attention ignores the packed layout, in the first steps.

HDP is exact only if every attention layer calls
:func:`lightning_bytescale.attention` (:func:`~lightning_bytescale.packed_attention.attention`),
which reads the micro-batch's layout: causal within each packed sequence, and zigzag ring or
Ulysses attention with the other members of a ring.  A model ported from DDP with
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` trains without any error, but its
attention crosses the boundaries of the sequences packed into a micro-batch, and a ring member
attends only to its own shard of a long sequence.

So, in the first steps (:data:`ATTENTION_CHECK_STEPS`, until some rank ran a micro-batch),
each rank counts the packed attention calls of every micro-batch's forward
(:func:`~lightning_bytescale.packed_attention.count_attention_calls`).  Every micro-batch must
make one: a micro-batch holding several sequences and a ring member are wrong without it, and
one holding a single whole sequence, though exact with any causal attention, shows at the
first step a model that would be wrong once sequences are packed (so the first optimizer step
is never taken with it).  The counts ride in the step's one all-reduce
(:func:`~lightning_bytescale.engine.executor.sync_step`), so every rank raises
:class:`~lightning_bytescale.errors.MissingPackedAttentionError` together, with the same
message, before the optimizer step, even when only some ranks saw it.  Afterwards nothing is
counted.

Pipelines check per pipeline instead (:func:`pipeline_verdict`, agreed by one all-reduce over
the world in :func:`lightning_bytescale.parallel.pipeline_step.agree_on_attention`): torch's schedule runs a stage's
micro-batches in one call, and a stage may hold no attention layer (a head-only last stage), so
the calls of a pipeline's stages over the step are added before the rule applies: a pipeline
whose stages made no packed attention call in a step with micro-batches is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bytescale.engine.batch import PackedMicroBatch
from lightning_bytescale.errors import MissingPackedAttentionError

#: Steps in which the attention check runs until some rank ran a micro-batch.
ATTENTION_CHECK_STEPS = 3


@dataclass
class AttentionVerdict:
    """What the check saw, on one rank or summed over ranks (integers: they ride in the step's all-reduce)."""

    checked: int = 0  # micro-batches checked
    missed_packed: int = 0  # of them: holding several sequences, without a packed attention call
    missed_ring: int = 0  # of them: a ring member, without a packed attention call
    missed_single: int = 0  # of them: holding one whole sequence, without a packed attention call

    def as_counts(self) -> tuple[int, int, int, int]:
        return self.checked, self.missed_packed, self.missed_ring, self.missed_single

    def add(self, mb: PackedMicroBatch, calls: int) -> None:
        """Record one micro-batch's forward that made ``calls`` packed attention calls."""
        self.checked += 1
        if calls == 0:
            kind = kind_of(mb)
            self.missed_ring += kind == "ring"
            self.missed_packed += kind == "packed"
            self.missed_single += kind == "single"


def kind_of(mb: PackedMicroBatch) -> str:
    """``"ring"`` (a ring member), ``"packed"`` (several sequences) or ``"single"`` (one whole sequence)."""
    if mb.layout.ring is not None:
        return "ring"
    return "packed" if len(mb.layout.seq_lens) > 1 else "single"


@dataclass
class AttentionCheckWindow:
    """The first steps of a run, in which the strategy runs the check (its ``check_attention`` option)."""

    steps: int = 0
    done: bool = False

    @property
    def active(self) -> bool:
        return not self.done

    def record(self, verdict: AttentionVerdict) -> None:
        """After a checked step's all-reduce (``verdict`` summed over ranks): close once conclusive."""
        self.steps += 1
        if verdict.checked or self.steps >= ATTENTION_CHECK_STEPS:
            self.done = True


def pipeline_verdict(
    per_rank: Sequence[tuple[int, int, int, int]], pipelines: Sequence[Sequence[int]]
) -> AttentionVerdict:
    """The verdict of a pipeline step from every global rank's ``(calls, ring, packed, single)``.

    ``calls`` are a stage's packed attention calls over the whole step (torch's schedule runs
    all of a stage's micro-batches in one call); ``ring``, ``packed`` and ``single`` count its
    pipeline's micro-batches of each kind (:func:`kind_of`).  ``pipelines`` lists the global
    ranks of each pipeline (of each TP lane).  A stage may hold no attention layer (a head-only
    last stage): a pipeline is refused only when none of its stages made a call in a step in
    which it ran micro-batches.
    """
    verdict = AttentionVerdict()
    for ranks in pipelines:
        ring, packed, single = per_rank[ranks[0]][1:]
        verdict.checked += ring + packed + single
        if not sum(per_rank[r][0] for r in ranks):
            verdict.missed_ring += ring
            verdict.missed_packed += packed
            verdict.missed_single += single
    return verdict


def check_attention(verdict: AttentionVerdict, step: int) -> None:
    """Raise :class:`MissingPackedAttentionError` when some checked micro-batch made no packed attention call."""
    if not (verdict.missed_packed or verdict.missed_ring or verdict.missed_single):
        return
    what = []
    if verdict.missed_packed:
        what.append(f"{verdict.missed_packed} packed micro-batch(es) holding several sequences")
    if verdict.missed_ring:
        what.append(f"{verdict.missed_ring} ring member(s) holding a shard of a long sequence")
    if verdict.missed_single:
        what.append(f"{verdict.missed_single} micro-batch(es) holding one whole sequence")
    raise MissingPackedAttentionError(
        f"The model's forward did not call lightning_bytescale.attention at step {step}: "
        f"{', '.join(what)} ran without it, over all ranks. Attention that ignores the micro-batch layout "
        "(F.scaled_dot_product_attention(q, k, v, is_causal=True), a hand-written softmax) attends across the "
        "sequences packed into a micro-batch, and on a ring member only to its own shard of a long sequence: "
        "the model would train silently wrong. In every attention layer call lightning_bytescale.attention(q, k, v) "
        "on packed [T, H, D] tensors (the reference LlamaModel does; a Hugging Face model: HFCausalLM, or "
        'attn_implementation="bytescale"). If the model mixes no tokens across positions, or handles packed '
        "sequences and rings itself, pass ByteScaleStrategy(check_attention=False)."
    )


__all__ = [
    "ATTENTION_CHECK_STEPS",
    "AttentionCheckWindow",
    "AttentionVerdict",
    "check_attention",
    "kind_of",
    "pipeline_verdict",
]
