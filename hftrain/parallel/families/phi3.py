"""Phi-3: Llama's trunk with fused ``qkv_proj`` and ``gate_up_proj``, split part by part."""

from __future__ import annotations

from hftrain.parallel.families.family import Family
from hftrain.parallel.families.llama import DECODER, LLAMA_MODEL
from hftrain.parallel.plans import TensorParallelPlan

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
    model=LLAMA_MODEL,
    sizes=lambda c: {
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "intermediate_size": c.intermediate_size,
    },
    grouped_query="self_attn",
)

FAMILIES: dict[str, Family] = {"phi3": Family("Phi-3", tp=_PHI3_PLAN, **DECODER)}
