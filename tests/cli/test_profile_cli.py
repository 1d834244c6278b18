"""``bytescale-profile`` on this CPU: options in, the cost-model file out, bad input refused."""

from __future__ import annotations

import math

import pytest

from lightning_bytescale.cli.profile import main, parse_bytes
from lightning_bytescale.profiler import load_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_byte_sizes():
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30) and parse_bytes("8e9") == 8 * 10**9
    assert parse_bytes("512 MB") == 512 * 10**6


def test_command_line(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["--model", "tiny", "--lengths", "16,32,48", "--device", "cpu", "--repeats", "1",
               "--warmup", "0", "--memory-budget", "64MiB", "--round-to", "8", "-o", str(out),
               "--bandwidth-intra", "150GB", "--bandwidth-inter", "25GB", "--ranks-per-node", "8"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert (
        "Act(s)" in text and "capacity C" in text and "resid" in text and "ring links: intra 150.000" in text
    )
    prof = load_profile(out)
    assert prof.capacity % 8 == 0 and math.isfinite(prof.cost_model.a)
    cm = prof.cost_model
    assert (cm.bandwidth_intra, cm.bandwidth_inter, cm.ranks_per_node) == (150e9, 25e9, 8)
    assert "p2p" not in prof.notes  # measured only with --p2p
    assert main(["--model", "tiny", "--lengths", "16,32", "-o", str(out)]) == 2
    with pytest.raises(SystemExit):
        main(["--memory-budget", "lots"])


@pytest.mark.timeout(300)
def test_tensor_parallel_profiles_one_hdp_rank_of_two_processes(tmp_path, capsys):
    """--tensor-parallel 2 on this CPU: the command starts the two gloo processes itself and the file says so."""
    out = tmp_path / "tp.json"
    rc = main(["--model", "tiny", "--lengths", "16,32,48", "--device", "cpu", "--repeats", "1", "--warmup", "0",
               "--memory-budget", "64MiB", "--tensor-parallel", "2", "--timeout", "120", "-o", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "one tensor-parallel group of 2" in text and "tokens per HDP rank" in text
    prof = load_profile(out)
    assert prof.tensor_parallel == 2 and prof.cost_model.tensor_parallel == 2
    assert (
        prof.cost_model.kv_bytes_per_token_per_layer == 2 * 1 * 8 * 4
    )  # one of the 2 KV heads of 8, float32
    one = tmp_path / "one.json"
    assert main(["--model", "tiny", "--lengths", "16,32,48", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                 "--memory-budget", "64MiB", "-o", str(one)]) == 0  # fmt: skip
    assert prof.act_bytes[0] < load_profile(one).act_bytes[0]
    assert main(["--model", "tiny", "--lengths", "16,32,48", "--tensor-parallel", "0", "-o", str(out)]) == 2


def _torchrun_rank(rank: int, port: int, out: str) -> None:
    """One rank as torchrun starts it: the environment names the group, the command joins it."""
    import os

    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    rc = main(["--model", "tiny", "--lengths", "16,32,48", "--device", "cpu", "--repeats", "1", "--warmup", "0",
               "--tensor-parallel", "2", "--timeout", "120", "-o", f"{out}/rank{rank}.json"])  # fmt: skip
    assert rc == 0 and dist.is_initialized()  # it joined the group instead of starting processes
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_under_torchrun_the_command_joins_its_group_and_rank_zero_writes_the_file(tmp_path):
    from _ranks import free_port, run_ranks

    run_ranks(_torchrun_rank, 2, free_port(), str(tmp_path), timeout_s=240)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["rank0.json"]
    assert load_profile(tmp_path / "rank0.json").tensor_parallel == 2
