"""A language model's step with its loss in chunks against the whole logits: each run's peak resident memory.

A tiny Llama (hidden 64, 2 layers: the trunk weighs nothing) with SmolLM2's 49,152-token vocabulary (tied embeddings),
built from its config with random weights, trains ``--steps`` steps of one ``--block``-token block in one process
(fp32, the embedded Rotten Tomatoes texts packed), once per ``training.loss_chunk_tokens`` setting: ``null`` (the
whole ``[tokens, vocabulary]`` logits, as before) and the chunk sizes given. Each run is its own process (a process's
high-water mark never goes down); it reports ``VmHWM`` from ``/proc/self/status`` just before the first step and at
the end of training (before the export, which builds logits for its reload check), the mean loss of the steps, and
the time per step. The losses agree within fp32 rounding (the same rows through the same head and cross entropy).

``python benchmarks/lm_loss_memory.py`` (about a minute; ``--block 256`` for the issue's smaller case).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def high_water_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def child(args: argparse.Namespace) -> None:
    import hftrain
    from hftrain.trainers.base import Trainer

    marks: dict[str, float] = {}
    stamps: list[float] = []
    fit, on_step_end = Trainer.fit, Trainer._on_step_end

    def fit_marked(self, *a, **k):
        marks["before_first_step"] = high_water_gib()
        try:
            return fit(self, *a, **k)
        finally:
            marks.setdefault("after_training", high_water_gib())

    def stamped(self, *a, **k):
        stamps.append(time.perf_counter())
        if len(stamps) == args.steps:
            marks["after_training"] = high_water_gib()
        return on_step_end(self, *a, **k)

    Trainer.fit, Trainer._on_step_end = fit_marked, stamped
    chunk = None if args.chunk == "null" else args.chunk if args.chunk == "auto" else int(args.chunk)
    result = hftrain.train(
        {"model": {"model_name_or_path": args.model, "task": "causal_lm"}},
        dataset_name="embedded:rotten_tomatoes", max_train_samples=2000, max_eval_samples=100,
        max_seq_length=args.block, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        max_steps=args.steps, mixed_precision="no", log_with="none", logging_steps=1,
        output_dir=args.output, loss_chunk_tokens=chunk, torch_num_threads=args.threads,
    )  # fmt: skip
    losses = [h["loss"] for h in result.log_history if "loss" in h]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    print("RESULT " + json.dumps({**marks, "mean_loss": sum(losses) / len(losses),
                                  "step_s": sorted(gaps)[len(gaps) // 2] if gaps else float("nan")}))  # fmt: skip


def build_model(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hftrain.models import cache_dir, resolve_model_path

    source = cache_dir() / "smollm2" if (cache_dir() / "smollm2").is_dir() else resolve_model_path("embedded:smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--chunks", default="null,auto,256,1024", help="comma-separated loss_chunk_tokens settings")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as scratch:
        model = build_model(Path(scratch) / "model")
        rows = []
        for chunk in args.chunks.split(","):
            command = [sys.executable, __file__, "--child", "--chunk", chunk, "--model", str(model), "--block",
                       str(args.block), "--steps", str(args.steps), "--threads", str(args.threads), "--output",
                       str(Path(scratch) / f"run-{chunk}")]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not found:
                raise SystemExit(f"loss_chunk_tokens {chunk} failed:\n{done.stderr[-3000:]}")
            rows.append((chunk, json.loads(found[0].removeprefix("RESULT "))))
            print(f"loss_chunk_tokens {chunk}: {rows[-1][1]}", file=sys.stderr, flush=True)
    whole = dict(rows).get("null")
    print(f"\nblock {args.block} tokens, vocabulary 49,152, {args.steps} steps, 1 process, fp32, load "
          f"{os.getloadavg()[0]:.2f}\n")  # fmt: skip
    print("| loss_chunk_tokens | peak before the first step (GiB) | peak at the end of training (GiB) | vs whole | "
          "mean loss | s/step |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for chunk, r in rows:
        ratio = f"{r['after_training'] / whole['after_training']:.2f}" if whole else "-"
        print(f"| {chunk} | {r['before_first_step']:.2f} | {r['after_training']:.2f} | {ratio} | "
              f"{r['mean_loss']:.6f} | {r['step_s']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
