"""Pipeline chunks, the per-family trunk adapters that run their layers, and the task heads that end them.

A family's *trunk* adapter (``EncoderStages``, ``GPT2Stages``, ``DecoderStages``, ``ModernBertStages``,
``DebertaStages``: registered in ``hftrain.parallel.families``) knows its embedding, layers and final norm; a task's
*head* (:class:`StageHead`) knows what the first chunk reads, what travels beside the hidden states and what the
last chunk returns: a sequence classifier's (:class:`FirstTokenHead`, :class:`LastTokenHead`, :class:`DebertaHead`,
:class:`ModernBertHead`, registered beside their families), a causal LM's (:class:`CausalLMHead`), or a task's own.
:class:`ModelStages` joins the two and :class:`PipelineChunk` runs them without knowing the task.

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
    """BERT-style encoders' trunk: embeddings (ELECTRA: then its ``embeddings_project``) → ``layer[i]``; no final norm.
    Their classification heads are :class:`FirstTokenHead`'s.

    Args:
        base: the base model's attribute (``bert``, ``roberta``, ``electra``, ``distilbert``).
        layers: the path of its ``ModuleList`` of layers inside the base model.
        pad_numbered: the family numbers positions from its padding index, counting only non-pad tokens (RoBERTa,
            XLM-R: ``padding_idx + cumsum(not pad)``, pads at ``padding_idx``), rather than by index.
    """

    def __init__(self, base: str, layers: str = "encoder.layer", *, pad_numbered: bool = False) -> None:
        self.base, self.layers_path, self.pad_numbered = base, layers, pad_numbered

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

    def norm_modules(self, model: torch.nn.Module) -> Modules:
        """The trunk's final norm: none (BERT's layers end in their own norms)."""
        return {}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """Parameter-free helpers every chunk needs."""
        return {}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token ids (and token types, positions where given) to the hidden states ``[b, s, h]``."""
        kwargs = {} if positions is None else {"position_ids": _positions(input_ids, positions)}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = mods["embeddings"](input_ids=input_ids, **kwargs)
        if "project" in mods:
            hidden = mods["project"](hidden)
        return hidden

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The 4-D mask, built once per chunk as the HF encoder builds it."""
        from transformers.masking_utils import create_bidirectional_mask

        return {"mask": create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One encoder layer."""
        return layer(hidden, context["mask"])


class ModernBertStages:
    """ModernBERT's trunk: embeddings (token embedding → norm → dropout) → ``layers[i]`` with the mask and rotary
    embedding of its layer type (global: full bidirectional attention; local: a bidirectional sliding window, its own
    rotary base) → the final norm. Its classification head is :class:`ModernBertHead`.
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

    def norm_modules(self, model: torch.nn.Module) -> Modules:
        """The final norm."""
        return {"norm": model.model.final_norm}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The rotary embedding (buffers only): each chunk recomputes cos/sin per layer type."""
        return {"rotary_emb": model.model.rotary_emb}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token ids to the hidden states (positions enter through the rotary embedding)."""
        return mods["embeddings"](input_ids=input_ids)

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


class AlbertStages(EncoderStages):
    """ALBERT's trunk: its factorised embedding (``embedding_size`` wide) → the encoder's
    ``embedding_hidden_mapping_in`` (to ``hidden_size``) → the layer group run ``num_hidden_layers`` times, as
    ``AlbertTransformer`` runs it: layer ``i`` is group ``⌊i / (L / G)⌋``, so with one group (every released ALBERT)
    every layer is the same module.

    The layers are that module repeated, so the chunks of every pipeline rank hold the group's weights: a copy on
    each rank, from the same initial values, its gradient summed over the pipeline group and the first stage's copy
    the one checkpointed and exported (``hftrain.parallel.pipeline.place_stage_copies`` records it, as it records
    DeBERTa's relative embeddings). Several groups (G > 1) are refused: a group would be held by some pipeline ranks
    only. Its classification head is :class:`FirstTokenHead`'s ``albert_pooler``.
    """

    def __init__(self) -> None:
        super().__init__("albert")

    def refusal(self, config: Any) -> str | None:
        """Why a config cannot be cut into stages (several layer groups), else None."""
        if getattr(config, "num_hidden_groups", 1) != 1:
            return (
                f"its {config.num_hidden_groups} layer groups would each be held by some pipeline ranks only; hftrain "
                "cuts ALBERT models with one group (num_hidden_groups 1, as every released ALBERT); use pp 1"
            )
        return None

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The layer group each of the ``num_hidden_layers`` layers runs, in order (the same module, repeated)."""
        config, groups = model.config, model.albert.encoder.albert_layer_groups
        count, group_count = config.num_hidden_layers, config.num_hidden_groups
        return torch.nn.ModuleList([groups[int(i / (count / group_count))] for i in range(count)])

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """The embeddings and the projection to the hidden size."""
        return {"embeddings": model.albert.embeddings, "project": model.albert.encoder.embedding_hidden_mapping_in}


class DebertaStages(EncoderStages):
    """DeBERTa-v2/v3's trunk: embeddings (padding zeroed by the mask, as ``DebertaV2Embeddings`` does) → ``layer[i]``
    with the encoder's relative positions and relative embeddings. Its classification head is :class:`DebertaHead`.

    The relative embeddings (and their LayerNorm) are read by every layer: each chunk holds them (``aux_modules``:
    parameters on every pipeline rank, their gradient summed over the pipeline group, the first stage's copy the one
    checkpointed and exported) and computes them, the relative positions and the pairwise mask once per chunk, as
    the encoder does once per forward. The convolution after the first layer (``conv_kernel_size > 0``) is refused.
    BERT's layout otherwise (:class:`EncoderStages`: layers, embedding modules).
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

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The encoder's relative-position state (see the class doc)."""
        return {"relative": _RelativeState(model.deberta.encoder)}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token ids to the hidden states (padding zeroed by the mask)."""
        kwargs = {} if positions is None else {"position_ids": _positions(input_ids, positions)}
        return mods["embeddings"](input_ids=input_ids, token_type_ids=token_type_ids, mask=attention_mask, **kwargs)

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


class _LastTokenStages:
    """Shared by the decoders' trunks: positions by index; a causal LM's head (:class:`CausalLMHead`) can follow."""

    causal = True

    def position_ids(self, mods: Any, input_ids: torch.Tensor) -> None:
        """None: the decoders number positions by their index."""
        return None


class GPT2Stages(_LastTokenStages):
    """GPT-2's trunk: ``wte + wpe`` → dropout → ``transformer.h[i]`` → ``ln_f`` (classifier: :class:`LastTokenHead`)."""

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer blocks, in order."""
        return model.transformer.h

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        t = model.transformer
        return {"wte": t.wte, "wpe": t.wpe, "drop": t.drop}

    def norm_modules(self, model: torch.nn.Module) -> Modules:
        """The final norm ``ln_f``."""
        return {"norm": model.transformer.ln_f}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """Parameter-free helpers every chunk needs."""
        return {}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token and position embeddings (plus token types, as ``GPT2Model``), then embedding dropout."""
        inputs_embeds = mods["wte"](input_ids)
        hidden = inputs_embeds + mods["wpe"](_positions(inputs_embeds, positions))
        if token_type_ids is not None:
            hidden = hidden + mods["wte"](token_type_ids)
        return mods["drop"](hidden)

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
    rotary embeddings → the final norm (their classifier: :class:`LastTokenHead`).

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

    def norm_modules(self, model: torch.nn.Module) -> Modules:
        """The final norm."""
        return {"norm": getattr(getattr(model, self.base), self.norm_name)}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The rotary embedding (buffers only): each chunk recomputes cos/sin from the positions."""
        return {"rotary_emb": getattr(model, self.base).rotary_emb}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token embeddings (and the embedding dropout); no token types (positions enter through the rotary)."""
        hidden = mods["embed"](input_ids)
        if "dropout" in mods:
            hidden = mods["dropout"](hidden)
        return hidden

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


# ----------------------------------------------------------------------------- task heads
class StageHead:
    """A task's head on a family's trunk: what the pipeline's first chunk reads and the last one computes.

    The engine (:class:`PipelineChunk`, ``hftrain.parallel.schedules``) never opens the batch nor the output: the
    head names the first chunk's input columns (:meth:`first_args`), turns them into the activation tuple
    ``(hidden [b, s, h], trunk_input [b, s], *carries)`` (:meth:`embed`; ``trunk_input`` is the 2-D attention mask,
    or a packed block's position ids where :attr:`packed`), and maps the trunk's last (normed) hidden states and the
    carried tensors to the last chunk's output (:meth:`forward`). The task's loss is computed from that output by the
    Trainer's ``compute_loss``, on the model :meth:`output` presents. A task defines a subclass; the classification
    heads are registered beside their families (``hftrain.parallel.families``).

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
        ``compute_loss``/``prediction_step`` read it: an object with ``.logits`` and ``.loss`` (None here).

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
        if inputs is None or inputs.get("input_ids") is None:
            raise ValueError("the first pipeline stage needs inputs with input_ids")
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        types = inputs.get("token_type_ids")
        return (ids, torch.ones_like(ids) if mask is None else mask, *(() if types is None else (types,)))

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
        reduce = reduce or _identity
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


class DebertaHead(SequenceClassificationHead):
    """DeBERTa-v2/v3: ``ContextPooler`` on the first token → dropout → classifier."""

    def modules(self, model: torch.nn.Module) -> Modules:
        """The context pooler, dropout and classifier."""
        return {"pooler": model.pooler, "dropout": model.dropout, "classifier": model.classifier}

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """``ContextPooler`` (it takes the first token itself) → dropout → classifier."""
        return mods["classifier"](mods["dropout"](mods["pooler"](token.unsqueeze(1))))


class ModernBertHead(SequenceClassificationHead):
    """ModernBERT: pooling → ``head`` (dense → activation → norm) → dropout → classifier.

    The pooling weights are the first token's one-hot (``classifier_pooling: cls``) or the attention mask (``mean``),
    and the head computes ``Σ_s h_s · pool_s / Σ_s pool_s`` — transformers' ``(h · mask).sum(1) / mask.sum(1)`` term
    for term (a one-hot's sum is 1, so ``cls`` is exact too).
    """

    def modules(self, model: torch.nn.Module) -> Modules:
        """The prediction head, dropout and classifier."""
        return {"head": model.head, "drop": model.drop, "classifier": model.classifier}

    def pool(self, config: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, dtype: torch.dtype):
        """The first token's one-hot, or the mask (``mean``)."""
        if config.classifier_pooling == "mean":
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            return mask.to(dtype)
        return first_token_one_hot(input_ids, dtype)

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, pool: torch.Tensor, reduce=None):
        """Pooling (see the class doc), then the head: logits ``[b, num_labels]``."""
        reduce = reduce or _identity
        token = reduce((hidden * pool.unsqueeze(-1)).sum(1)) / reduce(pool.sum(1, keepdim=True))
        return self.classify(mods, token)

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The prediction head, dropout and classifier on the pooled token ``[b, hidden]``."""
        return mods["classifier"](mods["drop"](mods["head"](token)))


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
        return (reduce or _identity)(_pool(mods["score"](hidden), pool))

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The score on the pooled (already normed) token."""
        return mods["score"](token)


class CausalLMHead(StageHead):
    """A decoder's ``*ForCausalLM`` head (``model.task: causal_lm``): the output projection on every position.

    The activation tuple is ``(hidden [b, s, h], position_ids [b, s])``: packed blocks hold whole documents whose
    positions restart at each one and carry no attention mask, so every chunk builds its masks from the positions
    (transformers' ``create_causal_mask(..., attention_mask=None, position_ids=...)``: block-diagonal causal, as the
    unsharded model masks them) and the rotary embeddings from the same positions. The last chunk returns this rank's
    logits ``[b, s, vocabulary]`` (under tensor parallelism the vocabulary-parallel head's slice of it; Gemma-2/3's
    final soft-capping ``c · tanh(z / c)`` applied, as their ``*ForCausalLM``); the task computes the loss from them.

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
        """Token ids and their positions to ``(hidden, position_ids)``."""
        input_ids, position_ids = args
        return trunk.embed(mods, config, input_ids, None, positions=position_ids), position_ids

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


class ModelStages:
    """A model's pipeline adapter: its family's trunk and its task's head (:class:`StageHead`).

    The trunk holds the family's embedding, layers, final norm and parameter-free helpers; the head its task's modules.
    The last chunk holds the trunk's norm and the head's modules.

    Args:
        trunk: the family's trunk adapter (``hftrain.parallel.families``' ``stages``).
        head: the task's head.
    """

    def __init__(self, trunk: Any, head: StageHead) -> None:
        self.trunk, self.head = trunk, head

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The trunk's layers, in order."""
        return self.trunk.layers(model)

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """The first chunk's embedding modules."""
        return self.trunk.embed_modules(model)

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """The last chunk's modules: the trunk's final norm (as ``"norm"``), then the head's."""
        return {**self.trunk.norm_modules(model), **self.head.modules(model)}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The trunk's helpers every chunk needs."""
        return self.trunk.aux_modules(model)


from hftrain.parallel.chunk import PipelineChunk  # noqa: E402, F401
