"""The embedded default job end to end: hftrain against the transformers ``Trainer``, usual and tuned.

Every job fine-tunes the embedded MiniLM (all-MiniLM-L6-v2) on the embedded Rotten Tomatoes reviews, on the
identical train/validation split of ``hftrain.data.loading.load_classification_splits`` (seed 42, 10 %
held out), for one epoch, batch 32, learning rate 5e-5, linear schedule without warm-up, gradient clipping at
1.0, seed 42, truncation at 128 tokens with dynamic padding, evaluation once at the end (batch 64):

- ``trainer_usual``: transformers the usual way: ``dataset.map`` tokenization, ``DataCollatorWithPadding``,
  ``TrainingArguments`` defaults (random sampling, fused AdamW, fp32, and ``save_strategy="steps"``, which writes
  a checkpoint of model, optimizer, scheduler and RNG at the end of training, as hftrain's default does) plus
  batch 32 / lr 5e-5 / 1 epoch / ``use_cpu`` / ``report_to="none"`` / eval batch 64, ``evaluate()`` with
  accuracy, then ``save_model()`` since hftrain's job exports the model too;
- ``trainer_tuned``: the same at the Trainer's best documented CPU settings for this job:
  ``train_sampling_strategy="group_by_length"``, fused AdamW (its default) and ``bf16=True`` only where the CPU
  computes bf16 natively (the rule hftrain's ``auto`` uses: an AMX or AVX512-BF16 flag);
- ``hftrain``: ``run_training(load_config(None, overrides), LaunchInfo())``, the job behind ``hftrain train``
  with its defaults (only ``output_dir``, and ``max_train_samples`` under --quick, are overridden);
- ``hftrain_equal``: ``hftrain`` with every setting equal to ``trainer_tuned``'s (glibc's malloc settings left as
  they are, torch's dropout, torch's clipping before the step): the parity row;
- ablations, each ``hftrain`` with one default turned back: ``hftrain_stock_malloc`` (glibc's malloc settings
  left as they are instead of ``Platform.tune_host_allocator``), ``hftrain_torch_dropout`` (``dropout_kernel:
  torch``), ``hftrain_torch_clip`` (Accelerate's ``clip_grad_norm_`` instead of the clipping folded into the
  fused AdamW step), ``hftrain_fp32`` (``mixed_precision: no``), ``hftrain_unfused`` (``optim: adamw_torch``);
- ``hftrain_eager``: a candidate measured and not kept (``attn_implementation: eager``).

Each job runs in its own process (Accelerate keeps process-global state), jobs alternate A, B, C, A, B, C.
Wall time is from just before the process is started to the end of the job (imports, data loading,
tokenization, model loading, training, evaluation, model export); the statistics printed beside it (padded
tokens per batch, model FLOPs) are computed afterwards, outside the timed span. "save" is hftrain's end-of-run
checkpoint (model, optimizer, scheduler, RNG; written by default) plus its export, and on the other side the
Trainer's end-of-training checkpoint (its default) plus ``save_model``; "train" excludes evaluation and saving.
hftrain's export runs beside its last checkpoint's background write and waits for it before it replaces
``output_dir/model``, so its "save" is the save call plus the export with that wait.
"median step" is the median time between consecutive optimizer-step ends (same batches on every side). "CPU s" is
the job process's CPU time (all threads) up to the same point. Ratios are of medians over repetitions.

The compute floor: the model FLOPs of hftrain's training steps (3 x forward: 2 FLOPs per weight per token in
every linear layer, and 4 x length x hidden per token per layer in attention, at the padded batch shapes of
hftrain's sampler), divided by this CPU's measured matmul throughput (fp32 and bf16, 2 threads, an FFN-sized
product) in this run: the step time no kernel could beat.
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


def child_hftrain(
    args: argparse.Namespace,
    output_dir: str,
    *,
    overrides: tuple[str, ...] = (),
    stock_allocator: bool = False,
    torch_clip: bool = False,
) -> dict:
    """Run hftrain's default job (with ``overrides``); time its phases with thin wrappers (no change to the loop).

    ``stock_allocator`` leaves glibc's malloc settings as they are (the ablation of ``tune_host_allocator``);
    ``torch_clip`` clips with Accelerate's ``clip_grad_norm_`` before the step (the ablation of ``DDPRuntime``'s
    clipping folded into the fused AdamW step).
    """
    if stock_allocator:
        from hftrain.strategies.platform import Platform

        Platform.tune_host_allocator = lambda self: "host allocator: left as is (benchmark ablation)"
    if torch_clip:
        from hftrain.strategies.ddp import DDPRuntime
        from hftrain.strategies.runtime import AccelerateRuntime

        DDPRuntime.clip_grad_norm_ = AccelerateRuntime.clip_grad_norm_
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

    stamps: list[float] = []
    on_step_end = Task._on_step_end

    def stamped(self, *a, **k):
        stamps.append(time.perf_counter())
        return on_step_end(self, *a, **k)

    Task._on_step_end = stamped
    Task.fit, Task.evaluate = timed(Task.fit, "fit"), timed(Task.evaluate, "eval")
    Task.save_checkpoint = timed(Task.save_checkpoint, "checkpoint")
    export.export_pretrained = timed(export.export_pretrained, "export")  # run_training imports it at call time
    overrides = ("--output_dir", output_dir, "--overwrite_output_dir", "true", *overrides)
    if args.max_train_samples:
        overrides += ("--max_train_samples", str(args.max_train_samples))
    if args.max_steps:
        overrides += ("--max_steps", str(args.max_steps))
    config = load_config(None, list(overrides))
    result = run_training(config, LaunchInfo(), process_exits_after=True)  # as `hftrain train` runs it
    end, cpu = time.time(), time.process_time()
    # Padding statistics and model FLOPs, outside the timed span: replay hftrain's own sampler over the lengths.
    from hftrain.data.batching import EpochSampler, tokenize_splits
    from hftrain.models import build_tokenizer, model_config

    lengths = tokenize_splits(
        load_splits(args.max_train_samples), build_tokenizer(config.model), max_seq_length=MAX_SEQ_LENGTH
    )["train"]["length"]
    order = list(EpochSampler(lengths, order=config.training.train_sampling_strategy, group_size=BATCH_SIZE, seed=SEED))
    batches = [[lengths[i] for i in order[j : j + BATCH_SIZE]] for j in range(0, len(order), BATCH_SIZE)]
    batches = batches[: result.global_step]  # a job cut short by --max_steps trained on the first batches only
    return {
        "end": end,
        "cpu_s": cpu,
        "accuracy": result.metrics["eval_accuracy"],
        "steps": result.global_step,
        # the export runs inside fit, beside the last checkpoint's write (Trainer.fit(beside_last_save=...))
        "train_s": spans["fit"] - spans["eval"] - spans["checkpoint"] - spans["export"],
        "step_median_s": median_step(stamps),
        "eval_s": spans["eval"],
        "save_s": spans["checkpoint"] + spans["export"],
        "padded_tokens": statistics.mean(max(b) * len(b) for b in batches),
        "real_tokens": statistics.mean(sum(b) for b in batches),
        "flops_per_step": statistics.mean(training_flops(model_config(config.model), len(b), max(b)) for b in batches),
    }


def median_step(stamps: list[float]) -> float:
    """The median time between consecutive optimizer-step ends (the first step, with its warm-up, has no start).

    Both sides train on the same batches, so the medians compare like with like; unlike the mean, a median is not
    moved by a burst of load from other tenants of the machine during a few steps.
    """
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")  # a 1-step job has no step between two ends


def training_flops(config, batch: int, length: int) -> float:
    """Model FLOPs of one training step of a BERT encoder at ``batch`` x ``length`` (3 x the forward).

    Forward: 2 FLOPs per weight per token in the linear layers (attention projections 4h^2, FFN 2hi, pooler h^2)
    plus 4 x length x h per token per layer for the two attention products (scores and weighted values).
    """
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    tokens = batch * length
    forward = 2 * tokens * (layers * (4 * h * h + 2 * h * i)) + 2 * batch * h * h + layers * 4 * tokens * length * h
    return 3.0 * forward


def matmul_throughput(dtype_name: str, seconds: float = 1.5) -> float:
    """FLOP/s of an FFN-sized matmul (1024 tokens x 384 -> 1536) at this process's thread count."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(1024, 384, dtype=dtype), torch.randn(384, 1536, dtype=dtype)
    a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    return calls * 2 * 1024 * 384 * 1536 / (time.perf_counter() - start)


def child_transformers(args: argparse.Namespace, output_dir: str, *, tuned: bool = False) -> dict:
    """Run the same job the usual transformers way (``tuned``: its best CPU settings); the collator counts tokens."""
    import numpy as np
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
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
        max_steps=args.max_steps or -1,
        **(tuned_settings() if tuned else {}),
    )

    def accuracy(prediction) -> dict:
        return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}

    stamps: list[float] = []

    class StepStamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    trainer = Trainer(
        callbacks=[StepStamps()],
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        data_collator=CountingCollator(tokenizer),
        compute_metrics=accuracy,
    )
    checkpoint_s = [0.0]  # its end-of-training checkpoint, inside train(): counted as saving, not training
    save_checkpoint = trainer._save_checkpoint

    def timed_checkpoint(*a, **k):
        start = time.perf_counter()
        try:
            return save_checkpoint(*a, **k)
        finally:
            checkpoint_s[0] += time.perf_counter() - start

    trainer._save_checkpoint = timed_checkpoint
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
        "train_s": train.metrics["train_runtime"] - checkpoint_s[0],
        "step_median_s": median_step(stamps),
        "eval_s": metrics["eval_runtime"],
        "save_s": save_s + checkpoint_s[0],
        "padded_tokens": statistics.mean(c[0] for c in train_counts),
        "real_tokens": statistics.mean(c[1] for c in train_counts),
    }


def tuned_settings() -> dict:
    """The Trainer's best documented CPU settings for this job: length-grouped batches, bf16 only if native."""
    from hftrain.strategies.platform import Platform

    return {"train_sampling_strategy": "group_by_length", "bf16": Platform.detect().native_bf16() is not None}


JOBS = {
    "trainer_usual": child_transformers,
    "trainer_tuned": functools.partial(child_transformers, tuned=True),
    "hftrain": child_hftrain,
    "hftrain_fp32": functools.partial(child_hftrain, overrides=("--mixed_precision", "no")),
    "hftrain_unfused": functools.partial(child_hftrain, overrides=("--optim", "adamw_torch")),
    "hftrain_stock_malloc": functools.partial(child_hftrain, stock_allocator=True),
    "hftrain_torch_dropout": functools.partial(child_hftrain, overrides=("--dropout_kernel", "torch")),
    "hftrain_torch_clip": functools.partial(child_hftrain, torch_clip=True),
    "hftrain_equal": functools.partial(
        child_hftrain, overrides=("--dropout_kernel", "torch"), stock_allocator=True, torch_clip=True
    ),
    "hftrain_eager": functools.partial(child_hftrain, overrides=("--attn_implementation", "eager")),
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
    "step_median_s": ("median step s", ".3f"),
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
        if args.max_steps:
            command += ["--max_steps", str(args.max_steps)]
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


SIZES = {"1step": (None, 1), "1000": (1000, None), "3000": (3000, None), "all": (None, None)}  # rows, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="train on 1000 rows (32 steps), one repetition each")
    parser.add_argument("--reps", type=int, help="repetitions of each job, interleaved (default 2; 1 with --quick)")
    parser.add_argument("--max_train_samples", type=int, help="train on the first N training rows")
    parser.add_argument("--max_steps", type=int, help="stop after N optimizer steps (1: command to saved model)")
    parser.add_argument(
        "--sizes",
        help=f"comma-separated job sizes, each measured in turn and summed up in one table: {', '.join(SIZES)} "
        "(1step: one optimizer step on all rows, from the command to the saved model)",
    )
    parser.add_argument(
        "--jobs", default=",".join(JOBS), help=f"comma-separated, run in this order each round: {', '.join(JOBS)}"
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
    sizes = args.sizes.split(",") if args.sizes else []
    if unknown := set(sizes) - set(SIZES):
        parser.error(f"--sizes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SIZES)}")
    if not sizes:
        measure(args, names)
        return
    by_size = {}
    for size in sizes:
        args.max_train_samples, args.max_steps = SIZES[size]
        by_size[size] = measure(args, names)
    print_sizes(names, by_size)


def measure(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    """Run ``names`` interleaved ``args.reps`` times at ``args``' size; print and return the medians."""
    print(
        f"\n# train rows: {args.max_train_samples or 'all'}, steps: {args.max_steps or 'one epoch'}, repetitions: "
        f"{args.reps}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, trainer_tuned: {tuned_settings()}",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names:
            r = run_job(name, args)
            results[name].append(r)
            figures = "  ".join(f"{k} {r[k]:.4g}" for k in COLUMNS if k in r)
            print(f"rep {rep}: {name:15s} {figures}  load {r['load']}", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k in COLUMNS} for n, rs in results.items()}
    for m in med.values():
        m["step_s"] = m["train_s"] / m["steps"]
    print(f"\nload average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    print_table(names, med)
    print_ratios(names, med)
    flops = [r["flops_per_step"] for r in results.get("hftrain", []) if "flops_per_step" in r]
    if flops and not args.max_steps:
        print_floor(flops[0], med["hftrain"]["step_s"])
    return med


def print_sizes(names: list[str], by_size: dict[str, dict[str, dict]]) -> None:
    """One row per job size: each job's median wall time, and hftrain's against each Trainer's."""
    trainers = [n for n in ("trainer_tuned", "trainer_usual") if n in names]
    headers = [f"{n} wall s" for n in names] + [f"hftrain / {t}" for t in trainers]
    print("\n| job size | " + " | ".join(headers) + " | accuracy (hftrain, points vs tuned) |")
    print("|---" * (len(names) + len(trainers) + 2) + "|")
    for size, med in by_size.items():
        walls = [f"{med[n]['wall_s']:.1f}" for n in names]
        ratios = [f"{med['hftrain']['wall_s'] / med[t]['wall_s']:.3f}" for t in trainers if "hftrain" in med]
        accuracy = ""
        if "hftrain" in med and "trainer_tuned" in med:
            points = 100 * (med["hftrain"]["accuracy"] - med["trainer_tuned"]["accuracy"])
            accuracy = f"{med['hftrain']['accuracy']:.4f} ({points:+.2f})"
        print(f"| {size} | " + " | ".join(walls + ratios + [accuracy]) + " |")


def print_table(names: list[str], med: dict[str, dict]) -> None:
    print("| job (medians) | " + " | ".join(header for header, _ in COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for n in names:
        cells = (format(med[n][k], f) if k in med[n] else "" for k, (_, f) in COLUMNS.items())
        print(f"| {n} | " + " | ".join(cells) + " |")


RATIOS = [  # (numerator, denominator, figure, target)
    ("hftrain_equal", "trainer_tuned", "step_s", "parity at equal settings: <= 1.00"),
    ("hftrain_equal", "trainer_tuned", "step_median_s", "parity at equal settings, median step: <= 1.00"),
    ("hftrain", "trainer_tuned", "wall_s", "default vs the tuned Trainer: <= 0.80"),
    ("hftrain", "trainer_usual", "wall_s", "default vs the usual Trainer"),
    ("trainer_tuned", "trainer_usual", "wall_s", "what the Trainer's own flags buy"),
    ("hftrain", "hftrain_fp32", "step_s", "ablation: bf16 autocast (native here)"),
    ("hftrain", "hftrain_unfused", "step_s", "ablation: fused AdamW"),
    ("hftrain", "hftrain_stock_malloc", "step_s", "ablation: glibc heap kept for reuse"),
    ("hftrain", "hftrain_torch_dropout", "step_s", "ablation: dropout masks from 64-bit draws"),
    ("hftrain", "hftrain_torch_clip", "step_s", "ablation: clipping folded into the fused AdamW step"),
    ("hftrain_eager", "hftrain", "step_s", "candidate not kept: eager attention"),
]


def print_ratios(names: list[str], med: dict[str, dict]) -> None:
    print()
    for top, bottom, figure, what in RATIOS:
        if top in names and bottom in names:
            ratio = med[top][figure] / med[bottom][figure]
            points = 100 * (med[top]["accuracy"] - med[bottom]["accuracy"])
            print(f"{top} / {bottom}: {figure} {ratio:.3f}, accuracy {points:+.2f} points  ({what})")


def print_floor(flops_per_step: float, step_s: float) -> None:
    """The default job's step time against this CPU's compute floor, fp32 and bf16."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"\ncompute floor: {flops_per_step / 1e9:.1f} GFLOP per training step (hftrain's batches)")
    for dtype in ("float32", "bfloat16"):
        throughput = matmul_throughput(dtype)
        floor = flops_per_step / throughput
        print(
            f"  {dtype}: matmul {throughput / 1e9:.0f} GFLOP/s -> floor {1000 * floor:.0f} ms/step; "
            f"hftrain default {1000 * step_s:.0f} ms/step = {step_s / floor:.2f}x the floor"
        )


if __name__ == "__main__":
    main()
