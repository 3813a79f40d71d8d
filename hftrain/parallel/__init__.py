"""hftrain's Megatron-style parallelism: the PTD rank layout, tensor-parallel layers, plans and state conversion.

Names are imported lazily so that ``hftrain groups`` and ``hftrain --help`` do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ParallelDims": "dims",
    "ParallelGroups": "dims",
    "build_groups": "dims",
    "format_groups": "dims",
    "TensorParallelPlan": "plans",
    "FAMILIES": "families",
    "HEADS": "heads",
    "StageHead": "heads",
    "check_tensor_parallel": "families",
    "sequence_multiple": "plans",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "VocabParallelHead": "layers",
    "vocab_parallel_cross_entropy": "cross_entropy",
    "apply_tensor_parallel": "tensor_parallel",
    "parallelize_layer": "tensor_parallel",
    "check_replicas_agree": "tensor_parallel",
    "RNGTracker": "random",
    "record_collectives": "collectives",
    # the composition of the axes: one apply call each, and their refusals before any process group
    **dict.fromkeys(
        (
            "parallelize_model",
            "check_layout",
            "check_model",
            "padding_multiple",
            "LANGUAGE_MODEL_LAYOUTS_NOT_BUILT",
        ),
        "parallelize",
    ),
    # where each parameter lives, and what is written once over the records (issue 38)
    **dict.fromkeys(
        (
            "Split",
            "Placement",
            "place",
            "placed",
            "placements",
            "split_over",
            "complete_grads",
            "sum_partial_grads",
            "ddp_ignored",
            "clip_grad_norm_",
            "gather_full_tensors",
            "full_state_dict",
            "shard_full_tensor",
            "load_full_state_dict",
        ),
        "placement",
    ),
    # pipeline parallelism (issue 8)
    **dict.fromkeys(
        (
            "stage_layer_ranges",
            "stage_ranges",
            "other_stages_modules",
            "build_stage_modules",
            "chunk_ids_of_rank",
            "release_other_stages",
        ),
        "pipeline",
    ),
    **dict.fromkeys(("SCHEDULES", "PipelineSchedule", "build_schedule", "check_schedule"), "schedules"),
    **dict.fromkeys(("TimelineRecorder", "render_timeline", "measured_bubble", "theoretical_bubble"), "timeline"),
    "gather_events": "timeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hftrain.parallel' has no attribute '{name}'")
    return getattr(importlib.import_module(f"hftrain.parallel.{_EXPORTS[name]}"), name)
