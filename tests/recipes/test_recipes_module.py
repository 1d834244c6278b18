"""PretrainModule: the recipe's LightningModule (loss, FLOPs for MFU, LR schedule, errors)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_bytescale.engine.loss import token_loss
from lightning_bytescale.models.llama import LlamaConfig
from lightning_bytescale.recipes.module import PretrainModule, warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    values = [warmup_cosine(s, 4, 12, 0.1) for s in range(14)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert values[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[12] == pytest.approx(0.1) and values[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert warmup_cosine(7, 0, 0, 0.1) == 1.0  # no max_steps: constant after warm-up


def test_train_flops_match_the_model_config():
    module = PretrainModule(preset="tiny", vocab=257)
    cfg = LlamaConfig.preset("tiny", vocab=257)
    lengths = [5, 300, 1024]
    assert module.train_flops(lengths) == pytest.approx(sum(s * cfg.flops_per_token(s) for s in lengths))
    # attention makes a long sequence cost more per token than short ones with the same tokens
    assert module.train_flops([1024]) > module.train_flops([256] * 4)


def test_training_step_is_the_global_token_loss():
    from lightning_bytescale.engine.batch import PackedMicroBatch
    from lightning_bytescale.packed_attention import attention_context
    from lightning_bytescale.packed_attention.layout import AttentionLayout

    torch.manual_seed(0)
    module = PretrainModule(preset="tiny", vocab=257, overrides={"layers": 1})
    module.configure_model()
    ids = torch.randint(0, 257, (12,))
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    layout = AttentionLayout(
        cu_seqlens=torch.tensor([0, 12], dtype=torch.int32), seq_lens=(12,), ring=None, member=0
    )
    mb = PackedMicroBatch(ids, labels, torch.arange(12), layout, (0,), num_global_tokens=40)
    with attention_context(layout):
        loss = module.training_step(mb, 0)
        expected = token_loss(module.model(ids, torch.arange(12)), labels, 40)
    assert torch.equal(loss, expected)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())


def test_bad_options_fail_early():
    with pytest.raises(ValueError, match="unknown Llama preset"):
        PretrainModule(preset="huge")
    with pytest.raises(ValueError, match="lr must be positive"):
        PretrainModule(lr=0)
    with pytest.raises(ValueError, match="betas"):
        PretrainModule(betas=[0.9])
