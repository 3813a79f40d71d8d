"""Gemma-2 and Gemma-3 (text): Llama's trunk with norms before and after the feed-forward; Gemma-2's soft-capped
attention logits are refused by context parallelism."""

from __future__ import annotations

from typing import Any

from hftrain.parallel.families.family import Family
from hftrain.parallel.families.llama import DECODER, LLAMA_NORMS, derived_plan

GEMMA2_NORMS = (*LLAMA_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _gemma2_attention(config: Any) -> str | None:
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (
            f"its soft-capped attention logits (attn_logit_softcapping {config.attn_logit_softcapping}) are not in "
            "hftrain's context-parallel attention; use cp 1"
        )
    return None


FAMILIES: dict[str, Family] = {
    "gemma2": Family(
        "Gemma-2",
        tp=lambda c: derived_plan(c, norms=GEMMA2_NORMS),
        config_refusals={"cp": _gemma2_attention},
        **DECODER,
    ),
    "gemma3_text": Family("Gemma-3 (text)", tp=lambda c: derived_plan(c, norms=GEMMA2_NORMS), **DECODER),
}
