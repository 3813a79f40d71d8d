"""Regression and multi-label classification, besides single-label: the same trainer under every strategy.

Three launches: one process for the references; 2 processes for DDP and ZeRO-3 (micro-batch 4 each, the
reference's 8 split over the replicas); 4 processes for megatron tp=2 × pp=2 (the pipeline's last stage computes
transformers' loss for the config's ``problem_type``). Each equals its 1-process run within 1e-5 (fp32): losses
every step and the final evaluation (loss and the task's metrics). Then ``hftrain train`` on model folders whose
``config.json`` names the task (transformers' ``problem_type``), which crashed at step 1 before: each trains, and its
exported ``config.json`` keeps the task.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hftrain.cli import main
from tests.distributed import run_distributed
from tests.tiny import (
    TASK_LABELS,
    reset_accelerate_state,
    run_tiny_training,
    save_model_folder,
    synthetic_texts,
    task_labels,
)

REGRESSION, MULTI_LABEL = "regression", "multi_label_classification"
TASKS = (REGRESSION, MULTI_LABEL)
STEPS = 6
PIPELINE = {"tp": 2, "pp": 2, "num_microbatches": 4, "schedule": "1f1b"}
MEGATRON_KIND = {REGRESSION: "llama", MULTI_LABEL: "gpt2"}  # the data-parallel runs use BERT


def _run(task: str, kind: str, micro: int, **options) -> dict:
    return run_tiny_training(kind=kind, problem_type=task, micro=micro, gas=1, steps=STEPS, **options)


def _references() -> dict:
    runs = {(task, "bert"): _run(task, "bert", 8) for task in TASKS}
    runs.update({(task, MEGATRON_KIND[task]): _run(task, MEGATRON_KIND[task], 8) for task in TASKS})
    return runs


def _data_parallel() -> dict:
    strategies = ("ddp", "zero3")
    return {(task, strategy): _run(task, "bert", 4, strategy=strategy) for task in TASKS for strategy in strategies}


def _megatron() -> dict:
    return {task: _run(task, MEGATRON_KIND[task], 8, strategy="megatron", strategy_options=PIPELINE) for task in TASKS}


@pytest.fixture(scope="module")
def runs() -> dict:
    (reference,) = run_distributed(_references, nprocs=1, timeout=900)
    return {
        "reference": reference,
        "two": run_distributed(_data_parallel, nprocs=2, timeout=900),
        "four": run_distributed(_megatron, nprocs=4, timeout=1200),
    }


def _assert_equal(run: dict, ref: dict) -> None:
    assert len(run["losses"]) == len(ref["losses"]) == STEPS
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert run["metrics"]["eval_samples"] == ref["metrics"]["eval_samples"] == 25  # each example once
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the loss moved


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("task", TASKS)
def test_data_parallel_equals_one_process(runs, task, strategy):
    for rank in runs["two"]:
        _assert_equal(rank[(task, strategy)], runs["reference"][(task, "bert")])


@pytest.mark.distributed
@pytest.mark.parametrize("task", TASKS)
def test_megatron_tp2_pp2_equals_one_process(runs, task):
    for rank in runs["four"]:
        _assert_equal(rank[task], runs["reference"][(task, MEGATRON_KIND[task])])


@pytest.mark.distributed
def test_each_task_reports_its_own_metrics(runs):
    regression = runs["reference"][(REGRESSION, "bert")]["metrics"]
    assert set(regression) == {"eval_loss", "eval_samples", "eval_mse", "eval_rmse", "eval_mae", "eval_pearson"}
    assert regression["eval_loss"] == pytest.approx(regression["eval_mse"], rel=1e-6)  # MSE is the loss
    multi = runs["reference"][(MULTI_LABEL, "bert")]["metrics"]
    assert set(multi) == {"eval_loss", "eval_samples", "eval_accuracy", "eval_f1_micro", "eval_f1_macro"}


def _jsonl(path: Path, problem_type: str, rows: int = 64) -> Path:
    texts, _ = synthetic_texts(rows, seed=3)
    labels, _ = task_labels(texts, problem_type)
    if problem_type == MULTI_LABEL:  # as people write them: the ids of the labels a text has
        labels = [[i for i, hot in enumerate(row) if hot] for row in labels]
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in zip(texts, labels, strict=True)))
    return path


@pytest.mark.parametrize("problem_type", TASKS)
def test_a_model_whose_config_names_the_task_trains_and_exports_it(tmp_path, capsys, problem_type):
    num_labels = TASK_LABELS[problem_type]
    model = save_model_folder(tmp_path / "model", num_labels=num_labels, problem_type=problem_type)
    out = tmp_path / "out"
    data = _jsonl(tmp_path / "train.jsonl", problem_type)
    args = ["train", "--model_name_or_path", str(model), "--dataset_name", "null", "--log_with", "none",
            "--train_file", str(data), "--max_steps", "3", "--per_device_train_batch_size", "8",
            "--num_labels", str(num_labels), "--output_dir", str(out), "--mixed_precision", "no"]  # fmt: skip
    reset_accelerate_state()  # an earlier test in this process may have built an Accelerator
    code, printed = main(args), capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    headline = {REGRESSION: "validation rmse", MULTI_LABEL: "validation f1_micro"}[problem_type]
    assert headline in printed.out + printed.err  # the task's own numbers in the closing line
    exported = json.loads((out / "model" / "config.json").read_text())
    assert exported["problem_type"] == problem_type
    assert len(exported["id2label"]) == num_labels
