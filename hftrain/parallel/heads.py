"""The task heads that end a pipeline's trunk, and the head kinds a caller names them by.

A task's *head* (:class:`StageHead`) knows what the first chunk reads, what travels beside the hidden states and
what the last chunk returns; a family's *trunk* (``hftrain.parallel.families``) its embedding, layers and final norm;
``hftrain.parallel.stages.ModelStages`` joins the two. The generic heads live here: the sequence classifiers' on the
first token (:class:`FirstTokenHead`) or the last non-pad one (:class:`LastTokenHead`), the per-token classifier
(:class:`TokenClassificationHead`) and the causal LM's (:class:`CausalLMHead`). A family whose head is its own
(DeBERTa's context pooler, ModernBERT's prediction head) keeps it in its module.

A caller names its head by *kind* (:data:`HEADS`), never by the model's class: ``"sequence_classification"``,
``"token_classification"`` or ``"causal_lm"``. Each kind has a factory ``(config, family) -> StageHead`` and traits
that the axes read: whether its output has a row per token (``per_token``: context parallelism then gathers
nothing), whether it needs a causal trunk under pipeline parallelism, and whether a mixture of experts' router loss
is built into its pipeline loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hftrain.errors import ConfigError

Modules = dict[str, torch.nn.Module]


def classifier_args(inputs: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
    """A classifier's first-chunk inputs ``(input_ids, attention_mask[, token_type_ids])`` from the batch: the mask
    ones where absent, token types where given; ValueError without ``input_ids``."""
    if inputs is None or inputs.get("input_ids") is None:
        raise ValueError("the first pipeline stage needs inputs with input_ids")
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    types = inputs.get("token_type_ids")
    return (ids, torch.ones_like(ids) if mask is None else mask, *(() if types is None else (types,)))


def identity(x: torch.Tensor) -> torch.Tensor:
    """``x``: the ``reduce`` of a sequence that is not split."""
    return x


def _last_non_pad_one_hot(input_ids: torch.Tensor, config: Any, dtype: torch.dtype) -> torch.Tensor:
    """One-hot ``[b, s]`` of the token GPT-2/Llama classifiers pool, computed as transformers 5 does."""
    pad = config.get_text_config().pad_token_id
    seq = input_ids.shape[-1]
    if pad is None:  # transformers then takes the last position (and refuses batches > 1 in the model)
        index = torch.full(input_ids.shape[:1], seq - 1, device=input_ids.device)
    else:
        non_pad = (input_ids != pad).to(torch.int32)
        index = (torch.arange(seq, device=input_ids.device, dtype=torch.int32) * non_pad).argmax(-1)
    return torch.nn.functional.one_hot(index.long(), seq).to(dtype)


def first_token_one_hot(input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One-hot ``[b, s]`` of the first token (BERT's pooler reads it)."""
    pool = torch.zeros(input_ids.shape, dtype=dtype, device=input_ids.device)
    pool[:, 0] = 1
    return pool


def _pool(logits: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """``logits[b, s, n]`` at the one-hot position: exact, since the other terms are exact zeros."""
    return (logits * pool.unsqueeze(-1)).sum(1)


class StageHead:
    """A task's head on a family's trunk: what the pipeline's first chunk reads and the last one computes.

    The engine (``chunk.PipelineChunk``, ``hftrain.parallel.schedules``) never opens the batch nor the output: the
    head names the first chunk's input columns (:meth:`first_args`), turns them into the activation tuple
    ``(hidden [b, s, h], trunk_input [b, s], *carries)`` (:meth:`embed`; ``trunk_input`` is the 2-D attention mask,
    or a packed block's position ids where :attr:`packed`), and maps the trunk's last (normed) hidden states and the
    carried tensors to the last chunk's output (:meth:`forward`). The task's loss is computed from what :meth:`output`
    makes of that output, by the Trainer's ``loss(output, batch)`` (and its ``predictions`` in evaluation). A task
    defines a subclass; the classification heads are named by kind (:data:`HEADS`), the families' own registered
    beside them (``hftrain.parallel.families``).

    Attributes:
        first_inputs: the batch columns the first chunk reads, in order (the optional ones too).
        packed: the trunk input is a packed block's position ids (no attention mask): masks built from them.
        per_position: the output has a row per position (a causal LM's logits), not one per example.
    """

    first_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    packed = False
    per_position = False

    def first_args(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The first chunk's positional inputs from the batch: :attr:`first_inputs`, an ``attention_mask`` of ones
        where the batch has none; ValueError naming the missing columns.

        Args:
            inputs: the batch (its labels left out).
        """
        columns = dict(inputs)
        if "attention_mask" in self.first_inputs and columns.get("attention_mask") is None and "input_ids" in columns:
            columns["attention_mask"] = torch.ones_like(columns["input_ids"])
        missing = [name for name in self.first_inputs if columns.get(name) is None]
        if missing:
            raise ValueError(f"the first pipeline stage needs inputs with {', '.join(missing)}")
        return tuple(columns[name] for name in self.first_inputs)

    def modules(self, model: torch.nn.Module) -> Modules:
        """The head's modules of ``model`` (on the last chunk, after the trunk's final norm)."""
        raise NotImplementedError

    def carries(self, config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Per-token tensors ``[b, s]`` the head reads, computed on the first chunk from the whole sequences (they
        travel through the pipeline; context parallelism takes each rank's positions of them). Default none.

        Args:
            config: the model's config.
            input_ids: the whole sequences' token ids.
            attention_mask: their mask.
            dtype: the hidden states' dtype (float carries: torch fills receive buffers with garbage first).
        """
        return ()

    def embed(self, trunk: Any, mods: Any, config: Any, *args: torch.Tensor, split: Any = None) -> tuple:
        """The first chunk's inputs (:meth:`first_args`) to ``(hidden, attention_mask, *carries)``; under context
        parallelism (``split``) this rank's positions of each, embedded at their global positions.

        Args:
            trunk: the family's trunk adapter.
            mods: the embedding modules.
            config: the model's config.
            args: ``(input_ids, attention_mask, *rest)`` as :attr:`first_inputs` names them (``rest``: the optional
                token types of the classifiers).
            split: this rank's part of each sequence (``ContextSplit``), or None.
        """
        input_ids, mask = args[0], args[1]
        if split is None:
            hidden = trunk.embed(mods, config, *args)
            return hidden, mask, *self.carries(config, input_ids, mask, hidden.dtype)
        positions = split.positions(input_ids.shape[1], input_ids.device)
        local = [a[:, positions] for a in args]
        numbered = trunk.position_ids(mods, input_ids)  # RoBERTa's count non-pad tokens of the whole sequence
        hidden = trunk.embed(mods, config, *local, positions=positions if numbered is None else numbered[:, positions])
        carries = self.carries(config, input_ids, mask, hidden.dtype)
        return hidden, local[1], *(c[:, positions] for c in carries)

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, *carried: Any, reduce=None) -> Any:
        """The last chunk's output from the trunk's last hidden states (after its final norm).

        Args:
            mods: the head's modules (:meth:`modules`, and the trunk's norm).
            hidden: ``[b, s, h]`` (this rank's positions under context parallelism).
            trunk_input: the attention mask (or position ids, :attr:`packed`).
            carried: :meth:`carries`.
            reduce: completes a sum over the sequence where it is split (``Σ`` over the cp ranks), or None.
        """
        raise NotImplementedError

    def output(self, output: torch.Tensor, labels: torch.Tensor | None, config: Any) -> Any:
        """What the model returns for ``output`` (the last chunk's, on the last stage), as the task's
        ``loss``/``predictions`` read it: an object with ``.logits`` and ``.loss`` (None here).

        Args:
            output: the last chunk's output for these rows.
            labels: the rows' labels, or None.
            config: the model's config.
        """
        from types import SimpleNamespace

        return SimpleNamespace(logits=output, loss=None)


class SequenceClassificationHead(StageHead):
    """A ``*ForSequenceClassification``'s head: the pooled token (a one-hot ``pool`` ``[b, s]`` carried from the first
    chunk), then the family's classifier: logits ``[b, num_labels]`` and transformers' loss.

    The pool is a float one-hot rather than an integer index because ``torch.distributed.pipelining`` infers shapes
    with *uninitialised* receive buffers on later stages: a garbage index would crash a gather, a garbage one-hot
    only yields ignored numbers. The pooled token is ``Σ_s h_s · pool_s`` (exact: the other terms are exact zeros),
    summed over the cp ranks where the sequence is split.
    """

    first_inputs = ("input_ids", "attention_mask", "token_type_ids")

    def first_args(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``(input_ids, attention_mask[, token_type_ids])``: the mask ones where absent, token types where given."""
        return classifier_args(inputs)

    def pool(self, config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype):
        """The pooling weights ``[b, s]`` over the whole sequences (default: the first token's one-hot)."""
        return first_token_one_hot(input_ids, dtype)

    def carries(self, config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The pooling weights (:meth:`pool`)."""
        return (self.pool(config, input_ids, attention_mask, dtype),)

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The family's classifier on the pooled token ``[b, hidden]``."""
        raise NotImplementedError

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, pool: torch.Tensor, reduce=None):
        """Logits ``[b, num_labels]``: the classifier on the pooled token."""
        reduce = reduce or identity
        return self.classify(mods, reduce((hidden * pool.unsqueeze(-1)).sum(1)))

    def output(self, output: torch.Tensor, labels: torch.Tensor | None, config: Any) -> Any:
        """``SequenceClassifierOutput(loss, logits)`` with transformers' own loss (``ForSequenceClassificationLoss``:
        the config's ``problem_type``, or when unset MSE for ``num_labels == 1``, cross entropy for integer labels,
        BCE with logits for float labels; each a mean over the examples)."""
        from transformers.loss.loss_utils import ForSequenceClassificationLoss
        from transformers.modeling_outputs import SequenceClassifierOutput

        loss = None if labels is None else ForSequenceClassificationLoss(labels, output, config)
        return SequenceClassifierOutput(loss=loss, logits=output)


class FirstTokenHead(SequenceClassificationHead):
    """BERT-style classifiers on the first token: BERT's pooler → dropout → classifier; ALBERT's ``pooler`` linear →
    ``pooler_activation`` (tanh) → dropout → classifier; RoBERTa's, XLM-R's and ELECTRA's classification head (it
    takes the first token itself); DistilBERT's ``pre_classifier`` → ReLU → dropout → classifier.

    Args:
        base: the base model's attribute (BERT's and ALBERT's pooler live in it).
        kind: ``"pooler"`` (BERT), ``"albert_pooler"`` (ALBERT), ``"classification_head"`` (RoBERTa, XLM-R,
            ELECTRA) or ``"pre_classifier"`` (DistilBERT).
    """

    def __init__(self, base: str, kind: str = "pooler") -> None:
        self.base, self.kind = base, kind

    def modules(self, model: torch.nn.Module) -> Modules:
        """The pooler, dropout and classifier (as the family has them)."""
        if self.kind == "pooler":
            return {
                "pooler": getattr(model, self.base).pooler,
                "dropout": model.dropout,
                "classifier": model.classifier,
            }
        if self.kind == "albert_pooler":
            base = getattr(model, self.base)
            return {
                "pooler": base.pooler,
                "activation": base.pooler_activation,
                "dropout": model.dropout,
                "classifier": model.classifier,
            }
        if self.kind == "pre_classifier":
            return {"pre_classifier": model.pre_classifier, "dropout": model.dropout, "classifier": model.classifier}
        return {"classifier": model.classifier}

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The family's classification head on the pooled token ``[b, hidden]``."""
        if self.kind == "pooler":
            pooler = mods["pooler"]
            return mods["classifier"](mods["dropout"](pooler.activation(pooler.dense(token))))
        if self.kind == "albert_pooler":
            return mods["classifier"](mods["dropout"](mods["activation"](mods["pooler"](token))))
        if self.kind == "pre_classifier":
            return mods["classifier"](mods["dropout"](torch.relu(mods["pre_classifier"](token))))
        return mods["classifier"](token.unsqueeze(1))  # the head takes features[:, 0, :] itself


class LastTokenHead(SequenceClassificationHead):
    """The decoders' classifiers (GPT-2, Llama and kin): ``score`` on every (normed) position, then the last non-pad
    token's row (transformers' order of operations)."""

    def modules(self, model: torch.nn.Module) -> Modules:
        """The score."""
        return {"score": model.score}

    def pool(self, config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype):
        """The last non-pad token's one-hot (transformers' rule, from the pad id)."""
        return _last_non_pad_one_hot(input_ids, config, dtype)

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, pool: torch.Tensor, reduce=None):
        """Score on every position, then the pooled row: logits ``[b, num_labels]``."""
        return (reduce or identity)(_pool(mods["score"](hidden), pool))

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The score on the pooled (already normed) token."""
        return mods["score"](token)


class CausalLMHead(StageHead):
    """A decoder's ``*ForCausalLM`` head (``model.task: causal_lm``): the output projection on every position.

    The activation tuple is ``(hidden [b, s, h], position_ids [b, s])``: packed blocks hold whole documents whose
    positions restart at each one and carry no attention mask, so every chunk builds its masks from the positions
    (transformers' ``create_causal_mask(..., attention_mask=None, position_ids=...)``: block-diagonal causal, as the
    unsharded model masks them) and the rotary embeddings from the same positions. Under context parallelism the
    hidden states are this cp rank's positions ``[b, S/cp, h]`` and the position ids stay the whole sequences'
    ``[b, S]``, from which each chunk finds every local token's document (``ContextSplit.attend_packed``). The last
    chunk returns this rank's logits ``[b, s, vocabulary]`` (under tensor parallelism the vocabulary-parallel head's
    slice of it; Gemma-2/3's final soft-capping ``c · tanh(z / c)`` applied, as their ``*ForCausalLM``); the task
    computes the loss from them.

    Args:
        config: the model's config (``final_logit_softcapping``).
    """

    first_inputs = ("input_ids", "position_ids")
    packed = True
    per_position = True

    def __init__(self, config: Any = None) -> None:
        self.softcap = getattr(config, "final_logit_softcapping", None) if config is not None else None

    def modules(self, model: torch.nn.Module) -> Modules:
        """The output projection (``get_output_embeddings()``: vocabulary-parallel under tp)."""
        return {"lm_head": model.get_output_embeddings()}

    def embed(self, trunk: Any, mods: Any, config: Any, *args: torch.Tensor, split: Any = None) -> tuple:
        """Token ids and their positions to ``(hidden, position_ids)``; under context parallelism (``split``) this
        rank's positions embedded, and the whole sequences' position ids passed on (every chunk finds the documents
        from them, ``ContextSplit.attend_packed``)."""
        input_ids, position_ids = args
        if split is None:
            return trunk.embed(mods, config, input_ids, None, positions=position_ids), position_ids
        local = split.positions(input_ids.shape[1], input_ids.device)
        return trunk.embed(mods, config, input_ids[:, local], None, positions=position_ids[:, local]), position_ids

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, *carried: Any, reduce=None):
        """The output projection on every position: logits ``[b, s, vocabulary (slice)]``."""
        logits = mods["lm_head"](hidden)
        if self.softcap is not None:  # elementwise: the same on a vocabulary slice
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def output(self, output: torch.Tensor, labels: torch.Tensor | None, config: Any) -> Any:
        """``CausalLMOutput(logits)``: the loss is the task's."""
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=output)


class TokenClassificationHead(StageHead):
    """A ``*ForTokenClassification``'s head: the trunk's final hidden states → the model's dropout → its classifier
    linear on every position, ``logits[b, s, n] = W · dropout(h[b, s]) + c``, and transformers' per-token loss
    (``ForTokenClassification``: cross entropy over the positions whose label is not ``-100``, their mean).

    Nothing travels beside the hidden states (no pooling: every position is classified), and under context
    parallelism each rank classifies its own positions (nothing to gather, nothing to sum: ``reduce`` is unused).

    Args:
        linear: the classifier linear's attribute on the model (``classifier``: BERT-like encoders, GPT-2,
            GPT-NeoX; ``score``: transformers' generic decoder heads, Llama and kin).
    """

    first_inputs = ("input_ids", "attention_mask", "token_type_ids")
    per_position = True

    def __init__(self, linear: str = "classifier") -> None:
        self.linear = linear

    def first_args(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``(input_ids, attention_mask[, token_type_ids])``: the mask ones where absent, token types where given."""
        return classifier_args(inputs)

    def modules(self, model: torch.nn.Module) -> Modules:
        """The dropout and the classifier linear."""
        return {"dropout": model.dropout, "classifier": getattr(model, self.linear)}

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, *carried: Any, reduce=None):
        """The classifier on every position: logits ``[b, s, num_labels]``."""
        return mods["classifier"](mods["dropout"](hidden))

    def output(self, output: torch.Tensor, labels: torch.Tensor | None, config: Any) -> Any:
        """``TokenClassifierOutput(loss, logits)`` with transformers' ``ForTokenClassification`` loss; ``loss`` None
        where ``output`` holds a context-parallel rank's positions ``[b, S/cp, n]`` of the labels' ``[b, S]``: a mean
        over one rank's part is not the model's loss (the task's loss takes this rank's labels and sums over cp)."""
        from transformers.loss.loss_utils import ForTokenClassification
        from transformers.modeling_outputs import TokenClassifierOutput

        whole = labels is not None and labels.shape[1] == output.shape[1]
        loss = ForTokenClassification(output, labels, config) if whole else None
        return TokenClassifierOutput(loss=loss, logits=output)


# ----------------------------------------------------------------------------- head kinds
@dataclass(frozen=True)
class HeadKind:
    """A head a caller names by kind (:data:`HEADS`).

    Args:
        make: ``(config, family) -> StageHead``: the head on the family's trunk (``family``: its
            ``hftrain.parallel.families.Family`` entry).
        per_token: its output has a row per position (context parallelism gathers nothing; each rank's rows are its
            positions').
        causal_trunk: pipeline parallelism runs it on causal trunks only (a decoder's).
        router_loss: a mixture of experts' router loss is built into its pipeline loss (pp takes MoE families).
    """

    make: Callable[[Any, Any], StageHead]
    per_token: bool
    causal_trunk: bool = False
    router_loss: bool = True


HEADS: dict[str, HeadKind] = {
    # the family's own classifier (its ``classifier`` entry)
    "sequence_classification": HeadKind(lambda config, family: family.classifier, per_token=False),
    # the family's per-token classifier, else dropout + ``classifier`` on every position; the router loss of a MoE
    # family's token classifier is not built into the pipeline loss yet
    "token_classification": HeadKind(
        lambda config, family: family.token_classifier or TokenClassificationHead(), per_token=True, router_loss=False
    ),
    # the output projection; a MoE family's router loss per pipeline micro-batch, weighted by its share of the rows
    # (hftrain.trainers.language: the LM's token-mean scaling, as one process accumulating the micro-batches)
    "causal_lm": HeadKind(lambda config, family: CausalLMHead(config), per_token=True, causal_trunk=True),
}  # fmt: skip


def per_token_head(head: str | StageHead) -> bool:
    """Whether a head's output has a row per position: its kind's ``per_token`` trait, or a task's own head's
    :attr:`StageHead.per_position`.

    Args:
        head: a head kind (:data:`HEADS`) or a task's own :class:`StageHead`.
    """
    return head_kind(head).per_token if isinstance(head, str) else bool(head.per_position)


def head_kind(head: str) -> HeadKind:
    """The :data:`HEADS` entry of ``head``; ``ConfigError`` naming the kinds for another name.

    Args:
        head: a head kind (``"sequence_classification"``, ``"token_classification"``, ``"causal_lm"``).
    """
    if head not in HEADS:
        raise ConfigError(f"head {head!r} is not a pipeline head kind; use one of {', '.join(HEADS)}")
    return HEADS[head]
