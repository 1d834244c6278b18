"""``cost_model="auto"`` on two gloo ranks: the lengths split over them, one model bit for bit on
both, the links measured between them (on every start: they belong to the cluster), and the
second start's layer figures read back on both (one forked run)."""

from __future__ import annotations

import datetime
import multiprocessing
import socket
import traceback

import pytest

pytestmark = pytest.mark.multiprocess
WORLD = 2


def _bits(cost) -> list:
    return [float(v).hex() if isinstance(v, float) else v for v in cost.to_json_dict().values()]


def _rank(rank: int, port: int, cache: str, out) -> None:
    try:
        import torch
        import torch.distributed as dist

        from lightning_bytescale.models import LlamaConfig, LlamaModel
        from lightning_bytescale.profiler import auto as auto_module

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        measured: list[list[int]] = []
        real = auto_module._measure_lengths
        auto_module._measure_lengths = lambda setup, lengths: (
            measured.append(list(lengths)),
            real(setup, lengths),
        )[1]
        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig.preset("tiny"))
        first = auto_module.auto_cost_model(model, capacity=256, measure_links=True, cache_dir=cache)
        second = auto_module.auto_cost_model(model, capacity=256, measure_links=True, cache_dir=cache)
        out.put((rank, "ok", {
            "measured": measured, "first": _bits(first.cost_model), "second": _bits(second.cost_model),
            "compute": [_bits(m.with_(bandwidth_intra=None, bandwidth_inter=None)) for m in (first.cost_model, second.cost_model)],
            "from_cache": (first.from_cache, second.from_cache), "links": first.cost_model.bandwidth_intra,
            "line": first.line,
        }))  # fmt: skip
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def test_two_ranks_measure_their_share_and_plan_with_the_same_model(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (status, value)) for r, status, value in (out.get(timeout=120) for _ in range(WORLD)))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    for r in range(WORLD):
        assert got[r][0] == "ok", got[r][1]
    r0, r1 = got[0][1], got[1][1]
    assert r0["measured"] == [[32, 128]] and r1["measured"] == [
        [64, 256]
    ]  # split, then nothing on the second start
    assert r0["first"] == r1["first"] and r0["second"] == r1["second"]  # bit for bit on both ranks
    assert r0["compute"][0] == r0["compute"][1]  # read back; only the links are measured again
    assert r0["from_cache"] == r1["from_cache"] == (False, True)
    assert r0["links"] is not None and r0["links"] == r1["links"] > 0
    assert "over 2 ranks" in r0["line"] and "(measured)" in r0["line"]
    assert len(list(tmp_path.glob("auto-*.json"))) == 1
