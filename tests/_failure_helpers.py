"""Test helper: run a block that talks to other ranks and turn a lost peer into ``PeerFailureError``.

The engine tests drive ``run_step`` on plain ``torch.distributed`` ranks, outside Lightning;
this guard is the engine-loop pattern that docs/troubleshooting.md shows ("A dead or stuck
peer"), built from the package's :func:`is_peer_failure` and :func:`peer_failure_message`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from lightning_bytescale.engine.failures import is_peer_failure, peer_failure_message
from lightning_bytescale.errors import PeerFailureError


@contextmanager
def peer_failure_guard(rank: int, timeout: float | timedelta | None, phase: str = "a step") -> Iterator[None]:
    """Re-raise a lost-peer error inside the block as :class:`PeerFailureError` (others unchanged)."""
    try:
        yield
    except PeerFailureError:
        raise
    except (RuntimeError, ConnectionError, TimeoutError) as err:
        if not is_peer_failure(err):
            raise
        raise PeerFailureError(peer_failure_message(rank=rank, timeout=timeout, phase=phase)) from err
