"""Ring P2P transfers on the global process group, on their own CUDA stream, with counters.

Every transfer is a ``batch_isend_irecv`` of one send to the next ring member and one
receive from the previous one, with peers named by their *global* ranks; no process group
is ever created here.  The counters are per process and cumulative until
:func:`reset_comm_stats`.

On CUDA a transfer runs on a per-device *communication stream*: posting makes that stream
wait for the compute stream (an event: the send buffer has been written) and issues the
P2P there; :meth:`Transfer.wait` makes the NCCL work complete on the communication stream and
then the compute stream wait for it (events again).  Neither synchronises the host, so the
ring loop queues the next transfer, the current block's kernels and the merges without
stopping.  :func:`post_on_comm_stream` and :func:`hand_over` are shared with the in-process
loopback ring, so it exercises the same stream handling, and with the Ulysses exchanges
(:mod:`.ulysses`: several sends and receives in one ``batch_isend_irecv``), which count
themselves here with :func:`count_exchange`.  On CPU (gloo) ``wait`` blocks the
calling thread while gloo's own threads move the data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_STATS: dict[str, float] = {}
_COMM_STREAMS: dict[int, torch.cuda.Stream] = {}

T = TypeVar("T")
R = TypeVar("R", torch.Tensor, Sequence[torch.Tensor])


def reset_comm_stats() -> None:
    """Zero the P2P counters of this process."""
    _STATS.update(
        p2p_calls=0, p2p_batches=0, bytes_sent=0, bytes_received=0, wait_s=0.0, ulysses_bytes_sent=0
    )


reset_comm_stats()


def comm_stats() -> dict[str, float]:
    """P2P counters since the last reset.

    ``p2p_calls``: point-to-point operations issued (each send and each receive counts one);
    ``p2p_batches``: ``batch_isend_irecv`` calls; ``bytes_sent`` / ``bytes_received``;
    ``wait_s``: seconds the host spent blocked in transfer waits (time not hidden by compute);
    ``ulysses_bytes_sent``: the part of ``bytes_sent`` that Ulysses all-to-alls sent (:mod:`.ulysses`;
    the rest went round rings).
    On CUDA waits are stream waits, so ``wait_s`` stays near zero there: device-side waiting
    shows in step time, not here.
    """
    return dict(_STATS)


def comm_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The ring's communication stream on a CUDA ``device`` (one per device); None elsewhere."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


def _tensors(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def post_on_comm_stream(send: torch.Tensor | Sequence[torch.Tensor], start: Callable[[], T]) -> T:
    """Run ``start()`` (which issues the exchange of ``send``, one tensor or several) on the communication stream.

    The communication stream first waits for the current (compute) stream, so the exchange
    reads ``send`` after the kernels that wrote it; ``send`` is recorded as used there, so the
    caching allocator does not hand its memory out before the exchange is done.
    """
    sends = _tensors(send)
    stream = comm_stream(sends[0].device) if sends else None
    if stream is None:
        return start()
    stream.wait_stream(torch.cuda.current_stream(sends[0].device))
    with torch.cuda.stream(stream):
        result = start()
    for tensor in sends:
        tensor.record_stream(stream)
    return result


def hand_over(recv: R, finish: Callable[[], Any] | None = None) -> R:
    """Make ``recv`` (one tensor or several) usable on the current stream: ``finish()`` on the communication stream, then an event wait."""
    recvs = _tensors(recv)
    stream = comm_stream(recvs[0].device) if recvs else None
    if stream is None:
        if finish is not None:
            finish()
        return recv
    if finish is not None:
        with torch.cuda.stream(stream):
            finish()  # NCCL: the current (communication) stream waits for the work
    current = torch.cuda.current_stream(recvs[0].device)
    current.wait_stream(stream)
    for tensor in recvs:
        tensor.record_stream(current)
    return recv


def count_exchange(calls: int, sent: int, received: int, wait_s: float, *, ulysses: bool = False) -> None:
    """Add one ``batch_isend_irecv`` of ``calls`` operations (``sent`` / ``received`` bytes) to the counters."""
    _STATS["p2p_calls"] += calls
    _STATS["p2p_batches"] += 1
    _STATS["bytes_sent"] += sent
    _STATS["bytes_received"] += received
    _STATS["wait_s"] += wait_s
    if ulysses:
        _STATS["ulysses_bytes_sent"] += sent


class Transfer:
    """One posted ring transfer: ``send`` goes to ``dst``, the result arrives from ``src``."""

    def __init__(self, send: torch.Tensor, dst: int, src: int, tag: int, group: Any = None) -> None:
        self._send: torch.Tensor | None = send  # keep the buffer alive until the send completes
        self.recv, self._reqs = post_on_comm_stream(send, lambda: self._start(send, dst, src, tag, group))
        nbytes = send.numel() * send.element_size()
        count_exchange(2, nbytes, nbytes, 0.0)

    @staticmethod
    def _start(send: torch.Tensor, dst: int, src: int, tag: int, group: Any) -> tuple[torch.Tensor, list]:
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, dst, group=group, tag=tag),
            dist.P2POp(dist.irecv, recv, src, group=group, tag=tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @property
    def done(self) -> bool:
        return not self._reqs

    def wait(self) -> torch.Tensor:
        """Finish both operations; return the received tensor, ready on the current stream.

        Safe to call more than once (a gloo work object must be waited exactly once).
        """
        if self._reqs:
            start = time.perf_counter()
            reqs, self._reqs = self._reqs, []
            hand_over(self.recv, lambda: [req.wait() for req in reqs])
            _STATS["wait_s"] += time.perf_counter() - start
            self._send = None
        return self.recv
