"""``engine.finite.all_finite``: the one finiteness rule of the step's gradient checks."""

from __future__ import annotations

import pytest
import torch

from lightning_bytescale.engine.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([1.0, -2.0, 0.0], True),
        ([3e38, -3e38, 3e38], True),  # the L2 norm overflows in float32: the max-abs pass decides
        ([1.0, float("nan")], False),
        ([float("inf"), 1.0], False),
        ([-float("inf")], False),
    ],
)
def test_the_flag_is_exact_on_every_kind_of_value(values, finite, dtype):
    big = torch.zeros(4096, dtype=dtype)
    big[-len(values) :] = torch.tensor(values, dtype=dtype)
    others = [torch.ones(3, dtype=torch.float32), torch.zeros(2, 2, dtype=dtype)]
    flag = all_finite([*others, big])
    assert flag is not None and flag.dtype == torch.bool and flag.dim() == 0
    assert bool(flag) is finite


def test_no_tensors_give_no_flag():
    assert all_finite([]) is None


def test_a_bad_value_in_any_tensor_is_seen():
    tensors = [torch.ones(5) for _ in range(4)]
    tensors[2][3] = float("nan")
    assert not bool(all_finite(tensors))
    assert bool(all_finite([tensors[0], tensors[1], tensors[3]]))
