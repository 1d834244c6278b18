"""Chat records to ids and loss masks: exact on hand-built conversations, and on random ones.

The tokenizer here is word-level (every word and special token one id, whitespace dropped), so
the expected ids, masks and labels can be written down by hand and, for random conversations,
built independently of the chat template: ``<|im_start|> role words... <|im_end|>`` per message,
the assistant's words and its ``<|im_end|>`` trained.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _chat_helpers import CONTENT_WORDS, CONVERSATION, VOCAB, by_hand, word_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from lightning_bytescale.data import DataError  # noqa: E402
from lightning_bytescale.data.chat import ChatFields, ChatJsonlSource, ChatRecord, parse_record  # noqa: E402
from lightning_bytescale.data.chat_encoder import CHATML, ChatEncoder  # noqa: E402
from lightning_bytescale.data.encode import MaskedTokens  # noqa: E402
from lightning_bytescale.data.tokenizer import HFTokenizer, JsonTokenizer, load_tokenizer  # noqa: E402
from lightning_bytescale.engine.micro_batch import IGNORE_INDEX, build_step  # noqa: E402
from lightning_bytescale.planner import make_plan  # noqa: E402

V = VOCAB  # short name for the hand-written expectations

# ChatML with the assistant's content and end token in {% generation %} blocks
CHATML_TRACKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# renders earlier assistant turns as "ok" (as templates that drop old reasoning rewrite them)
CHATML_REWRITING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\nok<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tok(tmp_path) -> JsonTokenizer:
    return JsonTokenizer(word_tokenizer(tmp_path / "tokenizer.json"))


IDS = [
    V["<|im_start|>"], V["user"], V["hi"], V["there"], V["<|im_end|>"],
    V["<|im_start|>"], V["assistant"], V["hello"], V["<|im_end|>"],
    V["<|im_start|>"], V["user"], V["bye"], V["<|im_end|>"],
    V["<|im_start|>"], V["assistant"], V["ok"], V["bye"], V["<|im_end|>"],
]  # fmt: skip
ASSISTANT = [0] * 7 + [1, 1] + [0] * 6 + [1, 1, 1]  # "hello <|im_end|>", "ok bye <|im_end|>"
COMPLETION = [0] * 15 + [1, 1, 1]


def encode(encoder: ChatEncoder, record: ChatRecord):
    [out] = encoder.encode_batch([record])
    return out


def labels_of(ids: list[int], mask: list[int] | None) -> list[int]:
    """The next-token labels a sequence gets, written independently of the packing code."""
    return [ids[p + 1] if (mask is None or mask[p + 1]) else IGNORE_INDEX for p in range(len(ids) - 1)] + [
        IGNORE_INDEX
    ]


# ------------------------------------------------------------------------------- hand-built
@pytest.mark.parametrize(
    ("loss_on", "template", "want"),
    [
        ("assistant", "chatml", ASSISTANT),
        ("assistant", CHATML_TRACKED, ASSISTANT),
        ("completion", "chatml", COMPLETION),
        ("completion", CHATML_TRACKED, COMPLETION),
        ("completion", CHATML_REWRITING, COMPLETION),
    ],
)
def test_conversation_ids_mask_labels_and_loss_tokens_are_exact(tok, loss_on, template, want):
    enc = ChatEncoder(tok, loss_on, template)
    out = encode(enc, ChatRecord(messages=CONVERSATION, where="t"))
    assert isinstance(out, MaskedTokens)
    ids = list(IDS)
    if template is CHATML_REWRITING:
        ids[7] = V["ok"]  # what that template writes for the earlier answer
    assert out.ids.tolist() == ids  # the template adds no BOS: none is added
    assert out.mask.astype(int).tolist() == want
    assert out.loss_tokens == sum(want)
    # through the packing, on one rank: labels -100 exactly where the target is masked
    plan = make_plan([len(IDS)], world_size=1, capacity=64, planner="balance")
    batch = build_step(plan, 0, lambda j: out.ids, loss_mask=lambda j: out.mask)
    [mb] = batch.micro_batches
    assert mb.labels.tolist() == labels_of(ids, want)
    assert (
        batch.num_global_tokens == mb.num_global_tokens == sum(want) == (5 if loss_on == "assistant" else 3)
    )


def test_all_tokens_keep_no_mask(tok):
    enc = ChatEncoder(tok, "all", "chatml")
    out = encode(enc, ChatRecord(messages=CONVERSATION, where="t"))
    assert isinstance(out, np.ndarray) and out.tolist() == IDS and not enc.loss_mask


def test_prompt_completion_strings_use_no_template(tok):
    enc = ChatEncoder(tok, "assistant", "chatml")
    out = encode(enc, ChatRecord(prompt="what is two ?", completion="four .", where="t"))
    # the prompt gets the tokenizer's BOS, the completion is followed by the end token, both trained
    assert out.ids.tolist() == [V["<s>"], V["what"], V["is"], V["two"], V["?"], V["four"], V["."], V["</s>"]]
    assert out.mask.astype(int).tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert ChatEncoder(tok, "completion", "chatml").encode_batch(
        [ChatRecord(prompt="what is two ?", completion="four .", where="t")]
    )[0].mask.astype(int).tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert encode(ChatEncoder(tok, "all", "chatml"), ChatRecord(prompt="hi", completion="ok", where="t")).tolist() == [
        V["<s>"], V["hi"], V["ok"], V["</s>"]
    ]  # fmt: skip


def test_prompt_completion_messages_train_the_completion_only(tok):
    record = parse_record({"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}, "t", ChatFields())
    out = encode(ChatEncoder(tok, "assistant", "chatml"), record)
    assert out.ids.tolist() == IDS and out.mask.astype(int).tolist() == COMPLETION


def test_a_template_that_rewrites_earlier_turns_is_refused_for_every_assistant_turn(tok):
    enc = ChatEncoder(tok, "assistant", CHATML_REWRITING)
    with pytest.raises(DataError, match=r"here:3: the chat template renders .*loss_on='completion'"):
        enc.encode_batch([ChatRecord(messages=CONVERSATION, where="here:3")])


def test_a_conversation_without_assistant_trains_nothing(tok):
    out = encode(ChatEncoder(tok, "assistant", "chatml"), ChatRecord(messages=CONVERSATION[:1], where="t"))
    assert out.loss_tokens == 0
    last_user = CONVERSATION[:3]
    out = encode(ChatEncoder(tok, "completion", "chatml"), ChatRecord(messages=last_user, where="t"))
    assert out.loss_tokens == 0


def test_the_tokenizer_folder_and_its_own_template(tmp_path, tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tok.path), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.chat_template = CHATML
    hf.save_pretrained(tmp_path / "folder")
    folder = load_tokenizer(str(tmp_path / "folder"))
    assert isinstance(folder, HFTokenizer) and folder.chat_template() == CHATML
    assert folder.eos_id == V["</s>"] and folder.vocab_size == len(VOCAB)
    out = encode(ChatEncoder(folder, "assistant"), ChatRecord(messages=CONVERSATION, where="t"))
    assert out.ids.tolist() == IDS and out.mask.astype(int).tolist() == ASSISTANT
    # the template is part of the encoder's identity (and so of the store's)
    assert (
        ChatEncoder(folder, "assistant").fingerprint
        != ChatEncoder(folder, "assistant", CHATML_TRACKED).fingerprint
    )
    assert ChatEncoder(folder, "assistant").fingerprint != ChatEncoder(folder, "completion").fingerprint


def test_a_tokenizer_without_template_names_the_fix(tok):
    with pytest.raises(DataError, match=r"no chat template.*chat_template=.*chatml"):
        ChatEncoder(tok, "assistant")
    from lightning_bytescale.data.tokenizer import ByteTokenizer

    with pytest.raises(DataError, match="Hugging Face tokenizer"):
        ChatEncoder(ByteTokenizer(), "assistant", "chatml")
    with pytest.raises(DataError, match="loss_on='prompt'"):
        ChatEncoder(tok, "prompt", "chatml")


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ({"text": "hi"}, "no 'messages' and no 'prompt' \\+ 'completion'"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"content": "hi"}]}, "messages\\[0\\] has no 'role'"),
        ({"messages": [{"role": "user"}]}, "messages\\[0\\] \\(user\\) has no 'content'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages\\[0\\] .*only text is trained",
        ),
        (
            {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
            "'prompt' and 'completion' must both be strings or both lists",
        ),
    ],
)
def test_bad_records_name_the_file_line_and_problem(tmp_path, record, needle):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"chat\.jsonl:3: {needle}"):
        list(ChatJsonlSource(str(path)).iter_documents(0))


# ------------------------------------------------------------------------------ random chats
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.lists(st.sampled_from(CONTENT_WORDS), max_size=6).map(" ".join),
    }
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(message, min_size=1, max_size=7), loss_on=st.sampled_from(["assistant", "completion"])
)
def test_random_conversations_match_the_hand_built_encoding(tok, messages, loss_on):
    for template in ("chatml", CHATML_TRACKED):
        out = encode(ChatEncoder(tok, loss_on, template), ChatRecord(messages=messages, where="t"))
        ids, mask = by_hand(messages, loss_on)
        assert out.ids.tolist() == ids
        assert out.mask.astype(int).tolist() == mask
