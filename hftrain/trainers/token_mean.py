"""One mean over the global batch's target tokens, as one process computes it: the shared part of the per-token tasks
(causal language modelling, ``hftrain.trainers.language``; token classification,
``hftrain.trainers.token_classification``).

The loss of an optimizer step is ``L = (1/N) Σ_tokens ℓ``: the cross entropy of every target position of the global
batch, ``N`` their count. A per-micro-batch mean would weight a micro-batch with few targets as much as a full one and
differ from one process, so each rank computes its micro-batch's *sum* ``S`` and scales it by ``dp · accumulation / N``
(:meth:`TokenMeanLoss.scaled`): the runtime's backward divides by the accumulation steps and the data-parallel
reduction (DDP's all-reduce, ZeRO's and FSDP's reduce-scatter, a pipeline's mean over dp) averages over ``dp``,
leaving ``Σ S / N`` on every rank.

``N`` needs no collective: every process builds the same example order (``hftrain.data.batching.EpochSampler``), and
a global batch is always the ``G = micro × accumulation × dp`` consecutive examples of that order, so each rank sums
the ``num_tokens`` column (targets per example) of the ones of its window. A stream (``data.streaming``) has no
order every rank knows: there the Trainer's window agrees ``N`` by one host all-reduce before its first backward
(``Trainer._next_window``, which counts with :meth:`TokenMeanLoss.count_examples`).

Under context parallelism the model returns the per-token output of this rank's positions of the sequence (its
``context_split``, ``hftrain.parallel.context_parallel``): :meth:`TokenMeanLoss.context_split` gives the split, whose
``local`` takes the same positions of the targets and whose ``sum`` adds the examples' sums over the cp ranks. Under
pipeline × context parallelism the same holds on the last stage: its chunk returns the output of this cp rank's
positions (``hftrain.parallel.chunk``), and ``loss(output, batch)`` reads the same split from the model.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100
"""transformers' label for positions without a target (prompts, padding, special tokens, a word's later sub-tokens)."""


class TokenMeanLoss:
    """A Trainer mixin (before :class:`hftrain.trainers.base.Trainer` in the bases): the global target count ``N`` and
    the ``dp · accumulation / N`` scaling. Call :meth:`count_targets` before ``Trainer.__init__``."""

    loss_is_example_mean = False  # a token sum scaled by dp · accumulation / N: a pipeline's parts add up
    whole_global_batches = True  # N counts a global batch's examples: Accelerate's repeats of a short one would not be

    def count_targets(self, train_dataset: Any) -> None:
        """Read each training example's target count (its ``num_tokens`` column; nothing for a stream)."""
        from hftrain.data.streaming import StreamingBlocks

        streamed = isinstance(train_dataset, StreamingBlocks)
        self._targets = [] if streamed else [int(n) for n in train_dataset["num_tokens"][:]]
        self._window_targets: dict[int, list[float]] = {}  # epoch -> target count of each global batch

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Each position's target, aligned with the model's output positions (the labels themselves here)."""
        return labels

    def count_examples(self, batch: dict[str, torch.Tensor]) -> float:
        """A micro-batch's target tokens (a stream's window sums them into ``N``)."""
        return float((self.targets(batch["labels"]) != IGNORE_INDEX).sum())

    def scaled(self, summed: torch.Tensor) -> torch.Tensor:
        """``S · dp · accumulation / N``: this micro-batch's summed token losses as its share of the step's mean."""
        return summed * (self.runtime.dp_size * self.args.gradient_accumulation_steps / self._global_targets())

    def router_loss_share(self, batch: dict[str, torch.Tensor], pipelined: bool) -> float:
        """The weight of a mixture of experts' router loss computed over ``batch`` alone: 1 for a micro-batch (the
        runtime's backward divides it by the accumulation steps, as one process accumulating them), ``n_j / b`` for
        a pipeline micro-batch of ``n_j`` of the micro-batch's ``b`` rows (the pipeline adds its micro-batches' losses
        unweighted, the token sums being already scaled): the router loss of ``m`` pipeline micro-batches then
        weighs as that of ``m`` accumulated micro-batches of ``b / m`` rows. ``b`` is the per-device batch: every
        micro-batch is whole (:attr:`whole_global_batches`).

        Args:
            batch: the rows the router loss was computed over.
            pipelined: whether they are a pipeline micro-batch (the model is a pipeline's).
        """
        if not pipelined:
            return 1.0
        return batch["input_ids"].shape[0] / self.args.per_device_train_batch_size

    def context_split(self) -> Any:
        """The model's context-parallel split (``ContextSplit``), or None where the sequence is whole on each rank."""
        return getattr(self.runtime.unwrap_model(self.model), "context_split", None)

    def _global_targets(self) -> float:
        """``N``: the target tokens of the global batch the current micro-batch belongs to (at least 1); a stream's
        window agreed it before its first backward (``Trainer._next_window``)."""
        if self.stream is not None:
            return max(1.0, self.window_count)
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
