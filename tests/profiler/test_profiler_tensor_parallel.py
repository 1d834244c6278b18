"""The profiler on one HDP rank that is a tensor-parallel group of 2 (gloo, CPU), against hand counts.

``run_profile(tensor_parallel=2)`` starts two processes, shards the Llama ``small`` preset (2 of 4
layers instantiated) with ``parallelize_llama`` and measures.  The expected figures are counted by
hand from the model's shape, never from the profiler:

* a lane saves per token and layer what one device saves, less half of what tensor parallelism
  shards (the attention output projection's input, the SwiGLU's four intermediate tensors, the
  attention's own tensors of this lane's heads); the norms, the projections' shared input and
  the rotary tables stay whole;
* a rank holds the whole model's parameters less half of the sharded ones (q, k, v, o, gate, up
  and down projections, the untied embedding and head), and the capacity ``C`` is the longest
  length whose activations fit the budget after those parameters' static bytes.

A process group of two ranks that already exists is used as it is, and the strategy refuses a
cost model profiled for HDP ranks of another size.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from _ranks import free_port, init_gloo, run_ranks

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.errors import CostModelTensorParallelError
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner.cost_model import CostModel, load_cost_model
from lightning_bytescale.profiler import Profile, ProfileError, load_profile, run_profile

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

LENGTHS = [32, 64, 128]
LAYERS = 4  # the real model; 2 are instantiated
BUDGET = 64 * 2**20
D, HEADS, KV_HEADS, HEAD_DIM, FFN = 128, 8, 2, 16, 352  # the 'small' preset
SHARDED = re.compile(r"(wq|wk|wv|wo|w1|w2|w3|embed|lm_head)\.weight$")


def _model() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig.preset("small", layers=2))


def _profile(tp: int) -> Profile:
    return run_profile(
        _model,
        LENGTHS,
        "cpu",
        num_layers=LAYERS,
        param_count=LlamaConfig.preset("small").num_params(),
        memory_budget=BUDGET,
        warmup=0,
        repeats=1,
        bandwidth_probe_bytes=2**20,
        tensor_parallel=tp,
        timeout_s=120,
        name=f"small-tp{tp}",
    )


@pytest.fixture(scope="module")
def profiles() -> dict[int, Profile]:
    return {1: _profile(1), 2: _profile(2)}


def _attention_bytes(heads: int, kv_heads: int, s: int) -> int:
    """What the attention kernel saves for ``heads`` query and ``kv_heads`` key/value heads, counted bare."""
    from lightning_bytescale.packed_attention import attention, attention_context
    from lightning_bytescale.packed_attention.layout import AttentionLayout

    q = torch.randn(s, heads, HEAD_DIM, requires_grad=True)
    k = torch.randn(s, kv_heads, HEAD_DIM, requires_grad=True)
    v = torch.randn(s, kv_heads, HEAD_DIM, requires_grad=True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[id(t)] = t.numel() * t.element_size()
        return t

    layout = AttentionLayout(torch.tensor([0, s]), (s,))
    with attention_context(layout), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(q, k, v)
    return sum(seen.values())


def _layer_bytes_by_hand(s: int, tp: int) -> int:
    """float32 bytes one lane of ``tp`` saves in one block for ``s`` tokens.

    Whole on every lane: two RMSNorms (x, rsqrt, normalised x: 2d + 1 each), the q/k/v projections'
    shared input (d), the rotary tables (2 x head_dim), the SwiGLU's input (d).  Split over the
    lanes: the output projection's input (d), the SwiGLU's w1 x, w3 x, silu(w1 x) and their product
    (4 x ffn), and the attention's tensors of the lane's heads.
    """
    whole = 2 * (2 * D + 1) + D + 2 * HEAD_DIM + D
    split = (D + 4 * FFN) // tp
    return 4 * (whole + split) * s + _attention_bytes(HEADS // tp, KV_HEADS // tp, s)


def _rank_params_by_hand(tp: int) -> int:
    """The parameters one rank holds of the 4-layer model: the whole model less the sharded part's (tp-1)/tp."""
    full = LlamaModel(LlamaConfig.preset("small"))
    sharded = sum(p.numel() for name, p in full.named_parameters() if SHARDED.search(name))
    total = sum(p.numel() for p in full.parameters())
    return total - sharded + sharded // tp


def test_a_lane_saves_what_one_device_saves_less_its_sharded_share(profiles):
    tp1, tp2 = profiles[1].cost_model, profiles[2].cost_model
    for s in (*LENGTHS, 96):
        assert tp1.act_bytes(s) == pytest.approx(_layer_bytes_by_hand(s, 1), rel=1e-9)
        assert tp2.act_bytes(s) == pytest.approx(_layer_bytes_by_hand(s, 2), rel=1e-9)
        sharded_share = 4 * (D + 4 * FFN) // 2 * s + _attention_bytes(HEADS, KV_HEADS, s) // 2
        assert tp1.act_bytes(s) - tp2.act_bytes(s) == pytest.approx(sharded_share, rel=1e-9)
    measured = profiles[2].act_bytes
    print(f"\nper-lane Act(s) at {LENGTHS}: TP=1 {profiles[1].act_bytes}, TP=2 {measured}")
    assert max(abs(r) for r in profiles[2].relative_act_residuals) < 1e-9


def test_the_group_records_its_size_its_lanes_heads_and_kv_bytes_and_its_times(profiles):
    prof = profiles[2]
    cm = prof.cost_model
    assert cm.tensor_parallel == prof.tensor_parallel == 2 and profiles[1].tensor_parallel == 1
    assert cm.kv_bytes_per_token_per_layer == 2 * (KV_HEADS // 2) * HEAD_DIM * 4  # one lane's K and V heads
    assert profiles[1].cost_model.kv_bytes_per_token_per_layer == 2 * KV_HEADS * HEAD_DIM * 4
    # the heads Ulysses splits: one lane's query and key/value heads
    assert (cm.attention_heads, cm.kv_heads) == (HEADS // 2, KV_HEADS // 2)
    assert (profiles[1].cost_model.attention_heads, profiles[1].cost_model.kv_heads) == (HEADS, KV_HEADS)
    assert all(t > 0 for t in prof.layer_seconds) and all(t > 0 for t in prof.model_seconds)
    assert cm.num_layers == LAYERS and prof.notes["profiled_layers"] == 2
    assert "one tensor-parallel group of 2" in prof.summary() and "per HDP rank" in prof.summary()


def test_capacity_is_the_longest_length_a_lane_holds_within_the_budget(profiles):
    for tp, prof in profiles.items():
        cm = prof.cost_model
        assert prof.static_bytes == _rank_params_by_hand(tp) * 16  # float32 weights and gradients, Adam's 8
        slope, const = np.polyfit(prof.lengths, prof.outside_act_bytes, 1)
        slope, const = max(0.0, slope), max(0.0, const)
        available = BUDGET - prof.static_bytes

        def need(s: int, cm: CostModel = cm, slope: float = slope, const: float = const) -> float:
            return LAYERS * cm.act_bytes(s) + slope * s + const

        assert prof.capacity is not None and need(prof.capacity) <= available < need(prof.capacity + 1)
    assert profiles[2].capacity > profiles[1].capacity  # a lane holds more tokens in the same budget
    print(
        f"C per HDP rank in {BUDGET / 2**20:.0f} MiB: TP=1 {profiles[1].capacity}, TP=2 {profiles[2].capacity}"
    )


def test_the_file_keeps_tensor_parallel_and_the_strategy_checks_it(profiles, tmp_path):
    path = profiles[2].save(tmp_path / "tp2.json")
    assert json.loads(path.read_text())["cost_model"]["tensor_parallel"] == 2
    assert load_profile(path).tensor_parallel == 2 and load_cost_model(path).tensor_parallel == 2
    one = profiles[1].save(tmp_path / "tp1.json")
    assert "tensor_parallel" not in json.loads(one.read_text())["cost_model"]  # files of one device unchanged
    assert (
        ByteScaleStrategy(
            tensor_parallel_size=2, cost_model=str(path)
        ).planner_config.cost_model.tensor_parallel
        == 2
    )
    for size, file in ((1, path), (2, one)):
        with pytest.raises(CostModelTensorParallelError, match=r"bytescale-profile --tensor-parallel"):
            ByteScaleStrategy(tensor_parallel_size=size, cost_model=str(file))
    ByteScaleStrategy(tensor_parallel_size=2)  # the default cost model is not checked


def _in_a_group(rank: int, port: int, out: str) -> None:
    init_gloo(rank, 2, port, timeout_s=120)
    prof = run_profile(
        _model, LENGTHS, "cpu", warmup=0, repeats=1, bandwidth_probe_bytes=2**20, tensor_parallel=2
    )
    errors = []
    for kwargs in ({"tensor_parallel": 4}, {"tensor_parallel": 2, "p2p": True}):
        try:
            run_profile(_model, LENGTHS, "cpu", warmup=0, repeats=1, **kwargs)
        except ProfileError as err:
            errors.append(str(err))
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump({"profile": prof.to_json_dict(), "errors": errors}, fh)


def test_a_process_group_of_n_ranks_that_exists_is_used_as_it_is(tmp_path):
    run_ranks(_in_a_group, 2, free_port(), str(tmp_path), timeout_s=240)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["profile"]["act_bytes"] == got[1]["profile"]["act_bytes"]  # one group, one profile
    assert got[0]["profile"]["layer_seconds"] == got[1]["profile"]["layer_seconds"]
    cm = Profile.from_json_dict(got[0]["profile"]).cost_model
    assert cm.tensor_parallel == 2 and cm.act_bytes(64) == pytest.approx(
        _layer_bytes_by_hand(64, 2), rel=1e-9
    )
    for rank in got:
        assert "the process group that exists has 2 ranks" in rank["errors"][0]
        assert "give bandwidth_intra / bandwidth_inter instead" in rank["errors"][1]


def test_bad_tensor_parallel_is_refused():
    for bad in (0, True, 1.5):
        with pytest.raises(ProfileError, match="tensor_parallel must be a positive integer"):
            run_profile(_model, LENGTHS, "cpu", tensor_parallel=bad)
