"""Estimate every strategy and layout the hardware admits, and choose one."""

from __future__ import annotations

import dataclasses
import math

import hftrain.plan.data_parallel as data_parallel
import hftrain.plan.model_parallel as model_parallel
from hftrain.errors import ConfigError
from hftrain.parallel.dims import AXIS_SIZES, SPEC
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec
from hftrain.plan.rows import Plan, Row, Workload

MAX_NODES_TRIED = 4096  # "what it would need": the node count at which something fits, searched up to this


def _no_layout(hw: Hardware, fixed: dict[str, int]) -> str:
    """Why no layout has the sizes ``fixed`` (their product, times any searched axis, must divide the GPUs)."""
    given = " ".join(f"--{axis} {size}" for axis, size in fixed.items() if size > 1) or "the sizes given"
    # an axis carved out of dp (ep) splits dp: not a factor of the layout's tp·pp·cp
    product = math.prod(size for axis, size in fixed.items() if SPEC[axis].carved_from is None)
    return (
        f"{given}: no layout of {hw.world} GPUs ({hw.nodes} node(s) × {hw.gpus_per_node}) has these sizes "
        f"(tp·pp·cp = {product} must divide the GPU count, and the model's sizes); give sizes that divide "
        f"{hw.world}, or --gpus-per-node / --nodes so that {product} divides their product"
    )


def estimate_rows(model: ModelSpec, hw: Hardware, work: Workload, **fixed: int | None) -> list[Row]:
    """Every data-parallel strategy and every admitted model-parallel layout (only layouts when an axis is fixed
    above 1).

    Args:
        model: the model.
        hw: the hardware.
        work: the workload.
        **fixed: an axis of ``hftrain.parallel.dims.AXIS_SIZES`` -> its only size (None: any, as
            :func:`~hftrain.plan.model_parallel.fixed_layouts` searches it).
    """
    unknown = sorted(set(fixed) - set(AXIS_SIZES))
    if unknown:
        raise TypeError(f"plan: '{unknown[0]}' is not an axis; give sizes of {', '.join(AXIS_SIZES)}")
    split = any((size or 1) > 1 for size in fixed.values())
    rows = [] if split else [data_parallel.estimate(label, model, work, hw) for label in data_parallel.STRATEGIES]
    return rows + [
        model_parallel.estimate(model=model, work=work, hw=hw, **layout)
        for layout in model_parallel.fixed_layouts(model, hw, **fixed)
    ]


def plan(
    model: ModelSpec,
    hardware: Hardware,
    workload: Workload | None = None,
    **fixed: int | None,
) -> Plan:
    """The plan: per-GPU memory, communication and time for each option, and one recommendation with reasons.

    The recommendation is the fitting row that this hftrain runs with the highest estimated throughput
    (tokens/s; ties go to the simpler strategy, in table order); a formula-only row only when nothing runnable
    fits. When nothing fits, ``nearest`` names the row closest to fitting and ``reasons`` what it would need.

    Args:
        model: a ``ModelSpec`` (``model_from_config`` / ``model_from_sizes``).
        hardware: a ``Hardware``.
        workload: a ``Workload`` (defaults: bf16, micro-batch 8, sequence 512).
        **fixed: consider only layouts with these sizes: ``tp=2``, ``pp=4``, ``cp=2`` (sequences split over cp
            GPUs; 1 when not given), ``ep=8`` (a MoE model's experts split over ep GPUs); an axis not given is
            searched (``hftrain.parallel.dims.AXIS_SIZES`` lists them).
    """
    work = (workload or Workload()).validate()
    hw = hardware.validate()
    rows = estimate_rows(model, hw, work, **fixed)
    if not rows:  # every row is a layout of the fixed sizes, and none of them divides the GPUs
        raise ConfigError(_no_layout(hw, {axis: size for axis, size in fixed.items() if size is not None}))
    fitting = [i for i, r in enumerate(rows) if r.fits]
    runnable = [i for i in fitting if rows[i].runnable] or fitting
    if runnable:
        best = max(runnable, key=lambda i: (round(rows[i].tokens_per_second, -1), -i))
        return Plan(model, hw, work, rows, best, None, _reasons(rows, best, runnable, hw))
    nearest = min(range(len(rows)), key=lambda i: _overflow(rows[i], hw))
    return Plan(model, hw, work, rows, None, nearest, _needs(rows[nearest], model, hw, work, **fixed))


def _overflow(row: Row, hw: Hardware) -> float:
    """How far over its memory a row is (1.0 = exactly full; the larger of GPU and CPU)."""
    cpu = row.cpu_per_node / hw.cpu_memory if hw.cpu_memory else (0.0 if not row.cpu_per_node else float("inf"))
    return max(row.total / hw.usable_memory, cpu)


def _reasons(rows: list[Row], best: int, candidates: list[int], hw: Hardware) -> list[str]:
    row = rows[best]
    reasons = [
        f"{row.label} fits: {row.total / 1e9:.2f} GB of {hw.usable_memory / 1e9:.1f} GB usable per GPU "
        f"(model states {row.model_states / 1e9:.2f} GB, activations {row.activations / 1e9:.2f} GB)",
        f"highest estimated throughput of the {len(candidates)} fitting option(s): "
        f"{row.tokens_per_second:,.0f} tokens/s (step {row.step_seconds * 1e3:.1f} ms, of which communication "
        f"{row.comm_seconds * 1e3:.1f} ms)",
    ]
    others = sorted((i for i in candidates if i != best), key=lambda i: -rows[i].tokens_per_second)
    if others:
        runner = rows[others[0]]
        reasons.append(f"next: {runner.label} at {runner.tokens_per_second:,.0f} tokens/s")
    unfit = [r.label for r in rows[:best] if not r.fits]
    if unfit:
        reasons.append(f"simpler options that do not fit: {', '.join(unfit)}")
    if not row.runnable:
        reasons.append("formula only: this hftrain cannot run it")
    return reasons


def _needs(row: Row, model: ModelSpec, hw: Hardware, work: Workload, **fixed: int | None) -> list[str]:
    """What the nearest option lacks, and the smallest node count (same nodes) at which something fits."""
    reasons = [f"nothing fits; nearest: {row.label}: " + "; ".join(row.notes or ["over memory"])]
    needed = row.total - hw.usable_memory
    if needed > 0:
        reasons.append(
            f"it would need {needed / 1e9:.2f} GB more per GPU (--gpu-memory {(row.total + hw.reserve) / 1e9:.1f})"
        )
    nodes = hw.nodes * 2
    while nodes <= MAX_NODES_TRIED:
        bigger = dataclasses.replace(hw, nodes=nodes)
        fitting = [r for r in estimate_rows(model, bigger, work, **fixed) if r.fits]
        if fitting:
            reasons.append(f"or {nodes} nodes ({nodes * hw.gpus_per_node} GPUs), where {fitting[0].label} fits")
            break
        nodes *= 2
    if work.micro_batch > 1 or not work.recompute:
        reasons.append("or less activation memory: --recompute, a smaller --micro-batch (with more --accumulation)")
    return reasons
