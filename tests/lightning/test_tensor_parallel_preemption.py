"""Preemption with ``tensor_parallel_size=2`` on ``(2, 2)``: SIGTERM to one rank saves one checkpoint that resumes exactly.

4 CPU ranks (gloo, fork launcher, float64), the module and reference of
``test_tensor_parallel_strategy.py``.  Global rank 1 alone (lane 1 of HDP rank 0) signals itself
inside a step.  Its lane's data-parallel all-reduce tells rank 3 (lane 1 of HDP rank 1); the
lanes' all-reduce tells ranks 0 and 2.  So every rank saves the same ``hpc_ckpt_1.ckpt`` after
that step (the DTensor gathers together) and exits with 143; resuming from it on ``(2, 2)`` ends
where a run that never stopped ends (parameters and losses to 1e-10).  The same with ``zero=2``
(the flag rides in the scalars' all-reduce after the reduces to the gradients' owners).
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from test_tensor_parallel_strategy import TOLERANCE, TPLM, _fit, _reference
from torch.multiprocessing.spawn import ProcessExitedException

from lightning_bytescale.lightning.checkpoint import is_sharded_checkpoint, read_consolidated
from lightning_bytescale.lightning.preemption import EXIT_PREEMPTED

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

SIGNAL_AT, TOTAL = 1, 4


class SignalledOnRank1(TPLM):
    """Global rank 1 sends itself SIGTERM in the first micro-batch of step ``SIGNAL_AT``."""

    def training_step(self, mb, batch_idx):
        if self.global_rank == 1 and self.global_step == SIGNAL_AT and not getattr(self, "_sent", False):
            self._sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # the strategy's handler only sets its flag
        return super().training_step(mb, batch_idx)


@pytest.mark.parametrize("zero", [0, 2])
def test_sigterm_to_one_rank_of_2x2_saves_one_checkpoint_on_every_rank_and_resumes_exactly(tmp_path, zero):
    first = tmp_path / "first"
    with pytest.raises(ProcessExitedException) as info:
        _fit(first, 4, steps=TOTAL, tied=False, module=SignalledOnRank1, data_steps=TOTAL, zero=zero)
    assert info.value.exit_code == EXIT_PREEMPTED, info.value
    saved = sorted(p.name for p in first.glob("hpc_ckpt_*"))
    assert saved == ["hpc_ckpt_1.ckpt"], saved
    path = first / "hpc_ckpt_1.ckpt"  # zero=2 splits the state over the HDP ranks: "auto" writes a folder
    assert is_sharded_checkpoint(path) == (zero == 2)
    ckpt = read_consolidated(path) if zero == 2 else torch.load(path, weights_only=False)
    assert ckpt["global_step"] == SIGNAL_AT + 1  # after the step in which rank 1 was signalled
    assert not any(first.glob("report_*.json")), "a rank trained on past the agreed step"

    resumed = tmp_path / "resumed"
    _fit(resumed, 4, steps=TOTAL, tied=False, data_steps=TOTAL, resume=first / "hpc_ckpt_1.ckpt", zero=zero)
    expected, losses, _ = _reference(TOTAL, tied=False)
    worst_param = worst_loss = 0.0
    for r in range(4):
        got = torch.load(resumed / f"params_{r}.pt")
        worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
        rows = json.loads((resumed / f"report_{r}.json").read_text())["rows"]
        assert [row["step"] for row in rows] == list(range(SIGNAL_AT + 1, TOTAL))
        worst_loss = max(worst_loss, max(abs(row["logged"] - losses[row["step"]]) for row in rows))
    print(
        f"preempted (2, 2) zero={zero} resumed: max parameter difference {worst_param:.3e}, loss {worst_loss:.3e}"
    )
    assert worst_param <= TOLERANCE and worst_loss <= TOLERANCE, (worst_param, worst_loss)
