"""Failures between ranks, on plain ``torch.distributed`` (gloo on 127.0.0.1), bounded in time.

One launcher subprocess (its own session, so its whole process group is killed in ``finally``)
forks 3 ranks per scenario:

* ``checks``: the digest check that ``run_step`` makes first
  (``engine.step_checks.check_plan_agreement``) stops ranks that planned with a different seed, from
  different data, or for a different step, before any P2P, and names the ranks; a non-finite
  gradient in one rank's micro-batch stops every rank together, naming the micro-batch and its
  sequences; a step planned for 4 ranks run on 3 fails on every rank, naming both world sizes,
  instead of hanging.  Ranks that agree run the step (positive control).
* ``kill_ring``: rank 2 is SIGKILLed in the middle of a ring exchange (at its second ring
  transfer of the forward pass).
* ``kill_allreduce``: rank 2 is SIGKILLed while ranks 0 and 1 wait in the gradient all-reduce.
* ``stuck_ring``: rank 2 stays alive but stops answering in the middle of a ring exchange, so
  only the process-group timeout can end the others' wait.

In every one of these scenarios the survivors must raise a clear error
(:class:`lightning_bytescale.errors.PeerFailureError`, from ``_failure_helpers.peer_failure_guard``)
within the process-group timeout (:data:`TIMEOUT_S`), and no process may outlive the launcher.  The Lightning-level versions of
the dead/stuck peer (the same message appended by ``ByteScaleStrategy.on_exception``) are in
``tests/lightning/test_strategy_launch.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _failure_helpers import peer_failure_guard
from _lifecycle import TESTS, clean_env
from _proc import group_alive
from _ranks import free_port, init_gloo, run_ranks

HERE = Path(__file__).resolve().parent
WORLD = 3
TIMEOUT_S = 5.0  # process-group timeout of the dead/stuck peer scenarios
CHECKS_TIMEOUT_S = 30.0  # the checks scenario waits only on slow (loaded) peers, never on dead ones
SLACK_S = 6.0  # scheduling slack on a loaded 2-core machine
CAPACITY = 12
LENGTHS = (30, 5, 3, 6, 4, 7, 2, 9)  # 30 tokens need a ring of 3 at capacity 12 (without offload)
SCENARIOS = ("checks", "kill_ring", "kill_allreduce", "stuck_ring")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


# =============================================================================== rank side
def _tokens(lengths):
    import torch

    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 64, (s,), generator=g) for s in lengths]
    return lambda j: seqs[j]


def _model():
    import torch

    from lightning_bytescale.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    return LlamaModel(LlamaConfig.preset("tiny", tie_embeddings=True)).double()


def _plan(lengths=LENGTHS, world=WORLD, seed=0):
    from lightning_bytescale.planner import make_plan

    return make_plan(list(lengths), world_size=world, capacity=CAPACITY, seed=seed, offload=False).validate()


def _hand_plan():
    """Rank 0..2 share a ring over sequence 0 (item 0, run first), then local work on every rank."""
    from lightning_bytescale.planner import zigzag
    from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

    ring = (0, 1, 2)
    s = LENGTHS[0]
    ranks = [
        [MicroBatch([Piece(0, tuple(zigzag.member_ranges(s, 3, m)))], ring=ring, item=0)] for m in range(3)
    ]
    for r, seqs in enumerate(([1, 2], [3], [4, 5, 6, 7])):
        ranks[r].append(MicroBatch([Piece(j, ((0, LENGTHS[j]),)) for j in seqs]))
    return Plan(WORLD, 32, "hand", LENGTHS, ranks).validate()


def _guarded_step(model, step):
    """One engine step: run_step's digest check first, then the micro-batches and the all-reduce."""
    from lightning_bytescale.engine import run_step

    model.zero_grad(set_to_none=True)
    return run_step(model, step)


def _checks(rank: int, report: dict) -> None:
    import torch

    from lightning_bytescale.engine import StepError, build_step, default_forward
    from lightning_bytescale.engine.loss import token_loss
    from lightning_bytescale.errors import PlanDivergenceError
    from lightning_bytescale.packed_attention import comm_stats

    model = _model()
    tokens = _tokens(LENGTHS)

    # Positive control: ranks that agree run the step, ring exchange included.
    p0 = comm_stats()["p2p_calls"]
    result = _guarded_step(model, build_step(_plan(), rank, tokens, step=4))
    report["agree"] = {"loss": result.loss, "p2p": comm_stats()["p2p_calls"] - p0}

    # Divergent plans: a different seed, different data, a different step.
    variants = {
        "seed": (LENGTHS, 1 if rank == 2 else 0, 4),
        "data": (LENGTHS[:3] + (8,) + LENGTHS[4:] if rank == 1 else LENGTHS, 0, 4),
        "step": (LENGTHS, 0, 5 if rank == 0 else 4),
    }
    for name, (lengths, seed, step_no) in variants.items():
        step = build_step(_plan(lengths, seed=seed), rank, _tokens(lengths), step=step_no)
        p0 = comm_stats()["p2p_calls"]
        try:
            _guarded_step(model, step)
            report[name] = {"error": None}
        except PlanDivergenceError as err:
            report[name] = {"error": str(err), "step_error": isinstance(err, StepError)}
        report[name]["p2p"] = comm_stats()["p2p_calls"] - p0

    # A non-finite gradient (finite loss) in rank 1's local micro-batch (a ring one would spread
    # the NaN to its members' gradients through the ring backward).
    step = build_step(_hand_plan(), rank, tokens, step=4)
    poisoned = 1 if rank == 1 else -1
    assert rank != 1 or step.micro_batches[1].layout.ring is None

    def forward(m, mb):
        if mb.index != poisoned:
            return default_forward(m, mb)
        logits = m(mb.input_ids, mb.position_ids)
        logits.register_hook(lambda g: torch.full_like(g, float("nan")))
        return token_loss(logits, mb.labels, mb.num_global_tokens)

    from lightning_bytescale.engine import NonFiniteError, run_step

    for name, locate in (("nan_grad", True), ("nan_grad_once", False)):
        model.zero_grad(set_to_none=True)
        try:
            run_step(model, step, forward=forward, locate_non_finite=locate)
            report[name] = {"error": None}
        except NonFiniteError as err:
            report[name] = {"error": str(err)}
        if poisoned >= 0:
            report[name]["micro_batch"] = poisoned
            report[name]["seq_ids"] = list(step.micro_batches[poisoned].seq_ids)
            report[name]["all_seq_ids"] = [s for mb in step.micro_batches for s in mb.seq_ids]
            report[name]["last"] = len(step.micro_batches) - 1

    # Last (it may leave the group unusable): a step planned for 4 ranks, run on 3.
    step = build_step(_plan(world=WORLD + 1), rank, tokens, step=4)
    t0 = time.time()
    try:
        with peer_failure_guard(rank, CHECKS_TIMEOUT_S, "a step"):
            _guarded_step(model, step)
        report["world"] = {"error": None}
    except Exception as err:  # noqa: BLE001  (recorded and checked by the test)
        report["world"] = {"error": f"{type(err).__name__}: {err}"}
    report["world"]["seconds"] = time.time() - t0


def _dead_peer(scenario: str, rank: int, report: dict) -> None:
    import torch.distributed as dist

    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.packed_attention import ring as ring_mod

    model = _model()
    step = build_step(_hand_plan(), rank, _tokens(LENGTHS), step=0)

    def die(out_dir: str) -> None:
        Path(out_dir, f"{scenario}_death.json").write_text(json.dumps({"t": time.time(), "rank": rank}))
        os.kill(os.getpid(), signal.SIGKILL)

    out_dir = report["out"]
    if rank == WORLD - 1 and scenario in ("kill_ring", "stuck_ring"):
        original = ring_mod.Transfer
        calls = []

        def transfer(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the first transfer went out; the ring is mid-exchange
                if scenario == "stuck_ring":
                    Path(out_dir, f"{scenario}_death.json").write_text(
                        json.dumps({"t": time.time(), "rank": rank})
                    )
                    time.sleep(3600)  # alive, connections open, never answering
                die(out_dir)
            return original(*args, **kwargs)

        ring_mod.Transfer = transfer
    if rank == WORLD - 1 and scenario == "kill_allreduce":
        original_all_reduce = dist.all_reduce

        def all_reduce(*args, **kwargs):
            time.sleep(1.0)  # the others are inside the all-reduce by now
            die(out_dir)
            return original_all_reduce(*args, **kwargs)

        dist.all_reduce = all_reduce
    phase = "the gradient all-reduce" if scenario == "kill_allreduce" else "a ring exchange"
    with peer_failure_guard(rank, TIMEOUT_S, phase):
        run_step(model, step)


def _rank_main(rank: int, scenario: str, port: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    report: dict = {"rank": rank, "out": out}
    code = 0
    try:
        init_gloo(rank, WORLD, port, timeout_s=CHECKS_TIMEOUT_S if scenario == "checks" else TIMEOUT_S)
        if scenario == "checks":
            _checks(rank, report)
        else:
            _dead_peer(scenario, rank, report)
        report["exit"] = "ok"
    except BaseException as err:  # noqa: BLE001
        code = 1
        cause = err.__cause__
        report.update(
            exit="error",
            t_error=time.time(),
            error_type=type(err).__name__,
            error=str(err),
            cause=None if cause is None else f"{type(cause).__name__}: {cause}",
        )
    finally:
        Path(out, f"{scenario}_rank{rank}.json").write_text(json.dumps(report))
        sys.stdout.flush()
        os._exit(code)  # no destroy_process_group after a failure: it could wait on the dead peer


def launcher(out: str) -> None:
    """Run every scenario; forked ranks, joined with a deadline, stragglers killed and reported."""
    # imported once, before forking, so the ranks start at once
    import torch  # noqa: F401

    import lightning_bytescale.engine  # noqa: F401
    import lightning_bytescale.engine.failures  # noqa: F401
    import lightning_bytescale.engine.step_checks  # noqa: F401
    import lightning_bytescale.models  # noqa: F401
    import lightning_bytescale.packed_attention.ring  # noqa: F401
    import lightning_bytescale.planner  # noqa: F401

    os.environ["OMP_NUM_THREADS"] = "1"
    summary = {}
    for scenario in SCENARIOS:
        exits = run_ranks(
            _rank_main,
            WORLD,
            scenario,
            free_port(),
            out,
            method="fork",
            timeout_s=30 + 3 * (CHECKS_TIMEOUT_S if scenario == "checks" else TIMEOUT_S),
            check=False,
            # a stuck last rank is expected to be alive still: do not wait for it
            wait_for=range(WORLD - 1) if scenario.startswith("stuck") else None,
        )
        summary[scenario] = {"exitcodes": exits.exitcodes, "hung": exits.alive, "seconds": exits.seconds}
    Path(out, "summary.json").write_text(json.dumps(summary))


# =============================================================================== test side
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("failures_dist")
    # tests/ for the _ helpers, this folder for this module; forked ranks run its functions
    code = f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(HERE)!r}]; import test_failures_dist as t; t.launcher({str(out)!r})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: everything it forks dies with it
    )
    pgid = proc.pid
    try:
        output, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(pgid, signal.SIGKILL)
            proc.wait()
        orphans = group_alive(pgid)
        if orphans:
            os.killpg(pgid, signal.SIGKILL)
    assert proc.returncode == 0, output[-4000:]
    assert not orphans, "processes of the run outlived the launcher"
    data = {"summary": json.loads((out / "summary.json").read_text()), "output": output}
    for scenario in SCENARIOS:
        for r in range(WORLD):
            path = out / f"{scenario}_rank{r}.json"
            data[(scenario, r)] = json.loads(path.read_text()) if path.exists() else None
        death = out / f"{scenario}_death.json"
        data[(scenario, "death")] = json.loads(death.read_text()) if death.exists() else None
    return data


def test_ranks_that_agree_run_the_step_with_ring_exchanges(runs):
    assert runs["summary"]["checks"]["hung"] == []
    reports = [runs[("checks", r)] for r in range(WORLD)]
    assert all(rep is not None for rep in reports), runs["output"][-3000:]
    losses = {rep["agree"]["loss"] for rep in reports}
    assert len(losses) == 1 and all(x == x for x in losses)  # one global loss, finite
    assert all(rep["agree"]["p2p"] > 0 for rep in reports)  # the 30-token sequence ran on a ring


@pytest.mark.parametrize(
    ("variant", "odd", "rest"), [("seed", [2], [0, 1]), ("data", [1], [0, 2]), ("step", [0], [1, 2])]
)
def test_divergent_plans_stop_before_any_p2p_and_name_the_ranks(runs, variant, odd, rest):
    for r in range(WORLD):
        rep = runs[("checks", r)][variant]
        assert rep["error"] is not None, f"rank {r}: ranks with different {variant} were not stopped"
        assert f"ranks {odd} differ from ranks {rest}" in rep["error"], rep["error"]
        assert "same data, use the same seed" in rep["error"]
        assert rep["p2p"] == 0, f"rank {r} made {rep['p2p']} P2P calls before the check stopped it"
        assert rep["step_error"], "the engine's plan check must raise a StepError too"


@pytest.mark.parametrize("name", ["nan_grad", "nan_grad_once"])
def test_non_finite_gradient_stops_every_rank_and_names_the_rank(runs, name):
    bad = runs[("checks", 1)][name]
    for r in range(WORLD):
        err = runs[("checks", r)][name]["error"]
        assert err is not None, f"rank {r} stepped over a NaN gradient"
        assert "local gradients on rank(s) [1]" in err, err
    assert bad["seq_ids"]  # the poisoned micro-batch held sequences


def test_non_finite_gradient_checked_once_names_the_micro_batches_it_covered(runs):
    bad = runs[("checks", 1)]["nan_grad_once"]
    shown = list(dict.fromkeys(bad["all_seq_ids"]))[:8]
    assert f"after micro-batches 0..{bad['last']}" in bad["error"], bad["error"]
    assert f"(sequences {shown}" in bad["error"] and "locate_non_finite=True" in bad["error"]


def test_non_finite_gradient_names_the_micro_batch_and_sequences(runs):
    bad = runs[("checks", 1)]["nan_grad"]
    assert bad["micro_batch"] == 1  # the ring micro-batch 0 before it left the gradients finite
    assert f"after micro-batch {bad['micro_batch']} (sequences {bad['seq_ids']})" in bad["error"]
    assert "non-finite loss" not in bad["error"]  # the loss was finite: only the gradient is named


def test_a_step_planned_for_another_world_size_fails_on_every_rank_without_hanging(runs):
    for r in range(WORLD):
        rep = runs[("checks", r)]["world"]
        assert rep["error"] is not None, f"rank {r} ran a 4-rank plan on 3 ranks without an error"
        assert rep["seconds"] <= CHECKS_TIMEOUT_S + SLACK_S, rep


def test_a_step_planned_for_another_world_size_names_the_world_size(runs):
    for r in range(WORLD):
        error = runs[("checks", r)]["world"]["error"]
        assert error.startswith(
            "PlanWorldSizeError: Ranks [0, 1, 2] hold plans made for [4] ranks, but the run has 3"
        )
        assert "plan with the trainer's world size" in error


@pytest.mark.parametrize("scenario", ["kill_ring", "kill_allreduce", "stuck_ring"])
def test_dead_or_stuck_peer_gives_a_clear_error_within_the_timeout(runs, scenario):
    summary = runs["summary"][scenario]
    stuck = scenario.startswith("stuck")
    assert summary["hung"] == ([WORLD - 1] if stuck else []), (
        f"ranks {summary['hung']} hung after their peer failed"
    )
    assert summary["exitcodes"][WORLD - 1] == -signal.SIGKILL, summary  # killed by the test / the launcher
    death = runs[(scenario, "death")]
    assert death is not None and death["rank"] == WORLD - 1
    for r in range(WORLD - 1):
        rep = runs[(scenario, r)]
        assert rep is not None and summary["exitcodes"][r] == 1, (r, summary, rep)
        assert rep["error_type"] == "PeerFailureError", rep
        phase = "the gradient all-reduce" if scenario == "kill_allreduce" else "a ring exchange"
        assert f"rank {r}: another rank died or stopped answering during {phase}" in rep["error"]
        assert (
            f"process-group timeout {TIMEOUT_S:g} s" in rep["error"]
            and "resume from the last checkpoint" in rep["error"]
        )
        waited = rep["t_error"] - death["t"]
        assert waited <= TIMEOUT_S + SLACK_S, f"rank {r} noticed the failed peer after {waited:.1f} s"
        if stuck:  # nothing closed a connection: only the timeout ended the wait
            assert waited >= TIMEOUT_S - 1.0 and "Timed out" in rep["cause"], rep
