"""`HFCausalLM` in one process: building, loading, the training step, refusals and the optimizer.

The training step runs on real packed micro-batches (``build_step`` of a one-rank plan) inside
their attention layout, as the strategy runs it, and equals the float64 ``sdpa`` model on each
sequence alone with the global token normalisation, including labels masked to -100.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from test_hf_families import BASE, VOCAB, tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_bytescale.engine.micro_batch import build_step  # noqa: E402
from lightning_bytescale.errors import ConfigError  # noqa: E402
from lightning_bytescale.hf import HFCausalLM, OptimizerOptions  # noqa: E402
from lightning_bytescale.hf.module import structure_digest  # noqa: E402
from lightning_bytescale.packed_attention import attention_context  # noqa: E402
from lightning_bytescale.planner import make_plan  # noqa: E402


def built(family: str = "llama", seed: int = 0, **kwargs) -> HFCausalLM:
    torch.manual_seed(seed)
    module = HFCausalLM(tiny_config(family), dtype=torch.float64, **kwargs)
    module.configure_model()
    return module


def sequences(lengths: list[int], seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (s,), generator=g) for s in lengths]


@pytest.mark.parametrize("mask", [False, True], ids=["all-tokens", "masked"])
def test_training_step_equals_sdpa_per_sequence(mask):
    lengths = [9, 3, 14, 6, 11]
    seqs = sequences(lengths)
    step = build_step(make_plan(lengths, world_size=1, capacity=16), 0, lambda j: seqs[j])
    masked = {
        (j, p) for j, s in enumerate(lengths) for p in range(s) if mask and (p < s // 3 or (p + j) % 4 == 0)
    }
    if mask:  # a loss mask as the data side writes it: labels -100, num_global_tokens counts the rest
        n = sum(1 for j, s in enumerate(lengths) for p in range(s - 1) if (j, p) not in masked)
        for mb in step.micro_batches:
            seq = torch.repeat_interleave(torch.tensor(mb.seq_ids), torch.tensor(mb.layout.slots))
            hit = torch.tensor([(int(j), int(p)) in masked for j, p in zip(seq, mb.position_ids)])
            mb.labels[hit] = -100
            mb.num_global_tokens = n
    module = built()
    ref = AutoModelForCausalLM.from_config(
        tiny_config("llama"), attn_implementation="sdpa", dtype=torch.float64
    )
    ref.load_state_dict(module.model.state_dict())

    total = 0.0
    for mb in step.micro_batches:
        with attention_context(mb.layout):
            loss = module.training_step(mb, 0)
        loss.backward()
        total += loss.item()
    n = step.micro_batches[0].num_global_tokens
    want = 0.0
    for j, seq in enumerate(seqs):
        logits = ref(input_ids=seq[None], position_ids=torch.arange(len(seq))[None], use_cache=False).logits[
            0
        ]
        labels = torch.tensor([-100 if (j, p) in masked else int(seq[p + 1]) for p in range(len(seq) - 1)])
        part = F.cross_entropy(logits[:-1], labels, ignore_index=-100, reduction="sum") / n
        part.backward()
        want += part.item()
    assert abs(total - want) <= 1e-12
    got = dict(module.model.named_parameters())
    for name, p in ref.named_parameters():
        assert (got[name].grad - p.grad).abs().max().item() <= 1e-12, name


def test_labels_are_refused():
    module = built()
    ids, pos = torch.randint(0, VOCAB, (6,)), torch.arange(6)
    with pytest.raises(ConfigError, match="labels= was passed to the Hugging Face model"):
        module(ids, pos, labels=ids[None])
    with pytest.raises(ConfigError, match="global token normalisation"):
        module.model(input_ids=ids[None], labels=ids[None], use_cache=False)
    assert module(ids, pos).shape == (6, VOCAB)


def test_forward_shape_errors_and_no_model_yet():
    with pytest.raises(ConfigError, match="configure_model"):
        HFCausalLM("llama", from_config=True)(torch.zeros(3, dtype=torch.long), torch.arange(3))
    module = built()
    with pytest.raises(ConfigError, match=r"packed input_ids \[T\]"):
        module(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None])


def test_gradient_checkpointing_is_refused():
    module = built()
    enable = getattr(module.model, "activation_checkpointing_enable", None)
    (enable or module.model.gradient_checkpointing_enable)()
    with pytest.raises(ConfigError, match="gradient checkpointing"):
        module(torch.zeros(4, dtype=torch.long), torch.arange(4))


def test_layers_that_skip_the_attention_are_caught():
    module = built()
    module._attention_layers = 3  # as if one of 3 layers mixed tokens without our attention
    with pytest.raises(ConfigError, match="in 2 of its 3 layers"):
        module(torch.zeros(4, dtype=torch.long), torch.arange(4))


def test_config_overrides_are_checked_by_name():
    module = HFCausalLM("llama", from_config=True, config_overrides={"num_hiden_layers": 1})
    with pytest.raises(ConfigError, match="did you mean 'num_hidden_layers'"):
        module.configure_model()
    module = HFCausalLM("llama", from_config=True, config_overrides={**BASE, "num_hidden_layers": 1})
    module.configure_model()
    assert len(module.model.model.layers) == 1 and module._attention_layers == 1
    assert module.load_report.weights == "config"
    module.configure_model()  # idempotent: the model is kept
    assert len(module.model.model.layers) == 1


def test_missing_folder_and_offline_hub_name(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="no such folder"):
        HFCausalLM(str(tmp_path / "nope")).configure_model()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    module = HFCausalLM("some-org/not-cached-model")
    assert module.source.offline and module.source._hub_kwargs()["local_files_only"] is True
    with pytest.raises(ConfigError, match="offline"):
        module.configure_model()


def test_load_a_local_checkpoint_and_save_it_back(tmp_path):
    source = built("qwen2", seed=3)
    folder = tmp_path / "ckpt"
    source.save_pretrained(str(folder))
    loaded = HFCausalLM(str(folder), dtype="float64")
    loaded.configure_model()
    assert loaded.load_report.weights == "checkpoint"
    assert loaded.model.config._attn_implementation == "bytescale"
    assert loaded.model.dtype == torch.float64
    want = source.model.state_dict()
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    # the weights are a copy (bitwise above); the forwards run the same weights through BLAS
    # kernels whose path can depend on memory alignment, so they agree to float64 rounding
    ids, pos = torch.randint(0, VOCAB, (7,)), torch.tensor([0, 1, 2, 0, 1, 2, 3])
    torch.testing.assert_close(loaded(ids, pos), source(ids, pos), rtol=1e-12, atol=1e-14)


def test_empty_build_has_the_loaded_structure(tmp_path):
    """Ranks that receive rank 0's weights build the same tensors (ties included) without reading them."""
    for tied in (True, False):
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        folder = tmp_path / f"tied-{tied}"
        model.save_pretrained(folder)
        loaded = HFCausalLM(str(folder), dtype=torch.float64)
        loaded.configure_model()
        empty = HFCausalLM(str(folder), dtype=torch.float64)
        cfg = empty.source.config()
        empty_model = empty.source.build_empty(cfg, torch.float64)
        assert structure_digest(empty_model) == structure_digest(loaded.model)
        assert (empty_model.lm_head.weight is empty_model.model.embed_tokens.weight) == tied


def test_config_objects_and_dicts_build_from_config():
    config = tiny_config("qwen3")
    module = HFCausalLM(config)
    assert module.source.from_config
    assert module.hparams["name_or_path"]["model_type"] == "qwen3"
    with pytest.raises(ConfigError, match="(?s)do not fit Qwen3Config: .*layer_types"):
        HFCausalLM(
            module.hparams["name_or_path"], config_overrides={"num_hidden_layers": 1}
        ).configure_model()
    one = {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    again = HFCausalLM(module.hparams["name_or_path"], config_overrides=one)
    again.configure_model()
    assert len(again.model.model.layers) == 1
    assert config._attn_implementation != "bytescale"  # the caller's config is not modified


def test_init_options_are_checked():
    with pytest.raises(ConfigError, match="load_on"):
        HFCausalLM("llama", load_on="node")
    with pytest.raises(ConfigError, match="schedule"):
        HFCausalLM("llama", schedule="exp")
    with pytest.raises(ConfigError, match="model_kwargs may not set 'attn_implementation'"):
        HFCausalLM("llama", model_kwargs={"attn_implementation": "sdpa"})
    with pytest.raises(ConfigError, match="name_or_path"):
        HFCausalLM(3)


def test_optimizer_groups_and_schedule():
    module = built(weight_decay=0.1, lr=1e-3, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    opt = module.optim.build(module.named_parameters(), total_steps=6)
    groups = opt["optimizer"].param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(module.parameters()))
    o = module.optim
    # warmup 1/2, 2/2; then a cosine from 1 to 0.1 over steps 2..5
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / 3)) for i in range(4)]
    assert [o.lr_factor(s, 6) for s in range(6)] == pytest.approx(expected, abs=1e-15)
    linear = OptimizerOptions(schedule="linear", warmup_steps=0)
    assert [linear.lr_factor(s, 3) for s in range(3)] == [1.0, 0.5, 0.0]
    assert OptimizerOptions().lr_factor(10, None) == 1.0
    with pytest.raises(ConfigError, match="max_steps"):
        linear.lr_factor(1, None)


def test_load_ignores_the_callers_device_context(tmp_path):
    """configure_model runs inside the strategy's device context; transformers would read it as a
    device_map (which needs accelerate, and meta is refused outright): loading stays on the CPU."""
    source = built("llama", seed=4)
    source.save_pretrained(str(tmp_path / "ckpt"))
    module = HFCausalLM(str(tmp_path / "ckpt"), dtype=torch.float64)
    with torch.device("meta"):
        module.configure_model()
    assert all(p.device.type == "cpu" for p in module.model.parameters())
    assert torch.equal(module.model.lm_head.weight, source.model.lm_head.weight)
