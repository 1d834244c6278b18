"""The package's floors (CONTRIBUTING.md): each layer imports only the layers below it.

* planner and simulator: Python's standard library and NumPy only (the command lines, the data
  loader and the simulator use them without torch);
* attention, engine, data, models, offload, profiler: torch, never Lightning;
* Lightning glue (strategy, data module, recipes, telemetry) on top.

Each check imports the layer in a fresh interpreter and lists what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded[name] = sorted({m.split('.')[0] for m in sys.modules})
print(json.dumps(loaded))
"""
TORCH_LAYERS = ["packed_attention", "engine", "data", "models", "offload"]


def loaded_top_level(*modules: str) -> dict[str, set[str]]:
    """For each module, imported in this order in one fresh interpreter: every top-level name loaded so far."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120, check=True
    )
    return {name: set(found) for name, found in json.loads(out.stdout).items()}


def test_planner_and_simulator_need_only_the_standard_library_and_numpy():
    loaded = loaded_top_level("lightning_bytescale.planner", "lightning_bytescale.sim")[
        "lightning_bytescale.sim"
    ]
    third_party = {
        name
        for name in loaded
        if not name.startswith("_") and name not in sys.stdlib_module_names and name != "lightning_bytescale"
    }
    assert third_party <= {"numpy"}, f"the planner floor imports {sorted(third_party - {'numpy'})}"


def test_torch_layers_do_not_import_lightning():
    loaded = loaded_top_level(*(f"lightning_bytescale.{layer}" for layer in TORCH_LAYERS))
    for name, found in loaded.items():
        assert "torch" in found
        assert not found & {"lightning", "pytorch_lightning"}, f"{name} imports Lightning"
