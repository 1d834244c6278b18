"""bf16 gradient buckets: summed in float32, with at most ``staging_copies`` float32 buffers alive.

Two gloo ranks sum the bf16 gradients of eight one-layer buckets, all launched from the hooks of
one backward.  Every float32 tensor of a bucket's size made while the backward and the sync run
is watched from outside the sync (a dispatch mode sees the op that makes it, a weak reference
sees its memory released), so the peak of live staging bytes is counted, not read from the
sync's own books: with the default two buffers it is two buckets' float32 bytes, where a copy
per bucket (the sync before) held all eight at once.  The sums are the float32 sums of both
ranks' bf16 gradients, rounded to bf16 once, bit for bit.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from _ranks import gather_reports, init_gloo, save_report
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
WIDTH = 32
LAYERS = 8

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

aten = torch.ops.aten
# the ops that make a tensor with memory of its own (views and in-place ops make none)
ALLOCATING = {
    aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.zeros, aten.zeros_like,
    aten.new_zeros, aten._to_copy, aten.clone,
}  # fmt: skip


class StagingWatch(TorchDispatchMode):
    """Live bytes of new float32 tensors of at least ``min_numel`` elements made under it, and their peak.

    The model is bf16 and its float32 tensors are small, so in its backward and the sync every
    float32 tensor of a bucket's size is a staging copy.  A tensor counts from the op that made
    it until its memory is released (its Python object dies with the last reference, C++ ones
    such as a collective's work included).
    """

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.live = self.peak = 0
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func.overloadpacket in ALLOCATING
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
            and out.numel() >= self.min_numel
        ):
            nbytes = out.untyped_storage().nbytes()
            self.live += nbytes
            self.made += 1
            self.peak = max(self.peak, self.live)
            weakref.finalize(out, self._died, nbytes)
        return out

    def _died(self, nbytes: int) -> None:
        self.live -= nbytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).to(torch.bfloat16)


def _backward(model: nn.Module, rank: int) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    model(x).float().square().sum().backward()


def _worker(rank: int, port: int, outdir: str) -> None:
    from lightning_bytescale.engine.grad_sync import BucketedGradSync

    torch.set_num_threads(1)
    init_gloo(rank, WORLD, port)
    group = dist.new_group(list(range(WORLD)))
    layer_bytes = WIDTH * WIDTH * 2
    report: dict = {"layer_float32_bytes": 2 * layer_bytes}

    # the reference: each rank's own bf16 gradients, gathered, summed in float32, rounded once
    model = _model()
    _backward(model, rank)
    mine = [p.grad.float() for p in model.parameters()]
    gathered = [[torch.empty_like(g) for _ in range(WORLD)] for g in mine]
    for g, out in zip(mine, gathered):
        dist.all_gather(out, g)
    reference = [(out[0] + out[1]).to(torch.bfloat16) for out in gathered]

    for copies in (2, LAYERS):
        model = _model()
        sync = BucketedGradSync(
            list(model.parameters()), group=group, bucket_bytes=layer_bytes, first_bucket_bytes=layer_bytes,
            staging_copies=copies,
        )  # fmt: skip
        watch = StagingWatch(WIDTH * WIDTH)
        sync.prepare()
        sync.arm()
        with watch:
            _backward(model, rank)  # every bucket is final in this backward: the hooks launch them all
            sync.finish()
        report[f"copies={copies}"] = {
            "buckets": len(sync.buckets),
            "launched_in_backward": sync.launched_in_backward,
            "peak_watched": watch.peak,
            "peak_reported": sync.peak_staging_bytes,
            "extra_after": sync.extra_bytes,
            "made": watch.made,
            "exact": all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference)),
            "dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        }
        sync.close()
    save_report(outdir, rank, report)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return gather_reports(tmp_path_factory.mktemp("staging"), _worker, WORLD, timeout_s=100)


def test_at_most_two_float32_staging_copies_are_alive_at_once(reports):
    for rep in reports:
        one_bucket = rep["layer_float32_bytes"]
        bounded, unbounded = rep["copies=2"], rep[f"copies={LAYERS}"]
        assert bounded["buckets"] == unbounded["buckets"] == LAYERS
        assert bounded["launched_in_backward"] == LAYERS  # launched from the hooks, as before
        assert bounded["made"] == 2 and bounded["peak_watched"] == 2 * one_bucket, bounded
        assert bounded["peak_reported"] == bounded["peak_watched"]
        # with a buffer per bucket all of them are alive together: the watch sees what it should
        assert unbounded["made"] == LAYERS and unbounded["peak_watched"] == LAYERS * one_bucket, unbounded
        # (after finish the sync holds none; gloo's worker threads may still hold the last works'
        # tensors for a moment, so what is alive then is not the sync's to bound)
        assert bounded["extra_after"] == unbounded["extra_after"] == 0


def test_bf16_sums_are_float32_sums_rounded_once(reports):
    for rep in reports:
        for case in (rep["copies=2"], rep[f"copies={LAYERS}"]):
            assert case["exact"] and case["dtypes"] == ["torch.bfloat16"], case
