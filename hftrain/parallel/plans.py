"""Tensor-parallel and expert plans as data: the types of a family's entries (``hftrain.parallel.families`` holds
the entries, one per model family) and the arithmetic of splitting heads and vocabularies.

A plan names modules by their path in the HF ``*ForSequenceClassification`` model and gives each a style:

- ``column`` / ``column_qkv``: split the output features (``column_qkv``: packed q, k, v, split per head;
  GPT-NeoX's fused ``query_key_value`` is per head already, so plain ``column`` splits it by heads);
- ``column_kv``: a grouped-query key or value projection: split per key/value head when tp divides them, else
  each head replicated over ``tp / kv`` ranks (Megatron's and vLLM's rule; see :func:`grouped_query_split`);
- ``column_fused_qkv`` / ``column_gate_up``: a fused projection whose output parts are split each on its own
  (Phi-3's ``qkv_proj``: ``h·d`` query, ``kv·d`` key and ``kv·d`` value rows, each per head; its ``gate_up_proj``:
  gate and up halves), so a rank's output is its own heads' q, k, v (its own features' gate and up), in the order
  the model slices them; ``local_heads``: the attention that slices them by its config's head counts reads this
  rank's counts through a view of the model's config (everything else, e.g. the attention implementation set
  later, is the model's);
- ``row``: split the input features (the partial outputs are summed);
- ``width_norm`` / ``width_norm_kv``: an RMSNorm over a column-parallel projection's whole width (OLMo-2's q/k
  norms), its weight split with the projection's output (``_kv``: with grouped key/value heads), the sum of
  squares all-reduced over tp (``layers.WidthParallelRMSNorm``);
- ``head_shared``: a replicated module applied to each rank's own heads (Qwen3's and Gemma-3's per-head q/k norms:
  transformers' ``replicated_with_grad_allreduce``; DeBERTa's relative embeddings and their LayerNorm, projected by
  every layer's column-split query/key): its gradient is each rank's heads' share, summed over tp
  (``g = Σ_tp g_r``, one all-reduce in ``placement.complete_grads``);
- ``vocab``: vocabulary-parallel embedding;
- ``region``: the module's ``hidden_states`` input enters a tensor-parallel region (f, or the sequence
  all-gather under sequence parallelism) once for all the column layers inside it; its dropout (attention
  probabilities on this rank's heads) draws from the rank's own ``tensor`` RNG stream (``hftrain.parallel.random``);
- ``heads_dropout``: an attention module whose projections are each a ``region`` (ALBERT's, which adds its residual
  inside the module, so the module's input cannot enter the region): its dropout of the attention probabilities of
  this rank's heads draws from the rank's own ``tensor`` stream;
- ``sequence_dropout``: a residual-stream dropout: the rank's ``tensor`` stream under sequence parallelism (it
  drops this rank's sequence chunk), the tp group's shared default stream otherwise (even inside a region);
- ``replicated_dropout``: a dropout on an activation every tp rank holds whole in both modes (DeBERTa's
  ``pos_dropout`` on the relative embeddings ``E``, inside the attention region, before each rank projects ``E``
  onto its own heads): the tp group's shared default stream, one mask ``m`` for all ranks, so rank r's heads see
  ``m ⊙ E`` as the unsplit model's heads do;
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
``hftrain.parallel.families.FAMILIES``.

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

from hftrain.errors import ConfigError


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
        sequence_refusal: why the family's layers cannot run on sequence chunks (sequence parallelism refused in one
            line naming it), or None.
    """

    layers: str
    layer: tuple[tuple[str, str], ...]
    model: tuple[tuple[str, str], ...]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: Callable[[Any], dict[str, int]] = lambda config: {}
    grouped_query: str | None = None
    replicated: tuple[str, ...] = ()
    sequence_refusal: str | None = None


@dataclass(frozen=True)
class ExpertPlan:
    """Where a mixture-of-experts family keeps its MoE blocks and how many experts it routes to.

    Args:
        layers: path of the ``ModuleList`` of decoder layers.
        block: path in a layer of its sparse MoE block (a dense layer has no ``experts`` there and is skipped).
        router: the block's router (returns ``(logits, top-k weights, top-k indices)``).
        experts: the block's experts module (3-D ``gate_up_proj`` and ``down_proj``).
        num_experts: the config attribute holding ``E``.
        top_k: the config attribute holding ``k``.
    """

    layers: str = "model.layers"
    block: str = "mlp"
    router: str = "gate"
    experts: str = "experts"
    num_experts: str = "num_local_experts"
    top_k: str = "num_experts_per_tok"


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


def sequence_multiple(tp: int, *, sequence_parallel: bool) -> int:
    """The multiple every batch's sequence length must be padded to (the collator's ``pad_to_multiple_of``).

    Sequence parallelism cuts the sequence into ``tp`` equal chunks; without it any length works.

    Args:
        tp: tensor-parallel size.
        sequence_parallel: whether sequence parallelism is on.
    """
    return tp if sequence_parallel else 1
