"""Hugging Face decoders with tensor parallelism (transformers' own plan) under HDP, against one process.

4 gloo ranks as ``(data_parallel=2, tensor_parallel=2)``, float64: tiny Llama (untied and tied
embeddings) and Qwen3 (per-head ``q_norm`` / ``k_norm``, the plan's ``replicated_with_grad_allreduce``
style) built with ``attn_implementation="bytescale"`` and sharded by
:func:`lightning_bytescale.hf.parallelize_hf`, three AdamW steps with clipping through
:func:`lightning_bytescale.parallel.run_parallel_step` on balance plans with rings and several
micro-batches per rank, equal to the same weights run with ``"sdpa"`` on each sequence alone in one
process (loss, gradients before clipping, parameters).

On one process, on torch's fake process group (``tests/_tp_comm.py``), with 2 lanes: a tiny
Llama's and Qwen3's backward all-reduces twice per block (the attention's input gradient and the
MLP's; Qwen3 adds the sums of its per-head norms' weight gradients) and once for the head, for 1
and 2 layers; the vocabulary-sharded embedding's weight gradient (Llama's, and Gemma's scaled
one) is a ``Shard(0)`` DTensor of the lane's rows, equal in float64 to those rows of one process's gradient (the padding row zero),
and no op of its backward produces more elements than those rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

from _parallel import global_batch, grad_diff, param_diff  # noqa: E402
from _ranks import gather_reports, init_gloo, save_report  # noqa: E402
from _tp_comm import TP as FAKE_TP  # noqa: E402
from _tp_comm import LargestTensor, backward_all_reduces, fake_tp_mesh  # noqa: E402
from test_hf_families import tiny_config  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

WORLD, TP = 4, 2
CAPACITY = 16
STEPS = 3
MAX_NORM = 0.05
CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
}


def _model(family: str, overrides: dict, attn: str):
    """A float64 tiny model of ``family`` from seed 0 (the same weights for every ``attn``)."""
    cfg = tiny_config(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float64)


def _reference_loss(model, seqs) -> torch.Tensor:
    total, count = 0.0, 0
    for seq in seqs:
        logits = model(
            input_ids=seq[None], position_ids=torch.arange(len(seq))[None], use_cache=False
        ).logits[0]
        total = total + F.cross_entropy(logits[:-1], seq[1:], reduction="sum")
        count += len(seq) - 1
    return total / count


def _forward(model, mb):
    from lightning_bytescale.engine import token_loss

    out = model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
    return token_loss(out.logits[0], mb.labels, mb.num_global_tokens)


def _case(pmesh, family: str, overrides: dict) -> dict:
    from lightning_bytescale.engine import build_step
    from lightning_bytescale.hf import parallelize_hf
    from lightning_bytescale.parallel import clip_grad_norm_, run_parallel_step
    from lightning_bytescale.planner import make_plan

    ref = _model(family, overrides, "sdpa")
    model = parallelize_hf(_model(family, overrides, "bytescale"), pmesh.tp_mesh)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"loss": [], "grad": [], "param": [], "norms": [], "per_rank": [], "rings": 0, "tied": tied}
    for s in range(STEPS):
        seqs = global_batch(s, (2, CAPACITY), 6, long=(27,))
        opt_ref.zero_grad(set_to_none=True)
        loss_ref = _reference_loss(ref, seqs)
        loss_ref.backward()
        grads_ref = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        opt_ref.step()
        plan = make_plan([len(x) for x in seqs], world_size=2, capacity=CAPACITY, planner="balance", seed=s)
        step = build_step(
            plan, pmesh.hdp_rank, lambda j, seqs=seqs: seqs[j], step=s, ring_ranks=pmesh.ring_ranks
        )
        opt.zero_grad(set_to_none=True)
        result = run_parallel_step(model, step, pmesh, forward=_forward)
        out["grad"].append(grad_diff(model, grads_ref))
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        out["loss"].append(abs(result.loss - float(loss_ref)))
        out["param"].append(param_diff(model, ref))
        out["per_rank"].append([len(r) for r in plan.ranks])
        out["rings"] += sum(mb.layout.ring is not None for mb in step.micro_batches)
    return out


LOADING_SEED = 7


def _loading(pmesh, checkpoint: str) -> dict:
    """``HFCausalLM(tensor_parallel=True).configure_model`` every documented way: what each rank got, and whether
    the shards gathered are exactly the checkpoint's weights (or, from a config, one process's draws from the seed)."""
    from lightning_bytescale.hf import HFCausalLM
    from lightning_bytescale.parallel.full_state import full_state_dict

    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).state_dict()
    torch.manual_seed(LOADING_SEED)
    drawn = AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float64).state_dict()
    ways = {
        "rank_zero": (HFCausalLM(checkpoint, local_files_only=True, dtype=torch.float64, tensor_parallel=True), saved),
        "every_rank": (
            HFCausalLM(checkpoint, local_files_only=True, dtype=torch.float64, tensor_parallel=True, load_on="every_rank"),
            saved,
        ),
        "from_config": (HFCausalLM(tiny_config("qwen3"), dtype=torch.float64, tensor_parallel=True), drawn),
    }  # fmt: skip
    out = {}
    for way, (module, expected) in ways.items():
        module._device_mesh = pmesh.mesh  # what the strategy sets before configure_model
        torch.manual_seed(LOADING_SEED)
        module.configure_model()
        got = full_state_dict(module)
        out[way] = {
            "weights": module.load_report.weights,
            "exact": got.keys() == {f"model.{k}" for k in expected}
            and all(torch.equal(got[f"model.{k}"], v) for k, v in expected.items()),
            "sharded": sum(isinstance(p, DTensor) for p in module.parameters()),
        }
    return out


def _worker(rank: int, port: int, outdir: str, checkpoint: str) -> None:
    from lightning_bytescale.parallel import ParallelDims

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    pmesh = ParallelDims(WORLD, tensor_parallel=TP).build("cpu")
    report = {name: _case(pmesh, family, overrides) for name, (family, overrides) in CASES.items()}
    report["loading"] = _loading(pmesh, checkpoint)
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("hf_tp_checkpoint")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float64).save_pretrained(checkpoint)
    return gather_reports(tmp_path_factory.mktemp("hf_tp"), _worker, WORLD, str(checkpoint), timeout_s=260)


@pytest.mark.multiprocess
@pytest.mark.timeout(280)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_model_with_its_tp_plan_trains_like_one_process(reports, case):
    for rep in reports:
        got = rep[case]
        assert min(got["norms"]) > MAX_NORM, "clipping must act"
        assert got["rings"] > 0 and max(max(c) for c in got["per_rank"]) >= 2, got["per_rank"]
        assert max(got["grad"]) <= 1e-10, got["grad"]
        assert max(got["param"]) <= 1e-10, got["param"]
        assert max(got["loss"]) <= 1e-12, got["loss"]
        assert got["tied"] == (case == "llama_tied")


@pytest.mark.multiprocess
@pytest.mark.timeout(280)
def test_hfcausallm_with_tp_starts_from_exactly_its_weights_every_documented_way(reports):
    """Rank 0 reads (or draws) the whole weights on its host and the others receive them; with
    ``load_on="every_rank"`` every rank reads its own copy; the shards gathered are the weights."""
    expected = {
        "rank_zero": ["checkpoint", "broadcast", "broadcast", "broadcast"],
        "every_rank": ["checkpoint"] * 4,
        "from_config": ["config", "broadcast", "broadcast", "broadcast"],
    }
    for way, weights in expected.items():
        got = [rep["loading"][way] for rep in reports]
        assert [g["weights"] for g in got] == weights, (way, got)
        assert all(g["exact"] and g["sharded"] > 0 for g in got), (way, got)


def test_plans_with_styles_not_checked_here_and_models_without_a_plan_are_refused():
    from lightning_bytescale.errors import ConfigError
    from lightning_bytescale.hf.tensor_parallel import hf_tp_plan

    model = _model("llama", {}, "bytescale")
    plan = hf_tp_plan(model)
    assert plan["model.layers.1.self_attn.q_proj.weight"] == "colwise"  # the library's plan, expanded
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["lm_head"] == "colwise_gather_output"
    model._tp_plan = {**model.tp_plan, "model.norm": "sequence_parallel"}
    with pytest.raises(
        ConfigError, match=r"uses the styles \['sequence_parallel'\], which this strategy has not"
    ):
        hf_tp_plan(model)
    model._tp_plan = {}
    with pytest.raises(ConfigError, match="has no tensor-parallel plan"):
        hf_tp_plan(model)


def test_heads_the_tp_size_cannot_split_are_refused_before_sharding():
    from types import SimpleNamespace

    from lightning_bytescale.hf import parallelize_hf
    from lightning_bytescale.parallel import TensorParallelHeadsError

    model = _model("qwen3", {}, "bytescale")  # 4 heads, 2 key/value heads
    with pytest.raises(TensorParallelHeadsError, match="Qwen3ForCausalLM has 2 key/value heads"):
        parallelize_hf(model, SimpleNamespace(ndim=1, size=lambda: 4))
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_block_all_reduces_twice_in_backward_and_the_head_once(family):
    from lightning_bytescale.hf import parallelize_hf

    per_head_norms = {"llama": 0, "qwen3": 2}[
        family
    ]  # q_norm, k_norm: their weight gradients summed per backward
    counts = {}
    with fake_tp_mesh() as mesh:
        for layers in (1, 2):
            model = parallelize_hf(_model(family, {"num_hidden_layers": layers}, "sdpa"), mesh)
            ids = global_batch(0, (12, 13), 1)[0][None]
            # the forward outside CommDebugMode: its module tracker loses its place in transformers' layers
            logits = model(input_ids=ids, use_cache=False).logits
            counts[layers] = backward_all_reduces(logits.sum())
    for layers, backward in counts.items():
        assert backward == layers * (2 + per_head_norms) + 1, counts
    assert counts[2] - counts[1] == 2 + per_head_norms


@pytest.mark.parametrize("lane", range(FAKE_TP))
@pytest.mark.parametrize("family", ["llama", "gemma"])  # gemma: a subclass whose forward scales the lookup
def test_the_embedding_gradient_is_this_lanes_rows_of_one_process_gradient(family, lane):
    from lightning_bytescale.hf import parallelize_hf

    ref = _model(family, {}, "sdpa")
    ids = torch.cat([global_batch(1, (20, 21), 1)[0], torch.tensor([0, 0, 5, 5, 63])])  # 0 is the padding id
    embed = ref.get_input_embeddings()
    assert embed.padding_idx == 0
    grad_out = torch.randn(
        len(ids), embed.embedding_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    embed(ids).backward(grad_out)
    rows = embed.num_embeddings // FAKE_TP
    start = lane * rows
    with fake_tp_mesh(lane) as mesh:
        model = parallelize_hf(_model(family, {}, "sdpa"), mesh)
        assert list(model.state_dict()) == list(ref.state_dict())
        weight = model.get_input_embeddings().weight
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
        out = model.get_input_embeddings()(ids)
        with LargestTensor() as largest:
            out.backward(grad_out)
        grad = weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad
        local = grad.to_local()
        assert tuple(local.shape) == (rows, embed.embedding_dim)
        assert (local - embed.weight.grad[start : start + rows]).abs().max().item() <= 1e-12
        assert local.abs().sum() > 0
        assert largest.numel <= rows * embed.embedding_dim, largest.numel
    assert embed.weight.grad[0].abs().max() == 0  # the padding row (on lane 0) gets no gradient
