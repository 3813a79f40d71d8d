"""OLMo-2: Llama's trunk, norms after attention and MLP, q/k norms over every head split with their projections."""

from __future__ import annotations

from hftrain.parallel.families.family import Family
from hftrain.parallel.families.llama import DECODER, LLAMA_MODEL
from hftrain.parallel.plans import TensorParallelPlan

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
    model=LLAMA_MODEL,
    sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
    grouped_query="self_attn",
)

FAMILIES: dict[str, Family] = {"olmo2": Family("OLMo-2", tp=_OLMO2_PLAN, **DECODER)}
