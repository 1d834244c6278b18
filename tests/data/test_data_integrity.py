"""Nothing silently wrong in the data: identity, verified stores, content fingerprints, safe builds.

One test (or a few) per case of the probe in docs/troubleshooting.md ("The probe's data
cases"): each failed, or passed silently, before the token store carried checksums and the
step digest carried the store's content.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from lightning_bytescale.data import (
    ByteTokenizer,
    CorruptIndexError,
    CorruptTokensError,
    DataError,
    JsonlSource,
    OutOfVocabularyError,
    StoreNotFoundError,
    TextFilesSource,
    TokenStore,
    prune_cache,
    write_store,
)
from lightning_bytescale.data.sources import file_digest
from lightning_bytescale.data.store import (
    HEADER_BYTES,
    INDEX_FILE,
    META_FILE,
    TOKENS_FILE,
    encode_index,
    leftovers,
)
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
from lightning_bytescale.planner import PlanError
from lightning_bytescale.planner.cost_model import CostModel

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
TOK = ByteTokenizer()


def _text_store(path: Path, texts: list[str], block_bytes: int = 64) -> TokenStore:
    write_store(
        path, iter(texts), TOK.encode_batch, TOK.vocab_size, eos_id=TOK.eos_id, block_bytes=block_bytes
    )
    return TokenStore.open(path)


def _texts(n: int = 30, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        "".join(chr(97 + int(c)) for c in rng.integers(0, 26, size=int(k)))
        for k in rng.integers(5, 60, size=n)
    ]


def _read_all(store: TokenStore) -> None:
    for d in range(store.num_docs):
        store.read(d)


def _jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _dm(source, cache: Path, **kw) -> ByteScaleDataModule:
    opts = dict(
        source=source, cache_dir=cache, capacity=64, context_length=64, tokens_per_step=256,
        world_size=1, num_workers=0,
    )  # fmt: skip
    opts.update(kw)
    return ByteScaleDataModule(**opts)


# ================================================================== case 1: the data identity
def _step_dataset(dm: ByteScaleDataModule):
    return dm.train_dataloader().dataset


def test_equal_lengths_different_text_give_different_step_digests(tmp_path):
    """Two stores with the same lengths but different text: same plan, different digest."""
    a = _jsonl(tmp_path / "a.jsonl", ["hello world", "x" * 40, "abc" * 20])
    b = _jsonl(tmp_path / "b.jsonl", ["hello wOrld", "x" * 40, "abc" * 20])  # one byte edited
    dms = []
    for src, cache in ((a, "ca"), (b, "cb"), (a, "cc")):  # "cc": the same text in another folder
        dm = _dm(src, tmp_path / cache)
        dm.prepare_data()
        dm.setup("fit")
        dms.append(dm)
    assert dms[0].store.lengths.tolist() == dms[1].store.lengths.tolist()
    steps = [_step_dataset(dm)[(0, 0)] for dm in dms]
    assert steps[0].stats["lengths"] == steps[1].stats["lengths"]
    assert steps[0].digest != steps[1].digest  # before: the digest covered the plan only
    assert steps[0].digest == steps[2].digest  # identical content agrees, wherever it is stored
    assert dms[0].store.content_hash != dms[1].store.content_hash
    assert dms[0].store.content_hash == dms[2].store.content_hash
    for dm, step in zip(dms, steps):
        assert step.data_identity.startswith(f"store {dm.store.content_hash[:16]}")
        assert dm.data_identity in step.data_identity


def test_same_store_other_batch_gives_another_digest(tmp_path):
    """Equal-length samples: two seeds give the same lengths and plan, but other samples."""
    src = _jsonl(tmp_path / "d.jsonl", [f"document number {i:04d}" for i in range(40)])
    steps = []
    for seed in (0, 1):
        dm = _dm(src, tmp_path / "c", seed=seed)
        dm.prepare_data()
        dm.setup("fit")
        steps.append(_step_dataset(dm)[(0, 0)])
    assert steps[0].stats["lengths"] == steps[1].stats["lengths"]
    assert steps[0].digest != steps[1].digest


_TWO_RANKS = textwrap.dedent(
    """
    import os, sys
    import lightning.pytorch as pl
    import torch
    import lightning_bytescale as lb
    from lightning_bytescale import ByteScaleStrategy
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule

    root = sys.argv[1]

    class PerNodeData(ByteScaleDataModule):
        '''Each rank stands for a node with its own copy of the corpus and its own cache.'''

        def setup(self, stage=None):
            from lightning_bytescale.data.source_spec import make_source
            r = self.trainer.global_rank
            self.source = make_source(os.path.join(root, f"node{r}.jsonl"))
            self.cache_dir = __import__("pathlib").Path(root) / f"cache{r}"
            self._store_dir = None
            self.prepare_data()
            super().setup(stage)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(257, 8)
            self.head = torch.nn.Linear(8, 257)

        def training_step(self, mb, batch_idx):
            return lb.token_loss(self.head(self.emb(mb.input_ids)), mb.labels, mb.num_global_tokens)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = PerNodeData(source=os.path.join(root, "node0.jsonl"), cache_dir=os.path.join(root, "cache0"),
                     capacity=32, context_length=32,
                     tokens_per_step=128, num_workers=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=ByteScaleStrategy(capacity=32, start_method="fork", timeout=30,
                                                    check_attention=False))  # LM has no attention
    trainer.fit(LM(), datamodule=dm)
    print("TRAINED TO THE END")
    """
)


@pytest.mark.multiprocess
def test_two_ranks_with_different_stores_stop_before_any_exchange(tmp_path):
    """Case 1 end to end: 2 gloo ranks, the same lengths, one edited byte on 'node' 1."""
    texts = [f"line {i} " + "abcdefgh" * (i % 4 + 1) for i in range(40)]
    _jsonl(tmp_path / "node0.jsonl", texts)
    edited = list(texts)
    edited[7] = edited[7].replace("a", "A", 1)
    _jsonl(tmp_path / "node1.jsonl", edited)
    script = tmp_path / "run.py"
    script.write_text(_TWO_RANKS)
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "RANK")
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=100, env=env,
        start_new_session=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "TRAINED TO THE END" not in out, "ranks with different data trained silently"
    assert proc.returncode != 0
    assert "PlanDivergenceError" in out, out[-3000:]
    assert "store " in out  # the message names the data (the store's content hash)
    # ... of every rank: one group per store, each naming what its ranks read
    assert re.search(r"ranks \[0\] read 'store [0-9a-f]{16}", out) and re.search(
        r"ranks \[1\] read 'store [0-9a-f]{16}", out
    ), out[-3000:]


# ============================================================ case 3: the store's content is verified
def test_bit_flip_in_tokens_is_caught_naming_the_block_and_documents(tmp_path):
    d = tmp_path / "s"
    texts = _texts()
    _text_store(d, texts)
    raw = bytearray((d / TOKENS_FILE).read_bytes())
    raw[200] ^= 0x01  # token 100 stays inside the vocabulary
    (d / TOKENS_FILE).write_bytes(bytes(raw))
    store = TokenStore.open(d)  # lazy: opening reads the index only
    with pytest.raises(CorruptTokensError) as err:
        _read_all(store)
    msg = str(err.value)
    assert str(d) in msg and "block 3" in msg and "documents" in msg and "rebuild=True" in msg
    with pytest.raises(CorruptTokensError, match="block 3"):
        TokenStore.open(d, verify="full")
    # verify="none" is the documented opt-out: the flip is read as it is
    _read_all(TokenStore.open(d, verify="none"))


def test_lengths_shifted_with_the_same_sum_are_caught(tmp_path):
    d = tmp_path / "s"
    _text_store(d, _texts())
    index = d / INDEX_FILE
    raw = bytearray(index.read_bytes())
    lens = np.frombuffer(bytes(raw[HEADER_BYTES : HEADER_BYTES + 4 * 30]), dtype=np.uint32).copy()
    lens[3] += 5
    lens[4] -= 5
    raw[HEADER_BYTES : HEADER_BYTES + 4 * 30] = lens.tobytes()
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptIndexError, match=r"checksum does not match.*rebuild=True"):
        TokenStore.open(d)


def test_a_consistent_looking_index_with_shifted_lengths_is_caught_on_read(tmp_path):
    """Even an index rewritten with a valid checksum: documents must end with the end token."""
    d = tmp_path / "s"
    store = _text_store(d, _texts())
    lens = store.lengths.astype(np.uint32)
    lens[3] += 5
    lens[4] -= 5
    (d / INDEX_FILE).write_bytes(encode_index(lens, store.block_sums, 2, store.num_tokens, 257, 64, TOK.EOS))
    shifted = TokenStore.open(d)
    shifted.read(2)
    with pytest.raises(CorruptIndexError, match=r"document 3 .*does not end with the end-of-document token"):
        shifted.read(3, 0, 4)  # even a read that does not reach the document's end


def test_out_of_vocabulary_id_names_the_store_and_document(tmp_path):
    d = tmp_path / "s"
    store = _text_store(d, _texts())
    doc = 5
    raw = bytearray((d / TOKENS_FILE).read_bytes())
    pos = int(store.offsets[doc]) + 2
    raw[2 * pos : 2 * pos + 2] = np.uint16(40000).tobytes()
    (d / TOKENS_FILE).write_bytes(bytes(raw))
    with pytest.raises(CorruptTokensError, match=rf"document {doc} holds token id 40000"):
        TokenStore.open(d).read(doc)
    with pytest.raises(OutOfVocabularyError) as err:
        TokenStore.open(d, verify="none").read(doc)
    msg = str(err.value)
    assert str(d) in msg and f"document {doc}" in msg and "40000" in msg and "rebuild=True" in msg


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_named(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", ["plain ascii text here"] * 8)
    dm = _dm(src, tmp_path / "c", vocab_size=100)  # bytes 100-255 and the end token 256 do not fit
    dm.prepare_data()
    dm.setup("fit")
    with pytest.raises(OutOfVocabularyError, match=r"document \d+ holds token id \d+ .*vocab_size=100"):
        next(iter(dm.train_dataloader()))  # step 0 (before: a bare IndexError in the embedding)


def test_corruption_is_caught_in_loader_workers(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", _texts(60))
    dm = _dm(src, tmp_path / "c", num_workers=1, shuffle=False)
    dm.prepare_data()
    raw = bytearray((dm.store_dir / TOKENS_FILE).read_bytes())
    raw[10] ^= 0x02
    (dm.store_dir / TOKENS_FILE).write_bytes(bytes(raw))
    dm.setup("fit")
    with pytest.raises(CorruptTokensError, match="block 0"):
        for _ in dm.train_dataloader():
            pass


# ========================================================= case 4: content fingerprints and pruning
def _edit_keeping_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    st = path.stat()
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    path.write_bytes(data.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # what cp -p / rsync -t / tar keep
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_an_edit_that_keeps_size_and_mtime_rebuilds(tmp_path, kind):
    if kind == "text":
        (tmp_path / "corpus").mkdir()
        f = tmp_path / "corpus" / "a.txt"
        f.write_text("the quick brown fox " * 10)
        src = {"kind": "text", "path": str(tmp_path / "corpus"), "pattern": "*.txt"}
    else:
        f = tmp_path / "d.jsonl"
        _jsonl(f, ["the quick brown fox " * 10, "second document"])
        src = str(f)
    dm = _dm(src, tmp_path / "cache")
    dm.prepare_data()
    dm.setup("fit")
    before, first = dm.store_dir, dm.store.read(0)
    _edit_keeping_size_and_mtime(f, b"quick", b"QUICK")
    dm2 = _dm(src, tmp_path / "cache")
    assert dm2.store_dir != before  # before: the same folder, the old tokens
    dm2.prepare_data()
    dm2.setup("fit")
    assert TOK.decode(dm2.store.read(0)).startswith("the QUICK") and TOK.decode(first).startswith("the quick")


def test_stale_stores_are_pruned_by_option_and_command(tmp_path):
    f = tmp_path / "d.jsonl"
    _jsonl(f, ["version one of the text"])
    cache = tmp_path / "cache"
    dm1 = _dm(str(f), cache)
    dm1.prepare_data()
    _jsonl(f, ["version two of the text"])
    dm2 = _dm(str(f), cache)
    dm2.prepare_data()
    _jsonl(f, ["version three, longer than the rest"])
    dm3 = _dm(str(f), cache, prune_stale=True)
    other = _dm(_jsonl(tmp_path / "other.jsonl", ["another corpus"]), cache)
    other.prepare_data()
    assert dm1.store_dir.exists() and dm2.store_dir.exists()
    dm3.prepare_data()  # removes this source's older versions, keeps other sources' stores
    assert not dm1.store_dir.exists() and not dm2.store_dir.exists()
    assert dm3.store_dir.exists() and other.store_dir.exists()

    # the command: a store whose files changed on disk is stale; a dry run removes nothing
    _jsonl(tmp_path / "other.jsonl", ["another corpus, edited"])
    cmd = [sys.executable, "-m", "lightning_bytescale.data", "prune", "--cache-dir", str(cache)]
    dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True, timeout=60, check=True)
    assert f"would remove {other.store_dir} (stale: {tmp_path / 'other.jsonl'} changed" in dry.stdout
    assert other.store_dir.exists()
    subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    assert not other.store_dir.exists() and dm3.store_dir.exists()
    assert prune_cache(cache) == []  # nothing else is stale


def test_prune_removes_unused_and_incomplete_stores_but_not_kept_ones(tmp_path):
    cache = tmp_path / "cache"
    dms = [_dm(_jsonl(tmp_path / f"{i}.jsonl", [f"corpus {i}"]), cache) for i in range(3)]
    for dm in dms:
        dm.prepare_data()
    (dms[0].store_dir / INDEX_FILE).unlink()
    old = time.time() - 40 * 86400
    os.utime(dms[1].store_dir / "last_used", (old, old))
    old_format = cache / "store-from-an-older-release"
    write_store(old_format, iter([np.arange(5)]), None, 257)
    raw = bytearray((old_format / INDEX_FILE).read_bytes())
    raw[8] = 1  # format version 1
    (old_format / INDEX_FILE).write_bytes(bytes(raw))
    acts = {a.path: a for a in prune_cache(cache, unused_days=30, keep=[dms[2].store_dir])}
    assert acts[dms[0].store_dir].reason == "incomplete" and acts[dms[1].store_dir].reason == "unused"
    assert acts[old_format].reason == "unusable" and "format version 1" in acts[old_format].detail
    assert dms[2].store_dir.exists() and len(acts) == 3


# ============================================================== case 8: encodings and binary files
def test_invalid_utf8_in_jsonl_names_the_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(2000)]
    lines.append(b'{"text": "caf\xe9"}\n')  # latin-1, line 2001
    f.write_bytes(b"".join(lines))
    dm = _dm(str(f), tmp_path / "cache")
    with pytest.raises(DataError, match=r"d\.jsonl:2001: not valid UTF-8 .*encoding_errors='replace'") as err:
        dm.prepare_data()
    assert isinstance(err.value.__cause__, UnicodeDecodeError)
    assert not [p for p in (tmp_path / "cache").glob("store-*") if p.is_dir()]  # nothing half built is left
    src = JsonlSource(str(f), encoding_errors="replace")
    assert list(src.iter_documents(257))[-1] == "caf\ufffd"


def test_binary_files_in_a_text_folder_are_skipped_and_counted(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("real text")
    (corpus / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (corpus / "c.txt").write_bytes(b"latin-1 caf\xe9\nline two")
    src = TextFilesSource(str(corpus), pattern="*.txt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        docs = list(src.iter_documents(257))
    assert docs == ["real text", "latin-1 caf\ufffd\nline two"]
    text = " | ".join(str(w.message) for w in seen)
    assert "skipped 1 binary file(s) of 3" in text and "b.txt" in text
    assert f"{corpus / 'c.txt'}:1" in text and "not valid UTF-8" in text
    dm = _dm({"kind": "text", "path": str(corpus), "pattern": "*.txt"}, tmp_path / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.prepare_data()
    meta = json.loads((dm.store_dir / META_FILE).read_text())
    assert meta["skipped_binary"] == [str(corpus / "b.txt")] and meta["num_docs"] == 2


# ============================================================ case 9: changed sources, broken stores
def test_a_file_changed_between_prepare_data_and_setup_is_named(tmp_path):
    f = tmp_path / "d.jsonl"
    _jsonl(f, ["first text", "second text"])
    rank0 = _dm(str(f), tmp_path / "cache")
    rank0.prepare_data()
    _jsonl(f, ["first TEXT", "second text"])  # edited before another rank's setup
    rank1 = _dm(str(f), tmp_path / "cache", rank=1, world_size=2)
    with pytest.raises(StoreNotFoundError) as err:
        rank1.setup("fit")
    msg = str(err.value)
    assert (
        f"{f}: content changed (same size)" in msg and "rebuild=True" in msg and str(rank0.store_dir) in msg
    )


def test_a_file_changed_during_the_build_publishes_nothing(tmp_path, monkeypatch):
    f = tmp_path / "d.jsonl"
    _jsonl(f, ["first text", "second text"])
    dm = _dm(str(f), tmp_path / "cache")
    dm.store_dir  # noqa: B018 - hashed now, edited below before the build reads it
    _jsonl(f, ["first text, edited", "second text"])
    with pytest.raises(
        DataError, match=rf"changed while its token store was being built .*{f.name}: content changed"
    ):
        dm.prepare_data()
    assert not dm.store_dir.exists() and not leftovers(dm.store_dir)


@pytest.mark.parametrize("missing", [INDEX_FILE, TOKENS_FILE])
def test_a_store_missing_a_file_names_rebuild(tmp_path, missing):
    src = _jsonl(tmp_path / "d.jsonl", ["some text", "more text"])
    dm = _dm(src, tmp_path / "cache")
    dm.prepare_data()
    (dm.store_dir / missing).unlink()
    for call in (
        lambda: _dm(src, tmp_path / "cache").setup("fit"),
        _dm(src, tmp_path / "cache").prepare_data,
    ):
        with pytest.raises(CorruptIndexError, match=rf"incomplete: {missing} missing.*rebuild=True"):
            call()
    fixed = _dm(src, tmp_path / "cache", rebuild=True)
    fixed.prepare_data()
    fixed.setup("fit")
    assert fixed.store.num_docs == 2


_REBUILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from lightning_bytescale.lightning.datamodule import ByteScaleDataModule
    src, cache, gate = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dm = ByteScaleDataModule(source=src, cache_dir=cache, rebuild=True, capacity=64, context_length=64,
                             tokens_per_step=4096, world_size=1, num_workers=0)
    dm.store_dir
    (gate / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while len(list(gate.glob("ready-*"))) < 3 and time.monotonic() < deadline:  # start together
        time.sleep(0.001)
    dm.prepare_data()
    dm.setup("fit")
    for d in range(dm.store.num_docs):
        dm.store.read(d)
    print("OK", dm.store.content_hash)
    """
)


@pytest.mark.multiprocess
def test_concurrent_rebuilds_on_one_cache(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", _texts(3000, seed=3))
    _dm(src, tmp_path / "cache").prepare_data()  # a store to rebuild
    script = tmp_path / "rebuild.py"
    script.write_text(_REBUILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    gate = tmp_path / "gate"
    gate.mkdir()
    procs = [
        subprocess.Popen([sys.executable, str(script), src, str(tmp_path / "cache"), str(gate)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(3)
    ]  # fmt: skip
    outs = [p.communicate(timeout=100) for p in procs]
    for p, (_, errs) in zip(procs, outs):
        assert p.returncode == 0, errs[-2000:]
    assert len({out.split()[-1] for out, _ in outs}) == 1
    assert not leftovers(_dm(src, tmp_path / "cache").store_dir)


# ====================================================== case 10: options, OS errors, crashes, modes
def test_huge_capacity_without_context_length_gives_sane_advice(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", ["y" * 5000, "short"])
    dm = _dm(src, tmp_path / "cache", capacity=10**9, context_length=None, tokens_per_step=1000, world_size=2)
    dm.prepare_data()
    with pytest.raises(DataError) as err:
        dm.setup("fit")
    msg = str(err.value)
    assert (
        "at least 5001" in msg and "context_length to at most 1000" in msg and "defaults to the pool" in msg
    )
    assert "raise tokens_per_step to at least 2000000000" not in msg


def test_an_unwritable_cache_is_a_data_error_keeping_the_cause(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    dm = _dm(_jsonl(tmp_path / "d.jsonl", ["text"]), blocker / "cache")
    with pytest.raises(DataError, match=rf"{blocker}.*writable folder") as err:
        dm.prepare_data()
    assert isinstance(err.value.__cause__, OSError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_cache_is_a_data_error(tmp_path):
    cache = tmp_path / "ro"
    cache.mkdir(mode=0o500)
    dm = _dm(_jsonl(tmp_path / "d.jsonl", ["text"]), cache)
    with pytest.raises(DataError, match="writable folder") as err:
        dm.prepare_data()
    assert isinstance(err.value.__cause__, PermissionError)


def test_a_folder_named_like_a_jsonl_file(tmp_path):
    (tmp_path / "x.jsonl").mkdir()
    (tmp_path / "x.jsonl" / "part-0.jsonl").write_text(json.dumps({"text": "inside"}) + "\n")
    dm = _dm(str(tmp_path / "x.jsonl"), tmp_path / "cache")
    with pytest.raises(
        DataError, match=r"matches the folder .*x\.jsonl, not a file.*part|x\.jsonl/\*\.jsonl"
    ):
        dm.prepare_data()
    with pytest.raises(DataError, match=r"cannot read source file .*x\.jsonl") as err:
        file_digest(tmp_path / "x.jsonl")
    assert isinstance(err.value.__cause__, IsADirectoryError)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"a": 0, "b": 0, "g": 0}, "zero time"),
        ({"a": 1e300, "b": 1e-6}, "overflows"),
        ({"a": True, "b": 1e-6}, "field a must be a finite number"),
        ({"a": 1e-9, "b": 1e-6, "num_layers": True}, "num_layers must be an integer"),
        ({"a": 1e-9, "b": 1e-6, "bandwidth_inter": "fast"}, "bandwidth_inter must be > 0"),
    ],
)
def test_degenerate_cost_models_are_refused(tmp_path, fields, match):
    with pytest.raises(PlanError, match=match):
        CostModel.from_json_dict(fields)
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(DataError, match=rf"cost_model file .*cm\.json.*{match}"):
        ByteScaleDataModule(cost_model=str(path))


def test_a_cost_model_file_holding_true(tmp_path):
    with pytest.raises(PlanError, match="must be a JSON object"):
        CostModel.from_json_dict(True)
    path = tmp_path / "cm.json"
    path.write_text("true")
    with pytest.raises(DataError, match="not a usable cost model"):
        ByteScaleDataModule(cost_model=str(path))


_SLOW_BUILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from lightning_bytescale.data.store import write_store

    def docs():
        for i in range(10**6):
            time.sleep(0.01)  # a long build
            yield np.arange(5000) % 250

    write_store(sys.argv[1], docs(), None, 257)
    """
)


@pytest.mark.multiprocess
def test_a_killed_build_is_cleaned_up_by_the_next_one(tmp_path):
    store = tmp_path / "cache" / "store-x"
    script = tmp_path / "slow.py"
    script.write_text(_SLOW_BUILD)
    proc = subprocess.Popen([sys.executable, str(script), str(store)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not leftovers(store):
            assert time.monotonic() < deadline and proc.poll() is None, "the build never started"
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    [tmp] = leftovers(store)
    assert (tmp / TOKENS_FILE).stat().st_size > 0  # a half-written build was left (before: for good)
    write_store(store, iter([np.arange(10)]), None, 257)  # the next build removes it
    assert not tmp.exists() and TokenStore.open(store).num_docs == 1


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700), (0o002, 0o775)])
def test_store_folders_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_store(tmp_path / "s", iter([np.arange(10)]), None, 257)
    finally:
        os.umask(old)
    assert (tmp_path / "s").stat().st_mode & 0o777 == mode
    assert (tmp_path / "s" / TOKENS_FILE).stat().st_mode & 0o777 == mode & 0o666


def test_verify_command_reports_damage(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    _text_store(good, _texts())
    _text_store(bad, _texts())
    raw = bytearray((bad / TOKENS_FILE).read_bytes())
    raw[-3] ^= 0x04
    (bad / TOKENS_FILE).write_bytes(bytes(raw))
    cmd = [sys.executable, "-m", "lightning_bytescale.data", "verify", str(good), str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"ok {good}" in proc.stdout and f"DAMAGED {bad}" in proc.stdout
