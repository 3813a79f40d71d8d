"""The one function that parallelizes a model over its process groups, and the axes' refusals before any group.

As torchtitan's ``parallelize_llama``: each parallelism lives in its own module behind one interface
(``hftrain.parallel.axis_ops.AxisOps``, the module's ``AXIS``), and this is the only place that composes them, in
the declared order (``hftrain.parallel.axes.AXIS_SPECS``), naming none: tensor parallelism splits every layer over the
tp group, context parallelism changes the attention, expert parallelism the MoE blocks' experts. Data parallelism
is applied by the caller around the result (DDP over the dp group, or gradients averaged by hand around pipeline
stages), and pipeline parallelism cuts the result into stages, since both wrap the model rather than change its
layers (their ``apply`` leaves it whole). A new axis is one more declaration and its module's ``AXIS``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from hftrain.parallel.dims import ParallelDims, ParallelGroups
    from hftrain.parallel.heads import StageHead
    from hftrain.parallel.random import RNGTracker


def __getattr__(name: str) -> Any:
    if name == "LANGUAGE_MODEL_LAYOUTS_NOT_BUILT":
        # Axes that do not run a per-token head (a causal language model's, a token classifier's) *together* yet,
        # from each axis's ``per_token_not_with`` (importing the axes' modules: computed on first use).
        from hftrain.parallel.axis_ops import per_token_layouts_not_built

        return per_token_layouts_not_built()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_layout(dims: ParallelDims, *, pad_to_multiple_of: int | None = None, **options: Any) -> None:
    """Refuse, before any model or process group, options the layout's axes do not take together: each axis's own
    ``check_layout`` (``hftrain.parallel.axis_ops``), in the declared order; ``AxisError`` naming the axis (the layout
    itself is ``ParallelDims.validate_trainable``'s).

    Args:
        dims: the layout.
        pad_to_multiple_of: the length buckets (None: none).
        options: the ``parallelism`` options by name (``axis_ops.option_defaults``; the rest default).
    """
    from hftrain.parallel.axis_ops import declared, with_defaults

    given = with_defaults(options)
    for _, ops in declared():
        ops.check_layout(dims, given, pad_to_multiple_of)


def check_model(config: Any, dims: ParallelDims, *, head: str = "sequence_classification", **options: Any) -> None:
    """Refuse a model the layout cannot split, from its config, before any process group: each axis's own
    ``check_model``, in the declared order; ``AxisError`` naming the axis.

    Args:
        config: the model's ``PretrainedConfig``.
        dims: the layout.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``): pipeline and context parallelism check the
            family with it (a MoE family's token classifier or causal LM under pp is refused).
        options: the ``parallelism`` options by name (``axis_ops.option_defaults``; the rest default).
    """
    from hftrain.parallel.axis_ops import declared, with_defaults

    given = with_defaults(options)
    for _, ops in declared():
        ops.check_model(config, dims, given, head)


def padding_multiple(dims: ParallelDims, *, pad_to_multiple_of: int | None = None, **options: Any) -> int | None:
    """What every batch's sequence length is padded up to a multiple of: the length buckets, else the least common
    multiple of what the axes that cut the sequence need (``2·cp`` equal zigzag chunks; ``tp`` parts under sequence
    parallelism), else None (the longest example).

    Args:
        dims: the layout.
        pad_to_multiple_of: the length buckets (None: none).
        options: the ``parallelism`` options by name (``axis_ops.option_defaults``; the rest default).
    """
    from hftrain.parallel import axis_ops

    if pad_to_multiple_of:
        return pad_to_multiple_of
    multiple = axis_ops.padding_multiple(dims, axis_ops.with_defaults(options))
    return multiple if multiple > 1 else None


def parallelize_model(
    model: nn.Module,
    groups: ParallelGroups,
    *,
    rng_tracker: RNGTracker | None = None,
    recompute: str | None = None,
    head: str | StageHead = "sequence_classification",
    **options: Any,
) -> nn.Module:
    """Apply every layer-changing axis of ``groups`` to ``model``: each axis's own ``apply``, in the declared order
    (in place; collective over each axis' group).

    Args:
        model: an unchanged HF model of the task's head kind, the same full weights on every rank.
        groups: this rank's process groups (``ParallelDims`` validated once, by the caller's owner).
        rng_tracker: this rank's random streams (``hftrain.parallel.random``), seeded for its tp and pp ranks.
        recompute: activation recomputation, ``"full"`` or ``"selective"`` (``hftrain.parallel.recompute``), applied
            last, on the split layers: a full-layer checkpoint replays the tracker's streams.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``) or its own ``StageHead``: context parallelism
            gathers the whole sequences back after the family's trunk for a head that is not per token, and nothing
            for one that is.
        options: the ``parallelism`` options by name (``axis_ops.option_defaults``: ``sequence_parallel``,
            ``vocab_multiple``, ``cp_comm``, ``moe_capacity_factor``, ...; the rest default); a name no axis reads
            is a ``TypeError``.
    """
    from hftrain.parallel.axis_ops import declared, not_built, with_defaults
    from hftrain.parallel.lora import hf_model_of

    given = with_defaults(options)
    if hf_model_of(model) is not model:  # the strategy refuses these first; here for hand-split models
        for axis, size, what in not_built(groups.dims, "lora"):
            from hftrain.errors import AxisError

            raise AxisError(
                axis,
                f"LoRA adapters with {what} ({axis}={size}) are not supported yet (that axis does not take "
                f"adapters yet); use {axis} = 1, or train the full model",
            )
    for _, ops in declared():
        model = ops.apply(model, groups, given, head=head, rng_tracker=rng_tracker)
    if recompute is not None:
        from hftrain.parallel.recompute import apply_activation_checkpointing

        apply_activation_checkpointing(model, recompute, rng_tracker=rng_tracker)
    return model
