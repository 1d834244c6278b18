"""How the profiler starts its workers: spawned for CUDA, forked for the CPU, and what a spawned one gets pickled.

On a GPU machine ``torch.cuda.is_available()`` initialises the CUDA driver (without making
``torch.cuda.is_initialized()`` true), and a process forked after that fails its first CUDA call:
``bytescale-profile --tensor-parallel 2`` on CUDA, started plainly, must spawn its NCCL workers.
CUDA is faked here as ``tests/_fake_cuda.py`` fakes it (two devices, available, not
initialised); no process is started: the multiprocessing context is replaced by one that records
the start method and, for a spawned worker, pickles and unpickles what the worker would get, as
spawning does.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

from lightning_bytescale.cli.profile import main
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.profiler import ProfileError, run_profile
from lightning_bytescale.profiler.links import measure_p2p_bandwidth

LENGTHS = [16, 32, 48]


def tiny_llama() -> LlamaModel:
    """A model factory defined at the top level of a module (``test_profiler_workers:tiny_llama``)."""
    return LlamaModel(LlamaConfig.preset("tiny", layers=1))


class Started(Exception):
    """Raised instead of starting a worker: the test has seen what it needed."""


class RecordedContext:
    """A multiprocessing context that starts nothing: its start method, and what a worker would receive."""

    def __init__(self, method: str, record: dict[str, Any]) -> None:
        self.method, self.record = method, record
        record["method"] = method

    def Queue(self) -> None:  # noqa: N802 (multiprocessing's name)
        return None

    def Process(self, target: Any, args: tuple, daemon: bool) -> RecordedContext:  # noqa: N802
        self.record["target"], self.record["args"] = target, args
        return self

    def start(self) -> None:
        if self.method == "spawn":  # what a spawned worker gets: its target and arguments, pickled
            self.record["received"] = ForkingPickler.loads(ForkingPickler.dumps(self.record["args"][:-1]))
        raise Started


@pytest.fixture
def record(monkeypatch) -> dict[str, Any]:
    """Fake CUDA (two devices, the driver not initialised by torch) and a context that starts nothing."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: RecordedContext(method, seen))
    return seen


def _received_model(record: dict[str, Any]) -> torch.nn.Module:
    """The model the spawned rank 0 builds from what it received (``_rank_main``'s ``fn, args, kwargs``)."""
    from lightning_bytescale.profiler.run import model_from

    _rank, _port, _world, device_type, _timeout, _fn, args, _kwargs = record["received"]
    assert device_type == "cuda"
    return model_from(args[0])


def test_cuda_profiler_workers_are_spawned(record):
    with pytest.raises(Started):
        run_profile(tiny_llama, LENGTHS, "cuda", tensor_parallel=2, warmup=0, repeats=1)
    assert record["method"] == "spawn"


def test_cpu_workers_are_forked(record):
    with pytest.raises(Started):
        run_profile(tiny_llama, LENGTHS, "cpu", tensor_parallel=2, warmup=0, repeats=1)
    assert record["method"] == "fork"
    with pytest.raises(Started):
        measure_p2p_bandwidth(1024, repeats=1)  # the gloo link probe: host tensors only
    assert record["method"] == "fork"


@pytest.mark.parametrize("spec", ["tiny", "test_profiler_workers:tiny_llama"])
def test_the_command_lines_model_pickles_for_spawned_cuda_workers(record, spec):
    with pytest.raises(Started):
        main(["--model", spec, "--lengths", "16,32,48", "--device", "cuda", "--tensor-parallel", "2"])
    assert record["method"] == "spawn"
    model = _received_model(record)
    layers = 1 if ":" in spec else LlamaConfig.preset("tiny").layers
    assert isinstance(model, LlamaModel) and len(model.blocks) == layers


def test_a_model_factory_and_a_model_pickle_for_spawned_cuda_workers(record):
    with pytest.raises(Started):
        run_profile(tiny_llama, LENGTHS, "cuda", tensor_parallel=2)
    assert record["received"][6][0] is tiny_llama  # a top-level function travels by name
    torch.manual_seed(0)
    model = tiny_llama()
    with pytest.raises(Started):
        run_profile(model, LENGTHS, "cuda", tensor_parallel=2)
    received = _received_model(record)
    assert received is not model
    for (name, a), (_, b) in zip(model.state_dict().items(), received.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_factory_that_cannot_pickle_is_refused_before_any_process_starts(record):
    with pytest.raises(ProfileError, match="top level of an importable module"):
        run_profile(lambda: tiny_llama(), LENGTHS, "cuda", tensor_parallel=2)
    assert "method" not in record  # refused before a context was asked for
