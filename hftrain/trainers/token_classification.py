"""Token classification (``model.task: token_classification``): one label per word, on its first sub-token.

**One mean over the global batch's labelled words, as one process computes it.** The loss of an optimizer step is
``L = (1/N) Σ_words ℓ``, the cross entropy of every labelled position (label ≠ ``-100``) of the global batch,
``N`` their count: transformers' ``*ForTokenClassification`` loss over the whole global batch. A per-micro-batch mean
would weight a micro-batch of short sentences as much as one of long ones and differ from one process, so, as the
causal-LM trainer does (``hftrain.trainers.language``), each rank computes its micro-batch's *sum* ``S`` and scales
it by ``dp · accumulation / N``: the runtime's backward divides by the accumulation steps and the data-parallel
reduction (DDP's all-reduce, ZeRO's and FSDP's reduce-scatter) averages over ``dp``, leaving ``Σ S / N``. ``N`` needs
no collective: every process builds the same example order (``EpochSampler``), a global batch is the ``G`` consecutive
examples of it, and each rank sums the ``num_tokens`` column (labelled positions per example) of the ones of its
window.

Evaluation sums each example's losses and keeps its predictions and labels padded to one width (the longest
evaluation example's bucket), so the gather over the replicas concatenates them; the loss is ``Σ sums / Σ words`` over
the whole set, the metrics are ``hftrain.metrics.token_classification``'s.

A pipeline's token head comes with the parallel layer's head kinds (``Task.pipeline_head``); until then the megatron
strategy refuses this task's model-parallel axes (``megatron_axes_not_built``), and ``stage_head`` stays None.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hftrain.data.word_labels import IGNORE_INDEX
from hftrain.trainers.base import Trainer


class TokenClassificationTrainer(Trainer):
    """Fine-tuning of a ``*ForTokenClassification`` model on words labelled one by one.

    Args:
        train_dataset: tokenized examples with ``labels`` aligned to the sub-tokens, ``length`` and ``num_tokens``.
        eval_dataset: the same columns.
        kwargs: as :class:`hftrain.trainers.base.Trainer`.
    """

    loss_is_example_mean = False  # a token sum scaled by dp · accumulation / N: a pipeline's parts add up
    whole_global_batches = True  # N counts a global batch's examples: Accelerate's repeats of a short one would not be

    def __init__(self, *args: Any, train_dataset: Any, eval_dataset: Any = None, **kwargs: Any) -> None:
        from hftrain.metrics.token_classification import METRICS_LINE, check_seqeval

        check_seqeval()
        self._targets = [int(n) for n in train_dataset["num_tokens"][:]]
        self._window_targets: dict[int, list[float]] = {}  # epoch -> labelled words of each global batch
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
    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This micro-batch's word losses summed, scaled by ``dp · accumulation / N`` (module docstring); a mixture of
        experts adds its routers' load-balancing loss."""
        summed = self._example_losses(model, batch).sum()
        loss = summed * (self.runtime.dp_size * self.args.gradient_accumulation_steps / self._global_targets())
        if self.expert_load is not None:
            loss = loss + self.expert_load.aux_loss(batch)
        return loss

    def _example_losses(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each example's cross entropy summed over its labelled positions, ``[b]`` in fp32 (0 where none)."""
        logits = self._logits(model, batch)
        labels = batch["labels"]
        losses = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        return losses.view(labels.shape).sum(dim=-1)

    @staticmethod
    def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(batch, positions, labels)``: the model run without its labels (the loss is computed here)."""
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits

    def count_examples(self, batch: dict[str, torch.Tensor]) -> float:
        """A micro-batch's labelled words."""
        return float((batch["labels"] != IGNORE_INDEX).sum())

    def _global_targets(self) -> float:
        """``N``: the labelled words of the global batch the current micro-batch belongs to (at least 1)."""
        epoch = self.state.epoch
        if epoch not in self._window_targets:
            self.train_sampler.set_epoch(epoch)
            order = list(self.train_sampler)
            size = self.strategy_summary["global_batch"]
            self._window_targets = {
                epoch: [
                    float(max(1, sum(self._targets[i] for i in order[start : start + size])))
                    for start in range(0, len(order), size)
                ]
            }
        window = self.state.micro_step // self.args.gradient_accumulation_steps
        return self._window_targets[epoch][window]

    # ----------------------------------------------------------------- evaluation
    @functools.cached_property
    def _width(self) -> int:
        """The positions every evaluation example's predictions are padded to: the longest one's bucket."""
        return self.buckets.padded(self._longest_eval)

    def prediction_step(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per example: (the sum of its word losses, its predicted label per position, its labels), the last two
        padded to :attr:`_width` with ``-100``."""
        labels = batch["labels"]
        logits = self._logits(model, batch)
        losses = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(labels.shape)
        pad = (0, self._width - labels.shape[1])
        predictions = torch.nn.functional.pad(logits.argmax(dim=-1), pad, value=IGNORE_INDEX)
        return losses.sum(dim=-1), predictions, torch.nn.functional.pad(labels, pad, value=IGNORE_INDEX)

    def evaluation_loss(self, losses: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean over every labelled word of the evaluation set: ``Σ sums / Σ words``."""
        return (losses.double().sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)).item()

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Entity precision, recall and F1 (seqeval) and word accuracy, by the model config's ``id2label``."""
        from hftrain.metrics.token_classification import compute_token_metrics

        id2label = self.runtime.unwrap_model(self.model).config.id2label
        return compute_token_metrics(predictions.tolist(), labels.tolist(), id2label)
