"""ByteScaleDataModule end to end without processes: every rank is built explicitly."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_bytescale.data import (
    DataError,
    EmptyDatasetError,
    EmptySampleError,
    LongDocumentError,
    ResumeMismatchError,
)
from lightning_bytescale.engine.batch import StepBatch
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

CAP = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """JSONL documents from 0 to ~300 bytes: empty ones, short ones, and ones longer than a rank."""
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    lens = np.concatenate([[0, 0], rng.integers(1, 60, size=150), rng.integers(100, 300, size=12)])
    rng.shuffle(lens)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz ,.\n"))
    path = d / "docs.jsonl"
    with open(path, "w") as fh:
        for n in lens:
            fh.write(json.dumps({"text": "".join(rng.choice(alphabet, size=int(n)))}) + "\n")
    return SimpleNamespace(path=str(path), cache=str(d / "cache"))


def make_dm(corpus, **kw) -> ByteScaleDataModule:
    opts = dict(
        source=corpus.path, cache_dir=corpus.cache, capacity=CAP, tokens_per_step=700, seed=3,
        num_workers=0, world_size=1, rank=0,
    )  # fmt: skip
    opts.update(kw)
    # two ranks' capacity where there are two ranks (the longest samples need a ring), else one
    opts.setdefault("context_length", min(2, opts["world_size"] or 1) * CAP)
    dm = ByteScaleDataModule(**opts)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def rank_loaders(corpus, world, **kw):
    return [make_dm(corpus, world_size=world, rank=r, **kw).train_dataloader() for r in range(world)]


def take(loader, n) -> list[StepBatch]:
    out = []
    for b in loader:
        out.append(b)
        if len(out) == n:
            break
    return out


def reconstruct(batches: list[StepBatch]) -> dict[int, np.ndarray]:
    """One step's sequences rebuilt from every rank's micro-batches; each token must come once."""
    seen: dict[int, dict[int, int]] = {}
    for b in batches:
        for mb in b.micro_batches:
            lay = mb.layout
            pos, valid = lay.positions(), lay.valid()
            seq = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(lay.slots))
            for s, p, t in zip(seq[valid].tolist(), pos[valid].tolist(), mb.input_ids[valid].tolist()):
                assert p not in seen.setdefault(s, {}), f"token {p} of sequence {s} twice"
                seen[s][p] = t
    out = {}
    for s, toks in seen.items():
        assert sorted(toks) == list(range(len(toks))), f"sequence {s} has missing tokens"
        out[s] = np.array([toks[p] for p in range(len(toks))])
    return out


def expected(dm: ByteScaleDataModule, loader, epoch: int, step: int) -> dict[int, np.ndarray]:
    ids = loader.dataset.sample_ids(epoch, step)
    return {j: loader.dataset.tokens(int(i)) for j, i in enumerate(ids)}


@pytest.mark.parametrize(
    "world, opts",
    [(1, {}), (3, {}), (4, {"planner": "naive"}), (4, {"planner": "static", "cp_size": 2})],
)
def test_ranks_cover_the_global_batch_exactly_once(corpus, world, opts):
    loaders = rank_loaders(corpus, world, **opts)
    assert len({len(dl) for dl in loaders}) == 1  # the same number of steps on every rank
    per_rank = [take(dl, 3) for dl in loaders]
    rings = 0
    for step in range(3):
        batches = [r[step] for r in per_rank]
        assert len({b.digest for b in batches}) == 1  # every rank planned the same plan
        assert len({b.num_global_tokens for b in batches}) == 1
        got = reconstruct(batches)
        want = expected(None, loaders[0], 0, step)
        assert got.keys() == want.keys()
        for j in want:
            np.testing.assert_array_equal(got[j], want[j])
        assert batches[0].num_global_tokens == sum(len(v) - 1 for v in want.values())
        stats = batches[0].stats  # what telemetry reads
        assert stats["lengths"] == [len(want[j]) for j in range(len(want))] and stats["world_size"] == world
        assert stats["epoch"] == 0 and stats["split"] == "train" and stats["plan_ms"] >= 0
        rings += sum(not mb.layout.is_local for b in batches for mb in b.micro_batches)
    if world > 1:
        assert rings > 0  # the corpus has documents longer than one rank's capacity


def test_global_batches_follow_the_token_budget(corpus):
    dm = make_dm(corpus, tokens_per_step=500)
    dl = dm.train_dataloader()
    lens = dm.train_samples.length
    sums = [int(lens[dl.dataset.sample_ids(0, s)].sum()) for s in range(len(dl))]
    assert sum(sums) == dm.train_samples.num_tokens
    assert max(sums) < 500 + lens.max() and np.mean(sums[:-1]) == pytest.approx(500, rel=0.25)
    strict = make_dm(corpus, tokens_per_step=500, budget_mode="strict").train_dataloader()
    assert max(int(lens[strict.dataset.sample_ids(0, s)].sum()) for s in range(len(strict))) <= 500


def _signature(batches: list[StepBatch]):
    return [(b.step, b.digest, [mb.input_ids.tolist() for mb in b.micro_batches]) for b in batches]


def test_resume_mid_epoch_gives_the_same_next_batches(corpus):
    ref = take(rank_loaders(corpus, 2)[1], 6)
    dl = rank_loaders(corpus, 2)[1]
    take(dl, 2)
    state = dl.state_dict()
    assert (state["epoch"], state["step"]) == (0, 2)
    fresh = rank_loaders(corpus, 2)[1]
    fresh.load_state_dict(state)
    assert _signature(take(fresh, 4)) == _signature(ref[2:])
    # the DataModule's own state_dict carries the same position (restored before the loader exists)
    dm = make_dm(corpus, world_size=2, rank=1)
    dm.load_state_dict({"train": state})
    assert _signature(take(dm.train_dataloader(), 1)) == _signature(ref[2:3])


def test_resume_on_a_different_world_size_replans_the_same_global_batches(corpus):
    four = rank_loaders(corpus, 4)
    first = [take(dl, 2) for dl in four]
    state = four[0].state_dict()
    two = rank_loaders(corpus, 2)
    for dl in two:
        dl.load_state_dict(state)
    after = [take(dl, 2) for dl in two]
    ref = [take(dl, 4)[2:] for dl in rank_loaders(corpus, 4)]
    for k in range(2):
        got = reconstruct([r[k] for r in after])
        want = reconstruct([r[k] for r in ref])
        assert got.keys() == want.keys() and all(np.array_equal(got[j], want[j]) for j in want)
        assert after[0][k].step == 2 + k and after[0][k].num_global_tokens == ref[0][k].num_global_tokens
    assert len(first[0]) == 2


def test_worker_processes_prefetch_the_same_batches(corpus):
    ref = take(rank_loaders(corpus, 2)[0], 5)
    dl = rank_loaders(corpus, 2, num_workers=2)[0]
    got = take(dl, 3)
    assert _signature(got) == _signature(ref[:3])
    # workers ran ahead, but the saved position is what was consumed
    state = dl.state_dict()
    assert (state["epoch"], state["step"]) == (0, 3)
    again = rank_loaders(corpus, 2, num_workers=1)[0]
    again.load_state_dict(state)
    assert _signature(take(again, 2)) == _signature(ref[3:5])


def test_a_whole_epoch_then_the_next(corpus):
    dl = rank_loaders(corpus, 2, tokens_per_step=3000)[0]
    n = len(dl)
    e0 = list(dl)
    assert [b.step for b in e0] == list(range(n)) and {b.stats["epoch"] for b in e0} == {0}
    assert (dl.state_dict()["epoch"], dl.state_dict()["step"]) == (1, 0)
    dl.sampler.set_epoch(1)  # as Lightning does at the start of every epoch
    e1 = list(dl)
    assert len(e1) == n and {b.stats["epoch"] for b in e1} == {1}
    assert [b.digest for b in e0] != [b.digest for b in e1]  # reshuffled


def test_planner_options_come_from_the_strategy(corpus):
    from lightning_bytescale.errors import PlannerOptionsConflictError
    from lightning_bytescale.lightning.strategy import ByteScaleStrategy

    strategy = ByteScaleStrategy(planner="naive", capacity=32, slack=0.1, seed=11)
    dm = ByteScaleDataModule(source=corpus.path, cache_dir=corpus.cache, num_workers=0, context_length=None)
    dm.trainer = SimpleNamespace(global_rank=1, world_size=3, strategy=strategy)
    dm.prepare_data()
    dm.setup("fit")  # the context is the pool: 3 ranks x the strategy's capacity
    assert (
        dm.planner_config is strategy.planner_config
        and dm.rank == 1
        and dm.world_size == 3
        and dm.plan_seed() == 11
    )
    assert dm.max_length == 3 * 32  # the strategy's capacity, not the DataModule's
    b = next(iter(dm.train_dataloader()))
    assert all(mb.num_slots <= 32 for mb in b.micro_batches)
    clash = ByteScaleDataModule(source=corpus.path, cache_dir=corpus.cache, world_size=2)
    clash.trainer = dm.trainer
    with pytest.raises(DataError, match=r"world_size=2\) disagrees with the trainer \(3\)"):
        clash.setup("fit")
    own = ByteScaleDataModule(source=corpus.path, cache_dir=corpus.cache, capacity=CAP, num_workers=0)
    own.trainer = dm.trainer  # its own capacity, which the strategy's planner_config overrides
    with pytest.raises(PlannerOptionsConflictError, match=rf"capacity={CAP}\) differs"):
        own.setup("fit")


@pytest.mark.parametrize("policy", ["split", "truncate", "drop", "error"])
def test_documents_longer_than_the_pool_follow_the_policy(corpus, policy):
    pool = 2 * CAP  # world 2 x capacity
    kw = dict(world_size=2, context_length=pool, long_document_policy=policy)
    if policy == "error":
        with pytest.raises(LongDocumentError, match="long_document_policy='error'"):
            make_dm(corpus, **kw)
        return
    dm = make_dm(corpus, **kw)
    s = dm.train_samples
    assert s.length.max() <= pool and s.report["long_documents"] > 0
    doc_len = dm.store.lengths[s.doc]
    if policy == "split":
        assert s.num_tokens == dm.store.lengths[dm.store.lengths >= 2].sum()
    elif policy == "truncate":
        assert np.array_equal(s.length, np.minimum(doc_len, pool)) and (s.start == 0).all()
    else:
        assert (doc_len <= pool).all()
    b = next(iter(dm.train_dataloader()))
    assert b.num_global_tokens > 0


def test_empty_samples_and_empty_datasets(corpus, tmp_path):
    dm = make_dm(corpus)
    assert dm.train_samples.report["empty_dropped"] >= 2
    with pytest.raises(EmptySampleError, match="has 0 tokens"):
        make_dm(corpus, empty_sample_policy="error")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    dm = ByteScaleDataModule(source=str(empty), cache_dir=tmp_path / "c", world_size=1, num_workers=0)
    dm.prepare_data()
    with pytest.raises(EmptyDatasetError, match="no samples left"):
        dm.setup("fit")


def test_resume_refuses_other_data(corpus):
    state = rank_loaders(corpus, 1)[0].state_dict()
    other = rank_loaders(corpus, 1, seed=4)[0]
    with pytest.raises(ResumeMismatchError, match="seed: saved 3, now 4"):
        other.load_state_dict(state)


def test_validation_loader(corpus):
    dm = make_dm(corpus, val_fraction=0.2, world_size=2)
    assert not set(dm.val_samples.doc) & set(dm.train_samples.doc)
    val = dm.val_dataloader()
    passes = [[b.digest for b in val], [b.digest for b in take(val, 1)], [b.digest for b in val]]
    assert passes[0] == passes[2] and passes[1] == passes[0][:1]  # every pass starts at step 0
    assert make_dm(corpus).val_dataloader() == []


def test_text_folder_source_and_bad_options(tmp_path):
    (tmp_path / "src").mkdir()
    for i in range(5):
        (tmp_path / "src" / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" * (i + 1))
    dm = ByteScaleDataModule(
        source=str(tmp_path / "src"), cache_dir=tmp_path / "c", capacity=32, world_size=2,
        rank=0, tokens_per_step=200, num_workers=0, context_length=64,
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    assert dm.store.num_docs == 5 and dm.tokenizer.vocab_size == 257
    assert dm.train_samples.length.max() == 64
    assert len(next(iter(dm.train_dataloader())).micro_batches) >= 1
    with pytest.raises(DataError, match="val_fraction"):
        ByteScaleDataModule(val_fraction=1.5)
    with pytest.raises(DataError, match="capacity=1"):
        ByteScaleDataModule(source=str(tmp_path / "src"), cache_dir=tmp_path / "c", capacity=1).setup()


class _Recorder:
    """A LightningModule that records which global batches it was given."""

    @staticmethod
    def make():
        import lightning.pytorch as pl

        class M(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(1))
                self.seen: list[tuple[int, int, str]] = []

            def training_step(self, batch, batch_idx):
                assert isinstance(batch, StepBatch)
                self.seen.append((batch.stats["epoch"], batch.step, batch.digest))
                return (self.w * batch.num_global_tokens).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

        return M()


def test_lightning_saves_and_restores_the_position(corpus, tmp_path):
    """A run resumed from a mid-epoch checkpoint trains on the same steps as an uninterrupted one."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DistributedSampler

    def fit(max_steps, ckpt=None, callbacks=()):
        dm = make_dm(corpus, world_size=None, rank=None, tokens_per_step=2000)
        # Lightning leaves a loader whose sampler is already distributed alone
        assert isinstance(dm.train_dataloader().sampler, DistributedSampler)
        model = _Recorder.make()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=max_steps, logger=False, callbacks=list(callbacks),
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            enable_checkpointing=bool(callbacks), default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        return model, dm

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full, dm = fit(12, callbacks=[ckpt])
    n = len(dm.train_dataloader())
    assert 4 <= n < 12 and n % 3  # the run crosses epoch boundaries; a checkpoint falls mid-epoch
    assert [s[:2] for s in full.seen] == [(e, s) for e in range(12) for s in range(n)][:12]
    for k in (3, 6):
        saved = torch.load(tmp_path / f"step={k}.ckpt", weights_only=False)["loops"]["fit_loop"]
        [pos] = saved["state_dict"]["combined_loader"]  # saved by Lightning's fit loop
        assert (pos["epoch"], pos["step"]) == divmod(k, n)
        rest, _ = fit(12, ckpt=str(tmp_path / f"step={k}.ckpt"))
        assert rest.seen == full.seen[k:], k


def test_the_pool_limit_asks_the_planner_so_offload_counts():
    def pool(**kw):
        return ByteScaleDataModule(capacity=32768, world_size=2, **kw).pool_tokens(100_000)

    assert pool(offload=False) == 2 * 32768  # without offload: world x capacity
    assert pool() == 100_000  # the planner's default offload fits a longer sequence on the same pool
    assert pool(offload=False, planner="static", cp_size=1) == 32768  # static's fixed CP degree


def test_resume_onto_another_pool_names_the_context_length(corpus):
    state = rank_loaders(corpus, 4, context_length=None)[0].state_dict()  # pool 4 x 64
    with pytest.raises(ResumeMismatchError, match="set it explicitly"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rank_loaders(corpus, 2, context_length=None)[0].load_state_dict(state)


def test_step_dataset_pickles_without_tokens(corpus):
    """Spawned workers receive the dataset by pickle: it must be small and rebuild the same batch."""
    import pickle

    ds = rank_loaders(corpus, 2)[1].dataset
    ds[(0, 0)]  # maps the token file
    assert ds.store._tokens is not None
    blob = pickle.dumps(ds)
    assert np.asarray(ds.store.tokens[:400]).tobytes() not in blob  # no mapped token data travels
    clone = pickle.loads(blob)
    assert clone.store._tokens is None
    assert _signature([clone[(0, 1)]]) == _signature([ds[(0, 1)]])
