"""Causal language modelling (``model.task: causal_lm``): next-token cross entropy on packed blocks of text.

The blocks come from ``hftrain.data.language``: documents packed whole into ``data.max_seq_length`` tokens, position
ids restarting at every document (transformers then masks attention block-diagonally: no token sees another
document), and label ``-100`` on prompts, padding and every document's first token.

**One mean over the global batch, as one process computes it.** The loss of an optimizer step is the mean over every
target token of its global batch, ``L = (1/N) Σ_tokens ℓ``, however the batch is split into micro-batches and
processes: each rank sums its micro-batch's token losses and scales the sum by ``dp · accumulation / N``
(``hftrain.trainers.token_mean.TokenMeanLoss``, shared with token classification; the targets here are the next
tokens). The logged loss, the mean of the scaled micro-batch losses over the window and the replicas, is then
``Σ S / N`` too.

**A stream** (``data.streaming``, ``hftrain.data.streaming``): each rank packs its own share of the corpus, so no rank
knows the other ranks' blocks. Before a window's first backward, each rank reads the window's micro-batches, counts
their targets, and one host all-reduce of the counts over the processes gives ``N`` (``Trainer._next_window``: the
sum over the processes divided by the processes of one replica); the scaling is then the same, and so is the loss.

Evaluation sums each block's token losses and counts its targets; the evaluation loss is ``Σ sums / Σ counts`` over the
whole set (each block counted once, gathered over the replicas), and the perplexity ``exp`` of it.

A mixture of experts adds ``router_aux_loss_coef ×`` its routers' load-balancing loss ``A`` of each forward (over the
examples' ranks, as transformers' ``*ForCausalLM`` heads add it), one per micro-batch as gradient accumulation takes
it: ``(1/a) Σ_j A_j`` over the ``a`` micro-batches of a step. Under pipeline parallelism each pipeline micro-batch
``j`` of ``n_j`` of the micro-batch's ``b`` rows has its own ``A_j``, the stages' routing sums carried to the last one
(``hftrain.parallel.ep_routing.StageRouting``); it is weighted by ``n_j / b`` beside the token sums (which the
pipeline adds up unweighted), so a pp run with ``m`` pipeline micro-batches equals one process accumulating ``m · a``
micro-batches of ``b / m`` rows: the token mean the same, each router loss weighted ``1 / (m · a)``.

The loss is ``loss(output, batch)`` of the model's output (``forward``), so a pipeline's last stage hands its head's
output straight to it; with ``training.loss_chunk_tokens`` the data-parallel ``compute_loss`` runs the output
projection chunk by chunk instead (``hftrain.trainers.chunked_head``: the whole logits never built).

Under tensor parallelism the output projection may be split over the vocabulary (``hftrain.parallel``): the model then
returns each rank's shard of the logits, and the head module supplies the vocabulary-parallel cross entropy
(``token_losses``), so no rank holds a full-vocabulary row. Under context parallelism the model returns the logits of
this rank's positions of the sequence (its ``context_split``, ``hftrain.parallel.context_parallel``): the loss takes
the same positions of the next-token targets, and its sum over the cp ranks is the micro-batch's ``S``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from hftrain.models.packed_attention import PackedDocuments, apply_packed_attention, kernel_refusal, varlen_refusal
from hftrain.trainers.base import Trainer
from hftrain.trainers.chunked_head import ChunkedHead
from hftrain.trainers.inputs import packed_causal_mask, takes_boolean_masks
from hftrain.trainers.token_mean import IGNORE_INDEX, TokenMeanLoss


class CausalLMTrainer(TokenMeanLoss, Trainer):
    """Fine-tuning of a ``*ForCausalLM`` model on packed text, evaluated by loss and perplexity.

    Args:
        train_dataset: packed blocks with ``input_ids``, ``labels``, ``position_ids``, ``length`` and ``num_tokens``
            (the block's targets: its ``labels[1:]`` that are not ``-100``).
        kwargs: as :class:`hftrain.trainers.base.Trainer`.
    """

    stage_head = "causal_lm"  # the pipeline's head kind (hftrain.parallel.heads.HEADS): the output projection

    def __init__(self, *args: Any, train_dataset: Any, **kwargs: Any) -> None:
        from hftrain.errors import DataError

        self.count_targets(train_dataset)
        super().__init__(*args, train_dataset=train_dataset, **kwargs)
        self._packed_attention = self._choose_packed_attention()
        if self.stream is not None:
            return
        blocks, size = len(self._targets), self.strategy_summary["global_batch"]
        if blocks < size:
            raise DataError(
                f"data: the training text packs into {blocks} blocks of data.max_seq_length tokens, fewer than one "
                f"global batch ({size}: per_device_train_batch_size × gradient_accumulation_steps × data-parallel "
                "processes); add text, or lower the batch or data.max_seq_length"
            )
        if blocks % size:
            self._log(
                f"data: the last {blocks % size} of {blocks} training blocks (in each epoch's order) do not fill a "
                f"global batch of {size} and are left out of that epoch"
            )

    def data_collator(self) -> Any:
        from hftrain.data.language import lm_collator

        return lm_collator

    # ----------------------------------------------------------------- training
    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        """The model's output (its logits, this rank's positions under cp) for :meth:`_model_inputs`."""
        return model(**self._model_inputs(batch))

    def _model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The batch without its labels and cache (:func:`_inputs`); packed documents' bounds (``varlen``,
        ``hftrain.models.packed_attention``) or mask (:attr:`_packed_masks`) built here, on the device, once per
        forward."""
        inputs = _inputs(batch)
        if self._packed_attention == "varlen" and "position_ids" in inputs:
            # the documents' bounds, once per forward, on the device; every layer's attention reads them
            inputs["packed_documents"] = PackedDocuments.of(inputs["position_ids"])
        elif self._packed_masks and inputs.get("attention_mask") is None and "position_ids" in inputs:
            # the documents' mask built here, on the device: transformers would read the positions on the host
            inputs["attention_mask"] = packed_causal_mask(inputs["position_ids"])
        return inputs

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The data-parallel path: with ``training.loss_chunk_tokens`` the head's losses chunk by chunk (the whole
        logits never built, :class:`ChunkedHead`), else ``loss(forward(model, batch), batch)``."""
        chunked = self._chunked_head
        inputs = self._model_inputs(batch)
        per_position = None if chunked is None else chunked.losses(model, inputs, self._local_targets(batch))
        if per_position is None:  # no chunking, or a model the chunked head cannot run
            return self.loss(model(**inputs), batch)
        return self._with_aux(self.scaled(self._sums(per_position).sum()), batch)

    compute_loss.is_loss_of_forward = True  # type: ignore[attr-defined]  # the chunks' sum is loss(forward(...))

    def loss(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This micro-batch's target losses summed, scaled by ``dp · accumulation / N`` (``TokenMeanLoss``); a mixture
        of experts adds its routers' load-balancing loss."""
        return self._with_aux(self.scaled(self._block_losses(output, batch).sum()), batch)

    def _with_aux(self, loss: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``loss`` plus a mixture of experts' router loss of the forward that just ran, as its share of the step
        (:meth:`TokenMeanLoss.router_loss_share`)."""
        if self.expert_load is None:
            return loss
        return loss + self.expert_load.aux_loss(batch) * self.router_loss_share(batch, self.expert_load.pipeline)

    def _block_losses(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each block's next-token losses summed ``[b]`` (0 where it has no target). Under context parallelism the
        output holds the logits of this rank's positions: the loss takes the same positions of the targets, and the
        blocks' sums are added over the cp ranks (a sum whose backward is the same sum)."""
        return self._sums(token_losses(self._head(), output.logits, self._local_targets(batch)))

    def _local_targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The next-token targets of the positions the model's output holds (this rank's under cp)."""
        targets = next_token_targets(batch["labels"])
        split = self.context_split()
        return targets if split is None else split.local(targets)

    def _sums(self, per_position: torch.Tensor) -> torch.Tensor:
        """Each block's sum of ``per_position`` ``[b, s(/cp)]``, over the cp ranks where the sequence is split."""
        split, sums = self.context_split(), per_position.sum(dim=-1)
        return sums if split is None else split.sum(sums)

    @functools.cached_property
    def _chunked_head(self) -> ChunkedHead | None:
        """The head computing the losses chunk by chunk (``training.loss_chunk_tokens``; None: off, or no head)."""
        head = self._head()
        if self.args.loss_chunk_tokens is None or head is None:
            return None
        return ChunkedHead(head, self.args.loss_chunk_tokens, token_losses, self._log)

    @functools.cached_property
    def _packed_masks(self) -> bool:
        """Whether the packed blocks' mask is handed to the model 4-D (``hftrain.trainers.inputs``): where its attention
        takes SDPA's boolean mask and every process is a data-parallel replica of a whole model (a pipeline's stages
        and a context-parallel ring build their own masks)."""
        runtime = self.runtime
        whole = runtime.dp_size == runtime.num_processes
        return self._packed_attention == "mask" and whole and takes_boolean_masks(runtime.unwrap_model(self.model))

    def _choose_packed_attention(self) -> str:
        """``training.packed_attention`` resolved for this platform and model, logged in one line: ``varlen`` switches
        the model's attention to each document alone (``hftrain.models.packed_attention``), unless the model or the
        layout cannot take it, which keeps ``mask`` and says why."""
        choice, why = self.strategy.platform.resolve_packed_attention(self.args.packed_attention)
        if choice == "varlen":
            runtime = self.runtime
            model = runtime.unwrap_model(self.model)
            if runtime.dp_size != runtime.num_processes:
                refusal = "the model is split over processes (its own attention handles the documents)"
            elif self.args.gradient_checkpointing == "selective":
                refusal = "selective recomputation wraps the SDPA attention"
            else:
                device = self.strategy.platform.device
                refusal = kernel_refusal(device, self.args.mixed_precision) or varlen_refusal(model)
            if refusal is not None:
                self._log(f"packed_attention: mask, not varlen ({why}): {refusal}")
                return "mask"
            apply_packed_attention(model)
        self._log(f"packed_attention: {choice} ({why})")
        return choice

    def _head(self) -> torch.nn.Module | None:
        """The model's output projection (``lm_head``; vocabulary-parallel under tensor parallelism)."""
        unwrapped = self.runtime.unwrap_model(self.model)
        return unwrapped.get_output_embeddings() if hasattr(unwrapped, "get_output_embeddings") else None

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Each position's next-token target (:func:`next_token_targets`): what ``N`` and a stream's window count."""
        return next_token_targets(labels)

    # ----------------------------------------------------------------- evaluation
    def predictions(
        self, output: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block: (the sum of its target losses, the same sum, its target count)."""
        sums = self._block_losses(output, batch)
        return sums, sums, (next_token_targets(batch["labels"]) != IGNORE_INDEX).sum(dim=-1)

    def evaluation_loss(self, losses: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean over every target token of the evaluation set: ``Σ sums / Σ counts``."""
        return (losses.double().sum() / labels.double().sum().clamp(min=1)).item()

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Perplexity, ``exp`` of the mean target loss, and the target tokens counted."""
        loss = self.evaluation_loss(predictions, labels)
        return {"perplexity": math.exp(min(loss, 700.0)), "tokens": float(labels.sum().item())}


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The model's inputs: everything but the labels (the loss is computed here, not by the model), without a key/value
    cache: a cache, even an empty one, turns off transformers' packed-document masking (``LMCollator``)."""
    return {**{k: v for k, v in batch.items() if k != "labels"}, "use_cache": False}


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The target of each position, ``(batch, sequence)``: position ``t`` predicts ``labels[t + 1]`` (transformers'
    shift), and the last position has none (``-100``). Aligned with the positions, so a split of the sequence (context
    parallelism) takes the same positions of the logits and of the targets."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def token_losses(head: torch.nn.Module | None, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy per position, ``(batch, positions)`` in fp32, 0 where the target is ``-100``.

    Where the model's output projection is split over the vocabulary (tensor parallelism), ``logits`` is this rank's
    shard and the projection computes the loss across the shards (its ``token_losses``).

    Args:
        head: the model's output projection (``get_output_embeddings()``), or None.
        logits: ``(batch, positions, vocabulary or its shard)``.
        targets: ``(batch, positions)`` each position's target (:func:`next_token_targets`), ``-100`` for none.
    """
    from hftrain.parallel.cross_entropy import cross_entropy_per_token

    parallel = getattr(head, "token_losses", None)
    if parallel is not None:
        return parallel(logits, targets)
    return cross_entropy_per_token(logits, targets, ignore_index=IGNORE_INDEX)
