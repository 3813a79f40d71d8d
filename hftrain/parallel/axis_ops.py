"""What each axis's own module provides, behind one interface (:class:`AxisOps`), and how the composition finds it.

STYLE's "one parallelism per file behind one interface": every axis declared in ``hftrain.parallel.axes`` names its
own module (``AxisSpec.module``), whose module-level ``AXIS`` is an :class:`AxisOps`. Everything that composes the
axes iterates over the declared axes and calls these, naming none of them:

- ``hftrain.parallel.parallelize``: the layout's and the model's refusals before any process group, the sequence
  padding (the least common multiple of what each axis needs), one ``apply`` per axis in the declared order, and
  LoRA's refusal for a hand-split model;
- the megatron strategy and runtime: ZeRO-1's, LoRA's and ``torch.compile``'s refusals (:data:`NOT_BUILT` features),
  and the options the ``parallelism`` section passes (:func:`option_defaults`: each axis names the fields it reads,
  with their defaults);
- the family registry's ``trainable_axes`` (what the planner offers) and the planner's layouts a per-token loss does
  not take (:func:`per_token_layouts_not_built`).

A new axis is then its declaration (``axes.py``), its own module with an ``AXIS``, and its config fields.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hftrain.parallel.axes import AXIS_SPECS, SPEC, AxisSpec

if TYPE_CHECKING:
    from torch import nn

    from hftrain.parallel.axes import ParallelDims

Options = Mapping[str, Any]
"""The ``parallelism`` options by field name (``hftrain.config.ParallelismConfig``: this layer knows no config)."""

NOT_BUILT = {
    "lora": "LoRA adapters",
    "zero1": "a ZeRO-1 optimizer over the dp group (strategy.shard_optimizer)",
    "compile": "compiled blocks (training.torch_compile)",
    "block_loading": "megatron's blockwise loading (each rank reads its stages' blocks and its tp slices only)",
}
"""The features an axis may not compose with yet (:attr:`AxisOps.not_built`'s keys), with what each is called."""


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _whole(model: Any, *args: Any, **kwargs: Any) -> Any:
    return model


@dataclass(frozen=True)
class AxisOps:
    """One axis's checks, split and refusals, as its own module provides them.

    Args:
        options: the ``parallelism`` fields it reads, with their defaults (the config schema's: a test checks).
        check_layout: ``(dims, options, pad_to_multiple_of)``: refuse options the layout does not take, before any
            model or process group (``AxisError`` naming the axis).
        check_model: ``(config, dims, options, head)``: refuse a model the layout cannot split, from its config.
        check_family: ``(config, head)``: raise ``ConfigError`` when the axis cannot split this family's model at
            all (``trainable_axes``: the planner offers the axis only when this passes).
        padding_multiple: ``(dims, options) -> int``: what every batch's length must be a multiple of (1: any).
        apply: ``(model, groups, options, *, head, rng_tracker) -> model``: change the model's layers over this
            rank's group (in place; collective over the axis's group); ``_whole`` for an axis that wraps the model
            instead (the pipeline's stages, data parallelism).
        not_built: ``feature -> why`` for the :data:`NOT_BUILT` features it does not compose with yet.
        per_token_not_with: the axes a per-token head (a language model's, a token classifier's) does not run
            together with this one yet.
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    check_layout: Callable[[ParallelDims, Options, int | None], None] = _nothing
    check_model: Callable[[Any, ParallelDims, Options, str], None] = _nothing
    check_family: Callable[[Any, str | None], None] | None = None
    padding_multiple: Callable[[ParallelDims, Options], int] = lambda dims, options: 1
    apply: Callable[..., nn.Module] = _whole
    not_built: Mapping[str, str] = field(default_factory=dict)
    per_token_not_with: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.not_built) - set(NOT_BUILT)
        if unknown:
            raise ValueError(f"not_built names {', '.join(sorted(unknown))}, not features of {', '.join(NOT_BUILT)}")


NO_OPS = AxisOps()
"""An axis whose module is None (data parallelism: the caller wraps the model)."""


def ops_of(axis: str | AxisSpec) -> AxisOps:
    """The :class:`AxisOps` of an axis (its module's ``AXIS``, imported on first use)."""
    spec = SPEC[axis] if isinstance(axis, str) else axis
    return NO_OPS if spec.module is None else importlib.import_module(spec.module).AXIS


def declared() -> Iterator[tuple[AxisSpec, AxisOps]]:
    """Every declared axis with its ops, in the declared order (``AXIS_SPECS``: the order they are applied)."""
    for spec in AXIS_SPECS:
        yield spec, ops_of(spec)


def option_defaults() -> dict[str, Any]:
    """Every option some axis reads, with its default (the union over the axes, in the declared order)."""
    options: dict[str, Any] = {}
    for _, ops in declared():
        options.update(ops.options)
    return options


def with_defaults(given: Options) -> dict[str, Any]:
    """``given`` completed with the axes' defaults; ``TypeError`` naming an option no axis reads.

    Args:
        given: options by name (a hand-written call's keywords, or the config section's fields).
    """
    defaults = option_defaults()
    unknown = [name for name in given if name not in defaults]
    if unknown:
        raise TypeError(f"no parallel axis takes the option(s) {', '.join(unknown)} (options: {', '.join(defaults)})")
    return {**defaults, **given}


def not_built(dims: ParallelDims, feature: str) -> Iterator[tuple[str, int, str]]:
    """``(axis, size, why)`` for each axis of the layout in use (size > 1) that does not compose with ``feature``
    yet (a :data:`NOT_BUILT` key)."""
    if feature not in NOT_BUILT:
        raise ValueError(f"{feature!r} is not one of {', '.join(NOT_BUILT)}")
    for spec, ops in declared():
        size = dims.size(spec.name)
        if size > 1 and feature in ops.not_built:
            yield spec.name, size, ops.not_built[feature]


def per_token_layouts_not_built() -> tuple[tuple[str, ...], ...]:
    """The axis pairs a per-token head does not run together yet, ``(other, axis)``."""
    return tuple((other, spec.name) for spec, ops in declared() for other in ops.per_token_not_with)


def padding_multiple(dims: ParallelDims, options: Options) -> int:
    """The least common multiple of what each axis needs every batch's length padded to (1: any length)."""
    return math.lcm(*(ops.padding_multiple(dims, options) for _, ops in declared()))


def label(axis: str) -> str:
    """What a message calls the axis: ``"context parallelism"``."""
    return f"{SPEC[axis].label}ism"
