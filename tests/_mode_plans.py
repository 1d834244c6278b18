"""Plans the planner makes with ring, Ulysses and hybrid items in one step, for the engine, strategy and telemetry tests.

``balance`` chooses an item's attention mode by its cost model, so a test that wants every mode
in a real plan needs a cost model with heads under which each mode wins somewhere.  The one here
is the tiny Llama's shape (2 layers, width 32, 4 heads, float64) at a slow compute rate next to
slower links (1 MB/s inside a node, 4x slower across nodes, 2 ranks a node): rings of long
sequences hide their transfer, shorter ones do not, and Ulysses or the hybrid layout wins there.
With 4 key/value heads (multi-head attention) a Ulysses item of 2 moves 2/3 of a ring's bytes; with
the tiny preset's 2 key/value heads it moves exactly a ring's (``(H / n + K_n) / K`` = 1.5 per
pass twice against the ring's 3 passes), so ties go to the ring and only hybrid items of 4 appear.
"""

from __future__ import annotations

from collections import Counter

from lightning_bytescale.planner import CostModel, make_plan
from lightning_bytescale.planner.plan import Plan

RANKS_PER_NODE = 2
CAPACITY = 20
#: A global batch on which balance with :func:`mode_cost_model` plans a ring item (ranks 0, 1), Ulysses
#: items of 2 and 4 members and a hybrid item of 2 nodes x 2 (found by drawing batches; any batch with
#: every mode would do).
MIXED_LENGTHS = (16, 7, 43, 31, 3, 10, 56, 21)


def mode_cost_model(
    *,
    kv_heads: int = 4,
    vocab: int = 64,
    tensor_parallel: int = 1,
    ranks_per_node: int = RANKS_PER_NODE,
    bandwidth_intra: float = 1e6,
) -> CostModel:
    """The tiny Llama's cost model (4 query heads, ``kv_heads`` key/value heads) with links slow
    enough that Ulysses and hybrid items win where rings cannot hide their transfer (the link
    between nodes is 4x slower than ``bandwidth_intra``).

    ``tensor_parallel``: the heads are one lane's (``4 / tp``, ``kv_heads / tp``), as
    ``bytescale-profile --tensor-parallel`` records them.
    """
    cost = CostModel.from_model_shape(
        2, 32, 4, kv_heads, 64, vocab, flops_per_s=1e7, dtype_bytes=8,
        bandwidth_intra=bandwidth_intra, bandwidth_inter=bandwidth_intra / 4, ranks_per_node=ranks_per_node,
        name="tiny-modes",
    )  # fmt: skip
    if tensor_parallel == 1:
        return cost
    return cost.with_(
        attention_heads=4 // tensor_parallel,
        kv_heads=max(1, kv_heads // tensor_parallel),
        tensor_parallel=tensor_parallel,
    )


def modes_of(plan: Plan) -> Counter:
    """``(mode, ring size) -> items`` of a plan's ring items."""
    seen: set[int] = set()
    out: Counter = Counter()
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.ring is not None and mb.item not in seen:
                seen.add(mb.item)
                out[(mb.mode, len(mb.ring))] += 1
    return out


def mixed_mode_plan(lengths=MIXED_LENGTHS, *, kv_heads: int = 4, world: int = 4, seed: int = 0) -> Plan:
    """``balance``'s plan of ``lengths`` on ``world`` ranks (2 a node) under :func:`mode_cost_model`, checked."""
    return make_plan(
        list(lengths), world_size=world, capacity=CAPACITY, planner="balance", seed=seed,
        cost_model=mode_cost_model(kv_heads=kv_heads),
    ).validate()  # fmt: skip
