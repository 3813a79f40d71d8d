"""Llama and the decoders that share its forward and module names (Mistral, Qwen2/3, Gemma): a plan derived from
transformers' ``base_model_tp_plan``, the rotary decoders' trunk (:class:`DecoderStages`, which GPT-NeoX, Gemma-2/3,
Phi-3, OLMo-2 and the mixtures of experts reuse from here), the last-token classifier and the ``score`` token
classifier (transformers' generic heads).

A family transformers adds later whose plan names exactly Llama's modules is found without an entry
(:func:`llama_architecture`).
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.errors import ConfigError
from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import LastTokenHead, TokenClassificationHead
from hftrain.parallel.plans import TensorParallelPlan
from hftrain.parallel.stages import FULL, SLIDING, CausalTrunk, Modules, positions_of


class DecoderStages(CausalTrunk):
    """Rotary decoders (Llama and the families that share its forward: Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo-2,
    GPT-NeoX, the mixtures of experts): the token embedding (a Gemma's scales itself by √hidden) → ``layers[i]`` with
    rotary embeddings → the final norm (their classifier: ``LastTokenHead``).

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

        positions = positions_of(hidden, positions)
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


# Llama's attention and model entries, shared by the decoders that name their modules as Llama does.
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
LLAMA_ATTENTION: tuple[tuple[str, str], ...] = (
    ("input_layernorm", "sequence"),
    ("self_attn", "region"),
    ("self_attn.q_proj", "column"),
    ("self_attn.k_proj", "column_kv"),
    ("self_attn.v_proj", "column_kv"),
    ("self_attn.o_proj", "row"),
    ("post_attention_layernorm", "sequence"),
)
LLAMA_MODEL: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens", "vocab"),
    ("model.layers.0", "scatter"),
    ("model.norm", "sequence"),
    ("model.norm", "gather"),
)
# transformers' tp styles -> hftrain's (k_proj / v_proj of grouped-query attention: per key/value head)
_HF_STYLES = {"colwise": "column", "rowwise": "row", "replicated_with_grad_allreduce": "head_shared"}
LLAMA_LINEARS = frozenset(
    f"layers.*.{name}"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
)  # fmt: skip


def derived_plan(config: Any, *, norms: tuple[str, ...] = LLAMA_NORMS) -> TensorParallelPlan:
    """A Llama-architecture decoder's plan derived from transformers' ``base_model_tp_plan`` (see the module doc).

    Args:
        config: the model's config (its ``base_model_tp_plan``, head counts and sizes).
        norms: the layer's norms on the residual stream (sequence chunks under sequence parallelism).
    """
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    unsupported = {key: style for key, style in hf_plan.items() if style not in _HF_STYLES}
    if unsupported or not LLAMA_LINEARS <= set(hf_plan):
        raise ConfigError(
            f"tensor parallelism cannot split this {config.model_type} model: transformers' plan for it "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(unsupported.items())) or 'no Llama-architecture plan'}) "
            "is not one hftrain splits; use strategy ddp/fsdp/zero* or pp for this model"
        )
    layer: list[tuple[str, str]] = [(norm, "sequence") for norm in norms]
    layer += [("self_attn", "region"), ("mlp", "region")]
    for key, style in sorted(hf_plan.items()):
        path = key.removeprefix("layers.*.")
        grouped = path in ("self_attn.k_proj", "self_attn.v_proj")
        layer.append((path, "column_kv" if grouped and style == "colwise" else _HF_STYLES[style]))
    return TensorParallelPlan(
        layers="model.layers",
        layer=tuple(layer),
        model=LLAMA_MODEL,
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
        grouped_query="self_attn",
    )


# what the decoders with Llama's trunk share: its adapter, the last non-pad token's score, ``score`` on every token
DECODER: dict[str, Any] = {
    "stages": DecoderStages(),
    "classifier": LastTokenHead(),
    "token_classifier": TokenClassificationHead("score"),
    "gated_mlp": True,
}

FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", tp=derived_plan, **DECODER),
    "mistral": Family("Mistral", tp=derived_plan, **DECODER),
    "qwen2": Family("Qwen2", tp=derived_plan, **DECODER),
    "qwen3": Family("Qwen3", tp=derived_plan, **DECODER),
    "gemma": Family("Gemma", tp=derived_plan, **DECODER),
}


def llama_architecture(config: Any) -> Family | None:
    """An entry for a model type the registry does not list whose transformers tp plan names exactly Llama's modules
    (colwise/rowwise only), else None.

    Args:
        config: the model's config.
    """
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    if set(hf_plan) == LLAMA_LINEARS and set(hf_plan.values()) <= {"colwise", "rowwise"}:
        return Family(f"{getattr(config, 'model_type', None)} (Llama architecture)", tp=derived_plan, **DECODER)
    return None
