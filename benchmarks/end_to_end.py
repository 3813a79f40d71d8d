"""The embedded default job end to end: hftrain against the transformers ``Trainer``.

Both sides fine-tune the embedded MiniLM (all-MiniLM-L6-v2) on the embedded Rotten Tomatoes reviews, on the
identical train/validation split of ``hftrain.data.loading.load_classification_splits`` (seed 42, 10 %
held out), for one epoch, batch 32, learning rate 5e-5, linear schedule without warm-up, gradient clipping at
1.0, seed 42, truncation at 128 tokens with dynamic padding, evaluation once at the end (batch 64):

  (a) hftrain: ``run_training(load_config(None, overrides), LaunchInfo())``, the job behind ``hftrain train``
      with its defaults (only ``output_dir``, and ``max_train_samples`` under --quick, are overridden);
  (b) transformers: ``dataset.map`` tokenization, ``DataCollatorWithPadding``, ``TrainingArguments``
      (per_device_train_batch_size 32, learning_rate 5e-5, num_train_epochs 1, use_cpu, report_to none,
      save_strategy no, per_device_eval_batch_size 64), ``trainer.train()``, ``trainer.evaluate()`` with
      accuracy, then ``trainer.save_model()`` since hftrain's job exports the model too;
  (c) optional (``--jobs hftrain,transformers,hftrain_fused``): (a) with ``AdamW(fused=True)``, a preview of a
      proposed hftrain change (transformers' default optimizer; torch's default on CPU is a per-tensor loop).

Each job runs in its own process (Accelerate keeps process-global state), jobs alternate A, B, A, B.
Wall time is from just before the process is started to the end of the job (imports, data loading,
tokenization, model loading, training, evaluation, model export); the statistics printed beside it (padded
tokens per batch) are computed afterwards, outside the timed span. "save" is hftrain's end-of-run checkpoint
(model, optimizer, scheduler, RNG; written by default) plus its export, and ``save_model`` on the other side;
"train" excludes evaluation and saving. "CPU s" is the job process's CPU time (all threads) up to the same
point: on a machine shared with other jobs it moves less with their load than wall time does. Ratios are of
medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZE, EVAL_BATCH_SIZE, LR, SEED, MAX_SEQ_LENGTH = 32, 64, 5e-5, 42, 128


def load_splits(max_train_samples: int | None):
    """hftrain's split of the embedded Rotten Tomatoes reviews (both jobs get exactly these rows)."""
    from hftrain.data.loading import load_classification_splits

    return load_classification_splits(
        dataset_name="embedded:rotten_tomatoes",
        train_file=None,
        validation_file=None,
        text_column="text",
        label_column="label",
        num_labels=2,
        validation_split_percentage=10.0,
        max_train_samples=max_train_samples,
        max_eval_samples=None,
        seed=SEED,
        log=lambda _: None,
    )


def child_hftrain(args: argparse.Namespace, output_dir: str, *, fused_adamw: bool = False) -> dict:
    """Run hftrain's default job; time its phases with thin wrappers around methods (no change to the loop).

    ``fused_adamw`` previews a proposed change: the same AdamW parameter groups with ``fused=True``, the
    optimizer the transformers ``Trainer`` uses by default (torch's default on CPU is a per-tensor loop).
    """
    from hftrain.checkpoint import export
    from hftrain.config import load_config
    from hftrain.job import run_training
    from hftrain.strategies import LaunchInfo
    from hftrain.trainers import SequenceClassificationTrainer as Task

    spans = {"fit": 0.0, "eval": 0.0, "checkpoint": 0.0, "export": 0.0}

    def timed(function, key):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spans[key] += time.perf_counter() - start

        return wrapper

    Task.fit, Task.evaluate = timed(Task.fit, "fit"), timed(Task.evaluate, "eval")
    Task.save_checkpoint = timed(Task.save_checkpoint, "checkpoint")
    export.export_pretrained = timed(export.export_pretrained, "export")  # run_training imports it at call time
    if fused_adamw:
        import torch

        unfused = Task.create_optimizer

        def create_optimizer(self, model):
            groups = [
                {"params": g["params"], "weight_decay": g["weight_decay"]} for g in unfused(self, model).param_groups
            ]
            return torch.optim.AdamW(groups, lr=self.args.learning_rate, fused=True)

        Task.create_optimizer = create_optimizer
    overrides = ["--output_dir", output_dir, "--overwrite_output_dir", "true"]
    if args.max_train_samples:
        overrides += ["--max_train_samples", str(args.max_train_samples)]
    config = load_config(None, overrides)
    result = run_training(config, LaunchInfo())
    end, cpu = time.time(), time.process_time()
    # Padding statistics, outside the timed span: replay hftrain's own sampler over the same lengths.
    from hftrain.data.batching import EpochSampler, tokenize_splits
    from hftrain.models import build_tokenizer

    lengths = tokenize_splits(
        load_splits(args.max_train_samples), build_tokenizer(config.model), max_seq_length=MAX_SEQ_LENGTH
    )["train"]["length"]
    order = list(EpochSampler(lengths, order=config.training.train_sampling_strategy, group_size=BATCH_SIZE, seed=SEED))
    batches = [[lengths[i] for i in order[j : j + BATCH_SIZE]] for j in range(0, len(order), BATCH_SIZE)]
    return {
        "end": end,
        "cpu_s": cpu,
        "accuracy": result.metrics["eval_accuracy"],
        "steps": result.global_step,
        "train_s": spans["fit"] - spans["eval"] - spans["checkpoint"],
        "eval_s": spans["eval"],
        "save_s": spans["checkpoint"] + spans["export"],
        "padded_tokens": statistics.mean(max(b) * len(b) for b in batches),
        "real_tokens": statistics.mean(sum(b) for b in batches),
    }


def child_transformers(args: argparse.Namespace, output_dir: str) -> dict:
    """Run the same job the usual transformers way; the collator counts tokens (one ``numel`` per batch)."""
    import numpy as np
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )
    from transformers.utils import logging as hf_logging

    from hftrain.models import resolve_model_path

    hf_logging.set_verbosity_warning()
    counts: list[tuple[int, int]] = []

    class CountingCollator(DataCollatorWithPadding):
        def __call__(self, features):
            batch = super().__call__(features)
            counts.append((batch["input_ids"].numel(), int(batch["attention_mask"].sum())))
            return batch

    path = resolve_model_path("embedded:minilm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    splits = load_splits(args.max_train_samples)
    tokenized = splits.map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=MAX_SEQ_LENGTH),
        batched=True,
        remove_columns=["text"],
    )
    set_seed(SEED)  # the classification head is initialised in from_pretrained
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH_SIZE,
        per_device_eval_batch_size=EVAL_BATCH_SIZE,
        learning_rate=LR,
        num_train_epochs=1,
        seed=SEED,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
    )

    def accuracy(prediction) -> dict:
        return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=CountingCollator(tokenizer),
        compute_metrics=accuracy,
    )
    train = trainer.train()
    train_counts = list(counts)
    metrics = trainer.evaluate()
    start = time.perf_counter()
    trainer.save_model(str(Path(output_dir) / "model"))
    save_s = time.perf_counter() - start
    return {
        "end": time.time(),
        "cpu_s": time.process_time(),
        "accuracy": metrics["eval_accuracy"],
        "steps": train.global_step,
        "train_s": train.metrics["train_runtime"],
        "eval_s": metrics["eval_runtime"],
        "save_s": save_s,
        "padded_tokens": statistics.mean(c[0] for c in train_counts),
        "real_tokens": statistics.mean(c[1] for c in train_counts),
    }


JOBS = {
    "hftrain": child_hftrain,
    "transformers": child_transformers,
    "hftrain_fused": functools.partial(child_hftrain, fused_adamw=True),
}
# result key -> (table header, number format)
COLUMNS = {
    "wall_s": ("wall s", ".1f"),
    "cpu_s": ("CPU s", ".1f"),
    "train_s": ("train s", ".1f"),
    "eval_s": ("eval s", ".1f"),
    "save_s": ("save s", ".1f"),
    "steps": ("steps", ".0f"),
    "step_s": ("s/step (train)", ".3f"),
    "padded_tokens": ("padded tokens/batch", ".0f"),
    "real_tokens": ("real tokens/batch", ".0f"),
    "accuracy": ("val. accuracy", ".4f"),
}


def run_job(name: str, args: argparse.Namespace) -> dict:
    """Start one job in a fresh process; its wall time runs from here to the end of its job."""
    with tempfile.TemporaryDirectory(prefix=f"e2e-{name}-") as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", name, "--result", str(result_file)]
        if args.max_train_samples:
            command += ["--max_train_samples", str(args.max_train_samples)]
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        load = os.getloadavg()[0]
        start = time.time()
        with open(Path(tmp) / "log.txt", "w") as log:
            done = subprocess.run(command, check=False, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        if done.returncode != 0:
            sys.exit(f"{name} job failed:\n" + (Path(tmp) / "log.txt").read_text()[-3000:])
        result = json.loads(result_file.read_text())
    result.update(wall_s=result["end"] - start, load=f"{load:.1f}..{os.getloadavg()[0]:.1f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="train on 1000 rows (32 steps), one repetition each")
    parser.add_argument("--reps", type=int, help="repetitions of each job, interleaved (default 2; 1 with --quick)")
    parser.add_argument("--max_train_samples", type=int, help="train on the first N training rows")
    parser.add_argument(
        "--jobs",
        default="hftrain,transformers",
        help=f"comma-separated, run in this order each round: {', '.join(JOBS)}",
    )
    parser.add_argument("--child", choices=list(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="e2e-out-") as output_dir:
            result = JOBS[args.child](args, output_dir)
        Path(args.result).write_text(json.dumps(result))
        return
    if args.quick:
        args.max_train_samples = args.max_train_samples or 1000
    args.reps = args.reps or (1 if args.quick else 2)
    names = args.jobs.split(",")
    if unknown := set(names) - set(JOBS):
        parser.error(f"--jobs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(JOBS)}")
    print(
        f"# train rows: {args.max_train_samples or 'all'}, repetitions: {args.reps}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names:
            r = run_job(name, args)
            results[name].append(r)
            figures = "  ".join(f"{k} {r[k]:.4g}" for k in COLUMNS if k in r)
            print(f"rep {rep}: {name:13s} {figures}  load {r['load']}", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in COLUMNS if k in rs[0]} for n, rs in results.items()}
    for m in med.values():
        m["step_s"] = m["train_s"] / m["steps"]
    print(f"\nload average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    print("| job (medians) | " + " | ".join(header for header, _ in COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for n in names:
        print(f"| {n} | " + " | ".join(format(med[n][k], f) for k, (_, f) in COLUMNS.items()) + " |")
    if "transformers" not in med:
        return
    t = med["transformers"]
    for n in (n for n in names if n != "transformers"):
        h = med[n]
        cells = [f"{h[k] / t[k]:.3f}" if k != "accuracy" else f"{100 * (h[k] - t[k]):+.2f} pt" for k in COLUMNS]
        print(f"| **{n} / transformers** | " + " | ".join(cells) + " |")
    for n in (n for n in names if n != "transformers"):
        print(
            f"\n{n} / transformers: wall time {med[n]['wall_s'] / t['wall_s']:.3f} (target <= 0.85), accuracy "
            f"{100 * (med[n]['accuracy'] - t['accuracy']):+.2f} points (target within 1)"
        )


if __name__ == "__main__":
    main()
