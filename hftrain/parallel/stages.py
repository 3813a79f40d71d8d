"""Pipeline chunks of HF sequence classifiers, and the per-family adapters that run them.

The adapters call the HF modules themselves and rebuild attention masks with transformers' own
``create_causal_mask``/``create_bidirectional_mask`` from the carried 2-D mask, so a chain of chunks computes
exactly what the unsharded model does. See :mod:`hftrain.parallel.pipeline` for the activation tuple.
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.errors import AxisError

Modules = dict[str, torch.nn.Module]


def _positions(hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, s]`` position ids, as GPT-2 and Llama build them without a cache (or a context-parallel shard's own
    global positions)."""
    if positions is not None:
        return positions.unsqueeze(0)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _identity(x: torch.Tensor) -> torch.Tensor:
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


class BertStages:
    """BERT: embeddings → ``bert.encoder.layer[i]`` → pooler (first token) → dropout → classifier."""

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer layers, in order."""
        return model.bert.encoder.layer

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        return {"embeddings": model.bert.embeddings}

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        return {"pooler": model.bert.pooler, "dropout": model.dropout, "classifier": model.classifier}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """Parameter-free helpers every chunk needs."""
        return {}

    def pool(self, config: Any, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The one-hot of the token the head classifies, over the whole sequence: the first."""
        return first_token_one_hot(input_ids, dtype)

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token ids to the activation tuple (the pooler reads the first token)."""
        position_ids = None if positions is None else _positions(input_ids, positions)
        hidden = mods["embeddings"](input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        return hidden, attention_mask, first_token_one_hot(input_ids, hidden.dtype)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The 4-D mask, built once per chunk as ``BertModel`` builds it."""
        from transformers.masking_utils import create_bidirectional_mask

        return {"mask": create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict) -> torch.Tensor:
        """One ``BertLayer``."""
        return layer(hidden, context["mask"])

    def head(self, mods: Any, hidden: torch.Tensor, pool: torch.Tensor, reduce=_identity) -> torch.Tensor:
        """Pooler (the first token, picked by the one-hot: exact), dropout, classifier: logits ``[b, num_labels]``.

        ``reduce`` completes the pooled token where the sequence is split (a sum over the cp ranks)."""
        pooler = mods["pooler"]
        token = reduce((hidden * pool.unsqueeze(-1)).sum(1))
        return mods["classifier"](mods["dropout"](pooler.activation(pooler.dense(token))))


class _DecoderStages:
    """Shared by GPT-2 and Llama: causal mask from the 2-D mask, head pooled at the last non-pad token."""

    def pool(self, config: Any, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The one-hot of the token the head classifies, over the whole sequence: the last non-pad one."""
        return _last_non_pad_one_hot(input_ids, config, dtype)

    def causal_context(self, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        from transformers.masking_utils import create_causal_mask

        positions = _positions(hidden, positions)
        causal = create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=mask, past_key_values=None, position_ids=positions
        )
        return {"mask": causal, "positions": positions}

    def head(self, mods: Any, hidden: torch.Tensor, pool: torch.Tensor, reduce=_identity) -> torch.Tensor:
        """Final norm, score on every position, then the pooled token (transformers' order of operations);
        ``reduce`` completes it where the sequence is split (a sum over the cp ranks)."""
        return reduce(_pool(mods["score"](mods["norm"](hidden)), pool))


class GPT2Stages(_DecoderStages):
    """GPT-2: ``wte + wpe`` → dropout → ``transformer.h[i]`` → ``ln_f`` → score at the last non-pad token."""

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer blocks, in order."""
        return model.transformer.h

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        t = model.transformer
        return {"wte": t.wte, "wpe": t.wpe, "drop": t.drop}

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        return {"norm": model.transformer.ln_f, "score": model.score}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """Parameter-free helpers every chunk needs."""
        return {}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token and position embeddings (plus token types, as ``GPT2Model``), then embedding dropout."""
        inputs_embeds = mods["wte"](input_ids)
        hidden = inputs_embeds + mods["wpe"](_positions(inputs_embeds, positions))
        if token_type_ids is not None:
            hidden = hidden + mods["wte"](token_type_ids)
        hidden = mods["drop"](hidden)
        return hidden, attention_mask, _last_non_pad_one_hot(input_ids, config, hidden.dtype)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """Causal mask and positions, once per chunk."""
        return self.causal_context(config, hidden, mask, positions)

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict) -> torch.Tensor:
        """One ``GPT2Block`` (no cache)."""
        return layer(hidden, None, context["mask"], position_ids=context["positions"], use_cache=False)


class LlamaStages(_DecoderStages):
    """Llama: ``embed_tokens`` → ``layers[i]`` with rotary embeddings → ``norm`` → score at the last non-pad token."""

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The decoder layers, in order (as many as the config says, like ``LlamaModel``)."""
        return model.model.layers[: model.config.num_hidden_layers]

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        return {"embed_tokens": model.model.embed_tokens}

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        return {"norm": model.model.norm, "score": model.score}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The rotary embedding (buffers only): each chunk recomputes cos/sin from the positions."""
        return {"rotary_emb": model.model.rotary_emb}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token embeddings; Llama has no token types (positions enter through the rotary embedding)."""
        hidden = mods["embed_tokens"](input_ids)
        return hidden, attention_mask, _last_non_pad_one_hot(input_ids, config, hidden.dtype)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """Causal mask, positions and rotary ``(cos, sin)``, once per chunk."""
        context = self.causal_context(config, hidden, mask, positions)
        context["rotary"] = aux["rotary_emb"](hidden, position_ids=context["positions"])
        return context

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict) -> torch.Tensor:
        """One ``LlamaDecoderLayer`` (no cache)."""
        return layer(
            hidden,
            attention_mask=context["mask"],
            position_embeddings=context["rotary"],
            position_ids=context["positions"],
            past_key_values=None,
            use_cache=False,
        )


FAMILIES: dict[str, Any] = {"bert": BertStages(), "gpt2": GPT2Stages(), "llama": LlamaStages()}


def family_of(model: torch.nn.Module) -> Any:
    """The stage adapter for ``model``; ``AxisError`` (pp) for a model pipeline parallelism does not cover.

    Args:
        model: an HF ``*ForSequenceClassification`` model.
    """
    config = getattr(model, "config", None)
    check_family(config, class_name=type(model).__name__)
    return FAMILIES[config.model_type]


AXIS_NAMES = {"pp": "pipeline parallelism", "cp": "context parallelism"}


def check_family(config: Any, *, class_name: str | None = None, axis: str = "pp") -> None:
    """Refuse a model family the stage adapters do not cover (before any model is built, from its config).

    Args:
        config: the model's ``transformers`` config.
        class_name: the model's class, when there is one (it must be a ``*ForSequenceClassification``).
        axis: the axis that needs the adapters (``"pp"``, or ``"cp"``, which pools with them), named in the refusal.
    """
    model_type = getattr(config, "model_type", None)
    name = class_name or f"{model_type} model"
    if model_type not in FAMILIES or (class_name is not None and not class_name.endswith("ForSequenceClassification")):
        raise AxisError(
            axis,
            f"{AXIS_NAMES[axis]} supports BERT, GPT-2 and Llama *ForSequenceClassification models, got "
            f"{name} (model_type {model_type!r}); use {axis} 1 for this model",
        )


class PipelineChunk(torch.nn.Module):
    """One pipeline chunk: optional embedding, a run of HF layers, optional pooling head.

    Args:
        family: the model family's adapter from :data:`FAMILIES`.
        config: the HF model config (mask creation reads it).
        embed: the embedding modules (first chunk only), by short name.
        layers: the HF layers of this chunk, by their layer index.
        head: the final norm/pooler/classifier modules (last chunk only), by short name.
        aux: parameter-free helpers every chunk needs (e.g. Llama's rotary embedding).
    """

    def __init__(
        self,
        family: Any,
        config: Any,
        *,
        embed: Modules | None,
        layers: Modules,
        head: Modules | None,
        aux: Modules,
    ) -> None:
        super().__init__()
        self.family = family
        self.config = config
        self.embed = torch.nn.ModuleDict(embed) if embed is not None else None
        self.layers = torch.nn.ModuleDict(layers)
        self.head = torch.nn.ModuleDict(head) if head is not None else None
        self.aux = torch.nn.ModuleDict(aux)
        self._hf_names: dict[str, str] = {}
        self.index: int | None = None  # global stage index, set by build_stage_modules
        # context parallelism (hftrain.parallel.context_parallel.ContextSplit): this rank's part of each sequence
        self.context_split: Any = None

    @property
    def is_first(self) -> bool:
        """Whether this chunk embeds (takes token ids instead of activations)."""
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        """Whether this chunk ends in the classification head (returns logits)."""
        return self.head is not None

    def attach_hf_names(self, hf_names: dict[int, str]) -> None:
        """Record the HF name of each parameter.

        Args:
            hf_names: ``{id(p): name for name, p in model.named_parameters()}``.
        """
        self._hf_names = {name: hf_names[id(p)] for name, p in self.named_parameters()}

    def hf_name(self, name: str) -> str:
        """The HF model's name of this chunk's parameter ``name``.

        Args:
            name: a name from this chunk's ``named_parameters()``.
        """
        return self._hf_names[name]

    def hf_named_parameters(self):
        """``(hf_name, parameter)`` pairs of this chunk, in ``named_parameters()`` order."""
        for name, param in self.named_parameters():
            yield self._hf_names[name], param

    def forward(self, *acts: torch.Tensor) -> Any:
        """First chunk: ``(input_ids, attention_mask[, token_type_ids])``; others: the activation tuple.

        Returns the next activation tuple, or the logits ``[b, num_labels]`` from the last chunk.
        """
        split = self.context_split
        if self.is_first:
            if split is None:
                hidden, mask, pool = self.family.embed(self.embed, self.config, *acts)
            else:  # this rank's positions of the whole sequences; the classified token found on the whole
                input_ids, positions = acts[0], split.positions(acts[0].shape[1], acts[0].device)
                local = [a[:, positions] for a in acts]
                hidden, mask, _ = self.family.embed(self.embed, self.config, *local, positions=positions)
                pool = self.family.pool(self.config, input_ids, hidden.dtype)[:, positions]
        else:
            hidden, mask, pool = acts
        positions = None if split is None else split.attend(mask)
        if len(self.layers):
            context = self.family.layer_context(self.aux, self.config, hidden, mask, positions)
            for layer in self.layers.values():
                hidden = self.family.run_layer(layer, hidden, context)
        if self.is_last:
            return self.family.head(self.head, hidden, pool, *(() if split is None else (split.sum,)))
        return hidden, mask, pool
