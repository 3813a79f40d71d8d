"""Tensor-parallel plans as data, one entry per model family (keyed by ``config.model_type``).

A plan names modules by their path in the HF ``*ForSequenceClassification`` model and gives each a style:

- ``column`` / ``column_qkv``: split the output features (``column_qkv``: packed q, k, v, split per head);
- ``row``: split the input features (the partial outputs are summed);
- ``vocab``: vocabulary-parallel embedding;
- ``region``: the module's ``hidden_states`` input enters a tensor-parallel region (f, or the sequence
  all-gather under sequence parallelism) once for all the column layers inside it; its dropout (attention
  probabilities on this rank's heads) draws from the rank's own ``tensor`` RNG stream (``hftrain.parallel.random``);
- ``sequence_dropout``: a residual-stream dropout: the rank's ``tensor`` stream under sequence parallelism (it
  drops this rank's sequence chunk), the tp group's shared default stream otherwise (even inside a region);
- ``sequence``: a replicated module (LayerNorm) that runs on sequence chunks under sequence parallelism;
- ``scatter`` / ``gather``: under sequence parallelism, the module's ``hidden_states`` input is cut into
  sequence chunks / its output is gathered back to the full sequence (the head needs every position).

``layer`` entries apply to every transformer layer (paths relative to it); ``model`` entries to the model.
``heads`` lists attention attributes holding per-rank sizes (head counts, widths) that must be divided by tp.
``sizes`` are the config sizes tp must divide, ``minimums`` those it must not exceed, and ``counts`` gives
unequal per-rank widths where a family allows them (Llama's grouped-query attention: whole key/value groups
per rank, as balanced as possible, so SmolLM2-135M's 9 query / 3 key-value heads run at tp=2 as 6+3 / 2+1).
A new family is one more entry in :data:`PLANS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hftrain.errors import AxisError, ConfigError


@dataclass(frozen=True)
class TensorParallelPlan:
    """How to split one model family.

    Args:
        layers: path of the ``ModuleList`` of transformer layers.
        layer: ``(path in the layer, style)`` entries.
        model: ``(path in the model, style)`` entries.
        heads: ``path in the layer -> attribute names`` divided by tp on the attention module.
        sizes: the config sizes that tp must divide, as ``{name: value}`` for a config.
        minimums: the config sizes that tp must not exceed (every rank needs at least one).
        counts: ``(config, tp) -> {path in the layer: per-rank widths}`` for unequal splits.
    """

    layers: str
    layer: tuple[tuple[str, str], ...]
    model: tuple[tuple[str, str], ...]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: Callable[[Any], dict[str, int]] = lambda config: {}
    minimums: Callable[[Any], dict[str, int]] = lambda config: {}
    counts: Callable[[Any, int], dict[str, tuple[int, ...]]] = lambda config, tp: {}


def _grouped_query_counts(config: Any, tp: int) -> dict[str, tuple[int, ...]]:
    """Per-rank widths of q/k/v/o: whole key/value groups per rank (rank r gets one more while some are left)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_per_rank = [kv_heads // tp + (r < kv_heads % tp) for r in range(tp)]
    q = tuple(n * (heads // kv_heads) * head_dim for n in kv_per_rank)
    kv = tuple(n * head_dim for n in kv_per_rank)
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": q}


PLANS: dict[str, TensorParallelPlan] = {
    "bert": TensorParallelPlan(
        layers="bert.encoder.layer",
        layer=(
            ("attention.self", "region"),
            ("attention.self.query", "column"),
            ("attention.self.key", "column"),
            ("attention.self.value", "column"),
            ("attention.output.dense", "row"),
            ("attention.output.dropout", "sequence_dropout"),
            ("attention.output.LayerNorm", "sequence"),
            ("intermediate", "region"),
            ("intermediate.dense", "column"),
            ("output.dense", "row"),
            ("output.dropout", "sequence_dropout"),
            ("output.LayerNorm", "sequence"),
        ),
        model=(
            ("bert.embeddings.word_embeddings", "vocab"),
            ("bert.encoder.layer.0", "scatter"),
            ("bert.encoder", "gather"),
        ),
        heads={"attention.self": ("num_attention_heads", "all_head_size")},
        sizes=lambda c: {
            "num_attention_heads": c.num_attention_heads,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
        },
    ),
    "gpt2": TensorParallelPlan(
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
        sizes=lambda c: {
            "n_head": c.n_head,
            "n_embd": c.n_embd,
            "n_inner": c.n_inner or 4 * c.n_embd,
            "vocab_size": c.vocab_size,
        },
    ),
    "llama": TensorParallelPlan(
        layers="model.layers",
        layer=(
            ("input_layernorm", "sequence"),
            ("self_attn", "region"),
            ("self_attn.q_proj", "column"),
            ("self_attn.k_proj", "column"),
            ("self_attn.v_proj", "column"),
            ("self_attn.o_proj", "row"),
            ("post_attention_layernorm", "sequence"),
            ("mlp", "region"),
            ("mlp.gate_proj", "column"),
            ("mlp.up_proj", "column"),
            ("mlp.down_proj", "row"),
        ),
        model=(
            ("model.embed_tokens", "vocab"),
            ("model.layers.0", "scatter"),
            ("model.norm", "sequence"),
            ("model.norm", "gather"),
        ),
        # LlamaAttention reads no head count at run time (views use -1; q/kv groups per rank stay the same ratio)
        heads={},
        sizes=lambda c: {"intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size},
        minimums=lambda c: {"num_key_value_heads": c.num_key_value_heads},
        counts=_grouped_query_counts,
    ),
}


def plan_for(config: Any) -> TensorParallelPlan:
    """The plan of a model's family, or a ConfigError naming the supported families.

    Args:
        config: the model's ``transformers.PretrainedConfig``.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in PLANS:
        raise ConfigError(
            f"tensor parallelism has no plan for model type '{model_type}'; supported: {', '.join(sorted(PLANS))} "
            f"(use strategy ddp/fsdp/zero* for this model)"
        )
    return PLANS[model_type]


def _valid_tp(sizes: dict[str, int], minimums: dict[str, int]) -> list[int]:
    largest = min([*sizes.values(), *minimums.values()])
    return [
        d
        for d in range(1, largest + 1)
        if all(v % d == 0 for v in sizes.values()) and all(v >= d for v in minimums.values())
    ]


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Refuse a model that ``tp`` cannot split, naming the size and the valid tp values (no processes needed).

    Args:
        config: the model's ``transformers.PretrainedConfig``.
        tp: the tensor-parallel size.
    """
    plan = plan_for(config)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise AxisError("tp", f"tp must be a positive integer, got {tp!r}")
    sizes, minimums = plan.sizes(config), plan.minimums(config)
    indivisible = ", ".join(f"{name}={value}" for name, value in sizes.items() if value % tp)
    too_few = ", ".join(f"{name}={value}" for name, value in minimums.items() if value < tp)
    problems = [f"does not divide {indivisible}"] if indivisible else []
    problems += [f"exceeds {too_few} (each rank needs one)"] if too_few else []
    if problems:
        raise AxisError(
            "tp",
            f"tp={tp} {' and '.join(problems)} of this {config.model_type} model; "
            f"valid tp values for it: {', '.join(map(str, _valid_tp(sizes, minimums)))}",
        )
    unequal = any(len(set(widths)) > 1 for widths in plan.counts(config, tp).values())
    if unequal and getattr(config, "attention_dropout", 0.0):
        # ranks holding different numbers of heads draw different amounts of randomness in attention dropout,
        # after which the replicated dropouts (same stream on every tp rank) would no longer agree
        raise AxisError(
            "tp",
            f"tp={tp} splits this model's key/value heads unequally, which needs attention_dropout=0 "
            f"(it is {config.attention_dropout}); set model attention_dropout to 0 or use a tp that divides the "
            f"key/value heads",
        )


def sequence_multiple(tp: int, *, sequence_parallel: bool) -> int:
    """The multiple every batch's sequence length must be padded to (the collator's ``pad_to_multiple_of``).

    Sequence parallelism cuts the sequence into ``tp`` equal chunks; without it any length works.

    Args:
        tp: tensor-parallel size.
        sequence_parallel: whether sequence parallelism is on.
    """
    return tp if sequence_parallel else 1
