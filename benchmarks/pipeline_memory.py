"""Per-rank memory of pipeline layouts, read from the process, against ``hftrain plan``'s model-state estimate.

SmolLM2-135M's shape (Llama: 30 layers, hidden 576, 9 query / 3 key-value heads, vocabulary 49,152) with random
weights, trained for 2 optimizer steps in fp32 with AdamW under ``megatron`` at pp = 1, 2, 4 and tp = 2 × pp = 2,
each in its own set of gloo processes. Every rank reads ``/proc/self/status``:

- ``baseline``: VmRSS once torch, transformers, hftrain and the data are loaded, before the model is built;
- ``peak``: VmHWM after the steps (where the run would write its final checkpoint; the checkpoint itself is not
  written: its cost is issue 21's), minus the baseline: what model, gradients, optimizer state, activations and
  every transient cost this rank at their worst;
- ``held``: VmRSS at the same point, minus the baseline;
- ``after prepare``: VmRSS once the Trainer has built, split and cut the model (before any step), minus the
  baseline, beside the rank's own weights (a quarter of the model states).

Every rank loads the model from a saved folder as a job does (``hftrain.models.PretrainedBuilder``), so a
pipeline rank reads and materializes only its stage. The same layout is then run with the same 30 layers 8×
narrower (0.3M parameters): its peak and held memory are the **fixed cost** (imports touched on the first step,
process groups, the schedule, the loaders), which does not grow with the model; ``(peak - fixed) / plan`` is the
model and optimizer memory against the plan.

The plan is ``hftrain plan``'s estimate for that rank: its stage's parameters (the plan's formula:
``layers·Ψ_layer/t``, with the rank's own share of the key/value groups where t does not divide them, plus
``V·h/t`` and the other embeddings on the first stage, plus the head on the last, with the stage's real layer
count) × 16 bytes (fp32 parameter, gradient and two Adam moments), plus the plan's working
memory on a first stage with several micro-batches (one micro-batch's embedding gradient, ``V·h/t`` × 4 bytes,
live while autograd adds it to the accumulated one). Activations are kept small (4 sequences of 16 tokens) so
that the model states dominate.

Usage (about 6 minutes on 2 shared cores, 8 GB of memory at most):
    python benchmarks/pipeline_memory.py [--layouts pp1,pp2,pp4,tp3pp2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` and an uninstalled hftrain

from tests.distributed import run_distributed  # noqa: E402
from tests.memory import process_memory as _status  # noqa: E402

LAYOUTS = {"pp1": (1, 1), "pp2": (1, 2), "pp4": (1, 4), "tp3pp2": (3, 2)}  # SmolLM2: tp 1 or 3 (9 heads)
BYTES_PER_PARAMETER = 16  # fp32: parameter 4 + gradient 4 + Adam exp_avg 4 + exp_avg_sq 4


# The fixed cost's model: the same 30 layers, heads and layout, 8× narrower, a 1,024-token vocabulary (0.3M params).
NARROW = {"vocab_size": 1024, "hidden_size": 72, "intermediate_size": 192}


def smollm2_config(**overrides):
    """SmolLM2-135M's architecture as a sequence classifier (random weights: the shapes are what matter)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **{"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536} | overrides,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        num_labels=2,
        pad_token_id=0,
    )


def saved_model(name: str, **overrides) -> str:
    """A folder with SmolLM2-135M's shape (with ``overrides``) and random weights, loaded by every rank as a job
    loads its model (``hftrain.models.PretrainedBuilder``: a pipeline rank materializes only its stage)."""
    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification

    folder = Path(tempfile.gettempdir()) / f"hftrain-bench-{name}-random"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_config(smollm2_config(**overrides)).save_pretrained(folder)
    return str(folder)


def plan_spec():
    """``hftrain plan``'s description of the model (Ψ counted on the meta device, as ``hftrain plan --model``)."""
    import tempfile

    from hftrain.plan.model import model_from_config

    with tempfile.TemporaryDirectory() as folder:
        smollm2_config().save_pretrained(folder)
        return model_from_config(str(Path(folder) / "config.json"))


def plan_stage_parameters(spec, layers: int, *, tp: int, first: bool, last: bool) -> float:
    """``hftrain plan``'s per-GPU parameters of a stage with ``layers`` layers (``plan.model_parallel``'s terms;
    every tp rank holds the same share since grouped-query heads split evenly)."""
    from hftrain.plan.model_parallel import layer_parameters_per_gpu

    vocab = spec.vocab * spec.hidden
    total = layers * layer_parameters_per_gpu(spec, tp)
    if first:
        total += vocab / tp + spec.embedding_parameters - vocab - spec.head_parameters
    if last:
        total += spec.head_parameters
    return total


def _measure(tp: int, pp: int, folder: str) -> dict:
    import gc

    import torch.distributed.pipelining  # noqa: F401 - imported before the baseline, like everything else
    import transformers.models.llama.modeling_llama  # noqa: F401

    import hftrain.strategies.megatron.pipeline_runtime  # noqa: F401
    from hftrain.cli import launch_info_from_environ
    from hftrain.config import ModelConfig, TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.models import PretrainedBuilder
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, reset_accelerate_state, tiny_splits, tiny_tokenizer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("llama")
    tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(16, 4), tokenizer, max_seq_length=16)
    options = {"tp": tp, "pp": pp} | ({"num_microbatches": max(2, pp)} if pp > 1 else {})
    args = TrainingConfig(
        output_dir=_fresh_output_dir(),
        per_device_train_batch_size=4,
        max_steps=2,
        log_with="none",
        mixed_precision="no",
        eval_steps=1000,
    )
    strategy = strategy_from_options("megatron", options, launch=launch_info_from_environ())
    gc.collect()
    baseline = _status("VmRSS")

    class Trainer(SequenceClassificationTrainer):
        """Records memory where the run would checkpoint, instead of checkpointing: a checkpoint's own cost
        (megatron gathers the full state on every rank) is the subject of issue 21, not of this table."""

        def save_checkpoint(self) -> None:
            self.last_checkpoint = None
            measured.update(peak=_status("VmHWM") - baseline, held=_status("VmRSS") - baseline)

    measured: dict[str, int] = {}
    trainer = Trainer(
        args,
        strategy=strategy,
        model_init=PretrainedBuilder(ModelConfig(model_name_or_path=folder), tokenizer.pad_token_id),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=None,
    )
    prepared = _status("VmRSS") - baseline
    trainer.fit()
    peak, held = measured["peak"], measured["held"]
    runtime = trainer.runtime
    layout = runtime.plugin.groups
    stages = list(trainer.model.stages) if pp > 1 else []
    layers = sum(len(s.layers) for s in stages) if pp > 1 else trainer.model.config.num_hidden_layers
    owned = sum(p.numel() for p in runtime._params.values())
    return {
        "rank": int(os.environ["RANK"]),
        "pp_rank": layout.pp_rank,
        "tp_rank": layout.tp_rank,
        "layers": layers,
        "first": pp == 1 or any(s.is_first for s in stages),
        "last": pp == 1 or any(s.is_last for s in stages),
        "owned_parameters": owned,
        "peak": peak,
        "held": held,
        "prepared": prepared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    mib = 1 << 20
    spec = plan_spec()
    print("| layout | rank (pp, tp) | layers | parameters held | plan (MiB) | peak (MiB) | fixed peak (MiB) |"
          " (peak - fixed) / plan | held (MiB) | fixed held (MiB) | (held - fixed) / plan | after prepare (MiB) /"
          " its weights |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    folder, narrow = saved_model("smollm2"), saved_model("smollm2-narrow", **NARROW)
    for name in args.layouts.split(","):
        tp, pp = LAYOUTS[name]
        runs = run_distributed(_measure, nprocs=tp * pp, timeout=1800, tp=tp, pp=pp, folder=folder)
        fixed = {
            r["rank"]: r for r in run_distributed(_measure, nprocs=tp * pp, timeout=1800, tp=tp, pp=pp, folder=narrow)
        }
        for r in sorted(runs, key=lambda r: r["rank"]):
            f = fixed[r["rank"]]
            states = BYTES_PER_PARAMETER * plan_stage_parameters(
                spec, r["layers"], tp=tp, first=r["first"], last=r["last"]
            )
            # the plan's working memory: one micro-batch's embedding gradient being added to the accumulated one
            plan = states + (4 * spec.vocab * spec.hidden / tp if r["first"] and pp > 1 else 0)
            print(
                f"| {name} | {r['rank']} ({r['pp_rank']}, {r['tp_rank']}) | {r['layers']} | "
                f"{r['owned_parameters'] / 1e6:.1f}M | {plan / mib:.0f} | "
                f"{r['peak'] / mib:.0f} | {f['peak'] / mib:.0f} | "
                f"{(r['peak'] - f['peak']) / plan:.3f} | {r['held'] / mib:.0f} | {f['held'] / mib:.0f} | "
                f"{(r['held'] - f['held']) / plan:.3f} | {r['prepared'] / mib:.0f} / {states / 4 / mib:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
