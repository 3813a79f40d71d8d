"""Accuracy of the default job in bf16 autocast against fp32, over seeds: does ``mixed_precision: auto`` hold it?

Runs ``hftrain train`` (the embedded default job: MiniLM on Rotten Tomatoes, one epoch) once per seed and
precision, each in its own process, and prints validation accuracy per run, the mean per precision and the
per-seed difference. The seed sets the head initialisation, the data order and the held-out split, so each
seed's two runs see the same split. ``auto`` is bf16 only on CPUs with native bf16; on others this compares
fp32 with fp32 (the table says which precision ``auto`` chose).

    python benchmarks/precision_accuracy.py                 # seeds 1 2 3 (~12 min on 2 cores with bf16)
    python benchmarks/precision_accuracy.py --seeds 1 --max_train_samples 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(seed: int, precision: str, max_train_samples: int | None) -> dict:
    """One default job; returns its accuracy, wall time and the precision it resolved to."""
    with tempfile.TemporaryDirectory(prefix="precision-") as out:
        command = [sys.executable, "-m", "hftrain.cli", "train", "--seed", str(seed), "--mixed_precision", precision]
        command += ["--output_dir", out, "--log_with", "none"]
        if max_train_samples:
            command += ["--max_train_samples", str(max_train_samples)]
        start = time.time()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"seed {seed} {precision} failed:\n{done.stderr[-3000:]}")
        state = json.loads((Path(out) / "hftrain_strategy.json").read_text())
        metrics = json.loads((Path(out) / "trainer_state.json").read_text())["log_history"]
        accuracy = [h["eval_accuracy"] for h in metrics if "eval_accuracy" in h][-1]
        return {"accuracy": accuracy, "wall_s": time.time() - start, "resolved": state["mixed_precision"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max_train_samples", type=int)
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        auto, fp32 = run(seed, "auto", args.max_train_samples), run(seed, "no", args.max_train_samples)
        rows.append((seed, auto, fp32))
        print(
            f"seed {seed}: auto ({auto['resolved']}) {auto['accuracy']:.4f} in {auto['wall_s']:.0f} s, "
            f"fp32 {fp32['accuracy']:.4f} in {fp32['wall_s']:.0f} s",
            flush=True,
        )
    print("\n| seed | auto precision | accuracy (auto) | accuracy (fp32) | difference | wall s (auto / fp32) |")
    print("|---|---|---|---|---|---|")
    for seed, auto, fp32 in rows:
        difference = 100 * (auto["accuracy"] - fp32["accuracy"])
        print(
            f"| {seed} | {auto['resolved']} | {auto['accuracy']:.4f} | {fp32['accuracy']:.4f} | {difference:+.2f} pt "
            f"| {auto['wall_s']:.0f} / {fp32['wall_s']:.0f} |"
        )
    mean_auto = statistics.mean(a["accuracy"] for _, a, _ in rows)
    mean_fp32 = statistics.mean(f["accuracy"] for _, _, f in rows)
    print(f"| mean | | {mean_auto:.4f} | {mean_fp32:.4f} | {100 * (mean_auto - mean_fp32):+.2f} pt | |")


if __name__ == "__main__":
    main()
