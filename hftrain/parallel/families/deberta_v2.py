"""DeBERTa-v2/v3: disentangled relative attention, its relative embeddings read by every layer; its context pooler.

Context parallelism splits the attention by heads over the whole sequence, with ``cp_comm: all_to_all`` only
(``hftrain.parallel.cp_relative``: the c2p and p2c scores need each query's and key's contents beside their relative
position, which the ring's fused block kernel cannot take)."""

from __future__ import annotations

from typing import Any

import torch

from hftrain.errors import AxisError
from hftrain.parallel.cp_relative import apply_relative_context_parallel
from hftrain.parallel.families.bert import ENCODER_LAYER_OUTPUTS, EncoderStages
from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import SequenceClassificationHead
from hftrain.parallel.plans import TensorParallelPlan
from hftrain.parallel.stages import Modules, positions_of


class _RelativeState(torch.nn.Module):
    """A DeBERTa-v2 encoder's relative-position state, which every layer (so every pipeline chunk) reads: its
    relative embeddings and their LayerNorm (the encoder's own modules: parameters every chunk shares), and the
    sizes its ``get_rel_embedding`` / ``get_rel_pos`` read. Those two are transformers' methods, run on this object."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder_class = type(encoder)
        self.relative_attention = encoder.relative_attention
        self.norm_rel_ebd = encoder.norm_rel_ebd
        for name in ("rel_embeddings", "LayerNorm", "max_relative_positions", "position_buckets"):
            if hasattr(encoder, name):
                setattr(self, name, getattr(encoder, name))

    def get_rel_embedding(self) -> torch.Tensor | None:
        """The (normed) relative embeddings, as the encoder computes them once per forward."""
        return self.encoder_class.get_rel_embedding(self)

    def get_rel_pos(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The bucketed relative positions of the sequence, as the encoder builds them."""
        return self.encoder_class.get_rel_pos(self, hidden)


class DebertaStages(EncoderStages):
    """DeBERTa-v2/v3's trunk: embeddings (padding zeroed by the mask, as ``DebertaV2Embeddings`` does) → ``layer[i]``
    with the encoder's relative positions and relative embeddings. Its classification head is :class:`DebertaHead`.

    The relative embeddings (and their LayerNorm) are read by every layer: each chunk holds them (``aux_modules``:
    parameters on every pipeline rank, their gradient summed over the pipeline group, the first stage's copy the one
    checkpointed and exported) and computes them, the relative positions and the pairwise mask once per chunk, as
    the encoder does once per forward. The convolution after the first layer (``conv_kernel_size > 0``) is refused.
    BERT's layout otherwise (:class:`EncoderStages`: layers, embedding modules). Under cp every layer's attention
    runs split by heads (:meth:`context_parallel_attention`; ``cp_comm_only``: the all-to-all).
    """

    cp_comm_only = (
        "all_to_all",
        "its disentangled attention adds c2p and p2c scores (each query's and key's contents against their relative "
        "position's embedding), which the ring's fused block kernel cannot take",
    )
    """Context parallelism splits its attention by heads only (``hftrain.parallel.cp_relative``)."""

    def __init__(self) -> None:
        super().__init__("deberta")

    def refusal(self, config: Any) -> str | None:
        """Why a config cannot be cut into stages or sequence shards (its convolution layer), else None."""
        if getattr(config, "conv_kernel_size", 0) > 0:
            return (
                f"its convolution after the first layer (conv_kernel_size {config.conv_kernel_size}) is not in "
                "hftrain's stages nor in its sequence split; use pp 1 and cp 1"
            )
        return None

    def context_parallel_attention(self, model: torch.nn.Module, batch: Any) -> None:
        """Split every layer's ``DisentangledSelfAttention`` over the cp ranks by heads, exactly
        (``hftrain.parallel.cp_relative``: two all-to-alls per layer forward).

        Args:
            model: the transformers model (``*ForSequenceClassification``, possibly tensor-parallel already).
            batch: its per-forward cp state (``hftrain.parallel.context_parallel._Batch``).
        """
        apply_relative_context_parallel([layer.attention.self for layer in self.layers(model)], batch)

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The encoder's relative-position state (see the class doc)."""
        return {"relative": _RelativeState(model.deberta.encoder)}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token ids to the hidden states (padding zeroed by the mask)."""
        kwargs = {} if positions is None else {"position_ids": positions_of(input_ids, positions)}
        return mods["embeddings"](input_ids=input_ids, token_type_ids=token_type_ids, mask=attention_mask, **kwargs)

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The pairwise mask ``m_i · m_j``, the relative positions and embeddings, once per chunk (the encoder's)."""
        pairwise = mask.unsqueeze(1).unsqueeze(2)
        relative = aux["relative"]
        return {
            "mask": pairwise * pairwise.squeeze(-2).unsqueeze(-1),
            "positions": relative.get_rel_pos(hidden),
            "embeddings": relative.get_rel_embedding(),
        }

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One encoder layer."""
        output, _ = layer(
            hidden, context["mask"], relative_pos=context["positions"], rel_embeddings=context["embeddings"]
        )
        return output


class DebertaHead(SequenceClassificationHead):
    """DeBERTa-v2/v3: ``ContextPooler`` on the first token → dropout → classifier."""

    def modules(self, model: torch.nn.Module) -> Modules:
        """The context pooler, dropout and classifier."""
        return {"pooler": model.pooler, "dropout": model.dropout, "classifier": model.classifier}

    def classify(self, mods: Any, token: torch.Tensor) -> torch.Tensor:
        """``ContextPooler`` (it takes the first token itself) → dropout → classifier."""
        return mods["classifier"](mods["dropout"](mods["pooler"](token.unsqueeze(1))))


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
            *ENCODER_LAYER_OUTPUTS,
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


FAMILIES: dict[str, Family] = {
    "deberta-v2": Family(
        "DeBERTa-v2",
        tp=_deberta_v2_plan,
        stages=DebertaStages(),
        classifier=DebertaHead(),
    ),
}
