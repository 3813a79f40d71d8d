"""Sequence classification (BERT-style and GPT-style ``*ForSequenceClassification`` models): single-label,
multi-label and regression, the three tasks of transformers' heads (``hftrain.data.labels``).

The training loss is the model's own (transformers' ``ForSequenceClassificationLoss`` for the config's
``problem_type``, which ``hftrain.models`` sets); evaluation computes the same loss per example, so the mean over
the validation set is the loss one process would report, however the examples were split.
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.data.labels import MULTI_LABEL, REGRESSION, SINGLE_LABEL
from hftrain.trainers.base import Trainer


class SequenceClassificationTrainer(Trainer):
    """Fine-tuning of a sequence classifier, evaluated by its task's metrics (``hftrain.metrics``): accuracy and
    F1 (single-label), subset accuracy and micro/macro F1 (multi-label), MSE, RMSE, MAE and Pearson's r (regression).

    GPT-style models pool the last non-pad token, so their config must carry ``pad_token_id``
    (``hftrain.models`` sets it from the tokenizer).
    """

    def predictions(
        self, output: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per example: (its loss by the config's ``problem_type``, its prediction, its label)."""
        labels = batch["labels"]
        logits = output.logits.float()  # (batch, num_labels)
        task = problem_type(self.runtime.unwrap_model(self.model).config, labels)
        functional = torch.nn.functional
        if task == REGRESSION:
            predictions = logits.reshape(-1)  # (batch,): one target
            return functional.mse_loss(predictions, labels.float(), reduction="none"), predictions, labels
        if task == MULTI_LABEL:  # per example: the mean over its labels, as BCEWithLogitsLoss's mean over both
            losses = functional.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
            return losses, (logits > 0).long(), labels.long()  # a label is predicted where sigmoid(logit) > 0.5
        losses = functional.cross_entropy(logits, labels, reduction="none")  # (batch,)
        return losses, logits.argmax(dim=-1), labels

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        from hftrain.metrics import (
            compute_classification_metrics,
            compute_multi_label_metrics,
            compute_regression_metrics,
        )

        config = self.runtime.unwrap_model(self.model).config
        task = problem_type(config, labels)
        if task == REGRESSION:
            return compute_regression_metrics(predictions.tolist(), labels.tolist())
        if task == MULTI_LABEL:
            return compute_multi_label_metrics(predictions.tolist(), labels.tolist())
        return compute_classification_metrics(predictions.tolist(), labels.tolist(), num_labels=config.num_labels)


def problem_type(config, labels: torch.Tensor) -> str:  # noqa: ANN001 - a transformers PretrainedConfig
    """The model's task: its config's ``problem_type``, else transformers' own rule (``num_labels == 1``:
    regression; integer labels: single-label; else multi-label)."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return REGRESSION
    return SINGLE_LABEL if labels.dtype in (torch.long, torch.int) else MULTI_LABEL
