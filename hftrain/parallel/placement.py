"""Where each parameter lives on the mesh: one :class:`Placement` record per parameter.

A parameter is either whole on every rank of an axis, or cut into slices along one mesh axis (tp by a family's
plan, ep along the experts), described by a :class:`Split`; and its gradient on a rank is either complete or one term
of a sum over an axis (``partial``: under sequence parallelism a LayerNorm saw only this rank's sequence chunk, a
LoRA factor under a column-parallel layer only its share of the product). A weight several pipeline stages read is
held as a copy by each of their ranks (``copies``: tied input/output embeddings over the first and last stage,
Megatron's embedding group; weights every chunk reads over the pipeline group), one of which is the ``primary``. The
axis's ``apply_*`` call records this (:func:`place`) when it replaces a module or cuts the stages; everything that
must know where a parameter lives reads the records, and is written once, here:

- **gradient completion** (:func:`complete_grads`): ``g = Σ_axis g_r`` for partial gradients; the copies of a slice
  several ranks hold (``Split.replicas``) summed over their holders; a pipeline copy's gradient the sum over the
  copies, zero where one took none; the data-parallel mean ``(1 / (dp·cp)) Σ g_r`` over each parameter's data
  replicas (``ParallelGroups.data_replicas``: dp × cp for a dense parameter, the edp ranks for one cut along ep,
  which is carved out of dp);
- **the DDP ignore list** (:func:`ddp_ignored`): parameters whose data replicas are not DDP's group;
- **clipping** (:func:`clip_grad_norm_`): each slice's square counted once, summed over the axis that cuts it; a
  pipeline copy's by its primary only;
- **full tensors** (:func:`gather_full_tensors`, :func:`load_full_state_dict`, :func:`shard_full_tensor`): the export,
  the reload check, loading a full state dict;
- **checkpoint boxes** (:meth:`Split.boxes`) and which of a box's holders writes it (``ParallelGroups.holders``; a
  pipeline copy's primary: ``Placement.primary``);
- **the replica check** (``tensor_parallel.check_replicas_agree``): what tp does not cut is compared over tp.

The records themselves are ``hftrain.parallel.placement_records``' (re-exported here). A new axis that cuts
parameters adds its ``place`` calls and its declaration (``hftrain.parallel.axes``: ``cuts_parameters``); none of
the above changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hftrain.errors import HFTrainError
from hftrain.parallel.placement_records import (  # noqa: F401  (re-exported: the records' public path)
    PLACEMENTS,
    WHOLE,
    WRAPPER_PREFIXES,
    Placement,
    Split,
    _live_parameters,
    logical,
    place,
    placed,
    placements,
    split_over,
)


# ----------------------------------------------------------------- gradients
def sum_partial_grads(model: nn.Module, axis: str, group: Any) -> None:
    """Complete the gradients that are partial over ``axis`` (collective over ``group``, that axis's group).

    Two kinds, both summed by one all-reduce over the axis (per dtype):

    - parameters whose record lists ``axis`` in ``partial``: ``g = Σ_axis g_r``;
    - slices several ranks hold (``Split.replicas > 1``: a key/value head shared by ``tp / kv`` ranks, each of which
      saw only its own query heads): ``g_j = Σ_{r: r // replicas = j} g_r``, the sum over the ranks holding slice
      ``j`` only. Without a process group per slice: every rank writes its gradient into slot ``j`` of a zero buffer
      of all ``size / replicas`` slots, the all-reduce sums each slot over its holders, and each rank takes its slot
      back (the buffer is the full tensor's size).

    When there are neither, nothing is communicated.

    Args:
        model: the parallelized model, possibly wrapped.
        axis: the mesh axis (``"tp"``).
        group: its process group.
    """
    from hftrain.parallel.collectives import all_reduce_coalesced

    grads, replicated, seen = [], [], set()
    for module in model.modules():
        for name, record in placed(module).items():
            grad = getattr(module, name).grad
            if grad is None or id(grad) in seen:  # a weight two modules share (tied embeddings) is summed once
                continue
            seen.add(id(grad))
            if axis in record.partial:
                grads.append(grad)
            elif record.axis == axis and record.split is not None and record.split.replicas > 1:
                replicated.append((grad, record.split))
    slots = [grad.new_zeros(split.slices, *grad.shape) for grad, split in replicated]
    for slot, (grad, split) in zip(slots, replicated, strict=True):
        slot[split.rank // split.replicas] = grad
    if grads or slots:
        all_reduce_coalesced(grads + slots, group)
    for slot, (grad, split) in zip(slots, replicated, strict=True):
        grad.copy_(slot[split.rank // split.replicas])


def sum_copies(model: nn.Module, axis: str, group: Any) -> None:
    """Make every pipeline copy recorded over ``axis`` (``Placement.copies``) hold the sum of the copies' gradients
    (collective over ``group``, whose ranks hold those copies): ``g = Σ_copies g_r``, a copy that took no gradient
    joining with zeros, so each applies the same update and they stay one weight. One all-reduce per dtype.

    Args:
        model: the model, possibly wrapped (parameters on ``meta`` are another stage's, left out).
        axis: the copies' group name (``"embedding"``, ``"pp"``).
        group: its process group.
    """
    from hftrain.parallel.collectives import all_reduce_coalesced

    grads, seen = [], set()
    for module in model.modules():
        for name, record in placed(module).items():
            param = getattr(module, name)
            if record.copies != axis or id(param) in seen or param.device.type == "meta" or not param.requires_grad:
                continue
            seen.add(id(param))
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
    if grads:
        all_reduce_coalesced(grads, group)


def ddp_ignored(model: nn.Module, groups: Any) -> list[str]:
    """Names of the parameters DDP must leave alone: their data replicas are not DDP's group (cut along an axis
    carved out of the data-parallel ranks, as ep's experts: :func:`complete_grads` averages them over their own).

    Args:
        model: the parallelized model (unwrapped).
        groups: the run's ``ParallelGroups``.
    """
    dense = groups.data_replicas(None)[0]
    return [name for name, record in placements(model).items() if groups.data_replicas(record.axis)[0] is not dense]


def complete_grads(model: nn.Module, groups: Any, *, data_mean: bool) -> None:
    """Complete every gradient after backward, before clipping and the step (collective over the run's groups).

    1. the data-parallel mean ``g = (1 / (dp·cp)) Σ_r g_r`` over each parameter's data replicas (one all-reduce per
       group and dtype): for every parameter when ``data_mean`` (no DDP: a pipeline's stages), else only for those
       DDP ignores (:func:`ddp_ignored`; the dense ones DDP reduced in backward). A parameter cut along an axis carved
       out of dp (ep) sums over its fewer replicas but divides by ``dp·cp`` too: its gradient already holds the
       terms of its whole ep group (their tokens came to it). Such a parameter with no gradient (an expert no token
       reached) gets zeros, as the unsplit tensor's slice would;
    2. the partial gradients of each axis (:func:`sum_partial_grads`);
    3. the gradients of the pipeline copies over their group (:func:`sum_copies`).

    Args:
        model: the parallelized model, possibly wrapped (its parameters on ``meta`` are another stage's).
        groups: the run's ``ParallelGroups``.
        data_mean: average the dense parameters over dp × cp too.
    """
    from hftrain.parallel.collectives import all_reduce_coalesced

    records = placements(model)
    dense = groups.data_replicas(None)[0]
    by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for name, param in _live_parameters(model):
        record = records.get(name, WHOLE)
        group = groups.data_replicas(record.axis)[0]
        own = group is not dense
        if not (param.requires_grad and (data_mean or own)):
            continue
        if param.grad is None:
            if not own:
                continue
            param.grad = torch.zeros_like(param)
        by_group.setdefault(id(group), (group, []))[1].append(param.grad)
    scale = groups.data_replicas(None)[2]  # dp·cp: every parameter's mean divides by the dense replicas' count
    for group, grads in by_group.values():
        if group is not None and dist.get_world_size(group) > 1:
            all_reduce_coalesced(grads, group)
        if scale > 1:
            for grad in grads:
                grad.div_(scale)
    replicated = {r.axis for r in records.values() if r.split is not None and r.split.replicas > 1}
    for axis in sorted({a for r in records.values() for a in r.partial} | replicated):  # the same on every rank
        group = groups.axis_group(axis)
        if group is not None and dist.get_world_size(group) > 1:
            sum_partial_grads(model, axis, group)
    for axis in sorted({r.copies for r in records.values() if r.copies is not None}):  # a copy's holders agree
        group = groups.axis_group(axis)
        if group is not None and dist.get_world_size(group) > 1:
            sum_copies(model, axis, group)


def clip_grad_norm_(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    max_norm: float,
    *,
    groups: Mapping[str, Any],
    pp_group: Any = None,
) -> torch.Tensor:
    """Clip to the global gradient norm, as one process with the whole model computes it; returns the norm.

    Megatron's rule generalised to every axis that cuts parameters: ``‖g‖² = Σ_pp (Σ_axes Σ_axis Σ_cut g² +
    Σ_whole g²)``. The squares of the parameters cut along an axis are summed over that axis's group (one
    all-reduce each), a slice several ranks hold by its first holder only; whole parameters hold the same gradient on
    every rank of those axes and count once; under pipeline parallelism each stage's total is summed over the pp group,
    since each stage owns its own parameters (a weight several stages hold a copy of counts on its primary only). The
    coefficient is ``torch.nn.utils.clip_grad_norm_``'s,
    ``min(1, max_norm / (‖g‖ + 1e-6))``, so one process matches it exactly.

    Args:
        model: the parallelized model (its records say which names are cut).
        params: HF name -> the parameters this rank owns (all of them without pipeline parallelism).
        max_norm: the largest allowed norm.
        groups: axis -> its process group, for every axis that cuts parameters in this run (``{"tp": ...}``).
        pp_group: the pipeline group (None: one stage).
    """
    records = placements(model)
    axes = list(groups)
    grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    # where the norms are summed: the gradients' device (a rank with none: its parameters', never the host by default,
    # which an NCCL group would not take)
    device = next(iter(grads.values())).device if grads else next(iter(params.values())).device if params else None
    squares = torch.zeros(len(axes) + 1, dtype=torch.float64, device=device)  # whole, then one per axis
    for name, grad in grads.items():
        record = records.get(name, WHOLE)
        if record.counted:
            # Each tensor's norm in fp32 (no float64 copy of a 28M-element embedding gradient: that transient cost
            # 450 MB per step on SmolLM2), its square accumulated in float64.
            norm = torch.linalg.vector_norm(grad.detach(), 2, dtype=torch.float32)
            squares[axes.index(record.axis) + 1 if record.axis else 0] += norm.double().pow(2)
    total_sq = squares[:1].clone()
    for index, axis in enumerate(axes, start=1):
        cut = squares[index : index + 1].clone()
        if groups[axis] is not None and dist.get_world_size(groups[axis]) > 1:
            dist.all_reduce(cut, group=groups[axis])
        total_sq += cut
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt().float().squeeze(0)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads.values():
        grad.mul_(coefficient.to(grad.dtype))
    return total


# ----------------------------------------------------------------- full tensors
def gather_full_tensors(
    local: dict[str, torch.Tensor], model: nn.Module, *, groups: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Full tensors from per-rank ones keyed by logical name (weights, gradients, optimizer state).

    Collective over each axis's group: every rank of it passes the same names in the same order and gets the result.
    Per axis and dtype one all-gather; every rank knows every rank's slice shapes, so unequal cuts are padded.
    Tensors of names no axis cuts are returned as they are.

    Args:
        local: logical name -> this rank's tensor (its slice for cut names).
        model: the parallelized model whose records define the cuts.
        groups: axis -> its process group, for every axis that cuts a name of ``local``.
    """
    records = placements(model)
    full = dict(local)
    by_axis: dict[str, dict[torch.dtype, list[str]]] = {}
    for name in local:
        record = records.get(name, WHOLE)
        if record.split is not None:
            by_axis.setdefault(record.axis, {}).setdefault(local[name].dtype, []).append(name)
    for axis in [a for a in groups if a in by_axis] + [a for a in by_axis if a not in groups]:
        if axis not in groups:
            raise ValueError(f"{sorted(by_axis[axis].values())[0][0]!r} is cut along {axis}, whose group was not given")
        group = groups[axis]
        size = dist.get_world_size(group)
        for names in by_axis[axis].values():
            splits = [records[name].split for name in names]
            shapes = [[split.local_shape(r) for split in splits] for r in range(size)]
            lengths = [[math.prod(shape) for shape in rank_shapes] for rank_shapes in shapes]
            longest = max(sum(rank_lengths) for rank_lengths in lengths)
            flat = torch.cat([local[name].detach().reshape(-1) for name in names])
            flat = F.pad(flat, (0, longest - flat.numel()))
            gathered = [torch.empty_like(flat) for _ in range(size)]
            dist.all_gather(gathered, flat, group=group)
            pieces = [g[: sum(lengths[r])].split(lengths[r]) for r, g in enumerate(gathered)]
            for i, (name, split) in enumerate(zip(names, splits, strict=True)):
                full[name] = split.assemble([pieces[r][i].view(shapes[r][i]) for r in range(size)])
    return full


def full_state_dict(model: nn.Module, *, groups: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The unsharded state dict with the model's own HF names (collective over ``groups``; every rank gets it).

    Args:
        model: the parallelized model, possibly wrapped.
        groups: axis -> its process group (``{"tp": tp_group}``).
    """
    local = {logical(name): tensor.detach() for name, tensor in model.state_dict().items()}
    return gather_full_tensors(local, model, groups=groups)


def shard_full_tensor(name: str, full: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """This rank's slice of the full tensor named ``name`` (the tensor itself when no axis cuts that name).

    Args:
        name: logical HF name of a parameter (or of state shaped like it).
        full: the unsharded tensor.
        model: the parallelized model whose records define the cuts.
    """
    split = split_over(model).get(logical(name))
    return full if split is None else split.local(full)


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], *, names: set[str] | None = None) -> None:
    """Load an unsharded HF state dict into a parallelized model (each rank takes its slices), strictly.

    Args:
        model: the parallelized model, possibly wrapped.
        state: logical name -> full tensor, e.g. from :func:`full_state_dict` or the plain HF model.
        names: the logical names this rank holds (a pipeline stage's); None: all of the model's. ``state`` must
            still hold exactly the model's names.
    """
    splits = split_over(model)
    targets = {logical(name): tensor for name, tensor in model.state_dict().items()}
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise HFTrainError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in targets.items():
            if names is not None and name not in names:
                continue  # another stage's: not held here
            value = splits[name].local(state[name]) if name in splits else state[name]
            if value.shape != target.shape:
                raise HFTrainError(f"'{name}': shape {tuple(state[name].shape)} does not fit the model")
            target.copy_(value)
