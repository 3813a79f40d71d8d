"""``hftrain plan``'s estimates against measurement and against published figures, as README tables.

Measured (the same functions ``tests/test_plan.py`` asserts with):
- model states: per-rank bytes of parameters, gradients and optimizer state (fp32 master included) on 2 gloo
  processes, read from the live DeepSpeed/FSDP objects by ``tests/test_sharding.py``'s reader (DDP, ZeRO-1/2/3,
  FSDP2; BERT hidden 320, 2 layers by default; fp32, micro-batch 4, accumulation 2), and from the split modules
  under tensor parallelism (tp = 2, sequence parallelism) and of the live pipeline stages (pp = 2 on 2
  processes, tp = 2 × pp = 2 on 4; 1F1B, 2 micro-batches of 2);
- activations: bytes autograd saves in one forward (``saved_tensors_hooks``), whole tiny models, eager attention.
Published: the ZeRO paper's worked example and DeepSpeed's ``estimate_zero2/3_model_states_mem_needs``.

Usage (2 processes, a few minutes on 2 shared cores):
    python benchmarks/plan_validation.py [--layers 2] [--skip-measured]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` and an uninstalled hftrain

from tests.distributed import run_distributed  # noqa: E402
from tests.test_plan import (  # noqa: E402
    MEASURED_LABELS,
    MEASURED_MODEL,
    _check_pipeline,
    _estimate_rows,
    _pipeline_measurement,
    _saved,
    _spec_from_bert,
    _tensor_parallel_measurement,
    most_loaded,
)


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def model_state_table(layers: int, tensor_parallel_only: bool = False) -> list[str]:
    from hftrain.plan import Hardware, Workload, model_parallel
    from tests.state_reader import measure_strategies

    model = {**MEASURED_MODEL, "num_hidden_layers": layers}
    labels = [] if tensor_parallel_only else list(MEASURED_LABELS)
    runs = run_distributed(measure_strategies, nprocs=2, timeout=3600, labels=labels, model=model)
    rows = _estimate_rows(model, [MEASURED_LABELS[label] for label in labels])
    out = [
        f"Ψ = {runs[0]['psi']:,}; bytes in MB (1e6) per GPU, most loaded rank",
        "",
        _line(["strategy", "state", "estimate", "measured", "ratio"]),
        "|---|---|---|---|---|",
    ]
    for label in labels:
        for part, value in most_loaded(runs, label).items():
            estimate = getattr(rows[MEASURED_LABELS[label]], part)
            out.append(_line([label, part, f"{estimate / 1e6:.3f}", f"{value / 1e6:.3f}", f"{estimate / value:.3f}"]))
    from transformers import BertConfig

    spec = _spec_from_bert({"num_attention_heads": 4, "max_position_embeddings": 64, **MEASURED_MODEL}, BertConfig)
    work = Workload(precision="fp32", micro_batch=4, seq=32, dropout=False, fused_attention=False)
    for gpus, name in ((2, "megatron tp2 (SP)"), (4, "megatron tp2×dp2 (SP, ZeRO-1)")):
        tp_runs = run_distributed(
            _tensor_parallel_measurement, nprocs=gpus, timeout=1200, seq=32, micro=4, shard_optimizer=gpus > 2
        )
        row = model_parallel.estimate(2, 1, spec, work, Hardware(gpus_per_node=gpus, dropout_mask_bytes=4))
        for part in ("params", "grads", "optimizer", "activations"):
            value = max(run[part] for run in tp_runs)
            estimate = getattr(row, part)
            out.append(_line([name, part, f"{estimate / 1e6:.3f}", f"{value / 1e6:.3f}", f"{estimate / value:.3f}"]))
    for tp, pp in ((1, 2), (2, 2)):
        shape = {"seq": 32, "micro": 2, "microbatches": 2}
        pp_runs = run_distributed(_pipeline_measurement, nprocs=tp * pp, timeout=1200, tp=tp, pp=pp, **shape)
        for part, (estimate, value) in _check_pipeline(pp_runs, tp, pp, **shape).items():
            cells = [f"megatron tp{tp}×pp{pp}", part, f"{estimate / 1e6:.3f}", f"{value / 1e6:.3f}"]
            out.append(_line([*cells, f"{estimate / value:.3f}"]))
    return out


def activation_table() -> list[str]:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hftrain.plan import Hardware, Workload, model_from_config
    from hftrain.plan.common import activation_bytes
    from hftrain.plan.measure import saved_activation_bytes
    from tests.tiny import tiny_config

    out = [_line(["model", "dropout", "b × s", "estimate (MB)", "measured (MB)", "ratio"]), "|---|---|---|---|---|---|"]
    for kind, dropout in (("bert", 0.0), ("bert", 0.1), ("llama", 0.0)):
        for micro, seq in ((4, 48), (8, 128)):
            torch.manual_seed(0)
            config = tiny_config(kind, dropout=dropout)
            config.max_position_embeddings = 128
            config._attn_implementation = "eager"
            model = AutoModelForSequenceClassification.from_config(config).train()
            ids = torch.randint(3, config.vocab_size, (micro, seq))
            measured = saved_activation_bytes(model, lambda m=model, i=ids: m(input_ids=i))
            spec = model_from_config(_saved(config))
            work = Workload(precision="fp32", micro_batch=micro, seq=seq, dropout=dropout > 0, fused_attention=False)
            estimate = activation_bytes(spec, work, Hardware(dropout_mask_bytes=4), layers=spec.layers)
            out.append(
                _line(
                    [
                        f"tiny {kind} (2 layers, h 32)",
                        str(dropout),
                        f"{micro} × {seq}",
                        f"{estimate / 1e6:.3f}",
                        f"{measured / 1e6:.3f}",
                        f"{estimate / measured:.3f}",
                    ]
                )
            )
    return out


def published_table() -> list[str]:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from hftrain.plan import Hardware, Workload, model_from_sizes, plan

    model = model_from_sizes(parameters=7_500_000_000, layers=32, hidden=4096, heads=32, vocab=50_000)
    psi, largest = model.parameters, model.largest_layer_parameters
    rows = {r.label: r for r in plan(model, Hardware(gpus_per_node=8, nodes=8), Workload()).rows}
    _, ds2 = estimate_zero2_model_states_mem_needs(psi, 8, 8, cpu_offload=False)
    _, ds3, _ = estimate_zero3_model_states_mem_needs(psi, largest, 8, 8, cpu_offload=False)
    paper = {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    deepspeed = {"zero2": ds2 / 1e9, "zero3": ds3 / 1e9}
    out = [_line(["strategy", "ZeRO paper (GB)", "hftrain plan (GB)", "DeepSpeed estimator (GB)"]), "|---|---|---|---|"]
    for label, value in paper.items():
        ours = rows[label].model_states / 1e9
        ds = f"{deepspeed[label]:.2f}" if label in deepspeed else "–"
        out.append(_line([label, f"{value}", f"{ours:.2f}", ds]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="layers of the measured BERT (hidden 320)")
    parser.add_argument("--skip-measured", action="store_true", help="only the single-process tables")
    parser.add_argument("--tensor-parallel-only", action="store_true", help="measure only the megatron rows")
    args = parser.parse_args()
    print("\n".join(published_table()), end="\n\n")
    print("\n".join(activation_table()), end="\n\n")
    if not args.skip_measured:
        print("\n".join(model_state_table(args.layers, args.tensor_parallel_only)))


if __name__ == "__main__":
    main()
