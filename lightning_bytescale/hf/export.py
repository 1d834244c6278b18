"""A sharded checkpoint of ``HFCausalLM`` as a Hugging Face folder: the unsplit model, in one process.

Under pipelines or tensor parallelism no process holds the whole model, so ``HFCausalLM`` cannot
``save_pretrained`` after training; its sharded checkpoint folder holds every stage's tensors and
every shard under the unsplit model's names (``model.model.layers.0...``).
:func:`export_pretrained` reads them whole
(:func:`~lightning_bytescale.lightning.checkpoint.model_state`), builds the model from the
configuration ``HFCausalLM`` kept in the checkpoint's hyper-parameters (its source and
``config_overrides``), loads the tensors strictly and writes the folder that
``AutoModelForCausalLM.from_pretrained`` reads.  No process group, no accelerator.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lightning_bytescale.errors import CheckpointError
from lightning_bytescale.hf.loading import ModelSource
from lightning_bytescale.lightning.checkpoint import MODEL_KEY, export_command, read_consolidated

PREFIX = "model."  # HFCausalLM's attribute holding the Hugging Face model
SAVED_ATTENTION = "sdpa"  # what the written folder's config names: it loads without this package


def _source(hparams: dict[str, Any], folder: Path) -> ModelSource:
    if "name_or_path" not in hparams:
        raise CheckpointError(
            f"the checkpoint {str(folder)!r} was not saved by an HFCausalLM (its hyper-parameters name no "
            "name_or_path); export another model's state dict with python -m lightning_bytescale.lightning.checkpoint "
            "FOLDER model.pt --model-only PREFIX"
        )
    keys = ("from_config", "config_overrides", "revision", "trust_remote_code", "local_files_only")
    return ModelSource(hparams["name_or_path"], **{k: hparams[k] for k in keys if k in hparams})


def export_pretrained(folder: str | Path, out: str | Path) -> Path:
    """Write the ``HFCausalLM`` of the sharded checkpoint ``folder`` as a Hugging Face folder ``out``.

    The model is built from the checkpoint's configuration (``name_or_path`` read as at training,
    so a local folder or a cached hub name must still be there; ``config_overrides`` applied) in
    the dtype of the saved tensors, with ``attn_implementation="sdpa"`` in the written config, and
    loaded strictly with every saved tensor: a missing stage or a foreign tensor is an error.
    """
    folder = Path(folder)
    checkpoint = read_consolidated(folder, optimizer_states=False)
    state = {k.removeprefix(PREFIX): v for k, v in checkpoint[MODEL_KEY].items() if k.startswith(PREFIX)}
    if not state:
        raise CheckpointError(
            f"the checkpoint {str(folder)!r} holds no tensor of an HFCausalLM ({PREFIX}...)"
        )
    config = _source(checkpoint.get("hyper_parameters") or {}, folder).config()
    dtype = next(iter(state.values())).dtype
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=SAVED_ATTENTION)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint {str(folder)!r} does not hold the whole model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; export the folder a complete save wrote (every stage and shard of one run)"
        )
    out = Path(out)
    model.save_pretrained(out)
    return out


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m lightning_bytescale.hf.export FOLDER OUT``: an HFCausalLM checkpoint as a Hugging Face folder."""
    return export_command(
        argv,
        prog="python -m lightning_bytescale.hf.export",
        description="Write the HFCausalLM of a sharded checkpoint folder (pipelines, tensor parallelism) as a "
        "folder that AutoModelForCausalLM.from_pretrained reads.",
        out_help="the Hugging Face folder to write",
        export=lambda args: export_pretrained(args.folder, args.out),
    )


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["export_pretrained"]
