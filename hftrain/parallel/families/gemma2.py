"""Gemma-2 and Gemma-3 (text): Llama's trunk with norms before and after the feed-forward; Gemma-2's soft-capped
attention logits (``c · tanh(S / c)``) run under context parallelism through its score-modified kernels
(``hftrain.parallel.cp_scored``)."""

from __future__ import annotations

from typing import Any

from hftrain.parallel.families.family import Family
from hftrain.parallel.families.llama import DECODER, LLAMA_NORMS, derived_plan

GEMMA2_NORMS = (*LLAMA_NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _gemma2_attention(config: Any) -> str | None:
    """Why cp cannot split this Gemma-2 config exactly, else None: soft-capping and its causal sliding windows go
    through cp's score-modified kernels (``hftrain.parallel.cp_scored``); its bidirectional variant
    (``use_bidirectional_attention``: transformers then builds its sliding layers' masks another way) is not checked."""
    if getattr(config, "use_bidirectional_attention", None):
        return (
            "its bidirectional attention (use_bidirectional_attention) is not among the masks hftrain's "
            "context-parallel attention is checked against; use cp 1"
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
