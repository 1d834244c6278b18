"""ZeRO-1 and ZeRO-2 with ``tensor_parallel_size=2`` on ``(2, 2)``: the optimizer state (and with ZeRO-2 the gradients) split over each lane's HDP ranks, exact.

4 CPU ranks (gloo, fork launcher, float64), the module, data and reference of
``test_tensor_parallel_strategy.py`` (AdamW with weight decay, clipping in every step, the balance
planner with rings, one step in which HDP rank 1 runs no micro-batch).  Parameters and logged
losses equal one process to 1e-10; each rank keeps AdamW state only for the parameters it owns
(the two HDP ranks of a lane own disjoint sets that cover all of them); with ZeRO-2 a rank holds,
after the sync (in ``on_after_backward`` and at the optimizer step), gradients for exactly the
parameters it owns, with ZeRO-1 for all of them; a consolidated checkpoint from step 3 resumes
exactly to step 6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_tensor_parallel_strategy import IDLE_STEP, TOLERANCE, TPFSDPLM, TPLM, _check, _fit, _reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]


class StateRecordingLM(TPLM):
    """Writes, per rank, the parameters its optimizer keeps state for and those with a gradient after each sync."""

    def on_train_start(self) -> None:
        self.held: list[list[str]] = []  # per step: names with a gradient in on_after_backward
        self.stepped: list[list[str]] = []  # per step: the same just before the optimizer step

    def _with_grad(self) -> list[str]:
        return sorted(n for n, p in self.named_parameters() if p.grad is not None)

    def on_after_backward(self) -> None:
        self.held.append(self._with_grad())

    def on_before_optimizer_step(self, optimizer) -> None:
        self.stepped.append(self._with_grad())

    def on_train_end(self) -> None:
        opt = self.trainer.optimizers[0]
        names = {id(p): n for n, p in self.named_parameters()}
        kept = sorted(names[id(p)] for p in opt.state)
        out = Path(self.trainer.default_root_dir) / f"state_{self.global_rank}.json"
        record = {"kept": kept, "all": sorted(names.values()), "held": self.held, "stepped": self.stepped}
        out.write_text(json.dumps(record))


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_on_2x2_equals_one_process_and_splits_the_state_over_each_lanes_hdp_ranks(tmp_path, zero):
    steps = 4  # includes IDLE_STEP
    _fit(tmp_path, 4, steps=steps, tied=False, module=StateRecordingLM, zero=zero)
    result = _check(tmp_path, 4, steps, tied=False)
    print(
        f"(2, 2) ZeRO-{zero}: max parameter difference {result['param']:.3e}, "
        f"max loss difference {result['loss']:.3e}"
    )
    assert result["param"] <= TOLERANCE, result["param"]
    assert result["loss"] <= TOLERANCE, result["loss"]
    assert result["reports"][0]["rows"][IDLE_STEP]["num_micro_batches"][1] == 0
    states = [json.loads((tmp_path / f"state_{r}.json").read_text()) for r in range(4)]
    for lane in (0, 1):
        a, b = states[lane]["kept"], states[2 + lane]["kept"]  # HDP ranks 0 and 1 of this lane
        assert a and b and not set(a) & set(b), (a, b)
        assert sorted(a + b) == states[lane]["all"]
    assert states[0]["kept"] == states[1]["kept"]  # the same split in both lanes
    for r, state in enumerate(states):
        # after the sync: ZeRO-2 keeps only the owned gradients (every parameter is trained in
        # every step, so the owner has each of its own), ZeRO-1 all of them
        expected = state["kept"] if zero == 2 else state["all"]
        assert state["held"] == [expected] * steps, (r, state["held"])
        assert state["stepped"] == [expected] * steps, (r, state["stepped"])


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_on_2x2_resumes_exactly_from_a_consolidated_checkpoint(tmp_path, zero):
    total = 6
    first = tmp_path / "first"
    _fit(first, 4, steps=3, tied=False, data_steps=total, ckpt_every=3, zero=zero)
    (ckpt,) = (first / "ckpt").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]
    assert len(saved) == len(list(TPLM(False).parameters())), (
        "the checkpoint must hold every parameter's state"
    )
    expected, losses, _ = _reference(total, tied=False)
    out = tmp_path / "resumed"
    _fit(out, 4, steps=total, tied=False, data_steps=total, resume=ckpt, zero=zero)
    worst_param = worst_loss = 0.0
    for r in range(4):
        got = torch.load(out / f"params_{r}.pt")
        worst_param = max(worst_param, max((got[k] - v).abs().max().item() for k, v in expected.items()))
        rows = json.loads((out / f"report_{r}.json").read_text())["rows"]
        assert [row["step"] for row in rows] == list(range(3, total))
        worst_loss = max(worst_loss, max(abs(row["logged"] - losses[row["step"]]) for row in rows))
    print(f"resume ZeRO-{zero} (2, 2): max parameter difference {worst_param:.3e}, loss {worst_loss:.3e}")
    assert worst_param <= TOLERANCE and worst_loss <= TOLERANCE, (worst_param, worst_loss)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_fsdp2_is_refused_at_set_up(tmp_path, zero):
    from torch.multiprocessing.spawn import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match=rf"zero={zero}\) cannot run with fully_shard"):
        _fit(tmp_path, 2, steps=1, tied=False, module=TPFSDPLM, zero=zero)
