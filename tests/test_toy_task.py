"""A task ``hftrain.parallel`` does not know, added in this file alone: per-token regression.

The task is a tiny Llama trunk with its own head (``TokenRegressor``: one number per token from the final-normed
hidden state) and its own Trainer (``TokenRegressionTrainer``), which defines the task once: its pipeline head
(``stage_head = TokenHead()``, a ``hftrain.parallel.stages.StageHead``: the columns the first stage reads, the head's
modules and its output ``[b, s]``), how the model runs (``forward``) and its loss of an output against the batch
(``loss(output, batch)``: per example the mean squared error over its real tokens against a target of the token ids,
then the mean over the examples; the pipeline hands its last stage's output there, no model faked). It
trains through hftrain's real megatron runtime at tp=2 × pp=2 (4 gloo processes, 1F1B over 4 micro-batches) and
equals its 1-process run within 1e-5 (fp32, ``mixed_precision: no``): the loss of every step and every trained weight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hftrain.parallel.stages import StageHead
from hftrain.trainers.base import Trainer
from tests.distributed import run_distributed

STEPS = 4
PIPELINE = {"tp": 2, "pp": 2, "num_microbatches": 4, "schedule": "1f1b"}


class TokenHead(StageHead):
    """The pipeline's view of the task: the first stage reads ``input_ids`` and ``attention_mask``; the last one
    applies the model's ``token_head`` to every (final-normed) position: ``y[b, s]``."""

    first_inputs = ("input_ids", "attention_mask")

    def modules(self, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return {"token_head": model.token_head}

    def forward(self, mods: Any, hidden: torch.Tensor, mask: torch.Tensor, *carried: Any, reduce=None) -> torch.Tensor:
        return mods["token_head"](hidden).squeeze(-1)


def _model_class():
    """``TokenRegressor``: a Llama trunk and one linear unit per token (built lazily: transformers imports slowly)."""
    from transformers import LlamaModel, LlamaPreTrainedModel

    class TokenRegressor(LlamaPreTrainedModel):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = LlamaModel(config)
            self.token_head = torch.nn.Linear(config.hidden_size, 1)
            self.post_init()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
            from types import SimpleNamespace

            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return SimpleNamespace(logits=self.token_head(hidden).squeeze(-1), loss=None)

    return TokenRegressor


def _targets(input_ids: torch.Tensor) -> torch.Tensor:
    """What each token should predict: a function of its id."""
    return (input_ids % 5).float() / 4


class TokenRegressionTrainer(Trainer):
    """Per-token regression: each example's mean squared error over its real tokens, the mean over the examples."""

    stage_head = TokenHead()  # the task hands its own head to the pipeline; the model names none

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    def _per_example(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"].float()
        y = output.logits.float()
        return (((y - _targets(batch["input_ids"])) ** 2) * mask).sum(1) / mask.sum(1)

    def loss(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._per_example(output, batch).mean()

    def predictions(self, output: Any, batch: dict[str, torch.Tensor]) -> tuple:
        losses = self._per_example(output, batch)
        return losses, losses, losses


def _run(output_dir: str, strategy: str, options: dict | None = None) -> dict:
    from hftrain.data.batching import tokenize_splits
    from tests.tiny import fit_in_rank, fp32_args, reset_accelerate_state, tiny_config, tiny_splits, tiny_tokenizer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("llama")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(48, 10), tokenizer, max_seq_length=16)
    config = tiny_config("llama", num_layers=2, max_positions=32)
    args = fp32_args(output_dir, per_device_train_batch_size=8, max_steps=STEPS, warmup_steps=1)

    def model_init() -> torch.nn.Module:
        return _model_class()(config)

    trainer, result = fit_in_rank(TokenRegressionTrainer, args, strategy, options, model_init, tokenizer, splits)
    state_dict = trainer.runtime.get_state_dict(trainer.model) or {}
    main = trainer.accelerator.is_main_process
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": result.metrics.get("eval_loss"),
        "weights": {k: v.detach().clone() for k, v in state_dict.items()} if main else None,
        "head": type(getattr(trainer.model, "task_head", None)).__name__,  # the pipeline's: the task's own
    }


@pytest.mark.distributed
def test_a_toy_task_trains_at_tp2_pp2_as_one_process(tmp_path):
    (reference,) = run_distributed(_run, nprocs=1, timeout=600, output_dir=str(tmp_path / "one"), strategy="ddp")
    runs = run_distributed(
        _run, nprocs=4, timeout=900, output_dir=str(tmp_path / "four"), strategy="megatron", options=PIPELINE
    )
    assert len(reference["losses"]) == STEPS
    assert [run["head"] for run in runs] == ["TokenHead"] * 4
    for run in runs:  # every rank logs the step's loss
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
    weights = runs[0]["weights"]
    assert set(weights) == set(reference["weights"])
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert reference["eval_loss"] is not None
    torch.testing.assert_close(runs[0]["eval_loss"], reference["eval_loss"], rtol=1e-5, atol=1e-5)
