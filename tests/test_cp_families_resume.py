"""The cp = 2 rows of Gemma-2, ModernBERT, ALBERT and DeBERTa-v2 checkpointed, resumed (at cp = 2 and at cp = 1) and
exported; and a mixture-of-experts token classifier at cp = 2, against one process.

One 2-process launch (cp = 2, fp32) and one 1-process launch:
- Gemma-2 (soft-capped attention, sliding window of 4 tokens), ModernBERT (bidirectional local windows of 4 tokens),
  ALBERT (one layer module run by every layer), all three with the ring, and DeBERTa-v2 (relative attention,
  ``cp_comm: all_to_all``) sequence classifiers, texts of 20-40 words, global batch 8, 12 steps, a checkpoint every
  4: stopped at step 8 and resumed to 12, the run equals the uninterrupted one exactly (every loss, learning rate,
  the evaluation) and its weights within 1e-6; the resumed model exported by ``export_pretrained`` reloads in plain
  transformers (``AutoModelForSequenceClassification``) with the trained weights within 1e-6;
- each family's cp = 2 checkpoint of step 8 resumed on one process (megatron, cp = 1: another layout) continues
  the same run: losses and final weights within 1e-5 of the uninterrupted cp = 2 run;
- a tiny Mixtral token classifier (``model.task: token_classification``, the whole job: word-labelled JSON Lines,
  the trainer, the export) with its router loss on (``router_aux_loss_coef`` 0.02) at cp = 2 equals the one-process
  run within 1e-5: every step's loss on both ranks, the evaluation and the exported weights. The router loss's share
  of the loss is far above that (checked: the one-process run without it differs at the first step by > 1e-3).
The split is real: every cp = 2 model carries its ``context_split``, and the token job's strategy file says cp = 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import assert_same_weights
from tests.tiny import run_tiny_training, tagged_rows

# label -> (kind, megatron options at cp = 2)
FAMILIES = {
    "gemma2": ("gemma2", {"cp": 2}),
    "modernbert": ("modernbert", {"cp": 2}),
    "albert": ("albert", {"cp": 2}),
    "deberta-v2": ("deberta-v2", {"cp": 2, "cp_comm": "all_to_all"}),
}
# 96 examples, global batch 8 (one replica): 12 steps per epoch; a checkpoint every 4, stopped at 8
COMMON = {"steps": 12, "save_steps": 4, "micro": 8, "words": (20, 40), "max_seq_length": 64, "return_weights": True}
STEP8 = "checkpoints/step_00000008"
TOKEN_STEPS = 6


def _export(trainer, directory: str) -> dict:
    """Export the trained model (collective) the way the job does: the folder written, and whether the model ran
    split over cp (its ``context_split``)."""
    from hftrain.checkpoint.export import export_pretrained

    split = getattr(trainer.runtime.unwrap_model(trainer.model), "context_split", None) is not None
    result = export_pretrained(trainer.runtime, trainer.model, trainer.tokenizer, directory)
    return {"model_dir": str(result.model_dir), "context_split": split}


# ----------------------------------------------------------------- the MoE token classifier (the whole job)
def _token_job(root: Path) -> dict[str, str]:
    """A tiny Mixtral trunk (no head: the token head is initialised by the job) with a word-level tokenizer, and
    word-labelled JSON Lines; the same trunk without its router loss in ``mixtral-no-aux``."""
    import torch
    from transformers import MixtralModel

    from tests.tiny import tiny_config, tiny_tokenizer, write_jsonl

    for folder, coefficient in (("mixtral", 0.02), ("mixtral-no-aux", 0.0)):
        config = tiny_config("mixtral")
        config.router_aux_loss_coef = coefficient
        config.classifier_dropout = 0.0  # transformers' generic token head would default to 0.1
        torch.manual_seed(0)
        MixtralModel(config).save_pretrained(root / folder)
        tiny_tokenizer("bert").save_pretrained(root / folder)
    return {
        "root": str(root),
        "train": write_jsonl(root / "train.jsonl", tagged_rows(64, seed=1, longest=14)),
        "validation": write_jsonl(root / "validation.jsonl", tagged_rows(13, seed=2, longest=14)),
    }


def _token_run(job: dict[str, str], run: str, model: str = "mixtral", **fields) -> dict:
    """The token classification job trained as ``hftrain.job.run_training`` runs it (micro 8, the global batch 8)."""
    from hftrain.api import make_config
    from tests.tiny import train_job

    config = make_config(
        model_name_or_path=f"{job['root']}/{model}", task="token_classification", dataset_name=None,
        train_file=job["train"], validation_file=job["validation"], max_seq_length=32,
        cache_dir=f"{job['root']}/cache", output_dir=f"{job['root']}/{run}", max_steps=TOKEN_STEPS,
        per_device_train_batch_size=8, per_device_eval_batch_size=3, learning_rate=3e-3, warmup_steps=1,
        logging_steps=1, log_with="none", mixed_precision="no", **fields,
    )  # fmt: skip
    return train_job(config)[1]


# ----------------------------------------------------------------- the launches
def _two(root: str, job: dict[str, str]) -> dict:
    runs = {}
    for label, (kind, options) in FAMILIES.items():
        common = {**COMMON, "kind": kind, "strategy": "megatron", "strategy_options": options}
        full = run_tiny_training(output_dir=f"{root}/{label}/full", **common)
        part = run_tiny_training(output_dir=f"{root}/{label}/part", stop_at_step=8, **common)
        resumed = run_tiny_training(
            output_dir=f"{root}/{label}/part", resume_from_checkpoint="latest",
            inspect=lambda trainer, label=label: _export(trainer, f"{root}/{label}/export"), **common,
        )  # fmt: skip
        runs[label] = {"full": full, "part": part, "resumed": resumed}
    runs["moe-token"] = _token_run(job, "token-cp2", name="megatron", cp=2)
    return runs


def _one(root: str, job: dict[str, str]) -> dict:
    runs = {
        "moe-token": _token_run(job, "token-reference"),
        "moe-token-no-aux": _token_run(job, "token-no-aux", model="mixtral-no-aux"),
    }
    # Last: the one-process megatron runs start a process group, which the DDP reference above must not see.
    for label, (kind, _) in FAMILIES.items():
        runs[label] = run_tiny_training(
            output_dir=f"{root}/{label}/cp1", kind=kind, strategy="megatron", strategy_options={"tp": 1},
            resume_from_checkpoint=f"{root}/{label}/part/{STEP8}", trust_external_checkpoint=True, **COMMON,
        )  # fmt: skip
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("cp_families"))
    job = _token_job(tmp_path_factory.mktemp("cp_moe_token"))
    two = run_distributed(_two, nprocs=2, timeout=900, root=root, job=job)
    (one,) = run_distributed(_one, nprocs=1, timeout=900, root=root, job=job)
    return {"two": two, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(FAMILIES))
def test_cp2_stopped_and_resumed_equals_uninterrupted_and_exports(runs, label):
    from transformers import AutoModelForSequenceClassification

    from tests.megatron_runs import assert_resumed_equals_uninterrupted

    ranks = [rank[label] for rank in runs["two"]]
    assert_resumed_equals_uninterrupted(ranks)
    full = ranks[0]["full"]
    assert full["losses"][-1] != pytest.approx(full["losses"][0], rel=1e-3)  # it trained
    assert full["metrics"]["eval_samples"] == 25
    for rank in ranks:  # split over cp on every rank; every rank got the same folder
        assert rank["resumed"]["inspected"] == {**ranks[0]["resumed"]["inspected"], "context_split": True}
    model = AutoModelForSequenceClassification.from_pretrained(ranks[0]["resumed"]["inspected"]["model_dir"])
    assert type(model).__name__.lower().startswith(label.replace("-", "").replace("_", ""))
    assert_same_weights(model.state_dict(), ranks[0]["resumed"]["weights"], atol=1e-6)  # every tensor, by name


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(FAMILIES))
def test_the_cp2_checkpoint_resumes_at_cp1_on_one_process(runs, label):
    full, on_one = runs["two"][0][label]["full"], runs["one"][label]
    assert on_one["global_step"] == 12 and on_one["num_processes"] == 1
    assert on_one["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert on_one["lrs"] == pytest.approx(full["lrs"], rel=1e-9)
    assert on_one["metrics"] == pytest.approx(full["metrics"], rel=1e-5, abs=1e-6)
    assert_same_weights(on_one["weights"], full["weights"], atol=1e-5)


@pytest.mark.distributed
def test_a_moe_token_classifier_at_cp2_equals_one_process_with_its_router_loss(runs):
    import torch
    from transformers import AutoModelForTokenClassification

    ref = runs["one"]["moe-token"]
    assert len(ref["losses"]) == TOKEN_STEPS and ref["losses"][-1] < ref["losses"][0] - 0.05  # the loss moved
    # the router loss is on, and it matters at this tolerance: without it the first step's loss moves
    without = runs["one"]["moe-token-no-aux"]["losses"]
    assert abs(ref["losses"][0] - without[0]) > 1e-3 * abs(without[0])
    for rank in runs["two"]:  # every cp rank logs the whole loss and evaluates the whole set
        run = rank["moe-token"]
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    weights = runs["two"][0]["moe-token"]["weights"]
    assert weights is not None and weights.keys() == ref["weights"].keys()
    for name, tensor in ref["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    folder = Path(runs["two"][0]["moe-token"]["model_dir"])
    strategy = json.loads((folder.parent / "hftrain_strategy.json").read_text())
    assert strategy["cp"] == 2 and strategy["dp_size"] == 1 and strategy["global_batch"] == 8  # split over cp
    model = AutoModelForTokenClassification.from_pretrained(folder)
    assert type(model).__name__ == "MixtralForTokenClassification"
    assert model.config.router_aux_loss_coef == 0.02
