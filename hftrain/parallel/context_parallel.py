"""Context parallelism: attention over a sequence split across the ``cp`` ranks (ring, or all-to-all).

Each of the ``cp`` ranks holds ``S / cp`` positions of every sequence: its queries ``Q_r``, keys ``K_r`` and values
``V_r`` ``[b, h, S/cp, d]``, a key-keep mask ``[b, S/cp]`` (padding) and the global position of each of its
tokens. The positions are what make a split exact whatever its order: causal masking compares positions, never
indices, so the load-balancing **zigzag** layout (:func:`zigzag_positions`: rank ``r`` holds chunks ``r`` and
``2·cp − 1 − r`` of ``2·cp``, so every rank has as many early as late queries and causal work is even) needs
nothing else. Packed sequences (a language model's blocks, whose position ids restart at every document) also carry
each token's document (:func:`packed_segments`), and a key is visible only in its query's document, as transformers'
packed mask has it on one process.

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

**All-to-all** (:func:`all_to_all_attention`; DeepSpeed-Ulysses, Jacobs et al. 2023). One ``all_to_all`` turns
the sequence shards of ``Q``, ``K``, ``V`` into head shards over the whole sequence (``[b, h/cp, S, d]``; heads,
and key/value heads, must divide by ``cp``), attention runs on whole sequences with the gathered masks and
positions, and one ``all_to_all`` turns the output back; each all-to-all's backward is the reverse all-to-all. It
moves 4 · (cp − 1)/cp of the activations per layer forward (3 in, 1 out) instead of the ring's 2 · (cp − 1)
blocks, while the heads divide by ``cp``.

**The model** (:func:`apply_context_parallel`) keeps its own ``forward``, head, pooling and loss: context parallelism
touches only the inputs, the positions and the attention. A forward pre-hook on the base model numbers the whole
sequences' positions as the family does, sets the attention's padding, and hands the base model rank ``r``'s
positions ``p_r`` of every per-token input. A classifier's hidden states are gathered back after the trunk's last
layer, by one all-gather and the inverse zigzag permutation ``π⁻¹`` (an index: exact)::

    H = [H_0; …; H_{cp−1}][:, π⁻¹],       ∂L/∂H_r = (Σ_c ∂L_c/∂H)[:, p_r]   (backward: one all-reduce, a slice)

so the final norm or pooler, the head and transformers' loss see the whole sequences, as on one process. A causal
LM gathers nothing: its logits are this rank's positions', and its task sums the loss over cp.

Why hand-written: torch's ``torch.distributed.tensor.experimental.context_parallel`` runs ring attention only
inside SDPA on CUDA DTensors, without key-padding masks (its load balancer assumes causal LM batches); BERT-style
padded, non-causal classification on gloo is outside it, as it is outside Megatron's and Accelerate's CP.
Dropout inside attention is not supported here (the probabilities never exist whole); attention dropout must be
0 under ``cp`` (the caller checks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hftrain.parallel.chunk import ChunkExtra

NEG_INF = float("-inf")


# ----------------------------------------------------------------- what cp can split
ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
"""The config fields that hold a family's attention dropout, which must be 0 under cp."""


def check_context_parallel(cp: int, *, sequence_parallel: bool = False, pad_to_multiple_of: int | None = None) -> None:
    """Refuse, before any model or process group, what ``cp`` does not compose with yet (sequence parallelism) and
    length buckets the zigzag split (``2·cp`` equal chunks) cannot cut; ``AxisError`` naming ``cp``.

    Args:
        cp: context-parallel size.
        sequence_parallel: Megatron sequence parallelism in the tp regions.
        pad_to_multiple_of: the length buckets (None: none).
    """
    import math

    from hftrain.errors import AxisError

    if cp == 1:
        return
    if sequence_parallel:
        raise AxisError("cp", f"cp={cp} with sequence parallelism is not supported yet; use sequence_parallel: false")
    if pad_to_multiple_of and pad_to_multiple_of % (2 * cp):
        raise AxisError(
            "cp",
            f"length buckets of {pad_to_multiple_of} (pad_to_multiple_of) are not a multiple of 2·cp = {2 * cp}, and "
            f"context parallelism cuts every sequence into 2·cp equal chunks; use a multiple of {2 * cp} (e.g. "
            f"{math.lcm(pad_to_multiple_of, 2 * cp)})",
        )


def check_context_parallel_model(config: Any, cp: int, *, tp: int = 1, comm: str = "ring") -> None:
    """Refuse a model ``cp`` cannot split (no processes needed): another family, attention dropout (the attention
    probabilities never exist whole), heads the all-to-all cannot divide; ``AxisError`` naming ``cp``.

    Args:
        config: the model's ``PretrainedConfig``.
        cp: context-parallel size (> 1).
        tp: tensor-parallel size (the all-to-all splits each tp rank's heads).
        comm: ``"ring"`` or ``"all_to_all"``.
    """
    from hftrain.errors import AxisError
    from hftrain.parallel.families import check_family
    from hftrain.parallel.plans import grouped_query_split

    check_family(config, axis="cp")
    for name in ATTENTION_DROPOUT_FIELDS:
        if getattr(config, name, 0) or 0:
            raise AxisError(
                "cp",
                f"cp={cp}: context parallelism needs attention dropout 0, and the model's {name} is "
                f"{getattr(config, name)}; save the model with {name}: 0.0 in its config.json",
            )
    if comm == "all_to_all":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # each tp rank's own heads (checked by check_tensor_parallel first); key/value heads fewer than tp are
        # replicated, one per rank, which no cp > 1 divides
        split = grouped_query_split(heads, kv_heads, tp)
        if split.heads % cp or split.kv_heads % cp:
            raise AxisError(
                "cp",
                f"cp_comm all_to_all splits heads over cp, and each tp rank's {split.heads} heads / {split.kv_heads} "
                f"key/value heads do not divide by cp={cp}; use cp_comm: ring or a cp dividing both",
            )


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
    """Visible ``[b, 1, sq, sk]``: the key is not padding, (causal) not after the query, (``window``: a causal
    sliding window) fewer than ``window`` positions before it (transformers' ``kv_idx > q_idx − sliding_window``), and
    (``q_seg``/``k_seg`` ``[b, sq]``/``[b, sk]``: packed documents) in the query's document."""
    visible = k_keep[:, None, None, :]
    if causal:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])[None, None]
    if window is not None:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)[None, None]
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
    ``window``) wholly ``window`` or more positions in the past. ``pattern`` (:data:`MASKED`, :data:`WHOLE`,
    :data:`DIAGONAL`) is decided on the host from the runs' first and last positions: where ``plain`` (no padding
    key, one document per row), a pair whose keys are all at or before its first query (``k_last ≤ q_first``) and
    within the window of its last (``q_last − k_first < window``) needs no mask, and a run against itself is
    causal on its diagonal; anything else (or not ``plain``) is :data:`MASKED`."""
    for q_slice, q_first, q_last in q_runs:
        for k_slice, k_first, k_last in k_runs:
            if causal and k_first > q_last:
                continue
            if window is not None and q_first - k_last >= window:
                continue
            pattern = MASKED
            if plain and (window is None or q_last - k_first < window):
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keep, positions, segments, causal, scale, group, runs, window, padded):
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        n_rep = q.shape[1] // k.shape[1]
        kernel = block_kernel(q.device)
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
                if pattern != MASKED:  # every query row sees a key: no bias, no blind rows
                    o_b, lse_b = kernel.forward(q_b, kr[:, :, ks], vr[:, :, ks], None, scale, pattern == DIAGONAL)
                else:
                    docs = _segment_pair(segments, seg_b[0] if seg_b else None, qs, ks)
                    visible = _mask(positions[qs], pos_b[ks], keep_b[:, ks].bool(), causal, *docs, window=window)
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
        ctx.plain = plain
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep_f, positions, out, lse, *packed = ctx.saved_tensors
        segments = packed[0] if packed else None
        causal, scale, group, runs, window = ctx.causal, ctx.scale, ctx.group, ctx.runs, ctx.window
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        n_rep = q.shape[1] // k.shape[1]
        kernel = block_kernel(q.device)
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
                if pattern == MASKED:
                    docs = _segment_pair(segments, seg_b[0] if seg_b else None, qs, ks)
                    visible = _mask(positions[qs], pos_b[ks], keep_b[:, ks].bool(), causal, *docs, window=window)
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
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None, None


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
        window: a causal sliding window (Mistral's, a sliding layer's of Qwen2/3, Gemma-3, Phi-3): a query sees only
            the keys fewer than ``window`` positions before it. None: no window.
        padded: ``keep`` may hold a False (a padding key); False where the batch came without an attention mask (known
            on the host), so the ring masks a block only where positions, documents or a window need it.
        memo: what the attention computes once per forward and every layer shares (the all-to-all's gathered keep,
            positions and documents, and its mask per (causal, window)); a dict the forward's first layer fills,
            None: computed per call.
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

    def __post_init__(self) -> None:
        if self.window is not None and not self.causal:
            raise ValueError("context parallelism builds causal sliding windows only")


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
        shard.window, shard.padded,
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
    mask_key = ("mask", shard.causal, shard.window, q.dtype)
    if mask_key not in memo:  # one [b, 1, S, S] mask per (causal, window), not one per layer
        memo[mask_key] = _visible_mask(
            whole_keep, whole_positions, shard.causal, whole_segments, shard.window, dtype=q.dtype
        )
    qh, kh, vh = (_AllToAll.apply(t, group, False) for t in (q, k, v))
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
    keep, positions, causal, segments=None, window=None, *, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bias, any_visible)`` of the all-to-all's inner attention: SDPA's additive mask ``[b, 1, S, S]`` in the
    attention's ``dtype``, 0 where visible and −∞ elsewhere (a padding query, which sees no key, attends to every key
    and is zeroed after), and which queries see some key. Additive in the query's dtype, because SDPA keeps such a
    mask for its backward as it is: every layer then keeps this one tensor (a boolean mask is converted, and the
    copy kept, in each call)."""
    docs = () if segments is None else (segments, segments)
    visible = _mask(positions, positions, keep, causal, *docs, window=window)
    any_visible = visible.any(-1, keepdim=True)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    bias.masked_fill_(~(visible | ~any_visible), float("-inf"))
    return bias, any_visible


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


# ----------------------------------------------------------------------------- a model over cp ranks
ATTENTION_NAME = "hftrain_context_parallel"


class _Batch:
    """What every attention call of one forward needs besides q, k, v: set by the model's forward, read by the
    attention function through the module it is called with (one per model: no module global)."""

    def __init__(self, group: Any, comm: str) -> None:
        self.group, self.comm = group, comm
        self.keep: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.runs: tuple | None = None  # every cp rank's runs of positions, on the host (zigzag_runs)
        self.segments: torch.Tensor | None = None  # packed sequences: the document of each local token
        self.padded = True  # keep may hold padding (False: the batch came without an attention mask)
        self.memo: dict = {}  # what every layer of this forward shares (Shard.memo), new at each forward


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-interface entry: ``[b, h, s, d]`` in, ``([b, s, h, d], None)`` out; the local
    4-D mask transformers built is ignored: padding and causality come from the batch's keep mask and positions."""
    batch: _Batch = module.context_parallel_batch
    if dropout:
        raise ValueError("context parallelism needs attention dropout 0 (the attention probabilities are never whole)")
    if kwargs.get("softcap") is not None:
        raise ValueError("context parallelism has no soft-capped attention (the family's check refuses it)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = bool(getattr(module, "is_causal", False))
    window = kwargs.get("sliding_window")  # the layer's (None: full attention), as transformers passes it
    shard = Shard(
        batch.keep, batch.positions, causal, scale, batch.group, batch.runs, batch.segments, window, batch.memo,
        batch.padded,
    )  # fmt: skip
    out = ATTENTIONS[batch.comm](query, key, value, shard)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """The mask function registered beside :func:`_attention`: it builds its own masks from the positions."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _no_mask)


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


class ContextSplit(ChunkExtra):
    """This rank's part of every sequence: what the model's hooks (:func:`apply_context_parallel`), pipeline chunks
    and a language model's loss use to split, gather and sum over the cp ranks.

    Args:
        batch: the per-forward state the model's attention modules read.
    """

    name = "context_split"
    splits_sequence = True  # a pipeline chunk's task head embeds and reduces through it

    def __init__(self, batch: _Batch) -> None:
        self.batch = batch
        self.cp, self.rank = dist.get_world_size(batch.group), dist.get_rank(batch.group)

    def positions(self, seq: int, device: Any = None) -> torch.Tensor:
        """The zigzag positions this rank keeps of a whole sequence of ``seq`` tokens."""
        if seq % (2 * self.cp):
            raise ValueError(f"sequence length {seq} must be a multiple of 2·cp = {2 * self.cp} (pad_to_multiple_of)")
        return zigzag_positions(seq, self.cp, self.rank, device=device)

    def attend(self, keep: torch.Tensor, segments: torch.Tensor | None = None, *, padded: bool = True) -> torch.Tensor:
        """Set the attention's padding mask to this rank's ``keep`` ``[b, s/cp]`` (and, for packed sequences, the
        document of each of its tokens, ``segments`` ``[b, s/cp]``; ``padded``: False where the batch came without
        an attention mask, so ``keep`` is all True); returns its global positions."""
        seq = keep.shape[1] * self.cp
        positions = self.positions(seq, keep.device)
        self.batch.keep, self.batch.positions, self.batch.runs = keep.bool(), positions, zigzag_runs(seq, self.cp)
        self.batch.segments, self.batch.padded = segments, padded
        self.batch.memo = {}  # this forward's gathers and masks, shared by its layers
        return positions

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a per-token tensor of the whole sequences ``[b, s, ...]`` (e.g. the targets)."""
        return x[:, self.positions(x.shape[1], x.device)]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequences ``[b, s, ...]``, in token order, of a per-token tensor of this rank's positions
        ``[b, s/cp, ...]``: an all-gather over the cp group whose backward is an all-reduce and this rank's slice
        (:class:`_GatherContext`)."""
        seq = x.shape[1] * self.cp
        order = unzigzag_order(seq, self.cp).to(x.device)
        return _GatherContext.apply(x, self.batch.group, self.positions(seq, x.device), order)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``Σ`` over the cp ranks, whose backward is the same sum (:class:`_SumOverContext`)."""
        return _SumOverContext.apply(x, self.batch.group)


def apply_context_parallel(model: torch.nn.Module, *, cp_group: Any, comm: str = "ring") -> torch.nn.Module:
    """Make an HF model of a family context parallelism takes (``hftrain.parallel.families``: BERT, GPT-2, GPT-NeoX
    and the rotary decoders, sliding windows included) run split over the sequence, in place. Context parallelism
    touches the inputs, the positions and the attention only; the model's own ``forward``, head, pooling and loss run
    unchanged on every cp rank, which takes the *same* whole batch (padded to a multiple of ``2·cp``):

    - the attention becomes context-parallel (:func:`_attention`: ring or all-to-all);
    - a forward pre-hook on the base model (``model.base_model``: BertModel, GPT2Model, LlamaModel, …;
      :class:`_SplitInputs`) numbers the whole sequences' positions as the family does (by index, or RoBERTa's
      count of non-pad tokens: the trunk adapter's ``position_ids``), sets the attention's padding (and, for a causal
      LM, packed documents), and hands the base model this rank's zigzag positions of ``input_ids``,
      ``attention_mask``, ``token_type_ids``, ``position_ids`` (and ``inputs_embeds``);
    - a ``*ForSequenceClassification``: a forward hook on the trunk's last layer (the family's trunk adapter's
      ``layers``) gathers every rank's hidden states back into the whole sequences in token order
      (:class:`_GatherContext`: all-gather forward, all-reduce and this rank's slice backward), so the base model's
      final norm or pooler (BERT's sits inside the base model, after the layers), the model's head, its pooling of
      the classified token (BERT's first, GPT-2's and Llama's last non-pad one, found on the whole ``input_ids``) and
      transformers' loss run as on one process: the head needs to know nothing of the split. A base model that views
      its output to its (local) input's shape (GPT-2's ``view(output_shape)``) is viewed back to the whole batch's;
    - a ``*ForCausalLM`` gathers nothing: it returns the logits of this rank's positions only; the task takes the
      same positions of its targets (``model.context_split.local``) and sums its loss over the cp group
      (``model.context_split.sum``). Packed documents (positions restarting) stay apart: the attention masks by
      document as well as by position.

    Every cp rank computes the whole loss, so parameter gradients are ``cp`` × one rank's share below the gather
    (the whole gradient above it); averaging them over the cp (and dp) group, as Megatron does, gives the gradient.
    The hooks stay outside transformers' layer checkpoints (``GradientCheckpointingLayer`` checkpoints ``forward``,
    not ``__call__``): recomputation runs no collective of theirs again. The model's ``context_split``
    (:class:`ContextSplit`) also serves code that runs its modules itself: pipeline chunks take it
    (``hftrain.parallel.stages.PipelineChunk``), and there the hooks stay idle (the base model is never called).

    Args:
        model: the model (possibly tensor-parallel already: attention sees this rank's heads).
        cp_group: the context-parallel process group.
        comm: ``"ring"`` or ``"all_to_all"``.
    """
    from hftrain.parallel.families import is_causal_lm_class, stages_for

    name = type(model).__name__
    trunk = stages_for(model.config, class_name=name, axis="cp")
    _register()
    batch = _Batch(cp_group, comm)
    for module in model.modules():
        module.context_parallel_batch = batch
    model.set_attn_implementation(ATTENTION_NAME)
    split = model.context_split = ContextSplit(batch)
    per_token = is_causal_lm_class(name)
    base = model.base_model
    inputs = _SplitInputs(split, trunk, trunk.embed_modules(model), base, packed=per_token)
    base.register_forward_pre_hook(inputs, with_kwargs=True)
    if not per_token:  # a classifier: the whole sequences again after the last layer
        trunk.layers(model)[-1].register_forward_hook(inputs.gather)
        base.register_forward_hook(inputs.whole, always_call=True)
    return model


def _first(output: Any, function: Any) -> Any:
    """``output`` (a tensor, a tuple whose first item is the hidden states, or a ``ModelOutput``) with its hidden
    states replaced by ``function`` of them."""
    if isinstance(output, torch.Tensor):
        return function(output)
    if isinstance(output, tuple):
        return (function(output[0]), *output[1:])
    output.last_hidden_state = function(output.last_hidden_state)
    return output


class _SplitInputs:
    """The base model's forward pre-hook (this rank's positions of its inputs) and a classifier's gather.

    Args:
        split: this rank's part of the sequences.
        trunk: the family's trunk adapter (``position_ids``: RoBERTa's numbering from the padding index).
        embeddings: the trunk's embedding modules (``trunk.embed_modules``).
        base: the base model (its ``forward``'s positional parameters, to name positional arguments).
        packed: a causal LM's: each token's document (:func:`packed_segments`) from the positions.
    """

    def __init__(self, split: ContextSplit, trunk: Any, embeddings: Any, base: torch.nn.Module, *, packed: bool):
        import inspect

        self.split, self.trunk, self.embeddings, self.packed = split, trunk, embeddings, packed
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = inspect.signature(base.forward).parameters.values()
        self.names = [p.name for p in parameters if p.kind in kinds]
        self.whole_shape: tuple[int, int] | None = None  # (b, S) while a classifier's base model runs

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs) → ((), kwargs)`` with this rank's positions of every per-token input: position ids
        numbered on the whole sequences first (given, the family's, or the index), the attention's padding mask
        (and documents) set."""
        kwargs = {**dict(zip(self.names, args, strict=False)), **kwargs}
        input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        whole = input_ids if input_ids is not None else embeds
        b, seq, device = whole.shape[0], whole.shape[1], whole.device
        local = self.split.positions(seq, device)
        position_ids = kwargs.get("position_ids")
        # documents only where positions were given (a causal LM's packed blocks restart them); numbered here they
        # run 0..S−1 in every row: one document, so the ring need not mask by document
        documents = self.packed and position_ids is not None
        if position_ids is None:
            position_ids = self._numbered(input_ids, b, seq, device)
        mask = kwargs.get("attention_mask")
        keep = torch.ones((b, seq), dtype=torch.bool, device=device) if mask is None else mask.bool()
        segments = packed_segments(position_ids.expand(b, -1))[:, local] if documents else None
        self.split.attend(keep[:, local], segments=segments, padded=mask is not None)
        kwargs["position_ids"] = position_ids[:, local]
        for key in ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids"):
            if kwargs.get(key) is not None:
                kwargs[key] = kwargs[key][:, local]
        self.whole_shape = None if self.packed else (b, seq)
        return (), kwargs

    def _numbered(self, input_ids: torch.Tensor | None, b: int, seq: int, device: Any) -> torch.Tensor:
        """The family's position ids of the whole sequences ``[b | 1, S]``: RoBERTa's count of non-pad tokens from
        the padding index (the trunk's ``position_ids``), else the index."""
        if input_ids is not None:
            numbered = self.trunk.position_ids(self.embeddings, input_ids)
            if numbered is not None:
                return numbered
        elif getattr(self.trunk, "pad_numbered", False):
            raise ValueError("context parallelism numbers this family's positions from input_ids; pass input_ids")
        return torch.arange(seq, device=device).expand(b, -1)

    def gather(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """The trunk's last layer's forward hook: the whole sequences of its hidden states (:meth:`ContextSplit.gather`)
        while the base model runs on this rank's positions (idle in a pipeline chunk, which calls the layer itself)."""
        if self.whole_shape is None:
            return output
        return _first(output, self.split.gather)

    def whole(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """The base model's forward hook: its output's hidden states ``[b, S, h]`` (a base model that viewed them to
        its local input's shape ``(-1, S/cp, h)``, GPT-2's, viewed back: the same memory); the gather goes idle."""
        shape, self.whole_shape = self.whole_shape, None
        if shape is None or output is None:
            return output
        return _first(output, lambda hidden: hidden.reshape(*shape, *hidden.shape[2:]))
