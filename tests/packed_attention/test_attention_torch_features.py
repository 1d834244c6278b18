"""What the installed torch offers, detected (``torch_features.py``): op schemas bound by position, refused when they differ.

* the adapters' values are named by the installed schema: the flash backward's dropout state
  is ``rng_state, unused`` on this torch, and an older schema's ``philox_seed, philox_offset``
  names are used when that is the schema (an emulated op bound to it checks the call);
* a schema of another shape makes the kernel unavailable, with the reason, and the selection
  falls to the next kernel (on fake CUDA, where ``flash`` is otherwise chosen);
* ``varlen_attn`` problems: none on this torch; a function without ``window_size`` is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.varlen
from _fake_cuda import CUDA, fake_cuda

from lightning_bytescale.errors import ConfigError
from lightning_bytescale.packed_attention import cuda_kernels, kernels, select_kernel, torch_features
from lightning_bytescale.packed_attention.segments import Segments


def test_bind_names_values_by_the_installed_schema():
    schema = torch.ops.aten._flash_attention_backward.default._schema
    names = [a.name for a in schema.arguments if not a.kwarg_only]
    values = list(range(len(names)))
    bound = torch_features.bind("flash_backward", values, scale=0.5)
    assert list(bound) == [*names, "scale"] and list(bound.values()) == [*values, 0.5]
    assert names[-2:] == ["rng_state", "unused"]
    assert torch_features.op_problem("flash_backward") is None


def test_an_older_schema_is_called_with_its_own_names(monkeypatch):
    installed = torch_features.op_schema("flash_backward")
    older = torch_features.OpSchema(
        installed.name, (*installed.positional[:-2], "philox_seed", "philox_offset"), installed.keywords
    )
    monkeypatch.setattr(
        torch_features, "op_schema", lambda adapter: older if adapter == "flash_backward" else installed
    )
    seen = {}

    def flash_backward_with_philox_names(
        *, grad_out, query, key, value, philox_seed, philox_offset, scale, **rest
    ):
        seen.update(rest, philox_seed=philox_seed, philox_offset=philox_offset, scale=scale)
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    monkeypatch.setitem(cuda_kernels.OPS, "flash_backward", flash_backward_with_philox_names)
    q, k = torch.zeros(6, 4, 8, dtype=torch.bfloat16), torch.zeros(6, 2, 8, dtype=torch.bfloat16)
    lse = torch.zeros(4, 6)
    seg = Segments.of([2, 4])
    dq, dk, dv = cuda_kernels.flash_backward(q, q, k, k, q, lse, seg, seg, True, 0.25)
    assert dq.shape == q.shape and dk.shape == k.shape
    assert seen["scale"] == 0.25 and seen["is_causal"] is True and seen["max_q"] == 4
    assert seen["philox_seed"].dtype == torch.uint64 and seen["philox_offset"].numel() == 0


def test_a_schema_of_another_shape_makes_the_kernel_unavailable(monkeypatch):
    installed = torch_features.op_schema
    with fake_cuda():
        assert select_kernel(CUDA, torch.bfloat16, 64) == "flash"
        changed = torch_features.OpSchema(
            "aten::_flash_attention_forward", ("query", "key", "value"), frozenset()
        )
        monkeypatch.setattr(
            torch_features, "op_schema", lambda a: changed if a == "flash_forward" else installed(a)
        )
        assert select_kernel(CUDA, torch.bfloat16, 64) == "efficient"
        q = torch.empty(4, 2, 64, dtype=torch.bfloat16, device=CUDA)
        with pytest.raises(ConfigError, match=r"takes \(query, key, value\), not the 10 positional"):
            kernels.resolve_kernel("flash", q)


def test_varlen_attn_problems(monkeypatch):
    assert torch_features.varlen_attn_problem() is None
    assert {"scale", "window_size"} <= torch_features.varlen_attn_keywords()

    def no_window(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        raise AssertionError("not called")

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", no_window)
    assert torch_features.varlen_attn_problem() == "this torch's varlen_attn takes no window_size"
    monkeypatch.delattr(torch.nn.attention.varlen, "varlen_attn")
    assert torch_features.varlen_attn_problem() == "this torch has no torch.nn.attention.varlen.varlen_attn"
    assert "varlen_attn_problem" in torch_features.report()
