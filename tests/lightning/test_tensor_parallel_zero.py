"""ZeRO-1 and ZeRO-2 with ``tensor_parallel_size=2`` on ``(2, 2)``: the optimizer state (and with ZeRO-2 the gradients) split over each lane's HDP ranks, exact.

4 CPU ranks (gloo, fork launcher, float64), the module, data and reference of
``test_tensor_parallel_strategy.py`` (AdamW with weight decay, clipping in every step, the balance
planner with rings, one step in which HDP rank 1 runs no micro-batch).  Parameters and logged
losses equal one process to 1e-10; each rank keeps AdamW state only for the parameters it owns
(the two HDP ranks of a lane own disjoint sets that cover all of them); with ZeRO-2 a rank holds,
after the sync (in ``on_after_backward`` and at the optimizer step), gradients for exactly the
parameters it owns, with ZeRO-1 for all of them; a consolidated and a sharded checkpoint
(``"auto"``: each owner writes its own state) from step 3 resume exactly to step 6, each rank
keeping the state of what it owns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_tensor_parallel_strategy import IDLE_STEP, TOLERANCE, TPFSDPLM, TPLM, _check, _fit, _resume
from torch.distributed.checkpoint import FileSystemReader

from lightning_bytescale.lightning.checkpoint import read_consolidated

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


@pytest.mark.parametrize(
    ("zero", "checkpoint_format"), [(1, "consolidated"), (1, "auto"), (2, "consolidated"), (2, "auto")]
)
def test_zero_on_2x2_resumes_exactly(tmp_path, zero, checkpoint_format):
    """``"auto"`` with ZeRO is a sharded folder: each owner writes its parameters' state, nothing is gathered."""
    ckpt = _resume(tmp_path, TPLM, (("2x2", 4, {"zero": zero}),), checkpoint_format, zero=zero)
    if checkpoint_format == "consolidated":
        saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["state"]
    else:
        saved = read_consolidated(ckpt)["optimizer_states"][0]["state"]
        owned = [json.loads((tmp_path / "first" / f"probe_{r}.json").read_text())["owned"] for r in range(4)]
        metadata = FileSystemReader(ckpt).read_metadata()
        for index, storage in metadata.storage_data.items():
            if index.fqn.startswith("optimizer_0."):  # written by a rank that owns that state
                name = index.fqn.removeprefix("optimizer_0.").rsplit(".", 1)[0]
                writer = int(storage.relative_path.split("_")[2])
                assert name in owned[writer], (index.fqn, storage.relative_path)
    assert len(saved) == len(list(TPLM(False).parameters())), (
        "the checkpoint must hold every parameter's state"
    )


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_fsdp2_is_refused_at_set_up(tmp_path, zero):
    from torch.multiprocessing.spawn import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match=rf"zero={zero}\) cannot run with fully_shard"):
        _fit(tmp_path, 2, steps=1, tied=False, module=TPFSDPLM, zero=zero)
