"""Step time of ``megatron`` tp=2 × pp=2 against DDP on the same 4 gloo processes, through the Trainer.

Both train the same tiny GPT-2 classifier (``--layers`` layers, width 32) on the same global batch (DDP: 4 × 4
examples; tp=2 × pp=2: one replica of 16 examples in ``--microbatches`` micro-batches). Each layout runs
``--steps`` and ``2 × --steps`` optimizer steps after a warm-up; the difference divided by ``--steps`` is the
time per step without process start, model build, evaluation and checkpoint (the same in both runs); the median
over ``--rounds`` rounds, layouts alternating. On one 2-core machine
model parallelism buys memory, not speed: expect tp × pp to be slower (more, smaller messages; 4 processes on
2 cores). Run from the repository root::

    python benchmarks/pipeline_step_time.py            # ~3-5 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.*` and an uninstalled hftrain

GLOBAL_BATCH = 16


def _timed_run(strategy: str, options: dict | None, micro: int, steps: int, layers: int) -> float:
    from tests.tiny import run_tiny_training

    start = time.perf_counter()
    run_tiny_training(
        kind="gpt2", strategy=strategy, strategy_options=options, micro=micro, steps=steps, num_layers=layers,
        n_train=GLOBAL_BATCH * 2 * steps, n_eval=8, torch_num_threads=1,
    )  # fmt: skip
    return time.perf_counter() - start


def _worker(steps: int, layers: int, microbatches: int, rounds: int) -> dict[str, float]:
    import statistics

    layouts = {
        "ddp (dp=4)": ("ddp", None, GLOBAL_BATCH // 4),
        f"megatron tp=2 × pp=2 (1f1b, m={microbatches})": (
            "megatron", {"tp": 2, "pp": 2, "num_microbatches": microbatches, "schedule": "1f1b"}, GLOBAL_BATCH
        ),
    }  # fmt: skip
    for strategy, options, micro in layouts.values():  # warm-up: first-call costs out of the measurement
        _timed_run(strategy, options, micro, 2, layers)
    samples: dict[str, list[float]] = {label: [] for label in layouts}
    for _ in range(rounds):  # layouts alternate, so load from other jobs hits both alike
        for label, (strategy, options, micro) in layouts.items():
            short = _timed_run(strategy, options, micro, steps, layers)
            long = _timed_run(strategy, options, micro, 2 * steps, layers)
            samples[label].append((long - short) / steps)
    return {label: statistics.median(values) for label, values in samples.items()}


def main() -> None:
    """Print the per-step seconds of both layouts as a markdown table (rank 0's clock)."""
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = run_distributed(
        _worker, nprocs=4, timeout=1800, steps=args.steps, layers=args.layers, microbatches=args.microbatches,
        rounds=args.rounds,
    )[0]  # fmt: skip
    ddp = next(iter(seconds.values()))
    print(f"\n4 gloo processes, GPT-2 {args.layers} layers × width 32, global batch {GLOBAL_BATCH}, fp32")
    print("| layout | s/step | vs DDP |\n|---|---|---|")
    for label, value in seconds.items():
        print(f"| {label} | {value:.3f} | {value / ddp:.2f}× |")


if __name__ == "__main__":
    main()
