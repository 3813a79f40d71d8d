"""Causal language modelling: hftrain's SmolLM2 job (``configs/smollm2_lm.yaml``) against the tuned ``Trainer``.

Both sides fine-tune the embedded SmolLM2-135M-Instruct (Llama architecture) with next-token cross entropy on the
embedded Rotten Tomatoes review texts, on the identical packed blocks: ``hftrain.api.load_splits`` of the config
(seed 42, 10 % held out, the config's sample limits) packed by ``hftrain.data.language.pack_splits`` into blocks of
``data.max_seq_length`` tokens with hftrain's tokenizer (whole documents, EOS after each, position ids restarting at
every document, label -100 at padding and document starts). The same steps, batch, learning rate (linear schedule,
10 % warm-up), clipping at 1.0, no weight decay, seed 42, evaluation once at the end (batch 16):

- ``base``: the untrained model's held-out loss on the validation blocks (the step-0 evaluation, which no run logs),
  in the precision the runs evaluate in;
- ``hftrain``: ``run_training(load_config("configs/smollm2_lm.yaml", overrides), LaunchInfo())``, the job behind
  ``hftrain train``, with its defaults (``auto`` precision, fused AdamW, its end-of-run checkpoint and export);
- ``trainer``: ``transformers.Trainer`` at its best CPU settings for this job: ``optim="adamw_torch_fused"``,
  ``bf16=True`` only where the CPU computes bf16 natively (hftrain's ``auto`` rule: an AMX or AVX512-BF16 flag,
  ``Platform.native_bf16``), the packed blocks as its datasets, ``hftrain.data.language.lm_collator`` as its
  collator (``input_ids``, ``labels``, ``position_ids``; no ``attention_mask``, so transformers masks each document
  block-diagonally) and ``use_cache=False`` in the model config (a cache, even an empty one, undoes that mask).
  Its loss is the model's own (``ForCausalLMLoss`` with ``num_items_in_batch``: the mean over the batch's target
  tokens, as hftrain's at one process without accumulation); its end-of-training checkpoint (the default) plus
  ``save_model``, as hftrain checkpoints and exports.

By default both sides read the blocks in order (``--order sequential``: the same batches at every step, so the
per-step losses and the final evaluation compare like for like; the config's ``group_by_length`` shuffles blocks,
which all have one length, with each library's own generator). The evaluation loss of both is hftrain's: the mean
over every target token of the validation blocks (``Σ token losses / Σ targets``, perplexity ``exp`` of it); the
Trainer's own ``eval_loss`` (a mean of per-batch means) is printed beside it.

Each job runs in its own process (Accelerate keeps process-global state); hftrain and the Trainer alternate.
Wall time is from just before the process is started to the end of its job (imports, data loading, packing, model
loading, training, evaluation, checkpoint and export). "train s" excludes evaluation and saving; tokens/s is the
block positions trained (steps x batch x block length) over "train s", "real tokens/s" the same for the
non-padding positions. Peak RSS is the job process's (``ru_maxrss``).

``python benchmarks/lm_trainer.py --max_steps 10`` (a reduced run); without ``--max_steps`` one epoch of the config.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_lm.yaml"


def job_config(args: argparse.Namespace, output_dir: str):
    """The config's job as both sides run it: in ``args.order``, one evaluation at the end, a loss every step."""
    from hftrain.config import load_config

    overrides = [
        "--output_dir", output_dir, "--overwrite_output_dir", "true", "--log_with", "none",
        "--eval_steps", "null", "--logging_steps", "1", "--train_sampling_strategy", args.order,
    ]  # fmt: skip
    if args.max_train_samples:
        overrides += ["--max_train_samples", str(args.max_train_samples)]
    return load_config(CONFIG, overrides)


def packed_blocks(config):
    """The train and validation blocks exactly as hftrain's run builds them (and hftrain's tokenizer)."""
    import hftrain
    from hftrain.data.language import pack_splits
    from hftrain.models import build_tokenizer

    tokenizer = build_tokenizer(config.model)
    splits = hftrain.load_splits(config)
    blocks = pack_splits(
        splits,
        tokenizer,
        block_size=config.data.max_seq_length,
        long_documents=config.data.long_documents,
        log=lambda _: None,
    )
    return blocks, tokenizer


def planned_steps(config, blocks) -> int:
    """One epoch's whole global batches (hftrain leaves out the last partial one), or the config's max_steps."""
    if config.training.max_steps > 0:
        return config.training.max_steps
    return len(blocks["train"]) // config.training.per_device_train_batch_size


def trained_tokens(blocks, steps: int, batch: int, order: str) -> tuple[int, int]:
    """(block positions, non-padding positions) of the first ``steps`` batches (sequential order; the same totals
    in expectation otherwise)."""
    used = min(steps * batch, len(blocks["train"]))
    positions = used * len(blocks["train"][0]["input_ids"])
    if order != "sequential":
        mean_fill = statistics.mean(_filled(row) for row in blocks["train"])
        return positions, round(mean_fill * used)
    return positions, sum(_filled(blocks["train"][i]) for i in range(used))


def _filled(row) -> int:
    """Non-padding positions of a block: up to its last target (the EOS of its last document)."""
    labels = row["labels"]
    last = max((i for i, label in enumerate(labels) if label != -100), default=-1)
    return last + 1


def token_mean_loss(sums, counts) -> float:
    return float(sum(sums)) / max(1.0, float(sum(counts)))


def native_bf16() -> bool:
    from hftrain.strategies.platform import Platform

    return Platform.detect().native_bf16() is not None


# ----------------------------------------------------------------------------- jobs (each in its own process)
def child_base(args: argparse.Namespace, output_dir: str) -> dict:
    """The untrained model's validation loss: hftrain's evaluation (token mean over the blocks), batch 16."""
    import torch
    from transformers import AutoModelForCausalLM

    from hftrain.data.language import lm_collator
    from hftrain.models import resolve_model_path
    from hftrain.trainers.language import IGNORE_INDEX, next_token_targets, token_losses

    config = job_config(args, output_dir)
    blocks, _ = packed_blocks(config)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(config.model.model_name_or_path)).eval()
    validation, batch = blocks["validation"], config.training.per_device_eval_batch_size
    sums, counts = [], []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16()):
        for start in range(0, len(validation), batch):
            inputs = lm_collator([validation[i] for i in range(start, min(start + batch, len(validation)))])
            labels = inputs.pop("labels")
            logits = model(**inputs, use_cache=False).logits
            sums.append(token_losses(None, logits, next_token_targets(labels)).sum().item())
            counts.append((labels[:, 1:] != IGNORE_INDEX).sum().item())
    loss = token_mean_loss(sums, counts)
    return {"end": time.time(), "eval_loss": loss, "perplexity": math.exp(loss), "eval_tokens": sum(counts)}


def child_hftrain(args: argparse.Namespace, output_dir: str) -> dict:
    """hftrain's job as ``hftrain train`` runs it; its phases timed with thin wrappers (no change to the loop)."""
    from hftrain.checkpoint import export
    from hftrain.job import run_training
    from hftrain.strategies import LaunchInfo
    from hftrain.trainers.language import CausalLMTrainer as Task

    config = job_config(args, output_dir)
    if args.max_steps:
        config.training.max_steps = args.max_steps
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
    result = run_training(config, LaunchInfo(), process_exits_after=True)
    end, cpu = time.time(), time.process_time()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # the trained positions, outside the timed span: the blocks again, as the job packed them
    blocks, _ = packed_blocks(config)
    batch = config.training.per_device_train_batch_size
    positions, real = trained_tokens(blocks, result.global_step, batch, args.order)
    train_s = spans["fit"] - spans["eval"] - spans["checkpoint"] - spans["export"]
    return {
        "end": end,
        "cpu_s": cpu,
        "rss_mib": rss,
        "steps": result.global_step,
        "train_s": train_s,
        "eval_s": spans["eval"],
        "save_s": spans["checkpoint"] + spans["export"],
        "tokens_s": positions / train_s,
        "real_tokens_s": real / train_s,
        "eval_loss": result.metrics["eval_loss"],
        "perplexity": result.metrics["eval_perplexity"],
        "losses": [entry["loss"] for entry in result.log_history if "loss" in entry],
        "precision": result.mixed_precision,
    }


def child_trainer(args: argparse.Namespace, output_dir: str) -> dict:
    """The same job through ``transformers.Trainer`` at its tuned CPU settings, on the same packed blocks."""
    import numpy as np
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, set_seed
    from transformers.utils import logging as hf_logging

    from hftrain.data.language import lm_collator
    from hftrain.models import resolve_model_path
    from hftrain.trainers.language import IGNORE_INDEX, next_token_targets, token_losses

    hf_logging.set_verbosity_warning()
    config = job_config(args, output_dir)
    training = config.training
    blocks, tokenizer = packed_blocks(config)
    steps = args.max_steps or planned_steps(config, blocks)
    set_seed(training.seed)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(config.model.model_name_or_path))
    model.config.use_cache = False  # a cache, even an empty one, turns transformers' packed-document mask off
    bf16 = native_bf16()
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=training.per_device_train_batch_size,
        per_device_eval_batch_size=training.per_device_eval_batch_size,
        learning_rate=training.learning_rate,
        lr_scheduler_type=training.lr_scheduler_type,
        warmup_steps=training.warmup_steps,
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        max_steps=steps,
        seed=training.seed,
        optim="adamw_torch_fused",
        bf16=bf16,
        train_sampling_strategy=args.order,
        logging_steps=1,
        eval_strategy="no",
        use_cpu=True,
        report_to="none",
    )

    def per_block_sums(logits, labels):
        """Keep each block's summed target losses, not its (block x 128 x 49,152) logits, for the metric."""
        return token_losses(None, logits, next_token_targets(labels)).sum(dim=-1)

    def token_mean(prediction) -> dict:
        counts = (np.asarray(prediction.label_ids)[:, 1:] != IGNORE_INDEX).sum(axis=-1)
        loss = token_mean_loss(np.asarray(prediction.predictions, dtype=np.float64), counts)
        return {"token_loss": loss, "perplexity": math.exp(loss)}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        data_collator=lm_collator,
        processing_class=tokenizer,
        preprocess_logits_for_metrics=per_block_sums,
        compute_metrics=token_mean,
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
    metrics = trainer.evaluate()
    start = time.perf_counter()
    trainer.save_model(str(Path(output_dir) / "model"))
    save_s = time.perf_counter() - start
    end = time.time()
    positions, real = trained_tokens(blocks, train.global_step, training.per_device_train_batch_size, args.order)
    train_s = train.metrics["train_runtime"] - checkpoint_s[0]
    return {
        "end": end,
        "cpu_s": time.process_time(),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": train.global_step,
        "train_s": train_s,
        "eval_s": metrics["eval_runtime"],
        "save_s": save_s + checkpoint_s[0],
        "tokens_s": positions / train_s,
        "real_tokens_s": real / train_s,
        "eval_loss": metrics["eval_token_loss"],
        "perplexity": metrics["eval_perplexity"],
        "trainer_eval_loss": metrics["eval_loss"],
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "precision": "bf16" if bf16 else "no",
    }


JOBS = {"base": child_base, "hftrain": child_hftrain, "trainer": child_trainer}
# result key -> (table header, number format)
COLUMNS = {
    "wall_s": ("wall s", ".1f"),
    "cpu_s": ("CPU s", ".1f"),
    "train_s": ("train s", ".1f"),
    "eval_s": ("eval s", ".1f"),
    "save_s": ("save s", ".1f"),
    "steps": ("steps", ".0f"),
    "step_s": ("s/step", ".2f"),
    "tokens_s": ("tokens/s", ".0f"),
    "real_tokens_s": ("real tokens/s", ".0f"),
    "rss_mib": ("peak RSS MiB", ".0f"),
    "eval_loss": ("eval loss", ".4f"),
    "perplexity": ("perplexity", ".2f"),
}


def run_job(name: str, args: argparse.Namespace) -> dict:
    """Start one job in a fresh process; its wall time runs from here to the end of its job."""
    with tempfile.TemporaryDirectory(prefix=f"lm-{name}-") as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", name, "--result", str(result_file), "--order", args.order]
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
    if "steps" in result:
        result["step_s"] = result["train_s"] / result["steps"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max_steps", type=int, help="stop after N optimizer steps (default: one epoch)")
    parser.add_argument("--max_train_samples", type=int, help="train on the first N training reviews")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of hftrain and the Trainer, interleaved")
    parser.add_argument(
        "--order",
        default="sequential",
        choices=["sequential", "random", "group_by_length"],
        help="both sides' block order (sequential: the same batches at every step)",
    )
    parser.add_argument("--jobs", default="base,hftrain,trainer", help="comma-separated: base, hftrain, trainer")
    parser.add_argument("--child", choices=list(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="lm-out-") as output_dir:
            result = JOBS[args.child](args, output_dir)
        Path(args.result).write_text(json.dumps(result))
        return
    names = args.jobs.split(",")
    if unknown := set(names) - set(JOBS):
        parser.error(f"--jobs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(JOBS)}")
    print(
        f"# {CONFIG.relative_to(ROOT)}, steps: {args.max_steps or 'one epoch'}, order: {args.order}, "
        f"repetitions: {args.reps}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
        f"native bf16: {native_bf16()}",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in names}
    if "base" in names:
        results["base"].append(run_job("base", args))
        print(f"base: eval loss {results['base'][0]['eval_loss']:.4f}", flush=True)
    for rep in range(args.reps):
        for name in (n for n in names if n != "base"):
            r = run_job(name, args)
            results[name].append(r)
            figures = "  ".join(f"{k} {r[k]:.4g}" for k in COLUMNS if k in r)
            print(f"rep {rep}: {name:8s} {figures}  load {r['load']}", flush=True)
    med = {
        n: {k: statistics.median(r[k] for r in rs) for k in COLUMNS if k in rs[0]} for n, rs in results.items() if rs
    }
    print(f"\nload average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
    print("| job (medians) | " + " | ".join(header for header, _ in COLUMNS.values()) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for n in names:
        cells = (format(med[n][k], f) if k in med[n] else "" for k, (_, f) in COLUMNS.items())
        print(f"| {n} | " + " | ".join(cells) + " |")
    if "hftrain" in med and "trainer" in med:
        h, t = med["hftrain"], med["trainer"]
        print(
            f"\nhftrain / trainer: wall {h['wall_s'] / t['wall_s']:.3f}, train {h['train_s'] / t['train_s']:.3f}, "
            f"tokens/s {h['tokens_s']:.0f} vs {t['tokens_s']:.0f} ({h['tokens_s'] / t['tokens_s']:.3f}x)"
        )
        print(
            f"final eval loss: hftrain {h['eval_loss']:.4f}, trainer {t['eval_loss']:.4f} "
            f"(the Trainer's own eval_loss, a mean of batch means: {results['trainer'][0]['trainer_eval_loss']:.4f})"
        )
        hl, tl = results["hftrain"][0]["losses"], results["trainer"][0]["losses"]
        if args.order == "sequential" and len(hl) == len(tl):
            gap = max(abs(a - b) for a, b in zip(hl, tl, strict=True))
            print(
                f"per-step training loss, same batches: first {hl[0]:.4f} vs {tl[0]:.4f}, largest difference {gap:.4f}"
            )
    if "base" in med:
        for n in (n for n in ("hftrain", "trainer") if n in med):
            print(
                f"{n}: eval loss {med['base']['eval_loss']:.4f} -> {med[n]['eval_loss']:.4f}, perplexity "
                f"{med['base']['perplexity']:.2f} -> {med[n]['perplexity']:.2f}"
            )


if __name__ == "__main__":
    main()
