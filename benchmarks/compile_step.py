"""``torch.compile`` against eager training steps on a CPU: whole model (MiniLM), per block (``training.compile``).

``--model minilm`` (the first measurement, whole-model ``torch.compile(model)``): trains the embedded MiniLM for
``--steps`` steps of batch 32 on random token ids of varying lengths (10-59 tokens, the range of the Rotten Tomatoes
reviews, padded up to a multiple of ``--bucket`` so that recompilation stays bounded), in train mode (dropout on),
bf16 autocast when the CPU computes bf16 natively.

``--model tiny-llama`` / ``llama-20m`` (``training.compile``): a Llama causal LM built from a config (random weights),
fixed-length blocks (``--seq``, as packed language-model data), fp32, every transformer block compiled in place by
hftrain's own ``compile_blocks`` (``block.compile(dynamic=False)``, as torchtitan compiles per block). tiny-llama is
the tests' shape (hidden 64, 2 layers, vocabulary 512, batch 4 × 32); llama-20m has hidden 256, 8 layers,
intermediate 1024, 4 heads (2 key/value), vocabulary 24,000 (untied): 20.2 M parameters, batch 8 × 128.

Every mode runs fused AdamW and clipping as hftrain does, once eager and once compiled, each in its own process,
and prints the wall time of the whole run (compilation included), of the first 3 steps, and the median step time
of the last ``--steps // 2`` steps, with the load average at the start. Run twice to see the warm compile cache
(inductor's FX graph cache in ``$TMPDIR/torchinductor_$USER``).

    python benchmarks/compile_step.py                          # MiniLM, whole model, 40 steps, bucket 16
    python benchmarks/compile_step.py --model llama-20m --steps 30 --threads 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMAS = {  # name -> (config fields, batch, default sequence)
    "tiny-llama": (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
        },
        4,
        32,
    ),  # fmt: skip
    "llama-20m": (
        {
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 24000,
        },
        8,
        128,
    ),  # fmt: skip
}


def minilm_child(mode: str, steps: int, bucket: int) -> None:
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
    _row("minilm", mode, "bf16" if bf16 else "fp32", "32 × 10-59", time.perf_counter() - start, times)


def llama_child(name: str, mode: str, steps: int, seq: int | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hftrain.strategies.runtime import compile_blocks

    fields, batch, default_seq = LLAMAS[name]
    seq = seq or default_seq
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=max(seq, 128), use_cache=False, **fields)
    model = AutoModelForCausalLM.from_config(config).train()
    if mode == "compiled":
        compile_blocks(model, "default", device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times, start = [], time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(3, config.vocab_size, (batch, seq))
        step_start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - step_start)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    _row(f"{name} ({params:.1f} M)", f"{mode} (per block)" if mode == "compiled" else mode, "fp32",
         f"{batch} × {seq}", time.perf_counter() - start, times)  # fmt: skip


def _row(model: str, mode: str, precision: str, batch: str, wall: float, times: list[float]) -> None:
    print(
        f"| {model} | {mode} | {precision} | {batch} | {wall:.1f} | {sum(times[:3]):.1f} | "
        f"{1000 * statistics.median(times[len(times) // 2 :]):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["minilm", *LLAMAS], default="minilm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bucket", type=int, default=16, help="MiniLM: pad lengths up to a multiple of this")
    parser.add_argument("--seq", type=int, default=None, help="Llama: the block length (default: the model's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared machine)")
    parser.add_argument("--child", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        if args.model == "minilm":
            minilm_child(args.child, args.steps, args.bucket)
        else:
            llama_child(args.model, args.child, args.steps, args.seq)
        return
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("| model | mode | precision | batch | whole run s | first 3 steps s | median step ms (second half) |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("eager", "compiled"):
        command = [sys.executable, __file__, "--child", mode, "--model", args.model, "--steps", str(args.steps),
                   "--bucket", str(args.bucket)] + (["--seq", str(args.seq)] if args.seq else []) + (
                   ["--threads", str(args.threads)] if args.threads else [])  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        print(done.stdout.strip() if done.returncode == 0 else f"| {mode} | failed: {done.stderr[-500:]} |")


if __name__ == "__main__":
    main()
