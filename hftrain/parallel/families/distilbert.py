"""DistilBERT: BERT's trunk under ``distilbert.transformer``, its own plan, a ``pre_classifier`` classifier."""

from __future__ import annotations

from hftrain.parallel.families.bert import EncoderStages
from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import FirstTokenHead
from hftrain.parallel.plans import TensorParallelPlan

_DISTILBERT_PLAN = TensorParallelPlan(
    layers="distilbert.transformer.layer",
    layer=(
        ("attention", "region"),
        ("attention.q_lin", "column"),
        ("attention.k_lin", "column"),
        ("attention.v_lin", "column"),
        ("attention.out_lin", "row"),
        ("sa_layer_norm", "sequence"),
        ("ffn", "region"),
        ("ffn.lin1", "column"),
        ("ffn.lin2", "row"),
        ("ffn.dropout", "sequence_dropout"),
        ("output_layer_norm", "sequence"),
    ),
    model=(
        ("distilbert.embeddings.word_embeddings", "vocab"),
        ("distilbert.transformer.layer.0", "scatter"),
        ("distilbert.transformer", "gather"),
    ),
    sizes=lambda c: {"n_heads": c.n_heads, "dim": c.dim, "hidden_dim": c.hidden_dim},
)

FAMILIES: dict[str, Family] = {
    "distilbert": Family(
        "DistilBERT",
        tp=_DISTILBERT_PLAN,
        stages=EncoderStages("distilbert", layers="transformer.layer"),
        classifier=FirstTokenHead("distilbert", "pre_classifier"),
    ),
}
