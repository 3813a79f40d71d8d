"""Pipeline-parallel checkpoint state and export weights: the logical full tensors, merged over the stages.

Each stage owns some of the model's parameters (its chunks'); under tensor parallelism it holds shards of them.
Saving gathers each stage's tensors over its tp group (``hftrain.checkpoint.logical``'s way), then over the pp
group, and global rank 0 writes exactly the files a ``pp = 1`` megatron run writes (``model.safetensors``,
``optimizer.pt`` keyed by HF names, ``layout.json``). The format does not depend on ``pp``, so a checkpoint of
any ``tp × pp × dp`` resumes on any other that fits the model (with the same global batch). Loading reads the
full files on every rank; each keeps its stages' slices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hftrain.checkpoint.logical import (
    FORMAT,
    LAYOUT_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    _full_optimizer_state,
    _local_optimizer_state,
    check_layout,
)


def _merged_over_stages(part: dict[str, Any], pp_group: Any) -> list[dict[str, Any]]:
    """Every stage's ``part`` (collective over the pp group)."""
    parts: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, part, group=pp_group)
    return parts


def merged_weights(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], groups: Any) -> dict[str, Any]:
    """The full weights with HF names, merged over tp and pp (collective over both; every caller gets them).

    Args:
        model: the tensor-parallel HF model (every rank holds the object; only its stages' parameters are live).
        params: HF name -> this rank's stage parameter.
        groups: the run's ``ParallelGroups``.
    """
    from hftrain.parallel import gather_full_tensors

    parameter_names = {name for name, _ in model.named_parameters()}
    # Buffers are not trained: the first stage contributes them; each parameter comes from the stage owning it.
    local = {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if name in params or (name not in parameter_names and groups.pp_rank == 0)
    }
    full = gather_full_tensors(local, model, tp_group=groups.tp_group)
    merged: dict[str, torch.Tensor] = {}
    for part in _merged_over_stages({k: v.cpu() for k, v in full.items()}, groups.pp_group):
        merged.update(part)
    return merged


def _merged_optimizer_state(model: torch.nn.Module, optimizer: Any, groups: Any) -> dict[str, Any]:
    """The logical optimizer state of the whole model (collective over tp and pp)."""
    parts = _merged_over_stages(_full_optimizer_state(model, optimizer, groups), groups.pp_group)
    state = {name: values for part in parts for name, values in part["state"].items()}
    param_groups = [
        {**group, "params": [name for part in parts for name in part["param_groups"][i]["params"]]}
        for i, group in enumerate(parts[0]["param_groups"])
    ]
    return {"state": state, "param_groups": param_groups}


def save_pipeline_state(
    directory: str | Path,
    model: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    optimizer: Any,
    *,
    groups: Any,
    layout: dict[str, int],
) -> None:
    """Write the full model and optimizer state as ``save_logical_state`` does (collective over dp replica 0).

    Args:
        directory: the checkpoint's ``state/`` folder (exists on the main process).
        model: the tensor-parallel HF model.
        params: HF name -> this rank's stage parameter.
        optimizer: the inner optimizer over ``params``.
        groups: the run's ``ParallelGroups``.
        layout: ``{"tp", "dp", "pp", "world_size"}``.
    """
    if groups.dp_rank != 0:  # the other replicas hold the same stages and shards
        return
    weights = merged_weights(model, params, groups)
    optimizer_state = _merged_optimizer_state(model, optimizer, groups)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        directory = Path(directory)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / MODEL_FILE))
        torch.save(optimizer_state, directory / OPTIMIZER_FILE)
        (directory / LAYOUT_FILE).write_text(json.dumps({"format": FORMAT, **layout}) + "\n")


def load_pipeline_state(
    directory: str | Path,
    model: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    optimizer: Any,
    *,
    layout: dict[str, int],
) -> None:
    """Load a logical checkpoint (of any pp, tp and dp) into this rank's stages and optimizer (no collective).

    Args:
        directory: the checkpoint's ``state/`` folder.
        model: the tensor-parallel HF model (all its parameters are loaded; the stages' are the live ones).
        params: HF name -> this rank's stage parameter.
        optimizer: the inner optimizer over ``params``.
        layout: this run's ``{"tp", "dp", "pp", "world_size"}``.
    """
    from safetensors.torch import load_file

    from hftrain.parallel import load_full_state_dict

    directory = Path(directory)
    check_layout(directory, layout)
    load_full_state_dict(model, load_file(str(directory / MODEL_FILE)))
    saved = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    mine = {
        "state": {name: values for name, values in saved["state"].items() if name in params},
        "param_groups": [
            {**group, "params": [name for name in group["params"] if name in params]} for group in saved["param_groups"]
        ],
    }
    optimizer.load_state_dict(_local_optimizer_state(model, optimizer, mine))
