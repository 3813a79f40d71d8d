"""Megatron's checkpoint state: this rank's boxes of every logical tensor, in the sharded format of every strategy.

Save (:func:`snapshot`): each parameter split by a :class:`~hftrain.parallel.layers.TPShard` gives the boxes its
slice occupies in the full HF-layout tensor (``TPShard.boxes``: packed query/key/value blocks as separate ranges,
vocabulary padding left out), an unsplit one the whole tensor; Adam's moments are boxed like their parameter. The
dp and cp replicas of a slice, and the tp ranks of an unsplit tensor, deal the writes out among themselves
(``split_replicated``), so each piece is written once, from live memory, with no gather: a rank's save costs its own
state. Under ``shard_optimizer`` (ZeRO-1 over dp) each dp rank writes the moments of the parameters it owns.
Load (:func:`load_snapshot`): the same boxes, filled in place from a checkpoint of any strategy and layout
(``hftrain.checkpoint.sharded``). :func:`iter_full_state` streams the full weights to rank 0 one tensor at a time
for the export; :func:`merged_weights` gathers them all (LoRA's adapter export).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hftrain.checkpoint.sharded import Chunked, Snapshot


def snapshot(
    model: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    optimizer: Any,
    *,
    groups: Any,
    info: dict[str, Any],
    share: bool = True,
) -> Snapshot:
    """This rank's boxes of the logical model and optimizer state (views of the live tensors; no collective).

    Each split parameter gives the boxes its :class:`~hftrain.parallel.layers.TPShard` places in the full tensor
    (vocabulary padding left out), a replicated one the whole tensor; Adam's moments are boxed like their
    parameter. Replicas (tp for replicated parameters, dp, cp) give the same boxes and DCP writes one of each.

    Args:
        model: the tensor-parallel HF model (unwrapped).
        params: HF name -> the parameters this rank owns (its stages' under pipeline parallelism).
        optimizer: the inner optimizer over ``params`` (``torch.optim`` or ``ZeroRedundancyOptimizer``, whose
            local optimizer holds the state of the parameters this dp rank owns).
        groups: the run's ``ParallelGroups`` (the first stage contributes the buffers; replicas share writes).
        info: the layout, for ``sharded.json``.
        share: keep only this rank's share of replicated boxes (a save: dp and cp replicas hold the same shards,
            tp ranks the same unsplit tensors; ``Chunked.share``); a load fills everything it holds.
    """
    from hftrain.checkpoint.sharded import MODEL_PREFIX, OPTIM_PREFIX, Snapshot, split_replicated
    from hftrain.parallel.expert_parallel import expert_parameters
    from hftrain.parallel.tensor_parallel import sharded_parameters

    experts = expert_parameters(model)  # slices along the expert dimension over ep, the same on every tp rank
    shards = {**sharded_parameters(model), **experts}
    buffers = _buffer_names(model)
    state, split, by_expert = {}, [], []  # keys of tensor-parallel slices, and of expert-parallel ones
    for name, tensor in model.state_dict().items():
        if name in params or (name in buffers and groups.pp_rank == 0):
            state[MODEL_PREFIX + name] = _boxes(name, tensor, shards)
            split += [MODEL_PREFIX + name] if name in shards and name not in experts else []
            by_expert += [MODEL_PREFIX + name] if name in experts else []
    names = {id(p): n for n, p in params.items()}
    zero1 = hasattr(optimizer, "optim")  # ZeroRedundancyOptimizer: each dp rank holds its parameters' state only
    for param, values in getattr(optimizer, "optim", optimizer).state.items():
        name = names[id(param)]
        for key, value in values.items():
            if torch.is_tensor(value):
                state[f"{OPTIM_PREFIX}{name}.{key}"] = _boxes(name, value, shards)
                sliced = name in shards and value.dim() > 0
                split += [f"{OPTIM_PREFIX}{name}.{key}"] if sliced and name not in experts else []
                by_expert += [f"{OPTIM_PREFIX}{name}.{key}"] if sliced and name in experts else []
    if not share:
        return Snapshot(state=state, param_groups=optimizer.param_groups, info=info, model=model)
    # dp × cp replicas hold the same slices, and tp ranks the same unsplit tensors: each is written by one holder
    replica, replicas = groups.dp_rank * groups.cp_size + groups.cp_rank, groups.dp_size * groups.cp_size
    sliced = set(split) | set(by_expert)
    unsplit = [key for key in state if key not in sliced and not (zero1 and key.startswith(OPTIM_PREFIX))]
    state = split_replicated(state, unsplit, replica * groups.tp_size + groups.tp_rank, replicas * groups.tp_size)
    if not zero1:
        state = split_replicated(state, split, replica, replicas)
    if by_expert:  # an expert slice is held by its edp replicas (dp ranks with the same ep rank) on every tp rank
        holder, holders = groups.dp_rank // groups.ep_size, groups.dims.edp
        state = split_replicated(state, by_expert, holder * groups.tp_size + groups.tp_rank, holders * groups.tp_size)
    return Snapshot(state=state, param_groups=optimizer.param_groups, info=info, model=model)


def load_snapshot(
    directory: str | Path,
    model: torch.nn.Module,
    params: dict[str, torch.nn.Parameter],
    optimizer: Any,
    *,
    groups: Any,
) -> None:
    """Fill this rank's parameters and optimizer state from a sharded checkpoint of any strategy and layout.

    Args:
        directory: the checkpoint's ``state/`` folder.
        model: the tensor-parallel HF model (unwrapped).
        params: HF name -> the parameters this rank owns.
        optimizer: the inner optimizer over ``params``.
        groups: the run's ``ParallelGroups``.
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from hftrain.checkpoint.sharded import read_snapshot

    _init_optim_state(getattr(optimizer, "optim", optimizer))  # the moments' tensors, to load into
    boxes = snapshot(model, params, optimizer, groups=groups, info={}, share=False)
    read_snapshot(directory, boxes.state, optimizer.param_groups)


def _boxes(name: str, tensor: torch.Tensor, shards: dict[str, Any]) -> Chunked:
    from hftrain.checkpoint.sharded import Chunked

    tensor = tensor.detach()
    shard = shards.get(name)
    if shard is None or tensor.dim() == 0:
        return Chunked.whole(tensor)
    return Chunked(shard.full_shape, shard.boxes(tensor))


def merged_weights(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], groups: Any) -> dict[str, Any]:
    """The full weights with HF names, gathered over tp (and ep) and merged over pp (collective; every caller gets
    them).

    Args:
        model: the tensor-parallel HF model (unwrapped; under ``pp > 1`` only its stages' parameters are live).
        params: HF name -> the parameters this rank owns.
        groups: the run's ``ParallelGroups``.
    """
    from hftrain.parallel import gather_full_tensors

    buffers = _buffer_names(model)
    # Buffers are not trained: the first stage contributes them; each parameter comes from the stage owning it.
    local = {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if name in params or (name in buffers and groups.pp_rank == 0)
    }
    full = gather_full_tensors(local, model, tp_group=groups.tp_group)
    if groups.ep_size > 1:  # expert slices, the same on every tp rank, gathered over ep (pp = 1 under ep)
        from hftrain.parallel.expert_parallel import expert_parameters, gather_experts

        for name in sorted(expert_parameters(model)):
            full[name] = gather_experts(full[name], groups.ep_group)
    if groups.pp_size == 1:
        return full
    merged: dict[str, torch.Tensor] = {}
    for part in _merged_over_stages({k: v.cpu() for k, v in full.items()}, groups.pp_group):
        merged.update(part)
    return merged


def iter_full_state(
    model: torch.nn.Module, params: dict[str, torch.nn.Parameter], groups: Any
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The full weights one tensor at a time: ``(name, tensor)`` on global rank 0, ``(name, None)`` elsewhere.

    Collective. Every stage's names, full shapes and dtypes are exchanged once over the pp group (plain data);
    then, name by name, the tp ranks of the stage holding it (data-parallel and context replica 0) gather it (an
    expert tensor: the ep ranks of data-parallel replica 0's ep group, over ep), and that stage's tp rank 0 sends
    it to global rank 0. No rank holds more than one full tensor beside its shards.

    Args:
        model: the tensor-parallel HF model (unwrapped).
        params: HF name -> the parameters this rank owns.
        groups: the run's ``ParallelGroups``.
    """
    from hftrain.parallel import gather_full_tensors
    from hftrain.parallel.expert_parallel import expert_parameters, gather_experts
    from hftrain.parallel.tensor_parallel import sharded_parameters

    experts = expert_parameters(model) if groups.ep_size > 1 else {}
    shards = {**sharded_parameters(model), **experts}
    buffers = _buffer_names(model)
    state = model.state_dict()
    local = [
        (name, tuple(shards[name].full_shape) if name in shards else tuple(tensor.shape), str(tensor.dtype))
        for name, tensor in state.items()
        if name in params or (name in buffers and groups.pp_rank == 0)
    ]
    stages = _merged_over_stages(local, groups.pp_group) if groups.pp_size > 1 else [local]
    rank = dist.get_rank() if dist.is_initialized() else 0
    # Received where this rank computes: the default group of a CUDA run (NCCL) takes no CPU tensor.
    device = next(iter(params.values())).device if params else torch.device("cpu")
    holder = groups.dp_rank == 0 and groups.cp_rank == 0
    in_first_ep_group = groups.dp_rank < groups.ep_size and groups.cp_rank == 0  # its ranks hold every expert
    given: set[str] = set()
    for stage, entries in enumerate(stages):
        sender = groups.dims.rank(stage, 0, 0, 0)
        for name, shape, dtype in entries:
            if name in given:  # a tied embedding's copy on the last stage: the first stage's is the one
                continue
            given.add(name)
            full = None
            if stage == groups.pp_rank and name in experts and in_first_ep_group:
                full = gather_experts(state[name].detach(), groups.ep_group)  # experts are not split over tp
                full = full if holder else None
            elif stage == groups.pp_rank and holder:
                full = state[name].detach()
                if groups.tp_size > 1:
                    full = gather_full_tensors({name: full}, model, tp_group=groups.tp_group)[name]
            if sender != 0 and rank == sender:
                dist.send(full.contiguous(), dst=0)
            elif sender != 0 and rank == 0:
                full = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
                dist.recv(full, src=sender)
            yield name, full if rank == 0 else None
            del full


def _buffer_names(model: torch.nn.Module) -> set[str]:
    parameters = {name for name, _ in model.named_parameters()}
    return {name for name in model.state_dict() if name not in parameters}


def _merged_over_stages(part: dict[str, Any], pp_group: Any) -> list[dict[str, Any]]:
    """Every stage's ``part`` (collective over the pp group)."""
    parts: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, part, group=pp_group)
    return parts
