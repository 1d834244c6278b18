"""Memory per GPU of LLaMA-7B, 13B and 30B at C = 8K tokens per HDP rank, by tensor-parallel size.

Run: ``python benchmarks/tp_memory_arithmetic.py`` (about a minute); writes
``benchmarks/results/tp_memory_arithmetic.json``.  Not run in CI.

Weights, gradients and optimizer state are counted from the parameter shapes that
:func:`lightning_bytescale.parallel.parallelize_llama` leaves on one TP rank (projections and
untied embeddings split over the ``t`` lanes, norms whole).  Activations are *measured*: two
gloo ranks run one and two layers of each model at its real width, in bfloat16, as
``tensor_parallel`` 1 and 2, on a few tokens, and count the bytes autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once) with an attention that saves
what a flash kernel saves (q, k, v, the output and the float32 log-sum-exp).  Per layer and
token that is ``R + S / t`` (``R`` replicated on every lane, ``S`` split over them), fitted from
the two sizes and checked at ``t = 2``; the rest of the model (embedding output, final norm,
head input, float32 log-softmax of the whole vocabulary: our TP gathers the logits) is measured
the same way.  Both scale linearly with the tokens, so the table multiplies them by C.

Assumptions of the table: bfloat16 weights; gradients in float32 (bfloat16 halves them); AdamW
with float32 master weights and both moments (12 bytes a parameter) sharded over the HDP ranks
of a 64-GPU job by ZeRO-1 (``d = 64 / t``); no activation offload or recomputation; nothing for
the allocator's fragmentation, communication buffers or the CUDA context.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _common as common
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

C = 8192
GPUS = 64
TOKENS = 32  # measured on this many tokens; everything saved scales with them
GIB = 2**30
MODELS = ("7b", "13b", "30b")
TP_SIZES = (1, 2, 4, 8)


class _FlashLike(torch.autograd.Function):
    """Causal attention (one sequence) that saves what a flash kernel saves: q, k, v, out, lse."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[override]
        from lightning_bytescale.engine.reference import causal_attention

        with torch.no_grad():
            out = causal_attention(q, k, v)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise RuntimeError("only the forward's saved tensors are measured")


def _saved_bytes(model, tokens: int) -> int:
    seen: dict[tuple[int, int], int] = {}
    weights = {
        (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
        for p in model.parameters()
    }

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() in weights:  # a parameter (or a view of one): counted as weights
            return t
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab, (tokens,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, torch.arange(tokens))
        logits.float().log_softmax(-1).sum()  # the loss's float32 log-softmax
    return sum(seen.values())


def _measure(rank: int, port: int, out: str) -> None:
    from lightning_bytescale.models import LlamaConfig, LlamaModel
    from lightning_bytescale.parallel import ParallelDims, parallelize_llama

    torch.set_num_threads(1)
    common.init_gloo(rank, 2, port, timeout_s=600)
    pmesh = ParallelDims(2, tensor_parallel=2).build("cpu")
    rows: dict = {}
    for name in MODELS:
        for layers in (1, 2):
            cfg = LlamaConfig.preset(name, layers=layers)
            for tp in (1, 2):
                if tp == 1 and rank != 0:
                    continue  # one process measures the unsharded model
                with torch.device("meta"):
                    model = LlamaModel(cfg, attention_fn=_FlashLike.apply).to(torch.bfloat16)
                if tp == 2:
                    parallelize_llama(model, pmesh.tp_mesh)
                model.to_empty(device="cpu")  # the values do not matter, only what is saved
                rows[f"{name}/{layers}/{tp}"] = _saved_bytes(model, TOKENS)
                del model
    common.write_rank(out, "saved", rank, rows)
    dist.destroy_process_group()


def _params_per_rank(cfg, t: int) -> int:
    """Parameters one TP rank holds under ``parallelize_llama``."""
    hd = cfg.head_dim
    attn = cfg.dim * hd * (2 * cfg.heads + 2 * cfg.kv_heads) // t
    mlp = 3 * cfg.dim * cfg.ffn_dim // t
    norms = 2 * cfg.dim
    emb = cfg.vocab * cfg.dim * (1 if cfg.tie_embeddings else 2)
    emb = emb if cfg.tie_embeddings else emb // t
    return cfg.layers * (attn + mlp + norms) + emb + cfg.dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp_memory_arithmetic.json"))
    args = parser.parse_args()
    from lightning_bytescale.models import LlamaConfig
    from lightning_bytescale.parallel import TensorParallelHeadsError, check_heads

    tmp = common.parts_folder(args.out)
    saved = common.run_ranks(_measure, (common.free_port(), str(tmp)), 2, tmp, "saved")[0]
    common.remove_parts(tmp)
    result: dict = {
        "what": "memory per GPU at C tokens per HDP rank, by tensor-parallel size (weights bf16, grads fp32)",
        "C": C,
        "gpus": GPUS,
        "measured_tokens": TOKENS,
        "assumptions": __doc__.split("Assumptions of the table: ")[1].split("\n\n")[0].replace("\n", " "),
        "machine": common.machine(),
        "models": {},
    }
    for name in MODELS:
        cfg = LlamaConfig.preset(name)
        layer = {tp: (saved[f"{name}/2/{tp}"] - saved[f"{name}/1/{tp}"]) / TOKENS for tp in (1, 2)}
        rest = {tp: saved[f"{name}/1/{tp}"] / TOKENS - layer[tp] for tp in (1, 2)}
        sharded = 2 * (layer[1] - layer[2])  # R + S = layer[1], R + S / 2 = layer[2]
        replicated = layer[1] - sharded
        entry: dict = {
            "shape": {k: getattr(cfg, k) for k in ("vocab", "dim", "layers", "heads", "kv_heads", "ffn_dim")},
            "params": cfg.num_params(),
            "activation_bytes_per_token_per_layer": {"replicated": replicated, "split_over_lanes": sharded},
            "activation_bytes_per_token_outside_layers": rest,
            "by_tp": {},
        }
        for t in TP_SIZES:
            try:
                check_heads(cfg.heads, cfg.kv_heads, t)
            except TensorParallelHeadsError as err:
                entry["by_tp"][str(t)] = {"refused": str(err).split(". Use")[0]}
                continue
            p = _params_per_rank(cfg, t)
            d = GPUS // t
            acts = C * cfg.layers * (replicated + sharded / t) + C * rest[2 if t > 1 else 1]
            row = {
                "params_per_gpu": p,
                "weights_gib": 2 * p / GIB,
                "grads_fp32_gib": 4 * p / GIB,
                "optimizer_zero1_gib": 12 * p / d / GIB,
                "activations_gib": acts / GIB,
            }
            row["total_gib"] = sum(
                row[k] for k in ("weights_gib", "grads_fp32_gib", "optimizer_zero1_gib", "activations_gib")
            )
            entry["by_tp"][str(t)] = row
        result["models"][name] = entry
        print(
            name,
            {t: round(r.get("total_gib", float("nan")), 1) for t, r in entry["by_tp"].items()},
            flush=True,
        )
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
