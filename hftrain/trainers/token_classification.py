"""Token classification (``model.task: token_classification``): one label per word, on its first sub-token.

**One mean over the global batch's labelled words, as one process computes it.** The loss of an optimizer step is
``L = (1/N) Σ_words ℓ``, the cross entropy of every labelled position (label ≠ ``-100``) of the global batch, ``N``
their count: transformers' ``*ForTokenClassification`` loss over the whole global batch. Each rank sums its
micro-batch's word losses and scales the sum by ``dp · accumulation / N`` (``hftrain.trainers.token_mean``, shared
with the causal-LM trainer).

Evaluation sums each example's losses and keeps its predictions and labels padded to one width (the longest
evaluation example's bucket), so the gather over the replicas concatenates them; the loss is ``Σ sums / Σ words`` over
the whole set, the metrics are ``hftrain.metrics.token_classification``'s.

The trainer asks no strategy; what the model's split changes comes to it through the model and the runtime. A
tensor-parallel model keeps its classifier whole, so the logits are every label's; a pipeline's last stage runs the
token head (``hftrain.parallel.heads.TokenClassificationHead``) and hands its
``output`` to :meth:`TokenClassificationTrainer.loss`; under context parallelism the model returns the logits of this
rank's positions: the loss takes the same positions of the labels (``split.local``) and adds the examples' sums over
the cp ranks (``split.sum``), and evaluation gathers the logits of the whole sequence over the cp group
(``split.gather``, an all-gather) before predicting, so each rank predicts as one process does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hftrain.data.word_labels import IGNORE_INDEX
from hftrain.trainers.base import Trainer
from hftrain.trainers.token_mean import TokenMeanLoss


class TokenClassificationTrainer(TokenMeanLoss, Trainer):
    """Fine-tuning of a ``*ForTokenClassification`` model on words labelled one by one.

    Args:
        train_dataset: tokenized examples with ``labels`` aligned to the sub-tokens, ``length`` and ``num_tokens``.
        eval_dataset: the same columns.
        kwargs: as :class:`hftrain.trainers.base.Trainer`.
    """

    stage_head = "token_classification"  # the pipeline's head kind (hftrain.parallel.heads.HEADS)

    def __init__(self, *args: Any, train_dataset: Any, eval_dataset: Any = None, **kwargs: Any) -> None:
        from hftrain.metrics.token_classification import METRICS_LINE, check_seqeval

        check_seqeval()
        self.count_targets(train_dataset)
        self._longest_eval = max(eval_dataset["length"][:], default=1) if eval_dataset is not None else 1
        super().__init__(*args, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        self._log(METRICS_LINE)

    def data_collator(self) -> Any:
        """:class:`hftrain.data.word_labels.WordLabelCollator`: the default padding to the length buckets, the labels
        padded with ``-100``. Asked before the buckets exist (``Trainer._length_buckets``, which gives a collator of its
        own none), it answers None: this one pads by the buckets like the default one."""
        from hftrain.data.word_labels import WordLabelCollator

        buckets = getattr(self, "buckets", None)
        if buckets is None:
            return None
        return WordLabelCollator(self.tokenizer, buckets.multiple, buckets.ceiling)

    # ----------------------------------------------------------------- training
    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        """The model run without its labels (the loss is computed here): logits ``(batch, positions, labels)``, this
        rank's positions under context parallelism."""
        return model(**{k: v for k, v in batch.items() if k != "labels"})

    def loss(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This micro-batch's word losses summed, scaled by ``dp · accumulation / N`` (``TokenMeanLoss``); a mixture of
        experts adds its routers' load-balancing loss."""
        split = self.context_split()
        labels = batch["labels"] if split is None else split.local(batch["labels"])
        sums = _example_losses(output.logits, labels)
        loss = self.scaled((sums if split is None else split.sum(sums)).sum())
        if self.expert_load is not None:
            loss = loss + self.expert_load.aux_loss(batch)
        return loss

    # ----------------------------------------------------------------- evaluation
    @functools.cached_property
    def _width(self) -> int:
        """The positions every evaluation example's predictions are padded to: the longest one's bucket."""
        return self.buckets.padded(self._longest_eval)

    def predictions(
        self, output: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per example: (the sum of its word losses, its predicted label per position, its labels), the last two
        padded to :attr:`_width` with ``-100``. Under context parallelism the logits of the whole sequence are
        gathered over the cp group first (an all-gather of ``[b, s/cp, labels]``)."""
        labels, logits = batch["labels"], output.logits
        split = self.context_split()
        if split is not None:
            logits = split.gather(logits)
        pad = (0, self._width - labels.shape[1])
        predictions = torch.nn.functional.pad(logits.argmax(dim=-1), pad, value=IGNORE_INDEX)
        return _example_losses(logits, labels), predictions, torch.nn.functional.pad(labels, pad, value=IGNORE_INDEX)

    def evaluation_loss(self, losses: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean over every labelled word of the evaluation set: ``Σ sums / Σ words``."""
        return (losses.double().sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)).item()

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Entity precision, recall and F1 (seqeval) and word accuracy, by the model config's ``id2label``."""
        from hftrain.metrics.token_classification import compute_token_metrics

        id2label = self.runtime.unwrap_model(self.model).config.id2label
        return compute_token_metrics(predictions.tolist(), labels.tolist(), id2label)


def _example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each example's cross entropy summed over its labelled positions, ``[b]`` in fp32 (0 where none).

    Args:
        logits: ``(batch, positions, labels)``.
        labels: ``(batch, positions)``, ``-100`` where a position has none.
    """
    losses = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.view(labels.shape).sum(dim=-1)
