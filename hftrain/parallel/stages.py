"""Pipeline chunks of HF sequence classifiers and decoder causal LMs, and the per-family adapters that run them.

The adapters call the HF modules themselves and rebuild attention masks with transformers' own
``create_causal_mask``/``create_bidirectional_mask`` from the carried 2-D mask, so a chain of chunks computes
exactly what the unsharded model does. See :mod:`hftrain.parallel.pipeline` for the activation tuple.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

Modules = dict[str, torch.nn.Module]
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types


def _positions(hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, s]`` position ids, as GPT-2 and Llama build them without a cache (or a context-parallel shard's own
    global positions); ``[b, s]`` ones (a causal LM's, restarting at every packed document) as given."""
    if positions is not None:  # [b, s]: a causal LM's packed documents' own positions
        return positions if positions.dim() == 2 else positions.unsqueeze(0)
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


class EncoderStages:
    """BERT-style encoders: embeddings (ELECTRA: then its ``embeddings_project``) → ``layer[i]`` → the head on the
    first token: BERT's pooler → dropout → classifier; RoBERTa's, XLM-R's and ELECTRA's classification head (it
    takes the first token itself); DistilBERT's ``pre_classifier`` → ReLU → dropout → classifier.

    Args:
        base: the base model's attribute (``bert``, ``roberta``, ``electra``, ``distilbert``).
        layers: the path of its ``ModuleList`` of layers inside the base model.
        head: ``"pooler"`` (BERT), ``"classification_head"`` (RoBERTa, XLM-R, ELECTRA) or ``"pre_classifier"``
            (DistilBERT).
        pad_numbered: the family numbers positions from its padding index, counting only non-pad tokens (RoBERTa,
            XLM-R: ``padding_idx + cumsum(not pad)``, pads at ``padding_idx``), rather than by index.
    """

    def __init__(
        self, base: str, layers: str = "encoder.layer", head: str = "pooler", *, pad_numbered: bool = False
    ) -> None:
        self.base, self.layers_path, self.head_kind, self.pad_numbered = base, layers, head, pad_numbered

    def position_ids(self, mods: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The position ids the family gives whole sequences ``[b, s]`` where they are not the index (RoBERTa's,
        numbered from the padding index by its embedding's own ``create_position_ids_from_input_ids``), else None. A
        split of the sequence (context parallelism) takes its positions' entries: every cp rank holds the whole
        batch.

        Args:
            mods: the embedding modules (:meth:`embed_modules`).
            input_ids: the whole sequences.
        """
        if not self.pad_numbered:
            return None
        embeddings = mods["embeddings"]
        return embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx)

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer layers, in order."""
        return getattr(model, self.base).get_submodule(self.layers_path)

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        base = getattr(model, self.base)
        project = getattr(base, "embeddings_project", None)  # ELECTRA with embedding_size != hidden_size
        return {"embeddings": base.embeddings, **({"project": project} if project is not None else {})}

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        if self.head_kind == "pooler":
            return {
                "pooler": getattr(model, self.base).pooler,
                "dropout": model.dropout,
                "classifier": model.classifier,
            }
        if self.head_kind == "pre_classifier":
            return {"pre_classifier": model.pre_classifier, "dropout": model.dropout, "classifier": model.classifier}
        return {"classifier": model.classifier}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """Parameter-free helpers every chunk needs."""
        return {}

    def pool(self, config: Any, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The one-hot of the token the head classifies, over the whole sequence: the first."""
        return first_token_one_hot(input_ids, dtype)

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token ids to the activation tuple (the head reads the first token)."""
        kwargs = {} if positions is None else {"position_ids": _positions(input_ids, positions)}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = mods["embeddings"](input_ids=input_ids, **kwargs)
        if "project" in mods:
            hidden = mods["project"](hidden)
        return hidden, attention_mask, first_token_one_hot(input_ids, hidden.dtype)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The 4-D mask, built once per chunk as the HF encoder builds it."""
        from transformers.masking_utils import create_bidirectional_mask

        return {"mask": create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One encoder layer."""
        return layer(hidden, context["mask"])

    def head(self, mods: Any, hidden: torch.Tensor, pool: torch.Tensor, reduce=_identity) -> torch.Tensor:
        """The head on the first token (picked by the one-hot: exact): logits ``[b, num_labels]``.

        ``reduce`` completes the pooled token where the sequence is split (a sum over the cp ranks)."""
        return self.classify(mods, reduce((hidden * pool.unsqueeze(-1)).sum(1)))

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The family's classification head on the pooled token ``[b, hidden]``."""
        if self.head_kind == "pooler":
            pooler = mods["pooler"]
            return mods["classifier"](mods["dropout"](pooler.activation(pooler.dense(token))))
        if self.head_kind == "pre_classifier":
            return mods["classifier"](mods["dropout"](torch.relu(mods["pre_classifier"](token))))
        return mods["classifier"](token.unsqueeze(1))  # the head takes features[:, 0, :] itself


class ModernBertStages:
    """ModernBERT: embeddings (token embedding → norm → dropout) → ``layers[i]`` with the mask and rotary embedding of
    its layer type (global: full bidirectional attention; local: a bidirectional sliding window, its own rotary
    base) → the final norm → pooling → ``head`` (dense → activation → norm) → dropout → classifier.

    The pooling weights travel as the activation tuple's ``pool`` ``[b, s]``: the first token's one-hot
    (``classifier_pooling: cls``) or the attention mask (``mean``), and the head computes
    ``Σ_s h_s · pool_s / Σ_s pool_s`` — transformers' ``(h · mask).sum(1) / mask.sum(1)`` term for term (a one-hot's
    sum is 1, so ``cls`` is exact too).
    """

    def position_ids(self, mods: Any, input_ids: torch.Tensor) -> None:
        """None: positions are the index (they enter through the rotary embedding)."""
        return None

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The encoder layers, in order."""
        return model.model.layers

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        return {"embeddings": model.model.embeddings}

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        return {"norm": model.model.final_norm, "head": model.head, "drop": model.drop, "classifier": model.classifier}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The rotary embedding (buffers only): each chunk recomputes cos/sin per layer type."""
        return {"rotary_emb": model.model.rotary_emb}

    def pool(self, config: Any, input_ids: torch.Tensor, dtype: torch.dtype, attention_mask=None) -> torch.Tensor:
        """The pooling weights over the whole sequence: the first token's one-hot, or the mask (``mean``)."""
        if config.classifier_pooling == "mean":
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            return mask.to(dtype)
        return first_token_one_hot(input_ids, dtype)

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token ids to ``(hidden, attention_mask, pool)``."""
        hidden = mods["embeddings"](input_ids=input_ids)
        return hidden, attention_mask, self.pool(config, input_ids, hidden.dtype, attention_mask)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The masks and rotary ``(cos, sin)`` of each layer type, built once per chunk as ``ModernBertModel``."""
        from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask

        positions = _positions(hidden, positions)
        kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": mask}
        builders = {FULL: create_bidirectional_mask, SLIDING: create_bidirectional_sliding_window_mask}
        kinds = sorted(set(config.layer_types))
        return {
            "types": config.layer_types,
            "masks": {kind: builders[kind](**kwargs) for kind in kinds},
            "rotary": {kind: aux["rotary_emb"](hidden, positions, kind) for kind in kinds},
        }

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """Encoder layer ``index``, with its layer type's mask and rotary embedding."""
        kind = context["types"][index]
        return layer(hidden, attention_mask=context["masks"][kind], position_embeddings=context["rotary"][kind])

    def head(self, mods: Any, hidden: torch.Tensor, pool: torch.Tensor, reduce=_identity) -> torch.Tensor:
        """Final norm, pooling (see the class doc), then the head: logits ``[b, num_labels]``."""
        token = reduce((mods["norm"](hidden) * pool.unsqueeze(-1)).sum(1)) / reduce(pool.sum(1, keepdim=True))
        return self.classify(mods, token)

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The prediction head, dropout and classifier on the pooled token ``[b, hidden]``."""
        return mods["classifier"](mods["drop"](mods["head"](token)))


class _RelativeState(torch.nn.Module):
    """A DeBERTa-v2 encoder's relative-position state, which every layer (so every pipeline chunk) reads: its
    relative embeddings and their LayerNorm (the encoder's own modules: parameters every chunk shares), and the
    sizes its ``get_rel_embedding`` / ``get_rel_pos`` read. Those two are transformers' methods, run on this object."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder_class = type(encoder)
        self.relative_attention = encoder.relative_attention
        self.norm_rel_ebd = encoder.norm_rel_ebd
        for name in ("rel_embeddings", "LayerNorm", "max_relative_positions", "position_buckets"):
            if hasattr(encoder, name):
                setattr(self, name, getattr(encoder, name))

    def get_rel_embedding(self) -> torch.Tensor | None:
        """The (normed) relative embeddings, as the encoder computes them once per forward."""
        return self.encoder_class.get_rel_embedding(self)

    def get_rel_pos(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The bucketed relative positions of the sequence, as the encoder builds them."""
        return self.encoder_class.get_rel_pos(self, hidden)


class DebertaStages(EncoderStages):
    """DeBERTa-v2/v3: embeddings (padding zeroed by the mask, as ``DebertaV2Embeddings`` does) → ``layer[i]`` with the
    encoder's relative positions and relative embeddings → ``ContextPooler`` on the first token → dropout →
    classifier.

    The relative embeddings (and their LayerNorm) are read by every layer: each chunk holds them (``aux_modules``:
    parameters on every pipeline rank, their gradient summed over the pipeline group, the first stage's copy the one
    checkpointed and exported) and computes them, the relative positions and the pairwise mask once per chunk, as
    the encoder does once per forward. The convolution after the first layer (``conv_kernel_size > 0``) is refused.
    BERT's layout otherwise (:class:`EncoderStages`: layers, embedding modules, the first token's pooling).
    """

    def __init__(self) -> None:
        super().__init__("deberta")

    def refusal(self, config: Any) -> str | None:
        """Why a config cannot be cut into stages (its convolution layer), else None."""
        if getattr(config, "conv_kernel_size", 0) > 0:
            return (
                f"its convolution after the first layer (conv_kernel_size {config.conv_kernel_size}) is not in "
                "hftrain's stages; use pp 1"
            )
        return None

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        return {"pooler": model.pooler, "dropout": model.dropout, "classifier": model.classifier}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The encoder's relative-position state (see the class doc)."""
        return {"relative": _RelativeState(model.deberta.encoder)}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token ids to ``(hidden, attention_mask, pool)``."""
        kwargs = {} if positions is None else {"position_ids": _positions(input_ids, positions)}
        hidden = mods["embeddings"](input_ids=input_ids, token_type_ids=token_type_ids, mask=attention_mask, **kwargs)
        return hidden, attention_mask, first_token_one_hot(input_ids, hidden.dtype)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The pairwise mask ``m_i · m_j``, the relative positions and embeddings, once per chunk (the encoder's)."""
        pairwise = mask.unsqueeze(1).unsqueeze(2)
        relative = aux["relative"]
        return {
            "mask": pairwise * pairwise.squeeze(-2).unsqueeze(-1),
            "positions": relative.get_rel_pos(hidden),
            "embeddings": relative.get_rel_embedding(),
        }

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One encoder layer."""
        output, _ = layer(
            hidden, context["mask"], relative_pos=context["positions"], rel_embeddings=context["embeddings"]
        )
        return output

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """``ContextPooler`` (it takes the first token itself) → dropout → classifier."""
        return mods["classifier"](mods["dropout"](mods["pooler"](token.unsqueeze(1))))


class _LastTokenStages:
    """Shared by the decoders: the head pooled at the last non-pad token."""

    def position_ids(self, mods: Any, input_ids: torch.Tensor) -> None:
        """None: the decoders number positions by their index."""
        return None

    def pool(self, config: Any, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The one-hot of the token the head classifies, over the whole sequence: the last non-pad one."""
        return _last_non_pad_one_hot(input_ids, config, dtype)

    def head(self, mods: Any, hidden: torch.Tensor, pool: torch.Tensor, reduce=_identity) -> torch.Tensor:
        """Final norm, score on every position, then the pooled token (transformers' order of operations);
        ``reduce`` completes it where the sequence is split (a sum over the cp ranks)."""
        return reduce(_pool(mods["score"](mods["norm"](hidden)), pool))

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The score on the pooled (already normed) token."""
        return mods["score"](token)


class GPT2Stages(_LastTokenStages):
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

    def lm_head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of a ``GPT2LMHeadModel``'s last chunk: ``ln_f`` and the output projection."""
        return {"norm": model.transformer.ln_f, "lm_head": model.get_output_embeddings()}

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
        from transformers.masking_utils import create_causal_mask

        positions = _positions(hidden, positions)
        causal = create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=mask, past_key_values=None, position_ids=positions
        )
        return {"mask": causal, "positions": positions}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One ``GPT2Block`` (no cache)."""
        return layer(hidden, None, context["mask"], position_ids=context["positions"], use_cache=False)


class DecoderStages(_LastTokenStages):
    """Rotary decoders (Llama and the families that share its forward: Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo-2,
    GPT-NeoX, the mixtures of experts): the token embedding (a Gemma's scales itself by √hidden) → ``layers[i]`` with
    rotary embeddings → the final norm → score at the last non-pad token.

    Each layer gets the mask its model gives it: per ``config.layer_types`` (full or sliding-window attention:
    Qwen2/3, Gemma-2/3), sliding for every layer where the config has a ``sliding_window`` and no layer types
    (Mistral, Mixtral, Phi-3, Qwen3-MoE), causal otherwise; and the rotary embedding of its layer type where the
    rotary module takes one (Gemma-3's local and global bases).

    Args:
        base: the base model's attribute (``model``, ``gpt_neox``).
        embed: the token embedding's attribute in it.
        norm: the final norm's attribute in it.
        dropout: the embedding dropout's attribute (GPT-NeoX's ``emb_dropout``), or None.
        cache_argument: the name the layers take the cache by (GPT-NeoX: ``layer_past``).
    """

    def __init__(
        self,
        base: str = "model",
        embed: str = "embed_tokens",
        norm: str = "norm",
        dropout: str | None = None,
        cache_argument: str = "past_key_values",
    ) -> None:
        self.base, self.embed_name, self.norm_name, self.dropout = base, embed, norm, dropout
        self.cache_argument = cache_argument

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The decoder layers, in order (as many as the config says, like the HF model)."""
        return getattr(model, self.base).layers[: model.config.num_hidden_layers]

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        base = getattr(model, self.base)
        mods = {"embed": getattr(base, self.embed_name)}
        if self.dropout is not None:
            mods["dropout"] = getattr(base, self.dropout)
        return mods

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the last chunk's head."""
        return {"norm": getattr(getattr(model, self.base), self.norm_name), "score": model.score}

    def lm_head_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of a ``*ForCausalLM``'s last chunk: the final norm and the output projection."""
        return {"norm": getattr(getattr(model, self.base), self.norm_name), "lm_head": model.get_output_embeddings()}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The rotary embedding (buffers only): each chunk recomputes cos/sin from the positions."""
        return {"rotary_emb": getattr(model, self.base).rotary_emb}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None) -> tuple:
        """Token embeddings (and the embedding dropout); no token types (positions enter through the rotary)."""
        hidden = mods["embed"](input_ids)
        if "dropout" in mods:
            hidden = mods["dropout"](hidden)
        return hidden, attention_mask, _last_non_pad_one_hot(input_ids, config, hidden.dtype)

    @staticmethod
    def layer_types(config: Any) -> list[str]:
        """Each layer's attention, full or sliding-window (see the class doc)."""
        types = getattr(config, "layer_types", None)
        if types is not None:
            return list(types)
        sliding = getattr(config, "sliding_window", None) is not None
        return [SLIDING if sliding else FULL] * config.num_hidden_layers

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The masks and rotary ``(cos, sin)`` of the layer types this model has, and positions, once per chunk."""
        import inspect

        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        positions = _positions(hidden, positions)
        types = self.layer_types(config)
        kinds = sorted(set(types))
        kwargs = {"config": config, "inputs_embeds": hidden, "attention_mask": mask, "past_key_values": None,
                  "position_ids": positions}  # fmt: skip
        builders = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
        masks = {kind: builders[kind](**kwargs) for kind in kinds}
        rotary = aux["rotary_emb"]
        if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma-3: a base per layer type
            rotaries = {kind: rotary(hidden, positions, kind) for kind in kinds}
        else:
            rotaries = dict.fromkeys(kinds, rotary(hidden, position_ids=positions))
        return {"types": types, "masks": masks, "rotary": rotaries, "positions": positions}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """Decoder layer ``index`` (no cache), with its layer type's mask and rotary embedding."""
        kind = context["types"][index]
        return layer(
            hidden,
            attention_mask=context["masks"][kind],
            position_embeddings=context["rotary"][kind],
            position_ids=context["positions"],
            use_cache=False,
            **{self.cache_argument: None},
        )


class CausalLMStages:
    """A decoder family's stages for its ``*ForCausalLM`` (``model.task: causal_lm``): the family's embedding and
    layers, then the final norm and the output projection on every position.

    The activation tuple is ``(hidden [b, s, h], position_ids [b, s])``: packed blocks hold whole documents whose
    positions restart at each one and carry no attention mask, so every chunk builds its masks from the positions
    (transformers' ``create_causal_mask(..., attention_mask=None, position_ids=...)``: block-diagonal causal, as the
    unsharded model masks them) and the rotary embeddings from the same positions. The last chunk returns this rank's
    logits ``[b, s, vocabulary]`` (under tensor parallelism the vocabulary-parallel head's slice of it; Gemma-2/3's
    final soft-capping applied, as their ``*ForCausalLM``); the task computes the loss from them.

    Args:
        family: the family's adapter (:class:`GPT2Stages`, :class:`DecoderStages`).
        config: the model's config (``final_logit_softcapping``).
    """

    first_inputs = ("input_ids", "position_ids")
    """The batch columns the first chunk reads, in order."""
    per_position = True
    """The last chunk's output has a row per position (not one per example)."""

    def __init__(self, family: Any, config: Any = None) -> None:
        self.family = family
        self.softcap = getattr(config, "final_logit_softcapping", None) if config is not None else None

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The family's layers, in order."""
        return self.family.layers(model)

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """The family's embedding modules."""
        return self.family.embed_modules(model)

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """The final norm and the output projection (``get_output_embeddings()``: vocabulary-parallel under tp)."""
        return self.family.lm_head_modules(model)

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The family's parameter-free helpers (rotary embedding)."""
        return self.family.aux_modules(model)

    def embed(self, mods: Any, config: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        """Token ids and their positions to ``(hidden, position_ids)``."""
        hidden, _, _ = self.family.embed(mods, config, input_ids, None, positions=position_ids)
        return hidden, position_ids

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, position_ids: torch.Tensor, _=None) -> dict:
        """The family's masks (packed block-diagonal, from the positions) and rotary embeddings, once per chunk."""
        return self.family.layer_context(aux, config, hidden, None, position_ids)

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One layer of the family."""
        return self.family.run_layer(layer, hidden, context, index)

    def head(self, mods: Any, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, then the output projection on every position: logits ``[b, s, vocabulary (slice)]``."""
        logits = mods["lm_head"](mods["norm"](hidden))
        if self.softcap is not None:  # elementwise: the same on a vocabulary slice
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class PipelineChunk(torch.nn.Module):
    """One pipeline chunk: optional embedding, a run of HF layers, optional pooling head.

    Args:
        family: the model family's stage adapter (``hftrain.parallel.families``).
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
        # a mixture of experts (hftrain.parallel.expert_parallel.StageRouting): the router loss's sums, passed on
        self.routing: Any = None

    @contextlib.contextmanager
    def microbatch(self):
        """A real micro-batch's forward (the schedule's stage enters it; torch's shape inference on placeholder
        tensors does not): a mixture of experts' chunk counts its tokens per expert then, in training."""
        if self.routing is None:
            yield
            return
        self.routing.counting = torch.is_grad_enabled()
        try:
            yield
        finally:
            self.routing.counting = False

    @property
    def is_first(self) -> bool:
        """Whether this chunk embeds (takes token ids instead of activations)."""
        return self.embed is not None

    @property
    def first_inputs(self) -> tuple[str, ...] | None:
        """The batch columns the first chunk reads when its family names them (a causal LM's), else None."""
        return getattr(self.family, "first_inputs", None)

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
        """First chunk: the batch columns the family reads (a classifier's ``(input_ids, attention_mask[,
        token_type_ids])``, a causal LM's ``(input_ids, position_ids)``); others: the activation tuple.

        Returns the next activation tuple, or the last chunk's output (a classifier's logits ``[b, num_labels]``).
        A mixture of experts' chunk adds its layers' router-loss sums to the ones it received, at the tuple's end
        (``routing``); the last chunk turns them into the micro-batch's router loss.
        """
        split, routing = self.context_split, self.routing
        received = None
        if routing is not None and not self.is_first:
            acts, received = acts[: -routing.width], acts[-routing.width :]
        if self.is_first:
            if split is None:
                acts = self.family.embed(self.embed, self.config, *acts)
            else:  # this rank's positions of the whole sequences; the classified token found on the whole
                input_ids, positions = acts[0], split.positions(acts[0].shape[1], acts[0].device)
                local = [a[:, positions] for a in acts]
                numbered = self.family.position_ids(self.embed, input_ids)  # RoBERTa's, from the whole sequence
                ids = positions if numbered is None else numbered[:, positions]
                hidden, mask, _ = self.family.embed(self.embed, self.config, *local, positions=ids)
                acts = hidden, mask, self.family.pool(self.config, input_ids, hidden.dtype)[:, positions]
        hidden, carried = acts[0], acts[1:]  # carried: a classifier's (mask, pool), a causal LM's (positions,)
        positions = None if split is None else split.attend(carried[0])
        if len(self.layers):
            context = self.family.layer_context(self.aux, self.config, hidden, carried[0], positions)
            with contextlib.nullcontext() if routing is None else routing.recording():
                for index, layer in self.layers.items():
                    hidden = self.family.run_layer(layer, hidden, context, int(index))
        routed = ()
        if routing is not None:  # padding excluded by a classifier's mask (a causal LM's packed rows have none)
            mask = None if getattr(self.family, "per_position", False) else carried[0]
            routed = routing.add(received, mask, hidden.device)
        if self.is_last:
            if routing is not None and torch.is_grad_enabled():  # training: its loss takes the router loss
                routing.finish(routed)
            return self.family.head(self.head, hidden, *carried[1:], *(() if split is None else (split.sum,)))
        return (hidden, *carried, *routed)
