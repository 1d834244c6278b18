"""``bytescale-profile``: fit the planner's cost model to a model on this device and write its file.

The command line over :mod:`lightning_bytescale.profiler` (which does the measuring and the
fit; see :func:`~lightning_bytescale.profiler.run_profile`): it hands the profiler a factory of
the model (a Llama preset or a ``package.module:factory``), parses byte sizes (``80GiB``) and lengths, prints the
fit with its residuals and writes the cost-model file the planner, the strategy and the
simulator load (:func:`~lightning_bytescale.planner.cost_model.load_cost_model`).  With
``--tensor-parallel N`` it profiles one HDP rank of ``N`` devices: under torchrun it joins the
process group of ``N`` ranks, otherwise the profiler starts the ``N`` processes itself (spawned
on CUDA: the factory is what they get pickled).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_bytescale.models.llama import LlamaConfig, LlamaModel
from lightning_bytescale.profiler.errors import ProfileError
from lightning_bytescale.profiler.run import run_profile

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80e9"``, ``"512 MB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 80GiB, 512MB, 8e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_lengths(text: str) -> list[int]:
    try:
        return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"lengths must be integers separated by commas, got {text!r}"
        ) from None


def _build_model(
    spec: str, profile_layers: int | None
) -> tuple[Callable[[], nn.Module], int | None, int | None]:
    """``spec`` is a Llama preset name or ``package.module:factory``; returns (model factory, real layers, real params).

    A factory, not a model: the profiler builds it where it measures, and with
    ``--tensor-parallel`` on CUDA it is pickled to spawned processes, which a factory imported by
    name or a ``functools.partial`` of the model class does without copying any weights.
    """
    if ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        if not callable(factory):
            raise ProfileError(f"{spec} is not a model factory (a callable returning an nn.Module)")
        return factory, None, None
    full = LlamaConfig.preset(spec)
    cfg = LlamaConfig.preset(spec, layers=profile_layers) if profile_layers else full
    return functools.partial(LlamaModel, cfg), full.layers, full.num_params()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bytescale-profile",
        description="Fit T(s), Act(s), the host-link bandwidth (and, with --p2p, the ring link) and the "
        "token capacity C of a model "
        "on this device, and write the cost-model file the planner, strategy and simulator load.",
    )
    p.add_argument(
        "--model", default="small", help="Llama preset (tiny, small, 125m, 1b, 7b, ...) or module:factory"
    )
    p.add_argument(
        "--lengths",
        type=_parse_lengths,
        default=[256, 512, 1024, 2048],
        help="comma-separated sequence lengths",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument(
        "--profile-layers",
        type=int,
        default=None,
        help="instantiate only this many layers of a preset (the file keeps the real count)",
    )
    p.add_argument(
        "--memory-budget", type=parse_bytes, default=None, help="device bytes per rank, e.g. 80GiB"
    )
    p.add_argument("--reserve", type=parse_bytes, default=0, help="bytes kept free (allocator, workspace)")
    p.add_argument(
        "--state-bytes-per-param",
        type=float,
        default=None,
        help="static bytes per parameter (default 2 x dtype size + 8 for Adam)",
    )
    p.add_argument("--round-to", type=int, default=1, help="round C down to a multiple of this")
    p.add_argument(
        "--p2p",
        action="store_true",
        help="measure the P2P link between two gloo processes on 127.0.0.1 and use it as the ring bandwidth",
    )
    p.add_argument(
        "--p2p-bytes", type=parse_bytes, default=4 * 2**20, help="bytes per P2P exchange (default 4MiB)"
    )
    p.add_argument(
        "--bandwidth-intra", type=parse_bytes, default=None, help="ring bytes/s inside a node, e.g. 150GB"
    )
    p.add_argument(
        "--bandwidth-inter", type=parse_bytes, default=None, help="ring bytes/s between nodes, e.g. 25GB"
    )
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks per node (ring placement)")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="profile one HDP rank of N devices (a tensor-parallel group): N processes, started here "
        "(gloo on the CPU, NCCL on CUDA) unless run under torchrun with N ranks; the model is sharded by "
        "parallelize_llama; T is the group's time, Act one lane's bytes, C per HDP rank",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="process-group timeout, seconds (--tensor-parallel)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", "-o", default="cost_model.json", help="where to write the cost-model file")
    return p  # fmt: skip


def _join_torchrun(tensor_parallel: int, device: str | None, timeout_s: float) -> None:
    """Under torchrun (``WORLD_SIZE`` set), join its process group: the profiler uses it as it is."""
    if tensor_parallel > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _join_torchrun(args.tensor_parallel, args.device, args.timeout)
        model, real_layers, real_params = _build_model(args.model, args.profile_layers)
        profile = run_profile(
            model,
            args.lengths,
            args.device,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            num_layers=real_layers,
            param_count=real_params,
            memory_budget=args.memory_budget,
            state_bytes_per_param=args.state_bytes_per_param,
            reserve_bytes=args.reserve,
            round_to=args.round_to,
            warmup=args.warmup,
            repeats=args.repeats,
            name=f"profiled-{args.model}",
            p2p=args.p2p,
            p2p_bytes=args.p2p_bytes,
            bandwidth_intra=args.bandwidth_intra,
            bandwidth_inter=args.bandwidth_inter,
            ranks_per_node=args.ranks_per_node,
            tensor_parallel=args.tensor_parallel,
            timeout_s=args.timeout,
        )
    except (ProfileError, ValueError) as err:
        print(f"bytescale-profile: error: {err}", file=sys.stderr)
        return 2
    if args.tensor_parallel > 1 and dist.is_initialized() and dist.get_rank() != 0:
        return 0  # under torchrun every rank has the profile; rank 0 prints and writes it
    print(profile.summary())
    path = profile.save(args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
