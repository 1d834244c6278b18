"""The token-budgeted global batch sampler.

Global batches are made from a per-epoch shuffle of the samples (deterministic from ``seed``
and the epoch), cut by a token budget, ``tokens_per_step``, as the paper does (it fixes tokens
per step, not sequences per step).  Every rank computes the same batches; nothing depends on
the world size, so a run resumed on a different number of ranks sees the same global batches.

Two ways to cut the shuffled stream (``budget_mode``):

* ``"window"`` (default): step ``b`` takes the samples whose first token falls in tokens
  ``[b * B, (b + 1) * B)`` of the stream (the last step also takes the few samples that start
  after its window).  An epoch has ``(total_tokens - longest_sample) // B + 1`` steps, the
  same in every epoch (Lightning reads the loader length once, so this keeps epochs whole);
  every step holds fewer than ``B + longest_sample`` tokens, and ``B`` on average.
* ``"strict"``: fill each step until the next sample would exceed ``B``; no step holds more
  than ``B`` tokens, but the number of steps can differ by a few between epochs.

The sampler yields ``(epoch, step)`` keys; the step dataset turns a key into this rank's
:class:`~lightning_bytescale.engine.batch.StepBatch`.  Its state is ``(epoch, step)``, the
next step to train on, plus a fingerprint of the batching so a position is never applied to
different data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import DistributedSampler, SequentialSampler

from lightning_bytescale.data.errors import DataError, ResumeMismatchError

BUDGET_MODES = ("window", "strict")


@dataclass
class GlobalBatching:
    """Deterministic global batches of sample ids, per epoch."""

    lengths: np.ndarray  # sample lengths
    tokens_per_step: int
    seed: int = 0
    shuffle: bool = True
    budget_mode: str = "window"
    drop_last: bool = False  # drop the epoch's final, partly filled step
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        if self.budget_mode not in BUDGET_MODES:
            raise DataError(f"budget_mode={self.budget_mode!r}; use one of {BUDGET_MODES}")
        if self.lengths.size == 0:
            raise DataError(
                "no samples to batch: the source is empty or every document was dropped; check the source and the long_document_policy / empty_sample_policy / min_tokens settings"
            )
        longest = int(self.lengths.max())
        if self.tokens_per_step < longest:
            raise DataError(
                f"tokens_per_step={self.tokens_per_step} is smaller than the longest sample "
                f"({longest} tokens); raise tokens_per_step to at least the context length"
            )

    @property
    def fingerprint(self) -> dict:
        digest = hashlib.sha256(self.lengths.tobytes()).hexdigest()[:16]
        return {
            "samples": int(self.lengths.size),
            "tokens": int(self.lengths.sum()),
            "lengths_sha": digest,
            "tokens_per_step": int(self.tokens_per_step),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "budget_mode": self.budget_mode,
            "drop_last": bool(self.drop_last),
        }

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.lengths.size, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.lengths.size)

    def batches(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._cache:
            self._cache.clear()  # one epoch at a time is enough
            self._cache[epoch] = self._cut(self.order(epoch))
        return self._cache[epoch]

    def _cut(self, order: np.ndarray) -> list[np.ndarray]:
        lens, budget = self.lengths[order], self.tokens_per_step
        if self.budget_mode == "window":
            starts = np.cumsum(lens) - lens
            steps = self.window_steps()
            cuts = np.flatnonzero(np.diff(np.minimum(starts // budget, steps - 1))) + 1
        else:
            cuts, total = [], 0
            for i, n in enumerate(lens.tolist()):
                if total + n > budget:
                    cuts.append(i)
                    total = 0
                total += n
        out = np.split(order, cuts)
        if self.drop_last and len(out) > 1 and int(self.lengths[out[-1]].sum()) < budget:
            out.pop()
        return out

    def window_steps(self) -> int:
        """Steps per epoch in window mode: ``(total - longest) // B + 1``, for every order.

        The last sample of any order starts at or after ``total - longest``, and starts are at
        most one sample (at most ``B`` tokens) apart, so each of these windows holds a start;
        samples starting beyond the last window join the last step.
        """
        return (int(self.lengths.sum()) - int(self.lengths.max())) // self.tokens_per_step + 1

    def num_steps(self, epoch: int) -> int:
        return len(self.batches(epoch))


class TokenBudgetBatchSampler(DistributedSampler):
    """Yields ``(epoch, step)`` keys of global batches, from the resume position on.

    A :class:`DistributedSampler` subclass only so that Lightning sees an already distributed
    sampler and leaves the loader alone: every rank yields the *same* keys (the global
    batches), and the step dataset picks this rank's share through the plan.

    Position: ``epoch`` and ``step`` (the next step to train on).  Iterating the sampler on its
    own advances it as it yields; the step loader instead advances it as batches are consumed
    (``track_yields = False``), so prefetched steps are not skipped on resume.  Finishing an
    epoch moves to the next one; :meth:`set_epoch` with a *different* epoch restarts at its step 0.
    """

    def __init__(self, batching: GlobalBatching, num_replicas: int = 1, rank: int = 0) -> None:
        # DistributedSampler.__init__ would query torch.distributed; set its attributes here.
        self.batching = batching
        self.num_replicas, self.rank = num_replicas, rank
        self.seed, self.shuffle, self.drop_last = batching.seed, batching.shuffle, batching.drop_last
        self.epoch, self.step = 0, 0
        self.track_yields = True

    def __len__(self) -> int:
        return self.batching.num_steps(self.epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, start = self.epoch, self.step
        for s in range(start, self.batching.num_steps(epoch)):
            if self.track_yields:
                self.mark_consumed(epoch, s)
            yield (epoch, s)

    def mark_consumed(self, epoch: int, step: int) -> None:
        if step + 1 >= self.batching.num_steps(epoch):
            self.epoch, self.step = epoch + 1, 0
        else:
            self.epoch, self.step = epoch, step + 1

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "batching": self.batching.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        saved, now = state.get("batching", {}), self.batching.fingerprint
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if diff:
            what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            hint = ""
            if "lengths_sha" in diff:
                hint = (
                    " The samples differ: a changed source, policy or context_length (its default, "
                    "the pool world_size x capacity, changes with the world size: set it explicitly "
                    "to resume on another number of ranks)."
                )
            raise ResumeMismatchError(
                f"the saved data position belongs to different global batches ({what}); resume with "
                f"the same data, policies, context length, tokens_per_step and seed, or start a new "
                f"run.{hint}"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        if not 0 <= step < max(1, self.batching.num_steps(epoch)):
            raise ResumeMismatchError(f"saved step {step} is outside epoch {epoch}")
        self.epoch, self.step = epoch, step


class OrderedTokenBudgetBatchSampler(TokenBudgetBatchSampler, SequentialSampler):
    """A :class:`TokenBudgetBatchSampler` over unshuffled batching: the same global batches, in order, every epoch.

    It is also a ``SequentialSampler``, because that is how Lightning recognises a loader that
    does not shuffle: ``Trainer(overfit_batches=...)`` re-creates any other loader with an index
    sampler, which a step loader (keyed by ``(epoch, step)``) cannot take.
    """


def token_budget_sampler(
    batching: GlobalBatching, num_replicas: int = 1, rank: int = 0
) -> TokenBudgetBatchSampler:
    """The sampler for ``batching``: :class:`OrderedTokenBudgetBatchSampler` when it does not shuffle."""
    cls = TokenBudgetBatchSampler if batching.shuffle else OrderedTokenBudgetBatchSampler
    return cls(batching, num_replicas, rank)
