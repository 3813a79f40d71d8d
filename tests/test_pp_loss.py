"""Pipeline parallelism through the Trainer: the task decides the loss, short batches run, schedules are reused.

Three launches of real gloo processes and one single-process reference run (DDP in one process, the whole batch
at once), fp32 (``mixed_precision: no``), compared within 1e-5 relative loss at every step:

- **short batches**: 81 training rows, batch 8 and 4 micro-batches, 12 steps: each epoch ends with a batch of one
  example, which runs as one micro-batch (1F1B cannot run it and falls back to GPipe); with 86 rows the last batch
  of 6 runs as micro-batches of 2, 2, 1 and 1 (two passes), weighted by their examples. At pp=2 (1F1B with BERT on
  81 rows, interleaved 1F1B with Llama on 86) and at tp=2 × pp=2 (4 processes; 1F1B with GPT-2 on 81, GPipe with
  BERT on 86) the run completes, every step's loss equals the reference's, and every example is counted (an epoch
  and one batch seen after 12 steps, 25 evaluated);
- **the task's loss** at pp=2: regression (``num_labels: 1``, float labels, MSE), multi-label
  (``problem_type: multi_label_classification``, BCE with logits over 3 float labels) and a Trainer subclass whose
  ``loss(output, batch)`` adds a logit penalty to HF's loss each equal their reference, and the subclass's loss differs
  from HF's (so it is the one that ran);
- **length buckets** at pp=2: ``data.pad_to_multiple_of: 8`` builds at most 3 training schedules in an epoch
  (lengths 3 to 20 fall into 3 buckets) against one per length seen without, and the loss still equals the
  reference's, and the unbucketed reference's (padding is masked).

Bad input (one ``hftrain: error:`` line, exit 2, nothing written): buckets below 1. (Buckets that are not a multiple of
``tp`` under sequence parallelism now combine with it: ``tests/test_buckets.py``.)
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import refused_as_launched_rank0
from tests.tiny import synthetic_texts, tiny_config, tiny_tokenizer

LAYERS = 4  # 2 stages × 2 virtual stages for the interleaved schedule
SHORT = {"n_train": 81, "micro": 8, "steps": 12}  # 11 steps per epoch, the 11th of one example
UNEVEN = {"n_train": 86, "micro": 8, "steps": 12}  # the 11th of 6 examples: micro-batches of 2, 2, 1, 1
MICROBATCHES = 4
TASKS = {"regression": 1, "multi_label": 3, "single": 2, "custom": 2}  # task -> num_labels
# label -> (task, model, strategy options, data); the references run the same label in one process
PP2 = {
    "short-1f1b": ("single", "bert", {"schedule": "1f1b"}, SHORT),
    "uneven-interleaved": ("single", "llama", {"schedule": "interleaved_1f1b", "virtual_stages": 2}, UNEVEN),
    "regression": ("regression", "bert", {"schedule": "1f1b"}, {}),
    "multi_label": ("multi_label", "gpt2", {"schedule": "gpipe"}, {}),
    "custom": ("custom", "llama", {"schedule": "1f1b"}, {}),
    "buckets": ("single", "bert", {"schedule": "1f1b"}, {"buckets": 8}),
    "dynamic": ("single", "bert", {"schedule": "1f1b"}, {}),
}
TP2PP2 = {
    "short-1f1b": ("single", "gpt2", {"schedule": "1f1b"}, SHORT),
    "uneven-gpipe": ("single", "bert", {"schedule": "gpipe"}, UNEVEN),
}
DEFAULT_LOSS = ("single", "llama", {}, {})  # the custom case's model trained with HF's loss (reference only)


def task_splits(task: str, n_train: int, n_eval: int = 25):
    """Synthetic texts labelled for ``task``: class ids, one float score (regression) or 3 float flags."""
    from datasets import Dataset, DatasetDict

    from tests.tiny import POSITIVE

    texts, classes = synthetic_texts(n_train + n_eval, seed=0)

    def label(text: str, cls: int):
        words = text.split()
        share = sum(w in POSITIVE for w in words) / len(words)
        if task == "regression":
            return share
        if task == "multi_label":
            return [float(cls), float(len(words) > 10), float(words[0] in POSITIVE)]
        return cls

    labels = [label(t, c) for t, c in zip(texts, classes, strict=True)]
    return DatasetDict(
        train=Dataset.from_dict({"text": texts[:n_train], "label": labels[:n_train]}),
        validation=Dataset.from_dict({"text": texts[n_train:], "label": labels[n_train:]}),
    )


def run_task(
    task: str,
    kind: str,
    *,
    strategy: str = "ddp",
    options: dict | None = None,
    n_train: int = 96,
    micro: int = 8,
    steps: int = 12,
    buckets: int | None = None,
) -> dict:
    """Train a tiny ``kind`` model on ``task`` in this process group (``buckets``: ``data.pad_to_multiple_of``);
    returns what the tests compare."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from hftrain.cli import launch_info_from_environ
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.base import Trainer
    from tests.tiny import _fresh_output_dir, fp32_args, reset_accelerate_state

    class TaskTrainer(Trainer):
        """Evaluation loss per example in the form of HF's training loss for the task."""

        def prediction_step(self, model, batch):
            labels = batch["labels"]
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
            if task == "regression":
                losses = torch.nn.functional.mse_loss(logits.squeeze(-1), labels, reduction="none")
            elif task == "multi_label":
                losses = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
                losses = losses.mean(-1)
            else:
                losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            return losses, logits, labels

    class PenaltyTrainer(TaskTrainer):
        """A task that overrides ``loss(output, batch)``: HF's loss plus a penalty on the logits (a mean per example);
        the pipeline hands its last stage's output to it."""

        def loss(self, output, batch):
            return output.loss + 0.5 * output.logits.float().pow(2).mean()

    def model_init():
        config = tiny_config(kind, num_labels=TASKS[task], num_layers=LAYERS)
        if task == "multi_label":
            config.problem_type = "multi_label_classification"
        return AutoModelForSequenceClassification.from_config(config)

    reset_accelerate_state()
    tokenizer = tiny_tokenizer(kind)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(task_splits(task, n_train), tokenizer, max_seq_length=32)
    args = fp32_args(_fresh_output_dir(), per_device_train_batch_size=micro, max_steps=steps, warmup_steps=2)
    trainer_class = PenaltyTrainer if task == "custom" else TaskTrainer
    trainer = trainer_class(
        args,
        strategy=strategy_from_options(strategy, options, launch=launch_info_from_environ()),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
        pad_to_multiple_of=buckets,
    )
    result = trainer.fit()
    schedule = getattr(trainer.model, "schedule", None)
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "metrics": result.metrics,
        "samples_seen": trainer.state.samples_seen,
        "steps_per_epoch": trainer.steps_per_epoch,
        "builds": dict(schedule.builds) if schedule is not None else None,
    }


def _pipeline_runs(cases: dict, layout: dict) -> dict:
    options = {**layout, "num_microbatches": MICROBATCHES}
    return {
        label: run_task(task, kind, strategy="megatron", options={**options, **extra}, **data)
        for label, (task, kind, extra, data) in cases.items()
    }


def _pp2(root: str) -> dict:
    return _pipeline_runs(PP2, {"pp": 2})


def _tp2pp2(root: str) -> dict:
    return _pipeline_runs(TP2PP2, {"tp": 2, "pp": 2})


def _key(case: tuple) -> tuple:
    task, kind, _, data = case
    return task, kind, tuple(data.items())


def _references(root: str) -> dict:
    cases = {_key(case) for case in [*PP2.values(), *TP2PP2.values(), DEFAULT_LOSS]}
    return {key: run_task(key[0], key[1], **dict(key[2])) for key in sorted(cases)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("pipeline_loss"))
    (reference,) = run_distributed(_references, nprocs=1, timeout=900, root=root)
    return {
        "reference": reference,
        "pp2": run_distributed(_pp2, nprocs=2, timeout=900, root=root),
        "tp2pp2": run_distributed(_tp2pp2, nprocs=4, timeout=1200, root=root),
    }


def _reference(runs: dict, case: tuple) -> dict:
    return runs["reference"][_key(case)]


def _assert_parity(ranks: list[dict], ref: dict, *, steps: int = 12) -> None:
    for run in ranks:  # the last stage's loss reached every rank of every stage
        assert len(run["losses"]) == len(ref["losses"]) == steps
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert run["samples_seen"] == ref["samples_seen"]
        assert run["metrics"]["eval_samples"] == 25  # each validation example once, through the pipeline
        assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the loss moved


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout,label",
    [("pp2", label) for label in PP2 if label.startswith(("short", "uneven"))]
    + [("tp2pp2", label) for label in TP2PP2],
)
def test_short_last_batch_runs_and_equals_single_process(runs, layout, label):
    ranks = runs[layout]
    assert len(ranks) == {"pp2": 2, "tp2pp2": 4}[layout]
    case = {"pp2": PP2, "tp2pp2": TP2PP2}[layout][label]
    ref = _reference(runs, case)
    assert ref["steps_per_epoch"] == 11  # 10 batches of 8, then one of 1 (81 rows) or 6 (86 rows) examples
    assert ref["samples_seen"] == case[3]["n_train"] + 8  # an epoch, then the first batch of the next
    _assert_parity([rank[label] for rank in ranks], ref)


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["regression", "multi_label", "custom"])
def test_the_tasks_loss_runs_on_the_last_stage(runs, label):
    _assert_parity([rank[label] for rank in runs["pp2"]], _reference(runs, PP2[label]))


@pytest.mark.distributed
def test_a_loss_override_is_the_loss_trained(runs):
    custom, default = _reference(runs, PP2["custom"]), _reference(runs, DEFAULT_LOSS)
    for run in (rank["custom"] for rank in runs["pp2"]):
        # HF's loss alone would start near ln 2; the override adds the logit penalty from the first step
        assert run["losses"][0] == pytest.approx(custom["losses"][0], rel=1e-5)
        assert run["losses"][0] != pytest.approx(default["losses"][0], rel=1e-3)


@pytest.mark.distributed
def test_length_buckets_reuse_schedules(runs):
    buckets, dynamic = runs["pp2"][0]["buckets"], runs["pp2"][0]["dynamic"]
    assert buckets["steps_per_epoch"] == dynamic["steps_per_epoch"] == 12  # the 12 steps are one epoch
    print(f"\npp=2 1f1b, one epoch of 12 steps: {dynamic['builds']['train']} training schedules built with dynamic "
          f"padding, {buckets['builds']['train']} with pad_to_multiple_of 8")  # fmt: skip
    assert buckets["builds"]["train"] <= 3  # lengths 3..20 in buckets of 8: 8, 16, 24
    assert dynamic["builds"]["train"] > 2 * buckets["builds"]["train"]  # one per length seen
    for run in runs["pp2"]:  # the same builds on every stage (they build together), the same losses
        assert run["buckets"]["builds"] == buckets["builds"]
    ref, unbucketed = _reference(runs, PP2["buckets"]), _reference(runs, PP2["dynamic"])
    _assert_parity([r["buckets"] for r in runs["pp2"]], ref)
    _assert_parity([r["dynamic"] for r in runs["pp2"]], unbucketed)
    assert ref["losses"] == pytest.approx(unbucketed["losses"], rel=1e-5)  # padding is masked


# ----------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, str]:
    """A tiny BERT model folder and a small labelled CSV."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("pipeline_loss_job")
    AutoModelForSequenceClassification.from_config(tiny_config("bert")).save_pretrained(root / "bert")
    tiny_tokenizer("bert").save_pretrained(root / "bert")
    texts, labels = synthetic_texts(40, seed=1)
    csv = root / "train.csv"
    csv.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels, strict=True)))
    return {"model": str(root / "bert"), "data": str(csv)}


BAD_INPUT = {
    "buckets-below-one": (["--pp", "2", "--pad_to_multiple_of", "0"], "2", "data.pad_to_multiple_of must be at"),
}  # fmt: skip


@pytest.mark.parametrize("label", list(BAD_INPUT))
def test_bad_buckets_are_one_line_exit_2_nothing_written(job, tmp_path, capsys, monkeypatch, label):
    extra, world_size, message = BAD_INPUT[label]
    refused_as_launched_rank0(monkeypatch, capsys, tmp_path, job["model"], job["data"], extra, world_size, message)
