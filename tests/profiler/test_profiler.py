"""The profiler on this CPU: fit T(s) and Act(s), print residuals, derive C, round-trip the file."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner.cost_model import CostModel, load_cost_model
from lightning_bytescale.profiler import Profile, ProfileError, load_profile, profile_model, run_profile

LENGTHS = [64, 128, 256, 512]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def profile() -> Profile:
    torch.manual_seed(0)
    cfg = LlamaConfig.preset("small", layers=2)
    return run_profile(
        lambda: LlamaModel(cfg),
        LENGTHS,
        "cpu",
        num_layers=4,
        memory_budget=256 * 2**20,
        repeats=3,
        bandwidth_probe_bytes=16 * 2**20,
        p2p=True,
        p2p_bytes=2**20,
    )


def test_fit_on_this_cpu_prints_residuals(profile, capsys):
    with capsys.disabled():
        print("\nprofiler fit on this CPU (Llama 'small' preset, 2 of 4 layers instantiated, float32)")
        print(profile.summary())
    cm = profile.cost_model
    assert cm.num_layers == 4 and profile.notes["profiled_layers"] == 2
    assert all(t > 0 for t in profile.layer_seconds)
    assert all(0 < f <= t for f, t in zip(profile.layer_forward_seconds, profile.layer_seconds))
    assert 0 < cm.forward_fraction <= 1
    assert cm.layer_time(512) > cm.layer_time(64)
    # Act(s) is exactly linear here (CPU flash kernel saves no s^2 term): the fit is exact
    assert cm.c > 0
    assert max(abs(r) for r in profile.relative_act_residuals) < 1e-6
    # saved bytes double with the length
    assert profile.act_bytes[1] == pytest.approx(2 * profile.act_bytes[0], rel=0.02)
    # the residuals are what the file says they are
    for s, m, r in zip(profile.lengths, profile.layer_seconds, profile.time_residuals):
        assert r == pytest.approx(m - cm.layer_time(s))
    assert profile.offload.bandwidth_d2h > 1e8 and profile.offload.layers_per_rank == 4


def test_the_cost_model_records_the_models_heads_for_ulysses(profile, tmp_path):
    cfg = LlamaConfig.preset("small")
    cm = profile.cost_model
    assert (cm.attention_heads, cm.kv_heads) == (cfg.heads, cfg.kv_heads) == (8, 2)
    assert "heads: 8 query, 2 key/value [" in profile.summary()
    back = load_cost_model(profile.save(tmp_path / "small.json"))  # the file keeps them
    assert (back.attention_heads, back.kv_heads) == (8, 2)


def test_p2p_link_gives_the_cost_model_its_communication_term(profile):
    """The measured gloo link is the ring bandwidth; K/V bytes come from the model shape."""
    cm, link = profile.cost_model, profile.notes["p2p"]
    assert link["nbytes"] == 2**20 and link["backend"] == "gloo"
    assert 1e6 < link["bandwidth"] < 1e12 and 0 < link["latency_s"] < 1.0
    assert cm.bandwidth_intra == cm.bandwidth_inter == link["bandwidth"]
    assert cm.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 4  # K and V x 2 KV heads x 16 x float32
    assert cm.models_comm and "ring links: intra" in profile.summary()
    # the term is live: a ring member pays for moving its peers' K/V
    assert cm.ring_parts([512], 4)[2] == pytest.approx(3 * 3 * 128 * 256 / link["bandwidth"])


def test_activation_bytes_match_the_layer_by_hand(profile):
    """Act(s) per token of one 'small' block (d=128, 8 heads of 16, 2 KV heads, ffn 352), float32.

    Saved for backward, once per tensor object: each RMSNorm keeps x, rsqrt (1 per token) and the
    normalised x: 2 * (2d + 1); q/k/v projections share one input: d; RoPE keeps cos and sin:
    2 * 16; the output projection keeps its input: d; SwiGLU keeps its input, w1 x, w3 x, silu(w1 x)
    and the product: d + 4 * ffn.  Attention's own saved tensors depend on the kernel, so they
    are counted separately with a bare saved_tensors_hooks counter.
    """
    from lightning_bytescale.packed_attention import attention, attention_context
    from lightning_bytescale.packed_attention.layout import AttentionLayout

    d, ffn, s = 128, 352, 96
    layout = AttentionLayout(torch.tensor([0, s]), (s,))
    q = torch.randn(s, 8, 16, requires_grad=True)
    k = torch.randn(s, 2, 16, requires_grad=True)
    v = torch.randn(s, 2, 16, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[id(t)] = t.numel() * t.element_size()
        return t

    with attention_context(layout), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(q, k, v)
    attention_bytes = sum(seen.values())
    by_hand = 4 * (2 * (2 * d + 1) + d + 2 * 16 + d + d + 4 * ffn) * s + attention_bytes
    assert profile.cost_model.act_bytes(s) == pytest.approx(by_hand, rel=1e-9)


def test_capacity_is_the_largest_fitting_length(profile):
    cm = profile.cost_model
    slope, const = _outside_line(profile)
    available = profile.memory_budget_bytes - profile.static_bytes

    def need(s: int) -> float:
        return cm.num_layers * cm.act_bytes(s) + slope * s + const

    c = profile.capacity
    assert c is not None and c >= 2
    assert need(c) <= available < need(c + 1)
    assert (
        profile.static_bytes
        == sum(p.numel() for p in LlamaModel(LlamaConfig.preset("small", layers=2)).parameters()) * 16
    )


def _outside_line(profile: Profile) -> tuple[float, float]:
    import numpy as np

    slope, const = np.polyfit(profile.lengths, profile.outside_act_bytes, 1)
    return max(0.0, slope), max(0.0, const)


def test_file_round_trip_and_loaders(profile, tmp_path):
    path = profile.save(tmp_path / "cm.json")
    again = load_profile(path)
    assert again.cost_model == profile.cost_model
    assert again.offload == profile.offload
    assert again.capacity == profile.capacity
    assert load_cost_model(path) == profile.cost_model
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(profile.cost_model.to_json_dict()))
    assert load_cost_model(plain) == profile.cost_model
    # the planner accepts the profiled cost model as is
    from lightning_bytescale.planner import make_plan

    plan = make_plan([300, 200, 100], world_size=2, capacity=profile.capacity, cost_model=profile.cost_model)
    assert plan.world_size == 2


def test_profile_model_returns_cost_model():
    cfg = LlamaConfig.preset("tiny")
    cm = profile_model(LlamaModel(cfg), [16, 32, 48], "cpu", repeats=1, warmup=0, time_model=False,
                       bandwidth_probe_bytes=2**20)  # fmt: skip
    assert isinstance(cm, CostModel) and cm.num_layers == cfg.layers and cm.c > 0


def test_bad_input_is_reported():
    model = LlamaModel(LlamaConfig.preset("tiny"))
    with pytest.raises(ProfileError, match="at least 3 distinct"):
        run_profile(model, [64, 128], "cpu")
    with pytest.raises(ProfileError, match="pass layers"):
        run_profile(torch.nn.Linear(2, 2), [4, 8, 16], "cpu", vocab=8)
    with pytest.raises(ProfileError, match="memory budget leaves room"):
        run_profile(model, [16, 32, 48], "cpu", memory_budget=1000, repeats=1, warmup=0, time_model=False,
                    bandwidth_probe_bytes=2**20)  # fmt: skip
