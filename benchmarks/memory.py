"""Per-rank memory of the model states under DDP, ZeRO-1/2/3 and FSDP1/2, against the ZeRO paper's formulas.

What is measured: the bytes of parameters, gradients, fp32 master weights and optimizer state that each of ``N``
gloo processes really holds while hftrain trains a model of Ψ parameters with AdamW. Every strategy runs in the
same ``N``-process launch (one after another, same model, same seed, gradient accumulation 2): one optimizer step
first, so that Adam's state exists, then the rank's storage is read at two points of the next accumulation window,
by walking the live objects (DeepSpeed's flat groups and partitions, FSDP's flat parameters and DTensor shards, the
optimizer's ``state``; see ``tests/test_sharding.py``, whose reader this reuses and whose test proves it):

- "grads, accum.": after the window's first backward, before the boundary (kept between micro-batches);
- "grads, step": after the window's last backward and its reduction, just before the optimizer step.

A rank must hold the larger of the two, which the total uses; at gradient accumulation 1 only the second exists
for FSDP (Accelerate runs FSDP under ``no_sync`` between micro-batches, which keeps unsharded gradients), so FSDP
also gets a "gas=1" row. DDP and ZeRO-1 hold their whole local gradients at the end of every backward whatever the
accumulation. Not counted (they are no model state): activations, DDP's C++ gradient buckets, and DeepSpeed's
gradient-reduction bucket, shown apart as "reduce bucket".

The formulas (ZeRO paper, Adam, N data-parallel ranks):
- mixed precision (``--mixed_precision bf16``): bf16 params 2Ψ, bf16 grads 2Ψ, fp32 master + exp_avg + exp_avg_sq
  12Ψ: DDP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N (FSDP as ZeRO-3). Under Accelerate, DDP and
  FSDP in bf16 are autocast over fp32 states (params 4Ψ, grads 4Ψ, Adam 8Ψ): the same totals.
- fp32 (the default): params 4Ψ, grads 4Ψ, Adam 8Ψ and no master copy: DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N,
  ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N. DeepSpeed (0.19.8) still keeps an fp32 master copy of each rank's partition
  in fp32 training (4Ψ/N more); its column "with master" is the formula plus that copy.

Usage (2 processes; each takes a few minutes on 2 shared cores):
    python benchmarks/memory.py                              # the embedded all-MiniLM-L6-v2, fp32
    python benchmarks/memory.py --mixed_precision bf16
    python benchmarks/memory.py --model bert-base            # a BERT-base config built locally (110M)
    python benchmarks/memory.py --model tiny --strategies ddp,zero3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` and an uninstalled hftrain

from tests.distributed import run_distributed  # noqa: E402
from tests.state_reader import STRATEGIES, TEST_MODEL, measure_strategies  # noqa: E402

MODELS = {
    "tiny": TEST_MODEL,
    "bert-base": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "vocab_size": 30522,
        "max_position_embeddings": 512,
    },
}

# label -> (formula, bytes per rank as a function of Ψ and N)
PAPER = {
    "ddp": ("16Ψ", lambda p, n: 16 * p),
    "zero1": ("4Ψ + 12Ψ/N", lambda p, n: 4 * p + 12 * p / n),
    "zero2": ("2Ψ + 14Ψ/N", lambda p, n: 2 * p + 14 * p / n),
    "zero3": ("16Ψ/N", lambda p, n: 16 * p / n),
}
FP32 = {
    "ddp": ("16Ψ", lambda p, n: 16 * p),
    "zero1": ("8Ψ + 8Ψ/N", lambda p, n: 8 * p + 8 * p / n),
    "zero2": ("4Ψ + 12Ψ/N", lambda p, n: 4 * p + 12 * p / n),
    "zero3": ("16Ψ/N", lambda p, n: 16 * p / n),
}
MASTER = ("+ 4Ψ/N", lambda p, n: 4 * p / n)  # DeepSpeed's fp32 master copy in fp32 training
# FSDP between micro-batches: Accelerate's no_sync keeps unsharded gradients (fp32, or bf16 under bf16 autocast)
FSDP_ACCUMULATING = {
    "no": ("4Ψ + 12Ψ/N", lambda p, n: 4 * p + 12 * p / n),
    "bf16": ("2Ψ + 12Ψ/N", lambda p, n: 2 * p + 12 * p / n),
}


def _formula(label: str, precision: str, gas1: bool) -> tuple[str, object]:
    base = "zero3" if label.startswith("fsdp") else label
    if label.startswith("fsdp") and not gas1:
        return FSDP_ACCUMULATING[precision]
    return (PAPER if precision == "bf16" else FP32)[base]


def rows(runs: list[dict], labels: list[str], precision: str) -> list[dict]:
    """One row per strategy (per rank where the ranks differ by more than 0.5 %), plus FSDP at accumulation 1."""
    psi, n = runs[0]["psi"], len(runs)
    out = []
    for label in labels:
        if any("error" in r[label] for r in runs):
            out.append({"strategy": label, "error": next(r[label]["error"] for r in runs if "error" in r[label])})
            continue
        variants = [(label, False)] + ([(f"{label}, gas=1", True)] if label.startswith("fsdp") else [])
        for name, gas1 in variants:
            per_rank = []
            for rank in runs:
                acc, step = rank[label]["accumulating"], rank[label]["at_step"]
                grads = step["grads"] if gas1 else max(acc["grads"], step["grads"])
                row = {
                    "params": max(acc["params"], step["params"]),
                    "master": acc["master"],
                    "grads_accumulating": None if gas1 else acc["grads"],
                    "grads_step": step["grads"],
                    "optimizer": max(acc["optimizer"], step["optimizer"]),
                    "bucket": max(acc["comm_buffers"], step["comm_buffers"]),
                    "unclassified": max(acc["unclassified"], step["unclassified"]),
                }
                row["total"] = row["params"] + row["master"] + grads + row["optimizer"]
                per_rank.append(row)
            same = all(abs(r["total"] - per_rank[0]["total"]) <= 0.005 * per_rank[0]["total"] for r in per_rank)
            text, value = _formula(label, precision, gas1)
            for index, row in enumerate(per_rank[:1] if same else per_rank):
                row["strategy"] = name if same else f"{name} (rank {index})"
                row["formula"], row["formula_bytes"] = text, value(psi, n)
                if label.startswith("zero") and precision == "no":
                    row["formula_master"] = f"{text} {MASTER[0]}"
                    row["formula_master_bytes"] = value(psi, n) + MASTER[1](psi, n)
                out.append(row)
    return out


def markdown(table: list[dict], psi: int, precision: str) -> str:
    mb = lambda b: "–" if b is None else f"{b / 1e6:,.1f}"  # noqa: E731
    with_master = precision == "no"
    head = (
        [
            "strategy",
            "params",
            "master",
            "grads, accum.",
            "grads, step",
            "optimizer",
            "total",
            "total/Ψ",
            "formula",
            "measured/formula",
        ]
        + (["with master", "measured/(with master)"] if with_master else [])
        + ["reduce bucket"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table:
        if "error" in row:
            lines.append(f"| {row['strategy']} | did not run: {row['error'][:120]} |" + " |" * (len(head) - 2))
            continue
        cells = [
            row["strategy"],
            mb(row["params"]),
            mb(row["master"]),
            mb(row["grads_accumulating"]),
            mb(row["grads_step"]),
            mb(row["optimizer"]),
            mb(row["total"]),
            f"{row['total'] / psi:.2f}Ψ",
            f"{row['formula']} = {mb(row['formula_bytes'])}",
            f"{row['total'] / row['formula_bytes']:.3f}",
        ]
        if with_master:
            if "formula_master" in row:
                cells += [
                    f"{row['formula_master']} = {mb(row['formula_master_bytes'])}",
                    f"{row['total'] / row['formula_master_bytes']:.3f}",
                ]
            else:
                cells += ["", ""]
        cells.append(mb(row["bucket"]) if row["bucket"] else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="embedded:minilm",
        help="embedded:<name>, a saved model folder, or one built locally: " + ", ".join(MODELS),
    )
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated: " + ", ".join(STRATEGIES))
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4, help="micro-batch size per process")
    parser.add_argument("--json", help="also write the raw per-rank measurements here")
    args = parser.parse_args(argv)
    labels = args.strategies.split(",")
    unknown = [label for label in labels if label not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")

    start = time.perf_counter()
    runs = run_distributed(
        measure_strategies,
        nprocs=args.nprocs,
        timeout=3600,
        labels=labels,
        model=MODELS.get(args.model, args.model),
        micro=args.micro,
        mixed_precision=args.mixed_precision,
    )
    psi, n = runs[0]["psi"], args.nprocs
    table = rows(runs, labels, args.mixed_precision)
    print(
        f"\nmodel {args.model}: Ψ = {psi:,} parameters; N = {n} processes; mixed_precision={args.mixed_precision}; "
        f"bytes in MB (1e6) per rank; {time.perf_counter() - start:.0f} s\n"
    )
    print(markdown(table, psi, args.mixed_precision))
    worst = max((r["unclassified"] for r in table if "error" not in r), default=0)
    print(f"\nlargest storage reachable from a rank's model/optimizer that no category claims: {worst / 1e6:.3f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "rows": table}, indent=1, default=str))


if __name__ == "__main__":
    main()
