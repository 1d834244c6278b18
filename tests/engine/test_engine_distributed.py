"""Whole-model HDP equivalence on gloo, float64: one start of 4 ranks, many plans.

Set-up creates the sub-world groups ``[0, 1]`` and ``[0, 1, 2]`` (on every rank, in the same
order), so HDP worlds of 2, 3 and 4 ranks run in one spawn: a plan for ``W`` ranks runs on
global ranks ``0 .. W-1`` with its gradient all-reduce on the ``W``-rank group, and its rings
use P2P on the global group, as in production.  Every case is compared with an independent
single-process reference: the same weights on each whole sequence alone, plain causal
attention, loss = sum of token cross-entropies / global token count.

The processes start once per module (fixture; forked when this process is safe to fork, else
spawned); the tests below read their per-rank JSON reports.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _mode_plans import MIXED_LENGTHS, mixed_mode_plan, mode_cost_model, modes_of
from _ranks import DistCalls, IssueOrder, gather_reports, init_gloo, save_report

from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

WORLD = 4
LENGTHS = (3, 17, 5, 40, 9, 2, 23, 11, 7, 30, 4, 13)
CAPACITY = 20
PLANNERS = ("static", "naive", "balance")
TOLERANCE = 1e-10

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


# --------------------------------------------------------------------------- plans


def _local(seqs):
    return MicroBatch([Piece(j, ((0, LENGTHS[j]),)) for j in seqs])


def _ring(seqs, ring, member, item, mode="ring"):
    n = len(ring)
    return MicroBatch(
        [Piece(j, tuple(zigzag.member_ranges(LENGTHS[j], n, member))) for j in seqs],
        ring=tuple(ring),
        item=item,
        mode=mode,
    )


def _add_ring(ranks, seqs, ring, item, mode="ring"):
    for m, r in enumerate(ring):
        ranks[r].append(_ring(seqs, ring, m, item, mode))


def mode_plan(w: int) -> Plan:
    """Ring, Ulysses and (on 4 ranks, two a node) hybrid items in one step, with local work between them.

    The tiny Llama's 4 query heads and 2 key/value heads: Ulysses items of 2 members split the
    key/value heads, items of 4 replicate them; the hybrid item splits the heads over the 2 ranks
    of each node and rings across the 2 nodes.
    """
    ranks = [[] for _ in range(w)]
    ranks[0].append(_local([0, 2]))
    if w == 2:
        _add_ring(ranks, [3, 1], (1, 0), 0, "ulysses")  # 40 and 17 tokens: not divisible by 2N
        _add_ring(ranks, [9, 6], (0, 1), 1)
        ranks[1].append(_local([7, 8, 10, 11]))
    elif w == 3:
        _add_ring(ranks, [3, 1], (2, 0), 0, "ulysses")
        _add_ring(ranks, [9], (0, 1, 2), 1)  # 3 members cannot split 4 heads: a ring
        _add_ring(ranks, [6, 11], (1, 2), 2, "ulysses")
        ranks[1].append(_local([7, 8, 10]))
    else:
        _add_ring(ranks, [3, 1], (0, 1, 2, 3), 0, "hybrid")
        _add_ring(ranks, [9], (3, 1), 1, "ulysses")
        _add_ring(ranks, [6], (2, 0), 2)
        _add_ring(ranks, [11, 7], (0, 1, 2, 3), 3, "ulysses")
        ranks[1].append(_local([8]))
        ranks[3].append(_local([10]))
    ranks[0].append(_local([4, 5]))
    return Plan(w, 64, "hand", LENGTHS, ranks, {"ranks_per_node": 2}).validate()


def hand_plans(w: int) -> dict[str, Plan]:
    """Plans with deliberately unequal micro-batch counts, rings in scrambled rank order, and
    (for W >= 3) a rank that runs no micro-batch at all."""
    plans = {}
    ranks = [[] for _ in range(w)]
    ranks[0].append(_local([0, 2]))  # rank 0 starts with local work; its ring peers wait at item 0
    _add_ring(ranks, [3, 1], tuple(reversed(range(w))), item=0)  # 40 and 17 tokens: not divisible by 2N
    _add_ring(ranks, [9, 6], (w - 1, 0), item=1)
    ranks[0] += [_local([4, 5]), _local([7])]
    ranks[1].append(_local([8, 10, 11]))
    plans["unequal"] = Plan(w, 64, "hand", LENGTHS, ranks)
    plans["modes"] = mode_plan(w)
    if w >= 3:
        ranks = [[] for _ in range(w)]
        _add_ring(ranks, [3, 1, 9], (1, 0) + tuple(range(2, w - 1)), item=5)
        ranks[0] += [_local([0, 2, 4]), _local([5, 6])]
        ranks[1] += [_local([7, 8, 10, 11])]
        plans["idle_rank"] = Plan(w, 64, "hand", LENGTHS, ranks)
    for p in plans.values():
        p.validate()
    return plans


def planner_plans(w: int) -> dict[str, Plan]:
    try:
        from lightning_bytescale.planner import make_plan
    except ImportError:
        return {}
    return {
        name: make_plan(list(LENGTHS), world_size=w, capacity=CAPACITY, planner=name, seed=0)
        for name in PLANNERS
    }


def planner_mode_plans() -> dict[str, Plan]:
    """``balance``'s own plans under a cost model with heads (4 ranks, 2 a node): with the tiny
    Llama's 2 key/value heads on this file's batch it runs rings of 2 and a hybrid item of 4
    (``_mode_plans``: a Ulysses item of 2 moves a ring's bytes there, ties go to the ring); with 4
    key/value heads on ``MIXED_LENGTHS`` a ring, Ulysses items of 2 and 4 and a hybrid item."""
    from lightning_bytescale.planner import make_plan

    gqa = make_plan(list(LENGTHS), world_size=WORLD, capacity=16, cost_model=mode_cost_model(kv_heads=2))
    return {"gqa": gqa.validate(), "mha": mixed_mode_plan(kv_heads=4)}


# --------------------------------------------------------------------------- worker


def _tokens(lengths=LENGTHS):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 64, (s,), generator=g) for s in lengths]


def _model(reference: bool, kv_heads: int = 2):
    from lightning_bytescale.engine.reference import causal_attention
    from lightning_bytescale.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig.preset("tiny", tie_embeddings=True, kv_heads=kv_heads)
    return LlamaModel(cfg, attention_fn=causal_attention if reference else None).double()


# the torch.distributed entry points a rank's DistCalls counts (P2POp's isend/irecv stay unwrapped:
# P2POp checks their identity)
COUNTED = (
    "all_reduce",
    "all_gather",
    "broadcast",
    "barrier",
    "reduce_scatter",
    "all_reduce_coalesced",
    "batch_isend_irecv",
    "send",
    "recv",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
)


def _diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _per_mb_mean_forward(model, mb):
    """The WRONG normalisation (per-micro-batch token mean) for the negative test."""
    logits = model(mb.input_ids, mb.position_ids)
    keep = mb.labels != -100
    return F.cross_entropy(logits[keep], mb.labels[keep], reduction="sum") / max(int(keep.sum()), 1)


def _run_case(model, plan, rank, tokens, group, counters, ref_grads, ref_loss, forward=None, **options):
    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.packed_attention import comm_stats

    model.zero_grad(set_to_none=True)
    step = build_step(plan, rank, lambda j: tokens[j])
    p2p: list[dict] = []

    @contextlib.contextmanager
    def watch(mb):
        c0, s0 = comm_stats(), counters.snapshot()
        yield
        c1, s1 = comm_stats(), counters.snapshot()
        p2p.append(
            {
                "local": mb.layout.is_local,
                "ring": mb.layout.ring_size,
                "mode": mb.layout.mode,
                "attention_p2p": c1["p2p_calls"] - c0["p2p_calls"],
                "bytes_sent": c1["bytes_sent"] - c0["bytes_sent"],
                "dist_p2p": s1["batch_isend_irecv"] - s0["batch_isend_irecv"] + s1["send"] - s0["send"],
            }
        )

    before = counters.snapshot()
    start = time.perf_counter()
    result = run_step(model, step, group=group, micro_batch_context=watch, forward=forward, **options)
    seconds = time.perf_counter() - start
    calls = _diff(counters.snapshot(), before)
    grad_err = max((p.grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
    return {
        "grad_err": grad_err,
        "loss_err": abs(result.loss - ref_loss),
        "counts": [len(r) for r in plan.ranks],
        "micro_batches": result.num_micro_batches,
        "collectives": {k: v for k, v in calls.items() if k not in ("batch_isend_irecv", "send", "recv")},
        "p2p": p2p,
        "busy_len": len(result.busy_seconds),
        "seconds": seconds,
    }


def _train_steps(rank: int, counters: DistCalls, steps: int = 3) -> dict:
    """Three AdamW steps on fresh global batches (balance plans, 4 ranks) against one process."""
    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.engine.reference import reference_loss
    from lightning_bytescale.planner import make_plan

    ref, model = _model(reference=True), _model(reference=False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(99)
    diffs, all_reduces = [], 0
    for _ in range(steps):
        lengths = [int(x) for x in torch.randint(2, 48, (10,), generator=g)]
        seqs = [torch.randint(0, 64, (s,), generator=g) for s in lengths]
        opt_ref.zero_grad(set_to_none=True)
        reference_loss(ref, seqs).backward()
        opt_ref.step()
        plan = make_plan(lengths, world_size=WORLD, capacity=CAPACITY, planner="balance", seed=0)
        opt.zero_grad(set_to_none=True)
        before = counters.calls["all_reduce"]
        run_step(model, build_step(plan, rank, lambda j, seqs=seqs: seqs[j]))
        all_reduces += counters.calls["all_reduce"] - before
        opt.step()
        diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    return {"param_diff": diffs, "all_reduces": all_reduces, "steps": steps}


def _mode_steps(rank: int, steps: int = 2) -> dict:
    """AdamW steps of the 4-rank mixed-mode plan (ring, Ulysses and hybrid items in one step) against
    one process, every micro-batch offloading all its layers' activations (host copies on a CPU)."""
    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.engine.reference import reference_loss
    from lightning_bytescale.offload import ActivationOffloader

    ref, model = _model(reference=True), _model(reference=False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offloader = ActivationOffloader(model.blocks, keep_last=0, min_bytes=0)
    tokens, plan = _tokens(), mode_plan(WORLD)
    diffs, offloaded = [], []
    for _ in range(steps):
        opt_ref.zero_grad(set_to_none=True)
        reference_loss(ref, tokens).backward()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        before = offloader.stats.offloaded_bytes
        run_step(
            model,
            build_step(plan, rank, lambda j: tokens[j]),
            micro_batch_context=lambda mb: offloader.context(mb.index, 1.0),
        )
        offloaded.append(offloader.stats.offloaded_bytes - before)
        opt.step()
        diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    moved = max(
        (p - q).abs().max().item() for p, q in zip(ref.parameters(), _model(reference=True).parameters())
    )
    return {"param_diff": diffs, "offloaded": offloaded, "moved": moved}


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine import NonFiniteError, StepError
    from lightning_bytescale.engine.reference import reference_loss

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    # Set-up: every group this run will ever use, on every rank, in the same order.
    groups = {w: dist.new_group(list(range(w))) for w in range(2, WORLD)}
    groups[WORLD] = None
    grad_group = dist.new_group(list(range(WORLD)))  # the bucketed gradient sync's own group
    pg_setup = len(dist.distributed_c10d._world.pg_map)
    counters = DistCalls(COUNTED)

    tokens = _tokens()
    ref = _model(reference=True)
    loss = reference_loss(ref, tokens)
    loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    ref_loss = loss.item()
    model = _model(reference=False)

    report: dict = {"cases": {}, "errors": {}}
    for w in range(2, WORLD + 1):
        if rank >= w:
            continue
        plans = {**hand_plans(w), **planner_plans(w)}
        for name, plan in plans.items():
            report["cases"][f"{name}/{w}"] = _run_case(
                model, plan, rank, tokens, groups[w], counters, ref_grads, ref_loss
            )
    # balance's own plans with Ulysses and hybrid items (a cost model with heads), through the engine
    plans = planner_mode_plans()
    report["cases"]["planner_modes_gqa/4"] = _run_case(
        model, plans["gqa"], rank, tokens, None, counters, ref_grads, ref_loss
    )
    mha_tokens = _tokens(MIXED_LENGTHS)
    mha_ref = _model(reference=True, kv_heads=4)
    mha_loss = reference_loss(mha_ref, mha_tokens)
    mha_loss.backward()
    mha_grads = {n: p.grad.detach().clone() for n, p in mha_ref.named_parameters()}
    report["cases"]["planner_modes_mha/4"] = _run_case(
        _model(reference=False, kv_heads=4), plans["mha"], rank, mha_tokens, None, counters, mha_grads,
        mha_loss.item(),
    )  # fmt: skip
    report["training"] = _train_steps(rank, counters)
    report["mode_steps"] = _mode_steps(rank)
    # The same plans with the bucketed gradient sync overlapped with the last backward (small
    # buckets, so a step has several and some launch during the backward).
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    sync = BucketedGradSync(list(model.parameters()), group=grad_group, bucket_bytes=4096)
    report["bucketed"] = {"buckets": len(sync.buckets), "cases": {}, "launched_in_backward": 0}
    order = IssueOrder(grad_group)  # the kinds of communication in the order this rank issues them
    for name, plan in {**hand_plans(WORLD), **planner_plans(WORLD)}.items():
        order.start()
        case = _run_case(model, plan, rank, tokens, None, counters, ref_grads, ref_loss, grad_sync=sync)
        mine = plan.ranks[rank]
        case["issued"] = list(order.log)
        case["last"] = "none" if not mine else ("local" if mine[-1].ring is None else "ring")
        case["launched_in_backward"] = sync.launched_in_backward
        report["bucketed"]["cases"][name] = case
        report["bucketed"]["launched_in_backward"] += sync.launched_in_backward
    order.stop()
    report["bucketed"]["extra_bytes"] = sync.extra_bytes
    sync.close()
    unequal = (model, hand_plans(WORLD)["unequal"], rank, tokens, None, counters, ref_grads, ref_loss)
    # Negative test: the per-micro-batch mean must break the equivalence.
    report["negative"] = _run_case(*unequal, _per_mb_mean_forward)
    # Without the digest check a step makes the gradient all-reduce and no other collective.
    report["unchecked"] = _run_case(*unequal, check_plan=False)
    # Ranks that run different plans fail together, fast, with a clear error (no hang): at the
    # digest check, and (with the check off) at the token count the all-reduce carries.
    ranks = [[_local([j for j in range(len(LENGTHS)) if j % WORLD == r])] for r in range(WORLD)]
    if rank == 1:  # rank 1's copy of the plan also lists sequence 0, which rank 0 holds
        ranks[1][0].pieces.append(Piece(0, ((0, LENGTHS[0]),)))
    diverged = Plan(WORLD, 256, "hand", LENGTHS, ranks)
    for key, check_plan in (("diverged", True), ("diverged_unchecked", False)):
        before = counters.snapshot()
        try:
            _run_case(
                model, diverged, rank, tokens, None, counters, ref_grads, ref_loss, check_plan=check_plan
            )
        except StepError as err:
            report["errors"][key] = f"{type(err).__name__}: {err}"
        report["errors"][key + "_calls"] = _diff(counters.snapshot(), before)

    # A non-finite loss on one rank stops every rank with the same clear error.
    def poisoned(m, mb):
        from lightning_bytescale.engine import default_forward

        loss = default_forward(m, mb)
        return loss * float("inf") if rank == 2 else loss

    try:
        _run_case(
            model, hand_plans(WORLD)["unequal"], rank, tokens, None, counters, ref_grads, ref_loss, poisoned
        )
    except NonFiniteError as err:
        report["errors"]["non_finite"] = str(err)
    report["pg_setup"] = pg_setup
    report["pg_end"] = len(dist.distributed_c10d._world.pg_map)
    report["group_calls"] = {
        k: counters.calls[k] for k in ("new_group", "new_subgroups", "new_subgroups_by_enumeration")
    }
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("engine_dist"), _worker, WORLD, timeout_s=200)


def _cases(reports, prefix=""):
    for rank, rep in enumerate(reports):
        for name, case in rep["cases"].items():
            if name.startswith(prefix):
                yield rank, name, case


@pytest.mark.parametrize("w", [2, 3, 4])
def test_hand_plans_with_unequal_micro_batch_counts_match_single_process(reports, w):
    seen = 0
    for rank, name, case in _cases(reports):
        if not name.endswith(f"/{w}") or name.split("/")[0] not in ("unequal", "idle_rank"):
            continue
        seen += 1
        assert len(set(case["counts"])) > 1, f"{name}: the plan must give ranks different micro-batch counts"
        assert case["grad_err"] <= TOLERANCE, f"{name} rank {rank}: grad error {case['grad_err']:.3e}"
        assert case["loss_err"] <= 1e-12, f"{name} rank {rank}: loss error {case['loss_err']:.3e}"
        assert case["micro_batches"] == case["counts"][rank]
    assert seen == w * (2 if w >= 3 else 1)
    if w >= 3:
        assert 0 in reports[0]["cases"][f"idle_rank/{w}"]["counts"]


@pytest.mark.parametrize("w", [2, 3, 4])
def test_plans_with_ulysses_and_hybrid_items_match_single_process(reports, w):
    """Ring, Ulysses and hybrid items in one micro-batch loop: gradients and loss equal one process."""
    plan = mode_plan(w)
    for rank in range(w):
        case = reports[rank]["cases"][f"modes/{w}"]
        assert case["grad_err"] <= TOLERANCE, f"modes/{w} rank {rank}: grad error {case['grad_err']:.3e}"
        assert case["loss_err"] <= 1e-12, f"modes/{w} rank {rank}: loss error {case['loss_err']:.3e}"
        modes = [mb.mode for mb in plan.ranks[rank] if mb.ring is not None]
        assert [mb["attention_p2p"] > 0 for mb in case["p2p"]] == [
            mb.ring is not None for mb in plan.ranks[rank]
        ]
        if rank == 0:
            assert "ulysses" in modes and "ring" in modes and (w < 4 or "hybrid" in modes), modes


def _item_bytes(plan: Plan) -> dict[str, float]:
    """Bytes the plan's ring items send in one step, per mode, as the engine sends them: Ulysses
    exchanges as the plan's cost model counts them (``Plan.mode_stats``), rings (a hybrid's ring
    across nodes too) one dK/dV hop more than its ``comm_passes = 3`` (the accumulated gradient
    returns to its owner: ``3 R - 2`` transfers per member of a ring of ``R``, not ``3 (R - 1)``)."""
    from lightning_bytescale.planner import CostModel
    from lightning_bytescale.planner.modes import group_layout

    cost = CostModel.from_json_dict(plan.options["cost_model"])
    rpn = plan.options["ranks_per_node"]
    hop = lambda r: (3 * r - 2) / (3 * (r - 1))  # noqa: E731
    out = dict.fromkeys(("ring", "ulysses", "hybrid"), 0.0)
    items = {mb.item: mb for mbs in plan.ranks for mb in mbs if mb.ring is not None}
    for mb in items.values():
        lengths, n = [plan.lengths[p.seq] for p in mb.pieces], len(mb.ring)
        if mb.mode == "ring":
            out["ring"] += cost.ring_bytes(lengths, n) * hop(n)
        elif mb.mode == "ulysses":
            out["ulysses"] += cost.ulysses_bytes(lengths, n)
        else:
            u = group_layout(mb.ring, rpn).per_node
            ring, exchange = cost.hybrid_bytes(lengths, n, u)
            out["hybrid"] += ring * hop(n // u) + exchange
    return out


@pytest.mark.parametrize("heads", ["gqa", "mha"])
def test_the_planners_mode_plans_run_exactly_through_the_engine(reports, heads):
    """balance's plans with a cost model with heads: the modes it chose, gradients and loss equal to
    one process (the engine's hybrid groups come from the plan's ``ranks_per_node``), and the bytes
    every mode sent, summed over the members, what the plan's cost model says."""
    plan = planner_mode_plans()[heads]
    modes = modes_of(plan)
    if heads == "mha":
        assert {m for m, _ in modes} == {"ring", "ulysses", "hybrid"}, modes
    else:
        assert {m for m, _ in modes} == {"ring", "hybrid"}, modes
    sent = dict.fromkeys(("ring", "ulysses", "hybrid"), 0)
    for rank in range(WORLD):
        case = reports[rank]["cases"][f"planner_modes_{heads}/{WORLD}"]
        assert case["grad_err"] <= TOLERANCE, f"{heads} rank {rank}: grad error {case['grad_err']:.3e}"
        assert case["loss_err"] <= 1e-12, f"{heads} rank {rank}: loss error {case['loss_err']:.3e}"
        mine = plan.ranks[rank]
        assert [(mb["local"], mb["mode"]) for mb in case["p2p"]] == [(m.ring is None, m.mode) for m in mine]
        for mb in case["p2p"]:
            if not mb["local"]:
                sent[mb["mode"]] += mb["bytes_sent"]
    assert sent == pytest.approx(_item_bytes(plan), rel=1e-12), (sent, _item_bytes(plan))
    planned = plan.mode_stats()["comm_bytes"]
    assert sent["ulysses"] == planned["ulysses"]  # telemetry's Ulysses bytes are the bytes sent


def test_mixed_mode_adamw_steps_with_offload_equal_one_process(reports):
    for rep in reports:
        steps = rep["mode_steps"]
        assert max(steps["param_diff"]) <= TOLERANCE, steps["param_diff"]
        assert all(b > 0 for b in steps["offloaded"]), steps["offloaded"]  # activations went through the host
        assert steps["moved"] > 1e-3  # the steps moved the parameters


@pytest.mark.parametrize("planner", PLANNERS)
def test_planner_plans_match_single_process(reports, planner):
    found = list(_cases(reports, planner + "/"))
    if not found:
        pytest.skip("lightning_bytescale.planner.make_plan not available")
    assert {name for _, name, _ in found} == {f"{planner}/{w}" for w in (2, 3, 4)}
    if planner == "balance":  # the balance scheduler gives ranks different micro-batch counts here
        assert any(len(set(case["counts"])) > 1 for _, _, case in found)
    for rank, name, case in found:
        assert case["grad_err"] <= TOLERANCE, f"{name} rank {rank}: grad error {case['grad_err']:.3e}"
        assert case["loss_err"] <= 1e-12, f"{name} rank {rank}: loss error {case['loss_err']:.3e}"


def test_bucketed_gradient_sync_equals_one_process_and_overlaps_the_last_backward(reports):
    for rep in reports:
        bucketed = rep["bucketed"]
        assert bucketed["buckets"] > 3, bucketed["buckets"]
        assert bucketed["extra_bytes"] == 0  # float64 gradients are the buckets: no copy
        for name, case in bucketed["cases"].items():
            assert case["grad_err"] <= 1e-10, (name, case["grad_err"])
            assert case["loss_err"] <= 1e-12, (name, case["loss_err"])
            # buckets + one small all-reduce of the scalars; the digest all-gather
            assert case["collectives"]["all_reduce"] == bucketed["buckets"] + 1, (name, case["collectives"])
    assert any(rep["bucketed"]["launched_in_backward"] > 0 for rep in reports)


def test_every_ring_transfer_is_issued_before_any_gradient_bucket_on_every_rank(reports):
    """The cross-communicator rule (docs/engine.md): on every rank the plan check, then all ring
    transfers, then the buckets, then the scalars -- with rings last on some ranks, where the
    buckets wait for the ring's backward, while ranks ending on local work still launch them
    from that backward's hooks."""
    seen = {"local": 0, "ring": 0, "none": 0}
    for rank, rep in enumerate(reports):
        buckets = rep["bucketed"]["buckets"]
        for name, case in rep["bucketed"]["cases"].items():
            issued = case["issued"]
            assert IssueOrder.follows_the_rule(issued), (name, rank, " ".join(issued))
            assert issued[0] == "plan" and issued.count("plan") == 1, (name, rank, issued)
            assert issued.count("bucket") == buckets and issued[-1:] == ["scalars"], (name, rank, issued)
            assert ("p2p" in issued) == any(not mb["local"] for mb in case["p2p"]), (name, rank)
            seen[case["last"]] += 1
            if case["last"] == "ring":
                assert case["launched_in_backward"] == 0, (name, rank)  # none during the ring's backward
    assert seen["ring"] > 0 and seen["local"] > 0, seen
    # where the last backward is local its hooks still launch buckets (the overlap is kept)
    assert any(
        case["launched_in_backward"] > 0
        for rep in reports
        for case in rep["bucketed"]["cases"].values()
        if case["last"] == "local"
    )


def test_exactly_one_gradient_all_reduce_and_one_digest_all_gather_per_step(reports):
    n = 0
    for rank, name, case in _cases(reports):
        expected = {"all_gather": 1, "all_reduce": 1}
        assert case["collectives"] == expected, f"{name} rank {rank}: {case['collectives']}"
        assert case["busy_len"] == int(name.split("/")[1])
        n += 1
    assert n > 0
    for rank, rep in enumerate(reports):  # check_plan=False: the gradient all-reduce alone
        assert rep["unchecked"]["collectives"] == {"all_reduce": 1}, (rank, rep["unchecked"])
        assert rep["unchecked"]["grad_err"] <= TOLERANCE


def test_local_micro_batches_make_no_p2p_and_rings_do(reports):
    local = ring = 0
    for rank, name, case in _cases(reports):
        for mb in case["p2p"]:
            if mb["local"]:
                local += 1
                assert mb["attention_p2p"] == 0 and mb["dist_p2p"] == 0, f"{name} rank {rank}: {mb}"
            else:
                ring += 1
                assert mb["attention_p2p"] > 0 and mb["dist_p2p"] > 0, f"{name} rank {rank}: {mb}"
    assert local > 0 and ring > 0


def test_no_process_group_created_after_set_up(reports):
    for rep in reports:
        assert rep["pg_end"] == rep["pg_setup"]
        assert all(v == 0 for v in rep["group_calls"].values()), rep["group_calls"]


def test_per_micro_batch_mean_breaks_the_equivalence(reports):
    for rep in reports:
        assert rep["negative"]["grad_err"] > 1e-4
        assert rep["negative"]["loss_err"] > 1e-3


def test_ranks_running_different_plans_or_non_finite_losses_fail_together(reports):
    for rep in reports:
        errors = rep["errors"]
        # the digest check stops them before any micro-batch (no P2P, no all-reduce) ...
        assert errors.get("diverged", "").startswith("PlanDivergenceError: "), errors
        assert "ranks [1] differ from ranks [0, 2, 3]" in errors["diverged"]
        assert errors["diverged_calls"] == {"all_gather": 1}, errors
        # ... and without it, the token count in the one all-reduce does
        assert "different plans" in errors.get("diverged_unchecked", ""), errors
        assert errors["diverged_unchecked_calls"] == {"all_reduce": 1}, errors
        assert "loss on rank(s) [2]" in errors.get("non_finite", "")


def test_several_optimizer_steps_track_single_process_training(reports):
    for rep in reports:
        train = rep["training"]
        assert train["all_reduces"] == train["steps"]
        assert max(train["param_diff"]) <= TOLERANCE, train["param_diff"]
