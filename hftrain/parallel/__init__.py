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
    "check_tensor_parallel": "families",
    "sequence_multiple": "plans",
    "TPShard": "layers",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "VocabParallelHead": "layers",
    "vocab_parallel_cross_entropy": "cross_entropy",
    "apply_tensor_parallel": "tensor_parallel",
    "parallelize_layer": "tensor_parallel",
    "sharded_parameters": "tensor_parallel",
    "gather_full_tensors": "tensor_parallel",
    "full_state_dict": "tensor_parallel",
    "shard_full_tensor": "tensor_parallel",
    "load_full_state_dict": "tensor_parallel",
    "finalize_tp_grads": "tensor_parallel",
    "check_replicas_agree": "tensor_parallel",
    "RNGTracker": "random",
    "clip_grad_norm_": "tensor_parallel",
    "record_collectives": "collectives",
    "parallelize_model": "parallelize",
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
