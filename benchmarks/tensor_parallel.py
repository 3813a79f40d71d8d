"""hftrain's tensor parallelism on ``--tp`` gloo processes: memory per rank, collectives per layer, vs DTensor.

Three measurements, in one run, printed as markdown tables by rank 0:

1. **Parameter bytes per rank** (read from the live modules after ``apply_tensor_parallel``) against the
   unsharded model, for BERT, GPT-2 and Llama configs of ``--hidden`` width: the split layers (target
   ``<= 1.05 / tp``) and the whole model (embedding positions, LayerNorms and the head stay replicated).
2. **Collectives per transformer layer**, forward and backward separately, counted by instrumenting
   hftrain's collective functions (``record_collectives``), not assumed: the counts of a 2-layer and a
   4-layer model differ by exactly two layers' collectives, so ``(c4 - c2) / 2`` is one layer's. With and
   without sequence parallelism. Megatron's figure: 2 all-reduces forward, 2 backward per layer.
3. **hftrain's layers vs DTensor TP** (``parallelize_module`` with ``ColwiseParallel`` /
   ``RowwiseParallel``) on the same modules and sizes: an MLP block (``d -> 4d -> d``) and a Llama decoder
   layer (attention + MLP, ``d / 16`` heads of 16, half as many key/value heads). Both are checked equal to
   the unsharded module first; then forward+backward is timed, alternating hftrain and DTensor rounds so
   that load from other jobs hits both alike. The ratio is DTensor time / hftrain time (> 1: hftrain faster).

Run from the repository root (2 cores, 1 thread per process)::

    python benchmarks/tensor_parallel.py                 # tp=2, d in 64,256,1024 (~2-4 min)
    python benchmarks/tensor_parallel.py --quick         # d in 64,256, fewer rounds
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


def _configs(hidden: int, layers: int) -> dict:
    from transformers import BertConfig, GPT2Config, LlamaConfig

    heads = max(hidden // 64, 4)
    common = {"vocab_size": 8192, "num_labels": 2, "pad_token_id": 0}
    return {
        "bert": BertConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        ),
        "gpt2": GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **common
        ),
        "llama": LlamaConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            intermediate_size=4 * hidden,
            **common,
        ),
    }


def _model(config):
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def parameter_bytes(group, hidden: int) -> list[dict]:
    """Per-rank bytes of the split parameters and of the whole model, against the unsharded model."""
    import torch.distributed as dist

    from hftrain.parallel import apply_tensor_parallel, split_over

    rows = []
    for kind, config in _configs(hidden, 2).items():
        full = _model(config)
        model = apply_tensor_parallel(_model(config), tp_group=group)
        split = split_over(model, "tp")
        nbytes = lambda p: p.numel() * p.element_size()  # noqa: E731
        rows.append(
            {
                "model": kind,
                "split_rank": sum(nbytes(model.get_parameter(n)) for n in split),
                "split_full": sum(nbytes(full.get_parameter(n)) for n in split),
                "all_rank": sum(nbytes(p) for p in model.parameters()),
                "all_full": sum(nbytes(p) for p in full.parameters()),
                "tp": dist.get_world_size(group),
            }
        )
    return rows


def _count(model, batch) -> tuple[dict, dict]:
    from hftrain.parallel import record_collectives

    with record_collectives() as forward:
        loss = model(**batch).loss
    with record_collectives() as backward:
        loss.backward()
    return dict(forward), dict(backward)


def collectives_per_layer(group) -> list[dict]:
    """Collectives of one transformer layer: the difference between a 4-layer and a 2-layer model, halved."""
    import torch

    from hftrain.parallel import apply_tensor_parallel, sequence_multiple

    rows = []
    for sequence_parallel in (False, True):
        for kind in ("bert", "gpt2", "llama"):
            counts = []
            for layers in (2, 4):
                config = _configs(64, layers)[kind]
                model = apply_tensor_parallel(_model(config), tp_group=group, sequence_parallel=sequence_parallel)
                seq = 8 * sequence_multiple(2, sequence_parallel=sequence_parallel)
                ids = torch.randint(1, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
                counts.append(_count(model, {"input_ids": ids, "labels": torch.tensor([0, 1])}))
            per_layer = []
            for phase in (0, 1):
                two, four = counts[0][phase], counts[1][phase]
                per_layer.append({k: (four.get(k, 0) - two.get(k, 0)) / 2 for k in sorted(set(two) | set(four))})
            rows.append({"model": kind, "sp": sequence_parallel, "forward": per_layer[0], "backward": per_layer[1]})
    return rows


class _MLP:
    """Builds ``d -> 4d -> d`` MLPs (GELU) with the same weights for the reference, hftrain and DTensor."""

    @staticmethod
    def build(d: int):
        import torch
        from torch import nn

        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    @staticmethod
    def hftrain(module, group):
        from torch import nn

        from hftrain.parallel import ColumnParallelLinear, RowParallelLinear
        from hftrain.parallel.collectives import copy_to_tp

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc1 = ColumnParallelLinear(module[0], tp_group=group)
                self.fc2 = RowParallelLinear(module[2], tp_group=group)

            def forward(self, x):
                return self.fc2(nn.functional.gelu(self.fc1(copy_to_tp(x, group))))

        return Block()

    @staticmethod
    def dtensor(module, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    @staticmethod
    def call(module, x, extra):
        return module(x)


class _LlamaLayer:
    """A ``LlamaDecoderLayer`` (d / 16 heads of 16, half as many key/value heads, intermediate 4d)."""

    @staticmethod
    def config(d: int):
        from transformers import LlamaConfig

        heads = d // 16
        return LlamaConfig(
            hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads // 2, intermediate_size=4 * d
        )

    @staticmethod
    def build(d: int):
        import torch
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        torch.manual_seed(1)
        return LlamaDecoderLayer(_LlamaLayer.config(d), layer_idx=0)

    @staticmethod
    def hftrain(module, group):
        from hftrain.parallel import parallelize_layer

        return parallelize_layer(module, module.self_attn.config, tp_group=group)

    @staticmethod
    def dtensor(module, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        return parallelize_module(module, mesh, plan)

    @staticmethod
    def call(module, x, extra):
        return module(x, position_embeddings=extra)


def _extra(block, d: int, x):
    """The rotary (cos, sin) a Llama layer needs; nothing for the MLP."""
    if block is _MLP:
        return None
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    positions = torch.arange(x.shape[1]).unsqueeze(0)
    return LlamaRotaryEmbedding(_LlamaLayer.config(d))(x, positions)


def _time(block, module, x, extra, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        out = block.call(module, x, extra)
        out.sum().backward()
    return (time.perf_counter() - start) / iters


def versus_dtensor(group, mesh, sizes: list[int], tokens: tuple[int, int], rounds: int, iters: int) -> list[dict]:
    """hftrain layers vs DTensor TP on the same modules: equal outputs/grads first, then forward+backward time."""
    import torch
    from torch.testing import assert_close

    rows = []
    for block in (_MLP, _LlamaLayer):
        for d in sizes:
            x = torch.randn(*tokens, d, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
            extra = _extra(block, d, x)
            reference = block.build(d)
            expected = block.call(reference, x, extra)
            sides = {"hftrain": block.hftrain(block.build(d), group), "dtensor": block.dtensor(block.build(d), mesh)}
            for module in sides.values():
                assert_close(block.call(module, x, extra), expected, rtol=1e-4, atol=1e-5)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(rounds):
                for name, module in sides.items():  # alternate: load changes hit both sides alike
                    torch.distributed.barrier(group)
                    times[name].append(_time(block, module, x, extra, iters))
            hf, dt = statistics.median(times["hftrain"]), statistics.median(times["dtensor"])
            ratios = [b / a for a, b in zip(times["hftrain"], times["dtensor"], strict=True)]
            name = "MLP d->4d->d" if block is _MLP else "Llama decoder layer"
            rows.append(
                {
                    "block": name,
                    "d": d,
                    "hftrain_ms": hf * 1e3,
                    "dtensor_ms": dt * 1e3,
                    "ratio": statistics.median(ratios),
                }
            )
    return rows


def _worker(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from hftrain.parallel import ParallelDims, build_groups

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = build_groups(ParallelDims(dist.get_world_size(), tp=dist.get_world_size()), dist.get_rank())
    result = {
        "bytes": parameter_bytes(groups.tp_group, args.hidden),
        "collectives": collectives_per_layer(groups.tp_group),
        "dtensor": versus_dtensor(
            groups.tp_group, groups.mesh["tp"], args.sizes, (args.batch, args.seq), args.rounds, args.iters
        ),
        "threads": torch.get_num_threads(),
    }
    dist.destroy_process_group()
    return result if rank == 0 else None


def report(result: dict, args: argparse.Namespace) -> str:
    """Markdown tables of one run."""
    lines = [f"tp={args.tp}, {result['threads']} thread(s) per process, load {os.getloadavg()[0]:.1f}", ""]
    lines += [
        "| model | split layers per rank / unsharded | × tp | whole model per rank / unsharded |",
        "|---|---|---|---|",
    ]
    for row in result["bytes"]:
        split = row["split_rank"] / row["split_full"]
        lines.append(
            f"| {row['model']} (hidden {args.hidden}) | {row['split_rank'] / 2**20:.2f} / "
            f"{row['split_full'] / 2**20:.2f} MiB "
            f"= {split:.4f} | {split * row['tp']:.3f} | {row['all_rank'] / row['all_full']:.3f} |"
        )
    lines += ["", "| model | sequence parallel | forward, per layer | backward, per layer |", "|---|---|---|---|"]
    fmt = lambda counts: ", ".join(f"{v:g} {k.split()[1]}" for k, v in counts.items() if v) or "none"  # noqa: E731
    for row in result["collectives"]:
        lines.append(f"| {row['model']} | {row['sp']} | {fmt(row['forward'])} | {fmt(row['backward'])} |")
    lines += [
        "",
        f"| block (tokens {args.batch}×{args.seq}) | d | hftrain ms | DTensor ms | DTensor / hftrain |",
        "|---|---|---|---|---|",
    ]
    for row in result["dtensor"]:
        lines.append(
            f"| {row['block']} | {row['d']} | {row['hftrain_ms']:.2f} | {row['dtensor_ms']:.2f} | {row['ratio']:.2f}× |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="processes = tensor-parallel size")
    parser.add_argument("--hidden", type=int, default=512, help="width of the models for the bytes table")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[64, 256, 1024])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="alternating timing rounds per side")
    parser.add_argument("--iters", type=int, default=10, help="forward+backward per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="d in 64,256; 3 rounds of 5")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.iters = [64, 256], 3, 5
    from tests.distributed import run_distributed

    results = run_distributed(_worker, nprocs=args.tp, timeout=1800, args=args)
    print(report(results[0], args))


if __name__ == "__main__":
    main()
