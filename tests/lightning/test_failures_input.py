"""Bad input fails fast with an error that names the cause and the fix, or follows the documented policy.

One process, no process group.  Each case below is listed in docs/troubleshooting.md with the
message the user sees.  Cases the owning modules already test in depth (the token store's
corruption checks, the long/empty policies on a real corpus, Hydra's unknown keys and wrong
types) are only exercised here through the paths a user takes (DataModule, recipes), not
repeated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_bytescale.data import (
    CorruptIndexError,
    DataError,
    EmptyDatasetError,
    EmptySampleError,
    LongDocumentError,
    make_samples,
)
from lightning_bytescale.data.loader import StepDataset
from lightning_bytescale.data.sampler import GlobalBatching
from lightning_bytescale.data.store import INDEX_FILE
from lightning_bytescale.engine.micro_batch import EmptyBatchError, PackingError, build_step
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
from lightning_bytescale.planner import PlanError, make_plan
from lightning_bytescale.planner.plan import MicroBatch, Piece, Plan

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _tokens(lengths):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (s,), generator=g) for s in lengths]
    return lambda j: seqs[j]


# ------------------------------------------------------------------------------ empty samples
def test_empty_sample_is_named_by_the_planner_and_the_packer():
    with pytest.raises(PlanError, match=r"sequence 1 has length 0.*drop empty samples"):
        make_plan([5, 0, 3], world_size=2, capacity=8)
    # the plan says 3 tokens but the data yields none (e.g. a changed store)
    plan = make_plan([3], world_size=1, capacity=8)
    with pytest.raises(PackingError, match=r"sequence 0 is empty; drop empty samples"):
        build_step(plan, 0, lambda j: [])
    # sequences of one token carry no loss: a batch of only those is refused, not divided by 0
    plan = make_plan([1, 1], world_size=2, capacity=8)
    with pytest.raises(EmptyBatchError, match=r"zero loss tokens.*at least 2 tokens"):
        build_step(plan, 0, _tokens([1, 1]))


def test_empty_sample_policy_drop_is_counted_and_error_names_the_document():
    s = make_samples(np.array([7, 1, 0, 9]), 16)
    assert s.length.tolist() == [7, 9] and s.report["empty_dropped"] == 2
    with pytest.raises(EmptySampleError, match=r"document 1 .*1 tokens.*empty_sample_policy='drop'"):
        make_samples(np.array([7, 1, 0, 9]), 16, empty_policy="error")


# ------------------------------------------------------------------------------ longer than the pool
WORLD, CAP = 2, 16384


def _pool(offload: bool) -> tuple[ByteScaleDataModule, int]:
    dm = ByteScaleDataModule(
        capacity=CAP, world_size=WORLD, offload=None if offload else False, num_workers=0
    )
    return dm, dm.pool_tokens(10**9)


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_the_pool_limit_is_exact_and_the_planner_names_the_fix(offload):
    dm, pool = _pool(offload)
    opts = dm.planner_options()
    if offload:
        assert pool > WORLD * CAP  # offload lets the same ranks hold a longer sequence
    else:
        assert pool == WORLD * CAP
    make_plan([pool], world_size=WORLD, **opts).validate()  # the limit itself plans
    with pytest.raises(PlanError) as err:
        make_plan([3, pool + 1], world_size=WORLD, **opts)
    msg = str(err.value)
    assert f"sequence 1 has length {pool + 1}" in msg
    assert f"world_size is {WORLD}" in msg and "add ranks" in msg and "split/truncate" in msg
    assert ("with offload" if offload else "without offload") in msg


def test_too_long_with_offload_does_not_suggest_enabling_offload():
    dm, pool = _pool(True)
    with pytest.raises(PlanError) as err:
        make_plan([pool + 1], world_size=WORLD, **dm.planner_options())
    assert "enable offload" not in str(err.value)


@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
@pytest.mark.parametrize("policy", ["split", "truncate", "drop", "error"])
def test_documents_longer_than_the_pool_follow_each_policy(policy, offload):
    """Every sample a policy emits plans on the pool; ``error`` names the document and the options."""
    dm, pool = _pool(offload)
    docs = np.array([100, 3 * pool + 5, pool, pool + 1, 1])
    if policy == "error":
        with pytest.raises(
            LongDocumentError, match=rf"document 1 .*{3 * pool + 5} tokens.*split / truncate / drop"
        ):
            make_samples(docs, pool, policy)
        return
    s = make_samples(docs, pool, policy)
    assert s.length.max() <= pool and s.report["long_documents"] == 2
    if policy == "split":  # every token kept but a 1-token tail (nothing to predict)
        assert s.length.tolist() == [100, pool, pool, pool, 5, pool, pool]
        assert s.num_tokens == int(docs[docs >= 2].sum()) - 1 and s.report["split_tails_dropped"] == 1
    elif policy == "truncate":
        assert s.length.tolist() == [100, pool, pool, pool]
    else:
        assert s.length.tolist() == [100, pool] and s.doc.tolist() == [0, 2]
    opts = dm.planner_options()
    for n in sorted(set(s.length.tolist())):
        make_plan([int(n)], world_size=WORLD, **opts).validate()


# ------------------------------------------------------------------------------ capacity
@pytest.mark.parametrize("capacity", [0, 1, -4])
def test_capacity_below_the_minimum(capacity):
    with pytest.raises(PlanError, match=rf"capacity must be >= 2, got {capacity}"):
        make_plan([5], world_size=2, capacity=capacity)
    if capacity >= 1:
        with pytest.raises(DataError, match=rf"capacity={capacity} must be at least 2"):
            ByteScaleDataModule(capacity=capacity, world_size=2, num_workers=0).pool_tokens()


def test_strategy_rejects_the_capacity_the_planner_rejects():
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    with pytest.raises(ValueError, match="capacity"):
        ByteScaleStrategy(capacity=1)


def test_recipe_with_capacity_zero_fails_at_build_naming_the_option(tmp_path):
    from lightning_bytescale.cli.train import build
    from lightning_bytescale.recipes.config import compose_pretrain

    cfg = compose_pretrain(
        [f"run_dir={tmp_path}", "strategy.capacity=0", "logger=csv"],
        REPO / "conf",
    )
    start = time.monotonic()
    with pytest.raises(Exception, match=r"capacity must be .*got 0"):
        build(cfg)
    assert time.monotonic() - start < 30


# ------------------------------------------------------------------------------ world size
def _two_rank_plan() -> Plan:
    return make_plan([5, 40, 7], world_size=2, capacity=24, planner="balance").validate()


@pytest.mark.parametrize("rank", [2, -1, 5])
def test_build_step_for_a_rank_outside_the_plan(rank):
    with pytest.raises(PackingError, match=rf"rank {rank} is outside the plan's world size 2"):
        build_step(_two_rank_plan(), rank, _tokens([5, 40, 7]))


def test_plan_whose_rank_list_does_not_match_its_world_size():
    plan = _two_rank_plan()
    plan.world_size = 3
    with pytest.raises(PackingError, match=r"lists 2 ranks but says world size 3; rebuild the plan"):
        build_step(plan, 0, _tokens([5, 40, 7]))


def test_step_dataset_for_a_rank_outside_the_world():
    with pytest.raises(DataError, match=r"rank 3 is outside world size 3"):
        StepDataset(None, None, None, rank=3, world_size=3)


def _strategy(world: int):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    env = LightningEnvironment()
    env.set_world_size(world)
    env.set_global_rank(0)
    return ByteScaleStrategy(capacity=24, cluster_environment=env)


def test_strategy_refuses_a_step_planned_for_another_world_size(monkeypatch):
    """Four ranks that all hold a plan for two are refused, naming both numbers.

    The digest all-gather is emulated in one process (every rank sent this rank's values), so
    the check may run before it or inside it.
    """
    import torch.distributed as dist

    from lightning_bytescale.engine.step_checks import check_plan_agreement
    from lightning_bytescale.errors import ConfigError, PlanDivergenceError

    def all_gather(gathered, mine, group=None):
        for t in gathered:
            t.copy_(mine)

    monkeypatch.setattr(dist, "all_gather", all_gather)
    step = build_step(_two_rank_plan(), 0, _tokens([5, 40, 7]))
    assert step.stats["world_size"] == 2
    with pytest.raises(
        (ConfigError, PlanDivergenceError), match=r"made for \[?2\]? ranks,? but the run has 4"
    ):
        check_plan_agreement(step.digest, step.step, 4, plan_world=step.stats["world_size"])


def test_step_batches_carry_the_world_size_of_their_plan():
    """Also steps from a custom loader that calls build_step get the strategy's world-size check."""
    step = build_step(_two_rank_plan(), 1, _tokens([5, 40, 7]))
    assert step.stats.get("world_size") == 2


def test_datamodule_world_size_argument_must_agree_with_the_trainer():
    dm = ByteScaleDataModule(capacity=24, world_size=4, num_workers=0)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=2, strategy=None)
    with pytest.raises(
        DataError, match=r"ByteScaleDataModule\(world_size=4\) disagrees with the trainer \(2\)"
    ):
        dm.setup("fit")


# ------------------------------------------------------------------------------ no samples
def test_a_global_batch_with_no_sequences_is_refused():
    plan = make_plan([], world_size=2, capacity=8)  # an empty plan is well formed ...
    with pytest.raises(EmptyBatchError, match=r"0 sequence\(s\) has zero loss tokens"):
        build_step(plan, 0, _tokens([]))  # ... but there is nothing to train on


def test_no_samples_left_names_the_counts_and_the_fix():
    with pytest.raises(EmptyDatasetError, match=r"no samples left \(3 documents, 2 empty, 1 longer than 8\)"):
        make_samples(np.array([0, 1, 50]), 8, long_policy="drop", where="my corpus")
    with pytest.raises(DataError, match="no samples"):
        GlobalBatching(np.array([], dtype=np.int64), tokens_per_step=64)


def _jsonl(tmp_path: Path, texts: list[str]) -> str:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def test_datamodule_on_a_source_without_documents(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    dm = ByteScaleDataModule(source=str(src), cache_dir=tmp_path / "cache", world_size=1, num_workers=0)
    with pytest.raises(EmptyDatasetError, match=r"no documents.*check the source"):
        dm.prepare_data()


# ------------------------------------------------------------------------------ corrupt index
def test_corrupt_index_names_the_file_and_rebuild_fixes_it(tmp_path):
    kw = dict(
        source=_jsonl(tmp_path, ["hello world", "abc" * 20, "x" * 90]),
        cache_dir=tmp_path / "cache", capacity=32, context_length=32, tokens_per_step=256,
        world_size=1, num_workers=0,
    )  # fmt: skip
    dm = ByteScaleDataModule(**kw)
    dm.prepare_data()
    index = dm.store_dir / INDEX_FILE
    good = index.read_bytes()
    index.write_bytes(good[:-2])  # a partly copied index
    with pytest.raises(CorruptIndexError) as err:
        ByteScaleDataModule(**kw).setup("fit")
    msg = str(err.value)
    assert str(index) in msg and "rebuild=True" in msg and "prepare_data()" in msg
    # the documented fix works
    dm = ByteScaleDataModule(**kw, rebuild=True)
    dm.prepare_data()
    dm.setup("fit")
    assert index.read_bytes() == good
    assert dm.train_samples.num_tokens > 0


# ------------------------------------------------------------------------------ an impossible plan
def test_hand_made_plan_that_breaks_its_promises_is_named():
    """A plan from another tool (or edited by hand) is validated before anyone runs it."""
    plan = Plan(
        2, 8, "hand", (4, 6), [[MicroBatch([Piece(0, ((0, 4),))])], [MicroBatch([Piece(0, ((0, 4),))])]]
    )
    with pytest.raises(PlanError, match=r"sequence 0 \(length 4\): tokens \[0, 4\) assigned twice"):
        plan.validate()
