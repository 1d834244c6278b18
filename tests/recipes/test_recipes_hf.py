"""The Hugging Face recipe: ``model=hf``, ``data=chat`` and the preset ``hf_sft_cpu_smoke``.

Configs compose against their schemas (and fail readably); the preset runs as users start it,
``bytescale-train experiment=hf_sft_cpu_smoke`` in a subprocess on 2 CPU processes; and a model
whose vocabulary cannot hold the data's ids stops before the first step, naming both sizes.
"""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest
from _recipe_helpers import run_train

pytest.importorskip("transformers")

from lightning_bytescale.data.synthetic_chat import SAMPLES_DIR  # noqa: E402
from lightning_bytescale.recipes.config import ConfigError, compose_pretrain  # noqa: E402


def _compose(tmp: Path, *overrides: str):
    return compose_pretrain([*overrides, f"run_dir={tmp}"], hydra_config=False)


def test_the_preset_composes_the_hf_model_and_chat_data(tmp_path):
    cfg = _compose(tmp_path, "experiment=hf_sft_cpu_smoke")
    assert cfg.model._target_ == "lightning_bytescale.hf.module.HFCausalLM"
    assert cfg.model.name_or_path == "llama" and cfg.model.from_config
    assert cfg.data.source.path == str(SAMPLES_DIR / "chat.jsonl")
    assert cfg.data.tokenizer == str(SAMPLES_DIR / "tokenizer.json")
    assert cfg.data.loss_on == "assistant" and cfg.data.long_document_policy == "drop"


def test_the_recipe_gives_a_from_config_model_the_tokenizer_vocabulary(tmp_path):
    from lightning_bytescale.cli.train import _model_for_data, _plain

    cfg = _compose(tmp_path, "experiment=hf_sft_cpu_smoke", "data.cache_dir=" + str(tmp_path / "cache"))
    from hydra.utils import instantiate

    dm = instantiate(_plain(cfg.data))
    model_cfg = _model_for_data(_plain(cfg.model), dm)
    assert model_cfg["config_overrides"]["vocab_size"] == dm.vocab_size == 875
    kept = _model_for_data({**_plain(cfg.model), "config_overrides": {"vocab_size": 2000}}, dm)
    assert kept["config_overrides"]["vocab_size"] == 2000  # an explicit vocabulary is the user's
    checkpoint = _model_for_data({**_plain(cfg.model), "from_config": False}, dm)
    assert "vocab_size" not in checkpoint["config_overrides"]  # a checkpoint keeps its own


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["model=hf"], ["model.name_or_path"]),
        (
            ["data=chat", "data.tokenizer=x.json", "data.loss_on=prompt"],
            ["data.loss_on", "assistant, completion, all"],
        ),
        (["model=hf", "model.name_or_path=llama", "model.schedule=step"], ["model.schedule", "cosine"]),
        (["data=chat", "data.long_document_policy=cut"], ["data.long_document_policy", "drop"]),
    ],
)
def test_bad_hf_and_chat_configs_are_readable(tmp_path, overrides, needles):
    from hydra.utils import instantiate

    from lightning_bytescale.cli.train import _plain

    try:
        cfg = _compose(tmp_path, *overrides)
        instantiate(_plain(cfg.model))  # a missing value fails when the config is read
        raise AssertionError(f"{overrides} composed")
    except ConfigError as err:
        message = str(err)
    except Exception as err:  # omegaconf's MissingMandatoryValue
        message = str(err)
    for needle in needles:
        assert needle in message, message


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    return run_train(args, tmp, check=False, HF_HUB_OFFLINE="1")


@pytest.mark.multiprocess
def test_the_preset_fine_tunes_on_two_processes(tmp_path):
    out = tmp_path / "run"
    proc = _run(
        ["experiment=hf_sft_cpu_smoke", "trainer.max_steps=3", "logger=csv", f"run_dir={out}"], tmp_path
    )
    assert proc.returncode == 0, f"STDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-6000:]}"
    assert "[bytescale-train] hf_sft_cpu_smoke: 3 steps" in proc.stdout
    metrics = (out / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    rows = [r for r in csv.DictReader(metrics) if r.get("train/loss")]
    losses = [float(r["train/loss"]) for r in rows]
    assert len(losses) == 3 and 5.5 < losses[0] < 7.5  # about ln(875) = 6.77 at the start
    loss_tokens = [float(r["data/loss_tokens"]) for r in rows if r.get("data/loss_tokens")]
    tokens = [float(r["data/tokens"]) for r in rows if r.get("data/tokens")]
    assert loss_tokens and all(0 < a < b for a, b in zip(loss_tokens, tokens))  # only the answers train
    # issue 37, item 9: the run leaves a folder transformers loads, with the trained weights
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = out / "hf_model"
    assert f"  Hugging Face model: {folder}" in proc.stdout, proc.stdout[-2000:]
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    assert loaded.config.num_hidden_layers == 2 and loaded.config.vocab_size == 875
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = torch.tensor([tokenizer("Hello there")["input_ids"]])
    assert torch.isfinite(loaded(input_ids=ids).logits).all()


@pytest.mark.multiprocess
def test_a_model_too_small_for_the_data_stops_before_the_first_step(tmp_path):
    proc = _run(
        [
            "experiment=hf_sft_cpu_smoke",
            "trainer.max_steps=2",
            "~logger",
            "+model.config_overrides.vocab_size=300",
        ],
        tmp_path,
    )
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert (
        "OutOfVocabularyError" in text and "vocab_size=300" in text and "the tokenizer has 875 tokens" in text
    )
    assert "config_overrides.vocab_size=875" in text
    assert "Epoch 0" not in text  # nothing was trained


def _documented_commands() -> list[list[str]]:
    """The ``bytescale-train`` command lines of the HF docs and the README (continuations joined)."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[2]
    out = []
    for doc in ("README.md", "docs/hf.md", "docs/recipes.md"):
        text = (root / doc).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            m = re.search(r"bytescale-train ((?:model=hf|experiment=hf_)[^#`]*)", line)
            if m:
                out.append(shlex.split(m.group(1)))
    return out


@pytest.mark.parametrize("args", _documented_commands(), ids=lambda a: " ".join(a)[:60])
def test_the_documented_hf_command_lines_compose(tmp_path, args):
    cfg = _compose(tmp_path, *args)
    assert cfg.model._target_.endswith("HFCausalLM") and cfg.data.source.kind == "chat"


@pytest.mark.multiprocess
def test_a_set_up_error_every_rank_raises_is_printed_once(tmp_path):
    """Issue 37, item 7: a model that cannot be split into stages (tied embeddings) fails in
    ``configure_model`` on every rank; the run prints one line, not a traceback and a Hydra line per rank."""
    proc = _run(
        ["experiment=hf_sft_cpu_smoke", "strategy.pipeline_parallel_size=2", "data.context_length=256",
         "hf_export_dir=null", "trainer.max_steps=1", "~logger", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("bytescale-train:")]
    assert len(lines) == 1, out[-4000:]
    assert lines[0].startswith("bytescale-train: PipelineModelError: the model ties its input embedding")
    assert "Traceback" not in out and "Error executing job" not in out, out[-4000:]
    assert "[ByteScale] rank 1" not in out, out[
        -4000:
    ]  # the other rank ends quietly (its error was the same)
