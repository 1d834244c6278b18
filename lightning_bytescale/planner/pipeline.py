"""The 1F1B pipeline schedule's makespan, shared by the planner and the simulator, and a stage's receive buffers.

With pipeline parallelism every HDP rank is a pipeline of ``stages`` stages that runs its own
micro-batches in a 1F1B schedule.  ``balance`` ranks its candidate plans by the makespan of
their slowest pipelines and the simulator times every pipeline with the same function, so a
plan the planner prefers is the one the simulator finds faster.

The capacity C bounds the activations a stage keeps: under 1F1B stage ``s`` holds at most
``stages - s`` micro-batches in flight, each through ``1/stages`` of the layers, so never more
than one micro-batch through the whole model.  But torch's ``PipelineStage`` also keeps receive
buffers (``[1, C, dim]``) for *every* micro-batch of the step (:func:`receive_buffer_slots`),
which grow with the pipeline's micro-batch count, not with C alone: ``PlannerConfig.max_micro_batches``
bounds that count, and :func:`receive_buffer_bytes` is the memory it allows (docs/pipelines.md,
"Receive buffers and reused stages").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_bytescale.planner.errors import PlanError


def one_f_one_b(durations: Sequence[float], stages: int, forward_share: float = 1.0 / 3.0) -> float:
    """Makespan of a 1F1B pipeline over ``stages`` stages.

    ``durations[i]`` is micro-batch ``i``'s whole-model forward+backward time; each stage
    runs ``1/stages`` of it, the forward taking ``forward_share`` and the backward the rest.
    Stage ``s`` runs ``min(stages - 1 - s, m)`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards.  Activation transfers
    between stages are not modelled.
    """
    m = len(durations)
    if m == 0:
        return 0.0
    if stages < 1:
        raise PlanError(f"pipeline degree must be >= 1, got {stages}")
    fwd = [d * forward_share / stages for d in durations]
    bwd = [d * (1.0 - forward_share) / stages for d in durations]
    ops: list[list[tuple[str, int]]] = []
    for s in range(stages):
        warm = min(stages - 1 - s, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", i) for i in range(m - warm, m)]
        ops.append(seq)
    f_end = [[None] * m for _ in range(stages)]
    b_end = [[None] * m for _ in range(stages)]
    free = [0.0] * stages
    ptr = [0] * stages
    remaining = stages * 2 * m
    while remaining:
        progressed = False
        for s in range(stages):
            while ptr[s] < len(ops[s]):
                kind, i = ops[s][ptr[s]]
                if kind == "F":
                    dep = 0.0 if s == 0 else f_end[s - 1][i]
                else:
                    dep = f_end[s][i] if s == stages - 1 else b_end[s + 1][i]
                if dep is None:
                    break
                begin = max(free[s], dep)
                end = begin + (fwd[i] if kind == "F" else bwd[i])
                (f_end if kind == "F" else b_end)[s][i] = end
                free[s] = end
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B orders cannot deadlock
            raise PlanError("1F1B schedule deadlocked")
    return max(free)


def receive_buffer_slots(stage: int, stages: int) -> int:
    """``[1, C, dim]`` tensors torch's ``PipelineStage`` of ``stage`` keeps per micro-batch through a step.

    Every stage but the first: the activation it receives; every stage but the last: the output
    gradient it receives.  So 2 on a middle stage, 1 on the first and the last.  The gradient of a
    received activation (the one sent back) is released once it is sent, so only a few of them
    exist at a time, whatever the count.
    """
    if stages < 1 or not 0 <= stage < stages:
        raise PlanError(f"stage {stage} is not one of {stages} pipeline stages")
    return (1 if stage > 0 else 0) + (1 if stage < stages - 1 else 0)


def receive_buffer_bytes(
    micro_batches: int, capacity: int, hidden_bytes_per_token: float, stages: int
) -> float:
    """The most receive-buffer bytes one stage of a pipeline holds in a step of ``micro_batches`` micro-batches.

    ``hidden_bytes_per_token`` is one token's hidden state between stages (``dim`` times the
    activations' element size: 4 for float32, also under ``"bf16-mixed"``, whose residual stream
    stays in the parameters' float32).  The largest stage's :func:`receive_buffer_slots` times
    ``micro_batches * capacity * hidden_bytes_per_token``; 0 without pipelines.
    """
    if stages <= 1:
        return 0.0
    slots = max(receive_buffer_slots(s, stages) for s in range(stages))
    return float(slots * micro_batches * capacity * hidden_bytes_per_token)


def max_micro_batches_within(
    budget_bytes: float, capacity: int, hidden_bytes_per_token: float, stages: int
) -> int:
    """The largest micro-batch count whose receive buffers (:func:`receive_buffer_bytes`) fit ``budget_bytes``."""
    per = receive_buffer_bytes(1, capacity, hidden_bytes_per_token, stages)
    if per <= 0:
        raise PlanError(
            "receive buffers need pipelines (stages > 1), a capacity and hidden bytes per token > 0"
        )
    return max(0, math.floor(budget_bytes / per))
