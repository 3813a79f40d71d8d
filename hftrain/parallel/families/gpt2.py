"""GPT-2: fused ``c_attn`` split per head, learned positions; its classifier scores the last non-pad token."""

from __future__ import annotations

from typing import Any

import torch

from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import LastTokenHead
from hftrain.parallel.plans import TensorParallelPlan
from hftrain.parallel.stages import CausalTrunk, Modules, positions_of


class GPT2Stages(CausalTrunk):
    """GPT-2's trunk: ``wte + wpe`` → dropout → ``transformer.h[i]`` → ``ln_f`` (classifier: ``LastTokenHead``)."""

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
        hidden = inputs_embeds + mods["wpe"](positions_of(inputs_embeds, positions))
        if token_type_ids is not None:
            hidden = hidden + mods["wte"](token_type_ids)
        return mods["drop"](hidden)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """Causal mask and positions, once per chunk."""
        from transformers.masking_utils import create_causal_mask

        positions = positions_of(hidden, positions)
        causal = create_causal_mask(
            config=config, inputs_embeds=hidden, attention_mask=mask, past_key_values=None, position_ids=positions
        )
        return {"mask": causal, "positions": positions}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One ``GPT2Block`` (no cache)."""
        return layer(hidden, None, context["mask"], position_ids=context["positions"], use_cache=False)


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

FAMILIES: dict[str, Family] = {"gpt2": Family("GPT-2", tp=_GPT2_PLAN, stages=GPT2Stages(), classifier=LastTokenHead())}
