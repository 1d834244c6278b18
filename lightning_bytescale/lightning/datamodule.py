"""`ByteScaleDataModule`: documents in, one packed `StepBatch` per rank per step out.

Flow: a source (text files, JSONL, synthetic ``github``/``byted``, Hugging Face) is tokenized
once into a memory-mapped token store (``prepare_data``, local rank 0 of each node); every rank
opens the store, applies the empty-sample and long-document policies to the length index,
cuts the token-budgeted global batches, and loads only its own share of each step's plan
(``setup`` and the dataloaders).  See ``docs/data.md``.

Planner options (one :class:`~lightning_bytescale.planner.config.PlannerConfig`) come from the
strategy's ``planner_config`` when it has one (so the loader plans exactly what the strategy
runs), else from this module's arguments; an argument given here that the strategy's config
contradicts is refused (:class:`~lightning_bytescale.errors.PlannerOptionsConflictError`), not
silently ignored.  The rank and world
size come from the trainer, or from ``rank=`` / ``world_size=`` for standalone use.

Data identity: the store folder is named after the content of the source (not file sizes and
times), builds are locked and atomic, and every step's digest carries the store's content hash
(``StepBatch.data_identity``), so ranks that read different data stop at the strategy's digest
check instead of training on it.

Chat data (a ``{"kind": "chat", ...}`` source): records are rendered with the tokenizer's chat
template and stored with a loss mask (``loss_on``); labels of untrained tokens are -100 and
``num_global_tokens`` counts trained tokens only.  Conversations are never split.  Before the
first step the store's largest token id is checked against the model's vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from enum import Enum
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
from filelock import Timeout
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_bytescale.data.errors import (
    ContextLengthError,
    DataError,
    OutOfVocabularyError,
    StoreNotFoundError,
)
from lightning_bytescale.data.loader import PredictSteps, StepDataset, StepLoader
from lightning_bytescale.data.policy import Samples, drop_untrained, make_samples
from lightning_bytescale.data.prune import STORE_PREFIX, default_cache_dir, prune_cache
from lightning_bytescale.data.sampler import GlobalBatching, token_budget_sampler
from lightning_bytescale.data.source_spec import make_source, with_source_options
from lightning_bytescale.data.sources import (
    FileSourceMixin,
    FileStamp,
    Source,
    changed_files,
)
from lightning_bytescale.data.store import (
    LAST_USED_FILE,
    VERIFY_MODES,
    VERSION,
    TokenStore,
    is_complete,
    read_meta,
    store_lock,
    write_store,
)
from lightning_bytescale.data.tokenizer import Tokenizer, load_tokenizer
from lightning_bytescale.errors import PlannerOptionsConflictError
from lightning_bytescale.parallel.layout import LoaderView
from lightning_bytescale.planner.config import PlannerConfig
from lightning_bytescale.planner.cost_model import CostModel
from lightning_bytescale.planner.errors import PlanError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")

#: The data module's own capacity when neither it nor a ``planner_config`` gives one.
DEFAULT_CAPACITY = 4096


def _plain(value: Any) -> Any:
    """An Enum option (as Hydra structured configs pass them) as its plain value."""
    return value.value if isinstance(value, Enum) else value


class _validation_loader:  # noqa: N801 (used as a decorator)
    """``ByteScaleDataModule.val_dataloader`` as a Trainer sees it.

    Without a validation split (``val_fraction=0``) and under a LightningModule that has no
    ``validation_step``, Lightning is shown the base class's method (not overridden), so it
    neither looks for validation data nor warns that there is a ``val_dataloader`` but no
    ``validation_step`` (there is no validation data to skip).  With a split, or a module that
    validates, the method is the module's own: Lightning's warning then says something true.
    """

    def __init__(self, method: Any) -> None:
        self.method = method
        self.__doc__ = method.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is not None and obj.val_fraction <= 0 and not _validates(obj._trainer_or_none()):
            return pl.LightningDataModule.val_dataloader.__get__(obj, owner)
        return self.method.__get__(obj, owner)


def _validates(trainer: Any) -> bool:
    """Whether the trainer's LightningModule (if any) has a ``validation_step``; True when unknown."""
    module = getattr(getattr(trainer, "strategy", None), "lightning_module", None)
    return module is None or is_overridden("validation_step", module)


class ByteScaleDataModule(pl.LightningDataModule):
    """Token store, token-budgeted global batches and per-rank step loaders.

    Args:
        source: where documents come from: ``None`` (Python's stdlib ``*.py`` files), a folder
            or glob of text files, a ``.jsonl`` path or glob, ``"github"`` / ``"byted"``
            (synthetic), ``"hf:<name>"``, a dict ``{"kind": ..., **options}`` or a source object.
        pattern: which files of a folder source are read (default ``"*.py"``; e.g. ``"*.md"``,
            ``"*"``), searched recursively.  Hydra: ``data.pattern``.
        field: the key (JSONL) or column (Hugging Face dataset) that holds each document's text
            (default ``"text"``; ``"messages"`` for chat data).  Hydra: ``data.field``.
        tokenizer: ``None`` / ``"byte"`` (bytes + an end-of-document token, vocabulary 257), the
            path of a ``tokenizers`` JSON file, or a tokenizer folder (``AutoTokenizer``; a
            model's folder works).
        loss_on: which tokens are trained: ``"assistant"`` (chat data's default),
            ``"completion"`` or ``"all"`` (text data's only choice).  See :mod:`.chat_encoder`.
        chat_template: the chat template for chat data: ``None`` (the tokenizer's own), a
            built-in name (``"chatml"``), a ``.jinja`` file or the template text.
        tokenize_workers: processes that tokenize while the store is built (``None``: one per
            core for chat data, whose templates render in Python; 1 for text, which the
            tokenizer already encodes on every core).
        progress: a progress bar while the store is built (``None``: on a terminal).
        cache_dir: folder for token stores (default ``$BYTESCALE_DATA_CACHE`` or
            ``~/.cache/lightning_bytescale/data``); one sub-folder per source and tokenizer.
        rebuild: rebuild the token store in ``prepare_data`` even if one exists (the fix for a
            damaged store; processes that asked together share one rebuild).
        verify_store: check ``tokens.bin`` against its block checksums ``lazy`` (default: each
            block when first read), ``full`` (all at ``setup``) or ``none``.
        model_vocab_size: the model's vocabulary size (rows of its input embedding), when known
            beforehand; otherwise it is read from the trainer's LightningModule (a
            ``vocab_size`` attribute, or a Hugging Face model's input embeddings) when the
            loaders are made.  A stored id at or above it fails before the first step, naming
            both sizes, the store and the document.  (``vocab_size=``: the same, older name.)
            ``dm.vocab_size`` is the tokenizer's vocabulary, what a model built for the data
            needs.
        prune_stale: after ``prepare_data``, remove this cache's stores of older versions of
            this source (and leftovers of killed builds).  Not while another job reads them.
        context_length: the longest sample; longer documents follow ``long_document_policy``.
            ``None``: the pool, ``world_size * capacity``.  It is capped at the pool in any case.
        long_document_policy: ``split`` | ``truncate`` | ``drop`` | ``error``; ``None``
            (default): ``split`` for text, ``drop`` for chat data (conversations are never split:
            ``split`` is refused for them; dropped ones are counted and logged).
        empty_sample_policy: ``drop`` (default) | ``error``, for documents below ``min_tokens``.
        min_tokens: the shortest usable sample (default 2: one token has nothing to predict).
        tokens_per_step: the global batch's token budget.
        budget_mode: ``window`` (default, equal steps per epoch) | ``strict`` (never above budget).
        seed: shuffling and planning seed (identical on every rank).
        shuffle: shuffle samples every epoch.
        drop_last: drop each epoch's final, partly filled step.
        planner_config: the :class:`~lightning_bytescale.planner.config.PlannerConfig` to plan
            with when the strategy has none (default: ``PlannerConfig(capacity=4096)``).
        planner, capacity, cp_size, offload, slack, cost_model, comm_aware, ranks_per_node:
            ``PlannerConfig`` fields replacing those of ``planner_config`` (``None``: keep its
            value).  ``cost_model`` may also be the path of a profiler file.
        planner_options: more ``PlannerConfig`` options by name (``num_buckets``, a planner's
            own options such as ``pp_reading``); an unknown name fails naming the closest one.
        val_fraction: fraction of documents held out for validation (0: no validation loader).
        test_fraction: fraction of documents held out for ``trainer.test`` (0: the test loader
            is the validation split).  The validation split does not change when it is added.
        predict_split: what ``trainer.predict`` reads, in order: ``"train"``, ``"val"`` or
            ``"test"``; ``None``: the test split, else the validation split, else all training data.
        num_workers: loader worker processes that plan and pack the next steps (0: inline).
        prefetch_factor: steps each worker prepares ahead (default 2).
        persistent_workers: keep the loader workers between epochs and validation passes (default:
            starting a worker process costs seconds, which short epochs would pay again and again).
        rank, world_size: this process's rank and the world size, for use without a trainer.
        validate_plans: run ``Plan.validate()`` on every plan.
    """

    def __init__(
        self,
        source: str | dict | Source | None = None,
        tokenizer: str | Path | Tokenizer | None = None,
        cache_dir: str | Path | None = None,
        rebuild: bool = False,
        verify_store: str = "lazy",
        vocab_size: int | None = None,
        prune_stale: bool = False,
        context_length: int | None = None,
        long_document_policy: str | None = None,
        empty_sample_policy: str = "drop",
        min_tokens: int = 2,
        tokens_per_step: int = 32768,
        budget_mode: str = "window",
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        planner: str | None = None,
        capacity: int | None = None,
        cp_size: int | None = None,
        offload: Any = None,
        slack: float | None = None,
        cost_model: Any = None,
        comm_aware: bool | None = None,
        ranks_per_node: int | None = None,
        planner_options: dict | None = None,
        planner_config: PlannerConfig | None = None,
        val_fraction: float = 0.0,
        num_workers: int = 1,
        prefetch_factor: int | None = None,
        persistent_workers: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        validate_plans: bool = True,
        loss_on: str | None = None,
        chat_template: str | None = None,
        model_vocab_size: int | None = None,
        tokenize_workers: int | None = None,
        progress: bool | None = None,
        pattern: str | None = None,
        field: str | None = None,
        test_fraction: float = 0.0,
        predict_split: str | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
        if not 0.0 <= test_fraction < 1.0:
            raise DataError(f"test_fraction={test_fraction} must be in [0, 1)")
        if val_fraction + test_fraction >= 1.0:
            raise DataError(
                f"val_fraction={val_fraction} + test_fraction={test_fraction} leave no training documents; "
                f"keep their sum below 1"
            )
        if predict_split is not None and predict_split not in SPLITS:
            raise DataError(
                f"predict_split={predict_split!r}; use one of {SPLITS} (or None: the test split, else the validation split, else the training data)"
            )
        if tokens_per_step < 1:
            raise DataError(f"tokens_per_step={tokens_per_step} must be positive")
        if num_workers < 0:
            raise DataError(f"num_workers={num_workers} must be >= 0")
        if verify_store not in VERIFY_MODES:
            raise DataError(f"verify_store={verify_store!r}; use one of {VERIFY_MODES}")
        if vocab_size is not None and model_vocab_size is not None and vocab_size != model_vocab_size:
            raise DataError(
                f"vocab_size={vocab_size} and model_vocab_size={model_vocab_size} disagree; they are the same "
                f"setting (the model's vocabulary), give one"
            )
        model_vocab_size = model_vocab_size if model_vocab_size is not None else vocab_size
        if model_vocab_size is not None and model_vocab_size < 1:
            raise DataError(
                f"model_vocab_size={model_vocab_size} must be a positive vocabulary size (or None)"
            )
        if tokenize_workers is not None and tokenize_workers < 1:
            raise DataError(f"tokenize_workers={tokenize_workers} must be at least 1 (or None: automatic)")
        self.source = with_source_options(make_source(source), source, pattern=pattern, field=field)
        self.conversational = bool(getattr(self.source, "conversational", False))
        loss_on = _plain(loss_on)
        if loss_on is None:
            loss_on = "assistant" if self.conversational else "all"
        from lightning_bytescale.data.chat_encoder import LOSS_ON

        if loss_on not in LOSS_ON:
            raise DataError(f"loss_on={loss_on!r}; use one of {LOSS_ON}")
        if not self.conversational and loss_on != "all":
            raise DataError(
                f"loss_on={loss_on!r} needs chat data (messages or prompt/completion records: source="
                f"{{'kind': 'chat', 'path': ...}}); a text source trains every token (loss_on='all')"
            )
        if chat_template is not None and not self.conversational:
            raise DataError(
                "chat_template= is for chat data (source={'kind': 'chat', ...}); this source is text"
            )
        self.loss_on = loss_on
        self.chat_template = chat_template
        self.tokenize_workers = tokenize_workers
        self.progress = progress
        self._tokenizer_spec = tokenizer
        self._tokenizer: Tokenizer | None = None
        self._encoder: Any = None
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.rebuild = rebuild
        self.verify_store = verify_store
        self.model_vocab_size = model_vocab_size
        self.prune_stale = prune_stale
        self.context_length = context_length
        long_document_policy = _plain(long_document_policy)
        if long_document_policy is None:
            long_document_policy = "drop" if self.conversational else "split"
        if self.conversational and long_document_policy == "split":
            raise DataError(
                "long_document_policy='split' would cut conversations apart (a piece without its prompt, an "
                "answer without its question); chat data use 'drop' (the default: counted and logged), "
                "'truncate' or 'error'"
            )
        self.long_document_policy = long_document_policy
        self.empty_sample_policy = _plain(empty_sample_policy)
        self.min_tokens = min_tokens
        self.tokens_per_step = tokens_per_step
        self.budget_mode = _plain(budget_mode)
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        given = dict(
            planner=planner, capacity=capacity, cp_size=cp_size, offload=offload, slack=slack,
            cost_model=cost_model, comm_aware=comm_aware, ranks_per_node=ranks_per_node,
        )  # fmt: skip
        explicit = {**{k: v for k, v in given.items() if v is not None}, **(planner_options or {})}
        self._own_planner_config = _planner_config(planner_config, explicit)
        # what this module was told about planning: refused under a strategy that plans otherwise
        self._given_planner_fields = (
            set(PlannerConfig.__dataclass_fields__) if planner_config is not None else set()
        ) | {k for k in explicit if k in PlannerConfig.__dataclass_fields__}
        self._checked_config: PlannerConfig | None = None
        self._checking_config: PlannerConfig | None = None  # validate()'s stand-in for the strategy's
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.predict_split = predict_split
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = bool(persistent_workers)
        self._rank, self._world_size = rank, world_size
        self.validate_plans = validate_plans
        self.store: TokenStore | None = None
        self.train_samples: Samples | None = None
        self.val_samples: Samples | None = None
        self.test_samples: Samples | None = None
        self.max_length: int | None = None
        self._train_loader: StepLoader | None = None
        self._pending_state: dict | None = None
        self._store_dir: Path | None = None
        self._stamps: list[FileStamp] | None = None  # file sources: the content hashed for store_dir
        self._fingerprint: str | None = None

    # ----------------------------------------------------------------------------------- parts
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_spec)
        return self._tokenizer

    @property
    def encoder(self) -> Any:
        """What tokenizes the source: the tokenizer, or for chat data a :class:`ChatEncoder` around it."""
        if self._encoder is None:
            if self.conversational:
                from lightning_bytescale.data.chat_encoder import ChatEncoder

                self._encoder = ChatEncoder(self.tokenizer, self.loss_on, self.chat_template)
            else:
                self._encoder = self.tokenizer
        return self._encoder

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size: what a model's embedding needs to hold every id."""
        return int(self.tokenizer.vocab_size)

    @property
    def store_dir(self) -> Path:
        """``cache_dir/store-<hash of the source's content and the tokenizer>`` (computed once).

        File sources are hashed by content, so an edit that keeps sizes and modification times
        (``cp -p``, ``rsync -t``, ``tar``) still gets a new store.
        """
        if self._store_dir is None:
            if isinstance(self.source, FileSourceMixin):
                self._stamps = self.source.stamps()
                self._fingerprint = self.source.fingerprint_of(self._stamps)
            else:
                self._fingerprint = self.source.fingerprint
            key = f"v{VERSION}|{self._fingerprint}|{self.encoder.fingerprint}"
            self._store_dir = (
                self.cache_dir / f"{STORE_PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:16]}"
            )
        return self._store_dir

    @property
    def source_key(self) -> str | None:
        """The source's identity without its content (stores of its older versions share it)."""
        key = getattr(self.source, "key", None)
        return None if key is None else f"{key}|{self.encoder.fingerprint}"

    @property
    def data_identity(self) -> str:
        """The opened store by content (after ``setup``), as the step digest carries it."""
        if self.store is None:
            raise DataError("call setup() before asking for the data identity")
        return f"store {self.store.content_hash[:16]}"

    @property
    def rank(self) -> int:
        """This process's HDP rank: the global rank, or under tensor parallelism its TP group's index."""
        if self._rank is not None:
            return self._rank
        return self._trainer_ranks()[0]

    @property
    def world_size(self) -> int:
        """The HDP ranks the planner plans for (under tensor parallelism: the world // tensor_parallel_size)."""
        if self._world_size is not None:
            return self._world_size
        return self._trainer_ranks()[1]

    def _loader_view(self) -> LoaderView:
        """The run's layout as the loader plans with it: the strategy's (``ByteScaleStrategy.loader_view``), else
        plain HDP over the trainer's ranks (another strategy, or before the strategy's mesh is built)."""
        trainer = self._trainer_or_none()
        view = getattr(getattr(trainer, "strategy", None), "loader_view", None)
        if isinstance(view, LoaderView):
            return view
        rank, world = (0, 1) if trainer is None else (int(trainer.global_rank), int(trainer.world_size))
        return LoaderView(
            hdp_rank=rank, hdp_ranks=world, ring_ranks=None, pipeline_stages=1, tensor_parallel=1
        )

    def _trainer_ranks(self) -> tuple[int, int]:
        """``(HDP rank, HDP ranks)`` from the trainer: every TP lane of an HDP rank reads the same share."""
        view = self._loader_view()
        return view.hdp_rank, view.hdp_ranks

    def _trainer_or_none(self):
        return getattr(self, "trainer", None)

    @property
    def _reports_data_warnings(self) -> bool:
        """Whether this process logs the data warnings: the run's global rank 0 under a trainer (HDP
        rank 0 is several processes with TP lanes or pipeline stages), else HDP rank 0."""
        trainer = self._trainer_or_none()
        if trainer is not None and self._rank is None:
            return int(trainer.global_rank) == 0
        return self.rank == 0

    def _strategy(self) -> Any:
        """The trainer's strategy (None without a trainer)."""
        trainer = self._trainer_or_none()
        return getattr(trainer, "strategy", None) if trainer is not None else None

    def _strategy_config(self) -> PlannerConfig | None:
        """The trainer's strategy's ``planner_config`` (``ByteScaleStrategy``'s), if it has one."""
        config = getattr(self._strategy(), "planner_config", None)
        return config if isinstance(config, PlannerConfig) else None

    @property
    def planner_config(self) -> PlannerConfig:
        """What every step is planned with: the strategy's ``planner_config`` under a strategy that
        has one (this module's own planner arguments must then agree with it:
        :meth:`check_planner_config`), else this module's (``seed`` ``None``: this module's ``seed``
        is the planning seed)."""
        if self._checking_config is not None:
            return self._checking_config
        config = self._strategy_config()
        if config is None:
            return self._own_planner_config
        self.check_planner_config(config)
        return config

    def check_planner_config(self, config: PlannerConfig, owner: str = "ByteScaleStrategy") -> None:
        """Refuse, naming both values and the fix, planner arguments of this module that ``config`` overrides.

        Under ``ByteScaleStrategy`` the strategy's ``planner_config`` plans every step; an
        option given here too must say the same, or this module's value would be silently
        ignored.  ``ByteScaleStrategy`` calls this before it starts any process.
        """
        if config is self._checked_config:
            return
        own = self._own_planner_config
        differ = sorted(k for k in self._given_planner_fields if getattr(own, k) != getattr(config, k))
        if differ:
            mine = ", ".join(f"{k}={getattr(own, k)!r}" for k in differ)
            theirs = ", ".join(f"{k}={getattr(config, k)!r}" for k in differ)
            raise PlannerOptionsConflictError(
                f"ByteScaleDataModule({mine}) differs from {owner}'s planner_config ({theirs}); under {owner} "
                f"the strategy's planner options plan every step. Give them to the strategy ({owner}({mine}), "
                "or strategy.<option>=... in a recipe) and drop them from the data module."
            )
        self._checked_config = config

    def planner_options(self) -> dict:
        """:attr:`planner_config` as ``make_plan`` keyword options (without the seed and ``None`` values)."""
        opts = self.planner_config.as_options()
        opts = {k: v for k, v in opts.items() if v is not None and k != "seed"}
        view = self._loader_view()
        if view.tensor_parallel > 1:
            # ranks_per_node (the option or the cost model's) counts devices; the planner places
            # rings over HDP ranks, tp devices each (as the simulator's Scenario.ranks_per_node)
            per_node = opts.get("ranks_per_node")
            if per_node is None:
                cost = opts.get("cost_model") or CostModel.paper_preset()
                per_node = cost.ranks_per_node
            if per_node is not None:
                opts["ranks_per_node"] = view.hdp_ranks_per_node(per_node)
        return opts

    def plan_seed(self) -> int:
        """The base of every step's planning seed: the planner config's ``seed`` if it gives one."""
        seed = self.planner_config.seed
        return int(seed) if seed is not None else int(self.seed)

    def pool_tokens(self, want: int | None = None) -> int:
        """The longest sequence (at most ``want``) the planner can place.

        ``want`` defaults to ``world_size * capacity``.  Lengths above one rank's capacity are
        checked with the planner itself, so ``static``'s CP degree and offload are taken into
        account; the longest length the planner accepts is returned.
        """
        config = self.planner_config.replace(seed=0)
        cap = config.capacity
        if want is None:
            want = self.world_size * cap
        if want <= cap:
            return want

        from lightning_bytescale.planner import PlanError, make_plan

        def fits(n: int) -> bool:
            try:
                make_plan((n,), world_size=self.world_size, config=config)
            except PlanError:
                return False
            return True

        if fits(want):
            return want
        lo, hi = cap, want  # lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    # ------------------------------------------------------------------------------- lifecycle
    def prepare_data(self) -> None:
        """Build the token store once (no state is set here), under the store's lock.

        An existing store is checked (its index, not its tokens) and kept; with ``rebuild=True``
        it is replaced, once for all processes that asked at the same time.
        """
        try:
            directory = self.store_dir
            lock = store_lock(directory)
            seen = (read_meta(directory) or {}).get("build_id")
            with lock:
                current = (read_meta(directory) or {}).get("build_id")
                rebuilt_meanwhile = current is not None and current != seen
                if is_complete(directory) and (not self.rebuild or rebuilt_meanwhile):
                    TokenStore.open(
                        directory, verify="none"
                    )  # a damaged store fails here, naming rebuild=True
                elif directory.exists() and not self.rebuild:
                    TokenStore.open(directory, verify="none")  # incomplete: the error names rebuild=True
                else:
                    self._build(directory)
                _touch(directory / LAST_USED_FILE)
                if self.prune_stale and self.source_key is not None:
                    for act in prune_cache(self.cache_dir, keep=[directory], source_key=self.source_key):
                        log.info("pruned %s (%s: %s, %d bytes)", act.path, act.reason, act.detail, act.bytes)
        except OSError as err:
            raise DataError(
                f"cannot prepare the token store cache {self.cache_dir}: {err.strerror or err}"
                f"{f' ({err.filename})' if err.filename else ''}; set cache_dir= (or $BYTESCALE_DATA_CACHE) "
                f"to a writable folder with enough free space"
            ) from err

    def _build(self, directory: Path) -> None:
        tok = self.encoder
        source = self.source
        stamps = self._stamps
        meta: dict[str, Any] = {
            "source": self._fingerprint,
            "tokenizer": tok.fingerprint,
            "loss_on": self.loss_on,
        }
        if isinstance(source, FileSourceMixin):
            meta.update(source_key=self.source_key, files=[st.as_list() for st in stamps or []])

        def documents():
            yield from source.iter_documents(tok.vocab_size)
            if stamps is not None:
                changes = changed_files(stamps, source.last_read)
                if changes:
                    raise DataError(
                        f"the source changed while its token store was being built ({len(changes)} file(s): "
                        f"{'; '.join(changes[:5])}); nothing was written. Finish editing the files, then "
                        f"run again: prepare_data() builds the store for the files as they are."
                    )
            skipped = getattr(source, "skipped_binary", None)
            if skipped:
                meta["skipped_binary"] = skipped

        workers = self.tokenize_workers
        if workers is None:
            workers = _cores() if self.conversational else 1
        hint = getattr(source, "count_hint", None)
        log.info("building the token store %s (%d tokenizing process(es))", directory, workers)
        write_store(
            directory, documents(), tok.encode_batch, tok.vocab_size, meta=meta,
            eos_id=getattr(tok, "eos_id", None), replace=True, loss_mask=bool(getattr(tok, "loss_mask", False)),
            num_proc=workers, progress=self.progress, total=hint() if callable(hint) else None,
        )  # fmt: skip

    def setup(self, stage: str | None = None) -> None:
        trainer = self._trainer_or_none()
        if trainer is not None:
            hdp_rank, hdp_ranks = self._trainer_ranks()
            for name, mine, theirs in (
                ("rank", self._rank, hdp_rank),
                ("world_size", self._world_size, hdp_ranks),
            ):
                if mine is not None and mine != theirs:
                    raise DataError(
                        f"ByteScaleDataModule({name}={mine}) disagrees with the trainer ({theirs}); "
                        f"leave {name} unset under a Trainer"
                    )
        self.store = self._open_store()
        pool = self.pool_tokens(self.context_length)
        max_len = self.context_length if self.context_length is not None else pool
        if max_len is None:
            raise DataError("set context_length (or capacity, so the pool bounds the context)")
        if pool is not None and max_len > pool:
            raise self._context_error(int(max_len), pool)
        self.max_length = int(max_len)
        train_docs, val_docs, test_docs = self._split_documents()
        self.train_samples = self._samples(train_docs, "the training data")
        self._check_budget(int(self.train_samples.length.max()))
        self.val_samples = self._samples(val_docs, "the validation split") if val_docs is not None else None
        self.test_samples = self._samples(test_docs, "the test split") if test_docs is not None else None
        if (
            trainer is not None
            and stage == "fit"
            and self.val_samples is None
            and getattr(trainer, "limit_val_batches", 0)
        ):
            # No validation split: skip the loop as limit_val_batches=0 does, instead of handing
            # Lightning an empty loader it warns about ("Total length of `list` across ranks is zero").
            # teardown("fit") puts the trainer's value back, so a later fit with a split validates.
            self._restore_limit_val_batches = (trainer, trainer.limit_val_batches)
            trainer.limit_val_batches = 0

    def teardown(self, stage: str | None = None) -> None:
        """Give back the trainer's ``limit_val_batches`` that :meth:`setup` set to 0 for a fit without a validation split."""
        saved = getattr(self, "_restore_limit_val_batches", None)
        if saved is not None and stage in (None, "fit"):
            trainer, value = saved
            trainer.limit_val_batches = value
            self._restore_limit_val_batches = None

    def _context_error(self, wanted: int, pool: int) -> ContextLengthError:
        """The error for a ``context_length`` the planner cannot place whole, with the three fixes."""
        config, ranks = self.planner_config, self.world_size
        cap = config.capacity
        with_offload = ""
        if not config.offload:
            saved = self._checking_config
            self._checking_config = config.replace(offload=True)
            try:
                reach = self.pool_tokens(wanted)
            finally:
                self._checking_config = saved
            enough = "enough" if reach >= wanted else f"up to {reach:,} tokens here, not enough alone"
            with_offload = (
                f"; or offload=True (strategy.offload=true: a long sequence needs fewer ranks; {enough})"
            )
        more_ranks = -(-wanted // cap)
        return ContextLengthError(
            f"context_length={wanted:,} is more than the planner can place on {ranks} HDP rank(s) with capacity "
            f"{cap:,} tokens a rank{' and offload' if config.offload else ''}: at most {pool:,} tokens, so every "
            f"longer document would be cut to {pool:,} tokens (long_document_policy="
            f"{self.long_document_policy!r}). Lower context_length to {pool:,} (data.context_length={pool}); or "
            f"raise capacity to {-(-wanted // ranks):,} (strategy.capacity, if a device holds that many tokens) "
            f"or the HDP ranks to {more_ranks} (trainer.devices x trainer.num_nodes, over tensor_parallel_size x "
            f"pipeline_parallel_size){with_offload}"
        )

    def _check_budget(self, longest: int, world_size: int | None = None, capacity: Any = None) -> None:
        """Fail if a global batch's budget cannot hold the longest training sample."""
        if self.tokens_per_step >= longest:
            return
        if self.context_length is None:
            world = self.world_size if world_size is None else world_size
            cap = self.planner_config.capacity if capacity is None else capacity
            how = (
                f"context_length is unset, so it defaults to the pool (world_size {world} x "
                f"capacity {cap}: {self.max_length} tokens)"
            )
        else:
            how = f"context_length={self.context_length}"
        raise DataError(
            f"tokens_per_step={self.tokens_per_step} is smaller than the longest sample ({longest} "
            f"tokens; {how}); raise tokens_per_step to at least {longest}, or set context_length to at "
            f"most {self.tokens_per_step} so that longer documents follow "
            f"long_document_policy={self.long_document_policy!r}"
        )

    def validate(self, world_size: int, planner_options: PlannerConfig | dict | None = None) -> None:
        """Check, before any process starts, what ``setup`` would reject; builds nothing.

        ``world_size`` and ``planner_options`` (the strategy's ``planner_config`` or its
        ``planner_options()``; default: this module's) stand in for the trainer's.  The pool and the context length are checked
        always; ``tokens_per_step`` against the longest training sample when the token store
        is already built (opening its index is cheap), else by ``setup``.  Raises
        :class:`DataError` naming the option and the fix.
        """
        if isinstance(planner_options, PlannerConfig):
            self.check_planner_config(planner_options)
            config = planner_options
        elif planner_options is None:
            config = self._own_planner_config
        else:
            config = _planner_config(None, {k: v for k, v in dict(planner_options).items() if v is not None})
        saved = (self._world_size, self._checking_config, self.store, self.max_length)
        self._world_size, self._checking_config = int(world_size), config
        try:
            pool = self.pool_tokens(self.context_length)
            max_len = self.context_length if self.context_length is not None else pool
            if max_len is None:
                raise DataError("set context_length (or capacity, so the pool bounds the context)")
            if pool is not None and max_len > pool:
                raise self._context_error(int(max_len), pool)
            if self.tokens_per_step < self.min_tokens:
                raise DataError(
                    f"tokens_per_step={self.tokens_per_step} is below min_tokens={self.min_tokens}: no sample fits; "
                    f"raise tokens_per_step"
                )
            directory = self.store_dir
            if not is_complete(directory):
                return
            self.store = TokenStore.open(directory, verify="none")
            self.max_length = int(min(max_len, pool) if pool is not None else max_len)
            train_docs = self._split_documents()[0]
            self._check_budget(
                int(self._samples(train_docs, "the training data", quiet=True).length.max()),
                world_size, config.capacity,
            )  # fmt: skip
        finally:
            self._world_size, self._checking_config, self.store, self.max_length = saved

    def _open_store(self) -> TokenStore:
        """Open this module's store (waiting for a build in progress), naming what went wrong."""
        directory = self.store_dir
        lock = store_lock(directory)
        try:
            lock.acquire(timeout=1)
        except Timeout:
            log.info("waiting for the build of the token store %s to finish", directory)
            lock.acquire()
        except OSError:  # a read-only cache: nobody builds there, open without the lock
            lock = None
        try:
            store = TokenStore.open(directory, verify=self.verify_store, vocab_limit=self.model_vocab_size)
        except StoreNotFoundError:
            raise self._missing_store(directory) from None
        finally:
            if lock is not None:
                lock.release()
        # once per run, not once per rank (TP lanes and pipeline stages share an HDP rank's share)
        (log.info if self._reports_data_warnings else log.debug)(
            "token store %s (content %s): %d documents, %d tokens",
            directory, store.content_hash, store.num_docs, store.num_tokens,
        )  # fmt: skip
        return store

    def _missing_store(self, directory: Path) -> StoreNotFoundError:
        """Why no store exists for the source as it is now: it changed since a store was built?"""
        key = self.source_key
        related = []
        if key is not None and self.cache_dir.is_dir():
            for other in self.cache_dir.glob(STORE_PREFIX + "*"):
                meta = read_meta(other) if other.is_dir() else None
                if meta and meta.get("source_key") == key:
                    related.append((other.stat().st_mtime, other, meta))
        if related and self._stamps is not None:
            from lightning_bytescale.data.sources import stamps_from_lists

            _, other, meta = max(related, key=lambda t: t[0])
            changes = changed_files(stamps_from_lists(meta.get("files", [])), self._stamps)
            return StoreNotFoundError(
                f"no token store for the source as it is now ({directory}): it changed after prepare_data() "
                f"built {other} ({len(changes)} file(s) differ: {'; '.join(changes[:5]) or 'unknown'}). Every "
                f"rank must read the same data: stop editing the files, then run again; prepare_data() "
                f"(which Lightning runs on each node's local rank 0) builds the store for the files as they "
                f"are (rebuild=True forces a fresh build)."
            )
        return StoreNotFoundError(
            f"no token store at {directory}: prepare_data() has not built it for this source. Under a "
            f"Trainer, Lightning runs prepare_data() on each node's local rank 0 (on global rank 0 only with "
            f"prepare_data_per_node=False: then cache_dir must be shared by all nodes); without a Trainer "
            f"call dm.prepare_data() before dm.setup(). To force a fresh build pass rebuild=True."
        )

    def _split_documents(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Document ids of the train, validation and test splits (None: no such split).

        One seeded permutation: its first ``val_fraction`` are validation, the next
        ``test_fraction`` test, the rest training; so adding a test split keeps the validation one.
        """
        n = self.store.num_docs
        if self.val_fraction <= 0 and self.test_fraction <= 0:
            return np.arange(n), None, None
        perm = np.random.default_rng([self.seed, 7]).permutation(n)
        k = max(1, round(n * self.val_fraction)) if self.val_fraction > 0 else 0
        m = max(1, round(n * self.test_fraction)) if self.test_fraction > 0 else 0
        if k + m >= n:
            raise DataError(
                f"val_fraction={self.val_fraction} and test_fraction={self.test_fraction} leave no training "
                f"documents of {n}; lower them or add documents"
            )
        val = np.sort(perm[:k]) if k else None
        test = np.sort(perm[k : k + m]) if m else None
        return np.sort(perm[k + m :]), val, test

    def _samples(self, docs: np.ndarray, where: str, quiet: bool = False) -> Samples:
        s = make_samples(
            self.store.lengths[docs],
            self.max_length,
            self.long_document_policy,
            self.empty_sample_policy,
            self.min_tokens,
            where=f"{where} ({self.store.directory})",
        )
        s.doc = docs[s.doc]  # positions in the subset -> document ids in the store
        if self.store.has_mask:
            s = drop_untrained(
                s, self._loss_tokens(s), self.empty_sample_policy, f"{where} ({self.store.directory})"
            )
        long = s.report.get("long_documents", 0)
        if quiet:
            return s
        if long and self._reports_data_warnings:
            what = "conversations" if self.conversational else "documents"
            done = {"drop": "dropped", "truncate": "truncated", "split": "split"}.get(
                self.long_document_policy
            )
            self._warn_once(
                "%s: %d %s longer than the context length %d were %s (long_document_policy=%r); raise "
                "context_length (and capacity x world size) to keep them",
                where, long, what, self.max_length, done, self.long_document_policy,
            )  # fmt: skip
        if s.report.get("no_loss_dropped") and self._reports_data_warnings:
            self._warn_once(
                "%s: %d samples with no trained token (loss_on=%r) were dropped",
                where, s.report["no_loss_dropped"], self.loss_on,
            )  # fmt: skip
        return s

    def _warn_once(self, message: str, *args: Any) -> None:
        """Log a data warning once per data module: ``setup`` runs for every stage (fit, test,
        predict) and the loaders check the vocabulary for every split, with the same findings."""
        text = message % args
        seen = self.__dict__.setdefault("_warned", set())
        if text not in seen:
            seen.add(text)
            log.warning(text)

    def _loss_tokens(self, s: Samples) -> np.ndarray:
        """Trained tokens of each sample: the index's count for whole documents, else from the mask."""
        store = self.store
        counts = store.loss_counts[s.doc].copy()
        partial = np.flatnonzero((s.start != 0) | (s.length != store.lengths[s.doc]))
        for i in partial.tolist():
            counts[i] = int(store.read_mask(int(s.doc[i]), int(s.start[i]), int(s.length[i]))[1:].sum())
        return counts

    # ----------------------------------------------------------------------------- vocabulary
    def find_model_vocab_size(self) -> int | None:
        """The model's vocabulary: ``model_vocab_size``, else read from the trainer's LightningModule."""
        if self.model_vocab_size is not None:
            return int(self.model_vocab_size)
        trainer = self._trainer_or_none()
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        return model_vocab_size(module) if module is not None else None

    def check_vocabulary(self, model_vocab: int | None = None) -> None:
        """Fail now, naming both sizes, if the store holds an id the model's embedding cannot hold.

        ``model_vocab``: the model's vocabulary size (default: :meth:`find_model_vocab_size`).
        Called when the loaders are made, before the first step.
        """
        if self.store is None:
            raise DataError("call setup() before checking the vocabulary")
        limit = model_vocab if model_vocab is not None else self.find_model_vocab_size()
        if limit is None:
            return
        limit = int(limit)
        store = self.store
        hit = store.first_out_of_vocabulary(limit)
        if hit is not None:
            doc, pos, tid = hit
            raise OutOfVocabularyError(
                f"token store {store.directory}: document {doc} holds token id {tid} at position {pos}, outside "
                f"the model's vocabulary (vocab_size={limit}: its input embedding has {limit} rows; the tokenizer "
                f"has {store.vocab_size} tokens). Use the model's own tokenizer, or give the model a vocabulary of "
                f"at least {store.vocab_size} (for a model built from its config: "
                f"config_overrides.vocab_size={store.vocab_size})"
            )
        store.vocab_limit = min(limit, store.vocab_size)
        if store.vocab_size > limit and self._reports_data_warnings:
            self._warn_once(
                "the tokenizer has %d tokens, the model's vocabulary %d; the data's largest id (%s) fits",
                store.vocab_size, limit, store.max_token_id,
            )  # fmt: skip

    # ----------------------------------------------------------------------------- dataloaders
    def _loader(
        self, samples: Samples | None, shuffle: bool, split: str, drop_last: bool | None = None
    ) -> StepLoader:
        if self.store is None or samples is None:
            raise DataError("call setup() before asking for a dataloader")
        self.check_vocabulary()
        batching = GlobalBatching(
            samples.length, self.tokens_per_step, self.seed, shuffle, self.budget_mode,
            self.drop_last if drop_last is None else drop_last,
        )  # fmt: skip
        # training under a strategy that refines its cost model: the features, the schedule file
        refinement = getattr(self._strategy(), "cost_refinement", None) if split == "train" else None
        dataset = StepDataset(
            self.store, samples, batching, self.rank, self.world_size,
            self.planner_options(), self.plan_seed(), self.validate_plans, split,
            ring_ranks=(view := self._loader_view()).ring_ranks, pipeline_stages=view.pipeline_stages,
            record_work=refinement is not None,
            cost_schedule=None if refinement is None else refinement.loader_schedule(
                self.num_workers, self.prefetch_factor
            ),
        )  # fmt: skip
        sampler = token_budget_sampler(batching, self.world_size, self.rank)
        return StepLoader(
            dataset, sampler, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
        )  # fmt: skip

    def train_dataloader(self) -> StepLoader:
        """This rank's steps of the training data: shuffled every epoch, unless the trainer overfits
        (``Trainer(overfit_batches=n)``: the first ``n`` global batches, in order, every epoch)."""
        trainer = self._trainer_or_none()
        overfit = bool(getattr(trainer, "overfit_batches", 0)) if trainer is not None else False
        loader = self._loader(self.train_samples, self.shuffle and not overfit, "train")
        if self._pending_state:
            loader.load_state_dict(self._pending_state)
            self._pending_state = None
        self._train_loader = loader
        return loader

    @_validation_loader
    def val_dataloader(self) -> StepLoader | list:
        """Global batches of the held-out documents, in order, planned like training."""
        if self.val_samples is None:
            return []
        return self._held_out_loader(self.val_samples, "val", drop_last=self.drop_last)

    def test_dataloader(self) -> StepLoader:
        """``trainer.test``: the test split (``test_fraction``), else the validation split, in order."""
        samples = self.test_samples if self.test_samples is not None else self.val_samples
        if samples is None:
            raise DataError(
                "trainer.test needs held-out documents, and this data module holds none out: set "
                "test_fraction (data.test_fraction=0.05 in the recipe) or val_fraction"
            )
        return self._held_out_loader(samples, "test")

    def predict_dataloader(self) -> PredictSteps:
        """``trainer.predict``: the ``predict_split`` documents in order, every sample exactly once."""
        splits = {"train": self.train_samples, "val": self.val_samples, "test": self.test_samples}
        split = self.predict_split
        if split is None:
            split = next((name for name in ("test", "val") if splits[name] is not None), "train")
        samples = splits[split]
        if samples is None:
            raise DataError(
                f"predict_split={split!r}, but there is no {split} split: set "
                f"{'val_fraction' if split == 'val' else 'test_fraction'} or choose another predict_split"
            )
        return PredictSteps(self._held_out_loader(samples, "predict"))

    def _held_out_loader(self, samples: Samples, split: str, drop_last: bool = False) -> StepLoader:
        """Samples in store order (not shuffled; by default the last, partly filled step kept), from
        the start on every pass."""
        loader = self._loader(samples, shuffle=False, split=split, drop_last=drop_last)
        loader.restart_each_iter = True
        return loader

    # ---------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """The training position (also saved by Lightning's fit loop through the loader)."""
        return {"train": self._train_loader.state_dict()} if self._train_loader is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        train = state_dict.get("train")
        if not train:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(train)
        else:
            self._pending_state = train


def _planner_config(base: PlannerConfig | None, options: dict[str, Any]) -> PlannerConfig:
    """``base`` (default: ``PlannerConfig(capacity=4096)``) with ``options`` replaced; a bad
    option is a :class:`DataError` carrying the planner's message (cause and fix)."""
    cap = options.get("capacity")
    if isinstance(cap, int) and not isinstance(cap, bool) and cap < 2:
        raise DataError(
            f"capacity={cap} must be at least 2 tokens per rank (a ring member holds two zigzag chunks); "
            "raise capacity"
        )
    if base is not None and not isinstance(base, PlannerConfig):
        raise DataError(f"planner_config must be a PlannerConfig or None, got {type(base).__name__}")
    try:
        if base is None:
            return PlannerConfig.from_options(**{"capacity": DEFAULT_CAPACITY, **options})
        return base.replace(**options) if options else base
    except PlanError as err:
        raise DataError(str(err)) from err


def model_vocab_size(module: Any) -> int | None:
    """A model's vocabulary, found where it is: the module's ``vocab_size`` attribute, else the rows
    of a Hugging Face model's input embeddings (``get_input_embeddings()``) found among its modules,
    else the rows of its first ``nn.Embedding`` (``self.model = LlamaModel(...)``: ``model.embed``);
    None if none of them."""
    value = getattr(module, "vocab_size", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    modules = list(module.modules()) if callable(getattr(module, "modules", None)) else []
    for m in modules:
        get = getattr(m, "get_input_embeddings", None)
        if callable(get):
            with contextlib.suppress(NotImplementedError, AttributeError):
                rows = getattr(get(), "num_embeddings", None)
                if isinstance(rows, int) and rows > 0:
                    return rows
    for m in modules:  # the first embedding of the module tree: the token embedding of a plain model
        if isinstance(m, nn.Embedding) and m.num_embeddings > 0:
            return int(m.num_embeddings)
    return None


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _touch(path: Path) -> None:
    """Mark a store as used now (for ``prune --unused-days``); a read-only cache is fine."""
    with contextlib.suppress(OSError):
        path.touch()
