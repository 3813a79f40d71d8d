"""BERT and the encoders that share its layers (RoBERTa, XLM-R, ELECTRA): their plan, trunk and classifiers.

Their trunk (:class:`EncoderStages`) is BERT's layout; DistilBERT, ALBERT and DeBERTa-v2 build on it in their own
modules. Their sequence classifiers pool the first token (``hftrain.parallel.heads.FirstTokenHead``); their token
classifiers are the generic dropout + ``classifier`` (``hftrain.parallel.heads.TokenClassificationHead``).
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import FirstTokenHead
from hftrain.parallel.plans import TensorParallelPlan
from hftrain.parallel.stages import Modules, positions_of


class EncoderStages:
    """BERT-style encoders' trunk: embeddings (ELECTRA: then its ``embeddings_project``) → ``layer[i]``; no final norm.
    Their classification heads are ``FirstTokenHead``'s.

    Args:
        base: the base model's attribute (``bert``, ``roberta``, ``electra``, ``distilbert``).
        layers: the path of its ``ModuleList`` of layers inside the base model.
        pad_numbered: the family numbers positions from its padding index, counting only non-pad tokens (RoBERTa,
            XLM-R: ``padding_idx + cumsum(not pad)``, pads at ``padding_idx``), rather than by index.
    """

    def __init__(self, base: str, layers: str = "encoder.layer", *, pad_numbered: bool = False) -> None:
        self.base, self.layers_path, self.pad_numbered = base, layers, pad_numbered

    def position_ids(self, mods: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The position ids the family gives whole sequences ``[b, s]`` where they are not the index (RoBERTa's,
        numbered from the padding index by its embedding's own ``create_position_ids_from_input_ids``), else None. A
        split of the sequence (context parallelism) takes its positions' entries: every cp rank holds the whole
        batch.

        Args:
            mods: the embedding modules (:meth:`embed_modules`).
            input_ids: the whole sequences.
        """
        if not self.pad_numbered:
            return None
        embeddings = mods["embeddings"]
        return embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx)

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The transformer layers, in order."""
        return getattr(model, self.base).get_submodule(self.layers_path)

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """Modules of the first chunk's embedding."""
        base = getattr(model, self.base)
        project = getattr(base, "embeddings_project", None)  # ELECTRA with embedding_size != hidden_size
        return {"embeddings": base.embeddings, **({"project": project} if project is not None else {})}

    def norm_modules(self, model: torch.nn.Module) -> Modules:
        """The trunk's final norm: none (BERT's layers end in their own norms)."""
        return {}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """Parameter-free helpers every chunk needs."""
        return {}

    def embed(self, mods: Any, config: Any, input_ids, attention_mask, token_type_ids=None, positions=None):
        """Token ids (and token types, positions where given) to the hidden states ``[b, s, h]``."""
        kwargs = {} if positions is None else {"position_ids": positions_of(input_ids, positions)}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = mods["embeddings"](input_ids=input_ids, **kwargs)
        if "project" in mods:
            hidden = mods["project"](hidden)
        return hidden

    def layer_context(self, aux: Any, config: Any, hidden: torch.Tensor, mask: torch.Tensor, positions=None) -> dict:
        """The 4-D mask, built once per chunk as the HF encoder builds it."""
        from transformers.masking_utils import create_bidirectional_mask

        return {"mask": create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)}

    def run_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, context: dict, index: int) -> torch.Tensor:
        """One encoder layer."""
        return layer(hidden, context["mask"])


ENCODER_LAYER_OUTPUTS: tuple[tuple[str, str], ...] = (
    ("attention.output.dense", "row"),
    ("attention.output.dropout", "sequence_dropout"),
    ("attention.output.LayerNorm", "sequence"),
    ("intermediate", "region"),
    ("intermediate.dense", "column"),
    ("output.dense", "row"),
    ("output.dropout", "sequence_dropout"),
    ("output.LayerNorm", "sequence"),
)
"""A BERT-style encoder layer after its attention's projections: the attention output (row), the MLP (column, row)
and the post-norms, split over the sequence under sequence parallelism (DeBERTa-v2's layers share them)."""


def _encoder_plan(base: str) -> TensorParallelPlan:
    """BERT's layers under another base model (RoBERTa, XLM-R, ELECTRA)."""
    return TensorParallelPlan(
        layers=f"{base}.encoder.layer",
        layer=(
            ("attention.self", "region"),
            ("attention.self.query", "column"),
            ("attention.self.key", "column"),
            ("attention.self.value", "column"),
            *ENCODER_LAYER_OUTPUTS,
        ),
        model=(
            (f"{base}.embeddings.word_embeddings", "vocab"),
            (f"{base}.encoder.layer.0", "scatter"),
            (f"{base}.encoder", "gather"),
        ),
        heads={"attention.self": ("num_attention_heads", "all_head_size")},
        sizes=lambda c: {
            "num_attention_heads": c.num_attention_heads,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
        },
    )


FAMILIES: dict[str, Family] = {
    "bert": Family("BERT", tp=_encoder_plan("bert"), stages=EncoderStages("bert"), classifier=FirstTokenHead("bert")),
    # positions counted from the padding index over the whole sequence: every cp rank holds it (EncoderStages)
    "roberta": Family(
        "RoBERTa",
        tp=_encoder_plan("roberta"),
        stages=EncoderStages("roberta", pad_numbered=True),
        classifier=FirstTokenHead("roberta", "classification_head"),
    ),
    "xlm-roberta": Family(
        "XLM-RoBERTa",
        tp=_encoder_plan("roberta"),
        stages=EncoderStages("roberta", pad_numbered=True),
        classifier=FirstTokenHead("roberta", "classification_head"),
    ),
    "electra": Family(
        "ELECTRA",
        tp=_encoder_plan("electra"),
        stages=EncoderStages("electra"),
        classifier=FirstTokenHead("electra", "classification_head"),
    ),
}
