"""Configs and models the packed causal attention cannot train are refused before any step.

Each unsupported feature is refused with a ``ConfigError`` that names the config field; real
families with those features on by default (Gemma 2, Gemma 3, gpt-oss, Llama 4, Falcon,
Bloom, Mistral with its window) are refused by ``HFCausalLM.configure_model``, before a model
exists or a step runs; turning the feature off through ``config_overrides`` makes them pass.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_hf_families import BASE, tiny_config  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from lightning_bytescale.errors import ConfigError  # noqa: E402
from lightning_bytescale.hf import HFCausalLM, check_config, config_problems  # noqa: E402


def llama(**fields):
    return AutoConfig.for_model("llama", **{**BASE, **fields})


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (AutoConfig.for_model("mistral", **BASE), "sliding_window=4096"),
        (
            AutoConfig.for_model(
                "qwen2", **BASE, use_sliding_window=True, sliding_window=16, max_window_layers=1
            ),
            "layer_types has ['sliding_attention']",
        ),
        (llama(attention_chunk_size=64), "attention_chunk_size=64"),
        (llama(attn_logit_softcapping=30.0), "attn_logit_softcapping=30.0"),
        (llama(is_causal=False), "is_causal=False"),
        (llama(attention_dropout=0.1), "attention_dropout=0.1"),
        (llama(alibi=True), "ALiBi"),
        (llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type='dynamic'"),
        (
            AutoConfig.for_model(
                "phi3",
                **BASE,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 4,
                    "long_factor": [2.0] * 4,
                    "original_max_position_embeddings": 64,
                },
                max_position_embeddings=256,
            ),
            "rope_type='longrope'",
        ),
        (AutoConfig.for_model("falcon"), "does not route its attention through transformers.AttentionInterface"),
    ],
    ids=["window", "layer-types", "chunked", "softcap", "bidirectional", "dropout", "alibi", "dynamic-rope",
         "longrope", "no-interface"],
)  # fmt: skip
def test_each_unsupported_field_is_named(config, field):
    problems = config_problems(config)
    assert any(field in p for p in problems), problems
    with pytest.raises(ConfigError, match='cannot train with attn_implementation="bytescale"'):
        check_config(config)


def test_dropout_only_matters_in_training():
    assert config_problems(llama(attention_dropout=0.1), training=False) == []


def test_supported_families_pass():
    for family in ("llama", "qwen2", "qwen3", "mistral", "granite", "phi"):
        assert config_problems(tiny_config(family)) == [], family
    # a Qwen2 "sliding" layer without a window attends fully (what transformers then runs)
    qwen = AutoConfig.for_model("qwen2", **BASE, layer_types=["full_attention", "sliding_attention"])
    assert qwen.sliding_window is None and config_problems(qwen) == []


SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "overrides", "field"),
    [
        ("gemma2", {}, "attn_logit_softcapping"),
        ("gemma3_text", {}, "layer_types"),
        ("gpt_oss", {"sliding_window": None}, "attention sinks"),
        ("llama4_text", {}, "attention_chunk_size"),
        ("mistral", {}, "sliding_window=4096"),
        ("bloom", {}, "ALiBi"),
    ],
)
def test_families_with_unsupported_defaults_fail_at_configure_model(family, overrides, field):
    small = {k: v for k, v in SMALL.items() if k in AutoConfig.for_model(family).to_dict()}
    module = HFCausalLM(family, from_config=True, config_overrides={**small, **overrides})
    with pytest.raises(ConfigError, match=field):
        module.configure_model()
    assert module.model is None or field == "attention sinks"  # sinks are a parameter: seen once built


def test_turning_features_off_makes_them_pass():
    small = {**SMALL, "layer_types": ["full_attention"] * 2}
    module = HFCausalLM("gemma3_text", from_config=True, config_overrides=small)
    module.configure_model()
    assert module.model is not None
    mistral = HFCausalLM("mistral", from_config=True, config_overrides={**BASE, "sliding_window": None})
    mistral.configure_model()
    assert mistral.model.config.sliding_window is None


def test_use_sliding_window_override_recomputes_the_window():
    """Overrides go in before the config derives its fields: Qwen's window follows use_sliding_window."""
    on = dict(BASE, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    module = HFCausalLM("qwen2", from_config=True, config_overrides=on)
    with pytest.raises(ConfigError, match="layer_types"):
        module.configure_model()
    off = HFCausalLM("qwen2", from_config=True, config_overrides={**on, "use_sliding_window": False})
    off.configure_model()
    assert off.model.config.sliding_window is None
