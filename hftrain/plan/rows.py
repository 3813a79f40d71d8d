"""The planner's data: the workload, one estimated row per strategy/layout, and the plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hftrain.errors import ConfigError
from hftrain.parallel.axes import SPEC


@dataclass(frozen=True)
class Workload:
    """How the model is trained.

    Args:
        precision: ``bf16``, ``fp16`` or ``fp32``.
        micro_batch: sequences per GPU per forward/backward (b).
        seq: sequence length (s).
        accumulation: micro-batches per optimizer step (m; the pipeline's micro-batches too).
        lora_rank: LoRA r (0: full fine-tuning).
        recompute: activation recomputation, ``"full"`` (every layer keeps its input) or ``"selective"`` (the
            attention scores are recomputed), as ``training.gradient_checkpointing``; None: off.
        dropout: dropout on (its masks are saved for backward).
        fused_attention: a fused attention kernel (flash / SDPA) that saves no a·s² scores.
    """

    precision: str = "bf16"
    micro_batch: int = 8
    seq: int = 512
    accumulation: int = 1
    lora_rank: int = 0
    recompute: str | None = None
    dropout: bool = True
    fused_attention: bool = True

    @property
    def element(self) -> int:
        """Bytes per activation element."""
        return 4 if self.precision == "fp32" else 2

    def validate(self) -> Workload:
        """Refuse sizes that cannot train (one line, naming the option)."""
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"--precision {self.precision!r}: choose bf16, fp16 or fp32")
        for name, value in (
            ("--micro-batch", self.micro_batch),
            ("--seq", self.seq),
            ("--accumulation", self.accumulation),
        ):
            if value < 1:
                raise ConfigError(f"{name} {value}: must be a positive integer")
        if self.recompute not in (None, "full", "selective"):
            raise ConfigError(f"--recompute {self.recompute!r}: choose full or selective")
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank {self.lora_rank}: must be >= 0 (0 = full fine-tuning)")
        return self


@dataclass
class Row:
    """One strategy/layout's estimate, per GPU (bytes) and per step.

    Args:
        label: the row's name in the table (``zero2``, ``megatron tp2·pp2·dp2``...).
        strategy: the options for it, flat (``name``, ``tp``, ``pp``, ...: fields of the ``strategy`` and
            ``parallelism`` sections; ``hftrain.plan.configs.job_config`` puts each in its section).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dp: data-parallel size.
        params: parameter bytes per GPU.
        grads: gradient bytes per GPU.
        optimizer: optimizer-state bytes per GPU (fp32 master weights included).
        activations: bytes saved for backward per GPU.
        working: transient buffers (ZeRO-3/FSDP gathered layers, DeepSpeed's reduce bucket).
        sizes: the sizes of the other axes (``hftrain.plan.terms``: context parallelism's c, expert parallelism's
            e), by name; an axis absent is 1 (:meth:`size`).
        figures: the terms' own per-GPU figures, by name (``AxisTerm.figures``: a MoE model's ``experts``, the
            bytes of its routed experts' params, grads and Adam state on this GPU, and ``all_to_all``, the bytes
            this GPU sends by all-to-all per MoE layer and micro-batch, forward + backward).
        cpu_per_node: bytes of CPU memory per node that offload needs.
        comm: bytes each GPU sends per optimizer step, per link class (``intra``, ``inter``, ``pcie``).
        comm_seconds: the step's communication time at the hardware's bandwidths (not overlapped).
        compute_seconds: 6·Ψ·tokens (8· with recomputation, 4· for LoRA) / (t·p · TFLOP/s · efficiency).
        bubble: the pipeline bubble fraction.
        step_seconds: compute/(1 − bubble) + communication.
        tokens_per_second: global tokens per step / step time.
        formulas: the formula behind each figure.
        runnable: whether this hftrain can run it (every row it estimates today; False marks a formula-only row).
        fits: whether GPU (and offload CPU) memory suffice.
        notes: remarks (what limits it, what is assumed).
    """

    label: str
    strategy: dict[str, Any]
    tp: int
    pp: int
    dp: int
    params: float
    grads: float
    optimizer: float
    activations: float
    working: float = 0.0
    sizes: dict[str, int] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    cpu_per_node: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)
    comm_seconds: float = 0.0
    compute_seconds: float = 0.0
    bubble: float = 0.0
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    formulas: dict[str, str] = field(default_factory=dict)
    runnable: bool = True
    fits: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Per-GPU bytes: model states + activations + working buffers."""
        return self.model_states + self.activations + self.working

    def size(self, axis: str) -> int:
        """The size of one of the other axes (:attr:`sizes`; 1 when absent).

        Args:
            axis: an axis name of ``hftrain.parallel.axes.SPEC``.
        """
        return self.sizes.get(axis, 1)

    @property
    def model_split(self) -> int:
        """GPUs that split one model replica's compute: ``tp · pp`` times the other axes not carved out of dp
        (``tp · pp · cp``: experts are split over dp ranks)."""
        carved = {axis for axis in self.sizes if SPEC[axis].carved_from}
        return self.tp * self.pp * math.prod(size for axis, size in self.sizes.items() if axis not in carved)


@dataclass
class Plan:
    """The answer: every row, the recommendation (or the nearest option when nothing fits) and why.

    Args:
        model: the ``ModelSpec`` planned for.
        hardware: the ``Hardware``.
        workload: the ``Workload``.
        rows: one per strategy/layout the hardware admits.
        recommended: index of the recommended row, or None when nothing fits.
        nearest: index of the row closest to fitting when nothing fits.
        reasons: why the recommendation (or what the nearest option would need).
    """

    model: Any
    hardware: Any
    workload: Workload
    rows: list[Row]
    recommended: int | None
    nearest: int | None
    reasons: list[str]

    @property
    def choice(self) -> Row:
        """The recommended row, or the nearest one when nothing fits."""
        index = self.recommended if self.recommended is not None else self.nearest
        return self.rows[index]

    def row(self, label: str) -> Row:
        """The row named ``label`` (``--row``).

        Args:
            label: a row label as the table prints it.
        """
        for row in self.rows:
            if row.label == label:
                return row
        raise ConfigError(
            f"--row {label!r} is not a row of this plan; choose one of: " + ", ".join(r.label for r in self.rows)
        )
