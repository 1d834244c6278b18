"""ZeRO levels 0, 1 and 2: float64 equivalence with one process, sharded gradients, clipping, resume.

* One start of 3 gloo ranks runs the engine's step (:func:`~lightning_bytescale.engine.executor.run_step`)
  for 2 and 3 ranks (odd partitions), every ZeRO level, bucketed and flat sync, three AdamW
  steps with gradient clipping each, against an independent single-process reference (whole
  sequences, plain causal attention, ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``).
  Under ZeRO-2 it also checks that after the sync a rank holds exactly the gradients of the
  parameters whose optimizer state it owns (and the bytes of just those).
* Under a ``Trainer`` (fork launcher): ZeRO-2 with ``gradient_clip_val`` by norm and by value
  equals the reference, each rank holds only its shard when clipping starts, and a checkpoint
  saved on 3 ranks resumes on 2 ranks exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _ranks import DistCalls, gather_reports, init_gloo, save_report
from _strategy_helpers import (
    CAPACITY,
    Recorder,
    StepDataModule,
    TinyLM,
    quiet_trainer,
    read_rows,
    reference,
    step_checkpoints,
)

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.engine.grad_sync import BucketedGradSync
from lightning_bytescale.engine.zero import resolve_zero_level
from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

WORLD = 3
ENGINE_CAPACITY = 20
ENGINE_LR = 1e-2
ENGINE_STEPS = 3
CLIP_NORM = 0.05  # below every step's gradient norm here, so clipping always acts
CLIP_VALUE = 2e-3  # below the largest gradient entries here
TOLERANCE = 1e-12

CASES = [(w, zero, sync, "norm") for w in (2, 3) for zero in (0, 1, 2) for sync in ("bucketed", "flat")] + [
    (3, 2, "bucketed", "value"),
    (2, 2, "flat", "value"),
]


# ----------------------------------------------------------------------------- options
def test_zero_option_values_and_the_zero1_alias():
    assert ByteScaleStrategy().zero == 0 and not ByteScaleStrategy().zero1
    assert ByteScaleStrategy(zero1=True).zero == 1
    assert ByteScaleStrategy(zero=1, zero1=True).zero == 1
    assert ByteScaleStrategy(zero=2).zero == 2 and ByteScaleStrategy(zero=2).zero1  # optimizer state sharded
    assert resolve_zero_level(0, False) == 0
    for bad in (3, -1, True, "2", 1.0):
        with pytest.raises(ConfigError, match=r"zero must be 0 \(no sharding\), 1 .* or 2 .*got"):
            ByteScaleStrategy(zero=bad)
    with pytest.raises(ConfigError, match=r"zero1=True contradicts zero=2.*Pass only zero"):
        ByteScaleStrategy(zero=2, zero1=True)
    with pytest.raises(ConfigError, match=r"zero1=False contradicts zero=1"):
        ByteScaleStrategy(zero=1, zero1=False)
    with pytest.raises(ConfigError, match="zero1 must be True or False"):
        ByteScaleStrategy(zero1="yes")


def test_hydra_schema_passes_zero_to_the_strategy():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_bytescale.recipes.schema import StrategyConfig

    cfg = OmegaConf.structured(StrategyConfig)
    assert cfg.zero == 0 and cfg.zero1 is None
    cfg.zero = 2
    cfg.seed = 0
    strategy = instantiate(cfg)
    assert isinstance(strategy, ByteScaleStrategy) and strategy.zero == 2


# ----------------------------------------------------------------------------- one process
def _small_model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(8, 64), torch.nn.Linear(64, 2), torch.nn.Linear(2, 2)
    ).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_owner_buckets_hold_one_owner_each_in_backward_order_and_non_owners_free_theirs(dtype):
    """Without a process group this process is rank 0: buckets owned by 'rank 1' are released."""
    model = _small_model(dtype)
    params = list(model.parameters())
    owners = {id(p): i % 2 for i, p in enumerate(params)}  # interleaved owners
    sync = BucketedGradSync(params, bucket_bytes=2**20, owners=owners)
    assert all(len({owners[id(p)] for p in b.params}) == 1 for b in sync.buckets)
    assert {b.owner for b in sync.buckets} == {0, 1}
    backward = {id(p): i for i, p in enumerate(reversed(params))}
    last = [max(backward[id(p)] for p in b.params) for b in sync.buckets]
    assert last == sorted(last)  # launched in the order they become final
    ref = _small_model(dtype)
    for _ in range(2):  # two steps: released buffers come back zeroed
        model.zero_grad(set_to_none=True)
        sync.prepare()
        x = torch.randn(3, 8, dtype=dtype)
        sync.arm()
        model(x).square().sum().backward()
        sync.finish()
        ref.zero_grad(set_to_none=True)
        ref(x).square().sum().backward()
        for p, q in zip(params, ref.parameters()):
            if owners[id(p)] == 0:
                assert torch.equal(p.grad, q.grad)
            else:
                assert p.grad is None
        owned = sum(p.numel() * p.element_size() for p in params if owners[id(p)] == 0)
        assert sync.gradient_bytes == owned
        assert sync.extra_bytes == 0  # no float32 copy of a narrow bucket outlives the sync
    sync.close()


def test_without_owners_the_buckets_are_unchanged():
    model = _small_model()
    params = list(model.parameters())
    plain = BucketedGradSync(params, bucket_bytes=8 * 64 * 8)
    same = BucketedGradSync(params, bucket_bytes=8 * 64 * 8, owners=None)
    assert [[id(p) for p in b.params] for b in plain.buckets] == [
        [id(p) for p in b.params] for b in same.buckets
    ]
    assert [id(p) for b in plain.buckets for p in b.params] == [id(p) for p in reversed(params)]
    assert all(b.owner is None for b in plain.buckets)
    plain.close()
    same.close()


# ----------------------------------------------------------------------------- engine, 2 and 3 ranks
def _engine_model(reference: bool) -> torch.nn.Module:
    from lightning_bytescale.engine.reference import causal_attention

    torch.manual_seed(0)
    return LlamaModel(
        LlamaConfig.preset("tiny"), attention_fn=causal_attention if reference else None
    ).double()


def _engine_batches() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(ENGINE_STEPS):
        lengths = [int(x) for x in torch.randint(2, 41, (10,), generator=g)]  # a ring fits 2 ranks
        batches.append([torch.randint(0, 64, (s,), generator=g) for s in lengths])
    return batches


def _engine_reference(algorithm: str) -> tuple[list[torch.Tensor], list[float], int]:
    """One process: AdamW steps on whole sequences with torch's own clipping."""
    from lightning_bytescale.engine.reference import reference_loss

    model = _engine_model(reference=True)
    opt = torch.optim.AdamW(model.parameters(), lr=ENGINE_LR)
    norms, clipped = [], 0
    for seqs in _engine_batches():
        opt.zero_grad(set_to_none=True)
        reference_loss(model, seqs).backward()
        if algorithm == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)))
        else:
            clipped += sum(int((p.grad.abs() > CLIP_VALUE).sum()) for p in model.parameters())
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms, clipped


def _engine_case(rank, w, zero, sync_kind, algorithm, group, grad_group, counter, expected) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_bytescale.engine import build_step, run_step
    from lightning_bytescale.engine.zero import clip_grad_norm_, drop_unowned_gradients, owner_ranks
    from lightning_bytescale.planner import make_plan

    model = _engine_model(reference=False)
    params = list(model.parameters())
    if zero == 0:
        opt = torch.optim.AdamW(params, lr=ENGINE_LR)
    else:
        opt = ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, process_group=group, lr=ENGINE_LR
        )
    owners = owner_ranks([opt]) if zero == 2 else {}
    sync = None
    if sync_kind == "bucketed":
        sync = BucketedGradSync(params, group=grad_group, bucket_bytes=20_000, owners=owners or None)
    report: dict = {"held_ok": [], "gradient_bytes": [], "owned_bytes": [], "norms": [], "calls": []}
    for seqs in _engine_batches():
        opt.zero_grad(set_to_none=True)
        plan = make_plan(
            [len(s) for s in seqs], world_size=w, capacity=ENGINE_CAPACITY, planner="balance", seed=0
        )
        before = dict(counter.calls)
        run_step(model, build_step(plan, rank, lambda j, seqs=seqs: seqs[j]), group=group, grad_sync=sync)
        if zero == 2 and sync is None:
            drop_unowned_gradients(params, owners, rank)
        if zero == 2:  # the memory claim: exactly this rank's shard of the gradients is held
            held = {id(p) for p in params if p.grad is not None}
            mine = {id(p) for p in params if owners[id(p)] == rank}
            report["held_ok"].append(held == mine)
            report["owned_bytes"].append(sum(p.numel() * p.element_size() for p in params if id(p) in mine))
            if sync is not None:
                report["gradient_bytes"].append(sync.gradient_bytes)
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
        elif zero == 2:
            report["norms"].append(float(clip_grad_norm_(params, CLIP_NORM, group=group)))
        else:
            report["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)))
        report["calls"].append({k: counter.calls[k] - before[k] for k in counter.calls})
        opt.step()
    report["buckets"] = len(sync.buckets) if sync is not None else 0
    report["param_err"] = max((p.detach() - q).abs().max().item() for p, q in zip(params, expected))
    if sync is not None:
        sync.close()
    return report


def _engine_worker(rank: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    # every group on every rank, in the same order: steps of a 2-rank world run on ranks 0 and 1
    groups = {2: dist.new_group([0, 1]), 3: None}
    grad_groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2])}
    counter = DistCalls(("reduce", "all_reduce"))  # the gradient sync looks them up on dist
    references = {algorithm: _engine_reference(algorithm) for algorithm in ("norm", "value")}
    report: dict = {
        "reference_norms": references["norm"][1],
        "reference_clipped": references["value"][2],
        "cases": {},
    }
    for w, zero, sync_kind, algorithm in CASES:
        if rank >= w:
            continue
        expected = references[algorithm][0]
        report["cases"][f"{w}/{zero}/{sync_kind}/{algorithm}"] = _engine_case(
            rank, w, zero, sync_kind, algorithm, groups[w], grad_groups[w], counter, expected
        )
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def engine_reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("zero_engine"), _engine_worker, WORLD, timeout_s=200)


@pytest.mark.multiprocess
def test_every_zero_level_equals_one_process_with_clipping(engine_reports):
    ref_norms = engine_reports[0]["reference_norms"]
    assert all(n > CLIP_NORM for n in ref_norms), ref_norms  # clipping by norm acts in every step
    assert engine_reports[0]["reference_clipped"] > 0  # and clipping by value changes some entries
    seen = set()
    for rank, rep in enumerate(engine_reports):
        for name, case in rep["cases"].items():
            seen.add(name)
            assert case["param_err"] <= TOLERANCE, (
                f"{name} rank {rank}: parameters differ by {case['param_err']:.3e}"
            )
            if name.endswith("/norm"):  # the norm clipping used: the whole gradient's, as in one process
                assert case["norms"] == pytest.approx(ref_norms, rel=1e-12), (name, rank)
    assert seen == {"/".join(map(str, c)) for c in CASES}


@pytest.mark.multiprocess
def test_zero2_non_owners_hold_no_gradient_after_the_sync(engine_reports):
    for w in (2, 3):
        for sync_kind in ("bucketed", "flat"):
            name = f"{w}/2/{sync_kind}/norm"
            owned = [engine_reports[r]["cases"][name]["owned_bytes"][0] for r in range(w)]
            assert sum(owned) == sum(p.numel() * 8 for p in _engine_model(False).parameters())
            assert all(0 < b < sum(owned) for b in owned), owned  # every rank owns a real shard
            for rank in range(w):
                case = engine_reports[rank]["cases"][name]
                assert all(case["held_ok"]), (name, rank, case["held_ok"])
                if sync_kind == "bucketed":  # the sync's buffers hold this rank's shard, nothing more
                    assert case["gradient_bytes"] == case["owned_bytes"], (name, rank)


@pytest.mark.multiprocess
def test_zero2_reduces_to_owners_instead_of_all_reducing(engine_reports):
    for w in (2, 3):
        for rank in range(w):
            zero2 = engine_reports[rank]["cases"][f"{w}/2/bucketed/norm"]
            zero0 = engine_reports[rank]["cases"][f"{w}/0/bucketed/norm"]
            for calls in zero2["calls"]:  # one reduce per bucket; all-reduces: the scalars and the norm
                assert calls == {"reduce": zero2["buckets"], "all_reduce": 2}, calls
            assert len(zero0["calls"]) >= 2
            for step, calls in enumerate(zero0["calls"]):
                # every bucket all-reduced, then the step's scalars in one all-reduce of their own
                assert calls == {"reduce": 0, "all_reduce": zero0["buckets"] + 1}, (step, calls)


# ----------------------------------------------------------------------------- under a Trainer
class ShardProbe(pl.Callback):
    """Before clipping and the step: the parameters this rank holds a gradient for, and those it owns."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        zero = getattr(optimizer, "_optimizer", optimizer)
        owner = zero._param_to_rank
        names = list(pl_module.named_parameters())
        self.rows.append(
            {
                "held": sorted(n for n, p in names if p.grad is not None),
                "owned": sorted(n for n, p in names if owner[p] == trainer.global_rank),
                "all": sorted(n for n, _ in names),
            }
        )

    def on_train_end(self, trainer, pl_module):
        (self.out / f"shards_{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def _fit(
    out: Path,
    world: int,
    *,
    max_steps: int,
    gradient_sync: str = "bucketed",
    algorithm: str = "norm",
    ckpt_every: int | None = None,
    resume: Path | None = None,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[pl.Callback] = [Recorder(out), ShardProbe(out), *step_checkpoints(out, ckpt_every)]
    trainer = quiet_trainer(
        out,
        world,
        ByteScaleStrategy(
            capacity=CAPACITY,
            zero=2,
            start_method="fork",
            timeout=60,
            gradient_sync=gradient_sync,
            bucket_cap_mb=1 / 64,
        ),
        max_steps=max_steps,
        gradient_clip_val=CLIP_NORM if algorithm == "norm" else CLIP_VALUE,
        gradient_clip_algorithm=algorithm,
        enable_checkpointing=bool(ckpt_every),
        callbacks=callbacks,
    )
    trainer.fit(TinyLM(), datamodule=StepDataModule("balance"), ckpt_path=resume)


def _trainer_reference(steps: int, algorithm: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The single-process reference with torch's clipping, which must act in every step."""

    def by_norm(params: list[torch.nn.Parameter]) -> None:
        assert float(torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)) > CLIP_NORM

    def by_value(params: list[torch.nn.Parameter]) -> None:
        assert any((p.grad.abs() > CLIP_VALUE).any() for p in params)
        torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)

    return reference(steps, clip_grads=by_norm if algorithm == "norm" else by_value)


def _assert_matches(out: Path, world: int, steps: list[int], expected, losses) -> None:
    for r in range(world):
        got = torch.load(out / f"params_{r}.pt")
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            err = (got[k] - v).abs().max().item()
            assert err <= TOLERANCE, (
                f"rank {r} parameter {k} differs from the single-process run by {err:.3e}"
            )
        rows = read_rows(out, r)
        assert [row["step"] for row in rows] == steps
        assert [row["logged"] for row in rows] == pytest.approx([losses[s] for s in steps], abs=1e-12)
        shards = json.loads((out / f"shards_{r}.json").read_text())
        assert len(shards) == len(steps)
        for row in shards:  # after the sync this rank holds exactly the gradients it owns
            assert row["held"] == row["owned"] and row["owned"], row
    first = [json.loads((out / f"shards_{r}.json").read_text())[0] for r in range(world)]
    owned = [set(row["owned"]) for row in first]
    assert set().union(*owned) == set(first[0]["all"])  # every parameter has an owner ...
    assert sum(len(o) for o in owned) == len(first[0]["all"])  # ... and only one


@pytest.mark.multiprocess
def test_trainer_zero2_clip_by_norm_and_resume_on_fewer_ranks(tmp_path):
    expected, losses = _trainer_reference(5, "norm")
    first, _ = _trainer_reference(3, "norm")
    # 3 ranks, bucketed reduces, clipping by the global norm; checkpoint after 3 steps
    _fit(tmp_path / "a", 3, max_steps=3, ckpt_every=3)
    _assert_matches(tmp_path / "a", 3, [0, 1, 2], first, losses)
    # resume that checkpoint on 2 ranks (optimizer state re-partitioned), flat sync
    ckpt = next((tmp_path / "a" / "ckpt").glob("*.ckpt"))
    _fit(tmp_path / "b", 2, max_steps=5, gradient_sync="flat", resume=ckpt)
    _assert_matches(tmp_path / "b", 2, [3, 4], expected, losses)


@pytest.mark.multiprocess
def test_trainer_zero2_clip_by_value_flat(tmp_path):
    expected, losses = _trainer_reference(3, "value")
    _fit(tmp_path, 2, max_steps=3, gradient_sync="flat", algorithm="value")
    _assert_matches(tmp_path, 2, [0, 1, 2], expected, losses)


def test_zero2_refuses_a_float16_grad_scaler():
    """A float16 GradScaler decides per rank whether to skip a step: with sharded gradients ranks would disagree."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ByteScaleStrategy(zero=2)
    scaler = torch.amp.GradScaler("cpu")
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    with pytest.raises(ConfigError, match=r"zero=2\) cannot run with a float16 GradScaler.*bf16-mixed"):
        strategy._clip_by_global_norm()
