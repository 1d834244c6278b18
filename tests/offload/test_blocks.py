"""One block finder for the offloader and the profiler: the same blocks, in forward order, found alike.

The strategy builds its offloader on ``find_blocks(lightning_module)`` and the profiler times
``find_blocks(model)[0]``; these tests pin what it finds on the shapes users bring (the reference
Llama, a LightningModule-style wrapper, GPT-2's ``transformer.h``, a model that names its blocks
with ``offload_layers()``) and that the profiler follows a model's own ``offload_layers()``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.offload import find_blocks
from lightning_bytescale.profiler import run_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Wrapper(nn.Module):
    """A LightningModule's shape: the model one attribute down, under a name of the user's choosing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.net = inner

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.net(ids, pos)


class FirstBlockOnly(Wrapper):
    """Names its own blocks: only the first Llama block counts as a layer."""

    def offload_layers(self) -> list[nn.Module]:
        return [self.net.blocks[0]]


class GPT2Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(8, 4)
        self.transformer.h = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))


def test_the_blocks_of_the_shapes_users_bring():
    llama = LlamaModel(LlamaConfig.preset("tiny"))
    assert find_blocks(llama) == list(llama.blocks)
    assert find_blocks(Wrapper(llama)) == list(llama.blocks)  # found one level down, any attribute name
    gpt2 = GPT2Like()
    assert find_blocks(gpt2) == list(gpt2.transformer.h)
    assert find_blocks(FirstBlockOnly(llama)) == [llama.blocks[0]]  # the model's own word wins


def test_no_blocks_is_none_so_the_offloader_falls_back():
    assert find_blocks(None) is None
    assert find_blocks(nn.Linear(2, 2)) is None
    empty = nn.Module()
    empty.layers = nn.ModuleList()
    assert find_blocks(empty) is None  # an empty list is not a block list


def test_the_profiler_times_the_blocks_the_model_names():
    """``offload_layers()`` is the one contract: the profiler counts and times what the offloader hooks."""
    torch.manual_seed(0)
    llama = LlamaModel(LlamaConfig.preset("tiny"))
    options = dict(vocab=64, repeats=1, warmup=0, time_model=False, bandwidth_probe_bytes=2**20)
    whole = run_profile(Wrapper(llama), [16, 32, 48], "cpu", **options)
    assert whole.notes["profiled_layers"] == len(llama.blocks) == 2
    first = run_profile(FirstBlockOnly(llama), [16, 32, 48], "cpu", **options)
    assert first.notes["profiled_layers"] == 1
    # the second block's saved bytes now count as outside the layers
    assert first.outside_act_bytes[0] == pytest.approx(whole.outside_act_bytes[0] + whole.act_bytes[0])
