"""ALBERT: one shared layer group run for every layer: tp splits it once, each pipeline rank holds a copy."""

from __future__ import annotations

from typing import Any

import torch

from hftrain.parallel.families.bert import EncoderStages
from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import FirstTokenHead
from hftrain.parallel.plans import TensorParallelPlan
from hftrain.parallel.stages import Modules


class AlbertStages(EncoderStages):
    """ALBERT's trunk: its factorised embedding (``embedding_size`` wide) → the encoder's
    ``embedding_hidden_mapping_in`` (to ``hidden_size``) → the layer group run ``num_hidden_layers`` times, as
    ``AlbertTransformer`` runs it: layer ``i`` is group ``⌊i / (L / G)⌋``, so with one group (every released ALBERT)
    every layer is the same module.

    The layers are that module repeated, so the chunks of every pipeline rank hold the group's weights: a copy on
    each rank, from the same initial values, its gradient summed over the pipeline group and the first stage's copy
    the one checkpointed and exported (``hftrain.parallel.pipeline.place_stage_copies`` records it, as it records
    DeBERTa's relative embeddings). Several groups (G > 1) are refused: a group would be held by some pipeline ranks
    only. Its classification head is ``FirstTokenHead``'s ``albert_pooler``. Context parallelism gathers a
    classifier's hidden states after the encoder (:meth:`output_module`), once per forward.
    """

    def __init__(self) -> None:
        super().__init__("albert")

    def refusal(self, config: Any) -> str | None:
        """Why a config cannot be cut into stages (several layer groups), else None."""
        if getattr(config, "num_hidden_groups", 1) != 1:
            return (
                f"its {config.num_hidden_groups} layer groups would each be held by some pipeline ranks only; hftrain "
                "cuts ALBERT models with one group (num_hidden_groups 1, as every released ALBERT); use pp 1"
            )
        return None

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The layer group each of the ``num_hidden_layers`` layers runs, in order (the same module, repeated)."""
        config, groups = model.config, model.albert.encoder.albert_layer_groups
        count, group_count = config.num_hidden_layers, config.num_hidden_groups
        return torch.nn.ModuleList([groups[int(i / (count / group_count))] for i in range(count)])

    def output_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose output is the trunk's (``AlbertTransformer``, run once per forward): context parallelism
        gathers a classifier's hidden states after it, not after the shared layer group, which runs every layer."""
        return model.albert.encoder

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """The embeddings and the projection to the hidden size."""
        return {"embeddings": model.albert.embeddings, "project": model.albert.encoder.embedding_hidden_mapping_in}


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


FAMILIES: dict[str, Family] = {
    "albert": Family(
        "ALBERT",
        tp=_albert_plan,
        stages=AlbertStages(),
        classifier=FirstTokenHead("albert", "albert_pooler"),
    ),
}
