"""Micro-batch order for HDP ranks that are pipelines, and the check that their rings cannot deadlock.

With ``pipeline_degree`` P > 1 every HDP rank is a pipeline of P stages running its own
micro-batches in a 1F1B schedule, and a ring item (one micro-batch whose sequences are sharded
over several member pipelines) makes stage p of every member exchange K/V with stage p of the
others, in its forward and again in its backward, over blocking point-to-point rings on one
communicator.  Each stage runs a fixed op sequence (:func:`stage_ops`), and a ring op runs
only once every member stage has reached it.  The plan's item order (promise 4 of
:meth:`~.plan.Plan.validate`) is enough for P = 1 but not for P > 1: a stage's 1F1B sequence
interleaves forwards and backwards by micro-batch *index*, so two members holding two shared
items at different indices can reach one's backward and the other's forward in different
orders and wait for each other forever (the planner's PP-Balance plans do, as placed).

:func:`order_pipelines` orders each pipeline's micro-batches by the *index rule*: every ring
item sits at the **same micro-batch index on all of its members**.  Items get indices in
increasing item id, each the first index free on all its members; a member's slots skipped
that way take its local micro-batches in their order, the locals left over go last.  Where a
pipeline has too few local micro-batches to fill its gaps, a gap is a padding micro-batch
(``None`` in :attr:`PipelineOrder.slots`: C padding tokens that never attend and never count in
the loss, a forward and a backward of wasted compute), or with ``strict=True`` a
:class:`~.errors.PlanError` says which pipeline lacks how many.  Nothing else is needed, for
any micro-batch counts: docs/pipelines.md gives the argument (every op of the 1F1B schedule
has a clock reading ``2i + p`` for the forward of index ``i`` on stage ``p`` and
``2i + 2P - 1 - p`` for its backward that grows along every dependency, whatever the count).

:func:`deadlock_cycle` is the check, independent of the rule: the graph of every stage's ops
(program order on each stage, the activations going forward and the gradients going back
between stages of one pipeline), with each ring op merged into one node over its members, has
no cycle exactly when the schedule runs to the end; it returns a cycle where there is one.
Stage-to-stage transfers are inputs (a send does not wait for its receive), or with
``transfers="torch_1f1b"`` the point-to-point batches of torch's ``Schedule1F1B``
(:func:`torch_1f1b_program`), where a send may wait for its receive.  :func:`ring_order_conflicts`
is the weaker, pairwise form (two member stages reaching two shared ring ops in different
orders); :func:`index_rule_faults` checks the rule itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_bytescale.planner.errors import PlanError, PlanValidationError
from lightning_bytescale.planner.plan import MicroBatch, Plan

__all__ = [
    "PipelineOrder",
    "check_micro_batch_limit",
    "check_pipeline_order",
    "deadlock_cycle",
    "index_rule_faults",
    "order_pipelines",
    "ring_order_conflicts",
    "stage_ops",
    "torch_1f1b_program",
]

Slot = MicroBatch | None  # None: a padding micro-batch


def stage_ops(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s 1F1B op sequence over ``micro_batches`` micro-batches: ``("F", i)`` / ``("B", i)``.

    ``min(stages - 1 - stage, micro_batches)`` warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards (the order :func:`.pipeline.one_f_one_b` times).
    """
    if stages < 1 or not 0 <= stage < stages:
        raise PlanError(f"stage {stage} is not one of {stages} pipeline stages")
    m = micro_batches
    warm = min(stages - 1 - stage, m)
    seq = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        seq += [("F", warm + i), ("B", i)]
    seq += [("B", i) for i in range(m - warm, m)]
    return seq


@dataclass
class PipelineOrder:
    """Each pipeline's micro-batches in the order all its stages run them; ``None`` is a padding micro-batch."""

    stages: int
    slots: list[list[Slot]]

    @property
    def micro_batch_counts(self) -> list[int]:
        return [len(s) for s in self.slots]

    @property
    def pads(self) -> list[int]:
        """Padding micro-batches per pipeline."""
        return [sum(mb is None for mb in s) for s in self.slots]

    def ring_indices(self) -> dict[int, dict[int, int]]:
        """``{item: {pipeline: micro-batch index}}`` for every ring item."""
        out: dict[int, dict[int, int]] = {}
        for r, slots in enumerate(self.slots):
            for i, mb in enumerate(slots):
                if mb is not None and mb.ring is not None:
                    out.setdefault(mb.item, {})[r] = i
        return out

    def rings(self) -> dict[int, tuple[int, ...]]:
        """``{item: member pipelines}``."""
        out: dict[int, tuple[int, ...]] = {}
        for slots in self.slots:
            for mb in slots:
                if mb is not None and mb.ring is not None:
                    out[mb.item] = tuple(mb.ring)
        return out


def order_pipelines(
    plan: Plan, *, stages: int | None = None, strict: bool = False, min_micro_batches: int = 0
) -> PipelineOrder:
    """Order each pipeline's micro-batches by the index rule (module docstring); pad where locals run short.

    ``stages`` defaults to the plan's ``pipeline_degree``.  With one stage the plan's own order
    is kept (its item order is the whole rule there).  Ring items keep their relative order on
    every pipeline and local micro-batches theirs.  ``strict=True`` raises
    :class:`~.errors.PlanError` instead of padding gaps.  ``min_micro_batches`` pads every
    pipeline with fewer at its end (torch's ``Schedule1F1B`` needs at least P; padding at the
    end moves no ring item).  ``plan`` is not changed.
    """
    p = int(stages if stages is not None else (plan.options.get("pipeline_degree", 1) or 1))
    if p < 1:
        raise PlanError(f"pipeline degree must be >= 1, got {p}")
    if p == 1:
        return _padded(PipelineOrder(1, [list(mbs) for mbs in plan.ranks]), min_micro_batches)
    ring_mbs: dict[int, dict[int, MicroBatch]] = {}
    for r, mbs in enumerate(plan.ranks):
        for mb in mbs:
            if mb.ring is not None:
                ring_mbs.setdefault(mb.item, {})[r] = mb
    for item, members in ring_mbs.items():
        ring = next(iter(members.values())).ring
        if set(members) != set(ring):
            raise PlanError(f"ring item {item} on ring {ring} is held by pipelines {sorted(members)}")
    # in increasing item id, each item at the first index free on all its members
    nxt = [0] * len(plan.ranks)
    index: dict[int, int] = {}
    for item in sorted(ring_mbs):
        i = max(nxt[r] for r in ring_mbs[item])
        index[item] = i
        for r in ring_mbs[item]:
            nxt[r] = i + 1
    slots: list[list[Slot]] = []
    for r, mbs in enumerate(plan.ranks):
        at = {index[mb.item]: mb for mb in mbs if mb.ring is not None}
        pool = [mb for mb in mbs if mb.ring is None]
        gaps = nxt[r] - len(at)
        if strict and gaps > len(pool):
            raise PlanError(
                f"pipeline {r} has {len(pool)} local micro-batches but its ring items leave {gaps} index "
                f"gaps to fill (ring items at the same index on every member): {gaps - len(pool)} short"
            )
        out: list[Slot] = [at[i] if i in at else (pool.pop(0) if pool else None) for i in range(nxt[r])]
        slots.append(out + pool)
    return _padded(PipelineOrder(p, slots), min_micro_batches)


def check_micro_batch_limit(plan: Plan, limit: int) -> PipelineOrder:
    """Refuse a plan in which a pipeline runs more than ``limit`` micro-batches, padding included.

    ``PlannerConfig.max_micro_batches``: every micro-batch costs each stage receive buffers for
    the whole step (:func:`~.pipeline.receive_buffer_bytes`).  ``balance`` plans within the
    limit; the index rule's padding (:func:`order_pipelines`) may add micro-batches, and another
    planner may not know the limit, so :func:`~.planners.make_plan` checks every plan here.
    Returns the order it checked.
    """
    order = order_pipelines(plan)
    over = {r: n for r, n in enumerate(order.micro_batch_counts) if n > limit}
    if over:
        r, n = max(over.items(), key=lambda kv: kv[1])
        raise PlanError(
            f"pipeline {r} runs {n} micro-batches (padding for the ring order included), more than "
            f"max_micro_batches={limit} ({len(over)} pipeline(s) over): its stages' receive buffers would exceed "
            'what the limit allows. Raise max_micro_batches (docs/pipelines.md, "Receive buffers and reused stages"), lower the '
            "tokens per step, or use planner='balance', which plans within the limit"
        )
    return order


def _padded(order: PipelineOrder, least: int) -> PipelineOrder:
    for s in order.slots:
        s += [None] * max(0, least - len(s))
    return order


def index_rule_faults(order: PipelineOrder) -> list[str]:
    """Where ``order`` breaks the index rule: a ring item at different micro-batch indices on its members."""
    return [
        f"ring item {item} sits at different micro-batch indices {dict(sorted(where.items()))}"
        for item, where in sorted(order.ring_indices().items())
        if len(set(where.values())) > 1
    ]


def _ring_ops(order: PipelineOrder, r: int, stage: int) -> list[tuple[str, int]]:
    """Pipeline ``r`` stage ``stage``'s ring ops in its order: ``(kind, item)``."""
    slots = order.slots[r]
    out = []
    for kind, i in stage_ops(len(slots), order.stages, stage):
        mb = slots[i]
        if mb is not None and mb.ring is not None:
            out.append((kind, mb.item))
    return out


def ring_order_conflicts(order: PipelineOrder) -> list[str]:
    """Pairs of member stages that reach two shared ring ops in different orders (blocking rings deadlock)."""
    conflicts = []
    n = len(order.slots)
    pairs = sorted({(a, b) for ring in order.rings().values() for a in ring for b in ring if a < b})
    for stage in range(order.stages):
        seqs = [_ring_ops(order, r, stage) for r in range(n)]
        for a, b in pairs:
            common = set(seqs[a]) & set(seqs[b])
            if len(common) < 2:
                continue
            sa = [op for op in seqs[a] if op in common]
            sb = [op for op in seqs[b] if op in common]
            if sa != sb:
                j = next(k for k in range(len(sa)) if sa[k] != sb[k])
                conflicts.append(
                    f"stage {stage}: pipeline {a} reaches {_name(sa[j])} before {_name(sb[j])}, "
                    f"pipeline {b} the other way round"
                )
    return conflicts


def _name(op: tuple[str, int]) -> str:
    return f"{_KIND[op[0]]} of ring item {op[1]}"


def torch_1f1b_program(micro_batches: int, stages: int, stage: int) -> list[tuple]:
    """Stage ``stage``'s events in ``torch.distributed.pipelining.Schedule1F1B``, point-to-point included.

    Events: ``("F", i)`` / ``("B", i)`` computes, ``("fire", ops)`` (posts a batch of
    point-to-point ops, never blocks) and ``("wait", ops)`` (blocks until every op of the batch
    has its peer's matching op posted).  An op is ``(direction, kind, index, from, to)``:
    ``("send", "F", i, p, p + 1)`` on stage p matches ``("recv", "F", i, p, p + 1)`` on stage
    p + 1.  As in torch (2.13): ``min(m, P - p)`` warm-up forwards, each send fired after the
    compute and waited for after the next forward, the last warm-up send fused with the first
    backward's receive, in the steady part each backward's send fused with the next forward's
    receive, then the cool-down backwards.
    """
    m, p, s = micro_batches, stages, stage
    if p < 1 or not 0 <= s < p:
        raise PlanError(f"stage {stage} is not one of {stages} pipeline stages")

    def fwd_send(i):
        return (("send", "F", i, s, s + 1),) if s < p - 1 else ()

    def fwd_recv(i):
        return (("recv", "F", i, s - 1, s),) if s > 0 else ()

    def bwd_send(i):
        return (("send", "B", i, s, s - 1),) if s > 0 else ()

    def bwd_recv(i):
        return (("recv", "B", i, s + 1, s),) if s < p - 1 else ()

    events: list[tuple] = []

    def fire(ops):
        if ops:
            events.append(("fire", ops))

    def wait(ops):
        if ops:
            events.append(("wait", ops))

    if m == 0:
        return events
    warm = min(m, p - s)
    fwd = bwd = 0
    send_work: tuple = ()
    sends: tuple = ()
    for _ in range(warm):
        fire(fwd_recv(fwd))
        wait(fwd_recv(fwd))
        events.append(("F", fwd))
        wait(send_work)
        sends = fwd_send(fwd)
        if fwd != warm - 1:
            fire(sends)
            send_work = sends
        fwd += 1
    while True:
        fire(sends + bwd_recv(bwd))
        wait(sends + bwd_recv(bwd))
        events.append(("B", bwd))
        back = bwd_send(bwd)
        bwd += 1
        if fwd == m:
            break
        fire(back + fwd_recv(fwd))
        wait(back + fwd_recv(fwd))
        events.append(("F", fwd))
        sends = fwd_send(fwd)
        fwd += 1
    fire(back)
    send_work = back
    while bwd < m:
        fire(bwd_recv(bwd))
        wait(bwd_recv(bwd))
        events.append(("B", bwd))
        wait(send_work)
        send_work = bwd_send(bwd)
        fire(send_work)
        bwd += 1
    wait(send_work)
    return events


TRANSFERS = ("buffered", "torch_1f1b")


def deadlock_cycle(order: PipelineOrder, *, transfers: str = "buffered") -> list[str] | None:
    """A cycle of ops that wait for each other, or None when every stage's schedule runs to the end.

    Nodes are ops: ``(pipeline, stage, kind, index)``, with a ring item's op at one stage merged
    over its members into ``(item, stage, kind)``.  Edges: each stage's op order, a forward
    after the same micro-batch's forward on the previous stage, a backward after its forward
    on the last stage and after its backward on the next stage.  With ``transfers="buffered"``
    a transfer between stages is an input, not a rendezvous (a send does not wait for its
    receive).  With ``"torch_1f1b"`` each stage runs :func:`torch_1f1b_program`: point-to-point
    batches are nodes of their own, and a wait follows the peer's posting of every matching op
    (a send may wait for its receive, the worst case).  An acyclic graph runs to the end (the
    earliest op left in a topological order has all it waits for done and all its members
    there); a cycle never does.
    """
    if transfers not in TRANSFERS:
        raise PlanError(f"transfers must be one of {TRANSFERS}, got {transfers!r}")
    p = order.stages
    rings = order.rings()

    def node(r: int, stage: int, kind: str, i: int) -> tuple:
        mb = order.slots[r][i]
        if mb is not None and mb.ring is not None:
            return ("ring", mb.item, stage, kind)
        return ("op", r, stage, kind, i)

    succ: dict[tuple, set[tuple]] = {}

    def edge(a: tuple, b: tuple) -> None:
        succ.setdefault(a, set()).add(b)
        succ.setdefault(b, set())

    for r, slots in enumerate(order.slots):
        m = len(slots)
        if transfers == "torch_1f1b":
            fired: dict[tuple, tuple] = {}  # a posted op -> its fire node
            waits: list[tuple[tuple, tuple]] = []
            for stage in range(p):
                program = []
                for j, ev in enumerate(torch_1f1b_program(m, p, stage)):
                    if ev[0] in ("F", "B"):
                        program.append(node(r, stage, ev[0], ev[1]))
                        continue
                    here = ("p2p", r, stage, j, ev[0])
                    program.append(here)
                    for op in ev[1]:
                        if ev[0] == "fire":
                            fired[op] = here
                        else:
                            waits.append((("recv" if op[0] == "send" else "send", *op[1:]), here))
                for a in program:
                    succ.setdefault(a, set())
                for a, b in zip(program, program[1:], strict=False):
                    edge(a, b)
            for peer_op, here in waits:
                edge(fired[peer_op], here)
            continue
        for stage in range(p):
            ops = stage_ops(m, p, stage)
            program = [node(r, stage, k, i) for k, i in ops]
            for a in program:
                succ.setdefault(a, set())
            for a, b in zip(program, program[1:], strict=False):
                edge(a, b)
            for (k, i), op in zip(ops, program, strict=True):
                if k == "F" and stage > 0:
                    edge(node(r, stage - 1, "F", i), op)
                elif k == "B":
                    edge(node(r, stage, "F", i) if stage == p - 1 else node(r, stage + 1, "B", i), op)
    indeg = dict.fromkeys(succ, 0)
    for a in succ:
        for b in succ[a]:
            indeg[b] += 1
    ready = [a for a, d in indeg.items() if d == 0]
    done = 0
    while ready:
        a = ready.pop()
        done += 1
        for b in succ[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    if done == len(succ):
        return None
    left = {a for a, d in indeg.items() if d > 0}
    pred: dict[tuple, tuple] = {}
    for a in sorted(left, key=repr):
        for b in sorted(succ[a], key=repr):
            if b in left:
                pred.setdefault(b, a)
    a = min(left, key=repr)
    seen: list[tuple] = []
    while a not in seen:
        seen.append(a)
        a = pred[a]
    cycle = seen[seen.index(a) :][::-1]
    return [_describe(x, rings) for x in cycle]


def _describe(x: tuple, rings: dict[int, tuple[int, ...]]) -> str:
    if x[0] == "p2p":
        _, r, stage, j, what = x
        return f"point-to-point {what} (event {j}) on pipeline {r} stage {stage}"
    if x[0] == "ring":
        _, item, stage, kind = x
        return f"{_KIND[kind]} of ring item {item} (pipelines {list(rings[item])}) at stage {stage}"
    _, r, stage, kind, i = x
    return f"{_KIND[kind]} of micro-batch {i} on pipeline {r} stage {stage}"


_KIND = {"F": "forward", "B": "backward"}


def check_pipeline_order(order: PipelineOrder, *, transfers: str = "buffered") -> PipelineOrder:
    """Raise :class:`~.errors.PlanValidationError` when ``order``'s rings can deadlock; return it otherwise."""
    for r, slots in enumerate(order.slots):
        for mb in slots:
            if mb is not None and mb.ring is not None and r not in mb.ring:
                raise PlanValidationError(f"pipeline {r} holds ring item {mb.item} of ring {mb.ring}")
    for item, where in order.ring_indices().items():
        ring = order.rings()[item]
        if set(where) != set(ring):
            raise PlanValidationError(f"ring item {item} on ring {ring} is held by pipelines {sorted(where)}")
    conflicts = ring_order_conflicts(order)
    if conflicts:
        raise PlanValidationError("pipeline rings reach ring items in different orders: " + conflicts[0])
    cycle = deadlock_cycle(order, transfers=transfers)
    if cycle is not None:
        raise PlanValidationError("pipeline schedule deadlocks: " + " -> ".join(cycle) + " -> (again)")
    return order
