"""Apply a tensor-parallel plan to an HF model, and convert between full and sharded state.

:func:`apply_tensor_parallel` is the one function that turns a plan (``hftrain.parallel.plans``) into modules: each
style is one small function in :data:`STYLES`. Parameter names do not change, so the logical name of a shard is its
HF name (without wrapper prefixes such as ``module.``), and :func:`~hftrain.parallel.placement.full_state_dict`
returns a state dict the plain HF class loads with ``strict=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.errors import HFTrainError
from hftrain.parallel.axis_ops import AxisOps
from hftrain.parallel.collectives import (
    copy_to_tp,
    gather_from_sequence,
    gather_to_replicated,
    scatter_to_sequence,
)
from hftrain.parallel.families import check_tensor_parallel, plan_for
from hftrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    WidthParallelRMSNorm,
)
from hftrain.parallel.lora import check_lora_layers, hf_model_of, is_lora_layer, split_linear
from hftrain.parallel.placement import place
from hftrain.parallel.plans import GroupedQuerySplit, TensorParallelPlan, grouped_query_split
from hftrain.parallel.random import RNGTracker, run_in_stream
from hftrain.parallel.tp_replicas import (  # noqa: F401  (re-exported: their public path)
    REPLICA_RTOL,
    _check_replicated,
    check_replicas_agree,
)


@dataclass(frozen=True)
class _Context:
    tp_group: Any
    tp_size: int
    sequence_parallel: bool
    rng: RNGTracker | None = None  # which random stream each region draws dropout masks from
    vocab_multiple: int = 1  # the vocabulary is padded to a multiple of tp × this
    grouped_query: GroupedQuerySplit | None = None  # the per-rank heads of a grouped-query family


def _context(
    config: Any,
    plan: TensorParallelPlan,
    *,
    tp_group: Any,
    sequence_parallel: bool,
    rng_tracker: RNGTracker | None,
    vocab_multiple: int,
) -> _Context:
    """What the styles need to split one model: checked against the model's sizes first."""
    tp_size = dist.get_world_size(tp_group)
    check_tensor_parallel(config, tp_size, sequence_parallel=sequence_parallel)
    heads = (config.num_attention_heads, config.num_key_value_heads) if plan.grouped_query else None
    return _Context(
        tp_group,
        tp_size,
        sequence_parallel,
        rng_tracker,
        vocab_multiple,
        grouped_query_split(*heads, tp_size) if heads else None,
    )


def _map_hidden_input(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Pass the module's ``hidden_states`` input (keyword or first positional) through ``fn``."""

    def hook(_module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        return (fn(args[0]), *args[1:]), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _map_hidden_output(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Pass the module's output (a tensor, the first item of a tuple, or a ModelOutput's first field) through ``fn``."""

    def hook(_module, _args, output):
        if isinstance(output, torch.Tensor):
            return fn(output)
        if isinstance(output, tuple) and not hasattr(output, "keys"):
            return (fn(output[0]), *output[1:])
        first = next(iter(output.keys()))  # transformers ModelOutput: last_hidden_state
        output[first] = fn(output[first])
        return output

    module.register_forward_hook(hook)


# The linear styles go through split_linear, which also splits a PEFT LoRA layer's adapters (hftrain.parallel.lora).
def _column(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    split_linear(parent, name, module, lambda m: ColumnParallelLinear(m, tp_group=ctx.tp_group), ctx.rng)


def _column_kv(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # a key/value head per slice; with fewer heads than tp, tp/kv adjacent ranks hold (and train) the same one
    replicas = ctx.grouped_query.replicas if ctx.grouped_query else 1
    split_linear(
        parent, name, module, lambda m: ColumnParallelLinear(m, tp_group=ctx.tp_group, replicas=replicas), ctx.rng
    )


def _column_parts(parts: int) -> Callable[[nn.Module, str, nn.Module, _Context], None]:
    """A column split of ``parts`` equal packed outputs, each split on its own: GPT-2's ``c_attn`` and ModernBERT's
    ``Wqkv`` (q, k, v: 3), Phi-3's ``gate_up_proj`` and ModernBERT's GLU ``Wi`` (cut in two by ``chunk(2)``: 2)."""

    def style(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
        split = lambda m: ColumnParallelLinear(m, tp_group=ctx.tp_group, parts=parts)  # noqa: E731
        split_linear(parent, name, module, split, ctx.rng)

    return style


def _column_fused_qkv(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # a fused grouped-query [q; k; v] projection (Phi-3's qkv_proj: h·d, kv·d, kv·d rows), each part split per head
    split = ctx.grouped_query
    assert split is not None and split.replicas == 1, "the plan's sizes make tp divide the key/value heads"
    heads, kv_heads = split.heads * ctx.tp_size, split.kv_heads * ctx.tp_size
    head_dim = (module.base_layer if is_lora_layer(module) else module).out_features // (heads + 2 * kv_heads)
    blocks = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    split_linear(parent, name, module, lambda m: ColumnParallelLinear(m, tp_group=ctx.tp_group, blocks=blocks), ctx.rng)


class _LocalHeadsConfig:
    """A model config seen by one attention module with this rank's head counts; everything else (the attention
    implementation set later, e.g. context parallelism's) is read from and written to the model's config."""

    _OWN = ("num_attention_heads", "num_key_value_heads")

    def __init__(self, config: Any, heads: int, kv_heads: int) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "num_attention_heads", heads)
        object.__setattr__(self, "num_key_value_heads", kv_heads)

    def __getattr__(self, name: str) -> Any:
        if name == "_config":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._config, name, value)


def _local_heads(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # an attention that slices its fused qkv by its config's head counts (Phi-3: config.num_attention_heads) sees
    # this rank's counts through its own view of the config (the model's config stays whole, for the export)
    split = ctx.grouped_query
    assert split is not None
    module.config = _LocalHeadsConfig(module.config, split.heads, split.kv_heads)
    module.num_key_value_heads = split.kv_heads


def _row(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    split_linear(
        parent,
        name,
        module,
        lambda m: RowParallelLinear(m, tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel),
        ctx.rng,
    )


def _vocab(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    setattr(parent, name, VocabParallelEmbedding(module, tp_group=ctx.tp_group, vocab_multiple=ctx.vocab_multiple))


def _region(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    enter = gather_from_sequence if ctx.sequence_parallel else copy_to_tp
    _map_hidden_input(module, lambda x: enter(x, ctx.tp_group))
    if ctx.rng is not None:  # dropout on this rank's heads or features: its own stream, not its peers' copy
        run_in_stream(module, ctx.rng, "tensor")


def _heads_dropout(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # an attention whose projections enter the region one by one (ALBERT's: its residual is inside the module): its
    # dropout on the attention probabilities of this rank's heads draws from the rank's own stream
    if ctx.rng is not None:
        run_in_stream(module, ctx.rng, "tensor")


def _sequence(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    if ctx.sequence_parallel:
        _partial_over_tp(module)


def _head_shared(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # applied to this rank's heads only: its gradient is this rank's share of the heads' sum, complete after the
    # all-reduce over tp (placement.sum_partial_grads; transformers' replicated_with_grad_allreduce)
    _partial_over_tp(module)


def _partial_over_tp(module: nn.Module) -> None:
    """Record ``module``'s own parameters as whole on every tp rank with a gradient partial over tp."""
    for name, _ in module.named_parameters(recurse=False):
        place(module, name, partial=("tp",))


def _width_norm(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # a norm over a column-parallel output's whole width (OLMo-2's q_norm); its slices follow the projection's
    setattr(parent, name, WidthParallelRMSNorm(module, tp_group=ctx.tp_group))


def _width_norm_kv(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # the same over grouped key/value heads (k_norm), replicated with them when tp exceeds their count
    replicas = ctx.grouped_query.replicas if ctx.grouped_query else 1
    setattr(parent, name, WidthParallelRMSNorm(module, tp_group=ctx.tp_group, replicas=replicas))


def _sequence_dropout(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # A residual-stream dropout: on this rank's sequence chunk under sequence parallelism (its own stream), else on
    # activations every tp rank holds whole (the shared default stream, also when it sits inside a region).
    if ctx.rng is not None:
        run_in_stream(module, ctx.rng, "tensor" if ctx.sequence_parallel else "default")


def _replicated_dropout(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    # A dropout on an activation every tp rank holds whole, with or without sequence parallelism (DeBERTa's
    # pos_dropout on the relative embeddings, inside the attention region): one mask for the tp group, the shared
    # default stream, so each rank's heads see the mask the unsplit model's heads all see.
    if ctx.rng is not None:
        run_in_stream(module, ctx.rng, "default")


def _scatter(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    if ctx.sequence_parallel:
        _map_hidden_input(module, lambda x: scatter_to_sequence(x, ctx.tp_group))


def _gather(parent: nn.Module, name: str, module: nn.Module, ctx: _Context) -> None:
    if ctx.sequence_parallel:
        _map_hidden_output(module, lambda x: gather_to_replicated(x, ctx.tp_group))


STYLES: dict[str, Callable[[nn.Module, str, nn.Module, _Context], None]] = {
    "column": _column,
    "column_qkv": _column_parts(3),
    "column_kv": _column_kv,
    "column_gate_up": _column_parts(2),
    "column_fused_qkv": _column_fused_qkv,
    "local_heads": _local_heads,
    "row": _row,
    "vocab": _vocab,
    "region": _region,
    "heads_dropout": _heads_dropout,
    "sequence": _sequence,
    "head_shared": _head_shared,
    "width_norm": _width_norm,
    "width_norm_kv": _width_norm_kv,
    "sequence_dropout": _sequence_dropout,
    "replicated_dropout": _replicated_dropout,
    "scatter": _scatter,
    "gather": _gather,
}


def _refuse_unsupported(model: nn.Module) -> None:
    check_lora_layers(model)
    for name, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding | VocabParallelHead):
            raise HFTrainError(f"tensor parallelism is already applied to this model (module '{name}')")


def _apply_entries(root: nn.Module, entries, ctx: _Context) -> None:
    for path, style in entries:
        parent_path, _, name = path.rpartition(".")
        STYLES[style](root.get_submodule(parent_path), name, root.get_submodule(path), ctx)


def _apply_to_layer(layer: nn.Module, plan: TensorParallelPlan, ctx: _Context) -> None:
    _apply_entries(layer, plan.layer, ctx)
    for path, attributes in plan.heads.items():
        attention = layer.get_submodule(path)
        for attribute in attributes:
            setattr(attention, attribute, getattr(attention, attribute) // ctx.tp_size)
    if plan.grouped_query and ctx.grouped_query:  # query heads per key/value head on this rank (repeat_kv's factor)
        layer.get_submodule(plan.grouped_query).num_key_value_groups = ctx.grouped_query.groups


def parallelize_layer(
    layer: nn.Module,
    config: Any,
    *,
    tp_group: Any,
    sequence_parallel: bool = False,
    rng_tracker: RNGTracker | None = None,
) -> nn.Module:
    """Split one transformer layer in place with its family's plan (what apply_tensor_parallel does per layer).

    For benchmarks and tests of a single layer; the caller owns the model-level entries (embedding, sequence
    scatter/gather).

    Args:
        layer: e.g. a ``LlamaDecoderLayer`` with full weights identical on every rank.
        config: the model config the layer was built from (selects the plan; its sizes are checked).
        tp_group: the tensor-parallel group.
        sequence_parallel: the layer's input and output are sequence chunks.
        rng_tracker: the random streams dropout draws from (None: the default generator everywhere).
    """
    plan = plan_for(config)
    ctx = _context(
        config,
        plan,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        rng_tracker=rng_tracker,
        vocab_multiple=1,  # a layer has no embedding
    )
    _apply_to_layer(layer, plan, ctx)
    return layer


def check_sequence_parallel(tp: int, *, sequence_parallel: bool = False, pad_to_multiple_of: int | None = None) -> None:
    """Refuse, before any model or process group, length buckets (``pad_to_multiple_of``) that sequence parallelism
    cannot cut: it splits every sequence into ``tp`` equal parts; ``AxisError`` naming ``tp``.

    Args:
        tp: tensor-parallel size.
        sequence_parallel: Megatron sequence parallelism in the tp regions.
        pad_to_multiple_of: the length buckets (None: none).
    """
    import math

    from hftrain.errors import AxisError

    buckets = pad_to_multiple_of
    if buckets and sequence_parallel and tp > 1 and buckets % tp:
        raise AxisError(
            "tp",
            f"length buckets of {buckets} (pad_to_multiple_of) are not a multiple of tp={tp}, and sequence "
            f"parallelism cuts every sequence into tp equal parts; use a multiple of {tp} "
            f"(e.g. {math.lcm(buckets, tp)})",
        )


def apply_tensor_parallel(
    model: nn.Module,
    *,
    tp_group: Any,
    sequence_parallel: bool = False,
    rng_tracker: RNGTracker | None = None,
    vocab_multiple: int = 1,
) -> nn.Module:
    """Split an unchanged HF ``*ForSequenceClassification`` model in place over ``tp_group``.

    Every rank must hold the same full weights (build the model with the same seed); each keeps its shard.
    Collective over ``tp_group`` (one all-reduce checks the weights are replicated).

    Args:
        model: a model of a family with a tensor-parallel plan (``hftrain.parallel.families``; mixtures of
            experts: the MoE blocks replicated), or a PEFT LoRA model of one
            (its adapters are split with their layers, ``hftrain.parallel.lora``).
        tp_group: the tensor-parallel process group.
        sequence_parallel: shard LayerNorm/dropout regions along the sequence (batches must be padded to a multiple
            of ``sequence_multiple(tp, sequence_parallel=True)``; call
            :func:`~hftrain.parallel.placement.complete_grads` after backward).
        rng_tracker: this rank's random streams (``hftrain.parallel.random``): dropout inside the tensor-parallel
            regions and on sequence chunks draws from its per-rank ``tensor`` stream, elsewhere from the default
            stream shared by the tp group. None keeps one stream for everything (masks repeat across tp ranks).
        vocab_multiple: pad the vocabulary to a multiple of ``tp × vocab_multiple`` rows (Megatron's
            ``make-vocab-size-divisible-by``; the padding never leaves the shards).
    """
    plan = plan_for(model.config)
    ctx = _context(
        model.config,
        plan,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        rng_tracker=rng_tracker,
        vocab_multiple=vocab_multiple,
    )
    _refuse_unsupported(model)
    _check_replicated(model, tp_group)
    hf_model = hf_model_of(model)  # plan paths name modules of the transformers model, inside a PeftModel too
    head = hf_model.get_output_embeddings()  # a language model's vocabulary projection (None for a classifier)
    tied = head is not None and head.weight is hf_model.get_input_embeddings().weight
    for layer in hf_model.get_submodule(plan.layers):
        _apply_to_layer(layer, plan, ctx)
    _apply_entries(hf_model, plan.model, ctx)
    if head is not None:
        embedding = hf_model.get_input_embeddings() if tied else None  # split by the plan's vocab entry
        hf_model.set_output_embeddings(
            VocabParallelHead(head, tp_group=tp_group, vocab_multiple=vocab_multiple, tied=embedding)
        )
    return model


# ----------------------------------------------------------------- the axis's interface (hftrain.parallel.axis_ops)
def _apply(model: nn.Module, groups: Any, options: Any, *, head: Any, rng_tracker: RNGTracker | None) -> nn.Module:
    """Split the model over the tp group (at tp 1 too where its family has a plan: the same layers, whole)."""
    from hftrain.parallel.families import has_tp_plan

    check_tensor_parallel(model.config, groups.tp_size, sequence_parallel=options["sequence_parallel"])
    if groups.tp_size == 1 and not has_tp_plan(model.config):  # a family without a plan stays whole
        return model
    return apply_tensor_parallel(
        model,
        tp_group=groups.tp_group,
        sequence_parallel=options["sequence_parallel"],
        rng_tracker=rng_tracker,
        vocab_multiple=options["vocab_multiple"],
    )


def _padding(dims: Any, options: Any) -> int:
    from hftrain.parallel.plans import sequence_multiple

    return sequence_multiple(dims.tp, sequence_parallel=options["sequence_parallel"])  # tp parts under sp


def _check_layout(dims: Any, options: Any, pad_to_multiple_of: int | None) -> None:
    sp = options["sequence_parallel"]
    check_sequence_parallel(dims.tp, sequence_parallel=sp, pad_to_multiple_of=pad_to_multiple_of)


def _check_model(config: Any, dims: Any, options: Any, head: str) -> None:
    check_tensor_parallel(config, dims.tp, sequence_parallel=options["sequence_parallel"])


def _check_family(config: Any, head: str | None) -> None:
    plan_for(config)


AXIS = AxisOps(
    options={"sequence_parallel": False, "vocab_multiple": 1},
    check_layout=_check_layout,
    check_model=_check_model,
    check_family=_check_family,
    padding_multiple=_padding,
    apply=_apply,
)
"""Tensor parallelism behind the axes' one interface."""
