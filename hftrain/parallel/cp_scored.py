"""Context parallelism's score-modified block kernels: attention whose logits pass through a function before the
softmax (Gemma-2's soft-capping), under any visibility mask (causal, sliding or bidirectional windows, padding,
documents).

One block (this rank's query run against one key/value run) computes, in fp32 for its scores::

    S = scale · Q Kᵀ,   S' = score_mod(S, p_q, p_k)   (−∞ where the key is not visible),
    lse = log Σ_k e^S',   O = e^(S' − lse) V

and returns ``(O, lse)``, rows that see no key giving ``O = 0`` and ``lse = −∞``; the ring merges the blocks by the
online softmax as it merges the fused kernels' (``hftrain.parallel.cp_kernels._merge``). Soft-capping is
``score_mod(S) = c · tanh(S / c)`` (:class:`SoftCap`): applied before the mask, as transformers' eager attention
does (the capped scores, then the additive mask).

**The backward of one block given the whole attention's** ``O`` **and** ``lse`` (:func:`scored_block_backward`).
The whole output is ``O = Σ_j w_j O_j`` with ``w_j = e^(lse_j − lse)``, so the block's part of the loss gradient is
a cotangent on its own ``(O_j, lse_j)``::

    ∂L/∂O_j = w_j · dO,        ∂L/∂lse_j = w_j · (rowsum(dO ∘ O_j) − D),   D = rowsum(dO ∘ O)

and the kernel's forward, recomputed under autograd, carries it to ``dQ``, ``dK_j``, ``dV_j``. This equals
FlashAttention's ``P = e^(S' − lse)``, ``dV = Pᵀ dO``, ``dS' = P ∘ (dO Vᵀ − D)`` followed by the chain rule through
the score modification (``dS = dS' ∘ ∂score_mod/∂S``; for soft-capping ``1 − tanh²(S / c)``), and
``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``; autograd differentiates ``score_mod`` itself, so a new modification is
one function.

**Kernels** (:data:`SCORED_KERNELS`, chosen by device type as the fused kernels are): on a CPU the block's math,
its ``sq × sk`` scores materialised (torch 2.13's ``flex_attention`` raises "FlexAttention does not support
backward on CPU"); on CUDA torch's ``flex_attention`` (``score_mod=``, a ``block_mask`` built from the block's
visibility, ``return_aux=AuxRequest(lse=True)``; its backward takes the log-sum-exp's gradient). The CUDA kernel is
written from torch's sources and is not run by the CPU test suite; both share :func:`scored_block_backward`, which
the CPU tests check. The plain cases (no score modification) keep the fused kernels of ``cp_kernels``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SoftCap:
    """Gemma-2's soft-capped attention logits: ``S' = cap · tanh(S / cap)`` (``∂S'/∂S = 1 − tanh²(S / cap)``).

    Args:
        cap: the model's ``attn_logit_softcapping``.
    """

    cap: float
    positional: ClassVar[bool] = False  # the same for every (query, key) pair: no positions needed

    def __call__(self, scores: torch.Tensor, q_pos: Any = None, k_pos: Any = None) -> torch.Tensor:
        """The capped scores (positions unused: the cap is the same for every pair)."""
        return torch.tanh(scores / self.cap) * self.cap


@dataclass(frozen=True)
class ScoredKernel:
    """Attention of one block with a score modification and a visibility mask.

    ``forward(q, k, v, visible, scale, score_mod, q_pos, k_pos) -> (out, lse)``: ``q, k, v`` ``[b, h, sq|sk, d]``
    (key/value heads already repeated), ``visible`` bool ``[b, 1, 1|sq, sk]``, ``score_mod(S, q_pos [sq, 1],
    k_pos [1, sk])``; ``out`` in ``q``'s dtype, ``lse`` ``[b, h, sq]`` fp32, rows with no visible key ``0`` and
    ``−∞``. It is differentiable (autograd), which :func:`scored_block_backward` uses.
    """

    forward: Any


def _math_forward(q, k, v, visible, scale, score_mod, q_pos, k_pos):
    """The block's math in fp32: its scores materialised, masked, normalised (differentiable; no NaN for a row
    with no visible key: its normaliser is replaced by 1 and its ``lse`` set to −∞ outside the graph's path)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = score_mod(scores, q_pos[:, None], k_pos[None, :])
    scores = scores.masked_fill(~visible, NEG_INF)
    top = scores.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(scores - top)  # 0 where masked
    total = weights.sum(-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    out = torch.matmul(weights / total, v.float())
    lse = torch.where(seen, torch.log(total) + top, torch.full_like(top, NEG_INF)).squeeze(-1)
    return out.to(q.dtype), lse


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Any:
    """torch's ``flex_attention`` compiled once (uncompiled, it materialises the scores: torch warns so)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


@functools.lru_cache(maxsize=16)
def _position_free(score_mod: Any) -> Any:
    """flex's ``score_mod`` of a modification that reads no positions (``positional`` False: soft-capping): one
    function per (equal) modification, not a new closure per block, so the compiled kernel need not be traced again
    for each block (not checked on a GPU: see the module doc)."""

    def flex_mod(score, batch, head, q_idx, kv_idx):
        return score_mod(score)

    return flex_mod


def _flex_forward(q, k, v, visible, scale, score_mod, q_pos, k_pos):
    """torch's ``flex_attention`` on CUDA: the score modification as its ``score_mod(score, b, h, q_idx, kv_idx)``
    (positions looked up by index), the visibility as its ``block_mask`` (blocks wholly invisible are skipped), the
    natural-log ``lse`` through ``AuxRequest(lse=True)``; differentiable, its log-sum-exp included."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    b, _, sq, _ = q.shape
    sk = k.shape[2]
    dense = visible.expand(b, 1, sq, sk)

    def mask_mod(batch, head, q_idx, kv_idx):
        return dense[batch, 0, q_idx, kv_idx]

    def flex_mod(score, batch, head, q_idx, kv_idx):
        return score_mod(score, q_pos[q_idx], k_pos[kv_idx])

    if not getattr(score_mod, "positional", True):
        flex_mod = _position_free(score_mod)
    block_mask = create_block_mask(mask_mod, b, None, sq, sk, device=q.device)
    out, aux = _compiled_flex()(
        q, k, v, score_mod=flex_mod, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True)
    )
    lse = aux.lse.float()
    blind = ~dense.any(-1)  # [b, 1, sq]: flex gives such rows 0 and −∞ too; set here so the contract is ours
    return out.masked_fill(blind[..., None], 0.0), lse.masked_fill(blind, NEG_INF)


SCORED_KERNELS = {"cpu": ScoredKernel(_math_forward), "cuda": ScoredKernel(_flex_forward)}
"""The score-modified block kernel of each device type: the block's math on a CPU (torch's flex attention has no
CPU backward), torch's ``flex_attention`` on CUDA."""


def scored_kernel(device: torch.device) -> ScoredKernel:
    """The score-modified kernel for ``device``; another device type is one line of :data:`SCORED_KERNELS`."""
    kernel = SCORED_KERNELS.get(device.type)
    if kernel is None:
        raise ValueError(f"context parallelism has no score-modified attention kernel for device '{device.type}'")
    return kernel


def scored_block_backward(kernel: ScoredKernel, dout, q, k, v, visible, out, lse, scale, score_mod, q_pos, k_pos):
    """``(dq, dk, dv)`` of one block given the whole attention's ``out`` and ``lse`` of these queries (see the module
    doc: the block's ``(O_j, lse_j)`` recomputed under autograd and given the cotangents ``w_j · dO`` and
    ``w_j · (rowsum(dO ∘ O_j) − D)``, ``w_j = e^(lse_j − lse)``); fp32 gradients. A query with no visible key anywhere
    (``lse = +∞``) and a block it sees nothing of (``lse_j = −∞``) give ``w_j = 0``."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out_j, lse_j = kernel.forward(*leaves, visible, scale, score_mod, q_pos, k_pos)
        weight = torch.exp(lse_j.detach() - lse)  # [b, h, sq]
        do = dout.float()
        total = (do * out.float()).sum(-1)  # D
        own = (do * out_j.detach().float()).sum(-1)
        grad_out = (do * weight[..., None]).to(out_j.dtype)
        grad_lse = weight * (own - total)
        dq, dk, dv = torch.autograd.grad((out_j, lse_j), leaves, (grad_out, grad_lse))
    return dq.float(), dk.float(), dv.float()
