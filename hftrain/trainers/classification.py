"""Sequence classification (BERT-style and GPT-style ``*ForSequenceClassification`` models)."""

from __future__ import annotations

import torch

from hftrain.trainers.base import Trainer


class SequenceClassificationTrainer(Trainer):
    """Cross-entropy fine-tuning with accuracy and F1 evaluation.

    GPT-style models pool the last non-pad token, so their config must carry ``pad_token_id``
    (``hftrain.models`` sets it from the tokenizer).
    """

    def prediction_step(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # (batch, num_labels)
        losses = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")  # (batch,)
        return losses, logits.argmax(dim=-1), labels

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        from hftrain.metrics import compute_classification_metrics

        num_labels = self.runtime.unwrap_model(self.model).config.num_labels
        return compute_classification_metrics(predictions.tolist(), labels.tolist(), num_labels=num_labels)
