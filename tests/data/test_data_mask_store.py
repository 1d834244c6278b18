"""The token store's loss mask: kept bit-packed beside the tokens, covered by the checksums.

Round trips at every bit offset, the index layout, lazy and full verification of ``mask.bin``,
a missing or resized mask file, an index whose loss counts disagree with the mask, builds in
several processes byte-identical to one, and pickling for loader workers.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from lightning_bytescale.data import CorruptIndexError, CorruptTokensError, DataError, TokenStore, write_store
from lightning_bytescale.data.encode import MaskedTokens, encode_documents
from lightning_bytescale.data.store import (
    FLAG_MASK,
    HEADER_BYTES,
    INDEX_FILE,
    MASK_FILE,
    META_FILE,
    TOKENS_FILE,
    encode_index,
)

VOCAB = 300


def masked_docs(n: int, seed: int = 0, longest: int = 40) -> list[MaskedTokens]:
    rng = np.random.default_rng(seed)
    out = []
    for k in rng.integers(0, longest, size=n):
        out.append(MaskedTokens(rng.integers(0, VOCAB, size=int(k)), rng.random(int(k)) < 0.4))
    return out


def build(path: Path, docs, block_bytes: int = 8, **kw) -> TokenStore:
    write_store(path, iter(docs), None, VOCAB, loss_mask=True, block_bytes=block_bytes, **kw)
    return TokenStore.open(path)


def test_mask_round_trip_at_every_bit_offset(tmp_path):
    docs = masked_docs(60)
    store = build(tmp_path / "s", docs)
    assert store.has_mask and store.num_docs == 60
    assert store.max_token_id == max(int(d.ids.max()) for d in docs if d.ids.size)
    for i, d in enumerate(docs):
        want = d.mask.copy()
        want[:1] = False  # the first token is never a target
        np.testing.assert_array_equal(store.read(i), d.ids)
        np.testing.assert_array_equal(store.read_mask(i), want)
        assert int(store.loss_counts[i]) == int(want.sum())
        for start in range(min(int(d.ids.size), 9)):  # sub-ranges starting at each bit offset
            n = int(d.ids.size) - start
            np.testing.assert_array_equal(store.read_mask(i, start, n), want[start:])
    assert store.num_loss_tokens == sum(int(d.mask[1:].sum()) for d in docs)
    # one bit a token, and the index holds a count per document and a checksum per mask block
    num_tokens = store.num_tokens
    mask_bytes = -(-num_tokens // 8)
    assert (tmp_path / "s" / MASK_FILE).stat().st_size == mask_bytes
    blocks, mask_blocks = -(-num_tokens * 2 // 8), -(-mask_bytes // 8)
    index = (tmp_path / "s" / INDEX_FILE).stat().st_size
    assert index == HEADER_BYTES + 8 * 60 + 8 * (blocks + mask_blocks)


def test_a_store_without_mask_keeps_the_old_layout_and_refuses_read_mask(tmp_path):
    write_store(tmp_path / "s", iter([np.arange(5)]), None, VOCAB)
    store = TokenStore.open(tmp_path / "s")
    assert not store.has_mask and not (tmp_path / "s" / MASK_FILE).exists()
    assert store.num_loss_tokens == 4
    with pytest.raises(DataError, match="has no loss mask"):
        store.read_mask(0)


def test_masks_and_plain_documents_do_not_mix(tmp_path):
    with pytest.raises(DataError, match="has no loss mask, but the store keeps one"):
        write_store(tmp_path / "a", iter([np.arange(5)]), None, VOCAB, loss_mask=True)
    with pytest.raises(DataError, match="comes with a loss mask, but the store was not asked"):
        write_store(tmp_path / "b", iter(masked_docs(3)), None, VOCAB)
    with pytest.raises(DataError, match="does not match its"):
        MaskedTokens(np.arange(4), np.ones(3, bool))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_flipped_mask_bit_is_caught_lazily_and_in_full(tmp_path):
    d = tmp_path / "s"
    store = build(d, masked_docs(60))
    raw = bytearray((d / MASK_FILE).read_bytes())
    raw[20] ^= 0x10  # one bit: a token's trained flag
    (d / MASK_FILE).write_bytes(bytes(raw))
    doc = int(np.searchsorted(store.offsets, 20 * 8 + 4, side="right") - 1)
    with pytest.raises(CorruptTokensError, match=r"block 2 of mask\.bin .*documents .*rebuild=True"):
        TokenStore.open(d, verify="full")
    lazy = TokenStore.open(d)
    lazy.read_mask(0)  # an untouched block reads fine
    with pytest.raises(CorruptTokensError, match=r"mask\.bin"):
        lazy.read_mask(doc)
    # unchecked, the index's count still catches it when the whole document is read
    with pytest.raises(CorruptIndexError, match=rf"loss mask of document {doc} has \d+ loss tokens"):
        TokenStore.open(d, verify="none").read_mask(doc)
    assert TokenStore.open(d, verify="none").content_hash == store.content_hash  # the index is intact


def test_missing_or_resized_mask_file_is_named(tmp_path):
    d = tmp_path / "s"
    build(d, masked_docs(10))
    raw = (d / MASK_FILE).read_bytes()
    (d / MASK_FILE).write_bytes(raw[:-1])
    with pytest.raises(CorruptIndexError, match=r"mask\.bin has \d+ bytes, but the index announces"):
        TokenStore.open(d)
    (d / MASK_FILE).unlink()
    with pytest.raises(
        CorruptIndexError, match=r"announces a loss mask but mask\.bin is missing.*rebuild=True"
    ):
        TokenStore.open(d)


def test_index_checks_cover_the_loss_counts(tmp_path):
    d = tmp_path / "s"
    docs = masked_docs(10)
    store = build(d, docs)
    index = d / INDEX_FILE
    good = index.read_bytes()
    # a count changed without fixing the checksum
    raw = bytearray(good)
    at = HEADER_BYTES + 4 * 10
    raw[at] ^= 1
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptIndexError, match="checksum does not match"):
        TokenStore.open(d)
    # a consistent index whose counts exceed what a document can train
    counts = store.loss_counts.copy()
    counts[3] = store.lengths[3] + 1
    index.write_bytes(
        encode_index(
            store.lengths,
            store.block_sums,
            2,
            store.num_tokens,
            VOCAB,
            8,
            None,
            max_id=store.max_token_id,
            loss_counts=counts,
            mask_sums=store.mask_sums,
        )  # fmt: skip
    )
    with pytest.raises(CorruptIndexError, match=r"document 3 has \d+ loss tokens but only \d+ tokens"):
        TokenStore.open(d)
    # the flag and the sizes must agree
    raw = bytearray(good)
    raw[HEADER_BYTES - 16] &= ~FLAG_MASK & 0xFF
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptIndexError, match="bytes, but the header announces"):
        TokenStore.open(d)


def test_several_build_processes_write_the_same_bytes(tmp_path):
    texts = [f"doc {i} " * (i % 7 + 1) for i in range(700)]

    for procs in (1, 2):
        write_store(
            tmp_path / f"s{procs}", iter(texts), _encode, VOCAB, loss_mask=True, num_proc=procs, batch_docs=64
        )
    for name in (TOKENS_FILE, INDEX_FILE, MASK_FILE):
        assert (tmp_path / "s1" / name).read_bytes() == (tmp_path / "s2" / name).read_bytes()
    # the stream keeps its order whatever the process count, arrays passing through
    mixed = [*texts[:300], np.arange(4), *texts[300:]]
    order = [len(x) for x in encode_documents(mixed, _plain, batch_docs=64, num_proc=2)]
    assert order == [len(x) for x in encode_documents(mixed, _plain, batch_docs=64, num_proc=1)]


def _encode(batch):
    out = []
    for text in batch:
        ids = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
        out.append(MaskedTokens(ids, ids % 3 == 0))
    return out


def _plain(batch):
    return [np.frombuffer(t.encode(), np.uint8).astype(np.int64) for t in batch]


def test_workers_get_the_store_by_pickle_without_mapped_data(tmp_path):
    docs = masked_docs(30)
    store = build(tmp_path / "s", docs)
    store.read_mask(3)
    assert store._mask is not None
    clone = pickle.loads(pickle.dumps(store))
    assert clone._mask is None and clone._tokens is None
    np.testing.assert_array_equal(clone.read_mask(5), store.read_mask(5))


def test_meta_records_the_mask_and_build_speed(tmp_path):
    import json

    build(tmp_path / "s", masked_docs(10))
    meta = json.loads((tmp_path / "s" / META_FILE).read_text())
    assert meta["loss_mask"] is True and meta["loss_tokens"] > 0 and meta["build_seconds"] >= 0
    assert meta["max_token_id"] < VOCAB


def test_the_vocabulary_check_names_the_first_id_that_does_not_fit(tmp_path):
    docs = [
        MaskedTokens(np.array([1, 2, 3]), np.ones(3, bool)),
        MaskedTokens(np.array([4, 250, 7]), np.ones(3, bool)),
    ]
    store = build(tmp_path / "s", docs)
    assert store.first_out_of_vocabulary(251) is None  # the index's largest id answers without a scan
    assert store.first_out_of_vocabulary(250) == (1, 1, 250)
    assert store.first_out_of_vocabulary(5) == (1, 1, 250)
    assert store.first_out_of_vocabulary(2) == (0, 1, 2)
