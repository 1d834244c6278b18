"""``parallel.materialize`` in one process (no process group): the values, the refusals.

The sharded, multi-rank paths run under the Trainer: ``tests/lightning/test_tensor_parallel_strategy.py``
(a meta-device ``LlamaModel`` with ``parallelize_llama``) and ``tests/hf/test_hf_tensor_parallel_strategy.py``
(``HFCausalLM(tensor_parallel=True)``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.parallel.materialize import (
    fill_from_whole,
    materialize_sharded,
    named_tensors,
    to_empty_keeping_ties,
)


def test_a_meta_device_model_gets_what_its_constructor_draws():
    cfg = LlamaConfig.preset("tiny", tie_embeddings=False)
    torch.manual_seed(5)
    eager = LlamaModel(cfg)
    with torch.device("meta"):
        lazy = LlamaModel(cfg)
    torch.manual_seed(5)
    assert materialize_sharded(lazy, torch.device("cpu")) == []
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert materialize_sharded(lazy, torch.device("cpu")) == []  # nothing on the meta device: unchanged
    assert torch.equal(lazy.embed.weight, eager.embed.weight)


def test_modules_without_reset_parameters_are_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    assert materialize_sharded(model, torch.device("cpu")) == ["Scale"]
    assert not any(t.is_meta for _, t in named_tensors(model))


def test_fill_from_whole_copies_every_tensor_once_with_ties_and_buffers():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight
            self.register_buffer("scale", torch.zeros(4), persistent=False)

    source = Tied()
    source.scale.fill_(2.0)
    with torch.device("meta"):
        target = Tied()
    to_empty_keeping_ties(target, "cpu")  # module.to_empty would give b a weight of its own
    whole = dict(named_tensors(source))
    assert sorted(whole) == ["a.weight", "scale"]  # the tied weight once, the non-persistent buffer too
    fill_from_whole(target, whole, src=None)
    assert torch.equal(target.a.weight, source.a.weight) and target.b.weight is target.a.weight
    assert torch.equal(target.scale, source.scale)


def test_a_tied_weight_stays_tied_and_keeps_its_first_modules_draws():
    class TiedHead(nn.Module):  # ties after drawing both, as a tied language model's constructor does
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight
            self.after = nn.Linear(4, 4)

    torch.manual_seed(2)
    eager = TiedHead()
    with torch.device("meta"):
        lazy = TiedHead()
    torch.manual_seed(2)
    materialize_sharded(lazy, torch.device("cpu"))
    assert lazy.head.weight is lazy.embed.weight
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # the head's draws advanced the generator but were not kept
    with torch.device("meta"):
        broken = TiedHead()
    broken.to_empty(device="cpu")
    assert broken.head.weight is not broken.embed.weight  # what to_empty_keeping_ties prevents


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda w: w.pop("0.bias"),
            r"'0.bias' is \(3,\) torch.float32 in the sharded model but the whole weights have nothing",
        ),
        (
            lambda w: w.update({"0.weight": w["0.weight"].double()}),
            r"'0.weight' .* have \(3, 3\) torch.float64",
        ),
        (lambda w: w.update({"0.weight": w["0.weight"][:2]}), r"'0.weight' .* have \(2, 3\)"),
    ],
)
def test_fill_from_whole_refuses_weights_that_do_not_fit(change, match):
    source, target = nn.Sequential(nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3))
    whole = {k: v.detach().clone() for k, v in named_tensors(source)}
    change(whole)
    with pytest.raises(ConfigError, match=match):
        fill_from_whole(target, whole, src=None)
