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


def assert_every_rank_ends_in_time(
    exits, out, scenario: str, failing: int, world: int, timeout_s: float, slack_s: float
) -> None:
    """After ``failing`` stopped (``stuck``: slept; ``dead``: exited 9): every rank ended clearly, in time.

    ``exits`` is ``_ranks.run_ranks``'s result for ranks run with ``_lifecycle.run_as_torchrun_rank``
    writing ``out/stderr_<r>.txt``, and the failing rank wrote ``out/failure.json`` (``{"t": time}``)
    just before it stopped.  The others exit 1 with the strategy's peer-failure error naming the
    timeout within the timeout plus ``slack_s``; a stuck rank is ended by its own watchdog (exit
    124) within the timeout plus the watchdog's grace for a phase that waits on peers.
    """
    import json
    from pathlib import Path

    from lightning_bytescale.engine.watchdog import EXIT_STEP_TIMEOUT

    out = Path(out)
    assert not exits.alive, (
        f"ranks {exits.alive} still running {exits.seconds:.0f} s after the start (a hang)"
    )
    failure = json.loads((out / "failure.json").read_text())["t"]
    ended = {r: (out / f"stderr_{r}.txt").stat().st_mtime for r in range(world)}
    stderr = {r: (out / f"stderr_{r}.txt").read_text() for r in range(world)}
    lateness = {r: round(t - failure, 1) for r, t in ended.items()}
    print(
        f"\n{scenario}: exit codes {exits.exitcodes}, seconds from the failure to each rank's end {lateness}"
    )
    for r in range(world):
        if r == failing:
            continue
        assert exits.exitcodes[r] == 1, f"rank {r} exited with {exits.exitcodes[r]}: {stderr[r][-3000:]}"
        assert f"[ByteScale] rank {r}: another rank died or stopped answering during" in stderr[r], stderr[r][
            -3000:
        ]
        assert (
            f"process-group timeout {timeout_s} s" in stderr[r]
            and "resume from the last checkpoint" in stderr[r]
        )
        assert lateness[r] <= timeout_s + slack_s, f"rank {r} ended {lateness[r]} s after the failure"
    if scenario == "stuck":
        assert exits.exitcodes[failing] == EXIT_STEP_TIMEOUT, (exits.exitcodes, stderr[failing][-3000:])
        assert f"rank {failing}" in stderr[failing] and "ByteScaleStrategy(timeout=...)" in stderr[failing]
        # a phase that waits on peers gives the watchdog the timeout plus its grace
        assert lateness[failing] <= timeout_s + max(30.0, timeout_s / 2) + slack_s
        # the others waited for the timeout: nothing closed a connection
        assert all(lateness[r] >= timeout_s - 1 for r in range(world) if r != failing), lateness
    else:
        assert exits.exitcodes[failing] == 9
    assert not list(out.glob("done_*"))


def run_failing_ranks(
    rank_main, scenario: str, out, *, failing: int, world: int, timeout_s: float, slack_s: float
) -> None:
    """Fork ``world`` ranks of ``rank_main(rank, scenario, port, out)`` and check :func:`assert_every_rank_ends_in_time`."""
    from _ranks import free_port, run_ranks

    exits = run_ranks(
        rank_main,
        world,
        scenario,
        str(free_port()),
        out,
        method="fork",
        timeout_s=120 + timeout_s,
        check=False,
    )
    assert_every_rank_ends_in_time(exits, out, scenario, failing, world, timeout_s, slack_s)
