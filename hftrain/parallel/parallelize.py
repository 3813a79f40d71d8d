"""The one function that parallelizes a model over its process groups: one ``apply_*`` call per axis.

As torchtitan's ``parallelize_llama``: each parallelism lives in its own module behind one apply function, and
this is the only place that composes them, in a fixed order. Tensor parallelism splits every layer over the tp
group (``hftrain.parallel.tensor_parallel``). Data parallelism is applied by the caller around the result (DDP
over the dp group, or gradients averaged by hand around pipeline stages), and pipeline parallelism cuts the
result into stages (``hftrain.parallel.pipeline``), since both wrap the model rather than change its layers.
Context parallelism changes the attention (``hftrain.parallel.context_parallel``), expert parallelism the MoE
blocks' experts (``hftrain.parallel.expert_parallel``): each is one more ``apply_*`` call here and one field of
``ParallelDims``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from hftrain.parallel.dims import ParallelDims, ParallelGroups
    from hftrain.parallel.heads import StageHead
    from hftrain.parallel.random import RNGTracker

LANGUAGE_MODEL_LAYOUTS_NOT_BUILT = (("pp", "cp"),)
"""Axes that do not run a per-token head (a causal language model's, a token classifier's) *together* yet: the
pipeline's chunks do not take a context-parallel split of the positions a per-token loss reads."""

LORA_AXES_NOT_BUILT = {"pp": "pipeline stages", "cp": "context parallelism", "ep": "expert parallelism"}
"""Axes whose layers do not take LoRA adapters yet (LoRA's adapters are split with their layers under tp,
``hftrain.parallel.lora``), with what each is called."""

ZERO1_AXES_NOT_BUILT = {
    "pp": "the stages' optimizers are not sharded",
    "ep": "ZeRO-1 over dp would mix different ranks' experts",
}
"""Axes a ZeRO-1 optimizer over the dp group does not compose with yet, with why."""


def check_layout(dims: ParallelDims, *, sequence_parallel: bool = False, pad_to_multiple_of: int | None = None) -> None:
    """Refuse, before any model or process group, options the layout's axes do not take together; ``AxisError``
    naming the axis (the layout itself is ``ParallelDims.validate_trainable``'s).

    Args:
        dims: the layout.
        sequence_parallel: Megatron sequence parallelism in the tp regions.
        pad_to_multiple_of: the length buckets (None: none).
    """
    from hftrain.parallel.context_parallel import check_context_parallel
    from hftrain.parallel.tensor_parallel import check_sequence_parallel

    check_sequence_parallel(dims.tp, sequence_parallel=sequence_parallel, pad_to_multiple_of=pad_to_multiple_of)
    check_context_parallel(dims.cp, sequence_parallel=sequence_parallel, pad_to_multiple_of=pad_to_multiple_of)


def check_model(
    config: Any,
    dims: ParallelDims,
    *,
    sequence_parallel: bool = False,
    cp_comm: str = "ring",
    moe_capacity_factor: float | None = None,
    virtual_stages: int = 1,
    head: str = "sequence_classification",
) -> None:
    """Refuse a model the layout cannot split, from its config, before any process group: each axis's own check, in
    the order of their refusals (tp, ep, cp, pp); ``AxisError`` naming the axis.

    Args:
        config: the model's ``PretrainedConfig``.
        dims: the layout.
        sequence_parallel: Megatron sequence parallelism in the tp regions.
        cp_comm: context parallelism's exchange, ``"ring"`` or ``"all_to_all"``.
        moe_capacity_factor: a mixture-of-experts model's per-expert cap (None: dropless).
        virtual_stages: model chunks per pipeline rank.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``): pipeline and context parallelism check the
            family with it (a MoE family's token classifier or causal LM under pp is refused).
    """
    from hftrain.parallel.context_parallel import check_context_parallel_model
    from hftrain.parallel.expert_parallel import check_expert_parallel
    from hftrain.parallel.families import check_family, check_tensor_parallel
    from hftrain.parallel.pipeline import stage_layer_ranges

    check_tensor_parallel(config, dims.tp, sequence_parallel=sequence_parallel)
    check_expert_parallel(config, dims.ep, dims.dp, moe_capacity_factor)
    if dims.cp > 1:
        check_context_parallel_model(config, dims.cp, tp=dims.tp, comm=cp_comm)
        check_family(config, head=head, axis="cp")
    if dims.pp > 1:
        check_family(config, head=head)
        # The same split the stages will use; balance "layers" needs no parameter sizes and applies the same checks.
        stage_layer_ranges(config.num_hidden_layers, pp=dims.pp, virtual_stages=virtual_stages)


def padding_multiple(
    dims: ParallelDims, *, sequence_parallel: bool = False, pad_to_multiple_of: int | None = None
) -> int | None:
    """What every batch's sequence length is padded up to a multiple of: the length buckets, else what the axes that
    cut the sequence need (``2·cp`` equal zigzag chunks; ``tp`` parts under sequence parallelism), else None (the
    longest example).

    Args:
        dims: the layout.
        sequence_parallel: Megatron sequence parallelism in the tp regions.
        pad_to_multiple_of: the length buckets (None: none).
    """
    from hftrain.parallel.plans import sequence_multiple

    if pad_to_multiple_of:
        return pad_to_multiple_of
    if dims.cp > 1:
        return 2 * dims.cp
    multiple = sequence_multiple(dims.tp, sequence_parallel=sequence_parallel)  # tp's rule: tp parts under sp
    return multiple if multiple > 1 else None


def parallelize_model(
    model: nn.Module,
    groups: ParallelGroups,
    *,
    sequence_parallel: bool = False,
    cp_comm: str = "ring",
    rng_tracker: RNGTracker | None = None,
    recompute: str | None = None,
    vocab_multiple: int = 1,
    moe_capacity_factor: float | None = None,
    head: str | StageHead = "sequence_classification",
) -> nn.Module:
    """Apply every layer-changing axis of ``groups`` to ``model`` (in place; collective over each axis' group).

    Args:
        model: an unchanged HF model of the task's head kind, the same full weights on every rank.
        groups: this rank's process groups (``ParallelDims`` validated once, by the caller's owner).
        sequence_parallel: Megatron sequence parallelism in the tensor-parallel regions.
        cp_comm: how context parallelism exchanges keys and values, ``"ring"`` or ``"all_to_all"``.
        rng_tracker: this rank's random streams (``hftrain.parallel.random``), seeded for its tp and pp ranks.
        recompute: activation recomputation, ``"full"`` or ``"selective"`` (``hftrain.parallel.recompute``), applied
            last, on the split layers: a full-layer checkpoint replays the tracker's streams.
        vocab_multiple: the vocabulary-parallel embedding pads the vocabulary to a multiple of ``tp ×`` this.
        moe_capacity_factor: a mixture-of-experts model's per-expert cap (None: dropless), under any ep.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``) or its own ``StageHead``: context parallelism
            gathers the whole sequences back after the family's trunk for a head that is not per token, and nothing
            for one that is.
    """
    from hftrain.parallel.families import check_tensor_parallel, has_tp_plan
    from hftrain.parallel.lora import hf_model_of
    from hftrain.parallel.tensor_parallel import apply_tensor_parallel

    check_tensor_parallel(model.config, groups.tp_size, sequence_parallel=sequence_parallel)
    for axis, what in LORA_AXES_NOT_BUILT.items():  # the strategy refuses these first; here for hand-split models
        size = getattr(groups.dims, axis)
        if size > 1 and hf_model_of(model) is not model:
            from hftrain.errors import AxisError

            raise AxisError(
                axis,
                f"LoRA adapters with {what} ({axis}={size}) are not supported yet (LoRA runs under tp and dp); use "
                f"{axis} = 1, or train the full model",
            )
    if groups.tp_size > 1 or has_tp_plan(model.config):  # at tp 1 a family without a plan stays whole
        model = apply_tensor_parallel(
            model,
            tp_group=groups.tp_group,
            sequence_parallel=sequence_parallel,
            rng_tracker=rng_tracker,
            vocab_multiple=vocab_multiple,
        )
    if groups.cp_size > 1:
        from hftrain.parallel.context_parallel import apply_context_parallel
        from hftrain.parallel.families import stages_for
        from hftrain.parallel.heads import per_token_head

        # checked for cp with the head kind (a task's own head object: the family alone)
        trunk = stages_for(model.config, head=head if isinstance(head, str) else None, axis="cp")
        per_token = per_token_head(head)
        model = apply_context_parallel(model, trunk=trunk, per_token=per_token, cp_group=groups.cp_group, comm=cp_comm)
    if groups.ep_size > 1 or moe_capacity_factor is not None:
        from hftrain.parallel.expert_parallel import apply_expert_parallel

        model = apply_expert_parallel(model, ep_group=groups.ep_group, capacity_factor=moe_capacity_factor)
    if recompute is not None:
        from hftrain.parallel.recompute import apply_activation_checkpointing

        apply_activation_checkpointing(model, recompute, rng_tracker=rng_tracker)
    return model
