"""The per-rank step loader: one :class:`StepBatch` per step, the same number on every rank.

Every rank walks the same global batches (:mod:`.sampler`), plans each one with the same
planner options and seed (so every rank computes the same plan and digest, without a central
server), and packs only its own micro-batches with
:func:`lightning_bytescale.engine.micro_batch.build_step`.  Planning and packing run in the
loader's worker processes (``num_workers >= 1``), so the next step's plan and tensors are
ready while the current step trains; ``num_workers=0`` does the same work inline.

The loader is a torchdata :class:`StatefulDataLoader` (``batch_size=None``: the sampler's keys
go straight to the dataset), so Lightning saves and restores it with the fit loop.  Its state
is the *consumed* position (epoch, next step) of the sampler, not torchdata's worker
snapshot: a position is valid for any number of workers and any world size, and the same
global batches follow after a resume (re-planned for the new world size).  Steps that workers
prepared ahead but that were not yet handed out are not counted.  (Lightning's fit loop does
not fetch ahead of training for loaders with a length, so the consumed position is the
trained position.)

**A refined cost model** (``cost_schedule``, docs/cost-model.md "Refinement during training"):
the training loader plans its ``i``-th step of the run (``stats["plan_index"]``, counted over
epochs) with the model the rank's refit published for it in the schedule file at
``cost_schedule``, waiting in a worker until the refit has seen step ``i - lag``; the file is
the one channel from the training process to its workers, which plan ahead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import xxhash
from torch.utils.data import Dataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_bytescale.data.errors import DataError
from lightning_bytescale.data.policy import Samples
from lightning_bytescale.data.sampler import GlobalBatching, TokenBudgetBatchSampler
from lightning_bytescale.data.store import TokenStore
from lightning_bytescale.engine.batch import StepBatch
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.parallel.pipeline_batch import PipelineStepBatch, build_pipeline_step
from lightning_bytescale.planner.cost_features import plan_work_rows
from lightning_bytescale.planner.cost_refit import wait_for_model
from lightning_bytescale.planner.planners import make_plan
from lightning_bytescale.proc import LoaderWorkerInit


def plan_seed(seed: int, epoch: int, step: int) -> int:
    """The planner's seed for one step: the same on every rank, different per step."""
    return int(np.random.SeedSequence([seed, epoch, step]).generate_state(1)[0])


def _make_plan(lengths: tuple[int, ...], world_size: int, seed: int, options: dict):
    """One step's plan; ``make_plan`` checks the options (``PlannerConfig``)."""
    return make_plan(lengths, world_size=world_size, seed=seed, **options)


@dataclass
class StepDataset(Dataset):
    """Map-style: ``(epoch, step)`` -> this rank's :class:`StepBatch` of that global batch."""

    store: TokenStore
    samples: Samples
    batching: GlobalBatching
    rank: int
    world_size: int
    plan_options: dict = field(default_factory=dict)  # make_plan keyword arguments
    seed: int = 0
    validate_plans: bool = True
    split: str = "train"  # tagged into every batch's stats
    # tensor parallelism: ``rank``/``world_size`` are the HDP rank and count, and ring peers are
    # these global ranks (this TP lane's, one per HDP rank: ParallelMesh.ring_ranks)
    ring_ranks: tuple[int, ...] | None = None
    # pipelines: every HDP rank is a pipeline of this many stages, and each item is its PipelineStepBatch
    # (every stage and lane of the pipeline builds the same one: docs/pipelines.md)
    pipeline_stages: int = 1
    # the refined cost model: the schedule file of this rank's refit (None: plan_options' model)
    cost_schedule: str | None = None
    # every rank's micro-batches' cost features in stats["cost_work"] (the refit's and the telemetry's)
    record_work: bool = False
    schedule_timeout_s: float = 600.0  # how long a worker waits for a step's model
    _identity: str | None = field(default=None, init=False, repr=False)
    _epoch_offsets: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.ring_ranks is not None:
            self.ring_ranks = tuple(int(r) for r in self.ring_ranks)
            if len(self.ring_ranks) != self.world_size:
                raise DataError(
                    f"ring_ranks names {len(self.ring_ranks)} global ranks for {self.world_size} HDP ranks; give "
                    "one per HDP rank (ParallelMesh.ring_ranks)"
                )
        self.plan_options = {k: v for k, v in self.plan_options.items() if v is not None}

    def sample_ids(self, epoch: int, step: int) -> np.ndarray:
        return self.batching.batches(epoch)[step]

    def tokens(self, sample: int) -> np.ndarray:
        s = self.samples
        return self.store.read(int(s.doc[sample]), int(s.start[sample]), int(s.length[sample]))

    def loss_mask(self, sample: int) -> np.ndarray:
        """The sample's loss mask (loss-masked stores only)."""
        s = self.samples
        return self.store.read_mask(int(s.doc[sample]), int(s.start[sample]), int(s.length[sample]))

    @property
    def masked(self) -> bool:
        return self.samples.loss_tokens is not None

    def data_identity(self, ids: np.ndarray) -> str:
        """What this step reads, by content: the store's content hash, the sample table, the batch.

        Every rank of a run must compute the same string (it is folded into the step digest
        the strategy compares before any exchange); it names no path, so identical stores in
        different folders or on different nodes agree.
        """
        if self._identity is None:
            h = xxhash.xxh3_64()
            extra = () if self.samples.loss_tokens is None else (self.samples.loss_tokens,)
            for a in (self.samples.doc, self.samples.start, self.samples.length, *extra):
                h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
            self._identity = f"store {self.store.content_hash[:16]}, samples {h.hexdigest()}"
        batch = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        return f"{self._identity}, batch {batch}"

    def plan_index(self, epoch: int, step: int) -> int:
        """The step's position in the run, counted over epochs (what the cost schedule is keyed by)."""
        if epoch not in self._epoch_offsets:
            self._epoch_offsets[epoch] = sum(self.batching.num_steps(e) for e in range(epoch))
        return self._epoch_offsets[epoch] + step

    def plan_options_for(self, epoch: int, step: int) -> dict:
        """``plan_options`` with the cost model the schedule gives this step (waiting for it in a
        worker; inline, the training process publishes it before it asks)."""
        if self.cost_schedule is None:
            return self.plan_options
        timeout = self.schedule_timeout_s if get_worker_info() is not None else 0.0
        cost = wait_for_model(self.cost_schedule, self.plan_index(epoch, step), timeout_s=timeout)
        return {**self.plan_options, "cost_model": cost}

    def plan(self, epoch: int, step: int):
        ids = self.sample_ids(epoch, step)
        lengths = tuple(int(n) for n in self.samples.length[ids])
        options = self.plan_options_for(epoch, step)
        plan = _make_plan(lengths, self.world_size, plan_seed(self.seed, epoch, step), options)
        if self.validate_plans and callable(getattr(plan, "validate", None)):
            plan.validate()
        return plan

    def __getitem__(self, key: tuple[int, int]) -> StepBatch | PipelineStepBatch:
        epoch, step = key
        ids = self.sample_ids(epoch, step)
        t0 = time.perf_counter()
        plan = self.plan(epoch, step)
        plan_ms = (time.perf_counter() - t0) * 1e3
        masked = self.masked
        build_options = dict(
            step=step,
            data_identity=self.data_identity(ids),
            loss_mask=(lambda j: self.loss_mask(int(ids[j]))) if masked else None,
            loss_tokens=self.samples.loss_tokens[ids].tolist() if masked else None,
            ring_ranks=self.ring_ranks,
        )
        tokens = lambda j: self.tokens(int(ids[j]))  # noqa: E731
        if self.pipeline_stages > 1:
            pipeline = build_pipeline_step(
                plan, self.rank, tokens, stages=self.pipeline_stages, **build_options
            )
            self._add_stats(pipeline.step, epoch, plan_ms, plan)
            return pipeline
        batch = build_step(plan, self.rank, tokens, **build_options)
        self._add_stats(batch, epoch, plan_ms, plan)
        return batch

    def _add_stats(self, batch: StepBatch, epoch: int, plan_ms: float, plan) -> None:
        stats = dict(batch.stats)
        stats.update(epoch=epoch, split=self.split, plan_ms=plan_ms, loss_tokens=batch.num_global_tokens)
        stats["plan_index"] = self.plan_index(epoch, batch.step)
        if self.record_work:
            stats["cost_work"] = plan_work_rows(plan)
        batch.stats = stats

    def __len__(self) -> int:
        return self.batching.num_steps(0)


def _identity(x):
    return x


class StepLoader(StatefulDataLoader):
    """Yields this rank's :class:`StepBatch` for each step; ``len`` is the steps of the epoch."""

    def __init__(
        self,
        dataset: StepDataset,
        sampler: TokenBudgetBatchSampler,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        timeout: float = 0,
        multiprocessing_context=None,
        **kwargs,
    ) -> None:
        sampler.track_yields = False
        self.restart_each_iter = False  # validation: every pass starts at step 0
        kwargs.pop("batch_size", None)
        kwargs.pop("collate_fn", None)
        # workers ignore SIGTERM (the rank saves first) and die with their rank
        kwargs["worker_init_fn"] = LoaderWorkerInit.wrap(kwargs.get("worker_init_fn"))
        super().__init__(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=num_workers,
            collate_fn=_identity,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            timeout=timeout,
            multiprocessing_context=multiprocessing_context,
            **kwargs,
        )

    def __iter__(self) -> Iterator[StepBatch]:
        sampler: TokenBudgetBatchSampler = self.sampler  # type: ignore[assignment]
        if self.restart_each_iter:
            sampler.epoch, sampler.step = 0, 0
        epoch = sampler.epoch
        batches = super().__iter__()
        try:
            for batch in batches:
                step = batch.step_batch.step  # a pipeline's batch holds its StepBatch
                sampler.mark_consumed(epoch, step)
                yield batch
        except BaseException:
            # a failed step (bad data in a worker) or an abandoned pass: stop the workers now,
            # not when the iterator is collected (a traceback keeps it alive)
            shutdown = getattr(batches, "_shutdown_workers", None)
            if callable(shutdown) and not self.persistent_workers:
                shutdown()
            raise

    def state_dict(self) -> dict:
        """``{"epoch", "step", "batching"}``: the next step to train on and what it belongs to."""
        return self.sampler.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state_dict: dict) -> None:
        self.sampler.load_state_dict(state_dict)  # type: ignore[attr-defined]


class PredictSteps:
    """A :class:`StepLoader` that ``trainer.predict`` iterates as it is.

    Lightning re-creates any ``DataLoader`` it predicts over, with a sampler that tracks sample
    indices; a step loader's sampler is the token-budgeted plan of global batches, which must
    stay.  This wrapper is not a ``DataLoader``, so Lightning leaves it alone; ``mb.seq_ids``
    say which sequences each micro-batch's outputs belong to.
    """

    def __init__(self, loader: StepLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[StepBatch]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)
