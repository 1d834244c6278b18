"""What one profiler run measured and fitted (:class:`Profile`), and the JSON file it is kept in.

The file is the planner's cost-model file: its ``cost_model`` entry is what
:func:`~lightning_bytescale.planner.cost_model.load_cost_model` reads (on the planner floor, so
the strategy and the data module need not import the profiler), and the rest is what the fit
was made from: the lengths, the measured times and bytes, the residuals, the capacity ``C``
and its memory budget.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_bytescale.planner.cost_model import PROFILE_FORMAT, CostModel, OffloadConfig
from lightning_bytescale.profiler.errors import ProfileError

FORMAT = PROFILE_FORMAT


@dataclass
class Profile:
    """Everything one profiler run measured and fitted; ``to_json_dict`` is the cost-model file."""

    cost_model: CostModel
    offload: OffloadConfig
    capacity: int | None  # C; None without a memory budget
    device: str
    dtype: str
    lengths: list[int]
    layer_seconds: list[float]  # T(s) measured: one layer forward+backward
    layer_forward_seconds: list[float]
    act_bytes: list[float]  # Act(s) measured: one layer's saved bytes
    outside_act_bytes: list[float]  # saved outside the layers (embedding, head, loss)
    model_seconds: list[float | None]  # the whole model forward+backward (reference; None: not timed)
    time_residuals: list[float]  # measured - fitted seconds
    act_residuals: list[float]  # measured - fitted bytes
    memory_budget_bytes: int | None = None
    static_bytes: int = 0  # parameters, gradients and optimizer states (not activations)
    param_count: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_parallel(self) -> int:
        """The devices of the HDP rank profiled (a tensor-parallel group of that many; 1: one device)."""
        return self.cost_model.tensor_parallel

    @property
    def relative_time_residuals(self) -> list[float]:
        return [r / m if m else 0.0 for r, m in zip(self.time_residuals, self.layer_seconds)]

    @property
    def relative_act_residuals(self) -> list[float]:
        return [r / m if m else 0.0 for r, m in zip(self.act_residuals, self.act_bytes)]

    def to_json_dict(self) -> dict:
        d = asdict(self)
        d["cost_model"] = self.cost_model.to_json_dict()
        d["offload"] = self.offload.to_json_dict()
        return {"format": FORMAT, **d}

    @classmethod
    def from_json_dict(cls, data: dict) -> Profile:
        if data.get("format") != FORMAT:
            raise ProfileError(f"not a {FORMAT} file (format={data.get('format')!r})")
        d = {k: v for k, v in data.items() if k != "format"}
        d["cost_model"] = CostModel.from_json_dict(d["cost_model"])
        d["offload"] = OffloadConfig.from_json_dict(d["offload"])
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
        return path

    def _comm_line(self) -> str:
        cm = self.cost_model
        if not cm.models_comm:
            return "ring links: not modelled (no bandwidth or no K/V bytes; the paper's compute-only model)"
        bw = [f"{v / 1e9:.3f} GB/s" if v else "-" for v in (cm.bandwidth_intra, cm.bandwidth_inter)]
        line = (
            f"ring links: intra {bw[0]}, inter {bw[1]}, K/V {cm.kv_bytes_per_token_per_layer:.0f} B/token/layer, "
            f"crossover (ring of 4) {cm.crossover_length(4) / 4:.0f} tokens a rank"
        )
        link = self.notes.get("p2p")
        if link:
            line += f" [gloo P2P measured: {link['nbytes'] / 2**20:.1f} MiB exchange, latency {link['latency_s'] * 1e6:.0f} us]"
        return line

    def summary(self) -> str:
        cm = self.cost_model
        lines = [
            f"device {self.device} ({self.dtype}), {cm.num_layers} layers, {self.param_count:,} parameters"
            + (
                f"; one tensor-parallel group of {cm.tensor_parallel} (T: the group's, Act: one lane's, "
                f"{self.notes.get('params_per_rank', 0):,} parameters a rank)"
                if cm.tensor_parallel > 1
                else ""
            ),
            f"T(s)   = {cm.a:.4e} s^2 + {cm.b:.4e} s + {cm.g:.4e}   [seconds per layer, fwd+bwd; "
            f"forward share {cm.forward_fraction:.2f}]",
            f"Act(s) = {cm.c:.1f} s + {cm.d:.1f}   [bytes saved per layer]",
            f"host link: d2h {self.offload.bandwidth_d2h / 1e9:.2f} GB/s, h2d {self.offload.bandwidth_h2d / 1e9:.2f} GB/s",
            self._comm_line(),
            (
                f"heads: {cm.attention_heads} query, {cm.kv_heads} key/value"
                + (" (one lane's)" if cm.tensor_parallel > 1 else "")
                + " [the planner may run Ulysses and hybrid items of sizes dividing them]"
                if cm.attention_heads is not None
                else "heads: unknown (the planner runs every item as a ring)"
            ),
            f"{'s':>8} {'T meas':>11} {'T fit':>11} {'resid':>8} {'Act meas':>12} {'Act fit':>12} {'resid':>8}",
        ]
        for i, s in enumerate(self.lengths):
            t, a = self.layer_seconds[i], self.act_bytes[i]
            lines.append(
                f"{s:>8} {t:>11.4e} {cm.layer_time(s):>11.4e} {self.relative_time_residuals[i]:>+8.1%} "
                f"{a:>12.0f} {cm.act_bytes(s):>12.0f} {self.relative_act_residuals[i]:>+8.1%}"
            )
        if self.capacity is not None:
            lines.append(
                f"capacity C = {self.capacity} tokens per {'HDP ' if cm.tensor_parallel > 1 else ''}rank (budget {self.memory_budget_bytes / 2**30:.2f} GiB, "
                f"static {self.static_bytes / 2**30:.2f} GiB)"
            )
        return "\n".join(lines)


def load_profile(path: str | Path) -> Profile:
    """Read a profiler file written by :meth:`Profile.save`."""
    return Profile.from_json_dict(json.loads(Path(path).read_text()))
