"""``cost_model="auto"`` in one process: measured once, cached, rebuilt when the model changes.

The cache is a folder of each test's own; the model is the reference Llama's ``tiny`` preset
(a measurement takes a fraction of a second on one core).
"""

from __future__ import annotations

import json

import pytest
import torch
from filelock import FileLock

from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.profiler import auto as auto_module
from lightning_bytescale.profiler.auto import auto_cost_model, auto_lengths, autocast_dtype
from lightning_bytescale.profiler.errors import ProfileError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny(**overrides) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig.preset("tiny", **overrides))


@pytest.fixture
def measured(monkeypatch):
    """Counts the layer measurements (``_measure_lengths`` calls that measure something)."""
    calls: list[list[int]] = []
    real = auto_module._measure_lengths

    def counting(setup, lengths):
        if lengths:
            calls.append(list(lengths))
        return real(setup, lengths)

    monkeypatch.setattr(auto_module, "_measure_lengths", counting)
    return calls


def test_the_second_start_measures_nothing_and_gets_the_same_model(tmp_path, measured):
    model = _tiny()
    first = auto_cost_model(model, capacity=256, cache_dir=tmp_path)
    assert measured == [[32, 64, 128, 256]] and not first.from_cache
    assert first.cache_path is not None and first.cache_path.parent == tmp_path and first.cache_path.is_file()
    second = auto_cost_model(model, capacity=256, cache_dir=tmp_path)
    assert len(measured) == 1 and second.from_cache
    assert second.cost_model == first.cost_model and second.capacity == 256
    assert "read back, nothing measured" in second.line and str(second.cache_path) in second.line
    assert "measured at lengths 32,64,128,256" in first.line and str(first.cache_path) in first.line
    cm = first.cost_model
    # the refit clamps its coefficients to be non-negative, so time never falls with length; on a
    # loaded machine the tiny model's times may be all noise, so strict growth is not promised
    assert cm.num_layers == 2 and cm.layer_time(256) >= cm.layer_time(32) > 0
    assert (cm.attention_heads, cm.kv_heads) == (4, 2)
    assert cm.kv_bytes_per_token_per_layer == 2 * 2 * 8 * 4  # 2 x kv_heads x head_dim x float32
    assert first.offload.layers_per_rank == 2 and first.offload.bandwidth_d2h > 0


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda: _tiny(ffn_dim=96), id="structure"),
        pytest.param(lambda: _tiny().to(torch.float64), id="dtype"),
        pytest.param(lambda: _tiny(layers=3), id="layers"),
    ],
)
def test_the_cache_is_rebuilt_when_the_model_changes(tmp_path, measured, change):
    auto_cost_model(_tiny(), capacity=256, cache_dir=tmp_path)
    other = auto_cost_model(change(), capacity=256, cache_dir=tmp_path)
    assert len(measured) == 2 and not other.from_cache
    assert len(list(tmp_path.glob("auto-*.json"))) == 2


def test_precision_capacity_and_kernel_are_in_the_key(tmp_path, measured):
    model = _tiny()
    auto_cost_model(model, capacity=256, cache_dir=tmp_path)
    mixed = auto_cost_model(model, capacity=256, precision="bf16-mixed", cache_dir=tmp_path)
    auto_cost_model(model, capacity=512, cache_dir=tmp_path)
    assert len(measured) == 3
    assert mixed.cost_model.kv_bytes_per_token_per_layer == 2 * 2 * 8 * 2  # bf16 K/V on the ring
    key = json.loads(mixed.cache_path.read_text())["key"]
    assert key["precision"] == "bf16-mixed" and key["attention_kernel"].startswith("local=sdpa, ring=cpu")
    assert key["torch"] == torch.__version__ and "threads" in key["device"]
    with pytest.raises(ProfileError, match="cannot measure in precision 'transformer-engine'"):
        autocast_dtype("transformer-engine")


def test_a_damaged_cache_file_is_reported_and_measured_over(tmp_path, measured):
    model = _tiny()
    first = auto_cost_model(model, capacity=256, cache_dir=tmp_path)
    first.cache_path.write_text('{"format": "bytescale-auto-cost/1", "key": ')  # cut short
    with pytest.warns(UserWarning, match=r"cache file .* cannot be used .*measuring again and rewriting it"):
        again = auto_cost_model(model, capacity=256, cache_dir=tmp_path)
    assert not again.from_cache and len(measured) == 2
    assert auto_cost_model(model, capacity=256, cache_dir=tmp_path).from_cache  # rewritten whole
    assert list(tmp_path.glob("*.tmp")) == []


def test_a_start_that_cannot_get_the_lock_measures_and_writes_nothing(tmp_path, measured):
    """Another start on this machine holds the file's lock (measuring the same model): this one
    waits ``lock_timeout_s``, then measures for itself and leaves the file to the other."""
    model = _tiny()
    path = auto_cost_model(model, capacity=256, cache_dir=tmp_path).cache_path
    path.unlink()
    held = FileLock(str(path) + ".lock")
    with held:
        got = auto_cost_model(model, capacity=256, cache_dir=tmp_path, lock_timeout_s=0.2)
    assert not got.from_cache and not path.exists() and len(measured) == 2


def test_the_measurement_leaves_the_model_and_the_random_state_as_they_were(tmp_path):
    model = _tiny()
    model.eval()
    grad = torch.full_like(model.blocks[0].attn.wq.weight, 0.5)
    model.blocks[0].attn.wq.weight.grad = grad
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    auto_cost_model(model, capacity=256, cache_dir=tmp_path)
    assert torch.equal(torch.rand(3), expected)
    assert not model.training and not any(m.training for m in model.modules())
    assert model.blocks[0].attn.wq.weight.grad is grad
    assert all(p.grad is None for n, p in model.named_parameters() if n != "blocks.0.attn.wq.weight")


def test_capacity_from_a_memory_budget_and_the_configured_links(tmp_path):
    model = _tiny()
    got = auto_cost_model(
        model, memory_budget=64 * 2**20, round_to=64, bandwidth_intra=1e10, bandwidth_inter=2e9,
        ranks_per_node=4, cache_dir=tmp_path,
    )  # fmt: skip
    assert got.capacity is not None and got.capacity % 64 == 0 and got.capacity >= 1024
    assert got.lengths == auto_lengths(got.capacity)
    cm = got.cost_model
    assert (cm.bandwidth_intra, cm.bandwidth_inter, cm.ranks_per_node) == (1e10, 2e9, 4) and cm.models_comm
    again = auto_cost_model(model, memory_budget=64 * 2**20, round_to=64, cache_dir=tmp_path)
    assert again.from_cache and again.capacity == got.capacity and again.cost_model.bandwidth_intra is None
    with pytest.raises(ProfileError, match="give capacity=, or memory_budget="):
        auto_cost_model(model, cache_dir=tmp_path)


def test_auto_lengths_are_around_c():
    assert auto_lengths(8192) == [1024, 2048, 4096, 8192]
    assert auto_lengths(100) == [16, 25, 50, 100]
    with pytest.raises(ProfileError, match="C=32 is below 64"):
        auto_lengths(32)


def test_the_planner_takes_what_auto_returns(tmp_path):
    from lightning_bytescale.planner.config import PlannerConfig

    got = auto_cost_model(_tiny(), capacity=256, cache_dir=tmp_path)
    config = PlannerConfig(cost_model=got.cost_model, capacity=got.capacity)
    assert isinstance(config.cost_model, CostModel) and config.cost_model.name == "auto-LlamaModel-cpu"
