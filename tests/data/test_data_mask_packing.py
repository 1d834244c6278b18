"""Loss masks through the packing and the data module: every trained token trained exactly once.

Property tests (hypothesis) over random lengths, masks, world sizes, capacities and planners:
across all ranks and micro-batches, including sequences sharded over zigzag rings, every token
whose mask is set is the label of exactly one slot, with its own id, no masked token is a
label, and every micro-batch carries the global count of trained tokens.  Then the same through
``ByteScaleDataModule`` on random conversations: JSONL -> chat template -> token store with
its mask -> sample table -> per-rank ``StepBatch``es, checked against the store and an
independent encoding.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_bytescale.engine.micro_batch import EmptyBatchError, PackingError, build_step
from lightning_bytescale.planner import PlanError, make_plan

IGNORE = -100


def trained_slots(batches) -> tuple[Counter, dict, set]:
    """``(seq, pos) -> times labelled``, their label values, and each micro-batch's global count."""
    seen: Counter = Counter()
    values: dict = {}
    counts = set()
    for batch in batches:
        for mb in batch.micro_batches:
            seq = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(mb.layout.slots))
            for j, p, label in zip(seq.tolist(), mb.position_ids.tolist(), mb.labels.tolist()):
                if label != IGNORE:
                    seen[(j, p)] += 1
                    values[(j, p)] = label
            counts.add(mb.num_global_tokens)
        counts.add(batch.num_global_tokens)
    return seen, values, counts


def expected(tokens: list[np.ndarray], masks: list[np.ndarray]) -> dict:
    """``(seq, pos) -> label`` written from the definition: the next token where its mask is set."""
    return {
        (j, p): int(t[p + 1])
        for j, (t, m) in enumerate(zip(tokens, masks))
        for p in range(t.size - 1)
        if m[p + 1]
    }


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_every_trained_token_is_trained_once_on_any_plan(data):
    world = data.draw(st.integers(1, 4), label="world")
    capacity = data.draw(st.integers(4, 12), label="capacity")
    planner = data.draw(st.sampled_from(["balance", "naive", "static"]), label="planner")
    longest = world * (capacity - 2)  # zigzag pads a ring's share to whole chunk pairs
    lengths = data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=8), label="lengths")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    tokens = [rng.integers(0, 1000, size=s) for s in lengths]
    density = data.draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]), label="density")
    masks = [rng.random(s) < density for s in lengths]  # the first flag is arbitrary: never a target
    want = expected(tokens, masks)
    try:
        plan = make_plan(lengths, world_size=world, capacity=capacity, planner=planner, seed=1)
    except PlanError:
        assume(False)  # a length the pool cannot place: not this test's subject
    counts = [int(m[1:].sum()) for m in masks]

    def step(r, **kw):
        return build_step(plan, r, lambda j: tokens[j], loss_mask=lambda j: masks[j], **kw)

    if not want:
        with pytest.raises(EmptyBatchError, match="no trained token"):
            step(0, loss_tokens=counts)
        return
    for given_counts in (counts, None):  # from the sample table, or read from every mask
        seen, values, totals = trained_slots([step(r, loss_tokens=given_counts) for r in range(world)])
        assert set(seen) == set(want) and set(seen.values()) == {1}  # once each, none masked
        assert values == want
        assert totals == {len(want)}


def test_sharded_sequences_are_labelled_across_the_chunk_boundaries():
    """A sequence on a ring of 3: the last slot of each zigzag chunk reads the next chunk's mask."""
    s, world, capacity = 30, 3, 10
    tokens = [np.arange(100, 100 + s)]
    mask = np.zeros(s, bool)
    mask[[5, 6, 10, 11, 15, 20, 25, 29]] = True  # 5, 10, 15, 20, 25 open a chunk of 5 (6 chunks)
    plan = make_plan([s], world_size=world, capacity=capacity, planner="balance")
    batches = [build_step(plan, r, lambda j: tokens[0], loss_mask=lambda j: mask) for r in range(world)]
    assert all(mb.layout.ring is not None for b in batches for mb in b.micro_batches)
    seen, values, totals = trained_slots(batches)
    assert values == expected(tokens, [mask]) and set(seen.values()) == {1} and totals == {8}


def test_counts_that_disagree_with_the_masks_are_refused():
    tokens, masks = [np.arange(6)], [np.array([0, 1, 1, 0, 1, 0], bool)]
    plan = make_plan([6], world_size=1, capacity=8, planner="balance")
    with pytest.raises(PackingError, match="trains 3 tokens, the sample table says 2"):
        build_step(plan, 0, lambda j: tokens[j], loss_mask=lambda j: masks[j], loss_tokens=[2])
    with pytest.raises(PackingError, match="6 loss tokens but length 6"):
        build_step(plan, 0, lambda j: tokens[j], loss_mask=lambda j: masks[j], loss_tokens=[6])
    with pytest.raises(PackingError, match="without a loss_mask"):
        build_step(plan, 0, lambda j: tokens[j], loss_tokens=[3])
    with pytest.raises(PackingError, match="shape \\(5,\\), its tokens \\(6,\\)"):
        build_step(plan, 0, lambda j: tokens[j], loss_mask=lambda j: masks[j][:5])


# ------------------------------------------------------------------ through the data module
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from _chat_helpers import CONTENT_WORDS, by_hand, word_tokenizer  # noqa: E402

from lightning_bytescale.data import DataError  # noqa: E402
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule  # noqa: E402

conversation = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "assistant"]),
            "content": st.lists(st.sampled_from(CONTENT_WORDS), max_size=12).map(" ".join),
        }
    ),
    min_size=1,
    max_size=8,
)


def module(folder: Path, rank: int, world: int, capacity: int, **kw) -> ByteScaleDataModule:
    return ByteScaleDataModule(
        source={"kind": "chat", "path": str(folder / "chat.jsonl")},
        tokenizer=str(folder / "tokenizer.json"),
        chat_template="chatml",
        cache_dir=folder / "cache",
        rank=rank,
        world_size=world,
        capacity=capacity,
        tokens_per_step=2 * world * capacity,
        planner="balance",
        num_workers=0,
        tokenize_workers=1,
        **kw,
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chats=st.lists(conversation, min_size=3, max_size=20),
    world=st.integers(1, 3),
    capacity=st.integers(8, 24),
    loss_on=st.sampled_from(["assistant", "completion"]),
)
def test_random_conversations_reach_the_step_batches_exactly(chats, world, capacity, loss_on):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        word_tokenizer(folder / "tokenizer.json")
        (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
        encodings = [by_hand(c, loss_on) for c in chats]
        limit = module(folder, 0, world, capacity).pool_tokens()  # the longest sample the pool holds
        dms = [
            module(folder, r, world, capacity, loss_on=loss_on, context_length=limit) for r in range(world)
        ]
        dms[0].prepare_data()
        kept = [d for d, (ids, m) in enumerate(encodings) if sum(m[1:]) and len(ids) <= limit]
        if not kept:
            with pytest.raises(DataError, match="no sample"):
                dms[0].setup("fit")
            return
        for dm in dms:
            dm.setup("fit")
        store, samples = dms[0].store, dms[0].train_samples
        # the store holds exactly the independent encoding; dropped are the too long and the untrained
        for doc, (ids, mask) in enumerate(encodings):
            assert store.read(doc).tolist() == ids and store.read_mask(doc).astype(int).tolist() == mask
        assert sorted(samples.doc.tolist()) == kept
        assert samples.report["long_documents"] == sum(len(ids) > limit for ids, _ in encodings)
        loaders = [iter(dm.train_dataloader()) for dm in dms]
        dataset = dms[0]._train_loader.dataset
        labelled: Counter = Counter()
        sharded = 0
        for step in range(len(dms[0]._train_loader)):
            batches = [next(it) for it in loaders]
            ids = dataset.sample_ids(0, step)
            toks = [store.read(int(samples.doc[i])) for i in ids]
            masks = [store.read_mask(int(samples.doc[i])) for i in ids]
            seen, values, totals = trained_slots(batches)
            assert values == expected(toks, masks) and set(seen.values()) == {1}
            assert totals == {sum(int(m[1:].sum()) for m in masks)}
            labelled.update(int(samples.doc[i]) for i in ids)
            sharded += sum(mb.layout.ring is not None for b in batches for mb in b.micro_batches)
        assert sorted(labelled) == kept and set(labelled.values()) == {1}  # each conversation once an epoch
        if world > 1 and any(len(encodings[d][0]) > capacity for d in kept):
            assert sharded  # a conversation longer than one rank's capacity ran on a ring


def test_masked_labels_reach_the_loss_through_the_step_batch(tmp_path):
    """The loss of a StepBatch is the mean over trained tokens only: a masked token changes nothing."""
    from lightning_bytescale.engine.loss import token_loss

    word_tokenizer(tmp_path / "tokenizer.json")
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello ok"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    dm = module(tmp_path, 0, 1, 32, context_length=32)
    dm.prepare_data()
    dm.setup("fit")
    [batch] = list(dm.train_dataloader())
    [mb] = batch.micro_batches
    assert batch.num_global_tokens == 3  # "hello", "ok", "<|im_end|>"
    logits = torch.randn(mb.num_slots, 40, dtype=torch.float64, requires_grad=True)
    loss = token_loss(logits, mb.labels, mb.num_global_tokens)
    trained = mb.labels != IGNORE
    want = torch.nn.functional.cross_entropy(logits[trained], mb.labels[trained], reduction="sum") / 3
    assert torch.allclose(loss, want, rtol=0, atol=1e-14)
    loss.backward()
    assert logits.grad[~trained].abs().max() == 0  # masked positions get no gradient at all
