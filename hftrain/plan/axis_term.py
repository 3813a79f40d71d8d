"""What one parallel axis adds to the planner's megatron rows: the :class:`AxisTerm` interface, and the
:class:`Frame` of one layout that each term reads.

The generic estimator (``hftrain.plan.model_parallel``) knows tensor and pipeline parallelism and data parallelism;
every other axis is one module of this package exposing one :class:`AxisTerm` (its row's strategy keys, label part,
the positions one GPU holds, the parameters it splits apart, its memory and communication terms and their formula
text, the sizes it searches, its checks of a fixed size), listed once in ``hftrain.plan.terms.TERMS``. Where the
generic code needs a trait of an axis (is it carved out of dp? flattened with dp into the gradient group? where in
the rank order?), it reads ``hftrain.parallel.axes.SPEC``; this module names no axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hftrain.parallel.axes import SPEC
from hftrain.plan.formulas import StateBytes
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec
from hftrain.plan.rows import Row, Workload


@dataclass(frozen=True)
class Frame:
    """One megatron layout being estimated, as every term sees it (the most loaded stage's GPU).

    Args:
        model: the model.
        work: the workload.
        local: the workload one GPU computes (each term's :meth:`AxisTerm.local_work` applied: s/c positions).
        hw: the hardware.
        tp: tensor-parallel size t.
        pp: pipeline-parallel size p.
        dp: data-parallel size (the world over t·p and the terms' mesh axes).
        sizes: every term's axis -> its size (1 when off).
        state_bytes: bytes per parameter (params, grads, Adam) at the workload's precision.
        shard_optimizer: ZeRO-1 shards the Adam state over dp.
    """

    model: ModelSpec
    work: Workload
    local: Workload
    hw: Hardware
    tp: int
    pp: int
    dp: int
    sizes: Mapping[str, int]
    state_bytes: StateBytes
    shard_optimizer: bool

    def size(self, axis: str) -> int:
        """The size of any axis of the layout: a term's (1 when off), or t, p, dp (this record's fields)."""
        return self.sizes[axis] if axis in self.sizes else int(getattr(self, axis, 1))

    @property
    def replicas(self) -> int:
        """The ranks a replicated gradient is all-reduced over: dp times the axes flattened with it (dp × cp,
        ``AxisSpec.flattened_with``)."""
        return self.dp * math.prod(size for axis, size in self.sizes.items() if SPEC[axis].flattened_with)

    def inner_ranks(self, parent: str) -> int:
        """How many consecutive ranks one rank of the mesh axis ``parent`` spans: t times the terms' mesh axes
        inside it in the rank order (``AxisSpec.stride``): a run of ``parent``'s ranks is that many apart."""
        stride = SPEC[parent].stride or 0
        strides = {axis: SPEC[axis].stride for axis in self.sizes}
        return self.tp * math.prod(
            size for axis, size in self.sizes.items() if strides[axis] is not None and strides[axis] < stride
        )


@dataclass(frozen=True)
class HeldStates:
    """Parameters one GPU holds apart from the rest of its stage, split by an axis other than tp and replicated over
    fewer ranks (a MoE model's routed experts: over dp/e).

    Args:
        parameters: how many of them the GPU holds.
        trained: how many of those are trained (0 when frozen, e.g. under LoRA).
        optimizer_ranks: the ranks ZeRO-1 shards their Adam state over.
        gradient_ranks: the ranks their gradients are all-reduced over.
    """

    parameters: float
    trained: float
    optimizer_ranks: int
    gradient_ranks: int


@dataclass(frozen=True)
class AxisTerm:
    """What one axis adds to a megatron row. Every method has the neutral default (the axis off, or nothing of
    its own), so a term overrides only what its axis changes.

    Args:
        axis: the axis's name (``hftrain.parallel.axes.SPEC``, ``Row.sizes``, ``--<axis>``, the strategy key).
        figures: the per-row figures it reports (``Row.figures`` keys; in ``--json`` every row has them, 0 when
            the term sets none).
        formulas: the plan's formula text it adds to ``--json``'s ``formulas``.
    """

    axis: str
    figures: tuple[str, ...] = ()
    formulas: Mapping[str, str] = field(default_factory=dict)

    @property
    def carved(self) -> bool:
        """Whether the axis is carved out of another (ep out of dp: it adds no factor to t·p·…·dp)."""
        return SPEC[self.axis].carved_from is not None

    def check(self, model: ModelSpec, fixed: Mapping[str, int | None]) -> None:
        """Refuse a fixed size (``--<axis>``) the model or the other fixed sizes do not admit, in one line.

        Args:
            model: the model.
            fixed: every axis the plan was given -> its size (None: searched).
        """

    def searched(self, model: ModelSpec, dp: int) -> list[int]:
        """The sizes searched in a layout of ``dp`` data-parallel ranks when none is fixed (an axis not carved
        out of dp is not searched: 1).

        Args:
            model: the model.
            dp: the layout's data-parallel size.
        """
        return [1]

    def splits_alone(self, model: ModelSpec) -> bool:
        """Whether the axis alone (t = p = 1) makes a layout of this model."""
        return False

    def no_layout(self, size: int, hw: Hardware) -> str:
        """The one-line refusal when a fixed size above 1 is in no layout.

        Args:
            size: the fixed size.
            hw: the hardware.
        """
        return f"--{self.axis} {size}: no layout of {hw.world} GPUs has it"

    def local_work(self, work: Workload, size: int) -> Workload:
        """The workload one GPU computes (the positions it holds)."""
        return work

    def keeps_sequence_parallel(self, size: int) -> bool:
        """Whether tp may still cut the sequence (sequence parallelism) at this size."""
        return True

    def keeps_shard_optimizer(self, size: int) -> bool:
        """Whether ZeRO-1 still runs at this size."""
        return True

    def label(self, size: int) -> str:
        """The row label's part (``""`` when off)."""
        return f"{self.axis}{size}" if size > 1 else ""

    def strategy(self, model: ModelSpec, tp: int, size: int) -> dict[str, Any]:
        """The row's strategy options (``parallelism`` fields) for this axis (none when off).

        Args:
            model: the model.
            tp: tensor-parallel size t.
            size: the axis's size.
        """
        return {self.axis: size} if size > 1 else {}

    def layer_parameters(self, model: ModelSpec, size: int) -> tuple[float, float]:
        """``(X, X_gpu)``: of one transformer layer's parameters (the mean over the layers), the ``X`` this axis
        splits instead of tp, and the ``X_gpu`` one GPU holds of them (0, 0 for an axis that splits none)."""
        return 0.0, 0.0

    def held(self, frame: Frame) -> HeldStates | None:
        """The stage's parameters this axis splits apart from the rest on one GPU (None: none)."""
        return None

    def unbuilt(self, frame: Frame) -> list[tuple[str, ...]]:
        """The axes this one is not built with in this layout (its row is formula only)."""
        return []

    def add_terms(self, row: Row, frame: Frame) -> None:
        """Add the axis's own memory figures, communication (``row.comm``, by link) and formula text to a row
        whose generic terms are filled in.

        Args:
            row: the row.
            frame: its layout.
        """

    def table_formulas(self, model: ModelSpec) -> list[str]:
        """Lines the plan's table adds under ``formulas`` for this model (none by default)."""
        return []
