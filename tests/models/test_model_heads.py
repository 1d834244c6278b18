"""A model's attention heads, read from its config: the reference Llama's and Hugging Face's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.models.heads import config_heads, lane_heads, model_heads


def test_heads_of_the_reference_llama_and_of_hugging_face_configs():
    transformers = pytest.importorskip("transformers")
    assert config_heads(LlamaConfig.preset("small")) == (8, 2)
    assert config_heads(
        transformers.LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    ) == (12, 4)
    assert config_heads(transformers.GPT2Config(n_embd=96, n_head=6)) == (
        6,
        6,
    )  # no key/value heads named: MHA
    qwen = transformers.Qwen2Config(hidden_size=112, num_attention_heads=14, num_key_value_heads=2)
    assert config_heads(qwen) == (14, 2)
    for nameless in (None, SimpleNamespace(), SimpleNamespace(heads=0), SimpleNamespace(heads=True)):
        assert config_heads(nameless) is None


def test_heads_of_a_lightning_style_module_holding_the_model():
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = {"lr": 1e-3}  # a module's own settings, not a model config
            self.model = LlamaModel(LlamaConfig.preset("tiny", kv_heads=4))

    assert model_heads(Module()) == (4, 4)
    assert model_heads(nn.Linear(2, 2)) is None
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    holder = nn.Module()
    holder.model = transformers.LlamaForCausalLM(config)  # as HFCausalLM holds it after configure_model
    assert model_heads(holder) == (4, 2)


def test_the_heads_of_one_tensor_parallel_lane():
    assert lane_heads(32, 8, 1) == (32, 8)
    assert lane_heads(32, 8, 4) == (8, 2)
    assert lane_heads(32, 2, 4) == (8, 1)  # a key/value head tensor parallelism replicates
