"""Build packed (THD) micro-batches from a `Plan` and the token data.

The planner says *which* tokens a rank holds (pieces, rings); this module turns that into the
tensors a model runs on: ``input_ids``, ``labels``, ``position_ids`` and the
:class:`~lightning_bytescale.packed_attention.layout.AttentionLayout`.

* Local micro-batch: whole sequences concatenated, positions ``0 .. s - 1``.
* Ring micro-batch: per sequence, this member's ``2c`` zigzag slots
  (:func:`~lightning_bytescale.planner.zigzag.member_positions`): the real tokens of its two
  chunks in position order, then its 0-2 padding slots (the padding is spread over the ``2N``
  chunks, so every member gets about ``1/N`` of the causal-mask area).  Padding slots (positions
  ``>= s``) hold input 0 and label -100; real tokens keep their positions in the sequence (RoPE).

Labels are taken from the *full* sequence (``label[p] = token[p + 1]``), so a zigzag chunk's
last slot is labelled with the first token of the next chunk even though another member holds
it.  The last position of every sequence is -100, so a sequence of length ``s`` contributes
``s - 1`` loss tokens and the global batch ``sum(s_i - 1)``.

With a loss mask (chat data: ``mask[i]`` true when token ``i`` is trained), ``label[p]`` is
``token[p + 1]`` only where ``mask[p + 1]`` holds, else -100, wherever slot ``p`` lies (a zigzag
chunk's last slot reads the mask of the next chunk's first token too); the global batch then has
``sum(mask_i[1:].sum())`` loss tokens, which every rank takes from the sample table, so it is the
same on every rank without reading the other ranks' data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from itertools import groupby

import numpy as np
import torch

from lightning_bytescale.engine.batch import PackedMicroBatch, StepBatch
from lightning_bytescale.errors import ByteScaleError
from lightning_bytescale.packed_attention.layout import MODES, AttentionLayout
from lightning_bytescale.planner import zigzag
from lightning_bytescale.planner.modes import group_layout
from lightning_bytescale.planner.plan import MicroBatch, Plan

IGNORE_INDEX = -100

TokenSource = Callable[[int], "Sequence[int] | np.ndarray | torch.Tensor"]
MaskSource = Callable[[int], "Sequence[bool] | np.ndarray | torch.Tensor"]  # sequence -> loss mask


class PackingError(ByteScaleError, ValueError):
    """A plan and its token data do not fit together (or the batch cannot be trained on)."""


class EmptyBatchError(PackingError):
    """The global batch has no loss tokens, so a token-mean loss is undefined."""


def count_loss_tokens(lengths: Sequence[int], *, allow_zero: bool = False) -> int:
    """Loss tokens of a global batch: ``sum(s_i - 1)`` (the last token of a sequence has no label).

    Raises :class:`EmptyBatchError` when the count is zero (unless ``allow_zero``), and
    :class:`PackingError` for a length below 1.
    """
    total = 0
    for i, s in enumerate(lengths):
        if int(s) < 1:
            raise PackingError(
                f"sequence {i} has length {s}; every sequence needs at least one token "
                "(drop empty samples before planning)"
            )
        total += int(s) - 1
    if total == 0 and not allow_zero:
        raise EmptyBatchError(
            f"the global batch of {len(lengths)} sequence(s) has zero loss tokens (every sequence has "
            "length 1), so the token-mean loss is undefined; use sequences of at least 2 tokens"
        )
    return total


def _as_tokens(seq: int, raw: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        if raw.is_floating_point() or raw.is_complex():
            raise PackingError(f"sequence {seq}: token ids must be integers, got dtype {raw.dtype}")
        arr = raw.detach().cpu().numpy()
    else:
        arr = np.asarray(raw)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise PackingError(f"sequence {seq}: token ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise PackingError(f"sequence {seq}: tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size < 1:
        raise PackingError(f"sequence {seq} is empty; drop empty samples before planning")
    return arr.astype(np.int64, copy=False)


def _as_mask(seq: int, raw: Sequence[bool] | np.ndarray | torch.Tensor, length: int) -> np.ndarray:
    arr = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if arr.shape != (length,):
        raise PackingError(
            f"sequence {seq}: its loss mask has shape {arr.shape}, its tokens ({length},); one flag per token"
        )
    if (
        arr.size
        and arr.dtype != np.bool_
        and not (np.issubdtype(arr.dtype, np.integer) and int(arr.min()) >= 0 and int(arr.max()) <= 1)
    ):
        raise PackingError(f"sequence {seq}: a loss mask must be booleans (or 0/1), got dtype {arr.dtype}")
    return arr.astype(bool, copy=False)


def _sequence_slots(
    full: np.ndarray, pos: np.ndarray, mask: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and next-token labels of the given slot positions (padding where ``pos >= s``).

    ``mask``: the sequence's loss mask; a label whose target token is not in it is -100.
    """
    s = full.size
    inputs = np.where(pos < s, full[np.minimum(pos, s - 1)], 0)
    target = np.minimum(pos + 1, s - 1)
    keep = pos + 1 < s
    if mask is not None:
        keep &= mask[target]
    labels = np.where(keep, full[target], IGNORE_INDEX)
    return inputs, labels


def build_micro_batch(
    mb: MicroBatch,
    rank: int,
    tokens: TokenSource,
    num_global_tokens: int,
    index: int = 0,
    *,
    lengths: Sequence[int] | None = None,
    loss_mask: MaskSource | None = None,
    probe_ring: bool = False,
    ring_ranks: Sequence[int] | None = None,
    ranks_per_node: int | None = None,
) -> PackedMicroBatch:
    """Pack one micro-batch of ``rank``.

    ``tokens(seq)`` returns the *full* token list of global sequence ``seq``.  ``lengths``
    (the plan's length list), when given, is checked against the data.  ``loss_mask(seq)``, when
    given, returns the sequence's loss mask (one flag per token: is its prediction trained).
    ``probe_ring`` marks the ring micro-batch all of whose members run the loss probe
    (:func:`probe_ring_item`).  ``ring_ranks[r]`` is the global rank that plan rank ``r``'s ring
    transfers go to (default: ``r`` itself); with tensor parallelism a plan's ranks are HDP ranks
    and each TP lane passes the global ranks of its own lane
    (:attr:`lightning_bytescale.parallel.ParallelMesh.ring_ranks`).

    A ring item's ``mode`` goes into the layout; a ``"hybrid"`` item's Ulysses groups are its
    members on one node, from ``ranks_per_node`` (plan ranks per node, the plan option of that
    name): :func:`hybrid_ulysses_size`.
    """
    if not mb.pieces:
        raise PackingError(f"rank {rank} micro-batch {index} has no pieces; a plan must not list empty work")
    if mb.ring is None:
        n, member = 1, 0
    else:
        if rank not in mb.ring:
            raise PackingError(
                f"rank {rank} is not a member of ring {mb.ring} (item {mb.item}); "
                "the plan was built for other ranks"
            )
        n, member = len(mb.ring), mb.ring.index(rank)
        if n == 1:
            raise PackingError(f"item {mb.item}: a single-rank ring must be expressed as a local micro-batch")

    ids, labels, positions, slots, seq_lens, seq_ids = [], [], [], [], [], []
    for piece in mb.pieces:
        full = _as_tokens(piece.seq, tokens(piece.seq))
        s = full.size
        if lengths is not None and int(lengths[piece.seq]) != s:
            raise PackingError(
                f"sequence {piece.seq}: the plan says length {lengths[piece.seq]} but the data has {s} "
                "tokens; plan from the same lengths the loader yields"
            )
        if mb.ring is None:
            pos = np.arange(s, dtype=np.int64)
            expected = [(0, s)]
        else:
            pos = np.asarray(zigzag.member_positions(s, n, member), dtype=np.int64)
            expected = zigzag.member_ranges(s, n, member)
        if [tuple(r) for r in piece.ranges] != expected:
            raise PackingError(
                f"sequence {piece.seq} on rank {rank}: piece ranges {list(piece.ranges)} differ from the "
                f"{'whole sequence' if mb.ring is None else f'zigzag share of member {member}/{n}'} "
                f"{expected}; the plan and the data disagree"
            )
        mask = None if loss_mask is None else _as_mask(piece.seq, loss_mask(piece.seq), s)
        inp, lab = _sequence_slots(full, pos, mask)
        ids.append(inp)
        labels.append(lab)
        positions.append(pos)
        slots.append(pos.size)
        seq_lens.append(s)
        seq_ids.append(piece.seq)

    ring, mode, ulysses_size = None, "ring", None
    if mb.ring is not None:
        ring = tuple(mb.ring) if ring_ranks is None else tuple(int(ring_ranks[r]) for r in mb.ring)
        mode = getattr(mb, "mode", "ring")
        if mode not in MODES:
            raise PackingError(
                f"item {mb.item} has attention mode {mode!r}; a ring item's mode is one of {MODES}"
            )
        if mode == "hybrid":
            ulysses_size = hybrid_ulysses_size(tuple(mb.ring), ranks_per_node, mb.item)
    layout = AttentionLayout(
        cu_seqlens=(0, *np.cumsum(slots).tolist()),
        seq_lens=tuple(seq_lens),
        ring=ring,
        member=member,
        mode=mode,
        ulysses_size=ulysses_size,
    )
    return PackedMicroBatch(
        input_ids=torch.from_numpy(np.concatenate(ids)),
        labels=torch.from_numpy(np.concatenate(labels)),
        position_ids=torch.from_numpy(np.concatenate(positions)),
        layout=layout,
        seq_ids=tuple(seq_ids),
        num_global_tokens=int(num_global_tokens),
        offload_ratio=float(mb.offload_ratio),
        index=index,
        probe_ring=probe_ring and mb.ring is not None,
    )


def hybrid_ulysses_size(ring: Sequence[int], ranks_per_node: int | None, item: int | None = None) -> int:
    """The Ulysses group size of a hybrid ring item: its members on one node, consecutive in ``ring``.

    ``ring`` holds plan ranks; rank ``r`` is on node ``r // ranks_per_node``.  The planner's rule
    (:func:`lightning_bytescale.planner.modes.group_layout`, which ``Plan.validate`` and the
    planner's cost use): the ring spans two nodes or more, each holding one run of the same number
    (``>= 2``) of consecutive members (USP's layout: Ulysses inside a node, a ring across nodes);
    otherwise :class:`PackingError`.  Group ``j`` is then ``modes.hybrid_groups(ring, ranks_per_node)[j]``.
    """
    if ranks_per_node is None or int(ranks_per_node) < 1:
        raise PackingError(
            f"item {item} runs hybrid attention (Ulysses inside each node, a ring across nodes) but the plan "
            "does not say how many ranks a node holds; plan with ranks_per_node (the planner option, or the "
            "cost model's)"
        )
    per_node = group_layout(tuple(int(r) for r in ring), int(ranks_per_node)).per_node
    if per_node is None:
        runs = [(node, len(list(run))) for node, run in groupby(int(r) // int(ranks_per_node) for r in ring)]
        raise PackingError(
            f"hybrid item {item}: its ring {tuple(ring)} holds {[size for _, size in runs]} consecutive members "
            f"on nodes {[node for node, _ in runs]} ({ranks_per_node} ranks a node); a hybrid ring spans two "
            "nodes or more and lists every node's members together, the same number (>= 2) on every node. Plan "
            "it as 'ring' or 'ulysses', or order its members node by node"
        )
    return per_node


def probe_ring_item(plan: Plan) -> int | None:
    """The ring item every one of its members probes for the loss normalisation, or ``None``.

    The probe runs a micro-batch's forward once more; on a ring that forward exchanges with
    the ring's peers, so either every member probes it or none does.  Each rank packs its own
    micro-batches, so the choice comes from the plan, which every rank holds: the ring item
    with the lowest id without offload.  A plan whose micro-batches are all rings (``static``)
    is checked that way, not only through local micro-batches.
    """
    items = [
        mb.item
        for mbs in plan.ranks
        for mb in mbs
        if mb.ring is not None and mb.offload_ratio == 0 and mb.item is not None
    ]
    return min(items, default=None)


def plan_digest(plan: Plan) -> str:
    """A hash of the plan that every rank must agree on (uses ``plan.digest()`` when the plan has one)."""
    own = getattr(plan, "digest", None)
    if callable(own):
        return str(own())
    h = hashlib.sha256()
    h.update(repr((plan.world_size, plan.capacity, plan.planner, tuple(plan.lengths))).encode())
    for r, mbs in enumerate(plan.ranks):
        for mb in mbs:
            h.update(repr((r, mb.ring, mb.item, [(p.seq, tuple(p.ranges)) for p in mb.pieces])).encode())
    return h.hexdigest()[:16]


def step_digest(plan: Plan, data_identity: str = "") -> str:
    """The digest ranks compare before a step: the plan's, with the data identity folded in."""
    digest = plan_digest(plan)
    if not data_identity:
        return digest
    return hashlib.sha256(f"{digest}|{data_identity}".encode()).hexdigest()[:16]


def count_masked_loss_tokens(lengths: Sequence[int], loss_tokens: Sequence[int]) -> int:
    """Loss tokens of a loss-masked global batch: the sum of the sequences' trained tokens.

    Raises :class:`EmptyBatchError` when nothing is trained, and :class:`PackingError` for a
    count that does not fit its sequence.
    """
    count_loss_tokens(lengths, allow_zero=True)  # the lengths themselves are valid
    if len(loss_tokens) != len(lengths):
        raise PackingError(
            f"{len(loss_tokens)} loss-token counts for {len(lengths)} sequences; give one per sequence"
        )
    for i, (s, n) in enumerate(zip(lengths, loss_tokens)):
        if not 0 <= int(n) <= int(s) - 1:
            raise PackingError(f"sequence {i} has {n} loss tokens but length {s} (at most {int(s) - 1})")
    total = int(sum(int(n) for n in loss_tokens))
    if total == 0:
        raise EmptyBatchError(
            f"the global batch of {len(lengths)} sequence(s) has no trained token (the loss mask masks them "
            "all), so the token-mean loss is undefined; drop samples without loss tokens before batching "
            "(ByteScaleDataModule does)"
        )
    return total


def build_step(
    plan: Plan,
    rank: int,
    tokens: TokenSource,
    step: int = 0,
    data_identity: str = "",
    *,
    loss_mask: MaskSource | None = None,
    loss_tokens: Sequence[int] | None = None,
    ring_ranks: Sequence[int] | None = None,
) -> StepBatch:
    """Everything ``rank`` runs in one step of ``plan``, packed.

    ``data_identity`` names what the step reads by content (the data module passes the token
    store's content hash, its sample table and the batch's samples); it is folded into the
    digest, so ranks that read different data for the same lengths stop at the digest check,
    before any exchange, instead of training on it.

    ``loss_mask(seq)``: the loss mask of global sequence ``seq`` (labels of untrained tokens
    become -100).  ``loss_tokens``: each sequence's trained-token count (``mask[1:].sum()``),
    so that ``num_global_tokens`` needs no other rank's mask; without it every sequence's mask
    is read.  The masks this rank packs are checked against their counts.

    ``ring_ranks`` (one global rank per plan rank) names the ring peers' global ranks when the
    plan's ranks are not global ranks: with tensor parallelism ``rank`` is the HDP rank, and the
    TP lane packing the step passes its lane's ranks, so lane ``t`` exchanges its head shard with
    lane ``t`` of the ring's other HDP ranks (see :func:`build_micro_batch`).
    """
    if not 0 <= rank < plan.world_size:
        raise PackingError(f"rank {rank} is outside the plan's world size {plan.world_size}")
    if ring_ranks is not None and len(ring_ranks) != plan.world_size:
        raise PackingError(
            f"ring_ranks names {len(ring_ranks)} global ranks for a plan of {plan.world_size} ranks; give one "
            "global rank per plan (HDP) rank"
        )
    if len(plan.ranks) != plan.world_size:
        raise PackingError(
            f"the plan lists {len(plan.ranks)} ranks but says world size {plan.world_size}; rebuild the plan"
        )
    lengths = plan.lengths
    if loss_mask is None:
        if loss_tokens is not None:
            raise PackingError("loss_tokens were given without a loss_mask; give both or neither")
        num_global = count_loss_tokens(lengths)
        mask_of = None
    else:
        if loss_tokens is None:
            loss_tokens = [
                int(_as_mask(j, loss_mask(j), int(lengths[j]))[1:].sum()) for j in range(len(lengths))
            ]
        counts = [int(n) for n in loss_tokens]
        num_global = count_masked_loss_tokens(lengths, counts)

        def mask_of(seq: int) -> np.ndarray:
            mask = _as_mask(seq, loss_mask(seq), int(lengths[seq]))
            if int(mask[1:].sum()) != counts[seq]:
                raise PackingError(
                    f"sequence {seq}: its loss mask trains {int(mask[1:].sum())} tokens, the sample table says "
                    f"{counts[seq]}; the masks and the counts come from different data"
                )
            return mask

    probed = probe_ring_item(plan)
    mbs = [
        build_micro_batch(
            mb,
            rank,
            tokens,
            num_global,
            index=i,
            lengths=lengths,
            loss_mask=mask_of,
            probe_ring=probed is not None and mb.item == probed,
            ring_ranks=ring_ranks,
            ranks_per_node=(getattr(plan, "options", None) or {}).get("ranks_per_node"),
        )
        for i, mb in enumerate(plan.ranks[rank])
    ]
    stats_fn = getattr(plan, "stats", None)
    stats = dict(stats_fn()) if callable(stats_fn) else {}
    stats.setdefault("world_size", plan.world_size)  # run_step and the strategy check it against the group
    # every rank holds the whole plan: each sequence's length and ring size, for telemetry
    stats.setdefault("lengths", [int(s) for s in lengths])
    stats.setdefault("cp_degrees", Plan.cp_degrees(plan))
    return StepBatch(
        micro_batches=mbs,
        num_global_tokens=num_global,
        num_tokens=int(sum(int(s) for s in lengths)),
        digest=step_digest(plan, data_identity),
        step=step,
        stats=stats,
        data_identity=data_identity,
    )
