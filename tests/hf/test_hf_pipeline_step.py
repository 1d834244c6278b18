"""Hugging Face decoders split into pipeline stages (``HFDecoderStage``) on gloo, float64, against one process.

The torch-floor step (``run_pipeline_step``: torch's ``PipelineStage`` with ``Schedule1F1B`` or
``ScheduleGPipe``) trains a tiny 3-layer HF decoder split into two stages (two layers and one),
attention through ``attn_implementation="bytescale"``.  The reference is the same HF model,
unsplit, in one process with ``"sdpa"`` on each whole sequence and the same initial weights;
every rank compares its stage's gradients (before the AdamW step) and parameters (after it) by
name with the reference's, and the step's loss, to 1e-10 (the loss to 1e-12).

* ``(pipeline=2, data_parallel=2)``, Qwen3: balance-planner PP-Balance plans with two sequences
  longer than C (ring items over both pipelines, at every stage), a hand plan with three
  micro-batches on one pipeline and one on the other (``ScheduleGPipe``), then the same steps with
  every pipeline padded to four micro-batches (padding micro-batches among the rings).
* ``(2, 1)``: Llama and Qwen2, the same without rings (a step of one micro-batch included).

The refusals and the split itself run in one process.
"""

from __future__ import annotations

import _parallel as helpers
import pytest
import torch
import torch.nn.functional as F
from _ranks import gather_reports, init_gloo, save_report

pytest.importorskip("transformers")

from test_hf_families import tiny_config  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_bytescale.hf.pipeline import HFDecoderStage  # noqa: E402
from lightning_bytescale.parallel import PipelineModelError  # noqa: E402
from lightning_bytescale.planner.plan import Plan  # noqa: E402

CAPACITY = 24
LR = 1e-2
TOLERANCE = 1e-10
STAGES = 2
LAYERS = 3
STEPS = 3
PAD_TO = 4
RING_STEPS = (0, 2)
HAND_STEP = 1


def _build(family: str, attn: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config = tiny_config(family)
    config.num_hidden_layers = LAYERS
    for key, value in {"tie_word_embeddings": False, **overrides}.items():
        setattr(config, key, value)
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float64)


def _models(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = _build(family, "bytescale")
    ref = _build(family, "sdpa")
    ref.load_state_dict(model.state_dict())
    return ref, model


def _reference_step(ref: torch.nn.Module, opt: torch.optim.Optimizer, seqs: list[torch.Tensor]):
    opt.zero_grad(set_to_none=True)
    n = sum(len(s) - 1 for s in seqs)
    total = 0.0
    for s in seqs:
        logits = ref(input_ids=s[None], position_ids=torch.arange(len(s))[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits[:-1], s[1:], reduction="sum") / n
        loss.backward()
        total += loss.item()
    grads = {name: p.grad.detach().clone() for name, p in ref.named_parameters()}
    opt.step()
    return total, grads


def _batch(step: int, pipelines: int) -> list[torch.Tensor]:
    if pipelines == 1 and step == HAND_STEP:  # two short sequences: one micro-batch
        return helpers.global_batch(step, (2, 10), 2)
    if pipelines == 2 and step in RING_STEPS:  # two sequences longer than C: rings across the pipelines
        return helpers.global_batch(step, (2, 20), 6, long=(31 + step, 45))
    return helpers.global_batch(step, (2, CAPACITY), 4 * pipelines + 2)


def _plan(step: int, seqs: list[torch.Tensor], pipelines: int) -> Plan:
    from lightning_bytescale.planner import make_plan

    lengths = [len(s) for s in seqs]
    if pipelines == 2 and step == HAND_STEP:  # several micro-batches on pipeline 0, one on pipeline 1
        split = len(lengths) - 1
        ranks = [helpers.greedy_micro_batches(part, lengths, CAPACITY) for part in (range(split), [split])]
        plan = Plan(2, CAPACITY, "hand", tuple(lengths), ranks, {"pipeline_degree": STAGES})
        plan.validate()
        return plan
    return make_plan(
        lengths, world_size=pipelines, capacity=CAPACITY, planner="balance", pipeline_degree=STAGES, seed=step
    )


def _train(pmesh, family: str, *, min_micro_batches: int) -> dict:
    ref, model = _models(family)
    stage = HFDecoderStage(model, pmesh.stage, pmesh.dims.pipeline)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR)
    pipelines = pmesh.dims.data_parallel
    out: dict = {
        k: [] for k in ("grad_diff", "param_diff", "loss_diff", "counts", "schedules", "rings", "padding")
    }
    for s in range(STEPS):
        seqs = _batch(s, pipelines)
        loss_ref, grads_ref = _reference_step(ref, opt_ref, seqs)
        batch = helpers.pipeline_batch(_plan(s, seqs, pipelines), pmesh, seqs, s, min_micro_batches)
        helpers.pipeline_step_against(stage, opt, batch, pmesh, ref, grads_ref, loss_ref, out)
    out["params"] = sorted(n for n, _ in stage.named_parameters())
    return out


def _worker(rank: int, port: int, outdir: str, world: int, families: list[str]) -> None:
    from lightning_bytescale.parallel import ParallelDims

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    pmesh = ParallelDims(world, pipeline=STAGES).build("cpu")
    report: dict = {"coords": [pmesh.stage, pmesh.hdp_rank]}
    for family in families:
        report[family] = _train(pmesh, family, min_micro_batches=0)
        report[f"{family}_padded"] = _train(pmesh, family, min_micro_batches=PAD_TO)
    save_report(outdir, rank, report)
    import torch.distributed as dist

    dist.destroy_process_group()


def _check_exact(train: dict) -> None:
    assert len(train["param_diff"]) == STEPS
    assert max(train["grad_diff"]) <= TOLERANCE, train["grad_diff"]
    assert max(train["param_diff"]) <= TOLERANCE, train["param_diff"]
    assert max(train["loss_diff"]) <= 1e-12, train["loss_diff"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hf_qwen3_2x2_with_rings_and_different_counts_per_pipeline_equals_one_process(tmp_path):
    reports = gather_reports(tmp_path, _worker, 4, 4, ["qwen3"], timeout_s=280)
    for rep in reports:
        train, padded = rep["qwen3"], rep["qwen3_padded"]
        print("qwen3 (2, 2)", rep["coords"], max(train["grad_diff"]), max(train["param_diff"]),
              max(train["loss_diff"]), max(padded["param_diff"]))  # fmt: skip
        _check_exact(train)
        _check_exact(padded)
        assert [r > 0 for r in train["rings"]] == [s in RING_STEPS for s in range(STEPS)], train["rings"]
        assert train["counts"][HAND_STEP][1] == 1 < train["counts"][HAND_STEP][0], train["counts"]
        assert all(min(c) >= PAD_TO for c in padded["counts"]) and sum(padded["padding"]) > 0, padded
        assert padded["rings"][0] > 0
    assert reports[1]["qwen3"]["schedules"][HAND_STEP] == "ScheduleGPipe"
    first, last = reports[0]["qwen3"]["params"], reports[2]["qwen3"]["params"]
    assert not set(first) & set(last)
    assert "model.embed_tokens.weight" in first and any(n.startswith("model.layers.1.") for n in first)
    assert "lm_head.weight" in last and "model.norm.weight" in last
    assert any(n.startswith("model.layers.2.self_attn.q_norm") for n in last)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_hf_llama_and_qwen2_2x1_equal_one_process(tmp_path):
    reports = gather_reports(tmp_path, _worker, 2, 2, ["llama", "qwen2"], timeout_s=280)
    for rep in reports:
        for family in ("llama", "qwen2"):
            print(
                family, "(2, 1)", rep["coords"], max(rep[family]["grad_diff"]), max(rep[family]["param_diff"])
            )
            _check_exact(rep[family])
            _check_exact(rep[f"{family}_padded"])
        assert rep["llama"]["schedules"][HAND_STEP] == "ScheduleGPipe", rep["llama"]["counts"]


# ---------------------------------------------------------------- one process


def test_one_stage_on_a_padded_micro_batch_equals_the_unsplit_model():
    """The whole model as one stage, on a micro-batch padded to C: its real logits are the model's on each sequence."""
    from lightning_bytescale.engine.micro_batch import build_step
    from lightning_bytescale.parallel.pipeline_batch import pad_micro_batch
    from lightning_bytescale.planner import make_plan

    ref, model = _models("qwen2")
    stage = HFDecoderStage(model, 0, 1)
    seqs = helpers.global_batch(0, (3, 8), 3)
    lengths = [len(s) for s in seqs]
    plan = make_plan(lengths, world_size=1, capacity=CAPACITY, planner="balance")
    step = build_step(plan, 0, lambda j: seqs[j], step=0)
    (mb,) = step.micro_batches
    padded = pad_micro_batch(mb, CAPACITY, 0)
    stage.bind([padded])
    logits = stage(padded.input_ids[None], slot=torch.tensor([0]))[0]
    assert logits.shape == (CAPACITY, model.config.vocab_size)
    expected = torch.cat(
        [
            ref(input_ids=seqs[j][None], position_ids=torch.arange(len(seqs[j]))[None]).logits[0]
            for j in mb.seq_ids
        ]
    )
    assert (logits[: mb.num_slots] - expected).abs().max().item() <= 1e-12


@pytest.mark.parametrize(
    ("family", "overrides", "match"),
    [
        ("qwen3", {"tie_word_embeddings": True}, "tie_word_embeddings"),
        ("gpt2", {}, "model_type='gpt2'"),
        ("granite", {}, "model_type='granite'"),
    ],
)
def test_what_cannot_be_split_exactly_is_refused_by_name(family, overrides, match):
    model = (
        AutoModelForCausalLM.from_config(
            tiny_config(family), attn_implementation="bytescale", dtype=torch.float64
        )
        if family in ("gpt2", "granite")
        else _build(family, "bytescale", **overrides)
    )
    with pytest.raises(PipelineModelError, match=match):
        HFDecoderStage(model, 0, STAGES)


def test_fewer_layers_than_stages_and_another_attention_are_refused():
    with pytest.raises(
        PipelineModelError, match="fewer than the 4 pipeline stages.*pipeline_parallel_size <= 3"
    ):
        HFDecoderStage(_build("llama", "bytescale"), 0, 4)
    with pytest.raises(PipelineModelError, match='attn_implementation="sdpa"'):
        HFDecoderStage(_build("llama", "sdpa"), 0, STAGES)


def test_hf_causal_lm_holding_a_stage_refuses_forward_and_save_pretrained(tmp_path):
    from lightning_bytescale.errors import ConfigError
    from lightning_bytescale.hf import HFCausalLM

    module = HFCausalLM(tiny_config("llama"), dtype=torch.float64)
    module.model = HFDecoderStage(_build("llama", "bytescale"), 1, STAGES)
    with pytest.raises(ConfigError, match="stage 1 of 2 .*pipeline_parallel_size=1"):
        module.save_pretrained(str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="need the whole model"):
        module(torch.zeros(4, dtype=torch.long), torch.arange(4))
