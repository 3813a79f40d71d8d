"""A pipeline rank holds only its own stage's weights, read from the process's resident memory.

Two gloo processes train a Llama classifier whose vocabulary embedding (400k × 32, 51 MB in fp32) is nearly all
of its weights, at pp = 2: the embedding belongs to stage 0. The model is loaded from a saved folder, as a job
loads it (``hftrain.models.PretrainedBuilder``). Each rank reads its VmRSS (``/proc/self/status``) before the
Trainer builds the model and after it has prepared it (built, split into stages, the other stages released), and
its peak (VmHWM, reset through ``/proc/self/clear_refs`` before the build) after a training step. Everything
else costs both ranks the same, so stage 0 must have grown by the embedding more than stage 1, at the end and at
the peak. A runtime that kept the whole model on every rank shows no difference in either; one that built the
whole model and freed the other stages afterwards (the rank's peak is then the whole model) shows none at the
peak.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.memory import process_memory as vm_rss
from tests.memory import reset_peak

VOCAB, HIDDEN = 400_000, 32


def _stage_memory(folder: str) -> dict:
    import gc

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
    args = TrainingConfig(
        output_dir=_fresh_output_dir(),
        per_device_train_batch_size=4,
        max_steps=1,
        log_with="none",
        mixed_precision="no",
    )
    strategy = strategy_from_options("megatron", {"pp": 2}, launch=launch_info_from_environ())
    gc.collect()
    before = vm_rss()
    reset_peak()  # the peak from here on

    class Trainer(SequenceClassificationTrainer):
        """Reads the peak where the run would save its final checkpoint, and saves none: a checkpoint's own cost
        (the full state gathered on every rank) is not a stage's weights."""

        def save_checkpoint(self) -> None:
            self.last_checkpoint = None
            peak.append(vm_rss("VmHWM") - before)

    peak: list[int] = []
    trainer = Trainer(
        args,
        strategy=strategy,
        model_init=PretrainedBuilder(ModelConfig(model_name_or_path=folder), tokenizer.pad_token_id),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )
    gc.collect()
    after = vm_rss()
    runtime = trainer.runtime
    holds_embedding = "model.embed_tokens.weight" in runtime._params
    trainer.fit()  # the stages still train after the release
    return {
        "pp_rank": runtime.plugin.groups.pp_rank,
        "grew": after - before,
        "peak_grew": peak[0],
        "holds_embedding": holds_embedding,
    }


@pytest.mark.distributed
def test_each_pipeline_rank_holds_only_its_stage_weights(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    model = AutoModelForSequenceClassification.from_config(tiny_config("llama", vocab_size=VOCAB, num_layers=2))
    model.save_pretrained(tmp_path)
    del model
    embedding = VOCAB * HIDDEN * 4
    results = {r["pp_rank"]: r for r in run_distributed(_stage_memory, nprocs=2, timeout=300, folder=str(tmp_path))}
    assert results[0]["holds_embedding"] and not results[1]["holds_embedding"]
    # Both ranks pay the same for everything else (imports, process groups, loaders, the small layers), so the
    # embedding is the difference between their growths: about 0 if stage 1 kept the whole model.
    difference = results[0]["grew"] - results[1]["grew"]
    assert 0.75 * embedding < difference < 1.5 * embedding, (difference, results)
    # Nor at the peak (after a step, before any checkpoint): stage 0 then holds the embedding's weights, gradient
    # and two Adam moments, 4 × 51 MB, and stage 1 none of them, as it never materialized the embedding (built on
    # meta, only its stage's tensors loaded): measured 3.0 ×. A stage 1 that built the whole model and freed the
    # rest afterwards peaks with the embedding (and the file's pages) in it: measured 1.4 ×.
    peak_difference = results[0]["peak_grew"] - results[1]["peak_grew"]
    assert peak_difference > 2.5 * embedding, (peak_difference, results)
