"""The mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's attention split over tp, the MoE blocks
replicated over tp and their experts split over ep (the expert plan); under context parallelism the routers see this
rank's positions and the router loss's sums are all-reduced over dp × cp (``hftrain.parallel.ep_routing``)."""

from __future__ import annotations

from hftrain.parallel.families.family import Family
from hftrain.parallel.families.llama import DECODER, LLAMA_ATTENTION, LLAMA_MODEL
from hftrain.parallel.plans import ExpertPlan, TensorParallelPlan


def _moe_plan(*, head_norms: bool = False) -> TensorParallelPlan:
    """A mixture-of-experts family with Llama's attention and module names (the MoE block has no entry: replicated
    over tp; ``head_norms``: Qwen3-MoE's per-head q/k norms)."""
    norms = (("self_attn.q_norm", "head_shared"), ("self_attn.k_norm", "head_shared")) if head_norms else ()
    return TensorParallelPlan(
        layers="model.layers",
        layer=(*LLAMA_ATTENTION, *norms),
        model=LLAMA_MODEL,
        heads={},
        # the experts' sizes are not split by tp (the block is replicated over tp)
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads},
        grouped_query="self_attn",
        replicated=("mlp",),
    )


FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        "Mixtral",
        tp=_moe_plan(),
        experts=ExpertPlan(num_experts="num_local_experts"),
        **DECODER,
    ),
    # its shared expert stays replicated, as the router
    "qwen2_moe": Family("Qwen2-MoE", tp=_moe_plan(), experts=ExpertPlan(num_experts="num_experts"), **DECODER),
    "qwen3_moe": Family(
        "Qwen3-MoE",
        tp=_moe_plan(head_norms=True),
        experts=ExpertPlan(num_experts="num_experts"),
        **DECODER,
    ),
}
