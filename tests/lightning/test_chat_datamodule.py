"""``ByteScaleDataModule`` on chat data: policies, sources, store identity and the vocabulary check."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from _chat_helpers import CONVERSATION, VOCAB, by_hand, word_tokenizer  # noqa: E402

from lightning_bytescale.data import DataError, OutOfVocabularyError  # noqa: E402
from lightning_bytescale.data.synthetic_chat import SAMPLES_DIR  # noqa: E402
from lightning_bytescale.lightning.datamodule import ByteScaleDataModule, model_vocab_size  # noqa: E402

LONG = (
    CONVERSATION
    + [{"role": "user", "content": "what is two ?"}, {"role": "assistant", "content": "four ."}] * 3
)
NO_ANSWER = [{"role": "user", "content": "hi"}]
PAIR = {"prompt": "what is two ?", "completion": "four ."}


@pytest.fixture
def folder(tmp_path) -> Path:
    word_tokenizer(tmp_path / "tokenizer.json")
    rows = [{"messages": CONVERSATION}, {"messages": LONG}, {"messages": NO_ANSWER}, PAIR]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def dm_for(folder: Path, **kw) -> ByteScaleDataModule:
    opts = dict(
        source={"kind": "chat", "path": str(folder / "chat.jsonl")},
        tokenizer=str(folder / "tokenizer.json"),
        chat_template="chatml",
        cache_dir=folder / "cache",
        world_size=1,
        capacity=64,
        context_length=24,
        tokens_per_step=64,
        num_workers=0,
    )
    opts.update(kw)
    return ByteScaleDataModule(**opts)


def ready(dm: ByteScaleDataModule) -> ByteScaleDataModule:
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_long_conversations_are_dropped_and_counted_by_default(folder, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_bytescale.lightning.datamodule"):
        dm = ready(dm_for(folder))
    assert dm.long_document_policy == "drop" and dm.loss_on == "assistant"
    report = dm.train_samples.report
    # CONVERSATION (18 tokens) and the pair stay; LONG (36) is too long; NO_ANSWER trains nothing
    assert report["long_documents"] == 1 and report["no_loss_dropped"] == 1
    assert sorted(dm.train_samples.doc.tolist()) == [0, 3]
    assert dm.train_samples.loss_tokens.tolist() == [5, 3]
    assert "1 conversations longer than the context length 24 were dropped" in caplog.text
    assert "1 samples with no trained token" in caplog.text


def test_truncated_conversations_count_only_their_kept_trained_tokens(folder):
    dm = ready(dm_for(folder, long_document_policy="truncate"))
    samples = dm.train_samples
    i = samples.doc.tolist().index(1)
    assert samples.length[i] == 24
    _, mask = by_hand(LONG, "assistant")
    assert samples.loss_tokens[i] == sum(mask[1:24])
    batch = next(iter(dm.train_dataloader()))
    assert batch.num_global_tokens == int(samples.loss_tokens.sum())


def test_conversations_are_never_split_and_masks_need_chats(folder):
    with pytest.raises(DataError, match="'split' would cut conversations apart"):
        dm_for(folder, long_document_policy="split")
    text = folder / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(DataError, match="loss_on='assistant' needs chat data"):
        ByteScaleDataModule(source=str(text), loss_on="assistant")
    with pytest.raises(DataError, match="chat_template= is for chat data"):
        ByteScaleDataModule(source=str(text), chat_template="chatml")
    assert ByteScaleDataModule(source=str(text)).long_document_policy == "split"
    with pytest.raises(DataError, match="exactly one of `path`.*data.source.path="):
        ByteScaleDataModule(source={"kind": "chat", "path": None, "name": None})


def test_loss_on_and_template_are_part_of_the_store_identity(folder):
    dirs = {
        dm_for(folder).store_dir,
        dm_for(folder, loss_on="completion").store_dir,
        dm_for(folder, loss_on="all").store_dir,
        dm_for(folder, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").store_dir,
    }
    assert len(dirs) == 4
    everything = ready(dm_for(folder, loss_on="all", context_length=64))
    assert not everything.store.has_mask and everything.train_samples.loss_tokens is None
    assert everything.train_samples.num_tokens == everything.store.num_tokens


def test_a_datasets_source_gives_the_same_store_as_jsonl(folder):
    jsonl = ready(dm_for(folder))
    hf = ready(
        dm_for(
            folder,
            source={"kind": "chat", "name": "json", "kwargs": {"data_files": str(folder / "chat.jsonl")}},
            cache_dir=folder / "cache-hf",
        )
    )
    assert hf.store.content_hash == jsonl.store.content_hash  # the same tokens and masks, bit for bit


def test_several_tokenizing_processes_and_a_progress_bar(tmp_path, capsys):
    rows = [{"messages": CONVERSATION}] * 700 + [PAIR] * 100
    word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = dm_for(tmp_path, tokenize_workers=1, cache_dir=tmp_path / "c1")
    two = dm_for(tmp_path, tokenize_workers=2, cache_dir=tmp_path / "c2", progress=True)
    for dm in (one, two):
        ready(dm)
    assert one.store.content_hash == two.store.content_hash
    err = capsys.readouterr().err
    assert "tokenizing into store-" in err and "800/800" in err  # the bar, with the line count as total


def test_the_model_vocabulary_is_checked_before_the_first_step(folder):
    dm = ready(dm_for(folder, model_vocab_size=8))
    assert dm.vocab_size == len(VOCAB)  # the tokenizer's: what a model built for this data needs
    with pytest.raises(OutOfVocabularyError) as err:
        dm.train_dataloader()
    msg = str(err.value)
    assert "vocab_size=8" in msg and f"the tokenizer has {len(VOCAB)} tokens" in msg
    assert f"config_overrides.vocab_size={len(VOCAB)}" in msg and "document 0 holds token id" in msg
    # a model just large enough for the data's ids passes (the tokenizer may be larger)
    fits = ready(dm_for(folder, model_vocab_size=dm.store.max_token_id + 1))
    next(iter(fits.train_dataloader()))
    with pytest.raises(DataError, match="disagree"):
        dm_for(folder, vocab_size=8, model_vocab_size=9)


def test_the_model_vocabulary_is_found_on_the_lightning_module():
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_bytescale.recipes.module import PretrainModule

    assert model_vocab_size(PretrainModule("tiny", vocab=300)) == 300

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = AutoConfig.for_model(
                "llama", vocab_size=123, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1,
            )  # fmt: skip
            self.model = AutoModelForCausalLM.from_config(config)

    assert model_vocab_size(Wrapper()) == 123
    assert model_vocab_size(torch.nn.Linear(2, 2)) is None


def test_the_shipped_sample_builds(tmp_path):
    dm = ByteScaleDataModule(
        source={"kind": "chat", "path": str(SAMPLES_DIR / "chat.jsonl")},
        tokenizer=str(SAMPLES_DIR / "tokenizer.json"),
        cache_dir=tmp_path,
        world_size=2,
        rank=0,
        capacity=256,
        context_length=512,
        tokens_per_step=2048,
        num_workers=0,
    )
    ready(dm)
    assert dm.store.has_mask and dm.train_samples.report["no_loss_dropped"] == 0
    assert 0.2 < dm.store.num_loss_tokens / dm.store.num_tokens < 0.5  # answers, not questions or markup
    runs = dm.encoder.decode_trained(dm.store.read(0), dm.store.read_mask(0))
    record = json.loads((SAMPLES_DIR / "chat.jsonl").read_text().splitlines()[0])
    answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert runs == [f"{a}<|im_end|>\n" for a in answers]
    assert np.all(dm.store.read(0) < dm.vocab_size)


@pytest.mark.parametrize("bad", ["record", "template"])
def test_errors_in_tokenizing_processes_name_the_record(tmp_path, bad):
    """A bad record read after the workers started, or a template failing in a worker, still names its line."""
    word_tokenizer(tmp_path / "tokenizer.json")
    rows = [json.dumps({"messages": CONVERSATION})] * 700
    if bad == "record":
        rows[650] = json.dumps({"messages": [{"content": "hi"}]})
    else:
        rows[650] = json.dumps({"messages": [{"role": "user", "content": "bye bye"}]})
    (tmp_path / "chat.jsonl").write_text("\n".join(rows) + "\n")
    template = (
        "{% for m in messages %}{% if m['content'] == 'bye bye' %}{{ raise_exception('two byes') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    dm = dm_for(tmp_path, tokenize_workers=2, chat_template=template)
    needle = (
        "messages\\[0\\] has no 'role'"
        if bad == "record"
        else "the chat template failed on this record: two byes"
    )
    with pytest.raises(DataError, match=rf"chat\.jsonl:651: {needle}"):
        dm.prepare_data()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # nothing half built is left
