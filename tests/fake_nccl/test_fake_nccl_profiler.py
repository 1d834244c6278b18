"""``cost_model="auto"``'s collectives on fake NCCL: what it broadcasts, sums and exchanges is on the GPU.

The measurement at set-up (``profiler/auto.py``) shares group rank 0's model, sums the layer
times each rank measured and times a two-way exchange between two ranks of the run's own group.
On NCCL every one of those tensors must be a CUDA tensor; a host tensor fails here as it would
there.  Values follow the tier's one simple world (a reduction leaves this rank's values, a
broadcast leaves the buffer as this rank made it), and each result comes back to the host once.
"""

from __future__ import annotations

import pytest
from _fake_nccl import RECORDED, fake_nccl

from lightning_bytescale.profiler import auto

D2H = "a device-to-host copy"


@pytest.mark.covers("profiler/auto.py:_broadcast:broadcast")
def test_rank_zeros_model_is_broadcast_from_the_gpu():
    with fake_nccl(world_size=4, rank=2) as mode:
        RECORDED.clear()
        got = auto._broadcast([1.5, 2.5e-9, 3.0], None, src=0)
        calls = [(c.function, c.op) for c in RECORDED]
        d2h = [s for s in mode.syncs if s.kind == D2H]
    assert got == [1.5, 2.5e-9, 3.0]
    assert calls == [("_broadcast", "c10d.broadcast_.default")], calls
    assert len(d2h) == 1, d2h


@pytest.mark.covers("profiler/auto.py:_sum_over_group:all_reduce")
def test_the_ranks_layer_times_are_summed_on_the_gpu():
    rows = [[0.0, 0.0], [1.25, 4.0e-3], [0.0, 0.0]]  # this rank measured the second length only
    with fake_nccl(world_size=3, rank=1) as mode:
        RECORDED.clear()
        got = auto._sum_over_group(rows, None)
        calls = [(c.function, c.op) for c in RECORDED]
        d2h = [s for s in mode.syncs if s.kind == D2H]
    assert got == rows
    assert calls == [("_sum_over_group", "c10d.allreduce_.default")], calls
    assert len(d2h) == 1, d2h


@pytest.mark.covers(
    "profiler/auto.py:_exchange_seconds:P2POp",
    "profiler/auto.py:_exchange_seconds:isend",
    "profiler/auto.py:_exchange_seconds:irecv",
    "profiler/auto.py:_exchange_seconds:batch_isend_irecv",
)
def test_a_link_is_timed_with_gpu_buffers_on_the_runs_own_group():
    """Group rank 1 times its exchange with group rank 0 (and no other pair on one node)."""
    with fake_nccl(world_size=4, rank=1):
        RECORDED.clear()
        intra, inter = auto.measure_group_links(None, ranks_per_node=4, nbytes=1024, repeats=2)
        calls = [(c.function, c.op) for c in RECORDED]
    assert intra is not None and intra > 0 and inter is None
    one = [("_exchange_seconds", "c10d.send.default"), ("_exchange_seconds", "c10d.recv_.default")]
    assert calls == one * 3, calls  # the connecting exchange and two timed ones
