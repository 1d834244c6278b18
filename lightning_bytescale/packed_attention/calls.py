"""Count the calls of :func:`~lightning_bytescale.packed_attention.attention` in a forward.

A model trains exactly on packed micro-batches only if its attention goes through
:func:`~lightning_bytescale.packed_attention.attention`, which reads the micro-batch's layout;
plain ``scaled_dot_product_attention`` attends across the packed sequences and, on a ring
member, to its own shard only.  Two checks ask whether it did: the Hugging Face model's
per-layer check (:mod:`lightning_bytescale.hf.module`) and the strategy's attention check of
the first steps (:mod:`lightning_bytescale.engine.attention_check`).  Both open a
:func:`count_attention_calls` block around a forward.

Outside any block, :func:`attention` pays one read of a module integer per call: nothing is
counted once the checks are over, and nothing is read from a device.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(eq=False)  # each block is its own counter: leaving one removes it, not an equal count
class AttentionCalls:
    """How many times :func:`~lightning_bytescale.packed_attention.attention` ran inside :func:`count_attention_calls`."""

    calls: int = 0


class _Counters(threading.local):
    def __init__(self) -> None:
        self.stack: list[AttentionCalls] = []


_COUNTERS = _Counters()
_open = 0  # blocks open in any thread: while none is, a call reads only this integer


@contextmanager
def count_attention_calls() -> Iterator[AttentionCalls]:
    """Count the packed attention calls of the forward inside the block (this thread; blocks nest)."""
    global _open
    counter = AttentionCalls()
    _COUNTERS.stack.append(counter)
    _open += 1
    try:
        yield counter
    finally:
        _open -= 1
        _COUNTERS.stack.remove(counter)


def record_attention_call() -> None:
    """Add one call to every open :func:`count_attention_calls` block of this thread."""
    if _open:
        for counter in _COUNTERS.stack:
            counter.calls += 1


__all__ = ["AttentionCalls", "count_attention_calls", "record_attention_call"]
