"""The planner's test sets and the simulator's scenarios as fixed plans, for the ring-only digest check.

``ring_only_digests.json`` (next to this file) holds the digest of every case's plan as the planner
made it before attention modes existed: written once by

    git archive 41920e6 lightning_bytescale | tar -x -C /tmp/main-41920e6
    PYTHONPATH=/tmp/main-41920e6 .venv/bin/python tests/planner/_ring_only_cases.py --write

(commit 41920e6 is the branch point; nothing here needs a name that commit lacks).
``test_planner_modes.py`` plans every case again with ``modes=("ring",)`` and compares.

The cases: the shapes of the property tests (random small worlds and capacities, ``static``, ``naive``,
``balance`` and ``lpt``, pipelines with topology, offload), the no-offload grid's batches
(``test_planner_no_offload.py``: the four synthetic distributions, 8 and 32 ranks, both
cost-model presets; ``balance`` with and without offload and the two peers), and the first
global batch of every simulator scenario with its ``balance`` settings (the scenario's cost model
as it was: without heads).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lightning_bytescale.planner import distributions
from lightning_bytescale.planner.cost_presets import get_preset
from lightning_bytescale.sim import costs
from lightning_bytescale.sim.run import draw_batch
from lightning_bytescale.sim.scenario import SCENARIOS

DIGESTS = Path(__file__).with_name("ring_only_digests.json")
SYNTHETIC = ("byted", "github", "mixed", "short")


@dataclass
class Case:
    name: str
    lengths: list[int]
    world_size: int
    options: dict = field(default_factory=dict)


def pinned(cost_model):
    """A scenario's cost model as before attention modes: without the heads."""
    if getattr(cost_model, "attention_heads", None) is not None:
        return cost_model.with_(attention_heads=None, kv_heads=None)
    return cost_model


def property_cases() -> Iterator[Case]:
    rng = random.Random(39)
    for k in range(24):
        world, cap = rng.randint(1, 64), rng.randint(2, 64)
        limit = 2 * (cap // 2) * world
        lengths = [rng.randint(1, min(limit, 4 * cap)) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.5:
            lengths.append(rng.randint(1, limit))
        for planner in ("static", "naive", "balance", "lpt"):
            opts = {"capacity": cap, "planner": planner, "seed": k % 4}
            yield Case(f"property-{k}-{planner}", lengths, world, opts)
        yield Case(f"offload-{k}-balance", lengths, world, {"capacity": cap, "offload": True, "seed": k})
    for k, (p, rpn, reading) in enumerate(
        [(2, 2, "sequential"), (2, 4, "round_robin"), (4, 2, "round_robin"), (4, 4, "sequential")] * 2
    ):
        cap = 16 + 8 * k
        world = 8 * (1 + k % 3)
        lengths = [rng.randint(1, 3 * world * cap // 4) for _ in range(30)]
        opts = {"capacity": cap, "pipeline_degree": p, "ranks_per_node": rpn, "pp_reading": reading}
        yield Case(f"pipeline-{k}", lengths, world, opts)


def grid_cases() -> Iterator[Case]:
    for dist in SYNTHETIC:
        for world in (8, 32):
            for preset in ("paper", "slow-link"):
                cm = get_preset(preset).with_(ranks_per_node=8)
                ctx = min(distributions.REFERENCE_CONTEXT, world * 8192 // 2)
                lengths = distributions.sample_global_batch(dist, world * 8192 * 4, ctx, seed=0)
                base = {"capacity": 8192, "cost_model": cm, "ranks_per_node": 8}
                for tag, extra in (
                    ("balance", {}),
                    ("balance_no_offload", {"offload": False}),
                    ("megatron_dcp", {"planner": "megatron_dcp"}),
                    ("lpt", {"planner": "lpt"}),
                ):
                    yield Case(f"grid-{dist}-{world}-{preset}-{tag}", lengths, world, {**base, **extra})


def scenario_cases() -> Iterator[Case]:
    for name, sc in SCENARIOS.items():
        opts = {
            "capacity": sc.capacity,
            "cost_model": pinned(costs.cost_model_for(sc)),
            "seed": sc.seed,
            "pipeline_degree": sc.pipeline_degree,
            "ranks_per_node": sc.ranks_per_node,
            "offload": costs.offload_config_for(sc),
        }
        yield Case(f"scenario-{name}", draw_batch(sc, 0), sc.ranks, opts)


def cases() -> list[Case]:
    return [*property_cases(), *grid_cases(), *scenario_cases()]


def plan_digest(case: Case, **extra) -> str:
    from lightning_bytescale.planner import make_plan

    return make_plan(case.lengths, world_size=case.world_size, **case.options, **extra).digest()


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: _ring_only_cases.py --write (on the branch point's code, see the docstring)")
    DIGESTS.write_text(json.dumps({c.name: plan_digest(c) for c in cases()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")
