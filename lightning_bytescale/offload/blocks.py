"""Finding a model's transformer blocks, for the offloader and the profiler alike.

Per-layer offload hooks each block to know which layer saved a tensor, and the profiler times
one block alone; both need the same list, the blocks in forward order.  A model may say which
they are (``offload_layers()``); otherwise the first non-empty ``blocks``, ``layers`` or ``h``
(GPT-2's name) module list found walking the module tree is taken, so a LightningModule
wrapping a model, a Hugging Face ``*ForCausalLM`` (``model.layers``) and the reference Llama
(``layers``) are all found without help.
"""

from __future__ import annotations

from torch import nn

BLOCK_LIST_NAMES = ("blocks", "layers", "h")


def find_blocks(module: nn.Module | None) -> list[nn.Module] | None:
    """The transformer blocks of ``module`` in forward order, or ``None`` when it names none.

    ``module.offload_layers()`` when the module defines it, else the first non-empty
    ``nn.ModuleList`` / ``nn.Sequential`` attribute named ``blocks``, ``layers`` or ``h`` in
    ``module.modules()`` order (the module itself first, then its children, depth first).
    """
    if module is None:
        return None
    custom = getattr(module, "offload_layers", None)
    if callable(custom):
        return list(custom())
    for sub in module.modules():
        for name in BLOCK_LIST_NAMES:
            found = getattr(sub, name, None)
            if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
                return list(found)
    return None
