"""Per-token losses under pipeline × context parallelism (pp2 × cp2): a causal LM and a token classifier, whole jobs.

One 4-process gloo launch and one 1-process launch for the references, fp32, tiny Llamas (grouped-query, rotary), the
global batch 8 (micro-batch 4 × accumulation 2; two pipeline micro-batches of 2 rows each):
- a ``LlamaForCausalLM`` on packed blocks of 32 tokens whose documents (2 to 14 words, a new one wherever the position
  ids restart) fall across the zigzag chunks: each pipeline chunk embeds its cp rank's positions, the ring attention
  keeps the documents apart from the whole sequences' position ids that travel beside the hidden states, and the last
  stage's loss takes the same positions of the shifted labels and sums the blocks' losses over cp;
- a ``LlamaForTokenClassification`` on padded sentences: the same split of the padding mask, each rank's positions
  of the labels.
Each job is stopped at step 4 (a checkpoint every 2) and resumed to 6 at pp2 × cp2, then exported: every step's loss
on every rank, the final evaluation and the exported weights equal the 1-process run's within 1e-5. In one process:
the megatron strategy takes both tasks at pp2 × cp2, and ``hftrain plan``'s pp × cp rows of a language model are
runnable.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import counting_documents, tagged_rows, tiny_config, tiny_tokenizer, write_jsonl

STEPS, STOP = 6, 4
LAYOUT = {"pp": 2, "cp": 2, "num_microbatches": 2}
TASKS = {"causal_lm": "lm", "token_classification": "tokens"}  # task -> the job folder's model and data


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama causal LM (its EOS the padding) and a tiny Llama trunk (the token head initialised from it), with
    word-level tokenizers, and their data."""
    from transformers import AutoModelForCausalLM, LlamaModel

    root = tmp_path_factory.mktemp("pp_cp_per_token")
    tokenizer = tiny_tokenizer("gpt2")
    config = tiny_config("llama", max_positions=128)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "lm")
    tokenizer.save_pretrained(root / "lm")
    trunk = tiny_config("llama", vocab_size=64)
    trunk.classifier_dropout = 0.0  # LlamaForTokenClassification would default to 0.1
    LlamaModel(trunk).save_pretrained(root / "tokens")
    tiny_tokenizer("bert").save_pretrained(root / "tokens")
    return {
        "root": str(root),
        "lm_train": write_jsonl(root / "lm_train.jsonl", counting_documents(120, seed=0)),
        "lm_validation": write_jsonl(root / "lm_validation.jsonl", counting_documents(20, seed=1)),
        "tokens_train": write_jsonl(root / "tokens_train.jsonl", tagged_rows(64, seed=1)),
        "tokens_validation": write_jsonl(root / "tokens_validation.jsonl", tagged_rows(13, seed=2)),
    }


def _config(job: dict[str, str], task: str, run: str, **fields):
    from hftrain.api import make_config

    name = TASKS[task]
    return make_config(
        model_name_or_path=f"{job['root']}/{name}", task=task, dataset_name=None, train_file=job[f"{name}_train"],
        validation_file=job[f"{name}_validation"], max_seq_length=32, cache_dir=f"{job['root']}/cache",
        output_dir=f"{job['root']}/{run}", max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, per_device_eval_batch_size=3, learning_rate=3e-3, warmup_steps=1,
        logging_steps=1, log_with="none", mixed_precision="no", save_steps=2, **fields,
    )  # fmt: skip


def _train(config, *, stop_at_step: int | None = None) -> dict:
    """The job trained as ``hftrain.job.run_training`` runs it (``tests.tiny.train_job``): its losses, final metrics
    and exported weights, and whether the model was split over cp."""
    from tests.tiny import train_job

    trainer, run = train_job(config, stop_at_step=stop_at_step)
    return {**run, "split": getattr(trainer.runtime.unwrap_model(trainer.model), "context_split", None) is not None}


def _one_process(job: dict[str, str]) -> dict:
    return {task: _train(_config(job, task, f"{task}-reference")) for task in TASKS}


def _pp2_cp2(job: dict[str, str]) -> dict:
    """Each task at pp2 × cp2, stopped at step 4 and resumed to 6 in the same folder."""
    runs = {}
    for task in TASKS:
        part = _train(_config(job, task, f"{task}-pp2-cp2", name="megatron", **LAYOUT), stop_at_step=STOP)
        resumed = _config(job, task, f"{task}-pp2-cp2", name="megatron", resume_from_checkpoint="latest", **LAYOUT)
        runs[task] = {"part": part, "resumed": _train(resumed)}
    return runs


@pytest.fixture(scope="module")
def runs(job) -> dict:
    four = run_distributed(_pp2_cp2, nprocs=4, timeout=900, job=job)
    (one,) = run_distributed(_one_process, nprocs=1, timeout=600, job=job)
    return {"four": four, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("task", list(TASKS))
def test_pp2_cp2_stopped_resumed_and_exported_equals_one_process(runs, task):
    ref = runs["one"][task]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the loss moved
    assert not ref["split"]
    worst = 0.0
    for rank in runs["four"]:  # every rank logs the last stage's loss and evaluates
        part, resumed = rank[task]["part"], rank[task]["resumed"]
        assert part["global_step"] == STOP and resumed["global_step"] == STEPS
        assert part["split"] and resumed["split"]  # the model was split over cp
        assert part["losses"] == pytest.approx(ref["losses"][:STOP], rel=1e-5, abs=1e-6)
        assert len(resumed["losses"]) == STEPS  # the first four from the checkpoint's history
        assert resumed["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        assert resumed["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
        worst = max(worst, *(abs(a - b) for a, b in zip(resumed["losses"], ref["losses"], strict=True)))
    weights = runs["four"][0][task]["resumed"]["weights"]
    assert weights is not None and weights.keys() == ref["weights"].keys()
    for name, tensor in ref["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    moved = max((weights[n] - t).abs().max().item() for n, t in ref["weights"].items())
    print(f"\n{task} pp2 × cp2, stopped at {STOP} and resumed to {STEPS}: largest loss difference {worst:.1e}, "
          f"largest exported weight difference {moved:.1e}")  # fmt: skip


@pytest.mark.parametrize("task", list(TASKS))
def test_the_strategy_takes_per_token_tasks_at_pp_with_cp_and_the_planner_offers_them(tmp_path, task):
    """The megatron strategy's model check takes both per-token tasks at pp2 × cp2 (refused before, issue 57), and
    ``hftrain plan``'s pp × cp rows of the task are runnable, not formula-only."""
    from hftrain.plan import Hardware, Workload, model_from_config, model_parallel
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    config = tiny_config("llama")
    config.save_pretrained(tmp_path / "llama")
    strategy = strategy_from_options(
        "megatron", LAYOUT, launch=LaunchInfo(world_size=4, local_world_size=4), platform=Platform("cpu", "gloo")
    )
    strategy.check_model(config, use_lora=False, task=task)
    model = model_from_config(str(tmp_path / "llama"), task=task)
    assert ("pp", "cp") not in model.refused_layouts  # (a token classifier's ("ep",) is its record's)
    row = model_parallel.estimate(1, 2, model, Workload(dropout=False), Hardware(gpus_per_node=4), cp=2)
    assert row.runnable and not any("formula only" in note for note in row.notes), row.notes
