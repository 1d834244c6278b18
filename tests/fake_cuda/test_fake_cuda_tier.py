"""The fake-CUDA tier's own checks can fail: it sees what a GPU would refuse and every host synchronisation.

Each case does on fake CUDA what real CUDA refuses or waits for, and the tier must report it:
a value read back (``.item()``, ``.tolist()``, ``bool()``), an output shape that depends on
values, a device-to-host copy, a pageable or blocking host-to-device copy, a host index mixed
with a device tensor; and it must stay quiet where CUDA is quiet (a non-blocking copy from
pinned memory, a 0-dim host scalar, host work on host tensors).  Autocast on ``cuda`` must be
active inside it, as on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from _fake_cuda import CUDA, fake_cuda
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: bool(t.any())])
def test_a_value_read_back_is_recorded_and_raises(read):
    with fake_cuda() as mode:
        x = torch.zeros(4, device=CUDA)
        with pytest.raises(DataDependentOutputException):
            read(x)
    assert [s.kind for s in mode.syncs] == [
        "a value read back from the device (.item(), .tolist(), bool(), int())"
    ]
    assert "outside the package" in mode.syncs[0].where


def test_a_data_dependent_shape_is_recorded_and_raises():
    with fake_cuda() as mode:
        mask = torch.zeros(6, dtype=torch.bool, device=CUDA)
        with pytest.raises(DynamicOutputShapeException):
            mask.nonzero()
    assert [s.kind for s in mode.syncs] == ["an output shape that depends on device values"]


def test_copies_that_synchronise_are_recorded_and_others_not():
    host = torch.arange(8)
    with fake_cuda() as mode:
        pinned = host.pin_memory()
        assert pinned.is_pinned() and not host.is_pinned()
        a = pinned.to(CUDA, non_blocking=True)  # no sync
        assert a.device == CUDA and mode.syncs == []
        host.to(CUDA, non_blocking=True)  # pageable
        pinned.to(CUDA)  # blocking
        torch.empty(8, device=CUDA).copy_(host)  # blocking copy_ into the device
        a.cpu()  # device to host
        torch.cuda.synchronize()
    kinds = [s.kind for s in mode.syncs]
    assert kinds == ["a host-to-device copy that is not non-blocking from pinned memory"] * 3 + [
        "a device-to-host copy",
        "torch.cuda.synchronize",
    ]


def test_host_tensors_stay_real_and_mixing_devices_is_refused():
    with fake_cuda() as mode:
        index = torch.tensor([2, 0])
        assert index.tolist() == [2, 0]  # host work runs for real
        x = torch.empty(3, 5, device=CUDA)
        with pytest.raises(RuntimeError, match="(same device|two different devices).*cuda:0.*cpu"):
            x.index_select(0, index)  # a host index with a CUDA tensor
        y = x * torch.tensor(2.0)  # a 0-dim host scalar is fine on CUDA
        assert y.device == CUDA and x[1:, None, 2].shape == (2, 1)
    assert mode.syncs == []


def test_autocast_runs_on_fake_cuda():
    with fake_cuda():
        x, w = torch.empty(4, 8, device=CUDA), torch.empty(3, 8, device=CUDA)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16
        assert torch.nn.functional.linear(x, w).dtype == torch.float32
