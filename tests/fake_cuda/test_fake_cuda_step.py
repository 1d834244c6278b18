"""One HDP step's micro-batches on fake CUDA, after Lightning's own ``batch_to_device``.

A two-rank plan gives each rank a ring micro-batch (one long sequence over ranks 0 and 1) and
a local one.  Each rank's ``StepBatch`` goes through ``ByteScaleStrategy.batch_to_device``
(Lightning's ``move_data_to_device``, which moves every tensor field of the dataclasses; with
and without a LightningModule's transfer hooks) to a fake CUDA device.  Then:

* the layouts are still host metadata (a tuple of ints), the token tensors are on the device;
* every micro-batch runs through the engine's :func:`run_micro_batch` under bf16 autocast
  with our Llama and with a Hugging Face Llama (``attn_implementation="bytescale"``) --
  forwards only, autograd cannot run on fake CUDA -- with no host synchronisation (counted per
  micro-batch), PyTorch's flash kernel in the ring (K/V blocks sent in bfloat16) and
  ``varlen_attn`` once per layer in the local micro-batch;
* the same step with the ring item in Ulysses mode: ``varlen_attn`` once per layer there too,
  two exchanges per layer, every send and receive a CUDA tensor in bfloat16.

The ring's P2P is an echo (``tests/_fake_cuda.py``: ``fake_p2p``), so the ring set-up runs its
P2P path for this rank of a world of two: the cache key, the rank checks, the block plans.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from _fake_cuda import CUDA, EchoExchange, fake_cuda, fake_p2p

from lightning_bytescale import ByteScaleStrategy
from lightning_bytescale.engine.attention_check import AttentionVerdict
from lightning_bytescale.engine.executor import run_micro_batch
from lightning_bytescale.engine.micro_batch import build_step
from lightning_bytescale.models import LlamaConfig, LlamaModel
from lightning_bytescale.planner import make_plan

LENGTHS = [40, 7, 5]  # one ring item over ranks (0, 1), a local micro-batch on each
VOCAB = 64
VARLEN, FLASH = "torch_attn::_varlen_attn", "aten::_flash_attention_forward"
SLOW = ("aten::_efficient_attention_forward", "aten::_safe_softmax")  # float32 / per-sequence paths


@pytest.fixture(scope="module")
def plan():
    return make_plan(LENGTHS, world_size=2, capacity=32)


def _step(plan, rank):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, VOCAB, (s,), generator=g) for s in LENGTHS]
    return build_step(plan, rank, lambda j: seqs[j])


SHAPE = dict(dim=64, heads=4, kv_heads=2, layers=2)  # head size 16
HF_NAMES = dict(
    dim="hidden_size", heads="num_attention_heads", kv_heads="num_key_value_heads", layers="num_hidden_layers"
)


def _llama():
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig.preset("tiny", vocab=VOCAB, **SHAPE))


def _hf_llama():
    """The same shape as a Hugging Face Llama, under attn_implementation="bytescale" (HFCausalLM sets it)."""
    transformers = pytest.importorskip("transformers")
    from lightning_bytescale.hf import HFCausalLM

    names = {HF_NAMES[k]: v for k, v in SHAPE.items()}
    module = HFCausalLM(
        transformers.AutoConfig.for_model("llama", vocab_size=VOCAB, intermediate_size=64, **names)
    )
    module.configure_model()
    return module


class LightningLlama(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = _llama()


def _run_step(mode, model, step, rank):
    """Each micro-batch through run_micro_batch under bf16 autocast; (ring?, syncs, ops, sent, exchanges) per micro-batch.

    The attention check counts every micro-batch's calls (host integers: no synchronisation).
    """
    rows = []
    counted = AttentionVerdict()
    with fake_p2p(rank, 2) as sent:
        for mb in step.micro_batches:
            mode.syncs.clear()
            mode.ops.clear()
            sent.clear()
            EchoExchange.OPS.clear()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, _ = run_micro_batch(model, mb, backward=lambda loss: None, attention=counted)
            assert loss.shape == () and loss.device == CUDA
            rows.append(
                (
                    mb.layout.ring is not None,
                    list(mode.syncs),
                    dict(mode.ops),
                    list(sent),
                    list(EchoExchange.OPS),
                )
            )
    assert counted == AttentionVerdict(checked=len(step.micro_batches))  # every forward called attention
    return rows


def _ulysses(plan):
    """The plan with its ring item in Ulysses mode."""
    plan = copy.deepcopy(plan)
    for mbs in plan.ranks:
        for mb in mbs:
            if mb.ring is not None:
                mb.mode = "ulysses"
    return plan


@pytest.mark.parametrize("with_module", [False, True], ids=["strategy", "module-hooks"])
def test_lightning_batch_to_device_leaves_the_layouts_on_the_host(plan, with_module):
    strategy = ByteScaleStrategy()
    if with_module:
        strategy.connect(LightningLlama())  # batch_to_device then runs the module's transfer hooks
    for rank in (0, 1):
        step = _step(plan, rank)
        with fake_cuda():
            moved = strategy.batch_to_device(step, CUDA)
            for before, after in zip(step.micro_batches, moved.micro_batches):
                assert after.input_ids.device == CUDA and after.labels.device == CUDA
                assert after.layout == before.layout and isinstance(after.layout.cu_seqlens, tuple)
                assert not any(isinstance(v, torch.Tensor) for v in vars(after.layout).values())


@pytest.mark.parametrize("item_mode", ["ring", "ulysses"])
@pytest.mark.parametrize("build", [_llama, _hf_llama], ids=["llama", "hf-llama"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_on_fake_cuda_has_no_host_sync_and_the_fused_kernels(plan, build, rank, item_mode):
    strategy = ByteScaleStrategy()
    model = build()
    layers = SHAPE["layers"]
    if item_mode == "ulysses":
        plan = _ulysses(plan)
    with fake_cuda() as mode:
        moved = strategy.batch_to_device(_step(plan, rank), CUDA)
        rows = _run_step(mode, mode.module_to_cuda(copy.deepcopy(model)), moved, rank)
    assert [ring for ring, *_ in rows] == [True, False]
    for ring, syncs, ops, sent, exchanges in rows:
        assert syncs == [], syncs  # zero host synchronisations in the micro-batch
        assert all(ops.get(name, 0) == 0 for name in SLOW), ops
        if ring and item_mode == "ulysses":  # two exchanges and the local kernel per layer, no ring transfer
            assert ops.get(VARLEN) == layers and ops.get(FLASH, 0) == 0 and sent == []
            assert [len(x) for x in exchanges] == [
                6,
                2,
            ] * layers  # q, k, v to the other member; the output back
            assert all(op.device == CUDA and op.dtype == torch.bfloat16 for x in exchanges for op in x)
        elif ring:  # ring of 2: one block against each member per layer, one K/V transfer per layer
            assert ops.get(FLASH) == 2 * layers and ops.get(VARLEN, 0) == 0
            slots = int(moved.micro_batches[0].layout.cu_seqlens[-1])
            kv_block = (
                2 * slots * SHAPE["kv_heads"] * (SHAPE["dim"] // SHAPE["heads"]) * 2
            )  # [2, T, Hkv, D] bf16
            assert sent == [(torch.bfloat16, kv_block)] * layers
        else:
            assert ops.get(VARLEN) == layers and ops.get(FLASH, 0) == 0 and exchanges == []
