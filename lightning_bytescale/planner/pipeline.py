"""The 1F1B pipeline schedule's makespan, shared by the planner and the simulator.

With pipeline parallelism every HDP rank is a pipeline of ``stages`` stages that runs its own
micro-batches in a 1F1B schedule.  ``balance`` ranks its candidate plans by the makespan of
their slowest pipelines and the simulator times every pipeline with the same function, so a
plan the planner prefers is the one the simulator finds faster.
"""

from __future__ import annotations

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
