"""Cross-entropy over a vocabulary split by columns over the tensor-parallel ranks (Megatron's vocab-parallel loss).

A column-parallel lm_head leaves rank i with the logits of its own vocabulary slice, ``z_i = z[..., s_i : s_i + V']``
(``V'`` = padded vocabulary / p, ``s_i = i·V'``). The per-token loss of the whole (unpadded) vocabulary ``V`` is
computed from the slices with three all-reduces of one number per token, never the logits themselves:

    ``m   = max_r  max_{j<V} z_rj``                 (all-reduce MAX)
    ``S   = Σ_r Σ_{j<V} exp(z_rj − m)``             (all-reduce SUM: the softmax's denominator)
    ``t   = Σ_r [y ∈ rank r's slice] (z_ry − m)``   (all-reduce SUM: the target logit, found on one rank)
    ``ℓ   = log S − t``                             (= −log softmax(z)_y, the same on every rank)

Backward, on the local slice only: ``∂ℓ/∂z_rj = (softmax_rj − [j = y]) · g``, ``softmax_rj = exp(z_rj − m) / S``
(``g``: the loss's incoming gradient). It needs no collective: the gradient of the lm_head's *input*,
``Σ_r dz_r W_r``, is summed by the all-reduce that the column-parallel layer's region entry (Megatron's f,
:func:`~hftrain.parallel.collectives.copy_to_tp`, or the sequence all-gather's reduce-scatter) already runs.

Columns at or beyond ``vocab_size`` (the zero padding of the padded vocabulary, see
:func:`~hftrain.parallel.plans.padded_vocab_size`) are set to ``−∞`` before the max: they add nothing to ``S``,
receive a zero gradient, and whatever they hold (zeros, garbage, ``inf``, ``nan``) does not matter, so the result equals
the unsplit, unpadded ``F.cross_entropy``. Tokens whose label is ``ignore_index`` get loss 0 and gradient 0, as with
``F.cross_entropy(reduction="none")``. Everything is computed in fp32 whatever the logits' dtype; the gradient is
returned in the logits' dtype.

Hand-written because torch has no vocabulary-parallel cross-entropy for plain tensors: ``F.cross_entropy`` needs the
full row, and DTensor's ``loss_parallel`` works only on DTensor logits sharded on the class dimension, which
hftrain's plain-tensor layers (``hftrain.parallel.layers``) do not produce.

Memory: a rank holds one fp32 buffer the size of its slice of the logits, ``[..., V/p]``: made in the forward, turned
into the softmax in place, kept for the backward, and turned into the gradient in place there (for fp32 logits it *is*
the returned gradient). No rank ever holds full-vocabulary logits, their log-softmax or their gradient, which the
gathered approach (all-gather the logits, then ``F.cross_entropy``) materialises several times over: at tp = 4, GPT-2's
50,257 tokens, 1,024 positions, fp32, the lm_head's local matmul, this loss and the backward added 108 MiB to a rank's
peak resident memory, the gathered approach 648 MiB (``tests/test_vocab_parallel_loss.py``). Because the
buffer is consumed by the backward, the graph through this loss cannot be backpropagated twice (``retain_graph``):
the second backward raises ``RuntimeError``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hftrain.parallel.collectives import _collective


def cross_entropy_per_token(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy of unsplit logits, in fp32: ``F.cross_entropy(reduction="none")`` over any leading shape.

    The loss for callers whose logits hold the whole vocabulary (no tensor parallelism, or a gathered head);
    :func:`vocab_parallel_cross_entropy` is the same loss on vocabulary slices.

    Args:
        logits: ``[..., V]`` logits of the full vocabulary (any float dtype; upcast to fp32).
        labels: ``[...]`` target ids (long), ``ignore_index`` where there is no loss.
        ignore_index: the label of tokens without loss (loss 0, gradient 0).

    Returns:
        ``[...]`` fp32 losses, 0 where ignored.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} (logits: [..., V])")
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, labels.reshape(-1), reduction="none", ignore_index=ignore_index).view(labels.shape)


def _all_reduce(x: torch.Tensor, op: Any, group: Any) -> None:
    if group is None or dist.get_world_size(group) == 1:
        return
    _collective("all_reduce", "forward")
    dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The forward's three all-reduces and the local backward described in the module docstring."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, group: Any, vocab_start: int, vocab_size: int, ignore: int
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        # the one [N, V/p] fp32 buffer (contiguous whatever the logits' strides: a shifted or transposed view)
        work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(-1, local_vocab)
        real = max(0, min(local_vocab, vocab_size - vocab_start))  # columns of the unpadded vocabulary
        if real < local_vocab:
            work[:, real:] = float("-inf")  # padding: out of the softmax, whatever it holds

        flat_labels = labels.reshape(-1)
        valid = flat_labels != ignore
        local_ids = flat_labels - vocab_start
        hit = valid & (local_ids >= 0) & (local_ids < real)  # the target's logit lives on this rank
        local_ids = local_ids.masked_fill(~hit, 0)

        top = work.max(dim=-1).values if local_vocab else work.new_full((work.shape[0],), float("-inf"))
        _all_reduce(top, dist.ReduceOp.MAX, group)
        work.sub_(top.unsqueeze(-1))
        if local_vocab:
            target = work.gather(1, local_ids.unsqueeze(-1)).squeeze(-1).masked_fill(~hit, 0.0)
        else:
            target = work.new_zeros(work.shape[0])
        work.exp_()
        total = work.sum(dim=-1)
        _all_reduce(total, dist.ReduceOp.SUM, group)
        _all_reduce(target, dist.ReduceOp.SUM, group)
        loss = (total.log() - target).masked_fill(~valid, 0.0)
        work.div_(total.unsqueeze(-1))  # the softmax of the local slice, kept for the backward

        ctx.save_for_backward(work, local_ids, hit, valid)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss.view(labels.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        if getattr(ctx, "consumed", False):
            raise RuntimeError(
                "vocab_parallel_cross_entropy backpropagated twice (retain_graph): its saved softmax became the first "
                "backward's gradient in place; compute the loss again for a second backward"
            )
        ctx.consumed = True
        softmax, local_ids, hit, valid = ctx.saved_tensors
        scale = grad_loss.reshape(-1).float().masked_fill(~valid, 0.0)  # ignored tokens: no gradient
        grad = softmax  # in place: the buffer becomes the gradient
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_ids] -= hit.to(grad.dtype)  # − onehot(y), on the rank holding y
        grad.mul_(scale.unsqueeze(-1))
        grad = grad.view(ctx.logits_shape).to(ctx.logits_dtype)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: Any,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split by vocabulary columns over ``tp_group`` (see the module docstring).

    Every rank of the group calls it with its own slice and the same labels; every rank gets the same losses.

    Args:
        logits: ``[..., V_local]``: this rank's columns ``[vocab_start, vocab_start + V_local)`` of the (padded)
            vocabulary, e.g. a column-parallel lm_head's output (any float dtype; computed in fp32). Columns at or
            beyond ``vocab_size`` are padding and excluded from the softmax.
        labels: ``[...]`` target ids in ``[0, vocab_size)`` (long), ``ignore_index`` where there is no loss;
            identical on every rank of the group.
        tp_group: the tensor-parallel group whose ranks hold the other columns. ``None`` (or a group of one rank):
            no tensor parallelism, the slice is the whole (possibly padded) vocabulary and no collective runs (no
            process group is needed then).
        vocab_start: the first vocabulary id of this rank's columns (``rank · V_local`` for an even split of the
            padded vocabulary, as :class:`~hftrain.parallel.layers.VocabParallelEmbedding`'s ``vocab_start``).
        vocab_size: the model's real (unpadded) vocabulary ``V``.
        ignore_index: the label of tokens without loss (loss 0, gradient 0).

    Returns:
        ``[...]`` fp32 losses (the shape of ``labels``), 0 where ignored. Its backward gives this rank's slice of
        ``(softmax − onehot) · grad`` in the logits' dtype, and runs no collective.

    Raises:
        IndexError: a label outside ``[0, vocab_size)`` that is not ``ignore_index`` (checked asynchronously on CUDA).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} (logits: [..., V])")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if vocab_start < 0 or vocab_size < 1:
        raise ValueError(f"need vocab_start >= 0 and vocab_size >= 1, got {vocab_start} and {vocab_size}")
    inside = ((labels == ignore_index) | ((labels >= 0) & (labels < vocab_size))).all()
    if labels.is_cuda:  # no host sync per step: a failure surfaces at the next sync
        torch._assert_async(inside, "cross-entropy target out of bounds")
    elif not inside:
        raise IndexError(f"a label is outside [0, {vocab_size}) and is not ignore_index={ignore_index}")
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group, vocab_start, vocab_size, ignore_index)
