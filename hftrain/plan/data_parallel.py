"""Data-parallel strategies: DDP, ZeRO-1/2/3 (with offload) and FSDP, as data plus one estimator.

Model states per GPU follow the ZeRO paper over N = world ranks (Adam; K bytes of optimizer state per
parameter): DDP (2+2+K)Ψ, ZeRO-1 (2+2)Ψ + KΨ/N, ZeRO-2 2Ψ + (2+K)Ψ/N, ZeRO-3 (2+2+K)Ψ/N, with the bytes per
state of ``formulas.state_bytes`` (mixed precision under DeepSpeed 2/2/12, under Accelerate's autocast 4/4/8,
fp32 4/4/8 plus DeepSpeed's fp32 master copy at ZeRO-1/2; at ZeRO-3 the master is the parameter partition). FSDP
shards like ZeRO-3, but with gradient accumulation Accelerate runs it under ``no_sync``, which keeps whole unsharded
gradients between micro-batches (measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import hftrain.plan.formulas as formulas
from hftrain.plan.common import activation_bytes, finish
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec
from hftrain.plan.rows import Row, Workload


@dataclass(frozen=True)
class Sharding:
    """What a data-parallel strategy shards over the N ranks, and where it keeps what.

    Args:
        strategy: hftrain's ``strategy`` section.
        params: parameters sharded.
        grads: gradients sharded.
        optimizer: optimizer state sharded.
        deepspeed: DeepSpeed's ZeRO optimizer (bf16 states + fp32 master) rather than Accelerate's.
        offload_optimizer: optimizer state and step on the CPU.
        offload_params: parameters on the CPU.
        formula: the paper's per-GPU model-state formula (mixed precision).
    """

    strategy: dict
    params: bool
    grads: bool
    optimizer: bool
    deepspeed: bool
    offload_optimizer: bool = False
    offload_params: bool = False
    formula: str = ""


STRATEGIES: dict[str, Sharding] = {
    "ddp": Sharding({"name": "ddp"}, False, False, False, False, formula="(2+2+12)Ψ = 16Ψ"),
    "zero1": Sharding({"name": "zero1"}, False, False, True, True, formula="(2+2)Ψ + 12Ψ/N"),
    "zero2": Sharding(
        {"name": "zero2"}, False, True, True, True, formula="2Ψ + (2+12)Ψ/N + 2·(largest tensor) straddling partitions"
    ),
    "zero3": Sharding({"name": "zero3"}, True, True, True, True, formula="(2+2+12)Ψ/N"),
    "fsdp": Sharding(
        {"name": "fsdp", "fsdp_version": 2},
        True,
        True,
        True,
        False,
        formula="16Ψ/N (accumulation > 1: + whole gradients under no_sync)",
    ),
    "zero2_offload": Sharding(
        {"name": "zero2", "offload_optimizer": True},
        False,
        True,
        True,
        True,
        True,
        formula="GPU 2Ψ + 2Ψ/N (+ straddling tensor); CPU (4+12)Ψ/N per GPU",
    ),
    "zero3_offload": Sharding(
        {"name": "zero3", "offload_optimizer": True, "offload_params": True},
        True,
        True,
        True,
        True,
        True,
        True,
        formula="GPU gathered layers; CPU (2+4+12)Ψ/N per GPU",
    ),
}


def estimate(label: str, model: ModelSpec, work: Workload, hw: Hardware) -> Row:
    """One data-parallel row: per-GPU model states, activations, communication and time.

    Args:
        label: a key of ``STRATEGIES``.
        model: the model.
        work: the workload.
        hw: the hardware.
    """
    spec = STRATEGIES[label]
    n = hw.world
    # ZeRO-3's fp32 master is its parameter partition (hftrain aliases them); ZeRO-1/2 keep a copy
    sb = formulas.state_bytes(work.precision, deepspeed=spec.deepspeed, shared_master=spec.params)
    psi, trained = model.parameters, _trained(model, work)
    params = psi * sb.params / (n if spec.params else 1)
    grads = trained * sb.grads / (n if spec.grads else 1)
    if spec.grads and not spec.params and n > 1:
        grads += _straddling(model, trained) * sb.grads
    accumulating = label == "fsdp" and work.accumulation > 1
    if accumulating:
        grads = trained * sb.grad_accumulation  # Accelerate's no_sync keeps whole unsharded gradients
    optimizer = trained * sb.optimizer / (n if spec.optimizer else 1)
    row = Row(
        label,
        dict(spec.strategy),
        1,
        1,
        n,
        params,
        grads,
        optimizer,
        activation_bytes(model, work, hw, layers=model.layers),
    )
    row.working = _working(spec, model, sb, trained)
    if spec.offload_optimizer:
        row.cpu_per_node = (optimizer + trained * 4 / n) * hw.gpus_per_node  # + DeepSpeed's fp32 gradient copy
        row.optimizer = 0.0
    if spec.offload_params:
        row.cpu_per_node += params * hw.gpus_per_node
        row.params = 0.0
    row.comm = _communication(label, spec, psi, trained, sb, work, hw)
    row.formulas["model states"] = (
        spec.formula
        + f"; bytes per parameter {sb.params}+{sb.grads}+{sb.optimizer}"
        + (
            " (fp32: DeepSpeed keeps a fp32 master copy, +4Ψ/N)"
            if work.precision == "fp32" and spec.deepspeed and not spec.params
            else ""
        )
    )
    if accumulating:
        row.notes.append("accumulation > 1: Accelerate's no_sync keeps whole gradients between micro-batches")
    return finish(row, model, work, hw)


def _straddling(model: ModelSpec, trained: float) -> float:
    """Elements of the one gradient that ZeRO-2 keeps whole on the rank where a tensor straddles two partitions
    (DeepSpeed 0.19.8, measured): at most the largest tensor; the most loaded rank is the one that must fit."""
    return min(model.largest_layer_parameters, trained)


def _trained(model: ModelSpec, work: Workload) -> float:
    """Parameters with gradients and optimizer state: all, or LoRA's adapters."""
    return model.lora_parameters(work.lora_rank) if work.lora_rank else model.parameters


def _working(spec: Sharding, model: ModelSpec, sb: formulas.StateBytes, trained: float) -> float:
    """Transient buffers: gathered layers (current + prefetched) when parameters are sharded (hftrain's ZeRO-3 limits
    keep about two layers gathered: ``stage3_max_live_parameters`` 24h²); DeepSpeed's gradient-reduction bucket,
    ``reduce_bucket_size`` elements: h² in hftrain's shipped JSONs (``strategies.deepspeed.MODEL_SIZED``; DeepSpeed's
    own default, 5e8, held a whole model below 500M parameters)."""
    gathered = 2 * model.largest_layer_parameters * sb.params if spec.params else 0.0
    bucket = min(model.hidden**2, trained) * sb.grads if spec.deepspeed and not spec.offload_optimizer else 0.0
    return gathered + bucket


def _communication(
    label: str, spec: Sharding, psi: float, trained: float, sb: formulas.StateBytes, work: Workload, hw: Hardware
) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step, per link.

    DDP: one all-reduce of the gradients per step (no_sync between micro-batches). ZeRO-1: reduce-scatter of
    the gradients + all-gather of the updated parameters (the same volume). ZeRO-2: the reduce-scatter after
    every micro-batch. ZeRO-3/FSDP: parameters all-gathered in forward and again in backward for every
    micro-batch (≈ 1.5× DDP's volume at accumulation 1), gradients reduce-scattered. Offload adds host<->GPU
    copies of the gradient partition and the updated parameters.
    """
    n, m = hw.world, work.accumulation
    grads, params = trained * sb.grads, psi * sb.params
    if label == "ddp":
        volume = formulas.all_reduce_bytes(grads, n)
    elif not spec.grads:  # ZeRO-1
        volume = formulas.all_gather_bytes(grads, n) + formulas.all_gather_bytes(params, n)
    elif not spec.params:  # ZeRO-2 (offload too)
        volume = m * formulas.all_gather_bytes(grads, n) + formulas.all_gather_bytes(params, n)
    else:  # ZeRO-3 / FSDP
        reductions = 1 if label == "fsdp" else m
        volume = 2 * m * formulas.all_gather_bytes(params, n) + reductions * formulas.all_gather_bytes(grads, n)
    comm = {"inter" if hw.nodes > 1 else "intra": volume}
    if spec.offload_optimizer:
        comm["pcie"] = (trained * 4 + psi * sb.params) / n * (m if spec.offload_params else 1)
    return comm
