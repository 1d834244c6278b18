"""A user's mistake is printed once, by one rank, and its hints lead somewhere (issue 29, items 1-3).

* the vocabulary check finds the model's vocabulary on the README's own module pattern
  (``self.model = LlamaModel(...)``, no ``vocab_size`` attribute);
* an error every rank raises alike is printed once, with one traceback, by the lowest rank that
  raised it; a different error of another rank is still printed;
* the plain-DataLoader error names only what exists.
"""

from __future__ import annotations

import json
import re
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from _lifecycle import finish, started
from test_docs_names import resolves

from lightning_bytescale import ByteScaleDataModule, ByteScaleStrategy
from lightning_bytescale.data import OutOfVocabularyError
from lightning_bytescale.lightning.datamodule import model_vocab_size
from lightning_bytescale.lightning.launcher import EXIT_SAME_ERROR
from lightning_bytescale.models import LlamaConfig, LlamaModel

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


class ReadmeLM(pl.LightningModule):
    """The README's module: the model is an attribute; the LightningModule has no ``vocab_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaModel(LlamaConfig.preset("tiny"))  # vocab 64: smaller than the byte tokenizer's 257


def _corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"document {i} " + "xyz " * (i % 7 + 1)}) + "\n" for i in range(30))
    )
    return path


def test_the_vocabulary_is_found_on_the_readme_module_pattern(tmp_path):
    module = ReadmeLM()
    assert model_vocab_size(module) == 64  # the first nn.Embedding: model.embed
    dm = ByteScaleDataModule(
        source=str(_corpus(tmp_path)), cache_dir=str(tmp_path / "cache"), capacity=64, context_length=64,
        tokens_per_step=256, num_workers=0,
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    with pytest.raises(OutOfVocabularyError, match=r"vocab_size=64: .* the tokenizer has 257 tokens"):
        dm.check_vocabulary(model_vocab_size(module))
    assert model_vocab_size(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def test_the_plain_dataloader_error_names_only_what_exists():
    strategy = ByteScaleStrategy(capacity=64)
    with pytest.raises(TypeError) as err:
        strategy.training_step(torch.zeros(3), 0)
    text = str(err.value)
    names = re.findall(r"\blightning_bytescale(?:\.[A-Za-z_]\w*)+", text)
    assert names, text
    assert all(resolves(n) for n in names), names
    assert "ByteScaleDataModule" in text and "build_step" in text


# ------------------------------------------------------------------ one error, printed once
LAUNCH = textwrap.dedent(
    """
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning_bytescale.lightning.launcher import ByteScaleScriptLauncher

    launcher = ByteScaleScriptLauncher(
        LightningEnvironment(), num_processes=3, num_nodes=1, poll_s=0.1, settle_s=2.0, exit_grace_s=5.0
    )


    def main():
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=60))
        if rank == 2:
            raise ValueError("rank 2's own mistake")
        raise ValueError("the same mistake on ranks 0 and 1")


    launcher.launch(main)
    """
)


def test_an_error_ranks_raise_alike_is_printed_once_and_another_rank_s_own_error_too(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(LAUNCH)
    with started([str(script)], MASTER_ADDR="127.0.0.1") as process:
        run = finish(process, 150)
    out = run.output
    assert run.returncode == 1, out[-4000:]
    assert out.count("ValueError: the same mistake on ranks 0 and 1") == 1, out[-4000:]  # rank 0's
    assert "[rank0]: ValueError: the same mistake" in out, out[-4000:]
    assert out.count("ValueError: rank 2's own mistake") == 1, out[-4000:]  # a different error stays visible
    assert out.count("Traceback") == 2, out[-4000:]  # rank 0's and rank 2's; rank 1's copy is silent
    assert "[ByteScale] rank 1" not in out, out[-4000:]  # nor reported as a failure of its own


class DictStore:
    """The two calls of a c10d store that the launcher uses, on a dict."""

    def __init__(self, **reports: str) -> None:
        self.data = {f"bytescale/failure/{k.removeprefix('r')}": v.encode() for k, v in reports.items()}
        self.checks = 0

    def check(self, keys):
        self.checks += 1
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_the_lowest_rank_with_the_error_prints_it_and_a_rank_without_reports_is_waited_for_briefly():
    import time

    from lightning_bytescale.lightning.launcher import same_error_below

    every = DictStore(r0="X", r1="X", r2="X")
    assert same_error_below(every, 3, "X", wait_s=5.0) == 0 and every.checks == 1  # one look-up
    other = DictStore(r0="Y", r1="X", r2="X")  # rank 0 failed otherwise: rank 1 prints X, not 2 or 3
    assert same_error_below(other, 1, "X", wait_s=5.0) is None
    assert same_error_below(other, 3, "X", wait_s=5.0) == 1
    start = time.monotonic()
    assert same_error_below(DictStore(), 1, "X", wait_s=0.3) is None  # rank 0 raised nothing (yet)
    assert 0.3 <= time.monotonic() - start < 2.0


README_SCRIPT = textwrap.dedent(
    """
    import sys
    import lightning.pytorch as pl
    import torch
    import lightning_bytescale as lb
    from lightning_bytescale.models import LlamaConfig, LlamaModel


    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = LlamaModel(LlamaConfig.preset("tiny"))  # vocab 64 < the byte tokenizer's 257

        def training_step(self, mb, batch_idx):
            return mb.loss(self.model(mb.input_ids, mb.position_ids))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)


    if __name__ == "__main__":
        data = lb.ByteScaleDataModule(source=sys.argv[1], cache_dir=sys.argv[2], tokens_per_step=256,
                                      context_length=64, num_workers=0)
        trainer = pl.Trainer(strategy=lb.ByteScaleStrategy(capacity=64, timeout=60), accelerator="cpu",
                             devices=2, max_steps=2, logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(LM(), datamodule=data)
    """
)


def test_the_readme_module_with_a_small_vocabulary_stops_once_with_the_documented_error(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(README_SCRIPT)
    corpus = _corpus(tmp_path)
    with started([str(script), str(corpus), str(tmp_path / "cache")], MASTER_ADDR="127.0.0.1") as process:
        run = finish(process, 150)
    out = run.output
    assert run.returncode == 1, out[-5000:]
    assert out.count("OutOfVocabularyError: token store") == 1, out[-5000:]
    assert "vocab_size=64: its input embedding has 64 rows; the tokenizer has 257 tokens" in out
    assert out.count("Traceback") == 1, out[-5000:]
    assert "IndexError" not in out, out[-5000:]


def test_the_same_error_exit_code_is_not_a_clean_exit():
    assert EXIT_SAME_ERROR not in (0, 1, 124, 143)


# ------------------------------------------------------------------ strategy="bytescale" without the import
def test_without_the_import_lightning_s_message_is_the_one_the_readme_explains():
    """Lightning 2.6 reads no entry point for strategies (only callbacks, after the strategy is
    chosen): the name exists once ``lightning_bytescale`` is imported, and the README and the FAQ
    quote the message a user gets without the import.  When Lightning reads entry points for
    strategies, this test fails: register one in pyproject.toml then."""
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    import lightning.pytorch.strategies as pl_strategies
    from lightning.pytorch.trainer.connectors import accelerator_connector

    for module in (pl_strategies, accelerator_connector):
        assert "entry_points" not in inspect.getsource(module), module.__name__
    code = (
        "import lightning.pytorch as pl\n"
        "try:\n"
        "    pl.Trainer(strategy='bytescale', accelerator='cpu', devices=1, logger=False)\n"
        "except ValueError as err:\n"
        "    print(str(err).split('.')[0])\n"
        "import lightning_bytescale\n"
        "print(type(pl.Trainer(strategy='bytescale', accelerator='cpu', devices=1, logger=False).strategy).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    said = run.stdout.strip().splitlines()
    assert said == ["You selected an invalid strategy name: `strategy='bytescale'`", "ByteScaleStrategy"], run
    root = Path(__file__).resolve().parents[2]
    for page in ("README.md", "docs/faq.md"):
        text = " ".join((root / page).read_text().split())
        assert "You selected an invalid strategy name: `strategy='bytescale'`" in text, page
        assert "import lightning_bytescale" in text, page
