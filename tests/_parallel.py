"""Helpers for the data-parallel x tensor-parallel (and FSDP2) tests: data, references, a call log.

The reference is always one process on whole sequences: the same initial weights, plain causal
attention (:func:`lightning_bytescale.engine.reference.causal_attention`), the loss summed over
all sequences' tokens and divided by their count, ``torch.nn.utils.clip_grad_norm_`` and AdamW.
Nothing here touches the code under test except to run it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

VOCAB = 64


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective on the DTensor's mesh: call on every rank in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def global_batch(
    step: int, lengths_range: tuple[int, int], count: int, long: Sequence[int] = ()
) -> list[torch.Tensor]:
    """``count`` random sequences plus the ``long`` lengths (rings), tokens in ``[0, VOCAB)``."""
    g = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(*lengths_range, (count,), generator=g).tolist() + list(long)
    return [torch.randint(0, VOCAB, (int(s),), generator=g) for s in lengths]


def reference_and_model(config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A float64 Llama with plain causal attention (the reference) and one with the packed attention, same weights."""
    from lightning_bytescale.engine.reference import causal_attention
    from lightning_bytescale.models import LlamaModel

    torch.manual_seed(0)
    ref = LlamaModel(config, attention_fn=causal_attention).double()
    torch.manual_seed(0)
    return ref, LlamaModel(config).double()


def reference_step(
    ref: torch.nn.Module, opt: torch.optim.Optimizer, seqs: Sequence[torch.Tensor], max_norm: float
):
    """One single-process step: ``(loss, gradient norm, {name: gradient}, both before clipping)``."""
    from lightning_bytescale.engine.reference import reference_loss

    opt.zero_grad(set_to_none=True)
    loss = reference_loss(ref, seqs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    opt.step()
    return float(loss), float(norm), grads


def param_diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest difference between the (gathered) parameters of ``model`` and ``ref``, by name."""
    refs = dict(ref.named_parameters())
    return max((full(p.detach()) - refs[n]).abs().max().item() for n, p in model.named_parameters())


def grad_diff(model: torch.nn.Module, ref: torch.nn.Module | dict[str, torch.Tensor]) -> float:
    """Largest difference between the (gathered) gradients of ``model`` and ``ref``'s (or the given ones)."""
    refs = ref if isinstance(ref, dict) else {n: p.grad for n, p in ref.named_parameters()}
    return max((full(p.grad) - refs[n]).abs().max().item() for n, p in model.named_parameters())


def process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


class CallLog:
    """This rank's torch.distributed calls in order: ``(name, ranks of the group, P2P peers)``.

    Wraps the named functions on ``dist`` (for the rest of the process).  ``mark(label)`` adds
    a separator, so a test can cut the log into steps.
    """

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "batch_isend_irecv",
        "broadcast",
        "new_group",
        "new_subgroups",
        "split_group",
    )

    def __init__(self, names: Iterable[str] = NAMES) -> None:
        self.events: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            peers: tuple[int, ...] = ()
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                peers = tuple(int(op.peer) for op in ops)
                group = ops[0].group if ops else None
            ranks: tuple[int, ...] = ()
            if name not in ("new_group", "new_subgroups", "split_group"):
                try:
                    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
                except Exception:  # a group this rank is not in
                    ranks = ()
            self.events.append((name, ranks, peers))
            return original(*args, **kwargs)

        return wrapped

    def groups_created(self) -> int:
        """How many process groups this rank asked for (``new_group``, ``new_subgroups``, ``split_group``)."""
        return sum(1 for e in self.events if e[0] in ("new_group", "new_subgroups", "split_group"))

    def mark(self, label: str) -> None:
        self.events.append(("mark:" + label, (), ()))

    def since(self, label: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """Events after the last ``mark(label)``."""
        for i in range(len(self.events) - 1, -1, -1):
            if self.events[i][0] == "mark:" + label:
                return self.events[i + 1 :]
        raise KeyError(label)


def shard_with_fsdp(model: torch.nn.Module, pmesh: Any):
    """``fully_shard`` every block, then the root, over the data-parallel mesh; the step driver."""
    from torch.distributed.fsdp import fully_shard

    from lightning_bytescale.parallel import FSDPStepDriver

    for block in model.blocks:
        fully_shard(block, mesh=pmesh.dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=pmesh.dp_mesh, reshard_after_forward=False)
    return FSDPStepDriver(model, pmesh.dp_group)


def train_against_reference(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    pmesh: Any,
    *,
    steps: int,
    batch: Callable[[int], list[torch.Tensor]],
    plan: Callable[[int, list[torch.Tensor]], Any],
    max_norm: float,
    lr: float,
    driver: Any = None,
    log: CallLog | None = None,
) -> dict:
    """``steps`` AdamW steps with clipping of ``model`` (run_parallel_step) and of ``ref`` (one process).

    Per step: the gradient difference before clipping, the parameter difference after the step,
    the loss and norm differences, the reference norm, the plan's micro-batch counts, the number
    of ring micro-batches of this rank and (with ``log``) its distributed calls.
    """
    from lightning_bytescale.engine import build_step
    from lightning_bytescale.parallel import clip_grad_norm_, run_parallel_step

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    keys = ("param_diff", "grad_diff", "loss_diff", "norm_diff", "norms", "counts", "steps")
    out: dict = {k: [] for k in keys}
    for s in range(steps):
        seqs = batch(s)
        loss_ref, norm_ref, grads_ref = reference_step(ref, opt_ref, seqs, max_norm)
        p = plan(s, seqs)
        step = build_step(
            p, pmesh.hdp_rank, lambda j, seqs=seqs: seqs[j], step=s, ring_ranks=pmesh.ring_ranks
        )
        opt.zero_grad(set_to_none=True)
        if log is not None:
            log.mark(f"step{s}")
        result = run_parallel_step(model, step, pmesh, fsdp=driver)
        events = log.since(f"step{s}") if log is not None else []
        out["grad_diff"].append(grad_diff(model, grads_ref))  # before clipping: clipping hides a scale
        norm = float(clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        out["param_diff"].append(param_diff(model, ref))
        out["loss_diff"].append(abs(result.loss - loss_ref))
        out["norm_diff"].append(abs(norm - norm_ref))
        out["norms"].append(norm_ref)
        out["counts"].append([len(r) for r in p.ranks])
        rings = [mb.layout for mb in step.micro_batches if mb.layout.ring is not None]
        out["steps"].append(
            {"rings": len(rings), "modes": sorted({lay.mode for lay in rings}), "events": events}
        )
    return out


def greedy_micro_batches(seqs: Sequence[int], lengths: Sequence[int], capacity: int) -> list:
    """Whole sequences ``seqs`` packed in order into micro-batches of at most ``capacity`` tokens."""
    from lightning_bytescale.planner.plan import MicroBatch, Piece

    out: list[list[int]] = []
    for j in seqs:
        if not out or sum(lengths[k] for k in out[-1]) + lengths[j] > capacity:
            out.append([])
        out[-1].append(j)
    return [MicroBatch([Piece(j, ((0, lengths[j]),)) for j in mb]) for mb in out]


def pipeline_batch(
    plan: Any, pmesh: Any, seqs: Sequence[torch.Tensor], step: int, min_micro_batches: int = 0
):
    """This rank's pipeline's ``PipelineStepBatch`` of ``plan`` over ``seqs``, with its stage's ring ranks."""
    from lightning_bytescale.parallel import build_pipeline_step

    return build_pipeline_step(
        plan,
        pmesh.hdp_rank,
        lambda j: seqs[j],
        stages=pmesh.dims.pipeline,
        step=step,
        min_micro_batches=min_micro_batches,
        ring_ranks=pmesh.ring_ranks,
    )


def recorded_pipeline_step(stage: torch.nn.Module, batch: Any, pmesh: Any) -> tuple[Any, str | None]:
    """``run_pipeline_step`` and the name of the schedule it built (``None``: none)."""
    from lightning_bytescale.parallel import run_pipeline_step

    seen: list[str | None] = []
    result = run_pipeline_step(
        stage, batch, pmesh, on_schedule=lambda sch: seen.append(None if sch is None else type(sch).__name__)
    )
    return result, seen[0]


def pipeline_step_against(
    stage: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: Any,
    pmesh: Any,
    ref: torch.nn.Module,
    grads_ref: dict[str, torch.Tensor],
    loss_ref: float,
    out: dict[str, list],
) -> Any:
    """One pipeline step of ``stage`` and its optimizer step, recorded in ``out`` against the reference's step.

    Appends the largest gradient (before the step), parameter (after it) and loss differences,
    the pipelines' counts, the schedule, the padding micro-batches and the ring micro-batches.
    """
    opt.zero_grad(set_to_none=True)
    result, schedule = recorded_pipeline_step(stage, batch, pmesh)
    out["grad_diff"].append(grad_diff(stage, grads_ref))
    opt.step()
    out["param_diff"].append(param_diff(stage, ref))
    out["loss_diff"].append(abs(result.loss - loss_ref))
    out["counts"].append(batch.counts)
    out["schedules"].append(schedule)
    out["padding"].append(batch.padding)
    out["rings"].append(sum(mb.layout.ring is not None for mb in batch.micro_batches))
    out.setdefault("modes", []).append(
        sorted({mb.layout.mode for mb in batch.micro_batches if mb.layout.ring})
    )
    return result
