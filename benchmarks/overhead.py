"""Per-step overhead of hftrain's training loop against a hand-written Accelerate loop.

What is measured: the wall time of one optimizer step in steady state. Both sides train the same model
(same config, same seed, so the same initial weights and dropout masks) on the same tokenized Rotten
Tomatoes reviews, in the same sequential batch order, with the same ``DataCollatorWithPadding`` loader,
the same AdamW parameter groups and the same linear schedule, in one process with the same thread count:

  (a) ``hftrain``: ``SequenceClassificationTrainer.fit()``, its real loop (``accumulate``, ``backward``,
      optional clipping, optimizer/scheduler step, the losses read once per logging window, the stop vote, tqdm),
      with ``logging_steps`` huge (``--logging_steps``), ``log_with="none"``, torch's dropout and no evaluation set;
  (b) the loop from the Accelerate docs: ``for batch in loader: loss = model(**batch).loss;
      accelerator.backward(loss); optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``.

Why steady state: construction (model, ``prepare``) and the first steps (allocator and kernel warm-up)
are not per-step overhead. Each side stamps ``perf_counter()`` and ``process_time()`` at the end of every
optimizer step (hftrain through a ``train_step`` override, which adds the same calls as the hand loop); the
time per step is ``(stamp[N] - stamp[W]) / (N - W)`` (the mean), so the interval covers data loading, the
step and everything the loop does between steps (hftrain's logging bookkeeping included). As the batches are
identical on both sides, the median of one run's step-to-step intervals is also comparable and shrugs off
bursts of load. On a shared machine the process CPU time per step is the steadiest figure (use ``--threads
1`` there: idle OpenMP threads spin-wait, which both inflates and blurs CPU time when cores are taken by
other processes). Whole-run wall times (``fit()`` call vs loop, warm-up included; hftrain's ``fit()`` also
writes its end-of-run checkpoint) are reported beside it. Runs alternate A, B, A, B in one process
(Accelerate state is reset between them) after one untimed round that pays the imports. The headline ratio is
the median over rounds of hftrain/accelerate within a round (the two runs of a round see about the same load);
the ratio of the medians is printed too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.tiny` and an uninstalled hftrain

import torch

# ((wall, CPU) seconds at the end of each optimizer step, whole-run seconds, per-step losses)
Run = tuple[list[tuple[float, float]], float, list[float]]


def build_data(max_seq_length: int, n_examples: int):
    """The first ``n_examples`` tokenized training reviews (hftrain's own loading and tokenization)."""
    from hftrain.config import ModelConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.data.loading import load_classification_splits
    from hftrain.models import build_tokenizer

    tokenizer = build_tokenizer(ModelConfig())
    splits = load_classification_splits(
        dataset_name="embedded:rotten_tomatoes",
        train_file=None,
        validation_file=None,
        text_column="text",
        label_column="label",
        num_labels=2,
        validation_split_percentage=10.0,
        max_train_samples=n_examples,
        max_eval_samples=None,
        seed=42,
        log=lambda _: None,
    )
    return tokenize_splits(splits, tokenizer, max_seq_length=max_seq_length)["train"], tokenizer


def model_init_fn(name: str, vocab_size: int):
    """``bert4``: a randomly initialised 4-layer, hidden-256 BERT; ``tiny``: 2 layers, hidden 64 (issue 54's host-bound
    size, where a step is all Python, dispatch and syncs); ``minilm``: the embedded MiniLM."""

    def build():
        from transformers import AutoModelForSequenceClassification, BertConfig

        if name == "minilm":
            from hftrain.models import resolve_model_path

            path = resolve_model_path("embedded:minilm")
            return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
        width, layers = (64, 2) if name == "tiny" else (256, 4)
        config = BertConfig(
            vocab_size=vocab_size,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=4 * width,
            num_labels=2,
        )
        return AutoModelForSequenceClassification.from_config(config)

    return build


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """hftrain's parameter groups (no decay on biases/norms), so both sides run identical optimizer math."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)


def run_hftrain(args: argparse.Namespace, dataset, tokenizer, steps: int) -> Run:
    """Stamps, ``fit()`` seconds and losses of hftrain's loop."""
    from hftrain.config import TrainingConfig
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import reset_accelerate_state

    stamps: list[tuple[float, float]] = []

    class StampedTrainer(SequenceClassificationTrainer):
        def train_step(self, batch):
            loss = super().train_step(batch)
            stamps.append((time.perf_counter(), time.process_time()))
            return loss

    reset_accelerate_state()
    output_dir = tempfile.TemporaryDirectory(prefix="hftrain-overhead-")  # fit() writes a final checkpoint
    training = TrainingConfig(
        output_dir=output_dir.name,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        max_steps=steps,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        train_sampling_strategy="sequential",
        logging_steps=args.logging_steps,
        log_with="none",
        torch_num_threads=args.threads,
        # The hand-written loop's settings: fp32 and torch's default (for-each) AdamW, whatever 'auto' would pick.
        mixed_precision="no",
        optim="adamw_torch",
        dropout_kernel="torch",  # the hand loop's nn.Dropout and SDPA dropout
    )
    trainer = StampedTrainer(
        training,
        strategy=strategy_from_options("ddp", launch=LaunchInfo()),
        model_init=model_init_fn(args.model, len(tokenizer)),
        tokenizer=tokenizer,
        train_dataset=dataset,
    )
    start = time.perf_counter()
    trainer.fit()
    whole = time.perf_counter() - start
    output_dir.cleanup()
    return stamps, whole, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run_accelerate(args: argparse.Namespace, dataset, tokenizer, steps: int) -> Run:
    """Stamps, loop seconds and losses of the Accelerate-docs loop."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding, get_scheduler

    from tests.tiny import reset_accelerate_state

    reset_accelerate_state()
    torch.set_num_threads(args.threads)
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)  # where hftrain seeds: after the Accelerator, before the model
    model = model_init_fn(args.model, len(tokenizer))()
    optimizer = adamw(model, args.lr)
    loader = DataLoader(
        dataset.remove_columns(["length"]),
        batch_size=args.batch_size,
        shuffle=False,
        collate_fn=DataCollatorWithPadding(tokenizer),
        # As hftrain's loader: its own generator, so the global RNG (dropout masks) is drawn the same way.
        generator=torch.Generator().manual_seed(0),
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=steps)
    stamps, losses = [], []
    model.train()
    start = time.perf_counter()
    for batch in loader:
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        if args.max_grad_norm > 0:  # hftrain clips when max_grad_norm > 0; do the same work here
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        stamps.append((time.perf_counter(), time.process_time()))
        if len(stamps) == steps:
            break
    whole = time.perf_counter() - start
    return stamps, whole, [x.item() for x in losses]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few minutes: 30 steps, 3 rounds")
    parser.add_argument("--model", choices=["bert4", "tiny", "minilm"], default="bert4")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="issue 54's size: --model tiny --batch_size 4 --max_seq_length 16 --steps 600 --warmup 100 --threads 1",
    )
    parser.add_argument("--logging_steps", type=int, default=10**9, help="hftrain's training.logging_steps")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the per-step time")
    parser.add_argument("--rounds", type=int, default=10, help="timed (hftrain, accelerate) pairs")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--max_grad_norm", type=float, default=0.0, help="clip in both loops when > 0")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--profile", metavar="FILE", help="cProfile one extra hftrain run into FILE")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.batch_size, args.max_seq_length = "tiny", 4, 16
        args.steps, args.warmup, args.threads = 600, 100, 1
    if args.quick:
        args.steps, args.rounds = min(args.steps, 30), min(args.rounds, 3)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dataset, tokenizer = build_data(args.max_seq_length, args.steps * args.batch_size)
    tokens = [
        max(dataset["length"][i : i + args.batch_size]) * args.batch_size
        for i in range(0, args.steps * args.batch_size, args.batch_size)
    ]
    print(
        f"# model={args.model} steps={args.steps} warmup={args.warmup} rounds={args.rounds} "
        f"batch={args.batch_size} threads={args.threads} clip={args.max_grad_norm} "
        f"mean padded tokens/batch={statistics.mean(tokens):.0f} load={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    runners = {"hftrain": run_hftrain, "accelerate": run_accelerate}
    for runner in runners.values():  # untimed: imports, first-touch allocations
        runner(args, dataset, tokenizer, args.warmup + 2)
    figures = {name: {"mean": [], "median": [], "cpu": [], "whole": []} for name in runners}
    losses = {}
    for r in range(args.rounds):
        for name, runner in runners.items():
            stamps, seconds, losses[name] = runner(args, dataset, tokenizer, args.steps)
            wall, cpu = zip(*stamps[args.warmup - 1 :], strict=True)
            row = figures[name]
            row["mean"].append((wall[-1] - wall[0]) / (len(wall) - 1))
            row["median"].append(statistics.median(b - a for a, b in itertools.pairwise(wall)))
            row["cpu"].append((cpu[-1] - cpu[0]) / (len(cpu) - 1))
            row["whole"].append(seconds)
            print(f"round {r}: {name:10s} " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in row.items()), flush=True)
    drift = max(abs(a - b) for a, b in zip(losses["hftrain"], losses["accelerate"], strict=True))
    print(
        f"\nmax |loss(hftrain) - loss(accelerate)| over {args.steps} steps: {drift:.2e} "
        "(0 = bit-identical training; with more than one thread CPU kernels may sum in a different order)"
    )
    print(f"load average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    med = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in figures.items()}
    # Each round's two runs are seconds apart and see about the same load: their ratio cancels it.
    paired = {
        k: statistics.median(h / a for h, a in zip(figures["hftrain"][k], figures["accelerate"][k], strict=True))
        for k in figures["hftrain"]
    }
    print("| loop (medians over runs) | wall ms/step (mean) | wall ms/step (median step) | CPU ms/step | whole run s |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {1e3 * m['mean']:.1f} | {1e3 * m['median']:.1f} | {1e3 * m['cpu']:.1f} | {m['whole']:.2f} |")
    print(
        "| **hftrain / accelerate**, median of per-round ratios | "
        + " | ".join(f"**{paired[k]:.3f}**" for k in ("mean", "median", "cpu", "whole"))
        + " |"
    )
    h, a = med["hftrain"], med["accelerate"]
    print(
        "| hftrain / accelerate, ratio of medians | "
        + " | ".join(f"{h[k] / a[k]:.3f}" for k in ("mean", "median", "cpu", "whole"))
        + " |"
    )
    print("\ntarget: hftrain / accelerate <= 1.02 per step")
    if args.profile:
        import cProfile

        cProfile.runctx("run_hftrain(args, dataset, tokenizer, args.steps)", globals(), locals(), args.profile)
        print(f"profile written to {args.profile} (python -m pstats {args.profile})")


if __name__ == "__main__":
    main()
