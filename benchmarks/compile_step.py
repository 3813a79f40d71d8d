"""``torch.compile`` as a speed default: does it pay on the default job's model? (It did not; see benchmarks/README.md.)

Trains the embedded MiniLM for ``--steps`` steps of batch 32 on random token ids of varying lengths (10-59
tokens, the range of the Rotten Tomatoes reviews, padded up to a multiple of ``--bucket`` so that recompilation
stays bounded), in train mode (dropout on), bf16 autocast when the CPU computes bf16 natively, fused AdamW and
clipping as hftrain does, once eager and once with ``torch.compile(model)``, each in its own process. Prints the
wall time of the whole run (compilation included), of the first steps, and the median step time of the last
``--steps // 2`` steps. Run twice to see the warm compile cache (inductor's FX graph cache in ``$TMPDIR``).

    python benchmarks/compile_step.py                  # 40 steps, bucket 16
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, steps: int, bucket: int) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hftrain.models import resolve_model_path
    from hftrain.strategies.platform import Platform

    bf16 = Platform.detect().native_bf16() is not None
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("embedded:minilm"), num_labels=2)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
    forward = torch.compile(model) if mode == "compiled" else model
    rng = random.Random(0)
    times, start = [], time.perf_counter()
    for _ in range(steps):
        length = -(-rng.randrange(10, 60) // bucket) * bucket
        ids = torch.randint(1000, 20000, (32, length))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (32,))}
        step_start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - step_start)
    print(
        f"| {mode} | {'bf16' if bf16 else 'fp32'} | {time.perf_counter() - start:.1f} | {sum(times[:3]):.1f} | "
        f"{1000 * statistics.median(times[steps // 2 :]):.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bucket", type=int, default=16, help="pad lengths up to a multiple of this")
    parser.add_argument("--child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.bucket)
        return
    print("| model | precision | whole run s | first 3 steps s | median step ms (second half) |")
    print("|---|---|---|---|---|")
    for mode in ("eager", "compiled"):
        command = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--bucket", str(args.bucket)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        print(done.stdout.strip() if done.returncode == 0 else f"| {mode} | failed: {done.stderr[-500:]} |")


if __name__ == "__main__":
    main()
