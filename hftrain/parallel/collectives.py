"""Megatron's tensor-parallel communication as autograd functions (each a forward op and its conjugate).

=========================  ===========================  ===========================  =====================
function                   forward                      backward                     used where
=========================  ===========================  ===========================  =====================
``copy_to_tp``  (f)        identity                     all-reduce                   enter a TP region
``reduce_from_tp``  (g)    all-reduce                   identity                     row-parallel output
``gather_from_sequence``   all-gather (sequence dim)    reduce-scatter               enter a TP region (SP)
``reduce_scatter_to_seq``  reduce-scatter (sequence)    all-gather                   row-parallel out (SP)
``scatter_to_sequence``    keep own sequence chunk      all-gather                   replicated -> SP
``gather_to_replicated``   all-gather (sequence dim)    keep own chunk               SP -> replicated
``all_reduce_both_ways``   all-reduce                   all-reduce                   a global batch sum
``all_to_all_rows``        all-to-all (rows, v-splits)  the inverse all-to-all       MoE dispatch/combine
=========================  ===========================  ===========================  =====================

Activations are batch-first (``batch, sequence, hidden``), as in transformers, so the sequence dimension is 1
(Megatron's is 0). gloo in torch 2.13 supports ``all_reduce``, ``all_gather``, ``reduce_scatter`` and
``all_to_all_single`` with uneven splits (checked on this machine), so every op is one real collective. Every
collective goes through :func:`_collective`, which also feeds :func:`record_collectives` (how the benchmark
counts them per layer instead of assuming).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hftrain.errors import ConfigError

SEQUENCE_DIM = 1

# Counters of the active record_collectives() contexts: debugging/benchmark instrumentation, not group state.
_RECORDERS: list[Counter] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[Counter]:
    """Count the collectives run inside the block, keyed ``"forward all_reduce"``, ``"backward all_gather"``..."""
    counts: Counter = Counter()
    _RECORDERS.append(counts)
    try:
        yield counts
    finally:
        _RECORDERS.remove(counts)


def _collective(name: str, phase: str) -> None:
    for counts in _RECORDERS:
        counts[f"{phase} {name}"] += 1


def _chunks(x: torch.Tensor, group: Any, dim: int) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ConfigError(
            f"sequence length {x.shape[dim]} is not a multiple of tp={size} under sequence parallelism; "
            f"pad every batch to a multiple of hftrain.parallel.sequence_multiple(tp, sequence_parallel=True)"
        )
    return [c.contiguous() for c in x.chunk(size, dim)]


def _identity(x: torch.Tensor, group: Any, dim: int, phase: str) -> torch.Tensor:
    return x


def _all_reduce(x: torch.Tensor, group: Any, dim: int, phase: str) -> torch.Tensor:
    _collective("all_reduce", phase)
    x = x.clone()  # autograd owns the incoming tensor; reduce a copy
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group: Any, dim: int, phase: str) -> torch.Tensor:
    _collective("all_gather", phase)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim)


def _reduce_scatter(x: torch.Tensor, group: Any, dim: int, phase: str) -> torch.Tensor:
    _collective("reduce_scatter", phase)
    chunks = _chunks(x, group, dim)
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


def _split(x: torch.Tensor, group: Any, dim: int, phase: str) -> torch.Tensor:
    return _chunks(x, group, dim)[dist.get_rank(group)]


Op = Callable[[torch.Tensor, Any, int, str], torch.Tensor]


class _Conjugate(torch.autograd.Function):
    """Runs ``forward_op`` forward and ``backward_op`` on the gradient: one class for every pair above."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int, forward_op: Op, backward_op: Op) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.backward_op = group, dim, backward_op
        return forward_op(x, group, dim, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.group, ctx.dim, "backward"), None, None, None, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the input gradient backward.

    Args:
        x: replicated activations entering a tensor-parallel region.
        group: the tensor-parallel group.
    """
    return _Conjugate.apply(x, group, SEQUENCE_DIM, _identity, _all_reduce)


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's g: all-reduce forward (sum the partial outputs), identity backward.

    Args:
        x: this rank's partial sum.
        group: the tensor-parallel group.
    """
    return _Conjugate.apply(x, group, SEQUENCE_DIM, _all_reduce, _identity)


def gather_from_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-parallel entry of a TP region: all-gather the sequence forward, reduce-scatter backward.

    Args:
        x: this rank's sequence chunk ``(batch, sequence / tp, hidden)``.
        group: the tensor-parallel group.
    """
    return _Conjugate.apply(x, group, SEQUENCE_DIM, _all_gather, _reduce_scatter)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-parallel exit of a TP region: reduce-scatter forward, all-gather backward.

    Args:
        x: this rank's partial sum over the full sequence.
        group: the tensor-parallel group.
    """
    return _Conjugate.apply(x, group, SEQUENCE_DIM, _reduce_scatter, _all_gather)


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Replicated -> sequence-parallel: keep this rank's sequence chunk forward, all-gather backward.

    Args:
        x: activations identical on every tp rank.
        group: the tensor-parallel group.
    """
    return _Conjugate.apply(x, group, SEQUENCE_DIM, _split, _all_gather)


def gather_to_replicated(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-parallel -> replicated: all-gather forward, keep own chunk backward (the gradient is replicated).

    Args:
        x: this rank's sequence chunk.
        group: the tensor-parallel group.
    """
    return _Conjugate.apply(x, group, SEQUENCE_DIM, _all_gather, _split)


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` in place over ``group`` with one all-reduce per dtype.

    Args:
        tensors: tensors of identical shapes on every rank, in the same order.
        group: the process group.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        _collective("all_reduce", "grads")
        dist.all_reduce(flat, group=group)
        for tensor, value in zip(same, flat.split([t.numel() for t in same]), strict=True):
            tensor.copy_(value.view_as(tensor))


def all_reduce_both_ways(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``, whose gradient is the sum of every rank's gradient (all-reduce both ways).

    For a term every rank's loss shares, computed from all ranks' examples (the MoE load-balancing loss over the
    global batch): each rank's loss ``L(Σ_r x_r)`` is the same, so ``∂/∂x_r`` of the ranks' mean loss, which data
    parallelism's gradient averaging computes, is ``(1/n) Σ_r' ∂L/∂x = ∂L/∂x``: the backward all-reduce sums the
    ``n`` identical upstream gradients and the averaging divides them again.

    Args:
        x: this rank's part of the sum.
        group: the ranks whose parts are summed (the examples' data-parallel group).
    """
    return _Conjugate.apply(x, group, 0, _all_reduce, _all_reduce)


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its gradient goes back by the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange_rows(x, output_splits, input_splits, group, "forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange_rows(grad, ctx.input_splits, ctx.output_splits, ctx.group, "backward"), None, None, None


def _exchange_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any, phase: str):
    _collective("all_to_all", phase)
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """Send ``x``'s rows to the ranks of ``group``: the first ``input_splits[0]`` rows to rank 0, the next to rank 1...;
    receive ``output_splits[j]`` rows from rank ``j``, in rank order. Backward: the inverse exchange of the gradient.

    Args:
        x: rows grouped by destination rank (``sum(input_splits)`` of them).
        output_splits: rows this rank receives from each rank.
        input_splits: rows this rank sends to each rank.
        group: the exchanging ranks (the expert-parallel group).
    """
    return _AllToAllRows.apply(x, output_splits, input_splits, group)
