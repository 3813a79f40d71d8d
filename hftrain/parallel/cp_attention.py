"""Context parallelism's algorithms: ring attention and all-to-all attention over the cp ranks.

**Ring attention** (:func:`ring_attention`; Liu et al. 2023, the exact blockwise softmax of FlashAttention). The
key/value blocks travel around the ring: at step ``t`` rank ``r`` holds the block of rank ``(r − t) mod cp``,
sends it on to ``r + 1`` and receives the next from ``r − 1`` (``batch_isend_irecv``, started before the block's
computation and waited for after it, so communication overlaps compute). Each block runs one fused attention
kernel in the training dtype (:data:`BLOCK_KERNELS`: torch's flash kernel on a CPU, its memory-efficient kernel on
CUDA, each taking the block's additive mask and returning ``O_j`` and ``lse_j``), with the scores masked to −∞ where
the key is padding or (causal) its position is after the query's; the blocks are merged in fp32::

    lse' = log(e^lse + e^lse_j);   O' = O·e^(lse − lse') + O_j·e^(lse_j − lse')

(the online softmax: exact, not approximate). A (query chunk, key chunk) pair that is entirely in the causal
future is skipped, so with the zigzag layout every rank does the same work. The mask is a dense ``[b, 1, sq, sk]``
bias only where one is needed (:func:`_visible_pairs`): without padding keys and packed documents (a batch without
an attention mask or position ids), a chunk against itself runs the kernel's own ``is_causal`` and a chunk wholly
below the diagonal (and inside the window) runs unmasked, so the plain causal case builds no bias at all.

The backward pass goes around the ring again with the kernel's backward per block, given the whole attention's
``out`` and ``lse`` (FlashAttention's gradients)::

    P = e^(S − lse),  D = rowsum(dO ∘ out),  dV_j += Pᵀ dO,  dS = P ∘ (dO V_jᵀ − D),
    dQ += dS K_j · scale,  dK_j += dSᵀ Q · scale

where ``dK_j``/``dV_j`` travel with their block and a last send brings them home: 2·cp point-to-point messages
of a block each way per layer (forward cp − 1, backward cp). Grouped-query heads travel unrepeated and are
repeated (and their gradients summed back) locally. A query row with no visible key (a padding query) gets 0.

**Score modifications** (``Shard.score_mod``: Gemma-2's soft-capping ``S' = c · tanh(S / c)``). A fused kernel takes
none, so every block of such an attention runs ``hftrain.parallel.cp_scored``'s kernel instead (the block's math on
a CPU, ``flex_attention`` on CUDA) with the block's boolean visibility, returning ``(O_j, lse_j)`` for the same
merge; its backward recomputes the block under autograd with the cotangents ``w_j · dO`` and
``w_j · (rowsum(dO ∘ O_j) − D)``, ``w_j = e^(lse_j − lse)`` (``cp_scored.scored_block_backward``). The same messages
go around the ring. Masks: a key's padding, causality, packed documents and a sliding window, causal
(``0 ≤ p_q − p_k < w``) or bidirectional (ModernBERT's local layers: ``|p_q − p_k| < w``; pairs wholly outside it on
either side are skipped).

**All-to-all** (:func:`all_to_all_attention`; DeepSpeed-Ulysses, Jacobs et al. 2023). One ``all_to_all`` turns
the sequence shards of ``Q``, ``K``, ``V`` into head shards over the whole sequence (``[b, h/cp, S, d]``; heads,
and key/value heads, must divide by ``cp``), attention runs on whole sequences with the gathered masks and
positions (and score modification: the score-modified kernel under autograd), and one ``all_to_all`` turns the
output back; each all-to-all's backward is the reverse all-to-all. It moves 4 · (cp − 1)/cp of the activations per
layer forward (3 in, 1 out) instead of the ring's 2 · (cp − 1) blocks, while the heads divide by ``cp``.

The blocks' kernels, masks and merge are ``hftrain.parallel.cp_kernels``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hftrain.parallel.cp_kernels import (
    DIAGONAL,
    MASKED,
    NEG_INF,
    _bias,
    _Block,
    _chunks,
    _mask,
    _merge,
    _repeat_kv,
    _segment_pair,
    _sum_groups,
    _visible_pairs,
    block_kernel,
)
from hftrain.parallel.cp_scored import scored_block_backward, scored_kernel


def _pair_mask(positions, pos_b, keep_b, segments, seg_b, qs: slice, ks: slice, causal: bool, window) -> torch.Tensor:
    """Which keys of the block's run ``ks`` each query of the run ``qs`` sees (``_mask``: padding, causality, the
    window, the documents that travel with the block as ``seg_b``)."""
    docs = _segment_pair(segments, seg_b[0] if seg_b else None, qs, ks)
    return _mask(positions[qs], pos_b[ks], keep_b[:, ks].bool(), causal, *docs, window=window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, positions, segments, causal, scale, group, runs, window, padded, score_mod):
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        n_rep = q.shape[1] // k.shape[1]
        kernel = block_kernel(q.device)
        scored = None if score_mod is None else scored_kernel(q.device)  # every block through it, masked
        b, h, sq, d = q.shape
        lse = torch.full((b, h, sq), NEG_INF, device=q.device)
        o = torch.zeros((b, h, sq, d), device=q.device)  # merged in fp32; each block computed in q's dtype
        q_runs = runs[me] if runs else _chunks(positions)
        keep_f = keep.to(torch.uint8)
        packed = [] if segments is None else [segments]  # the documents travel with their keys
        block = _Block([k, v, keep_f, positions, *packed])
        plain = not padded and segments is None  # no key is padding, one document per row: the runs decide
        for step in range(cp):
            pending = block.exchange(group) if step < cp - 1 else None
            kb, vb, keep_b, pos_b, *seg_b = block.tensors
            kr, vr = _repeat_kv(kb, n_rep), _repeat_kv(vb, n_rep)
            k_runs = runs[(me - step) % cp] if runs else _chunks(pos_b)  # the block came from rank me − step
            for qs, ks, pattern in _visible_pairs(q_runs, k_runs, causal, window, plain):
                q_b = q[:, :, qs]
                if scored is not None:  # a score modification: the block's own mask, its blind rows 0 and −∞
                    visible = _pair_mask(positions, pos_b, keep_b, segments, seg_b, qs, ks, causal, window)
                    o_b, lse_b = scored.forward(
                        q_b, kr[:, :, ks], vr[:, :, ks], visible, scale, score_mod, positions[qs], pos_b[ks]
                    )
                elif pattern != MASKED:  # every query row sees a key: no bias, no blind rows
                    o_b, lse_b = kernel.forward(q_b, kr[:, :, ks], vr[:, :, ks], None, scale, pattern == DIAGONAL)
                else:
                    visible = _pair_mask(positions, pos_b, keep_b, segments, seg_b, qs, ks, causal, window)
                    bias = _bias(visible, q.dtype, h, q_b.shape[2])
                    o_b, lse_b = kernel.forward(q_b, kr[:, :, ks], vr[:, :, ks], bias, scale)
                    # a query row with no visible key in this block (padding, or another document) contributes
                    # nothing: a kernel reports lse 0 there, and its output row may be anything
                    blind = ~visible.any(-1)
                    lse_b = lse_b.masked_fill(blind, NEG_INF)
                    o_b = o_b.masked_fill(blind[..., None], 0.0)
                o[:, :, qs], lse[:, :, qs] = _merge(o[:, :, qs], lse[:, :, qs], o_b, lse_b)
            if pending is not None:
                works, received = pending
                for work in works:
                    work.wait()
                block = _Block(received)
        empty = torch.isneginf(lse)  # padding queries that see no key: output 0, and no gradient through them
        out = torch.where(empty[..., None], torch.zeros_like(o), o).to(q.dtype)
        lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
        ctx.save_for_backward(q, k, v, keep_f, positions, out, lse, *packed)
        ctx.causal, ctx.scale, ctx.group, ctx.runs, ctx.window = causal, scale, group, runs, window
        ctx.plain, ctx.score_mod = plain, score_mod
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep_f, positions, out, lse, *packed = ctx.saved_tensors
        segments = packed[0] if packed else None
        causal, scale, group, runs, window = ctx.causal, ctx.scale, ctx.group, ctx.runs, ctx.window
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        n_rep = q.shape[1] // k.shape[1]
        kernel = block_kernel(q.device)
        score_mod = ctx.score_mod
        scored = None if score_mod is None else scored_kernel(q.device)
        do = grad_out.to(q.dtype).contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        q_runs = runs[me] if runs else _chunks(positions)
        block = _Block([k, v, keep_f, positions, *packed, torch.zeros_like(k, dtype=torch.float32),
                        torch.zeros_like(v, dtype=torch.float32)])  # fmt: skip
        for step in range(cp):
            kb, vb, keep_b, pos_b, *seg_b, dk, dv = block.tensors
            kr, vr = _repeat_kv(kb, n_rep), _repeat_kv(vb, n_rep)
            dkr = torch.zeros_like(kr, dtype=torch.float32)
            dvr = torch.zeros_like(vr, dtype=torch.float32)
            k_runs = runs[(me - step) % cp] if runs else _chunks(pos_b)
            for qs, ks, pattern in _visible_pairs(q_runs, k_runs, causal, window, ctx.plain):
                q_b = q[:, :, qs].contiguous()
                bias = None
                if scored is not None:
                    visible = _pair_mask(positions, pos_b, keep_b, segments, seg_b, qs, ks, causal, window)
                    dq_b, dk_b, dv_b = scored_block_backward(
                        scored, do[:, :, qs], q_b, kr[:, :, ks], vr[:, :, ks], visible, out[:, :, qs],
                        lse[:, :, qs], scale, score_mod, positions[qs], pos_b[ks],
                    )  # fmt: skip
                    dq[:, :, qs] += dq_b
                    dkr[:, :, ks] += dk_b
                    dvr[:, :, ks] += dv_b
                    continue
                if pattern == MASKED:
                    visible = _pair_mask(positions, pos_b, keep_b, segments, seg_b, qs, ks, causal, window)
                    bias = _bias(visible, q.dtype, q.shape[1], q_b.shape[2])
                dq_b, dk_b, dv_b = kernel.backward(
                    do[:, :, qs].contiguous(), q_b, kr[:, :, ks].contiguous(), vr[:, :, ks].contiguous(), bias,
                    out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), scale, pattern == DIAGONAL,
                )  # fmt: skip
                dq[:, :, qs] += dq_b.float()
                dkr[:, :, ks] += dk_b.float()
                dvr[:, :, ks] += dv_b.float()
            dk, dv = dk + _sum_groups(dkr, n_rep), dv + _sum_groups(dvr, n_rep)
            # Send the block on (its gradients with it); after the last block only the gradients go home.
            block = _Block([kb, vb, keep_b, pos_b, *seg_b, dk, dv] if step < cp - 1 else [dk, dv])
            if cp > 1:
                works, received = block.exchange(group)
                for work in works:
                    work.wait()
                block = _Block(received)
        dk, dv = block.tensors[-2:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *(None,) * 10


@dataclass(frozen=True)
class Shard:
    """What context-parallel attention needs besides this rank's queries, keys and values.

    Args:
        keep: ``[b, s]`` bool, False at padding keys.
        positions: ``[s]`` the global position of each local token (any order, e.g. zigzag).
        causal: a query sees only keys at its position or before.
        scale: the softmax scale (usually ``d ** -0.5``).
        group: the cp process group.
        runs: every cp rank's :func:`_chunks`, known on the host (:func:`zigzag_runs`); None: read from
            ``positions`` (a device read per ring step).
        segments: ``[b, s]`` the packed document of each local token (:func:`packed_segments`): a query sees only
            keys of its own document. None: one sequence per row.
        window: a sliding window: causal (Mistral's, a sliding layer's of Qwen2/3, Gemma-2/3, Phi-3), a query sees
            only the keys fewer than ``window`` positions before it; not causal (ModernBERT's local layers), the keys
            fewer than ``window`` positions away, ``|p_q − p_k| < window``. None: no window.
        padded: ``keep`` may hold a False (a padding key); False where the batch came without an attention mask (known
            on the host), so the ring masks a block only where positions, documents or a window need it.
        memo: what the attention computes once per forward and every layer shares (the all-to-all's gathered keep,
            positions and documents, and its mask per (causal, window)); a dict the forward's first layer fills,
            None: computed per call.
        score_mod: a modification of the scores before the softmax, ``score_mod(S, p_q, p_k)`` (``cp_scored.SoftCap``:
            Gemma-2's soft-capping), run by ``cp_scored``'s kernels; None: the fused kernels.
    """

    keep: torch.Tensor
    positions: torch.Tensor
    causal: bool
    scale: float
    group: Any
    runs: tuple | None = None
    segments: torch.Tensor | None = None
    window: int | None = None
    memo: dict | None = None
    padded: bool = True
    score_mod: Any = None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole (cp-split) sequence, by a ring of key/value blocks.

    Collective over ``shard.group`` (every cp rank calls it with its own shard, same shapes).

    Args:
        q: ``[b, h, s, d]`` this rank's queries.
        k: ``[b, h_kv, s, d]`` its keys (``h_kv`` divides ``h``: grouped-query attention).
        v: ``[b, h_kv, s, d]`` its values.
        shard: the padding, positions, causality, scale and group.

    Returns:
        ``[b, h, s, d]`` in ``q``'s dtype (each block in it, merged in fp32).
    """
    return _RingAttention.apply(
        q, k, v, shard.keep, shard.positions, shard.segments, shard.causal, shard.scale, shard.group, shard.runs,
        shard.window, shard.padded, shard.score_mod,
    )  # fmt: skip


class _AllToAll(torch.autograd.Function):
    """Sequence shards ``[b, h, s, d]`` → head shards ``[b, h/cp, cp·s, d]`` (or back with ``inverse``);
    the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, group, inverse):
        ctx.group, ctx.inverse = group, inverse
        return _exchange(x, group, inverse)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, not ctx.inverse), None, None


def _exchange(x: torch.Tensor, group: Any, inverse: bool) -> torch.Tensor:
    cp = dist.get_world_size(group)
    if not inverse:  # [b, h, s, d] → pieces by head → [b, h/cp, cp·s, d], rank j's positions at block j
        b, h, s, d = x.shape
        send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    b, hc, total, d = x.shape  # [b, h/cp, cp·s, d] → [b, h, s, d]
    s = total // cp
    send = x.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, cp * hc, s, d)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The same attention as :func:`ring_attention`, by two all-to-alls around whole-sequence attention on
    ``h/cp`` heads (heads and key/value heads must divide by cp). Arguments as :func:`ring_attention`."""
    keep, positions, group = shard.keep, shard.positions, shard.group
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(
            f"all-to-all context parallelism needs heads ({q.shape[1]}, {k.shape[1]}) divisible by cp={cp}"
        )
    memo = shard.memo if shard.memo is not None else {}
    if "whole" not in memo:  # the forward's first attention call: gathered once, shared by every layer
        memo["whole"] = _gather_whole(keep, positions, shard.segments, group, cp)
    whole_keep, whole_positions, whole_segments = memo["whole"]
    scored = shard.score_mod is not None  # the score-modified kernel takes the visibility itself, not a bias
    mask_key = ("mask", shard.causal, shard.window, None if scored else q.dtype)
    if mask_key not in memo:  # one [b, 1, S, S] mask per (causal, window), not one per layer
        memo[mask_key] = _visible_mask(
            whole_keep, whole_positions, shard.causal, whole_segments, shard.window, dtype=None if scored else q.dtype
        )
    qh, kh, vh = (_AllToAll.apply(t, group, False) for t in (q, k, v))
    if scored:  # whole sequences of this rank's heads, through the kernel's autograd
        n_rep = qh.shape[1] // kh.shape[1]
        visible, any_visible = memo[mask_key]
        out, _ = scored_kernel(q.device).forward(
            qh, _repeat_kv(kh, n_rep), _repeat_kv(vh, n_rep), visible, shard.scale, shard.score_mod,
            whole_positions, whole_positions,
        )  # fmt: skip
        out = out * any_visible.to(out.dtype)
    else:
        out = _local_attention(qh, kh, vh, shard.scale, *memo[mask_key])
    return _AllToAll.apply(out, group, True)


def _gather_whole(
    keep: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None, group: Any, cp: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every cp rank's keep mask, positions and documents, concatenated in rank order (all-gathers over cp): the
    whole sequence in the order the all-to-all hands it to the inner attention."""
    keeps = [torch.empty_like(keep, dtype=torch.uint8) for _ in range(cp)]
    dist.all_gather(keeps, keep.to(torch.uint8).contiguous(), group=group)
    all_positions = [torch.empty_like(positions) for _ in range(cp)]
    dist.all_gather(all_positions, positions.contiguous(), group=group)
    whole_segments = None
    if segments is not None:
        gathered = [torch.empty_like(segments) for _ in range(cp)]
        dist.all_gather(gathered, segments.contiguous(), group=group)
        whole_segments = torch.cat(gathered, 1)
    return torch.cat(keeps, 1).bool(), torch.cat(all_positions), whole_segments


def _visible_mask(
    keep, positions, causal, segments=None, window=None, *, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bias, any_visible)`` of the all-to-all's inner attention: SDPA's additive mask ``[b, 1, S, S]`` in the
    attention's ``dtype``, 0 where visible and −∞ elsewhere (a padding query, which sees no key, attends to every key
    and is zeroed after), and which queries see some key. Additive in the query's dtype, because SDPA keeps such a
    mask for its backward as it is: every layer then keeps this one tensor (a boolean mask is converted, and the
    copy kept, in each call). ``dtype`` None: the boolean visibility itself (the score-modified kernel's)."""
    docs = () if segments is None else (segments, segments)
    visible = _mask(positions, positions, keep, causal, *docs, window=window)
    any_visible = visible.any(-1, keepdim=True)
    if dtype is None:
        return visible, any_visible
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    bias.masked_fill_(~(visible | ~any_visible), float("-inf"))
    return bias, any_visible


class _SumOverContext(torch.autograd.Function):
    """``y = Σ_c x_c`` over the cp group (all-reduce), whose backward is the same sum (all-reduce): every cp rank
    computes the whole loss from ``y``, so each receives ``cp · ∂L/∂y`` and averaging gradients over cp (with dp) is
    exact. A pipeline's last chunk pools the classified token with it, a language model's loss sums its blocks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherContext(torch.autograd.Function):
    """The whole sequences ``H [b, S, ...]`` from every cp rank's positions ``H_r [b, S/cp, ...]``, in token order.

    Forward: one all-gather over the cp group, then the inverse of the zigzag permutation (an index, exact)::

        H = [H_0; H_1; …; H_{cp−1}][:, π⁻¹],   π = [p_0; p_1; …; p_{cp−1}]  (p_r: rank r's positions)

    Backward: every cp rank computes the whole loss ``L`` from ``H``, so rank ``r``'s input gradient is the sum of
    every rank's, at its positions: one all-reduce, then a slice::

        ∂L/∂H_r = (Σ_c ∂L_c/∂H)[:, p_r] = cp · ∂L/∂H[:, p_r]

    A rank's parameter gradients below the gather are then ``cp`` × its share, those above it (the head) the whole
    gradient on every rank, and the mean over the ``dp × cp`` group is the gradient in both (as
    :class:`_SumOverContext`).
    """

    @staticmethod
    def forward(ctx, x, group, positions, order):
        ctx.group, ctx.positions = group, positions
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 1).index_select(1, order)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(1, ctx.positions), None, None, None


ATTENTIONS = {"ring": ring_attention, "all_to_all": all_to_all_attention}  # the cp communication -> the attention


def _local_attention(q, k, v, scale, mask, any_visible) -> torch.Tensor:
    """Masked attention on one rank (the all-to-all's inner attention) by ``scaled_dot_product_attention`` (a fused
    kernel: flash on a CPU, memory-efficient on CUDA; no ``S × S`` probabilities kept), in the training dtype, with
    :func:`_visible_mask`'s mask; padding queries, which see no key, → 0 (they attend to every key and are zeroed,
    never a NaN)."""
    n_rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), attn_mask=mask, scale=scale
    )
    return out * any_visible.to(out.dtype)
