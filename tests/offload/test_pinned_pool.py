"""The offloader's pinned host pool stays bounded whatever the micro-batches' lengths.

The pool's bookkeeping is the same on every device; only its blocks are pinned on CUDA, so
here they are plain host memory (``pin=False``).  Offloading is simulated as the offloader does
it: every saved tensor of a micro-batch takes a block in the forward, and gives it back once its
reload is queued.  Over hundreds of micro-batches of lengths from 64 to 65,536 tokens (over a
thousand distinct tensor sizes), the pool never holds more than twice its peak use, and most
requests are served from reused blocks; a cache keyed by exact sizes (the pool before) held
several times its peak.
"""

from __future__ import annotations

import random

import pytest
import torch

from lightning_bytescale.offload import ActivationOffloader, OffloadError
from lightning_bytescale.offload.offloader import _host_view, _PinnedPool

LAYERS = 6


def _layer_sizes(length: int, rng: random.Random, kind: str) -> list[int]:
    """Bytes of one layer's saved tensors for a micro-batch of ``length`` tokens."""
    if kind == "layer":  # bf16 hidden and MLP activations, a float32 norm input, per-head statistics
        return [length * 256 * 2, length * 688 * 2, length * 256 * 4, length * 8 * 4]
    return [length * 64] * rng.randint(1, 40)  # many tensors of one size, a size per micro-batch


def _simulate(pool: _PinnedPool, kind: str, steps: int = 400, seed: int = 0) -> dict:
    rng = random.Random(seed)
    worst = {"held_over_peak_use": 0.0, "cached_over_peak_use": 0.0}
    requested = peak_requested = total_requested = 0
    sizes: set[int] = set()

    def check() -> None:
        worst["held_over_peak_use"] = max(
            worst["held_over_peak_use"], pool.held_bytes / pool.peak_in_use_bytes
        )
        worst["cached_over_peak_use"] = max(
            worst["cached_over_peak_use"], pool.cached_bytes / pool.peak_in_use_bytes
        )

    for _ in range(steps):
        length = int(2 ** rng.uniform(6, 16))
        blocks = []
        for _layer in range(LAYERS):  # the forward offloads layer by layer
            for n in _layer_sizes(length, rng, kind):
                buf, _event = pool.get(n)
                assert buf.numel() >= n
                blocks.append(buf)
                requested += n
                total_requested += n
                sizes.add(n)
                check()
        peak_requested = max(peak_requested, requested)
        for buf in reversed(blocks):  # the backward reloads the last layers first
            pool.put(buf, None)
            check()
        requested = 0
    return {
        **worst,
        "distinct_sizes": len(sizes),
        "held_over_peak_requested": pool.held_bytes / peak_requested,
        "allocated_over_requested": (pool.held_bytes + pool.released_bytes) / total_requested,
    }


@pytest.mark.parametrize("kind", ["layer", "one_size"])
def test_over_many_lengths_the_pool_holds_at_most_twice_its_peak_use_and_reuses_blocks(kind):
    out = _simulate(_PinnedPool(pin=False), kind)
    assert out["distinct_sizes"] > 300
    assert out["held_over_peak_use"] <= 2.0, out  # in use + idle, at every moment
    assert out["cached_over_peak_use"] <= 1.0, out
    # most requests are served by blocks given back earlier, not by new pinned allocations
    assert out["allocated_over_requested"] < 0.5, out


def test_a_request_takes_the_next_size_up_as_a_view_and_its_event():
    pool = _PinnedPool(pin=False)
    big, _ = pool.get(3 * 4096)  # a 16 KiB block
    assert big.numel() == 16384
    pool.put(big, "event of its last copy")
    buf, event = pool.get(5000)  # an 8 KiB request: no 8 KiB block idle, the 16 KiB one is
    assert buf.data_ptr() == big.data_ptr() and event == "event of its last copy"
    t = torch.randn(25, 50, dtype=torch.float32)[:, ::2]  # a strided view, 2,500 bytes of data
    t = t.contiguous().t()  # dense, not contiguous
    host = _host_view(buf, t)
    host.copy_(t)
    assert torch.equal(host, t) and host.stride() == t.stride()
    pool.put(buf, None)
    small, _ = pool.get(100)  # 4 KiB class: the idle 16 KiB block is two classes up, not taken
    assert small.numel() == 4096 and small.data_ptr() != big.data_ptr()


def test_an_explicit_cap_drops_the_least_recently_freed_blocks_first():
    pool = _PinnedPool(3 * 8192, pin=False)
    blocks = [pool.get(8192)[0] for _ in range(5)]
    for buf in blocks:
        pool.put(buf, None)
        assert pool.cached_bytes <= 3 * 8192
    assert pool.released_bytes == 2 * 8192 and pool.held_bytes == 3 * 8192
    kept = {pool.get(8192)[0].data_ptr() for _ in range(3)}
    assert kept == {b.data_ptr() for b in blocks[2:]}  # the last three freed stayed
    pool.clear()
    assert pool.cached_bytes == 0


def test_a_bad_cap_is_refused():
    for bad in (-1, 1.5, True):
        with pytest.raises(OffloadError, match="max_cached_host_bytes"):
            ActivationOffloader(max_cached_host_bytes=bad)
