"""Token store, tokenizers, sources and the document policies."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from lightning_bytescale.data import (
    ByteTokenizer,
    CorruptIndexError,
    DataError,
    EmptyDatasetError,
    EmptySampleError,
    JsonlSource,
    JsonTokenizer,
    LongDocumentError,
    TextFilesSource,
    TokenStore,
    make_samples,
    make_source,
    write_store,
)
from lightning_bytescale.data.store import BLOCK_BYTES, HEADER_BYTES, INDEX_FILE, TOKENS_FILE


def _docs(rng: np.random.Generator, n: int, vocab: int) -> list[np.ndarray]:
    return [rng.integers(0, vocab, size=int(k)) for k in rng.integers(0, 50, size=n)]


@pytest.mark.parametrize("vocab, dtype", [(300, np.uint16), (70_000, np.uint32)])
def test_store_round_trip(tmp_path, vocab, dtype):
    docs = _docs(np.random.default_rng(0), 40, vocab)
    write_store(tmp_path / "s", iter(docs), None, vocab)
    store = TokenStore.open(tmp_path / "s")
    assert store.dtype == dtype and store.num_docs == 40
    assert store.lengths.tolist() == [d.size for d in docs]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(store.read(i), d)
        if d.size > 5:
            np.testing.assert_array_equal(store.read(i, 2, 3), d[2:5])
    # the index costs 4 bytes a document and 8 bytes a checksum block beyond its header
    blocks = -(-sum(d.size for d in docs) * np.dtype(dtype).itemsize // BLOCK_BYTES)
    assert (tmp_path / "s" / INDEX_FILE).stat().st_size == HEADER_BYTES + 4 * 40 + 8 * blocks
    # workers get the store by pickle: no mapped data travels, reading still works
    store.tokens  # noqa: B018 - map it
    clone = pickle.loads(pickle.dumps(store))
    assert clone._tokens is None and len(pickle.dumps(store)) < 2000
    np.testing.assert_array_equal(clone.read(3), docs[3])


def test_text_is_tokenized_in_batches(tmp_path):
    texts = [f"doc {i} é" * (i % 3) for i in range(600)]  # crosses the 256-document batches
    tok = ByteTokenizer()
    write_store(tmp_path / "s", iter(texts), tok.encode_batch, tok.vocab_size)
    store = TokenStore.open(tmp_path / "s")
    for i in (0, 1, 255, 256, 599):
        assert store.read(i).tolist() == tok.encode(texts[i]).tolist()
    assert tok.decode(store.read(599)) == texts[599]


def test_token_ids_outside_vocab_rejected(tmp_path):
    with pytest.raises(DataError, match="outside"):
        write_store(tmp_path / "s", iter([np.array([1, 300])]), None, 257)
    assert not (tmp_path / "s").exists()


def test_no_documents_is_a_clear_error(tmp_path):
    with pytest.raises(EmptyDatasetError, match="no documents"):
        write_store(tmp_path / "s", iter([]), None, 257)
    with pytest.raises(DataError, match="no text files"):
        TextFilesSource(str(tmp_path), pattern="*.txt").files()


def test_missing_store_says_prepare_data(tmp_path):
    with pytest.raises(DataError, match="prepare_data"):
        TokenStore.open(tmp_path / "nothing")


@pytest.mark.parametrize("damage", ["truncate_index", "magic", "version", "tokens_short", "lengths"])
def test_corrupt_index_is_detected(tmp_path, damage):
    d = tmp_path / "s"
    write_store(d, iter(_docs(np.random.default_rng(1), 20, 257)), None, 257)
    index, tokens = d / INDEX_FILE, d / TOKENS_FILE
    raw = bytearray(index.read_bytes())
    if damage == "truncate_index":
        index.write_bytes(raw[:-3])
    elif damage == "magic":
        index.write_bytes(b"XXXXXXXX" + raw[8:])
    elif damage == "version":
        raw[8] = 99
        index.write_bytes(bytes(raw))
    elif damage == "tokens_short":
        tokens.write_bytes(tokens.read_bytes()[:-2])
    else:  # two lengths swapped for different ones: sizes match, the sum does not
        lens = np.frombuffer(bytes(raw[HEADER_BYTES:]), dtype=np.uint32).copy()
        lens[0] += 5
        index.write_bytes(bytes(raw[:HEADER_BYTES]) + lens.tobytes())
    with pytest.raises(CorruptIndexError) as err:
        TokenStore.open(d)
    msg = str(err.value)
    assert str(index) in msg and "rebuild" in msg and "prepare_data" in msg


def test_policies():
    lengths = np.array([0, 1, 5, 12, 25, 3])
    split = make_samples(lengths, 10, "split")
    # 0 and 1 token documents are empty; 12 -> 10 + 2; 25 -> 10 + 10 + 5
    assert split.doc.tolist() == [2, 3, 3, 4, 4, 4, 5]
    assert split.start.tolist() == [0, 0, 10, 0, 10, 20, 0]
    assert split.length.tolist() == [5, 10, 2, 10, 10, 5, 3]
    assert split.report["empty_dropped"] == 2 and split.num_tokens == lengths[2:].sum()
    trunc = make_samples(lengths, 10, "truncate")
    assert trunc.doc.tolist() == [2, 3, 4, 5] and trunc.length.tolist() == [5, 10, 10, 3]
    drop = make_samples(lengths, 10, "drop")
    assert drop.doc.tolist() == [2, 5] and drop.length.tolist() == [5, 3]
    with pytest.raises(LongDocumentError, match="document 3 .* 12 tokens.*context length 10"):
        make_samples(lengths, 10, "error")
    with pytest.raises(EmptySampleError, match="document 0 .*empty_sample_policy"):
        make_samples(lengths, 10, "split", "error")
    # a split tail below min_tokens is dropped, never emitted as an empty sample
    tail = make_samples(np.array([21]), 10, "split")
    assert tail.length.tolist() == [10, 10] and tail.report["split_tails_dropped"] == 1
    with pytest.raises(DataError, match="long_document_policy"):
        make_samples(lengths, 10, "wrap")


def test_no_samples_left_is_a_clear_error():
    with pytest.raises(EmptyDatasetError, match="no samples left.*2 empty"):
        make_samples(np.array([0, 1]), 10)
    with pytest.raises(EmptyDatasetError, match="1 longer than 10"):
        make_samples(np.array([50]), 10, "drop")


def test_text_folder_and_jsonl_sources(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("hello")
    (tmp_path / "a" / "y.md").write_text("skip me")
    (tmp_path / "b.txt").write_text("world")
    src = TextFilesSource(str(tmp_path), pattern="*.txt")
    assert list(src.iter_documents(257)) == ["hello", "world"]  # sorted paths: a/x.txt, b.txt
    assert list(make_source(str(tmp_path / "*.txt")).iter_documents(257)) == ["world"]
    fp = src.fingerprint
    (tmp_path / "b.txt").write_text("world, changed")
    assert src.fingerprint != fp  # a changed file invalidates the cached store

    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    src = make_source(str(jl))
    assert isinstance(src, JsonlSource) and list(src.iter_documents(257)) == ["one", "two"]
    jl.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match="d.jsonl:1: no field 'text'"):
        list(src.iter_documents(257))
    with pytest.raises(DataError, match="matches no file"):
        JsonlSource(str(tmp_path / "none*.jsonl")).files()
    with pytest.raises(DataError, match="unknown source kind"):
        make_source({"kind": "csv"})


def test_tokenizers_json_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 20, trainer)
    path = tmp_path / "tok.json"
    tok.save(str(path))

    jt = JsonTokenizer(path)
    assert jt.eos_id == tok.token_to_id("</s>") and jt.vocab_size == tok.get_vocab_size()
    [ids] = jt.encode_batch(["the lazy fox"])
    assert ids[-1] == jt.eos_id and ids[:-1].tolist() == tok.encode("the lazy fox").ids
    assert jt.decode(ids[:-1]) == "the lazy fox"
    with pytest.raises(DataError, match="does not exist"):
        JsonTokenizer(tmp_path / "missing.json")
    with pytest.raises(DataError, match="not in the vocabulary"):
        JsonTokenizer(path, eos_token="<|nope|>")


def test_synthetic_sources_follow_the_paper_distributions(tmp_path):
    from lightning_bytescale.data import SyntheticSource
    from lightning_bytescale.planner import distributions

    for name in ("github", "byted"):
        src = make_source({"kind": "synthetic", "name": name, "num_samples": 400, "seed": 5, "context": 8192})
        raw = distributions.sample_lengths(name, 400, seed=5)
        want = np.maximum(1, np.round(raw * 8192 / distributions.REFERENCE_CONTEXT))
        np.testing.assert_array_equal(src.lengths(), want)
        a, b = tmp_path / f"{name}-a", tmp_path / f"{name}-b"
        write_store(a, src.iter_documents(257), None, 257)
        write_store(b, SyntheticSource(name, 400, 5, context=8192).iter_documents(257), None, 257)
        sa = TokenStore.open(a)
        TokenStore.open(b)  # verifies
        np.testing.assert_array_equal(sa.lengths, want)
        assert (a / TOKENS_FILE).read_bytes() == (b / TOKENS_FILE).read_bytes()  # same seed, same tokens
        assert int(sa.tokens.max()) < 257
    assert make_source("byted").name == "byted"
    with pytest.raises(ValueError, match="unknown length distribution"):
        SyntheticSource("books", 3).lengths()


def test_hugging_face_source_is_optional(tmp_path, monkeypatch):
    import sys
    import types

    from lightning_bytescale.data import HFSource

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DataError, match="pip install datasets"):
        list(make_source("hf:some/corpus").iter_documents(257))

    calls = {}

    class Rows(list):
        column_names = ["text", "id"]

    def load_dataset(name, config, split, revision):
        calls.update(name=name, config=config, split=split)
        return Rows([{"text": "alpha", "id": 1}, {"text": "", "id": 2}])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    src = HFSource("org/corpus", split="validation")
    assert list(src.iter_documents(257)) == ["alpha", ""]
    assert calls == {"name": "org/corpus", "config": None, "split": "validation"}
    with pytest.raises(DataError, match="no column 'body'"):
        list(HFSource("org/corpus", field="body").iter_documents(257))


def test_options_from_hydra_configs():
    from enum import Enum

    from omegaconf import OmegaConf

    from lightning_bytescale.data import SyntheticSource
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

    src = make_source(OmegaConf.create({"kind": "synthetic", "name": "byted", "num_samples": 7}))
    assert isinstance(src, SyntheticSource) and src.num_samples == 7

    class Policy(Enum):
        truncate = "truncate"

    dm = ByteScaleDataModule(source=src, long_document_policy=Policy.truncate)
    assert dm.long_document_policy == "truncate"
