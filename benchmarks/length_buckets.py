"""The default job's training step on this machine with and without length buckets (``data.pad_to_multiple_of``).

What is measured: the wall time of one optimizer step (forward, backward, AdamW) of the default job's model
(the embedded MiniLM, ``data.max_seq_length: 128``, batch 32, the run's precision: bf16 autocast where the CPU has
AMX/AVX512-BF16, else fp32; hftrain's ``bits`` dropout, as ``dropout_kernel: auto`` picks on CPU) over the default
job's own batches: the Rotten Tomatoes training split in the ``group_by_length`` order of epoch 0. Each setting
(no buckets, multiples of 8, 16, 32, 64) pads the *same* batches, collated by hftrain's ``BucketCollator``; the
settings alternate in rounds (round r: every setting runs the same ``--steps`` batches), so the load of a shared
machine hits them alike. Reported per setting: the median step time, the padded positions against real tokens,
and the distinct batch shapes seen. One untimed warm-up step per setting and round.

Usage: ``python benchmarks/length_buckets.py [--rounds 3] [--steps 8] [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

SETTINGS: tuple[int | None, ...] = (None, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting and round")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForSequenceClassification

    from benchmarks.overhead import build_data
    from hftrain.data.batching import BucketCollator, EpochSampler, LengthBuckets, lengths_of
    from hftrain.models import resolve_model_path
    from hftrain.models.dropout import use_bits_dropout
    from hftrain.strategies.platform import Platform

    dataset, tokenizer = build_data(128, None)
    lengths = lengths_of(dataset)
    order = list(EpochSampler(lengths, order="group_by_length", group_size=32, seed=42))
    batches = [order[i : i + 32] for i in range(0, len(order) - 31, 32)]
    rows = dataset.remove_columns(["length"]).to_list()  # plain rows: one read, not one per example
    precision, why = Platform.detect().resolve_precision("auto")
    print(f"precision {precision} ({why}), {torch.get_num_threads()} threads, {len(batches)} batches per epoch")

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("embedded:minilm"), num_labels=2)
    use_bits_dropout(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
    collators = {
        m: BucketCollator(tokenizer, *_fields(LengthBuckets.combine(m, None, longest=128, rule=""))) for m in SETTINGS
    }
    times: dict[int | None, list[float]] = {m: [] for m in SETTINGS}
    positions = dict.fromkeys(SETTINGS, 0)
    tokens = dict.fromkeys(SETTINGS, 0)
    shapes: dict[int | None, set] = {m: set() for m in SETTINGS}
    for m in SETTINGS:  # shapes and padding over the whole epoch (collation only)
        for indices in batches:
            batch = collators[m]([rows[i] for i in indices])
            shapes[m].add(tuple(batch["input_ids"].shape))
            positions[m] += batch["input_ids"].numel()
            tokens[m] += int(batch["attention_mask"].sum())
    # rounds over evenly spaced stretches of the epoch (the length-grouped order mixes long and short batches)
    stride = max(1, len(batches) // (args.rounds * (args.steps + 1)))
    for r in range(args.rounds):
        chosen = [batches[(r + k * args.rounds) * stride % len(batches)] for k in range(args.steps + 1)]
        for m in SETTINGS:
            collated = [collators[m]([rows[i] for i in indices]) for indices in chosen]
            for k, batch in enumerate(collated):
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if k:  # the first is a warm-up
                    times[m].append(time.perf_counter() - start)
            print(f"round {r}, buckets {m}: {statistics.median(times[m]):.3f} s/step so far", flush=True)
    base = statistics.median(times[None])
    print("| buckets | step (median, s) | vs none | padding (of positions) | distinct shapes per epoch |")
    print("|---|---|---|---|---|")
    for m in SETTINGS:
        step = statistics.median(times[m])
        padding = 1 - tokens[m] / positions[m]
        print(f"| {m or 'none'} | {step:.3f} | {step / base:.2f}x | {100 * padding:.1f}% | {len(shapes[m])} |")


def _fields(buckets) -> tuple[int | None, int | None]:
    return buckets.multiple, buckets.ceiling


if __name__ == "__main__":
    main()
