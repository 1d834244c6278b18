"""The cost model the planners balance on, and the rank-count rules built on it.

Compute (paper §4.2): a layer's forward+backward time for one sequence of ``s`` tokens is
``T(s) = a*s**2 + b*s + g`` seconds and its saved activations are ``Act(s) = c*s + d`` bytes.
A local micro-batch of packed sequences costs ``num_layers * (sum_j (a*s_j**2 + b*s_j) + g)``.

Communication (beyond the paper, which assumes ring traffic hidden): a member of a zigzag ring
of ``N`` ranks holds ``2*c_j`` slots of every sequence ``j`` of the item
(``c_j = ceil(s_j / 2N)``, padding included) and ``1/N`` of its causal-mask area.  Per layer it
pays::

    linear    = sum_j b * 2*c_j + g
    attention = sum_j a * s_j**2 / N
    transfer  = passes * (N - 1) * sum_j 2*c_j * kv_bytes / bandwidth
    time      = linear + max(attention, transfer)

``transfer`` is the K/V of the *other* ``N - 1`` members' shares flowing through this member
(``(N-1)/N`` of the padded sequence's K/V), i.e. "chunk" is the member's own ``s/N`` tokens and
it moves ``N - 1`` times.  ``passes`` (default 3) counts a training step's traffic relative to
one forward pass of K/V: K/V in the forward, K/V again plus dK/dV in the backward.  Whatever is
not hidden, ``max(0, transfer - attention)``, is the *exposed* ring time.  The bandwidth is
``bandwidth_intra`` when every member sits on one node (``ranks_per_node``), otherwise
``bandwidth_inter`` (a ring is as slow as its slowest link).  ``kv_bytes_per_token_per_layer``
of 0 (or no bandwidth) turns the term off: the paper's compute-only model.

Ulysses (DeepSpeed-Ulysses, when ``attention_heads`` and ``kv_heads`` are known): a member of
a group of ``n`` holding ``t`` slots sends its q, k and v to the others before attention and
gets its output back after it, ``(n - 1) t (2 H / n + 2 K_n)`` head vectors a pass (``K_n``:
the K/V heads one member needs, ``K / n`` while ``n`` divides ``K``); forward and backward move
the same volume (``ULYSSES_PASSES = 2``) and nothing hides it.  Attention is local on the whole
sequence for ``H / n`` heads: ``a s**2 / n`` like a ring member's.  The *hybrid* layout (USP,
LoongTrain) runs Ulysses among the ``u`` members of each node and a ring of the ``n / u`` node
groups across nodes, whose K/V per member is ``K_u / K`` of a ring's.

Rank counts (paper §2.2, §3.4): :func:`ranks_without_offload` is ``ceil(s / C)`` adjusted so that
a member's zigzag slots (``2*ceil(s/2D)``, padding included) fit ``C``; :func:`ranks_with_offload`
applies Eq. 3.  Capacity with offload is counted in *resident* tokens: a member holding ``S``
slots at offload ratio ``r`` keeps ``S * f(r)`` token-equivalents on the device, where
``f(r) = (2 + (1 - r)(l - 2)) / l`` (two layers always resident, ``1 - r`` of the other ``l - 2``).
This is Eq. 3 with ``Act`` proportional to tokens; :func:`eq3_ranks` is the literal formula.

Pure Python and NumPy; serialisable to a JSON dict (the profiler writes one, the strategy and
the simulator load it).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from lightning_bytescale.planner.errors import PlanError

# Paper Fig. 6(a), per-layer times in ms (attention, MLP) at 4K..128K tokens (bytescale-paper §1.4).
PAPER_TABLE_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
PAPER_TABLE_ATTENTION_MS = (0.8, 1.8, 4.8, 14.1, 48.2, 175.5)
PAPER_TABLE_MLP_MS = (0.9, 1.8, 3.6, 7.5, 15.1, 28.2)

#: A Ulysses step moves the same volume twice: q, k, v out and the output back in the forward;
#: the output's gradient out and the gradients of q, k and v back in the backward.
ULYSSES_PASSES = 2.0

_RATIO_GRID = 1_000_000  # offload ratios are rounded up to 1e-6 so plans serialise exactly
# A cost model must add up any step without overflow: times at this many tokens, times this headroom.
_PROBE_TOKENS = 2**31
_PROBE_HEADROOM = 2.0**40


def _is_number(v: object) -> bool:
    """A real number, not a bool (``true`` in a JSON file is not a coefficient)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class CostModel:
    """Per-layer time ``T(s) = a s^2 + b s + g`` (s), activations ``Act(s) = c s + d`` (bytes).

    ``a``, ``b``, ``g`` describe one layer's forward+backward; ``forward_fraction`` of it is the
    forward (used by the offload overlap constraint).  Bandwidths are bytes/s per rank and
    direction; ``None`` means the link is not modelled (communication free).
    ``tensor_parallel``: the devices of one HDP rank (a tensor-parallel group) the model
    describes: ``T`` is the group's time, ``Act`` one lane's bytes, K/V one lane's heads.
    ``attention_heads`` / ``kv_heads``: the query and K/V heads of one lane, what Ulysses splits
    over an item's members; ``None`` (unknown) leaves ring attention the only mode.
    """

    a: float
    b: float
    g: float = 0.0
    c: float = 0.0
    d: float = 0.0
    num_layers: int = 1
    kv_bytes_per_token_per_layer: float = 0.0
    bandwidth_intra: float | None = None
    bandwidth_inter: float | None = None
    ranks_per_node: int | None = None
    comm_passes: float = 3.0
    forward_fraction: float = 1.0 / 3.0
    name: str = "custom"
    tensor_parallel: int = (
        1  # devices of one HDP rank the figures are for (bytescale-profile --tensor-parallel)
    )
    attention_heads: int | None = None  # query heads of one lane (Ulysses splits them); None: unknown
    kv_heads: int | None = None  # key/value heads of one lane; None: unknown

    def __post_init__(self) -> None:
        for f in ("a", "b", "g", "c", "d", "kv_bytes_per_token_per_layer", "comm_passes"):
            v = getattr(self, f)
            if not (_is_number(v) and math.isfinite(v) and v >= 0):
                raise PlanError(f"cost model field {f} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1:
            raise PlanError(f"cost model num_layers must be an integer >= 1, got {self.num_layers!r}")
        for f in ("bandwidth_intra", "bandwidth_inter"):
            v = getattr(self, f)
            if v is not None and not (_is_number(v) and math.isfinite(v) and v > 0):
                raise PlanError(f"cost model {f} must be > 0 bytes/s or None (not modelled), got {v!r}")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise PlanError(f"cost model tensor_parallel must be an integer >= 1, got {tp!r}")
        self._check_heads()
        rpn = self.ranks_per_node
        if rpn is not None and (not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1):
            raise PlanError(f"ranks_per_node must be an integer >= 1 or None, got {rpn!r}")
        if not (_is_number(self.forward_fraction) and 0 < self.forward_fraction <= 1):
            raise PlanError(f"forward_fraction must be in (0, 1], got {self.forward_fraction!r}")
        self._check_not_degenerate()

    def _check_heads(self) -> None:
        heads, kv = self.attention_heads, self.kv_heads
        if heads is None and kv is None:
            return
        for f, v in (("attention_heads", heads), ("kv_heads", kv)):
            if v is None:
                raise PlanError(
                    "cost model attention_heads and kv_heads go together (the query and key/value heads of "
                    f"one tensor-parallel lane); {f} is missing"
                )
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"cost model {f} must be an integer >= 1 or None, got {v!r}")
        if heads % kv:
            raise PlanError(
                f"cost model attention_heads ({heads}) must be a multiple of kv_heads ({kv}): every key/value "
                "head serves the same number of query heads"
            )

    def _check_not_degenerate(self) -> None:
        """Refuse models the planners cannot balance on: no time at all, or times that overflow."""
        if self.a == 0 and self.b == 0 and self.g == 0:
            raise PlanError(
                f"cost model {self.name!r} gives every micro-batch zero time (a = b = g = 0), so the planners "
                "have nothing to balance on (T(s) = a*s^2 + b*s + g); profile the model with bytescale-profile "
                "or leave cost_model=None for the default"
            )
        s = float(_PROBE_TOKENS)
        bw = min(v for v in (self.bandwidth_intra, self.bandwidth_inter, math.inf) if v is not None)
        probes = {
            "T(s) x num_layers": self.num_layers * self.layer_time(s),
            "Act(s)": self.act_bytes(s),
            "ring transfer": self.comm_passes * s * self.kv_bytes_per_token_per_layer / bw * self.num_layers,
        }
        if self.attention_heads is not None and self.kv_heads is not None:
            heads_read = (self.attention_heads + self.kv_heads) / self.kv_heads
            kv_bytes = self.kv_bytes_per_token_per_layer
            probes["Ulysses exchange"] = ULYSSES_PASSES * s * heads_read * kv_bytes / bw * self.num_layers
        for what, value in probes.items():
            if not math.isfinite(value * _PROBE_HEADROOM):
                raise PlanError(
                    f"cost model {self.name!r} overflows: {what} at {_PROBE_TOKENS} tokens is {value:.3g}, "
                    "too large to add up a step; check the units (a: s/token^2, b: s/token, g: s, c: bytes/token, "
                    "d: bytes, bandwidths: bytes/s)"
                )

    # ------------------------------------------------------------------ formulas
    def layer_time(self, s: float) -> float:
        """``T(s)``: one layer's forward+backward seconds for one sequence of ``s`` tokens."""
        return self.a * s * s + self.b * s + self.g

    def forward_layer_time(self, s: float) -> float:
        return self.forward_fraction * self.layer_time(s)

    def act_bytes(self, s: float) -> float:
        """``Act(s)``: one layer's saved activation bytes for ``s`` tokens."""
        return self.c * s + self.d

    def local_time(self, lengths: Iterable[int]) -> float:
        """Whole-model seconds of a local micro-batch packing ``lengths`` (``g`` paid once)."""
        a, b = self.a, self.b
        t = 0.0
        for s in lengths:
            t += a * s * s + b * s
        return self.num_layers * (t + self.g)

    def bandwidth(self, intra: bool) -> float | None:
        """The ring's link bandwidth; falls back to the other link when one is not given."""
        if intra:
            return self.bandwidth_intra if self.bandwidth_intra is not None else self.bandwidth_inter
        return self.bandwidth_inter if self.bandwidth_inter is not None else self.bandwidth_intra

    @property
    def models_comm(self) -> bool:
        return self.kv_bytes_per_token_per_layer > 0 and (
            self.bandwidth_intra is not None or self.bandwidth_inter is not None
        )

    def ring_parts(
        self, lengths: Sequence[int], n: int, *, intra: bool = False
    ) -> tuple[float, float, float]:
        """Per-layer ``(linear, attention, transfer)`` seconds of one member of a ring of ``n``."""
        slots, area = _member_share(lengths, n)
        linear = self.b * slots + self.g
        attention = self.a * area / n
        bw = self.bandwidth(intra)
        if n <= 1 or bw is None or self.kv_bytes_per_token_per_layer <= 0:
            transfer = 0.0
        else:
            transfer = self.comm_passes * (n - 1) * slots * self.kv_bytes_per_token_per_layer / bw
        return linear, attention, transfer

    def ring_member_time(
        self, lengths: Sequence[int], n: int, *, intra: bool = False, comm_aware: bool = True
    ) -> tuple[float, float]:
        """Whole-model ``(time, exposed)`` seconds of one member of a ring of ``n``.

        ``comm_aware=False`` is the paper's model (transfer assumed hidden); ``exposed`` is still
        reported so the two models can be compared.
        """
        if n == 1:
            return self.local_time(lengths), 0.0
        linear, attention, transfer = self.ring_parts(lengths, n, intra=intra)
        exposed = max(0.0, transfer - attention)
        per_layer = linear + attention + (exposed if comm_aware else 0.0)
        return self.num_layers * per_layer, self.num_layers * exposed

    def ring_bytes(self, lengths: Sequence[int], n: int) -> float:
        """Bytes one ring item sends in a training step, summed over members and layers."""
        if n <= 1:
            return 0.0
        slots = sum(2 * (-(-s // (2 * n))) for s in lengths)
        return self.comm_passes * self.num_layers * n * (n - 1) * slots * self.kv_bytes_per_token_per_layer

    def crossover_length(self, n: int, *, intra: bool = False) -> float:
        """Sequence length below which a ring of ``n`` is communication-bound (``inf`` if always).

        Solves ``a s^2 / n = passes (n-1) (s/n) kv / bw`` (padding ignored):
        ``s* = passes (n-1) kv / (a bw)``; ``s*/n`` is the crossover in tokens per rank.
        """
        bw = self.bandwidth(intra)
        if n <= 1 or bw is None or self.kv_bytes_per_token_per_layer <= 0:
            return 0.0
        if self.a <= 0:
            return math.inf
        return self.comm_passes * (n - 1) * self.kv_bytes_per_token_per_layer / (self.a * bw)

    # ------------------------------------------------------------------ Ulysses and hybrid
    def ulysses_allowed(self, n: int) -> bool:
        """Whether ``n`` members can split this model's heads: the heads are known and ``n``
        divides the query heads (``n >= 2``)."""
        return self.attention_heads is not None and n >= 2 and self.attention_heads % n == 0

    def ulysses_kv_heads(self, n: int) -> int:
        """K/V heads one member of a Ulysses group of ``n`` holds for the whole sequence.

        ``kv_heads / n`` while ``n`` divides them (split); otherwise the K/V heads its
        ``attention_heads / n`` query heads read (replicated over the members that share them):
        1 when ``n`` is a multiple of ``kv_heads``, the most any member's query heads span else.
        """
        if not self.ulysses_allowed(n):
            raise PlanError(
                f"a Ulysses group of {n} does not split this cost model's heads "
                f"(attention_heads={self.attention_heads}, kv_heads={self.kv_heads}): n must divide "
                "attention_heads"
            )
        return _kv_heads_per_member(self.attention_heads, self.kv_heads, n)  # type: ignore[arg-type]

    def ulysses_exchange(self, slots: int, n: int, *, intra: bool = False) -> float:
        """Per-layer seconds of one member's all-to-alls (forward and backward) in a group of ``n``.

        The member holds ``slots`` tokens; it sends ``(n - 1) slots (2 H / n + 2 K_n)`` head
        vectors a pass (q, k, v to the others, their outputs back), each ``kv_bytes / (2 K)``
        bytes, on the link the members share; nothing overlaps it.
        """
        bw = self.bandwidth(intra)
        if n <= 1 or bw is None or self.kv_bytes_per_token_per_layer <= 0:
            return 0.0
        return ULYSSES_PASSES * self._exchange_bytes(slots, n) / bw

    def _exchange_bytes(self, slots: int, n: int) -> float:
        """Bytes one member sends in one pass of a Ulysses group of ``n`` holding ``slots`` tokens."""
        heads, kv = self.attention_heads, self.kv_heads
        per_head = self.kv_bytes_per_token_per_layer / (2 * kv)  # type: ignore[operator]
        return (n - 1) * slots * (2 * heads / n + 2 * self.ulysses_kv_heads(n)) * per_head  # type: ignore[operator]

    def ulysses_parts(
        self, lengths: Sequence[int], n: int, *, intra: bool = False
    ) -> tuple[float, float, float]:
        """Per-layer ``(linear, attention, exchange)`` seconds of one member of a Ulysses group of ``n``."""
        slots, area = _member_share(lengths, n)
        return self.b * slots + self.g, self.a * area / n, self.ulysses_exchange(slots, n, intra=intra)

    def ulysses_member_time(
        self, lengths: Sequence[int], n: int, *, intra: bool = False, comm_aware: bool = True
    ) -> tuple[float, float]:
        """Whole-model ``(time, exposed)`` seconds of one member of a Ulysses group of ``n``: the
        exchange is all exposed (``comm_aware=False`` leaves it out of ``time``, as for a ring)."""
        linear, attention, exchange = self.ulysses_parts(lengths, n, intra=intra)
        per_layer = linear + attention + (exchange if comm_aware else 0.0)
        return self.num_layers * per_layer, self.num_layers * exchange

    def hybrid_parts(
        self, lengths: Sequence[int], n: int, per_node: int
    ) -> tuple[float, float, float, float]:
        """Per-layer ``(linear, attention, ring transfer, exchange)`` seconds of one member of a
        hybrid item: Ulysses among the ``per_node`` members of each node (intra-node link), then
        a ring of the ``n / per_node`` node groups (inter-node link) in which each member carries
        ``per_node x`` its tokens for ``ulysses_kv_heads(per_node)`` K/V heads."""
        u = per_node
        rings = n // u
        slots, area = _member_share(lengths, n)
        exchange = self.ulysses_exchange(slots, u, intra=True)
        bw = self.bandwidth(False)
        if rings <= 1 or bw is None or self.kv_bytes_per_token_per_layer <= 0:
            transfer = 0.0
        else:
            kv_share = self.ulysses_kv_heads(u) / self.kv_heads  # type: ignore[operator]
            transfer = (
                self.comm_passes * (rings - 1) * u * slots * self.kv_bytes_per_token_per_layer * kv_share / bw
            )
        return self.b * slots + self.g, self.a * area / n, transfer, exchange

    def hybrid_member_time(
        self, lengths: Sequence[int], n: int, per_node: int, *, comm_aware: bool = True
    ) -> tuple[float, float]:
        """Whole-model ``(time, exposed)`` seconds of one member of a hybrid item (:meth:`hybrid_parts`):
        the ring transfer hides behind attention as far as it can, the exchange does not."""
        linear, attention, transfer, exchange = self.hybrid_parts(lengths, n, per_node)
        exposed = max(0.0, transfer - attention) + exchange
        per_layer = linear + attention + (exposed if comm_aware else 0.0)
        return self.num_layers * per_layer, self.num_layers * exposed

    def ulysses_bytes(self, lengths: Sequence[int], n: int) -> float:
        """Bytes one Ulysses item sends in a training step, summed over members and layers."""
        if n <= 1:
            return 0.0
        slots = sum(2 * (-(-s // (2 * n))) for s in lengths)
        return ULYSSES_PASSES * self.num_layers * n * self._exchange_bytes(slots, n)

    def hybrid_bytes(self, lengths: Sequence[int], n: int, per_node: int) -> tuple[float, float]:
        """``(ring bytes across nodes, exchange bytes inside nodes)`` one hybrid item sends in a
        training step, summed over members and layers."""
        u, rings = per_node, n // per_node
        slots = sum(2 * (-(-s // (2 * n))) for s in lengths)
        exchange = ULYSSES_PASSES * self.num_layers * n * self._exchange_bytes(slots, u)
        kv_share = self.ulysses_kv_heads(u) / self.kv_heads  # type: ignore[operator]
        ring = (
            self.comm_passes
            * self.num_layers
            * n
            * (rings - 1)
            * u
            * slots
            * self.kv_bytes_per_token_per_layer
        ) * kv_share
        return ring, exchange

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_model_shape(
        cls,
        layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        vocab: int,
        *,
        flops_per_s: float = 400e12,
        dtype_bytes: int = 2,
        backward_factor: float = 2.0,
        overhead_s: float = 0.0,
        bandwidth_intra: float | None = None,
        bandwidth_inter: float | None = None,
        ranks_per_node: int | None = None,
        name: str = "model-shape",
    ) -> CostModel:
        """FLOP-based coefficients for a dense decoder (SwiGLU MLP, GQA attention).

        Forward FLOPs per token per layer: ``2 * (2 h^2 + 2 h kv_dim + 3 h ffn) + 2 h vocab / L``
        (the LM head spread over the layers); causal attention ``2 h s^2`` per layer (``QK^T``
        and ``PV`` over half the square).  Training costs ``1 + backward_factor`` forwards.
        ``flops_per_s`` is the *achieved* rate.  Activations: ``dtype_bytes * (6 h + 2 kv_dim +
        3 ffn)`` bytes per token per layer (inputs kept by the linear layers, norms and SwiGLU;
        flash attention keeps no ``s^2`` term).  K/V bytes: ``2 * kv_dim * dtype_bytes``.  The
        heads are recorded (``attention_heads``, ``kv_heads``) for the Ulysses term.
        """
        for nm, v in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads)):
            if v < 1:
                raise PlanError(f"model shape {nm} must be >= 1, got {v}")
        if hidden % heads or heads % kv_heads:
            raise PlanError(
                f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
            )
        if flops_per_s <= 0:
            raise PlanError(f"flops_per_s must be > 0, got {flops_per_s}")
        head_dim = hidden // heads
        kv_dim = kv_heads * head_dim
        dense = (
            2.0 * (2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn)
            + 2.0 * hidden * vocab / layers
        )
        mult = 1.0 + backward_factor
        return cls(
            a=mult * 2.0 * hidden / flops_per_s,
            b=mult * dense / flops_per_s,
            g=overhead_s,
            c=float(dtype_bytes * (6 * hidden + 2 * kv_dim + 3 * ffn)),
            d=0.0,
            num_layers=layers,
            kv_bytes_per_token_per_layer=float(2 * kv_dim * dtype_bytes),
            bandwidth_intra=bandwidth_intra,
            bandwidth_inter=bandwidth_inter,
            ranks_per_node=ranks_per_node,
            forward_fraction=1.0 / mult,
            name=name,
            attention_heads=heads,
            kv_heads=kv_heads,
        )

    @classmethod
    def fit(
        cls,
        lengths: Sequence[float],
        times: Sequence[float],
        *,
        act_lengths: Sequence[float] | None = None,
        act_bytes: Sequence[float] | None = None,
        **kwargs,
    ) -> CostModel:
        """Least-squares fit of ``T`` (and ``Act`` when given) to measured per-layer points.

        Coefficients are kept non-negative: the best fit over the subsets of the basis whose
        unconstrained solution is non-negative.  ``kwargs`` set the other fields.
        """
        a, b, g = _nonneg_lstsq(lengths, times, degree=2, what="times")
        c, d = kwargs.pop("c", 0.0), kwargs.pop("d", 0.0)
        if act_lengths is not None or act_bytes is not None:
            if act_lengths is None or act_bytes is None:
                raise PlanError("fit activations with both act_lengths and act_bytes")
            c, d = _nonneg_lstsq(act_lengths, act_bytes, degree=1, what="act_bytes")
        return cls(a=a, b=b, g=g, c=c, d=d, **kwargs)

    @classmethod
    def paper_preset(cls) -> CostModel:
        """The paper's per-layer table (§1.4) as a LLaMA-7B-like model for simulation.

        * ``T``: least-squares fit of attention+MLP ms at 4K..128K, read as the *forward* time
          (relative error below 2% at every point), times 3 for forward+backward:
          forward ``a = 9.03e-12 s/token^2``, ``b = 3.70e-7 s/token``, ``g = 0``.
        * 32 layers; K/V 4,096 bytes per token per layer (8 KV heads x 128 x bf16, Table 1).
        * Bandwidths (assumed, per rank and direction): 150 GB/s inside a node of 8 ranks
          (NVLink), 25 GB/s between nodes (one 200 Gb/s NIC per GPU).  Crossover (large rings):
          about 18.1K tokens a rank between nodes, 3.0K inside a node.
        * ``Act``: ``c`` is chosen so that Eq. 3's largest hidden offload ratio at 64K is 0.5
          with 25 GB/s PCIe (Fig. 21: r = 0.5 costs nothing at 64K); it reaches 1 near 170K,
          consistent with "r = 1 costs nothing at 256K".
        """
        return _paper_preset() if cls is CostModel else cls(**asdict(_paper_preset()))

    @classmethod
    def _build_paper_preset(cls) -> CostModel:
        """Fit the preset (cached by :meth:`paper_preset`)."""
        ms = [x + y for x, y in zip(PAPER_TABLE_ATTENTION_MS, PAPER_TABLE_MLP_MS)]
        a, b, g = (
            _round_sig(v)
            for v in _nonneg_lstsq(PAPER_TABLE_LENGTHS, [t * 1e-3 for t in ms], degree=2, what="times")
        )
        fwd_64k = a * 65536**2 + b * 65536 + g
        c = _round_sig(fwd_64k * PAPER_PCIE_BANDWIDTH / (0.5 * 65536))
        return cls(
            a=3 * a,
            b=3 * b,
            g=3 * g,
            c=c,
            d=0.0,
            num_layers=32,
            kv_bytes_per_token_per_layer=4096.0,
            bandwidth_intra=150e9,
            bandwidth_inter=25e9,
            ranks_per_node=8,
            comm_passes=3.0,
            forward_fraction=1.0 / 3.0,
            name="paper-preset",
        )

    # ------------------------------------------------------------------ (de)serialisation
    def to_json_dict(self) -> dict:
        """The fields as a dict; ``tensor_parallel`` only when it is not 1 and the heads only when
        known, so the files (and the digests of plans that carry them) of one-device models
        without heads stay what they were."""
        d = asdict(self)
        if d["tensor_parallel"] == 1:
            del d["tensor_parallel"]
        for f in ("attention_heads", "kv_heads"):  # unknown heads: the files of before, unchanged
            if d[f] is None:
                del d[f]
        return d

    @classmethod
    def from_json_dict(cls, data: dict) -> CostModel:
        if not isinstance(data, dict):
            raise PlanError(
                f"a cost model must be a JSON object of its fields (a, b, ...), got {type(data).__name__} {data!r}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"unknown cost model field(s) {unknown}; known fields: {sorted(known)}")
        missing = [k for k in ("a", "b") if k not in data]
        if missing:
            raise PlanError(f"cost model dict lacks {missing}")
        return cls(**data)

    def with_(self, **changes) -> CostModel:
        return replace(self, **changes)


PAPER_PCIE_BANDWIDTH = 25e9

#: The ``format`` tag of a ``bytescale-profile`` file (:mod:`lightning_bytescale.profiler`).
PROFILE_FORMAT = "bytescale-profile/1"


def cost_model_from_json(data: object) -> CostModel:
    """The :class:`CostModel` in a profiler file's JSON (``{"format": ..., "cost_model": {...}}``),
    in any object with a ``cost_model`` entry, or in a plain cost-model dict."""
    if isinstance(data, dict) and "cost_model" in data:
        return CostModel.from_json_dict(data["cost_model"])
    return CostModel.from_json_dict(data)  # type: ignore[arg-type]


def load_cost_model(path: str | os.PathLike) -> CostModel:
    """Read a cost model from a ``bytescale-profile`` JSON file or a file holding a plain dict.

    Raises :class:`PlanError` naming the file and what is wrong with it: it does not exist, it
    is not JSON, or it holds no usable cost model.
    """
    p = Path(path)
    if not p.is_file():
        raise PlanError(
            f"cost_model file {str(p)!r} does not exist; write one with `bytescale-profile -o {p}` "
            "or pass cost_model=None for the planner's default"
        )
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        return cost_model_from_json(data)
    except (OSError, ValueError, TypeError) as err:
        raise PlanError(
            f"cost_model file {str(p)!r} is not a usable cost model ({err}); pass the JSON written by "
            "bytescale-profile or CostModel.to_json_dict(), or cost_model=None for the planner's default"
        ) from err


def _member_share(lengths: Sequence[int], n: int) -> tuple[int, float]:
    """One member's slots (``2 ceil(s / 2n)`` per sequence, padding included) and the whole
    causal-mask measure ``sum s^2`` of an item's sequences on a group of ``n``."""
    slots = 0
    area = 0.0
    for s in lengths:
        slots += 2 * (-(-s // (2 * n)))
        area += s * s
    return slots, area


@functools.lru_cache(maxsize=4096)
def _kv_heads_per_member(heads: int, kv_heads: int, n: int) -> int:
    """K/V heads the member of a Ulysses group of ``n`` that needs the most must hold."""
    if kv_heads % n == 0:
        return kv_heads // n
    group = heads // kv_heads  # query heads per K/V head
    per = heads // n  # query heads per member
    return max((i * per + per - 1) // group - (i * per) // group + 1 for i in range(n))


@functools.lru_cache(maxsize=1)
def _paper_preset() -> CostModel:
    return CostModel._build_paper_preset()


def _round_sig(x: float, digits: int = 10) -> float:
    """Round to ``digits`` significant digits so a fit is bit-identical across BLAS builds."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits - 1}e}")


def _nonneg_lstsq(xs: Sequence[float], ys: Sequence[float], *, degree: int, what: str) -> tuple[float, ...]:
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise PlanError(f"fit needs two equally long non-empty 1-D sequences of lengths and {what}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise PlanError(f"fit got non-finite lengths or {what}")
    basis = np.stack([x**p for p in range(degree, -1, -1)], axis=1)
    best: tuple[float, np.ndarray] | None = None
    cols = range(degree + 1)
    for k in range(degree + 1, 0, -1):
        for subset in itertools.combinations(cols, k):
            sub = basis[:, subset]
            # scale columns for conditioning
            scale = np.maximum(np.abs(sub).max(axis=0), 1e-300)
            coef, *_ = np.linalg.lstsq(sub / scale, y, rcond=None)
            coef = coef / scale
            if np.any(coef < 0):
                continue
            full = np.zeros(degree + 1)
            full[list(subset)] = coef
            err = float(np.sum((basis @ full - y) ** 2))
            if best is None or err < best[0] - 1e-30:
                best = (err, full)
    if best is None:  # only possible for all-negative targets
        raise PlanError(f"no non-negative fit exists for the given {what}; check the measurements")
    return tuple(float(v) for v in best[1])


# ====================================================================== offload and rank counts


@dataclass(frozen=True)
class OffloadConfig:
    """Selective activation offload (paper §3.3-3.4).

    ``layers_per_rank`` is ``l`` (layers in one pipeline stage); bandwidths are the profiled
    PCIe device-to-host and host-to-device bytes/s.
    """

    layers_per_rank: int
    bandwidth_d2h: float = PAPER_PCIE_BANDWIDTH
    bandwidth_h2d: float = PAPER_PCIE_BANDWIDTH

    def __post_init__(self) -> None:
        if not isinstance(self.layers_per_rank, int) or self.layers_per_rank < 1:
            raise PlanError(f"offload layers_per_rank must be an integer >= 1, got {self.layers_per_rank!r}")
        for f in ("bandwidth_d2h", "bandwidth_h2d"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v > 0):
                raise PlanError(f"offload {f} must be > 0 bytes/s, got {v!r}")

    @property
    def bandwidth(self) -> float:
        return min(self.bandwidth_d2h, self.bandwidth_h2d)

    def resident_fraction(self, r: float) -> float:
        """``f(r) = (2 + (1 - r)(l - 2)) / l``; 1 when ``l <= 2`` (nothing can leave)."""
        nl = self.layers_per_rank
        if nl <= 2:
            return 1.0
        return (2.0 + (1.0 - r) * (nl - 2)) / nl

    def to_json_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, data: dict) -> OffloadConfig:
        return cls(**data)


def resident_tokens(slots: int, ratio: float, offload: OffloadConfig | None) -> float:
    """Token-equivalents a micro-batch of ``slots`` keeps on the device at offload ``ratio``."""
    if ratio <= 0 or offload is None:
        return float(slots)
    return slots * offload.resident_fraction(ratio)


def fits_capacity(slots: int, ratio: float, capacity: int, offload: OffloadConfig | None) -> bool:
    return resident_tokens(slots, ratio, offload) <= capacity * (1 + 1e-12)


def member_slots(length: int, ring_size: int) -> int:
    """Slots one member holds: the whole sequence locally, ``2*ceil(s/2D)`` in a ring."""
    return length if ring_size == 1 else 2 * (-(-length // (2 * ring_size)))


def ranks_without_offload(length: int, capacity: int) -> int:
    """``D(s)``: 1 when ``s <= C``; else the fewest ranks whose zigzag slots fit ``C``.

    ``2*ceil(s/2D) <= C`` iff ``D >= s / (2*floor(C/2))``, which is ``ceil(s/C)`` for even ``C``.
    """
    if length < 1:
        raise PlanError(f"sequence length must be >= 1, got {length}")
    if capacity < 2:
        raise PlanError(f"capacity must be >= 2 tokens (a ring member holds two chunks), got {capacity}")
    if length <= capacity:
        return 1
    half = capacity // 2
    return -(-length // (2 * half))


def max_offload_ratio(length: int, cost: CostModel, offload: OffloadConfig) -> float:
    """Eq. 3's overlap bound ``r* = min(1, T_fwd(s) * min(B) / Act(s))``."""
    act = cost.act_bytes(length)
    if act <= 0:
        return 1.0
    return min(1.0, cost.forward_layer_time(length) * offload.bandwidth / act)


def eq3_lower_bound(length: int, capacity: int, cost: CostModel, offload: OffloadConfig) -> float:
    """Smallest ratio that saves a rank: ``min(1, l Act(C) / ((l - 2) Act(s)))``."""
    nl = offload.layers_per_rank
    act = cost.act_bytes(length)
    if nl <= 2 or act <= 0:
        return 1.0
    return min(1.0, nl * cost.act_bytes(capacity) / ((nl - 2) * act))


def eq3_ranks(length: int, ratio: float, capacity: int, cost: CostModel, offload: OffloadConfig) -> int:
    """The literal Eq. 3: ``ceil((2 Act(s) + (1 - r)(l - 2) Act(s)) / (l Act(C)))``."""
    nl = offload.layers_per_rank
    act_s = cost.act_bytes(length)
    budget = nl * cost.act_bytes(capacity)
    if budget <= 0:
        raise PlanError("Eq. 3 needs Act(C) > 0; give the cost model activation coefficients c/d")
    need = (2 * act_s + (1 - ratio) * max(nl - 2, 0) * act_s) / budget
    return max(1, math.ceil(need - 1e-12))


def min_ratio_for(length: int, ring_size: int, capacity: int, offload: OffloadConfig | None) -> float | None:
    """Smallest offload ratio (on a 1e-6 grid) at which ``ring_size`` members fit; None if none."""
    slots = member_slots(length, ring_size)
    if slots <= capacity:
        return 0.0
    if offload is None or offload.layers_per_rank <= 2:
        return None
    nl = offload.layers_per_rank
    r = 1.0 - (nl * capacity / slots - 2.0) / (nl - 2)
    r = math.ceil(max(r, 0.0) * _RATIO_GRID) / _RATIO_GRID
    while r <= 1.0 and not fits_capacity(slots, r, capacity, offload):
        r = (round(r * _RATIO_GRID) + 1) / _RATIO_GRID
    return r if r <= 1.0 else None


def offload_options(
    length: int, capacity: int, cost: CostModel | None, offload: OffloadConfig | None
) -> list[tuple[int, float]]:
    """Feasible ``(ranks, ratio)`` choices for one sequence, fewest ranks first.

    The last entry is always ``(D(s), 0.0)``.  Entries before it use offload: every ``D`` from
    Eq. 3's optimum up to ``D(s) - 1``, each with the smallest ratio that fits (at most ``r*``).
    Empty offload choices when ``r*`` is below Eq. 3's lower bound (the fallback ``r = 0``).
    """
    d0 = ranks_without_offload(length, capacity)
    if offload is None or cost is None or offload.layers_per_rank <= 2:
        return [(d0, 0.0)]
    r_star = max_offload_ratio(length, cost, offload)
    if cost.act_bytes(capacity) > 0 and r_star < eq3_lower_bound(length, capacity, cost, offload) - 1e-12:
        return [(d0, 0.0)]
    out: list[tuple[int, float]] = []
    # fewest ranks whose slots fit at r*: f(r*) * 2ceil(s/2D) <= C
    frac = offload.resident_fraction(r_star)
    lo = max(1, math.floor(length * frac / capacity))
    for d in range(lo, d0):
        r = min_ratio_for(length, d, capacity, offload)
        if r is not None and r <= r_star + 1e-12:
            out.append((d, r))
    out.append((d0, 0.0))
    return out


def ranks_with_offload(
    length: int, capacity: int, cost: CostModel | None, offload: OffloadConfig | None
) -> tuple[int, float]:
    """Eq. 3: the fewest ranks reachable with a hidden offload, and the ratio used.

    The ratio is the smallest that reaches that rank count (at most ``r*``): same ranks, less
    PCIe traffic.  Falls back to ``(D(s), 0)`` when no feasible ratio saves a rank.
    """
    return offload_options(length, capacity, cost, offload)[0]
