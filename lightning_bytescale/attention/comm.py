"""Ring P2P transfers on the global process group, with counters for tests and telemetry.

Every transfer is a ``batch_isend_irecv`` of one send to the next ring member and one
receive from the previous one, with peers named by their *global* ranks; no process group
is ever created here.  The counters are per process and cumulative until
:func:`reset_comm_stats`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

_STATS: dict[str, float] = {}


def reset_comm_stats() -> None:
    """Zero the P2P counters of this process."""
    _STATS.update(p2p_calls=0, p2p_batches=0, bytes_sent=0, bytes_received=0, wait_s=0.0)


reset_comm_stats()


def comm_stats() -> dict[str, float]:
    """P2P counters since the last reset.

    ``p2p_calls``: point-to-point operations issued (each send and each receive counts one);
    ``p2p_batches``: ``batch_isend_irecv`` calls; ``bytes_sent`` / ``bytes_received``;
    ``wait_s``: seconds spent blocked waiting for transfers (time not hidden by compute).
    """
    return dict(_STATS)


class Transfer:
    """One posted ring transfer: ``send`` goes to ``dst``, the result arrives from ``src``."""

    def __init__(self, send: torch.Tensor, dst: int, src: int, tag: int, group: Any = None) -> None:
        self.recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, dst, group=group, tag=tag),
            dist.P2POp(dist.irecv, self.recv, src, group=group, tag=tag),
        ]
        self._send = send  # keep the buffer alive until the send completes
        self._reqs = dist.batch_isend_irecv(ops)
        nbytes = send.numel() * send.element_size()
        _STATS["p2p_calls"] += 2
        _STATS["p2p_batches"] += 1
        _STATS["bytes_sent"] += nbytes
        _STATS["bytes_received"] += nbytes

    def wait(self) -> torch.Tensor:
        """Block until both operations finish; return the received tensor.

        Safe to call more than once (a gloo work object must be waited exactly once).
        """
        if self._reqs:
            start = time.perf_counter()
            for req in self._reqs:
                req.wait()
            _STATS["wait_s"] += time.perf_counter() - start
            self._reqs = []
            self._send = None
        return self.recv
