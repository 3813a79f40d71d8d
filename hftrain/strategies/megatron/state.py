"""Megatron's checkpoint state: this rank's boxes of every logical tensor, in the sharded format of every strategy.

Save (:func:`snapshot`): each parameter's placement record (``hftrain.parallel.placement``) gives the boxes its slice
occupies in the full HF-layout tensor (``Split.boxes``: packed query/key/value blocks as separate ranges, vocabulary
padding left out; experts' ranges along ep), a whole one the whole tensor; Adam's moments are boxed like their
parameter. The ranks holding the same box (``ParallelGroups.holders``: its data replicas, and the tp ranks unless tp
cuts it) deal the writes out among themselves (``split_replicated``), and a weight several pipeline stages hold a
copy of is written by its primary copy's stage (``Placement.primary``), so each piece is written once, from live
memory, with no gather: a rank's save costs its own state. Under ``shard_optimizer`` (ZeRO-1 over dp; with pipeline
stages, each stage's optimizer over that stage's dp group; under ep the experts' over their edp group,
``ReplicaShardedOptimizer``) each rank writes the moments of the parameters it owns, whole (an expert's: its ep slice's
box): the boxes are the parameters' own, so the checkpoint does not record who owned them. Load
(:func:`load_snapshot`): the same boxes, filled in place from a checkpoint of any strategy and layout
(``hftrain.checkpoint.sharded``): under ZeRO-1 a rank fills the moments it owns, without it every moment of its
parameters, whether the writer sharded them or not. :func:`iter_full_state` streams the full
weights to rank 0 one tensor at a time for the export; :func:`merged_weights` gathers them all (LoRA's adapter
export).

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

    Each cut parameter gives the boxes its placement's :class:`~hftrain.parallel.placement.Split` places in the full
    tensor (vocabulary padding left out), a whole one the whole tensor; Adam's moments are boxed like their
    parameter. The holders of a box (``ParallelGroups.holders``) deal its writes out.

    Args:
        model: the tensor-parallel HF model (unwrapped).
        params: HF name -> the parameters this rank owns (its stages' under pipeline parallelism).
        optimizer: the inner optimizer over ``params`` (``torch.optim`` or ``ZeroRedundancyOptimizer``, whose
            local optimizer holds the state of the parameters this dp rank owns).
        groups: the run's ``ParallelGroups`` (the first stage contributes the buffers; replicas share writes).
        info: the layout, for ``sharded.json``.
        share: keep only this rank's share of the boxes several ranks hold (a save); a load fills everything it
            holds.
    """
    from hftrain.checkpoint.sharded import MODEL_PREFIX, OPTIM_PREFIX, Snapshot, split_replicated
    from hftrain.parallel import placements

    records = placements(model)  # where each parameter lives: cut along an axis (tp, ep) or whole
    buffers = _buffer_names(model)
    state, owner = {}, {}  # key -> boxes; key -> the parameter (or buffer) name it belongs to
    for name, tensor in model.state_dict().items():
        if name in params or (name in buffers and groups.pp_rank == 0):
            state[MODEL_PREFIX + name] = _boxes(name, tensor, records)
            owner[MODEL_PREFIX + name] = name
    names = {id(p): n for n, p in params.items()}
    locals_, zero1 = local_optimizers(optimizer)  # under ZeRO-1 each replica holds its parameters' state only
    for param, values in ((p, v) for local in locals_ for p, v in local.state.items()):
        name = names[id(param)]
        for key, value in values.items():
            if torch.is_tensor(value):
                state[f"{OPTIM_PREFIX}{name}.{key}"] = _boxes(name, value, records)
                owner[f"{OPTIM_PREFIX}{name}.{key}"] = name
    if not share:
        return Snapshot(state=state, param_groups=optimizer.param_groups, info=info, model=model)
    # A weight several pipeline ranks hold a copy of (a tied embedding's last-stage copy) is written by its primary
    # copy only; a load fills every copy from it, like any parameter this rank holds.
    state = {key: boxes for key, boxes in state.items() if _given_here(owner[key], params, buffers, records, groups)}
    owner = {key: name for key, name in owner.items() if key in state}
    # The ranks holding the same box (a parameter's data replicas, and the tp ranks unless tp cuts it) deal its writes
    # out among themselves; under ZeRO-1 only the owner holds a parameter's optimizer state (it writes it alone).
    by_axis: dict[str | None, list[str]] = {}  # one set of holders per axis cutting the keys (None: whole)
    for key, name in owner.items():
        if zero1 and key.startswith(OPTIM_PREFIX):
            continue
        record = records.get(name)
        axis = record.axis if record is not None and record.split is not None and state[key].size else None
        by_axis.setdefault(axis, []).append(key)
    for axis, keys in by_axis.items():
        state = split_replicated(state, keys, *groups.holders(axis))
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

    for local in local_optimizers(optimizer)[0]:
        _init_optim_state(local)  # the moments' tensors, to load into
    boxes = snapshot(model, params, optimizer, groups=groups, info={}, share=False)
    read_snapshot(directory, boxes.state, optimizer.param_groups)


def local_optimizers(optimizer: Any) -> tuple[list[Any], bool]:
    """The optimizers holding this rank's state, and whether ZeRO-1 shards it: a ``ZeroRedundancyOptimizer``'s local
    one, a ``ReplicaShardedOptimizer``'s parts' (one per replica group: dp's, and edp's for the experts), else the
    optimizer itself.

    Args:
        optimizer: the inner optimizer (inside Accelerate's wrapper).
    """
    if hasattr(optimizer, "local_optimizers"):
        return optimizer.local_optimizers, True
    if hasattr(optimizer, "optim"):
        return [optimizer.optim], True
    return [optimizer], False


def _boxes(name: str, tensor: torch.Tensor, records: dict[str, Any]) -> Chunked:
    """The boxes of ``tensor`` (parameter ``name`` or state shaped like it) in the logical tensor: its slice's, or
    the whole tensor (a scalar such as Adam's step is whole)."""
    from hftrain.checkpoint.sharded import Chunked

    tensor = tensor.detach()
    record = records.get(name)
    if record is None or record.split is None or tensor.dim() == 0:
        return Chunked.whole(tensor)
    return Chunked(record.split.full_shape, record.split.boxes(tensor))


def merged_weights(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], groups: Any) -> dict[str, Any]:
    """The full weights with HF names, gathered over the axes that cut them (tp, ep) and merged over pp
    (collective; every caller gets them).

    Args:
        model: the tensor-parallel HF model (unwrapped; under ``pp > 1`` only its stages' parameters are live).
        params: HF name -> the parameters this rank owns.
        groups: the run's ``ParallelGroups``.
    """
    from hftrain.parallel import gather_full_tensors, placements

    records, buffers = placements(model), _buffer_names(model)
    local = {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if _given_here(name, params, buffers, records, groups)
    }
    full = gather_full_tensors(local, model, groups=groups.cut_groups)  # each cut tensor over the axis cutting it
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
    then, name by name, the first data replica of the stage holding it gathers it over the axis cutting it (tp; ep for
    experts, whose first data replica is data-parallel replica 0's ep group), and that stage's first rank sends it to
    global rank 0. No rank holds more than one full tensor beside its shards.

    Args:
        model: the tensor-parallel HF model (unwrapped).
        params: HF name -> the parameters this rank owns.
        groups: the run's ``ParallelGroups``.
    """
    from hftrain.parallel import gather_full_tensors, placements

    records = placements(model)
    buffers = _buffer_names(model)
    state = model.state_dict()
    local = [
        (name, tuple(records[name].split.full_shape) if _cut(records, name) else tuple(tensor.shape), str(tensor.dtype))
        for name, tensor in state.items()
        if _given_here(name, params, buffers, records, groups)
    ]
    stages = _merged_over_stages(local, groups.pp_group) if groups.pp_size > 1 else [local]
    rank = dist.get_rank() if dist.is_initialized() else 0
    # Received where this rank computes: the default group of a CUDA run (NCCL) takes no CPU tensor.
    device = next(iter(params.values())).device if params else torch.device("cpu")
    holder = groups.holders(None)[0] == 0  # the first data replica's tp rank 0: it sends (or yields) each tensor
    for stage, entries in enumerate(stages):
        sender = groups.dims.rank(stage, 0, 0, 0)
        for name, shape, dtype in entries:
            full = None
            axis = records[name].axis if _cut(records, name) else None
            if stage == groups.pp_rank and groups.data_replicas(axis)[1] == 0:  # its first data replica gathers it
                full = gather_full_tensors({name: state[name].detach()}, model, groups=groups.cut_groups)[name]
                full = full if holder else None
            if sender != 0 and rank == sender:
                dist.send(full.contiguous(), dst=0)
            elif sender != 0 and rank == 0:
                full = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
                dist.recv(full, src=sender)
            yield name, full if rank == 0 else None
            del full


def _given_here(name: str, params: dict[str, Any], buffers: set[str], records: dict[str, Any], groups: Any) -> bool:
    """Whether this rank's stage gives ``name`` to the full state: a parameter it holds, unless it is a copy whose
    primary another stage holds (a tied embedding's last-stage copy, ``Placement.primary``), or a buffer on the first
    stage (buffers are not trained; every stage holds them)."""
    if name in params:
        return name not in records or records[name].primary
    return name in buffers and groups.pp_rank == 0


def _cut(records: dict[str, Any], name: str) -> bool:
    """Whether an axis cuts ``name`` into slices."""
    return name in records and records[name].split is not None


def _buffer_names(model: torch.nn.Module) -> set[str]:
    parameters = {name for name, _ in model.named_parameters()}
    return {name for name in model.state_dict() if name not in parameters}


def _merged_over_stages(part: dict[str, Any], pp_group: Any) -> list[dict[str, Any]]:
    """Every stage's ``part`` (collective over the pp group)."""
    parts: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, part, group=pp_group)
    return parts
