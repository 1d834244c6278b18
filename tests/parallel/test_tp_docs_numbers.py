"""The memory tables of docs/tensor-parallel.md are the committed results files, row by row.

``benchmarks/results/tp_memory_arithmetic.json`` (``benchmarks/tp_memory_arithmetic.py``) and
``benchmarks/results/tp_memory.json`` (``benchmarks/tp_memory.py``): every row the page shows is
rebuilt here from the file, rounded as printed, and must appear in the page; so must the measured
activation bytes it quotes.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "tensor-parallel.md").read_text()
LABELS = {"4x1_zero1": "(4, 1) ZeRO-1", "4x1_zero2": "(4, 1) ZeRO-2", "2x2_tp": "(2, 2) TP",
          "2x2_tp_zero1": "(2, 2) TP + ZeRO-1", "2x2_tp_zero2": "(2, 2) TP + ZeRO-2",
          "2x2_tp_fsdp2": "(2, 2) TP + FSDP2", "4x1_fsdp2": "(4, 1) FSDP2"}  # fmt: skip


def _row(label: str, cells: list[float], digits: int) -> str:
    return f"| {label} | " + " | ".join(f"{c:.{digits}f}" for c in cells) + " |"


def _model_label(name: str, entry: dict) -> str:
    shape = entry["shape"]
    gqa = f"{shape['kv_heads']} KV heads" if shape["kv_heads"] < shape["heads"] else f"{shape['heads']} heads"
    return f"{name.upper()} ({entry['params'] / 1e9:.1f}B, {gqa})"


def test_arithmetic_table_is_the_results_file():
    res = json.loads((ROOT / "benchmarks/results/tp_memory_arithmetic.json").read_text())
    assert res["C"] == 8192
    for name, entry in res["models"].items():
        for t, row in entry["by_tp"].items():
            if "refused" in row:
                assert f"TP = {t} is refused" in PAGE
                continue
            keys = ("weights_gib", "grads_fp32_gib", "optimizer_zero1_gib", "activations_gib", "total_gib")
            line = _row(f"{_model_label(name, entry)} | {t}", [row[k] for k in keys], 1)
            assert line in PAGE, line
    seven = res["models"]["7b"]
    per_layer = seven["activation_bytes_per_token_per_layer"]
    assert (
        f"`R` = {per_layer['replicated']:,.0f}" in PAGE
        and f"`S` = {per_layer['split_over_lanes']:,.0f}" in PAGE
    )
    assert f"{seven['activation_bytes_per_token_outside_layers']['1']:,.0f} bytes a token" in PAGE


def test_measured_table_is_the_results_file():
    res = json.loads((ROOT / "benchmarks/results/tp_memory.json").read_text())
    assert res["model"]["params"] >= 100_000_000 and res["world_size"] == 4
    assert set(res["layouts"]) == set(LABELS), sorted(res["layouts"])  # every layout measured and shown
    for layout, entry in res["layouts"].items():
        m = entry["max_over_ranks"]
        keys = (
            "peak_above_baseline_mib",
            "parameters_mib",
            "gradients_after_sync_mib",
            "optimizer_state_mib",
        )
        line = _row(LABELS[layout], [m[k] for k in keys], 0)
        assert line in PAGE, line
