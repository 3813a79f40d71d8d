"""ModernBERT: fused Wqkv and GLU Wi split part by part, local and global layers, its own prediction head."""

from __future__ import annotations

from typing import Any

import torch

from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import (
    SequenceClassificationHead,
    TokenClassificationHead,
    first_token_one_hot,
    identity,
)
from hftrain.parallel.plans import TensorParallelPlan
from hftrain.parallel.stages import FULL, SLIDING, Modules, positions_of


class ModernBertStages:
    """ModernBERT's trunk: embeddings (token embedding → norm → dropout) → ``layers[i]`` with the mask and rotary
    embedding of its layer type (global: full bidirectional attention; local: a bidirectional sliding window, its own
    rotary base) → the final norm. Its classification head is :class:`ModernBertHead`.

    Under context parallelism the local layers' window is the attention's ``sliding_window`` (transformers passes
    ``config.sliding_window + 1``, ``sliding_window = local_attention // 2``): a key is seen where
    ``|p_q − p_k| < sliding_window`` (``hftrain.parallel.cp_kernels._mask``), as its bidirectional sliding mask.
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

        positions = positions_of(hidden, positions)
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
        reduce = reduce or identity
        token = reduce((hidden * pool.unsqueeze(-1)).sum(1)) / reduce(pool.sum(1, keepdim=True))
        return self.classify(mods, token)

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """The prediction head, dropout and classifier on the pooled token ``[b, hidden]``."""
        return mods["classifier"](mods["drop"](mods["head"](token)))


class ModernBertTokenHead(TokenClassificationHead):
    """ModernBERT's ``*ForTokenClassification``: ``head`` (dense → activation → norm) → dropout → classifier on every
    position, as ``ModernBertForTokenClassification``."""

    def modules(self, model: torch.nn.Module) -> Modules:
        """The prediction head, dropout and classifier."""
        return {"head": model.head, "drop": model.drop, "classifier": model.classifier}

    def forward(self, mods: Any, hidden: torch.Tensor, trunk_input: torch.Tensor, *carried: Any, reduce=None):
        """Logits ``[b, s, num_labels]``."""
        return mods["classifier"](mods["drop"](mods["head"](hidden)))


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


FAMILIES: dict[str, Family] = {
    "modernbert": Family(
        "ModernBERT",
        tp=_MODERNBERT_PLAN,
        stages=ModernBertStages(),
        classifier=ModernBertHead(),
        token_classifier=ModernBertTokenHead(),
        gated_mlp=True,
    ),
}
