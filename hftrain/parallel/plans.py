"""Tensor-parallel plans as data, one entry per model family (keyed by ``config.model_type``).

A plan names modules by their path in the HF ``*ForSequenceClassification`` model and gives each a style:

- ``column`` / ``column_qkv``: split the output features (``column_qkv``: packed q, k, v, split per head);
- ``column_kv``: a grouped-query key or value projection: split per key/value head when tp divides them, else
  each head replicated over ``tp / kv`` ranks (Megatron's and vLLM's rule; see :func:`grouped_query_split`);
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
``replicated`` names the blocks of a layer that tp leaves whole (a mixture-of-experts block: router, experts, shared
expert); see "Mixture of experts" below.
``sizes`` are the config sizes tp must divide; ``grouped_query`` names the attention of a grouped-query family,
whose key/value heads tp must divide or be a multiple of (SmolLM2-135M's 9 query / 3 key/value heads: tp 1 or 3;
tp=2 would leave one rank twice the other's attention, which Megatron refuses too). The vocabulary is not among
the sizes: the embedding pads it to a multiple of tp (:func:`padded_vocab_size`). A new family is one more entry in
:data:`PLANS`.

Mixture of experts (``mixtral``, ``qwen2_moe``): attention is split as Llama's (q column, k/v ``column_kv``, o row;
Qwen2-MoE's q/k/v biases are split with their rows), and the MoE block (``mlp``: the router ``mlp.gate``, the 3-D
experts ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, Qwen2-MoE's ``shared_expert`` and
``shared_expert_gate``), like Qwen2-MoE's dense ``mlp`` of its ``mlp_only_layers``, has no entry: it stays
replicated over tp. Without sequence parallelism the residual stream is replicated over tp, so every tp rank runs
the whole block on the same full hidden states, ``y = MoE(x)`` identically on each rank (no collective); its
parameters' gradients are then equal on every tp rank, as a LayerNorm's are (clipping counts them once). The
expert sizes are therefore not among ``sizes`` (tp does not split the experts; expert parallelism ``ep`` does).
Sequence parallelism is refused for these families (:func:`check_tensor_parallel`): it would hand each rank
``s / tp`` positions of the residual stream, and the replicated block needs all of them.
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
        grouped_query: path in the layer of a grouped-query attention (its config's ``num_attention_heads`` and
            ``num_key_value_heads``; its ``num_key_value_groups`` is set per rank), or None.
        replicated: paths in the layer of blocks every tp rank runs whole on the full sequence (a mixture-of-experts
            block); such a family refuses sequence parallelism.
    """

    layers: str
    layer: tuple[tuple[str, str], ...]
    model: tuple[tuple[str, str], ...]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: Callable[[Any], dict[str, int]] = lambda config: {}
    grouped_query: str | None = None
    replicated: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupedQuerySplit:
    """How tp splits grouped-query attention: the query heads evenly, the key/value heads evenly when tp divides
    them, else each replicated over ``replicas = tp / kv`` adjacent ranks (rank r holds key/value head
    ``r // replicas``, which serves exactly its query heads).

    Args:
        heads: query heads per rank (``h / tp``).
        kv_heads: key/value heads per rank (``kv / tp``, or 1 when replicated).
        replicas: ranks holding each key/value head (1: split evenly).
    """

    heads: int
    kv_heads: int
    replicas: int

    @property
    def groups(self) -> int:
        """Query heads per key/value head on a rank (the attention's ``num_key_value_groups``)."""
        return self.heads // self.kv_heads


def kv_heads_split(kv_heads: int, tp: int) -> bool:
    """Whether tp can split ``kv_heads`` key/value heads evenly (tp divides them) or replicate them (a multiple)."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


def grouped_query_split(heads: int, kv_heads: int, tp: int) -> GroupedQuerySplit:
    """The per-rank split of ``heads`` query and ``kv_heads`` key/value heads (checked by the caller).

    Args:
        heads: query heads (tp divides them).
        kv_heads: key/value heads (tp divides them or is a multiple of them: :func:`kv_heads_split`).
        tp: tensor-parallel size.
    """
    if heads % tp or not kv_heads_split(kv_heads, tp):
        raise ValueError(f"tp={tp} cannot split {heads} query / {kv_heads} key/value heads evenly")
    replicas = max(tp // kv_heads, 1)
    return GroupedQuerySplit(heads // tp, max(kv_heads // tp, 1), replicas)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """The vocabulary padded up to a multiple of ``tp × multiple`` rows (Megatron's ``make-vocab-size-divisible-by``).

    Args:
        vocab_size: the model's vocabulary ``V``.
        tp: tensor-parallel size.
        multiple: each rank's rows a multiple of this too (e.g. 128, for aligned matmuls on GPUs).
    """
    if not isinstance(multiple, int) or isinstance(multiple, bool) or multiple < 1:
        raise ConfigError(f"vocab_multiple must be a positive integer (1: a multiple of tp only), got {multiple!r}")
    step = tp * multiple
    return -(-vocab_size // step) * step


# Llama's attention and model entries, shared by the mixture-of-experts families (whose ``mlp`` has no entry).
_LLAMA_ATTENTION: tuple[tuple[str, str], ...] = (
    ("input_layernorm", "sequence"),
    ("self_attn", "region"),
    ("self_attn.q_proj", "column"),
    ("self_attn.k_proj", "column_kv"),
    ("self_attn.v_proj", "column_kv"),
    ("self_attn.o_proj", "row"),
    ("post_attention_layernorm", "sequence"),
)
_LLAMA_MODEL: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens", "vocab"),
    ("model.layers.0", "scatter"),
    ("model.norm", "sequence"),
    ("model.norm", "gather"),
)


def _moe_plan() -> TensorParallelPlan:
    """A mixture-of-experts family with Llama's attention and module names (Mixtral, Qwen2-MoE)."""
    return TensorParallelPlan(
        layers="model.layers",
        layer=_LLAMA_ATTENTION,
        model=_LLAMA_MODEL,
        heads={},
        # the experts' sizes are not split by tp (the block is replicated over tp)
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads},
        grouped_query="self_attn",
        replicated=("mlp",),
    )


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
        },
    ),
    "llama": TensorParallelPlan(
        layers="model.layers",
        layer=(
            *_LLAMA_ATTENTION,
            ("mlp", "region"),
            ("mlp.gate_proj", "column"),
            ("mlp.up_proj", "column"),
            ("mlp.down_proj", "row"),
        ),
        model=_LLAMA_MODEL,
        # LlamaAttention's views use -1; the one head count it reads, num_key_value_groups, is set per rank
        heads={},
        sizes=lambda c: {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size},
        grouped_query="self_attn",
    ),
    # mixture of experts: attention split as Llama's, the MoE block (and Qwen2-MoE's dense mlp_only_layers) replicated
    "mixtral": _moe_plan(),
    "qwen2_moe": _moe_plan(),
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


def _kv_heads(plan: TensorParallelPlan, config: Any) -> dict[str, int]:
    return {"num_key_value_heads": config.num_key_value_heads} if plan.grouped_query else {}


def _valid_tp(sizes: dict[str, int], kv_heads: dict[str, int]) -> list[int]:
    return [
        d
        for d in range(1, min(sizes.values()) + 1)
        if all(v % d == 0 for v in sizes.values()) and all(kv_heads_split(v, d) for v in kv_heads.values())
    ]


def check_tensor_parallel(config: Any, tp: int, *, sequence_parallel: bool = False) -> None:
    """Refuse a model that ``tp`` cannot split, naming the size and the valid tp values (no processes needed), and
    sequence parallelism (tp > 1) for a family with blocks replicated over tp (mixture of experts).

    Args:
        config: the model's ``transformers.PretrainedConfig``.
        tp: the tensor-parallel size.
        sequence_parallel: whether sequence parallelism is asked for.
    """
    plan = plan_for(config)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise AxisError("tp", f"tp must be a positive integer, got {tp!r}")
    if sequence_parallel and tp > 1 and plan.replicated:
        raise ConfigError(
            f"strategy.sequence_parallel is not supported for this {config.model_type} model: its mixture-of-experts "
            f"blocks ({', '.join(plan.replicated)}) run whole on every tp rank and need the full sequence, which "
            "sequence parallelism cuts into tp chunks; use sequence_parallel: false (tp still splits the attention)"
        )
    sizes, kv_heads = plan.sizes(config), _kv_heads(plan, config)
    indivisible = ", ".join(f"{name}={value}" for name, value in sizes.items() if value % tp)
    unsplittable = ", ".join(f"{name}={value}" for name, value in kv_heads.items() if not kv_heads_split(value, tp))
    problems = [f"does not divide {indivisible}"] if indivisible else []
    if unsplittable:
        problems.append(f"neither divides nor is a multiple of {unsplittable} (split evenly or replicated)")
    if problems:
        raise AxisError(
            "tp",
            f"tp={tp} {' and '.join(problems)} of this {config.model_type} model; "
            f"valid tp values for it: {', '.join(map(str, _valid_tp(sizes, kv_heads)))}",
        )


def sequence_multiple(tp: int, *, sequence_parallel: bool) -> int:
    """The multiple every batch's sequence length must be padded to (the collator's ``pad_to_multiple_of``).

    Sequence parallelism cuts the sequence into ``tp`` equal chunks; without it any length works.

    Args:
        tp: tensor-parallel size.
        sequence_parallel: whether sequence parallelism is on.
    """
    return tp if sequence_parallel else 1
