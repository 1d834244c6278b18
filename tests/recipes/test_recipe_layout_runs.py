"""``bytescale-train`` runs tensor parallelism and pipelines from overrides alone (issue 37, items 2 and 8).

One run of the tiny model on 4 CPU ranks, 2 steps, as a user starts it:
``experiment=cpu_smoke strategy.tensor_parallel_size=2 strategy.pipeline_parallel_size=2
trainer.devices=4``, one pipeline of 2 stages, each stage 2 TP lanes.  Both layouts in one run
keep CI's process-starting tests short (``test_recipe_layouts.py`` checks each layout's
placements, FSDP2's too, on a fake process group in one process).  Its sharded checkpoint shows
real TP (the q projection's rows and the attention output's columns split over the two lanes of
a stage, the norms whole) and real stages (each block written only by its own stage's ranks);
torch's schedule ran (the pipeline's measured bubble is logged every step); it validates on a
held-out split through the pipelines' forward-only schedule (``val/loss`` logged) and its
checkpoint exports as one unsplit ``LlamaModel``; and the run prints
none of the lines of issue 37's item 8 (W&B's are checked by ``test_recipe_resume.py`` and
``test_first_run_parts.py``).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from _recipe_helpers import run_train

from lightning_bytescale.lightning.checkpoint import model_state, read_consolidated
from lightning_bytescale.models.llama import LlamaConfig, LlamaModel

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _chunks(folder: Path) -> tuple[dict[str, list[tuple]], dict[str, set[str]]]:
    """A sharded checkpoint's tensors: each one's chunks (offsets, sizes), and the files they are in."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    chunks = {
        key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        for key, md in metadata.state_dict_metadata.items()
        if hasattr(md, "chunks")
    }
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    return chunks, files


#: What item 8 of issue 37 saw in a first run, none of which a run may print now.
NOISE = (
    "Epoch 0/-2",  # Lightning's Rich bar on a run bounded by steps
    "v_num",  # the logger's version in the bar
    "perf/tokens_pe",  # a metric name cut at the terminal's width
    "persistent_workers=True",  # Lightning's hint about the loader's workers
    "val_dataloader",  # Lightning's warning about a validation loader without validation_step
)


def _split_in_two(chunks: list[tuple], dim: int) -> bool:
    """Whether a 2-D tensor's chunks are its two halves along ``dim`` (one per TP lane)."""
    (first_at, first), (second_at, second) = chunks
    whole = [first[0], first[1]]
    whole[dim] *= 2
    half = list(whole)
    half[dim] //= 2
    offset = [0, 0]
    offset[dim] = half[dim]
    return [first_at, first, second_at, second] == [(0, 0), tuple(half), tuple(offset), tuple(half)]


def test_tensor_parallel_pipeline_stages_from_overrides_and_no_noise(tmp_path):
    run = tmp_path / "run"
    proc = run_train(
        ["experiment=cpu_smoke", "strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=2",
         "trainer.devices=4", "data.num_workers=1", "trainer.max_steps=2", "logger=csv",
         "trainer.enable_checkpointing=true", "data.val_fraction=0.05", "trainer.limit_val_batches=1",
         f"hydra.run.dir={run}"],
        tmp_path, timeout=540,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "cpu_smoke: 2 steps" in proc.stdout, out[-3000:]
    chunks, files = _chunks(run / "checkpoints" / "last.ckpt")
    # global ranks 0-1 are stage 0 (the embedding, block 0), ranks 2-3 stage 1 (block 1, norm, head)
    stage_0, stage_1 = {"__0_0.distcp", "__1_0.distcp"}, {"__2_0.distcp", "__3_0.distcp"}
    # TP: ColwiseParallel splits the q projection's rows over a stage's 2 lanes, RowwiseParallel the
    # attention output's columns; a norm stays whole
    assert _split_in_two(chunks["state_dict.model.blocks.0.attn.wq.weight"], 0), chunks
    assert _split_in_two(chunks["state_dict.model.blocks.1.attn.wo.weight"], 1), chunks
    assert len(chunks["state_dict.model.blocks.0.attn_norm.weight"]) == 1
    assert len(chunks["state_dict.model.embed.weight"]) == 2  # the vocabulary over the lanes
    # pipelines: each block from its own stage's ranks only
    assert files["state_dict.model.blocks.0.attn.wq.weight"] == stage_0
    assert files["state_dict.model.embed.weight"] <= stage_0
    assert files["state_dict.model.blocks.1.attn.wo.weight"] == stage_1
    assert files["state_dict.model.lm_head.weight"] <= stage_1
    rows = list(csv.DictReader((run / "csv" / "version_0" / "metrics.csv").read_text().splitlines()))
    assert len([r for r in rows if r.get("pipeline/bubble/0")]) == 2, rows[:3]  # the schedule, every step
    # validation through each pipeline's forward-only schedule (issue 37, item 5): val/loss logged
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) == 1 and 0 < val[0] < 20, rows
    # the TP x PP checkpoint exports as the unsplit model: every stage's tensors, every shard whole
    folder = run / "checkpoints" / "last.ckpt"
    exported = model_state(folder, prefix="model.")
    config = read_consolidated(folder, optimizer_states=False)["hyper_parameters"]["model_config"]
    model = LlamaModel(LlamaConfig(**config))
    model.load_state_dict(exported)  # strict: the whole model's names and shapes, nothing else
    assert exported["blocks.0.attn.wq.weight"].shape == model.blocks[0].attn.wq.weight.shape
    # what such a run prints (item 8)
    for line in NOISE:
        assert line not in out, f"{line!r} in the output:\n{out[-4000:]}"
    assert out.count("(content ") == 1, out[-4000:]  # the token store's line once, not once per rank (4)
    assert "loss: " in proc.stdout and "tokens/s: " in proc.stdout  # the bar's short names
    assert "(to step 2)" in proc.stdout and "2/2" in proc.stdout
