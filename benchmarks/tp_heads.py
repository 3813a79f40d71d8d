"""Per-rank attention time of SmolLM2-135M's attention: the former unequal tp=2 split against the balanced tp=3 one.

SmolLM2-135M has 9 query and 3 key/value heads (hidden 576, head_dim 64). hftrain used to run it at tp=2 by dealing
out whole key/value groups, 6 query + 2 key/value heads on rank 0 and 3 + 1 on rank 1 (``Split.counts``); tp=2 is
now refused and the model runs at tp=3, 3 + 1 heads per rank (``hftrain.parallel.plans.grouped_query_split``).

Each rank times its own work in one transformers ``LlamaAttention`` (sdpa) forward + backward: its q/k/v
projections, attention over its heads and its partial ``o_proj`` product. The ``o_proj`` all-reduce is left out
(the same ``s·b·h`` in both splits): the ranks take turns, so each runs alone on the machine's cores with one
thread, and the slowest rank sets the step time of a tensor-parallel layer. The ratios are against the unsplit
attention timed the same way in the same process.

Also prints ``hftrain plan``'s tensor-parallel rows for GPT-2 small (12 heads) and medium (16 heads), whose
50,257-token vocabulary is padded to a multiple of tp (no row at all before padding).

Run from the repository root::

    python benchmarks/tp_heads.py                # seq 256, batch 4, 20 timed repeats per rank (~1 min)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.*` and an uninstalled hftrain

HEAD_DIM = 64


def _config():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=HEAD_DIM,
                         intermediate_size=1536, vocab_size=49152, num_hidden_layers=1)  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


def _unequal_split(attention, group, tp: int) -> None:
    """The former split: whole key/value groups per rank, rank r one more while some are left (6+3 / 2+1 at tp=2)."""
    from hftrain.parallel import ColumnParallelLinear, RowParallelLinear

    kv_per_rank = [3 // tp + (r < 3 % tp) for r in range(tp)]
    q = tuple(n * 3 * HEAD_DIM for n in kv_per_rank)
    kv = tuple(n * HEAD_DIM for n in kv_per_rank)
    attention.q_proj = ColumnParallelLinear(attention.q_proj, tp_group=group, counts=q)
    attention.k_proj = ColumnParallelLinear(attention.k_proj, tp_group=group, counts=kv)
    attention.v_proj = ColumnParallelLinear(attention.v_proj, tp_group=group, counts=kv)
    attention.o_proj = RowParallelLinear(attention.o_proj, tp_group=group, counts=q)


def _timed(attention, hidden, position_embeddings, repeats: int) -> float:
    """Median seconds of one forward + backward."""

    times = []
    for i in range(repeats + 3):  # 3 warm-up rounds
        start = time.perf_counter()
        out, _ = attention(hidden, position_embeddings=position_embeddings, attention_mask=None)
        out.sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
        attention.zero_grad(set_to_none=True)
        hidden.grad = None
    return statistics.median(times)


def _measure(split: str, seq: int, batch: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from hftrain.parallel import parallelize_layer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, tp = dist.get_rank(), dist.get_world_size()
    config = _config()
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    hidden = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    position_embeddings = LlamaRotaryEmbedding(config)(hidden, torch.arange(seq)[None])
    whole = _timed(layer.self_attn, hidden, position_embeddings, repeats) if rank == 0 else None
    if split == "unequal":
        _unequal_split(layer.self_attn, dist.group.WORLD, tp)  # 3 query heads per key/value head on both ranks
    else:
        parallelize_layer(layer, config, tp_group=dist.group.WORLD)
    attention = layer.self_attn
    # Local work only: the row-parallel partial product without its all-reduce, and without the region's entry
    # (f: an all-reduce of the input gradient); both collectives move the same s·b·h in either split.
    attention.o_proj.forward = attention.o_proj._matmul
    attention._forward_pre_hooks.clear()
    heads = (attention.q_proj.weight.shape[0] // HEAD_DIM, attention.k_proj.weight.shape[0] // HEAD_DIM)
    mine = None
    for turn in range(tp):  # one rank at a time: each has the cores to itself
        dist.barrier()
        if rank == turn:
            mine = _timed(attention, hidden, position_embeddings, repeats)
    every: list = [None] * tp
    dist.all_gather_object(every, {"rank": rank, "heads": heads, "seconds": mine})
    dist.barrier()
    dist.destroy_process_group()
    return {"whole": whole, "ranks": every}


def _plan_rows() -> list[str]:
    from hftrain.plan import Hardware, Workload, model_from_sizes, plan

    lines = ["| model | row | model states per GPU (GB) | fits 80 GB |", "|---|---|---|---|"]
    for name, sizes in (("GPT-2 small", {"layers": 12, "hidden": 768, "heads": 12}),
                        ("GPT-2 medium", {"layers": 24, "hidden": 1024, "heads": 16})):  # fmt: skip
        model = model_from_sizes(parameters=None, vocab=50_257, **sizes)
        rows = plan(model, Hardware(gpus_per_node=8, gpu_memory=80e9), Workload(micro_batch=8, seq=1024)).rows
        for row in rows:
            if row.label.startswith("megatron") and row.pp == 1:
                lines.append(f"| {name} | {row.label} | {row.model_states / 1e9:.2f} | {row.fits} |")
    return lines


def main() -> None:
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    kwargs = {"seq": args.seq, "batch": args.batch, "repeats": args.repeats}
    print(f"SmolLM2-135M attention (9 q / 3 kv heads, hidden 576), seq {args.seq}, batch {args.batch}, "
          f"forward + backward per rank, 1 thread, ranks in turn (median of {args.repeats})\n")  # fmt: skip
    print("| split | rank | query / key-value heads | ms | / unsplit | slowest rank / unsplit (speed-up) |")
    print("|---|---|---|---|---|---|")
    for split, tp in (("unequal", 2), ("balanced", 3)):
        result = run_distributed(_measure, nprocs=tp, timeout=600, split=split, **kwargs)[0]
        whole = result["whole"]
        slowest = max(r["seconds"] for r in result["ranks"])
        print(f"| unsplit (tp=1) | - | 9 / 3 | {whole * 1e3:.1f} | 1.00 | |")
        for r in result["ranks"]:
            q, kv = r["heads"]
            print(f"| {split} tp={tp} | {r['rank']} | {q} / {kv} | {r['seconds'] * 1e3:.1f} | "
                  f"{r['seconds'] / whole:.2f} | {slowest / whole:.2f} ({whole / slowest:.2f}x) |")  # fmt: skip
    print("\n`hftrain plan` megatron rows (8 GPUs of 80 GB, micro-batch 8, seq 1024, bf16), vocabulary 50,257:\n")
    print("\n".join(_plan_rows()))


if __name__ == "__main__":
    main()
