"""Activation recomputation: step time and peak memory of off / full / selective, side by side in one run.

Each mode trains the same model on the same random batch in a fresh process (so that its peak resident memory,
``VmHWM`` read from ``/proc/self/status``, is its own): a few warm-up steps, then ``--steps`` timed steps of
forward, backward and AdamW, dropout on (the ``bits`` kernel), fp32. Printed per model: the median step time and
its ratio to ``off``; the peak resident memory of the first forward and backward above the built model (read before
any step has freed memory into the allocator, which would hide the next steps' activations in a resident heap:
activations, gradients and temporaries, the gradients the same in every mode), and the share of that peak each mode
saves against ``off``.

Models: the embedded all-MiniLM-L6-v2 (6 layers, hidden 384) and SmolLM2-135M's shape (30 layers, hidden 576,
9 query / 3 key-value heads; random weights: the shapes are what matter).

Usage (about a minute per model on 2 cores; run on a quiet machine):
    python benchmarks/recompute.py                       # both models, batch 8, 256 tokens
    python benchmarks/recompute.py --models minilm --batch 16 --seq 128 --steps 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` and an uninstalled hftrain

MODES = ("off", "full", "selective")


def _model(name: str):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    if name == "minilm":
        from hftrain.models import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path("embedded:minilm"), num_labels=2)
    else:
        from benchmarks.pipeline_memory import smollm2_config

        config = smollm2_config()
    config.update({"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "attention_dropout": 0.1})
    return AutoModelForSequenceClassification.from_config(config).train()


def _measure(name: str, mode: str, batch: int, seq: int, steps: int, threads: int, queue) -> None:
    import torch

    from hftrain.models.dropout import use_bits_dropout
    from hftrain.parallel.recompute import apply_activation_checkpointing
    from tests.memory import process_memory, reset_peak

    torch.set_num_threads(threads)
    model = _model(name)
    use_bits_dropout(model)
    if mode != "off":
        apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq))
    labels = torch.zeros(batch, dtype=torch.long)

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    # The first forward and backward, before anything was freed into the allocator's free lists: its peak above the
    # built model is activations + gradients + temporaries (the gradients are the same in every mode).
    base = process_memory("VmRSS")
    reset_peak()
    model(input_ids=ids, labels=labels).loss.backward()
    peak = process_memory("VmHWM") - base
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times = [step() for _ in range(steps)]
    queue.put({"step": statistics.median(times), "peak_above_states": peak})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="minilm,smollm2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    print(f"batch {args.batch}, sequence {args.seq}, {args.steps} timed steps, {args.threads} threads, fp32, dropout")
    for name in args.models.split(","):
        results = {}
        for mode in MODES:
            queue = context.Queue()
            process = context.Process(
                target=_measure, args=(name, mode, args.batch, args.seq, args.steps, args.threads, queue)
            )
            process.start()
            results[mode] = queue.get()
            process.join()
        off = results["off"]
        print(f"\n{name}: mode       step s   vs off   first fwd+bwd peak MiB   saved vs off")
        for mode, r in results.items():
            saved = 1 - r["peak_above_states"] / off["peak_above_states"]
            print(
                f"{'':>{len(name)}}  {mode:<9} {r['step']:7.3f}   {r['step'] / off['step']:5.2f}x   "
                f"{r['peak_above_states'] / 2**20:21.0f}   {100 * saved:6.1f}%"
            )


if __name__ == "__main__":
    main()
