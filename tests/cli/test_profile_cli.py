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
