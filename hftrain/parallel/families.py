"""The model families hftrain splits: one registry entry per family, read by every axis and by ``hftrain plan``.

An entry (:class:`Family`) holds what hftrain knows of a family: its tensor-parallel plan (``hftrain.parallel.plans``
styles), its pipeline trunk adapter and sequence-classification head (``hftrain.parallel.stages``; context
parallelism reads the trunk's layers and numbering of positions), its expert plan (mixtures of experts), why an
axis cannot run it (one line), and the planner's facts. The axes look their family up here (:func:`plan_for`,
:func:`stages_for`, :func:`stages_of`, :func:`expert_plan_for`, :func:`check_family`), and so does ``hftrain plan``,
so the planner never offers a layout the trainer refuses.

Where transformers ships a family's own tensor-parallel plan (``config.base_model_tp_plan``, e.g.
``"layers.*.self_attn.q_proj": "colwise"``), the entry is derived from it (:func:`derived_plan`): ``colwise`` is a
column split (per key/value head for ``k_proj``/``v_proj`` of grouped-query attention), ``rowwise`` a row split,
``replicated_with_grad_allreduce`` (per-head q/k norms) a replicated module whose gradient is summed over tp; what
transformers' plan cannot say is written beside it: the norms that run on sequence chunks under sequence
parallelism. Where transformers' plan gathers (``colwise_gather_output``) the entry is written by hand: OLMo-2's
q/k norms over every head are split with their projections (``width_norm``); Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are split part by part (``column_fused_qkv``, ``column_gate_up``). Where transformers has no plan
the entry is written by hand too: BERT's architecture and its kin, DeBERTa-v2's disentangled relative attention (its
shared relative embeddings ``head_shared``: each rank projects them onto its own heads). A family transformers adds
later whose plan has exactly Llama's modules is found without an entry (:func:`family_of`), checked against the
model's modules when it is split.

| family | tp (+sp) | pp | cp | ep |
|---|---|---|---|---|
| BERT, ELECTRA, DistilBERT | yes | yes | yes | |
| RoBERTa, XLM-R | yes | yes | yes (positions numbered from the pads over the whole sequence, then split) | |
| GPT-2 | yes | yes | yes | |
| GPT-NeoX | yes (fused qkv, per head) | yes | yes | |
| Llama, Qwen2, Qwen3, Gemma, Mistral | yes | yes | yes (sliding windows too) | |
| Gemma-3 (text) | yes | yes | yes (local and global layers) | |
| Gemma-2 | yes | yes | no: soft-capped attention logits | |
| OLMo-2 | yes (q/k norms over every head: their sum of squares all-reduced over tp) | yes | yes | |
| Phi-3 | yes (fused qkv and gate_up, part by part; tp divides kv heads) | yes | yes | |
| Mixtral, Qwen2-MoE, Qwen3-MoE | attention (MoE replicated, no sp) | yes (router loss summed over stages) | no | yes |
| ModernBERT | yes (fused Wqkv and GLU Wi, part by part) | yes | no: local attention layers | |
| DeBERTa-v2, DeBERTa-v3 | yes (relative embeddings' gradient summed over tp) | yes (... over pp) | no | |
| ALBERT | yes (the shared layer group split once) | yes (the shared group: a copy per rank) | no: one layer run L× | |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hftrain.errors import AxisError, ConfigError
from hftrain.parallel.plans import ExpertPlan, TensorParallelPlan, kv_heads_split
from hftrain.parallel.stages import (
    AlbertStages,
    DebertaHead,
    DebertaStages,
    DecoderStages,
    EncoderStages,
    FirstTokenHead,
    GPT2Stages,
    LastTokenHead,
    ModernBertHead,
    ModernBertStages,
)

AXIS_NAMES = {"tp": "tensor parallelism", "pp": "pipeline parallelism", "cp": "context parallelism"}


@dataclass(frozen=True)
class Family:
    """What hftrain knows of one model family.

    Args:
        name: how messages and the README name it (``"Qwen3"``).
        tp: its tensor-parallel plan, or a function of the config giving it (derived from transformers' plan); None
            where tp cannot split it (``refusals["tp"]`` says why).
        stages: its trunk's pipeline adapter (embedding, layers, final norm; ``hftrain.parallel.stages``); None: no
            pp and no cp.
        classifier: its ``*ForSequenceClassification``'s head (a ``StageHead``: the pipeline's last chunk's pooling
            and classifier); another task hands its own head over (:func:`stages_of`).
        experts: its expert plan (a mixture of experts), or None.
        refusals: ``axis -> why`` for the axes it cannot take (one line each).
        cp_refusal: a function of the config giving why context parallelism cannot be exact for it (Gemma-2's
            soft-capped attention), or None when it can.
        gated_mlp: its MLP is gated (three matrices: the planner's FLOPs and sizes).
    """

    name: str
    tp: TensorParallelPlan | Callable[[Any], TensorParallelPlan] | None = None
    stages: Any = None
    classifier: Any = None
    experts: ExpertPlan | None = None
    refusals: dict[str, str] = field(default_factory=dict)
    cp_refusal: Callable[[Any], str | None] = lambda config: None
    gated_mlp: bool = False

    def tp_plan(self, config: Any) -> TensorParallelPlan | None:
        """This family's tensor-parallel plan for ``config`` (None: refused)."""
        return self.tp(config) if callable(self.tp) else self.tp


# ----------------------------------------------------------------------------- tensor-parallel plans
# Llama's attention and model entries, shared by the decoders that name their modules as Llama does.
_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
_GEMMA2_NORMS = (*_LLAMA_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")
_LLAMA_ATTENTION: tuple[tuple[str, str], ...] = (
    ("input_layernorm", "sequence"),
    ("self_attn", "region"),
    ("self_attn.q_proj", "column"),
    ("self_attn.k_proj", "column_kv"),
    ("self_attn.v_proj", "column_kv"),
    ("self_attn.o_proj", "row"),
    ("post_attention_layernorm", "sequence"),
)
_LLAMA_MODEL: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens", "vocab"),
    ("model.layers.0", "scatter"),
    ("model.norm", "sequence"),
    ("model.norm", "gather"),
)
# transformers' tp styles -> hftrain's (k_proj / v_proj of grouped-query attention: per key/value head)
_HF_STYLES = {"colwise": "column", "rowwise": "row", "replicated_with_grad_allreduce": "head_shared"}
_LLAMA_LINEARS = frozenset(
    f"layers.*.{name}"
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")
)  # fmt: skip


def derived_plan(config: Any, *, norms: tuple[str, ...] = _LLAMA_NORMS) -> TensorParallelPlan:
    """A Llama-architecture decoder's plan derived from transformers' ``base_model_tp_plan`` (see the module doc).

    Args:
        config: the model's config (its ``base_model_tp_plan``, head counts and sizes).
        norms: the layer's norms on the residual stream (sequence chunks under sequence parallelism).
    """
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    unsupported = {key: style for key, style in hf_plan.items() if style not in _HF_STYLES}
    if unsupported or not _LLAMA_LINEARS <= set(hf_plan):
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
        model=_LLAMA_MODEL,
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
        grouped_query="self_attn",
    )


def _moe_plan(*, head_norms: bool = False) -> TensorParallelPlan:
    """A mixture-of-experts family with Llama's attention and module names (the MoE block has no entry: replicated
    over tp; ``head_norms``: Qwen3-MoE's per-head q/k norms)."""
    norms = (("self_attn.q_norm", "head_shared"), ("self_attn.k_norm", "head_shared")) if head_norms else ()
    return TensorParallelPlan(
        layers="model.layers",
        layer=(*_LLAMA_ATTENTION, *norms),
        model=_LLAMA_MODEL,
        heads={},
        # the experts' sizes are not split by tp (the block is replicated over tp)
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads},
        grouped_query="self_attn",
        replicated=("mlp",),
    )


def _albert_plan(config: Any) -> TensorParallelPlan:
    """ALBERT: its layer group split once for every layer that runs it (the shared weights are cut once; each run's
    partial sums complete in the run). ``AlbertAttention`` adds its residual and norm inside the module, so the region
    is entered at each projection (query, key and value: three all-reduces backward where BERT has one) and the
    module only draws its attention dropout from the rank's stream. It also reshapes the projections by its input's
    length, so its layers cannot run on sequence chunks: sequence parallelism is refused."""
    layer: list[tuple[str, str]] = []
    for inner in range(config.inner_group_num):
        at = f"albert_layers.{inner}"
        for projection in ("query", "key", "value"):
            layer += [(f"{at}.attention.{projection}", "column"), (f"{at}.attention.{projection}", "region")]
        layer += [
            (f"{at}.attention", "heads_dropout"),
            (f"{at}.attention.dense", "row"),
            (f"{at}.attention.output_dropout", "sequence_dropout"),
            (f"{at}.ffn", "column"),
            (f"{at}.ffn", "region"),
            (f"{at}.ffn_output", "row"),
        ]
    return TensorParallelPlan(
        layers="albert.encoder.albert_layer_groups",
        layer=tuple(layer),
        model=(("albert.embeddings.word_embeddings", "vocab"),),
        sizes=lambda c: {
            "num_attention_heads": c.num_attention_heads,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
        },
        sequence_refusal="its attention reshapes the projections by its input's length, which a sequence chunk "
        "would not have",
    )


def _encoder_plan(base: str) -> TensorParallelPlan:
    """BERT's layers under another base model (RoBERTa, XLM-R, ELECTRA)."""
    return TensorParallelPlan(
        layers=f"{base}.encoder.layer",
        layer=(
            ("attention.self", "region"),
            ("attention.self.query", "column"),
            ("attention.self.key", "column"),
            ("attention.self.value", "column"),
            ("attention.output.dense", "row"),
            ("attention.output.dropout", "sequence_dropout"),
            ("attention.output.LayerNorm", "sequence"),
            ("intermediate", "region"),
            ("intermediate.dense", "column"),
            ("output.dense", "row"),
            ("output.dropout", "sequence_dropout"),
            ("output.LayerNorm", "sequence"),
        ),
        model=(
            (f"{base}.embeddings.word_embeddings", "vocab"),
            (f"{base}.encoder.layer.0", "scatter"),
            (f"{base}.encoder", "gather"),
        ),
        heads={"attention.self": ("num_attention_heads", "all_head_size")},
        sizes=lambda c: {
            "num_attention_heads": c.num_attention_heads,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
        },
    )


_GPT2_PLAN = TensorParallelPlan(
    layers="transformer.h",
    layer=(
        ("ln_1", "sequence"),
        ("attn", "region"),
        ("attn.c_attn", "column_qkv"),
        ("attn.c_proj", "row"),
        ("attn.resid_dropout", "sequence_dropout"),
        ("ln_2", "sequence"),
        ("mlp", "region"),
        ("mlp.c_fc", "column"),
        ("mlp.c_proj", "row"),
        ("mlp.dropout", "sequence_dropout"),
    ),
    model=(
        ("transformer.wte", "vocab"),
        ("transformer.h.0", "scatter"),
        ("transformer.ln_f", "sequence"),
        ("transformer.ln_f", "gather"),
    ),
    heads={"attn": ("num_heads", "embed_dim", "split_size")},
    sizes=lambda c: {"n_head": c.n_head, "n_embd": c.n_embd, "n_inner": c.n_inner or 4 * c.n_embd},
)

# GPT-NeoX's fused query_key_value is laid out per head ([h, 3, d]): a plain column split keeps whole heads.
_GPT_NEOX_PLAN = TensorParallelPlan(
    layers="gpt_neox.layers",
    layer=(
        ("input_layernorm", "sequence"),
        ("post_attention_layernorm", "sequence"),
        ("attention", "region"),
        ("attention.query_key_value", "column"),
        ("attention.dense", "row"),
        ("post_attention_dropout", "sequence_dropout"),
        ("mlp", "region"),
        ("mlp.dense_h_to_4h", "column"),
        ("mlp.dense_4h_to_h", "row"),
        ("post_mlp_dropout", "sequence_dropout"),
    ),
    model=(
        ("gpt_neox.embed_in", "vocab"),
        ("gpt_neox.layers.0", "scatter"),
        ("gpt_neox.final_layer_norm", "sequence"),
        ("gpt_neox.final_layer_norm", "gather"),
    ),
    sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
)

_DISTILBERT_PLAN = TensorParallelPlan(
    layers="distilbert.transformer.layer",
    layer=(
        ("attention", "region"),
        ("attention.q_lin", "column"),
        ("attention.k_lin", "column"),
        ("attention.v_lin", "column"),
        ("attention.out_lin", "row"),
        ("sa_layer_norm", "sequence"),
        ("ffn", "region"),
        ("ffn.lin1", "column"),
        ("ffn.lin2", "row"),
        ("ffn.dropout", "sequence_dropout"),
        ("output_layer_norm", "sequence"),
    ),
    model=(
        ("distilbert.embeddings.word_embeddings", "vocab"),
        ("distilbert.transformer.layer.0", "scatter"),
        ("distilbert.transformer", "gather"),
    ),
    sizes=lambda c: {"n_heads": c.n_heads, "dim": c.dim, "hidden_dim": c.hidden_dim},
)


# OLMo-2: no input norm, norms after attention and MLP, and q/k norms over every head at once (transformers' plan
# gathers q and k for them: colwise_gather_output); hftrain splits those norms with their projections instead.
_OLMO2_PLAN = TensorParallelPlan(
    layers="model.layers",
    layer=(
        ("self_attn", "region"),
        ("self_attn.q_proj", "column"),
        ("self_attn.k_proj", "column_kv"),
        ("self_attn.v_proj", "column_kv"),
        ("self_attn.q_norm", "width_norm"),
        ("self_attn.k_norm", "width_norm_kv"),
        ("self_attn.o_proj", "row"),
        ("post_attention_layernorm", "sequence"),
        ("mlp", "region"),
        ("mlp.gate_proj", "column"),
        ("mlp.up_proj", "column"),
        ("mlp.down_proj", "row"),
        ("post_feedforward_layernorm", "sequence"),
    ),
    model=_LLAMA_MODEL,
    sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
    grouped_query="self_attn",
)


# Phi-3: fused qkv_proj and gate_up_proj (transformers' plan gathers their outputs: colwise_gather_output); hftrain
# splits each part per head / feature, so no gather is needed, and tp divides the key/value heads (a replicated
# key/value head inside one fused matrix beside split query rows is not built).
_PHI3_PLAN = TensorParallelPlan(
    layers="model.layers",
    layer=(
        ("input_layernorm", "sequence"),
        ("self_attn", "region"),
        ("self_attn", "local_heads"),
        ("self_attn.qkv_proj", "column_fused_qkv"),
        ("self_attn.o_proj", "row"),
        ("resid_attn_dropout", "sequence_dropout"),
        ("post_attention_layernorm", "sequence"),
        ("mlp", "region"),
        ("mlp.gate_up_proj", "column_gate_up"),
        ("mlp.down_proj", "row"),
        ("resid_mlp_dropout", "sequence_dropout"),
    ),
    model=_LLAMA_MODEL,
    sizes=lambda c: {
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
    },
    grouped_query="self_attn",
)


# ModernBERT: fused Wqkv ([3, heads, head_dim] rows: q, k, v each split per head), fused GLU Wi ([input; gate]
# halves, each split), pre-norm layers (layer 0's attention norm is an identity), dropout after the attention's Wo.
_MODERNBERT_PLAN = TensorParallelPlan(
    layers="model.layers",
    layer=(
        ("attn_norm", "sequence"),
        ("attn", "region"),
        ("attn.Wqkv", "column_qkv"),
        ("attn.Wo", "row"),
        ("attn.out_drop", "sequence_dropout"),
        ("mlp_norm", "sequence"),
        ("mlp", "region"),
        ("mlp.Wi", "column_gate_up"),
        ("mlp.Wo", "row"),
    ),
    model=(
        ("model.embeddings.tok_embeddings", "vocab"),
        ("model.layers.0", "scatter"),
        ("model.final_norm", "sequence"),
        ("model.final_norm", "gather"),
    ),
    sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
)


# DeBERTa-v2/v3: BERT's layers with disentangled relative attention. The encoder's relative embeddings
# ``E = LayerNorm(rel_embeddings.weight)`` ([2k, hidden], k the position buckets) are computed once per forward and
# projected by every layer's (column-split) query/key projections per head: ``query_proj(E)``, ``key_proj(E)`` (or
# ``pos_query_proj``/``pos_key_proj`` when ``share_att_key`` is off). Each rank thus projects E onto its own heads
# only, and the gradient reaching ``rel_embeddings`` and the encoder's ``LayerNorm`` is this rank's heads' share:
# ``head_shared`` sums it over tp (complete_grads; E's path is linear in its gradient, the dropout on E drawing
# one mask for the tp group: ``replicated_dropout``). The relative positions and the mask are built by the encoder
# from the whole sequence before layer 0 (whose input alone is scattered under sequence parallelism), and each
# attention region gathers the sequence back, so every rank scores its heads over all query/key pairs. The model
# reads the encoder's last hidden state from its ``hidden_states`` tuple (not ``last_hidden_state``), so the last
# layer's output is gathered, not the encoder's.
def _deberta_v2_plan(config: Any) -> TensorParallelPlan:
    """DeBERTa-v2's plan for ``config`` (its relative-attention modules as the config builds them), or a one-line
    refusal (``AxisError``) for the convolution layer (``conv_kernel_size`` > 0)."""
    if getattr(config, "conv_kernel_size", 0) > 0:
        raise AxisError(
            "tp",
            f"tensor parallelism cannot split this DeBERTa-v2 model: its convolution after the first layer "
            f"(conv_kernel_size {config.conv_kernel_size}) is not in hftrain's plan; use tp 1 (strategy "
            "ddp/fsdp/zero*)",
        )
    relative = getattr(config, "relative_attention", False)
    pos_att_type = config.pos_att_type or []
    position: list[tuple[str, str]] = []  # the attention's relative-position modules, as the config builds them
    if relative and not getattr(config, "share_att_key", False):  # position projections of their own
        position += [("attention.self.pos_key_proj", "column")] if "c2p" in pos_att_type else []
        position += [("attention.self.pos_query_proj", "column")] if "p2c" in pos_att_type else []
    shared: list[tuple[str, str]] = []  # the encoder's relative embeddings, projected per head in every layer
    if relative:
        position.append(("attention.self.pos_dropout", "replicated_dropout"))
        shared.append(("deberta.encoder.rel_embeddings", "head_shared"))
        if "layer_norm" in [x.strip() for x in getattr(config, "norm_rel_ebd", "none").lower().split("|")]:
            shared.append(("deberta.encoder.LayerNorm", "head_shared"))
    return TensorParallelPlan(
        layers="deberta.encoder.layer",
        layer=(
            ("attention.self", "region"),
            ("attention.self.query_proj", "column"),
            ("attention.self.key_proj", "column"),
            ("attention.self.value_proj", "column"),
            *position,
            ("attention.output.dense", "row"),
            ("attention.output.dropout", "sequence_dropout"),
            ("attention.output.LayerNorm", "sequence"),
            ("intermediate", "region"),
            ("intermediate.dense", "column"),
            ("output.dense", "row"),
            ("output.dropout", "sequence_dropout"),
            ("output.LayerNorm", "sequence"),
        ),
        model=(
            ("deberta.embeddings.word_embeddings", "vocab"),
            *shared,
            ("deberta.encoder.layer.0", "scatter"),
            (f"deberta.encoder.layer.{config.num_hidden_layers - 1}", "gather"),
        ),
        heads={"attention.self": ("num_attention_heads", "all_head_size")},
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
    )


# ----------------------------------------------------------------------------- context parallelism's limits
def _gemma2_attention(config: Any) -> str | None:
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (
            f"its soft-capped attention logits (attn_logit_softcapping {config.attn_logit_softcapping}) are not in "
            "hftrain's context-parallel attention; use cp 1"
        )
    return None


# ----------------------------------------------------------------------------- the registry
_MOE_STAGES = {
    "cp": "its router loss needs every token's routing of the whole sequence, which a sequence shard does not "
    "see; use cp 1 (tp, pp, ep and dp split it)",
}

_LLAMA_STAGES = DecoderStages()
_LAST_TOKEN = LastTokenHead()  # the decoders' classifiers: score at the last non-pad token

FAMILIES: dict[str, Family] = {
    "bert": Family("BERT", tp=_encoder_plan("bert"), stages=EncoderStages("bert"), classifier=FirstTokenHead("bert")),
    # positions counted from the padding index over the whole sequence: every cp rank holds it (EncoderStages)
    "roberta": Family(
        "RoBERTa",
        tp=_encoder_plan("roberta"),
        stages=EncoderStages("roberta", pad_numbered=True),
        classifier=FirstTokenHead("roberta", "classification_head"),
    ),
    "xlm-roberta": Family(
        "XLM-RoBERTa",
        tp=_encoder_plan("roberta"),
        stages=EncoderStages("roberta", pad_numbered=True),
        classifier=FirstTokenHead("roberta", "classification_head"),
    ),
    "electra": Family(
        "ELECTRA",
        tp=_encoder_plan("electra"),
        stages=EncoderStages("electra"),
        classifier=FirstTokenHead("electra", "classification_head"),
    ),
    "distilbert": Family(
        "DistilBERT",
        tp=_DISTILBERT_PLAN,
        stages=EncoderStages("distilbert", layers="transformer.layer"),
        classifier=FirstTokenHead("distilbert", "pre_classifier"),
    ),
    "gpt2": Family("GPT-2", tp=_GPT2_PLAN, stages=GPT2Stages(), classifier=_LAST_TOKEN),
    "gpt_neox": Family(
        "GPT-NeoX",
        tp=_GPT_NEOX_PLAN,
        stages=DecoderStages(
            base="gpt_neox",
            embed="embed_in",
            norm="final_layer_norm",
            dropout="emb_dropout",
            cache_argument="layer_past",
        ),
        classifier=_LAST_TOKEN,
    ),
    "llama": Family("Llama", tp=derived_plan, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "mistral": Family("Mistral", tp=derived_plan, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "qwen2": Family("Qwen2", tp=derived_plan, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "qwen3": Family("Qwen3", tp=derived_plan, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "gemma": Family("Gemma", tp=derived_plan, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "gemma2": Family(
        "Gemma-2",
        tp=lambda c: derived_plan(c, norms=_GEMMA2_NORMS),
        stages=_LLAMA_STAGES,
        classifier=_LAST_TOKEN,
        cp_refusal=_gemma2_attention,
        gated_mlp=True,
    ),
    "gemma3_text": Family(
        "Gemma-3 (text)",
        tp=lambda c: derived_plan(c, norms=_GEMMA2_NORMS),
        stages=_LLAMA_STAGES,
        classifier=_LAST_TOKEN,
        gated_mlp=True,
    ),
    "phi3": Family("Phi-3", tp=_PHI3_PLAN, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "olmo2": Family("OLMo-2", tp=_OLMO2_PLAN, stages=_LLAMA_STAGES, classifier=_LAST_TOKEN, gated_mlp=True),
    "mixtral": Family(
        "Mixtral",
        tp=_moe_plan(),
        stages=_LLAMA_STAGES,
        classifier=_LAST_TOKEN,
        experts=ExpertPlan(num_experts="num_local_experts"),
        refusals=_MOE_STAGES,
        gated_mlp=True,
    ),
    "qwen2_moe": Family(
        "Qwen2-MoE",
        tp=_moe_plan(),
        stages=_LLAMA_STAGES,
        classifier=_LAST_TOKEN,
        experts=ExpertPlan(num_experts="num_experts"),  # its shared expert stays replicated, as the router
        refusals=_MOE_STAGES,
        gated_mlp=True,
    ),
    "qwen3_moe": Family(
        "Qwen3-MoE",
        tp=_moe_plan(head_norms=True),
        stages=_LLAMA_STAGES,
        classifier=_LAST_TOKEN,
        experts=ExpertPlan(num_experts="num_experts"),
        refusals=_MOE_STAGES,
        gated_mlp=True,
    ),
    # every layer runs one shared group: tp splits it once, each pipeline rank holds a copy (AlbertStages)
    "albert": Family(
        "ALBERT",
        tp=_albert_plan,
        stages=AlbertStages(),
        classifier=FirstTokenHead("albert", "albert_pooler"),
        refusals={
            "cp": "its layers are one module run num_hidden_layers times, and context parallelism gathers a "
            "classifier's hidden states after the trunk's last layer, which that module's every run would be; use "
            "cp 1 (tp and pp split it)",
        },
    ),
    "deberta-v2": Family(
        "DeBERTa-v2",
        tp=_deberta_v2_plan,
        stages=DebertaStages(),
        classifier=DebertaHead(),
        refusals={
            "cp": "its disentangled relative attention reads every key's relative position to every query (c2p and "
            "p2c scores gathered over the whole sequence), which a sequence shard cannot split exactly; use cp 1 "
            "(tp splits it)",
        },
    ),
    "modernbert": Family(
        "ModernBERT",
        tp=_MODERNBERT_PLAN,
        stages=ModernBertStages(),
        classifier=ModernBertHead(),
        refusals={
            "cp": "its local attention layers (a bidirectional sliding window of local_attention tokens) are not "
            "among the masks hftrain's context-parallel attention builds; use cp 1 (tp and pp split it)"
        },
        gated_mlp=True,
    ),
}


def family_of(config: Any) -> Family | None:
    """The registry entry of a model's family: by ``model_type``, else found by architecture (a config whose
    transformers tp plan names exactly Llama's modules, e.g. a family added to transformers later); None when
    neither.

    Args:
        config: the model's ``transformers.PretrainedConfig``.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    if set(hf_plan) == _LLAMA_LINEARS and set(hf_plan.values()) <= {"colwise", "rowwise"}:
        return Family(
            f"{model_type} (Llama architecture)",
            tp=derived_plan,
            stages=_LLAMA_STAGES,
            classifier=_LAST_TOKEN,
            gated_mlp=True,
        )
    return None


def _supported(axis: str) -> str:
    if axis == "tp":
        return ", ".join(f.name for f in FAMILIES.values() if f.tp is not None)
    return ", ".join(f.name for f in FAMILIES.values() if f.stages is not None)


def _refusal(config: Any, axis: str, family: Family | None) -> str:
    model_type = getattr(config, "model_type", None)
    if family is not None and axis in family.refusals:
        return f"{AXIS_NAMES[axis]} cannot split this {family.name} model: {family.refusals[axis]}"
    return (
        f"{AXIS_NAMES[axis]} has no entry for model type {model_type!r} (supported: {_supported(axis)}); "
        f"use {axis} 1 (strategy ddp/fsdp/zero* for this model)"
    )


def plan_for(config: Any) -> TensorParallelPlan:
    """The tensor-parallel plan of a model's family, or a one-line refusal naming why (and the families that have one).

    Args:
        config: the model's ``transformers.PretrainedConfig``.
    """
    family = family_of(config)
    plan = family.tp_plan(config) if family is not None and family.tp is not None else None
    if plan is None:
        raise AxisError("tp", _refusal(config, "tp", family))
    return plan


def has_tp_plan(config: Any) -> bool:
    """Whether tensor parallelism can split the model (its family has a plan for it)."""
    try:
        plan_for(config)
    except ConfigError:
        return False
    return True


def stages_for(config: Any, *, class_name: str | None = None, axis: str = "pp") -> Any:
    """The trunk adapter of a model's family, checked (:func:`check_family`).

    Args:
        config: the model's config.
        class_name: the model's class, when there is one.
        axis: ``"pp"`` or ``"cp"``.
    """
    check_family(config, class_name=class_name, axis=axis)
    family = family_of(config)
    assert family is not None
    return family.stages


def is_causal_lm_class(class_name: str) -> bool:
    """Whether an HF class name is a causal language model's (``*ForCausalLM``; GPT-2's ``GPT2LMHeadModel``)."""
    return class_name.endswith(("ForCausalLM", "LMHeadModel"))


def classifier_for(config: Any) -> Any:
    """The family's ``*ForSequenceClassification`` head (a ``StageHead``), or None."""
    family = family_of(config)
    return None if family is None else family.classifier


def stages_of(model: Any, head: Any = None) -> Any:
    """The pipeline adapter of ``model`` (:class:`~hftrain.parallel.stages.ModelStages`): its family's trunk with its
    task's head.

    Args:
        model: the model.
        head: the task's own :class:`~hftrain.parallel.stages.StageHead` (the Trainer's ``stage_head``); None: the
            one the model's class implies, a decoder's ``*ForCausalLM``'s :class:`~hftrain.parallel.stages.CausalLMHead`
            or a ``*ForSequenceClassification``'s family classifier (``AxisError`` (pp) for another class).
    """
    from hftrain.parallel.stages import CausalLMHead, ModelStages

    name, config = type(model).__name__, getattr(model, "config", None)
    trunk = stages_for(config, class_name=None if head is not None else name)
    if head is None:
        head = CausalLMHead(config) if is_causal_lm_class(name) else classifier_for(config)
    return ModelStages(trunk, head)


def check_family(config: Any, *, class_name: str | None = None, axis: str = "pp") -> None:
    """Refuse a model ``axis`` cannot split (before any model is built, from its config), in one line naming why.

    Args:
        config: the model's ``transformers`` config.
        class_name: the model's class, when there is one (a ``*ForSequenceClassification``, or a decoder's
            ``*ForCausalLM``).
        axis: ``"pp"`` or ``"cp"``.
    """
    family = family_of(config)
    if family is None or family.stages is None or axis in family.refusals:
        raise AxisError(axis, _refusal(config, axis, family))
    lm = class_name is not None and is_causal_lm_class(class_name)
    if lm and axis == "pp" and family.experts is not None:
        raise AxisError(
            axis,
            f"{AXIS_NAMES[axis]} splits {family.name} classifiers, not its causal LM (its router loss is not built "
            "into the language model's pipeline loss yet); use pp 1 (tp, ep and dp split it)",
        )
    if lm and axis == "pp" and not getattr(family.stages, "causal", False):  # cp runs the model's own forward
        raise AxisError(
            axis, f"{AXIS_NAMES[axis]} splits decoder causal LMs, not a {family.name} {class_name}; use {axis} 1"
        )
    if class_name is not None and not lm and not class_name.endswith("ForSequenceClassification"):
        raise AxisError(
            axis,
            f"{AXIS_NAMES[axis]} splits *ForSequenceClassification and decoder *ForCausalLM models, got {class_name}; "
            f"use {axis} 1",
        )
    refusal = getattr(family.stages, "refusal", None)  # what a config of the family cannot cut into chunks
    reason = None if refusal is None else refusal(config)
    if reason is not None:
        raise AxisError(axis, f"{AXIS_NAMES[axis]} cannot split this {family.name} model: {reason}")
    if axis == "cp":
        reason = family.cp_refusal(config)
        if reason is not None:
            raise AxisError("cp", f"context parallelism cannot split this {family.name} model exactly: {reason}")


def expert_plan_for(config: Any) -> ExpertPlan | None:
    """The family's expert plan, or None for a dense model."""
    family = family_of(config)
    return None if family is None else family.experts


def is_moe(config: Any) -> bool:
    """Whether the model is a mixture of experts hftrain can route (a family with an expert plan)."""
    return expert_plan_for(config) is not None


def moe_families() -> list[str]:
    """The model types hftrain routes experts for."""
    return sorted(t for t, f in FAMILIES.items() if f.experts is not None)


def is_gated_mlp(config: Any) -> bool:
    """Whether the family's MLP is gated (three matrices; the planner's FLOPs and sizes)."""
    family = family_of(config)
    return family is not None and family.gated_mlp


def _kv_heads(plan: TensorParallelPlan, config: Any) -> dict[str, int]:
    return {"num_key_value_heads": config.num_key_value_heads} if plan.grouped_query else {}


def _valid_tp(sizes: dict[str, int], kv_heads: dict[str, int]) -> list[int]:
    return [
        d
        for d in range(1, min(sizes.values()) + 1)
        if all(v % d == 0 for v in sizes.values()) and all(kv_heads_split(v, d) for v in kv_heads.values())
    ]


def check_tensor_parallel(config: Any, tp: int, *, sequence_parallel: bool = False) -> None:
    """Refuse a model that ``tp`` cannot split, naming the size and the valid tp values (no processes needed), and
    sequence parallelism (tp > 1) for a family with blocks replicated over tp (mixture of experts) or layers that
    cannot run on sequence chunks (the plan's ``sequence_refusal``: ALBERT's).

    Args:
        config: the model's ``transformers.PretrainedConfig``.
        tp: the tensor-parallel size.
        sequence_parallel: whether sequence parallelism is asked for.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise AxisError("tp", f"tp must be a positive integer, got {tp!r}")
    if tp == 1 and not has_tp_plan(config):
        return  # nothing to split: the family runs whole on each rank (under pp, cp or dp)
    plan = plan_for(config)
    if sequence_parallel and tp > 1 and plan.replicated:
        raise AxisError(
            "sequence_parallel",
            f"sequence parallelism is not supported for this {config.model_type} model: its mixture-of-experts "
            f"blocks ({', '.join(plan.replicated)}) run whole on every tp rank and need the full sequence, which "
            "sequence parallelism cuts into tp chunks; use sequence_parallel: false (tp still splits the attention)",
        )
    if sequence_parallel and tp > 1 and plan.sequence_refusal:
        raise AxisError(
            "sequence_parallel",
            f"sequence parallelism is not supported for this {config.model_type} model: {plan.sequence_refusal}; "
            "use sequence_parallel: false (tp still splits its layers)",
        )
    sizes, kv_heads = plan.sizes(config), _kv_heads(plan, config)
    indivisible = ", ".join(f"{name}={value}" for name, value in sizes.items() if value % tp)
    unsplittable = ", ".join(f"{name}={value}" for name, value in kv_heads.items() if not kv_heads_split(value, tp))
    problems = [f"does not divide {indivisible}"] if indivisible else []
    if unsplittable:
        problems.append(f"neither divides nor is a multiple of {unsplittable} (split evenly or replicated)")
    if problems:
        raise AxisError(
            "tp",
            f"tp={tp} {' and '.join(problems)} of this {config.model_type} model; "
            f"valid tp values for it: {', '.join(map(str, _valid_tp(sizes, kv_heads)))}",
        )


def takes_sequence_parallel(config: Any) -> bool:
    """Whether tensor parallelism may also cut the sequence for this model (its family has a plan with no replicated
    blocks and no ``sequence_refusal``)."""
    if not has_tp_plan(config):
        return False
    plan = plan_for(config)
    return not plan.replicated and plan.sequence_refusal is None


def trainable_axes(config: Any, class_name: str | None = None) -> frozenset[str]:
    """The model-parallel axes the trainer takes for ``config``, each checked as the trainer checks it (the planner
    asks here, so it never offers a layout ``train`` refuses).

    Args:
        config: the model's ``transformers`` config.
        class_name: the model class (e.g. a ``*ForCausalLM``), whose own limits count too.
    """
    from hftrain.errors import ConfigError

    checks = (
        ("tp", plan_for),
        ("pp", lambda c: check_family(c, class_name=class_name)),
        ("cp", lambda c: check_family(c, class_name=class_name, axis="cp")),
    )
    axes = set()
    for axis, check in checks:
        try:
            check(config)
        except ConfigError:
            continue
        axes.add(axis)
    if expert_plan_for(config) is not None:
        axes.add("ep")
    return frozenset(axes)
