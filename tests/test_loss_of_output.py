"""The loss of an output against the batch (``Trainer.loss``): the pipeline calls it on its last stage's output, so a
Trainer whose ``compute_loss`` is something else (an override that runs the model its own way) is refused in one line
there instead of silently training another loss; the tasks' own ``compute_loss`` are ``loss(forward(...))``."""

from __future__ import annotations

import pytest
import torch

from hftrain.errors import ConfigError
from hftrain.strategies.megatron.pipeline_runtime import PipelineRuntime
from hftrain.trainers.base import Trainer
from hftrain.trainers.classification import SequenceClassificationTrainer
from hftrain.trainers.language import CausalLMTrainer
from hftrain.trainers.token_classification import TokenClassificationTrainer


class OwnForward(Trainer):
    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).logits.sum()


class OwnLoss(Trainer):
    def loss(self, output, batch):  # noqa: ANN001, ANN201
        return output.logits.sum()


def test_a_compute_loss_override_is_refused_by_the_pipeline():
    with pytest.raises(ConfigError, match=r"OwnForward overrides compute_loss.*override loss\(output, batch\) instead"):
        PipelineRuntime.forward_backward(None, None, {}, OwnForward.__new__(OwnForward))


@pytest.mark.parametrize(
    "trainer", [Trainer, OwnLoss, SequenceClassificationTrainer, CausalLMTrainer, TokenClassificationTrainer]
)
def test_the_tasks_compute_loss_is_the_loss_of_the_forward(trainer):
    assert getattr(trainer.compute_loss, "is_loss_of_forward", False)
