"""The replica checks of tensor parallelism: every tp rank starts from the same full weights
(:func:`_check_replicated`), and the parameters tp does not cut stay bit-identical over the tp group
(:func:`check_replicas_agree`, resynchronised within :data:`REPLICA_RTOL` when not exact). The split itself is
``hftrain.parallel.tensor_parallel``'s, which re-exports these names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.errors import HFTrainError
from hftrain.parallel.placement import logical, split_over


def _check_replicated(model: nn.Module, tp_group: Any) -> None:
    """Every tp rank must start from the same full weights (same seed); a checksum costs one all-reduce."""
    from hftrain.parallel.host import all_max

    with torch.no_grad():
        # Parameters on ``meta`` (a pipeline rank's other stages, never built) are the same on every tp rank.
        sums = [p.detach().double().sum() for p in model.parameters() if p.device.type != "meta"]
        total = torch.stack(sums).sum().item() if sums else 0.0  # on the host: one sync, at build time only
    high, negated_low = all_max([total, -total], tp_group)  # over the host group: max and min of the checksums
    if abs(high + negated_low) > 1e-9 * max(1.0, abs(total)):
        raise HFTrainError(
            "the model's weights differ across tensor-parallel ranks; build it with the same seed on every rank "
            "(tensor parallelism splits identical full weights)"
        )


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an integer view of each float width


def check_replicas_agree(model: nn.Module, *, tp_group: Any, exact: bool = True) -> None:
    """Refuse a model whose replicated parameters are no longer bit-identical across the tp group (collective).

    Tensor parallelism keeps one copy of every unsplit parameter (norms, biases of row-parallel layers, position
    embeddings, the head) on each tp rank and relies on them staying equal; checkpoints and exports save tp rank
    0's copy. If they drift apart (pitfall "a run resumed at a larger tensor-parallel size silently diverges":
    different dropout masks on replicated activations), that copy is not the model the other ranks trained. The
    check is a checksum per parameter, the sum of its elements' bit patterns as integers (exact: any change of a
    bit changes it unless differences cancel), compared by one all-reduce (max of ``[s, -s]``) over tp; the copies
    of a key/value head replicated over several ranks (``Split.replicas``) are compared by one more.

    On a GPU some kernels are not deterministic (``index_add_`` in mixture-of-experts routing, atomics in
    backward passes): replicated parameters then drift by a few bits in a step and a bitwise check would refuse
    every checkpoint. With ``exact=False`` the check compares after one broadcast instead (:func:`_resync_replicas`):
    each rank's copy against tp rank 0's within ``REPLICA_RTOL`` of its largest magnitude, and then takes rank 0's
    bits, so the drift never accumulates past one checkpoint interval while a diverged run is still refused.

    Args:
        model: a model after :func:`apply_tensor_parallel`, possibly wrapped.
        tp_group: the tensor-parallel group.
        exact: bit-identical (deterministic kernels: a CPU), else within ``REPLICA_RTOL`` after one broadcast.
    """
    size = dist.get_world_size(tp_group)
    if size == 1:
        return
    if not exact:
        _resync_replicas(model, tp_group)
        return
    split = split_over(model, "tp")
    names, sums, copies, copy_sums = [], [], [], []
    for name, param in model.named_parameters():
        if param.device.type == "meta":  # another stage's (never built)
            continue
        shard = split.get(logical(name))
        if shard is None:
            names.append(logical(name))
            sums.append(_checksum(param))
        elif shard.replicas > 1:  # a key/value head held by several ranks: its copies must agree too
            copies.append((logical(name), shard))
            copy_sums.append(_checksum(param))
    differ = []
    if sums:
        local = torch.stack(sums)
        bounds = torch.cat([local, -local])
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=tp_group)
        differ = [names[i] for i in (bounds[: len(names)] != -bounds[len(names) :]).nonzero().flatten().tolist()]
    if copies:
        rows = torch.zeros(size, len(copies), dtype=torch.int64, device=copy_sums[0].device)  # a row per tp rank
        rows[copies[0][1].rank] = torch.stack(copy_sums)
        dist.all_reduce(rows, group=tp_group)
        for i, (name, shard) in enumerate(copies):
            held = rows[:, i].view(-1, shard.replicas)  # the ranks holding each slice, side by side
            if (held != held[:, :1]).any():
                differ.append(name)
    if differ:
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise HFTrainError(
            f"replicated parameter '{differ[0]}'{more} differs across the tensor-parallel ranks; the "
            "ranks no longer train one model (a dropout mask or an update that was not the same on every tp rank), "
            "so nothing was saved; resume from the last checkpoint"
        )


REPLICA_RTOL = 1e-3
"""How far a replicated parameter's copy may lie from tp rank 0's, relative to its largest magnitude, where kernels
are not deterministic: bit-level drift of summation order is ~1e-7 per step; a replica trained on another dropout
mask or update differs by the size of an update (the learning rate, 1e-5 to 1e-3 of the weights) in every element
and grows from there, and is refused once it passes this bound."""


def _resync_replicas(model: nn.Module, tp_group: Any) -> None:
    """Compare every replicated parameter with tp rank 0's copy (one broadcast per dtype), then take its bits."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from hftrain.parallel.host import any_rank

    split = split_over(model, "tp")
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        shard = split.get(logical(name))
        if param.device.type != "meta" and (shard is None or shard.replicas > 1):
            by_dtype.setdefault(param.dtype, []).append((logical(name), param))
    differ: list[str] = []
    for entries in by_dtype.values():
        mine = [param.detach() for _, param in entries]
        reference = _flatten_dense_tensors(mine)
        # A key/value head held by several ranks: the copies of rank 0's slice are compared and resynchronised (the
        # other slices' copies see the same kernels; the exact check on a CPU compares them all).
        dist.broadcast(reference, group=tp_group, group_src=0)
        for (name, param), ref in zip(entries, _unflatten_dense_tensors(reference, mine), strict=True):
            shard = split.get(name)
            if shard is not None and shard.rank // shard.replicas != 0:
                continue  # another slice than rank 0's
            scale = max(ref.abs().max().item(), 1e-12)
            if (param.detach() - ref).abs().max().item() > REPLICA_RTOL * scale:
                differ.append(name)
            else:
                param.data.copy_(ref)
    if any_rank(bool(differ), tp_group):
        raise HFTrainError(
            f"replicated parameter '{differ[0] if differ else 'of another rank'}' differs across the tensor-parallel "
            f"ranks by more than {REPLICA_RTOL:g} of its magnitude; the ranks no longer train one model, so nothing "
            "was saved; resume from the last checkpoint"
        )


def _checksum(param: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's elements' bit patterns as integers (int64): any changed bit changes it."""
    return param.detach().contiguous().view(_BITS[param.element_size()]).sum(dtype=torch.int64)
