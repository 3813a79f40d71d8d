"""LoRA against full fine-tuning at pp = 2: step time and optimizer state bytes per rank (issue 57's goals).

The pipeline memory benchmark's model (``benchmarks/pipeline_memory.py``: SmolLM2-135M's shape, Llama with 30
layers, hidden 576, vocabulary 49,152, random weights saved to a folder and loaded as a job loads it) as a sequence
classifier under ``megatron`` at pp = 2 (1F1B, ``--microbatches`` micro-batches) on 2 gloo processes, fp32 AdamW:

- **full**: every parameter trained;
- **LoRA**: ``lora_r`` ``--rank`` adapters on PEFT's default targets for Llama (``q_proj``, ``v_proj``) in every
  layer, the classifier (``score``) trained in full (``modules_to_save``).

Each run trains ``--steps`` optimizer steps (no evaluation, no checkpoint); the time per step is the median gap
between consecutive step ends after ``--warmup`` steps, measured on each rank (the slower rank counts: a pipeline
step ends when its last stage is done). Runs alternate full / LoRA for ``--rounds`` rounds so load from other jobs
hits both alike; the table gives the median over rounds and the ratio LoRA / full. The optimizer state bytes are every
tensor in the rank's optimizer state (Adam's two moments and its step counters) after the run.

Usage (about 3-5 minutes on 2 shared cores, ~3 GB of memory)::

    python benchmarks/pipeline_lora.py [--steps 10 --warmup 3 --rounds 3 --rank 8 --batch 8 --seq 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests`, `benchmarks` and an uninstalled hftrain

from benchmarks.pipeline_memory import saved_model  # noqa: E402 - the same model as the memory benchmark
from tests.distributed import run_distributed  # noqa: E402


def _run(folder: str, *, lora_rank: int, steps: int, warmup: int, batch: int, seq: int, microbatches: int) -> dict:
    """One pp=2 run; this rank's step times after the warm-up and its optimizer state bytes."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.config import LoraConfig, ModelConfig, TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.models import PretrainedBuilder
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, reset_accelerate_state, tiny_splits, tiny_tokenizer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("llama")
    tokenizer.pad_token = tokenizer.eos_token
    # seq to 2·seq words, cut at seq tokens: every example is seq tokens long
    splits = tokenize_splits(tiny_splits(batch * (steps + 1), 4, words=(seq, 2 * seq)), tokenizer, max_seq_length=seq)
    args = TrainingConfig(
        output_dir=_fresh_output_dir(), per_device_train_batch_size=batch, max_steps=steps, log_with="none",
        mixed_precision="no", eval_steps=10**6, logging_steps=10**6, torch_num_threads=1, learning_rate=1e-4,
    )  # fmt: skip
    options = {"pp": 2, "num_microbatches": microbatches, "schedule": "1f1b"}
    strategy = strategy_from_options("megatron", options, launch=launch_info_from_environ())
    lora = LoraConfig(use_lora=True, lora_r=lora_rank, lora_alpha=2 * lora_rank) if lora_rank else None
    ends: list[float] = []

    class Trainer(SequenceClassificationTrainer):
        """Stamps every optimizer step's end; writes no checkpoint (its cost is not this benchmark's)."""

        def _on_step_end(self, *args, **kwargs):
            ends.append(time.perf_counter())
            return super()._on_step_end(*args, **kwargs)

        def save_checkpoint(self) -> None:
            self.last_checkpoint = None

    trainer = Trainer(
        args,
        strategy=strategy,
        model_init=PretrainedBuilder(ModelConfig(model_name_or_path=folder), tokenizer.pad_token_id, lora),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=None,
    )
    trainer.fit()
    runtime = trainer.runtime
    state = runtime._optimizer.state
    optimizer_bytes = sum(
        t.numel() * t.element_size() for s in state.values() for t in s.values() if hasattr(t, "numel")
    )
    params = runtime._params.values()
    return {
        "step_seconds": [b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :], strict=False)],
        "optimizer_bytes": optimizer_bytes,
        "trained": sum(p.numel() for p in params if p.requires_grad),
        "held": sum(p.numel() for p in params),
        "pp_rank": runtime.plugin.groups.pp_rank,
    }


def _worker(folder: str, rank: int, rounds: int, **run: int) -> dict:
    import statistics

    samples: dict[str, list[float]] = {"full": [], "lora": []}
    last: dict[str, dict] = {}
    for _ in range(rounds):
        for label, lora_rank in (("full", 0), ("lora", rank)):
            result = _run(folder, lora_rank=lora_rank, **run)
            samples[label].append(statistics.median(result["step_seconds"]))
            last[label] = result
    return {label: {**last[label], "median": statistics.median(values), "rounds": values} for label, values in
            samples.items()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()
    folder = saved_model("smollm2")
    ranks = run_distributed(
        _worker, nprocs=2, timeout=3600, folder=folder, rank=args.rank, rounds=args.rounds, steps=args.steps,
        warmup=args.warmup, batch=args.batch, seq=args.seq, microbatches=args.microbatches,
    )  # fmt: skip
    mib = 1 << 20
    step = {label: max(r[label]["median"] for r in ranks) for label in ("full", "lora")}
    rounds = {label: [round(max(v), 3) for v in zip(*(r[label]["rounds"] for r in ranks), strict=True)]
              for label in ("full", "lora")}  # fmt: skip
    print(
        f"\nSmolLM2-135M's shape, megatron pp=2 (1f1b, m={args.microbatches}), batch {args.batch} × {args.seq} tokens, "
        f"fp32 AdamW, LoRA r={args.rank} on q_proj/v_proj + score; median of {args.rounds} rounds "
        f"(per-round medians: full {rounds['full']}, LoRA {rounds['lora']})"
    )
    print("| | full fine-tuning | LoRA | LoRA / full |\n|---|---|---|---|")
    print(f"| s/step (slower rank) | {step['full']:.3f} | {step['lora']:.3f} | {step['lora'] / step['full']:.2f}× |")
    for r in sorted(ranks, key=lambda r: r["full"]["pp_rank"]):
        full, lora = r["full"], r["lora"]
        print(
            f"| pp rank {full['pp_rank']}: optimizer state | {full['optimizer_bytes'] / mib:.1f} MiB | "
            f"{lora['optimizer_bytes'] / mib:.3f} MiB | {lora['optimizer_bytes'] / full['optimizer_bytes']:.2%} |"
        )
        print(
            f"| pp rank {full['pp_rank']}: trained / held parameters | {full['trained'] / 1e6:.2f}M / "
            f"{full['held'] / 1e6:.2f}M | {lora['trained'] / 1e6:.3f}M / {lora['held'] / 1e6:.2f}M | "
            f"{lora['trained'] / full['trained']:.2%} |"
        )


if __name__ == "__main__":
    main()
