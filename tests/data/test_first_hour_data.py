"""A new user's first hour with the data module: test and predict loaders, and the source's
``pattern`` / ``field`` as plain arguments (issue 17, items 1 and 3)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_data_loader import make_dm as data_loader_dm

from lightning_bytescale.data import DataError
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

CAP = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("fh_corpus")
    rng = np.random.default_rng(5)
    path = d / "docs.jsonl"
    with open(path, "w") as fh:
        for i in range(120):
            n = int(rng.integers(3, 90))
            fh.write(json.dumps({"body": f"{i}:" + "x" * n, "id": i}) + "\n")
    return d


def make_dm(corpus, **kw) -> ByteScaleDataModule:
    where = SimpleNamespace(path=str(corpus / "docs.jsonl"), cache=str(corpus / "cache"))
    return data_loader_dm(
        where, **{"field": "body", "tokens_per_step": 400, "seed": 2, "context_length": CAP, **kw}
    )


def sequences(loader) -> list[tuple[int, ...]]:
    """Every sequence of every step, rebuilt from the rank's micro-batches (one rank: all of them)."""
    out = []
    for batch in loader:
        per_seq: dict[int, dict[int, int]] = {}
        for mb in batch.micro_batches:
            lay = mb.layout
            pos, valid = lay.positions(), lay.valid()
            seq = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(lay.slots))
            for s, p, t in zip(seq[valid].tolist(), pos[valid].tolist(), mb.input_ids[valid].tolist()):
                per_seq.setdefault(s, {})[p] = t
        for s in sorted(per_seq):
            toks = per_seq[s]
            out.append(tuple(toks[p] for p in range(len(toks))))
    return out


def expected(dm, samples) -> list[tuple[int, ...]]:
    """The samples' tokens, read straight from the store."""
    return [
        tuple(dm.store.read(int(d), int(s), int(n)).tolist())
        for d, s, n in zip(samples.doc, samples.start, samples.length)
    ]


def test_test_split_is_held_out_and_keeps_the_validation_split(corpus):
    before = make_dm(corpus, val_fraction=0.1)
    dm = make_dm(corpus, val_fraction=0.1, test_fraction=0.15)
    assert np.array_equal(dm.val_samples.doc, before.val_samples.doc)  # adding a test split keeps val
    train, val, test = (set(s.doc.tolist()) for s in (dm.train_samples, dm.val_samples, dm.test_samples))
    assert not (train & val) and not (train & test) and not (val & test)
    assert len(train | val | test) == dm.store.num_docs
    assert len(test) == round(dm.store.num_docs * 0.15)
    # the test loader reads exactly the test split, every sample once, the same on every pass
    loader = dm.test_dataloader()
    first = sequences(loader)
    assert sorted(first) == sorted(expected(dm, dm.test_samples))
    assert sequences(loader) == first


def test_test_loader_falls_back_to_validation_and_explains_when_nothing_is_held_out(corpus):
    dm = make_dm(corpus, val_fraction=0.2)
    assert sorted(sequences(dm.test_dataloader())) == sorted(expected(dm, dm.val_samples))
    with pytest.raises(DataError, match=r"test_fraction \(data.test_fraction=0.05"):
        make_dm(corpus).test_dataloader()


@pytest.mark.parametrize(
    ("kw", "split"),
    [({}, "train"), ({"val_fraction": 0.2}, "val"), ({"val_fraction": 0.2, "test_fraction": 0.1}, "test"),
     ({"val_fraction": 0.2, "test_fraction": 0.1, "predict_split": "train"}, "train")],
)  # fmt: skip
def test_predict_reads_its_split_once_in_order(corpus, kw, split):
    dm = make_dm(corpus, drop_last=True, shuffle=True, **kw)  # neither applies to predict
    got = sequences(dm.predict_dataloader())
    samples = {"train": dm.train_samples, "val": dm.val_samples, "test": dm.test_samples}[split]
    assert got == expected(dm, samples)  # the split's samples in order, each once


def test_predict_split_errors(corpus):
    with pytest.raises(DataError, match="predict_split='all'"):
        ByteScaleDataModule(source=str(corpus / "docs.jsonl"), predict_split="all")
    with pytest.raises(DataError, match="no test split: set test_fraction"):
        make_dm(corpus, predict_split="test").predict_dataloader()
    with pytest.raises(DataError, match="leave no training documents"):
        ByteScaleDataModule(source=str(corpus / "docs.jsonl"), val_fraction=0.5, test_fraction=0.5)


# ------------------------------------------------------------------------ pattern and field
def test_field_is_a_plain_argument_and_the_error_names_the_keys(corpus):
    dm = make_dm(corpus)
    assert dm.store.num_docs == 120
    first = bytes(dm.store.read(0)[: len("0:x")].tolist()).decode()
    assert first == "0:x"
    bad = ByteScaleDataModule(source=str(corpus / "docs.jsonl"), cache_dir=str(corpus / "cache2"))
    with pytest.raises(
        DataError, match=r"no field 'text'.*\['body', 'id'\].*data\.field=<key>.*field='<key>'"
    ):
        bad.prepare_data()


def test_pattern_is_a_plain_argument(tmp_path):
    folder = tmp_path / "notes"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.md").write_text("# first note\n")
    (folder / "sub" / "b.md").write_text("second note\n")
    (folder / "c.txt").write_text("not markdown\n")
    dm = ByteScaleDataModule(source=str(folder), pattern="*.md", cache_dir=str(tmp_path / "c"))
    assert [os.path.basename(p) for p in dm.source.files()] == ["a.md", "b.md"]
    with pytest.raises(DataError, match=r"no text files found.*data\.pattern=.*pattern='\*\.md'"):
        ByteScaleDataModule(source=str(folder), cache_dir=str(tmp_path / "c")).source.files()


def test_source_options_that_do_not_apply_or_contradict_fail(tmp_path):
    with pytest.raises(DataError, match=r"pattern='\*\.md' is an option of a folder.*data\.pattern=null"):
        ByteScaleDataModule(source="github", pattern="*.md")
    with pytest.raises(DataError, match=r"field='body' is an option of JSONL"):
        ByteScaleDataModule(source=str(tmp_path), field="body")
    with pytest.raises(DataError, match=r"field='body' contradicts the source's own field='text'"):
        ByteScaleDataModule(source={"kind": "jsonl", "path": "x.jsonl", "field": "text"}, field="body")
    dm = ByteScaleDataModule(source={"kind": "jsonl", "path": "x.jsonl"}, field="body")
    assert dm.source.field == "body"


def test_pattern_field_and_splits_are_hydra_keys(tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_bytescale.recipes.config import compose_pretrain, find_conf_dir

    def data(*overrides):
        cfg = compose_pretrain([f"run_dir={tmp_path}", *overrides], find_conf_dir())
        return instantiate(OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True))

    dm = data("data=jsonl", "data.source=/x/corpus.jsonl", "data.field=body", "data.test_fraction=0.1",
              "data.predict_split=val")  # fmt: skip
    assert (dm.source.field, dm.test_fraction, dm.predict_split) == ("body", 0.1, "val")
    assert data("data=text", "data.source=/x/notes", "data.pattern=*.md").source.pattern == "*.md"
    with pytest.raises(Exception, match="predict_split"):
        data("data=jsonl", "data.source=/x/c.jsonl", "data.predict_split=everything")


# ------------------------------------------------------- hints that lead somewhere (issue 29, item 3)
def test_a_chat_file_under_the_jsonl_source_is_pointed_to_the_chat_source(tmp_path):
    from lightning_bytescale.data.source_spec import make_source

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError) as err:
        ByteScaleDataModule(source=str(path), cache_dir=str(tmp_path / "c")).prepare_data()
    text = str(err.value)
    assert "this is a chat record (a 'messages' list)" in text and "data.field" not in text, text
    assert f"data=chat data.source.path={path}" in text, text
    assert f"ByteScaleDataModule(source={{'kind': 'chat', 'path': '{path}'}}" in text, text
    assert make_source({"kind": "chat", "path": str(path)}).kind.startswith("chat")  # it exists
    pair = tmp_path / "pairs.jsonl"
    pair.write_text(json.dumps({"prompt": "2+2?", "completion": "4"}) + "\n")
    with pytest.raises(DataError, match=r"chat record \(a prompt and a completion\).*data=chat"):
        ByteScaleDataModule(source=str(pair), cache_dir=str(tmp_path / "c")).prepare_data()


@pytest.mark.parametrize("kind", ["folder", "glob", "jsonl", "jsonl_glob"])
def test_a_folder_that_does_not_exist_is_named_as_missing(tmp_path, kind):
    missing = tmp_path / "corpus"
    source = {
        "folder": str(missing),
        "glob": str(missing / "**" / "*.md"),
        "jsonl": str(missing / "docs.jsonl"),
        "jsonl_glob": str(missing / "*.jsonl"),
    }[kind]
    with pytest.raises(DataError) as err:
        ByteScaleDataModule(source=source, cache_dir=str(tmp_path / "c")).source.files()
    text = str(err.value)
    named = missing / "docs.jsonl" if kind == "jsonl" else missing
    assert f"{named} does not exist ({tmp_path} exists)" in text, text
    assert "matches no file" not in text and "no text files found" not in text, text
