"""GPT-NeoX: fused ``query_key_value`` laid out per head, Llama's rotary trunk under other names."""

from __future__ import annotations

from hftrain.parallel.families.family import Family
from hftrain.parallel.families.llama import DecoderStages
from hftrain.parallel.heads import LastTokenHead
from hftrain.parallel.plans import TensorParallelPlan

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

FAMILIES: dict[str, Family] = {
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
        classifier=LastTokenHead(),
    ),
}
