"""ZeRO-2's unbucketed gradient sync (``engine.zero.reduce_gradients_to_owners``) on 3 gloo ranks.

Each rank gives every parameter a known gradient (small integers; one parameter gets none on
rank 1, as on a rank whose micro-batches do not use it).  After the sync the owner
holds the sum over the ranks, computed here from the bases (a bfloat16 gradient summed in float32),
every other rank ``None``; a parameter without an owner is summed on every rank.  One
``dist.reduce`` per owner and one ``dist.all_reduce`` for the parameters without one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ranks import DistCalls, gather_reports, init_gloo, save_report

pytestmark = pytest.mark.multiprocess

WORLD = 3
SHAPES = {
    "a": ((3, 2), torch.float64),
    "b": ((5,), torch.bfloat16),
    "c": ((4,), torch.float64),
    "d": ((2,), torch.float64),
}
OWNERS = {"a": 0, "b": 2, "c": 1}  # "d" has no owner: all-reduced
UNUSED_ON = {"c": 1}  # no gradient on this rank


def _grad(name: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of ``name``: small integers, so every sum is exact in any order.

    ``b``'s element ``i < 3`` is 256 on rank ``i`` and 1 on the others: in bfloat16 256 + 1 rounds
    back to 256 (the step there is 2), so a sum in bfloat16 gets 256 for the elements whose 256 is
    among the first two ranks added; summed in float32 each is 258, which bfloat16 holds.
    """
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(10 * sorted(SHAPES).index(name) + rank)
    grad = torch.randint(-8, 9, shape, generator=g).to(torch.float64)
    if name == "b":
        for i in range(WORLD):  # whichever two ranks a bfloat16 sum adds first, one element loses 2
            grad[i] = 256.0 if i == rank else 1.0
    return grad.to(dtype)


def _params() -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for n, (shape, dtype) in SHAPES.items()}


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine.zero import reduce_gradients_to_owners

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    counter = DistCalls(("reduce", "all_reduce"))
    params = _params()
    for name, p in params.items():
        if UNUSED_ON.get(name) != rank:
            p.grad = _grad(name, rank)
    owners = {id(params[n]): r for n, r in OWNERS.items()}
    reduce_gradients_to_owners(list(params.values()), owners)
    report = {
        "held": {
            n: None if p.grad is None else p.grad.double().flatten().tolist() for n, p in params.items()
        },
        "dtypes": {n: str(p.grad.dtype) for n, p in params.items() if p.grad is not None},
        "calls": dict(counter.calls),
    }
    save_report(outdir, rank, report)
    dist.destroy_process_group()


def _expected_sum(name: str) -> torch.Tensor:
    total = sum(_grad(name, r).double() for r in range(WORLD) if UNUSED_ON.get(name) != r)
    return total.to(SHAPES[name][1]).double().flatten()


def test_each_gradient_is_summed_onto_its_owner_and_dropped_elsewhere(tmp_path):
    reports = gather_reports(tmp_path, _worker, WORLD, timeout_s=120)
    for rank, rep in enumerate(reports):
        for name in SHAPES:
            owner = OWNERS.get(name)
            got = rep["held"][name]
            if owner is not None and owner != rank:
                assert got is None, (rank, name)
                continue
            assert got is not None, (rank, name)
            assert torch.equal(torch.tensor(got, dtype=torch.float64), _expected_sum(name)), (rank, name, got)
            assert rep["dtypes"][name] == str(SHAPES[name][1])
        assert rep["calls"] == {"reduce": len(set(OWNERS.values())), "all_reduce": 1}, rep["calls"]
