"""Context parallelism's kernels: the zigzag layout, the masks and the fused attention of one key/value block.

Rank ``r`` of ``cp`` holds chunks ``r`` and ``2·cp − 1 − r`` of ``2·cp`` of every sequence
(:func:`zigzag_positions`), so every rank has as many early as late queries and causal work is even. Causal
masking compares global positions, never indices; a packed block's tokens carry their document
(:func:`packed_segments`). Each (query chunk, key chunk) pair runs one fused attention kernel in the training dtype
(:data:`BLOCK_KERNELS`: torch's flash kernel on a CPU, its memory-efficient kernel on CUDA, each taking the block's
additive mask and returning ``O_j`` and ``lse_j``), masked to −∞ where the key is padding, (causal) after the query,
outside a sliding window (causal ``p_q − p_k < w``, or bidirectional ``|p_q − p_k| < w``: ModernBERT's local layers)
or in another document (:func:`_visible_pairs` says which pairs need a mask at all); the blocks are merged in fp32
(:func:`_merge`)::

    lse' = log(e^lse + e^lse_j);   O' = O·e^(lse − lse') + O_j·e^(lse_j − lse')

A block whose scores pass through a modification first (Gemma-2's soft-capping) runs
``hftrain.parallel.cp_scored``'s kernels instead, merged the same way. The algorithms that move the blocks between
ranks are ``hftrain.parallel.cp_attention``'s; the model's wiring is ``hftrain.parallel.context_parallel``'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

NEG_INF = float("-inf")


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """The global positions rank ``cp_rank`` holds under the zigzag split: chunks ``cp_rank`` and
    ``2·cp − 1 − cp_rank`` of ``2·cp`` equal chunks (``seq_len`` must divide by ``2·cp``).

    Args:
        seq_len: the padded sequence length ``S``.
        cp: context-parallel size.
        cp_rank: this rank's position in the cp group.
        device: where the positions live.
    """
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not divide into 2·cp = {2 * cp} chunks")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, h_kv, s, d]`` → ``[b, h_kv·n_rep, s, d]``, each key/value head repeated for its query group."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _sum_groups(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of :func:`_repeat_kv`: the query group's gradients summed back to its key/value head."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(2)


def _chunks(positions: torch.Tensor) -> list[tuple[slice, int, int]]:
    """Runs of consecutive positions, at most half of the shard long, as ``(slice, first, last position)``: the
    zigzag's two chunks even where they meet (the middle rank's are adjacent), so that a causal pair wholly in
    the future is skipped by comparing two numbers and every rank computes the same number of scores."""
    pos = positions.tolist()
    longest = max(1, len(pos) // 2)
    runs, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1 or i - start == longest:
            runs.append((slice(start, i), pos[start], pos[i - 1]))
            start = i
    return runs


@functools.lru_cache(maxsize=64)
def zigzag_runs(seq_len: int, cp: int) -> tuple[tuple[tuple[slice, int, int], ...], ...]:
    """:func:`_chunks` of every cp rank's zigzag positions, computed on the host from ``(seq_len, cp)``: the ring
    then reads no positions from the device (a ``.tolist()`` of a GPU tensor per ring step waits for the GPU)."""
    return tuple(tuple(_chunks(zigzag_positions(seq_len, cp, r))) for r in range(cp))


@functools.lru_cache(maxsize=64)
def unzigzag_order(seq_len: int, cp: int) -> torch.Tensor:
    """``π⁻¹``: the index that puts the cp ranks' zigzag shards, concatenated in rank order
    (``π = [p_0; …; p_{cp−1}]``), back in token order (on the host, computed once per ``(seq_len, cp)``)."""
    return torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)]).argsort()


def _mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_keep: torch.Tensor,
    causal: bool,
    q_seg: torch.Tensor | None = None,
    k_seg: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Visible ``[b, 1, sq, sk]``: the key is not padding, (causal) not after the query, within the sliding
    ``window`` (causal: fewer than ``window`` positions before the query, transformers' ``kv_idx > q_idx −
    sliding_window``; not causal, ModernBERT's bidirectional window: ``|p_q − p_k| < window``, transformers'
    ``|q_idx − kv_idx| ≤ config.sliding_window`` with ``window = config.sliding_window + 1`` as its attention passes
    it), and (``q_seg``/``k_seg`` ``[b, sq]``/``[b, sk]``: packed documents) in the query's document."""
    visible = k_keep[:, None, None, :]
    if causal:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])[None, None]
    if window is not None:
        distance = q_pos[:, None] - k_pos[None, :]
        visible = visible & ((distance if causal else distance.abs()) < window)[None, None]
    if q_seg is not None:
        visible = visible & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    return visible


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """The document of each token of packed sequences ``[b, s]``: a new one wherever the position does not follow
    the one before (transformers' ``find_packed_sequence_indices``, the rule its packed masks use)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


class _Block:
    """One key/value block in flight: its tensors, keep mask and positions (and gradient accumulators)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def exchange(self, group: Any) -> tuple[list[Any], list[torch.Tensor]]:
        """Start sending these tensors to the next cp rank and receiving the previous rank's (asynchronous)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        nxt = dist.get_global_rank(group, (rank + 1) % size)
        prv = dist.get_global_rank(group, (rank - 1) % size)
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in self.tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group=group) for t in self.tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, group=group) for r in received]
        return dist.batch_isend_irecv(ops), received


MASKED, WHOLE, DIAGONAL = "masked", "whole", "diagonal"
"""How a block is masked: by a dense additive bias (padding, documents, a window's edge, or positions not in one of
the two patterns below); not at all (every key visible to every query); or causally on its diagonal (the query
and key runs are the same positions: the kernel's own ``is_causal``, query ``i`` sees keys ``j ≤ i``)."""


def _visible_pairs(q_runs, k_runs, causal: bool, window: int | None = None, plain: bool = False):
    """(query slice, key slice, pattern) of the pairs that are not wholly in the causal future, nor (a sliding
    ``window``) wholly ``window`` or more positions in the past (or, a bidirectional window, in the future).
    ``pattern`` (:data:`MASKED`, :data:`WHOLE`, :data:`DIAGONAL`) is decided on the host from the runs' first and
    last positions: where ``plain`` (no padding key, one document per row), a pair whose keys are all at or before its
    first query (``k_last ≤ q_first``; any key, not causal) and within the window of every query (``q_last − k_first <
    window``, and ``k_last − q_first < window`` for a bidirectional one) needs no mask, and a run against itself is
    causal on its diagonal; anything else (or not ``plain``) is :data:`MASKED`."""
    for q_slice, q_first, q_last in q_runs:
        for k_slice, k_first, k_last in k_runs:
            if causal and k_first > q_last:
                continue
            if window is not None and (q_first - k_last >= window or (not causal and k_first - q_last >= window)):
                continue
            pattern = MASKED
            inside = window is None or (q_last - k_first < window and (causal or k_last - q_first < window))
            if plain and inside:
                if not causal or k_last <= q_first:
                    pattern = WHOLE
                elif (k_first, k_last) == (q_first, q_last):
                    pattern = DIAGONAL
            yield q_slice, k_slice, pattern


# ----------------------------------------------------------------------------- fused attention of one block
@dataclass(frozen=True)
class BlockKernel:
    """Fused attention of one (query run, key run) block that also returns its log-sum-exp, and its backward.

    ``forward(q, k, v, bias, scale, causal) -> (out, lse)``: ``q, k, v`` ``[b, h, sq|sk, d]`` in the training dtype,
    ``bias`` ``[b, h, sq, sk]`` additive (0 or −∞) in that dtype or None (no mask), ``causal`` the kernel's own
    ``is_causal`` (a square block on its diagonal, no bias); ``out`` in that dtype, ``lse`` ``[b, h, sq]`` fp32.
    ``backward(dout, q, k, v, bias, out, lse, scale, causal) -> (dq, dk, dv)`` with the *whole* attention's ``out``
    and ``lse`` of these queries (FlashAttention's backward of one block: ``P = e^(S − lse)``,
    ``D = rowsum(dO ∘ out)``).
    A kernel computes the scores in tiles and never keeps the ``sq × sk`` probabilities.
    """

    forward: Any
    backward: Any


def _cpu_forward(q, k, v, bias, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dout, q, k, v, bias, out, lse, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _cuda_forward(q, k, v, bias, scale, causal=False):
    # memory-efficient attention (flash takes no bias); its log-sum-exp is padded to a multiple of 32 queries
    out, lse, _seed, _offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _cuda_backward(dout, q, k, v, bias, out, lse, scale, causal=False):
    padded = -(-q.shape[2] // 32) * 32
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    no_dropout = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed and offset: unused at p = 0
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, no_dropout, no_dropout, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


BLOCK_KERNELS = {"cpu": BlockKernel(_cpu_forward, _cpu_backward), "cuda": BlockKernel(_cuda_forward, _cuda_backward)}
"""The fused block kernel of each device type (torch's own: flash for CPU, memory-efficient on CUDA, both taking an
additive mask and returning the log-sum-exp, as torch's ring attention uses them)."""


def block_kernel(device: torch.device) -> BlockKernel:
    """The fused kernel for ``device``; another device type is one line (no slow fallback)."""
    kernel = BLOCK_KERNELS.get(device.type)
    if kernel is None:
        raise ValueError(f"context parallelism has no fused attention kernel for device '{device.type}'")
    return kernel


def _bias(visible: torch.Tensor, dtype: torch.dtype, heads: int, sq: int) -> torch.Tensor:
    """An additive mask ``[b, heads, sq, sk]`` (0 where visible, −∞ elsewhere) from ``visible`` ``[b, 1, 1|sq,
    sk]``, shaped as the memory-efficient CUDA kernel requires (every dimension its full size: it broadcasts none),
    one ``[b, 1, sq, sk]`` copy expanded over the heads (stride 0, as ``scaled_dot_product_attention`` passes a
    mask), its rows 16-element aligned (the kernel reads the mask in aligned vectors, as that function pads it)."""
    b, sk = visible.shape[0], visible.shape[-1]
    aligned = -(-sk // 16) * 16
    storage = torch.full((b, 1, sq, aligned), NEG_INF, dtype=dtype, device=visible.device)
    bias = storage[..., :sk]
    bias.masked_fill_(visible.expand(b, 1, sq, sk), 0.0)
    return bias.expand(b, heads, sq, sk)


def _merge(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> tuple:
    """The online softmax over two parts of the keys: ``lse' = log(e^lse + e^lse_b)``,
    ``o' = o·e^(lse − lse') + o_b·e^(lse_b − lse')`` (rows that saw no key yet keep ``lse = −∞``, ``o = 0``)."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    merged = o * torch.exp(lse - safe)[..., None] + o_b.float() * torch.exp(lse_b - safe)[..., None]
    return merged, new


def _segment_pair(segments: torch.Tensor | None, seg_b: torch.Tensor | None, qs: slice, ks: slice) -> tuple:
    """The query run's and the key run's documents for :func:`_mask` (none when the sequences are not packed)."""
    return () if segments is None else (segments[:, qs], seg_b[:, ks])
