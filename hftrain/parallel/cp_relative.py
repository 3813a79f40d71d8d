"""Context parallelism for disentangled relative attention (DeBERTa-v2/v3): all-to-all over heads, exact.

DeBERTa's ``DisentangledSelfAttention`` (transformers) scores a query ``i`` against a key ``j`` by their contents and
by their bucketed relative position ``δ(i, j) = clamp(bucket(p_i − p_j) + k, 0, 2k − 1)`` (``bucket``: transformers'
``make_log_bucket_position`` with the module's ``position_buckets`` and ``max_relative_positions``; ``k`` its
``pos_ebd_size``), through the shared relative embeddings ``E`` ``[2k, hidden]`` projected per head,
``K_r = key_proj(E)`` and ``Q_r = query_proj(E)`` (or ``pos_key_proj`` / ``pos_query_proj`` without
``share_att_key``)::

    A(i, j) = (q_i · k_j + c2p(i, j) + p2c(i, j)) / sqrt(d · scale_factor)
    c2p(i, j) = q_i · K_r[δ(i, j)],        p2c(i, j) = k_j · Q_r[δ'(j, i)],   δ'(j, i) = clamp(k − bucket(p_j − p_i))

(``scale_factor`` = 1 + one per c2p / p2c term), masked where query or key is padding, softmaxed over ``j``. c2p and
p2c depend on the contents of ``q_i`` and ``k_j`` and on their relative position, so a fused attention kernel with
an additive mask (the ring's per block) cannot compute them; the whole-sequence scores of some heads can.

So each cp rank, holding positions ``p_r`` of every sequence (``hftrain.parallel.context_parallel``'s zigzag split):

1. projects its positions' ``q, k, v`` ``[b, h, S/cp, d]`` (``h``: the module's heads, this tp rank's under tp);
2. turns them into head shards over the whole sequence ``[b, h/cp, S, d]`` (one all-to-all:
   ``hftrain.parallel.cp_attention._AllToAll``; cp rank ``c`` gets heads ``c·h/cp … (c+1)·h/cp − 1``, the positions
   concatenated in rank order);
3. computes ``A`` for its heads on the whole sequence: relative positions from the gathered global positions (in the
   same concatenated order), ``K_r`` and ``Q_r`` sliced to its heads, padding from the gathered keep mask (query
   and key: transformers' pairwise mask, so a padding query attends evenly to every key, as on one process);
4. turns the output back into sequence shards ``[b, h, S/cp, d]`` (the reverse all-to-all).

Collectives per layer, over the cp group: forward 2 all-to-all exchanges (in: one ``all_to_all_single`` for each of
q, k, v; back: one for the output), backward their reverses; the keep mask and positions are all-gathered once per
forward (shared with every layer through the forward's memo). The scores ``[b, h/cp, S, S]`` exist whole, as in
transformers' own (eager) attention on one process.
Each cp rank's gradient of the shared relative embeddings and position projections is its heads' share, complete
after the gradients' sum over dp × cp (as every parameter's under cp). Attention dropout must be 0 under cp
(``check_context_parallel_model``); ``pos_dropout`` on ``E`` runs as transformers runs it, from the stream in force
(under tp the plan's shared default stream).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hftrain.parallel.cp_attention import _AllToAll, _gather_whole

PAIRWISE = ("disentangled", "pairwise")  # the forward memo's key of the whole sequence's pairwise padding mask


def apply_relative_context_parallel(attentions: list[torch.nn.Module], batch: Any) -> None:
    """Make each ``DisentangledSelfAttention`` of ``attentions`` run split over the cp ranks (in place): its
    ``forward`` is replaced on the instance by :func:`disentangled_attention`, bound to the module and ``batch``
    (hooks on the module, tp's region and dropout streams, still run around it).

    Args:
        attentions: the layers' ``attention.self`` modules.
        batch: the model's per-forward cp state (``hftrain.parallel.context_parallel._Batch``: keep mask, positions,
            group, memo), set by the base model's pre-hook before the layers run.
    """
    for module in attentions:
        module.forward = partial(disentangled_attention, module, batch)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, s, h·d]`` → ``[b, h, s, d]``."""
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)


def _relative_indices(module: torch.nn.Module, positions: torch.Tensor, memo: dict) -> tuple[torch.Tensor, ...]:
    """The c2p and p2c gather indices ``[S, S]`` of the whole sequence in the all-to-all's order (positions
    ``[S]``): ``c2p[i, j] = δ(i, j)``, ``p2c[j, i] = δ'(j, i)`` (the module docstring), as transformers builds them
    from its relative positions; once per forward and module geometry."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    buckets, most, span = module.position_buckets, module.max_relative_positions, module.pos_ebd_size
    key = ("disentangled", buckets, most, span)
    if key not in memo:
        relative = positions[:, None] - positions[None, :]  # p_i − p_j
        if buckets > 0 and most > 0:
            relative = make_log_bucket_position(relative, buckets, most)
        relative = relative.to(torch.long)
        memo[key] = (torch.clamp(relative + span, 0, 2 * span - 1), torch.clamp(-relative + span, 0, 2 * span - 1))
    return memo[key]


def _relative_projections(module: torch.nn.Module, rel_embeddings: torch.Tensor, heads: slice, n_heads: int):
    """``(K_r, Q_r)`` ``[h/cp, 2k, d]`` of this cp rank's heads (None where the term is off), from transformers'
    projections of the whole relative embeddings (a LoRA layer on them runs as it is)."""
    types = module.pos_att_type
    embeddings = module.pos_dropout(rel_embeddings)[: 2 * module.pos_ebd_size]
    key_proj = module.key_proj if module.share_att_key else getattr(module, "pos_key_proj", None)
    query_proj = module.query_proj if module.share_att_key else getattr(module, "pos_query_proj", None)
    pos_key = _heads(key_proj(embeddings[None]), n_heads)[0, heads] if "c2p" in types else None
    pos_query = _heads(query_proj(embeddings[None]), n_heads)[0, heads] if "p2c" in types else None
    return pos_key, pos_query


def disentangled_attention(
    module: torch.nn.Module,
    batch: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    output_attentions: bool = False,
    query_states: torch.Tensor | None = None,
    relative_pos: torch.Tensor | None = None,
    rel_embeddings: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """``DisentangledSelfAttention.forward`` over the cp ranks (the module docstring): this rank's positions'
    hidden states ``[b, S/cp, hidden]`` in, their context ``[b, S/cp, h·d]`` out. ``attention_mask`` and
    ``relative_pos`` (built by the encoder on this rank's positions alone) are ignored: padding and relative
    positions come from ``batch`` (the whole sequence's). Collective over the cp group."""
    if output_attentions or query_states is not None or batch.segments is not None:
        raise ValueError(
            "context parallelism splits DeBERTa's attention probabilities over cp ranks: no output_attentions, no "
            "query_states (the enhanced mask decoder's) and no packed documents (position_ids)"
        )
    from transformers.models.deberta_v2.modeling_deberta_v2 import scaled_size_sqrt

    group, n_heads = batch.group, module.num_attention_heads  # this tp rank's heads under tp
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if n_heads % cp:
        raise ValueError(f"all-to-all context parallelism needs the attention's {n_heads} heads divisible by cp={cp}")
    q, k, v = (_heads(p(hidden_states), n_heads) for p in (module.query_proj, module.key_proj, module.value_proj))
    q, k, v = (_AllToAll.apply(t.contiguous(), group, False) for t in (q, k, v))  # [b, h/cp, S, d]
    memo = batch.memo
    if "whole" not in memo:  # shared with the family-agnostic all-to-all's key (the same gathers)
        memo["whole"] = _gather_whole(batch.keep, batch.positions, batch.segments, group, cp)
    keep, positions, _ = memo["whole"]
    if PAIRWISE not in memo:  # transformers' m_i · m_j: a padding query sees no key (then all keys, evenly)
        memo[PAIRWISE] = (keep[:, None, :, None] & keep[:, None, None, :]).logical_not()
    scale_factor = 1 + ("c2p" in module.pos_att_type) + ("p2c" in module.pos_att_type)
    scale = scaled_size_sqrt(q, scale_factor).to(q.dtype)
    scores = q @ (k.transpose(-1, -2) / scale)  # [b, h/cp, S, S]
    if module.relative_attention:
        local = n_heads // cp
        mine = slice(rank * local, (rank + 1) * local)  # the heads the all-to-all gave this rank
        pos_key, pos_query = _relative_projections(module, rel_embeddings, mine, n_heads)
        c2p_index, p2c_index = _relative_indices(module, positions, memo)
        shape = scores.shape
        if pos_key is not None:  # c2p(i, j) = q_i · K_r[δ(i, j)]
            c2p = torch.gather(q @ pos_key.transpose(-1, -2), -1, c2p_index.expand(shape))
            scores = scores + c2p / scale.to(c2p.dtype)
        if pos_query is not None:  # p2c(i, j) = k_j · Q_r[δ'(j, i)]: gathered per key row, then transposed
            p2c = torch.gather(k @ pos_query.transpose(-1, -2), -1, p2c_index.expand(shape)).transpose(-1, -2)
            scores = scores + p2c / scale.to(p2c.dtype)
    scores = scores.masked_fill(memo[PAIRWISE], torch.finfo(q.dtype).min)
    out = torch.softmax(scores, dim=-1) @ v  # [b, h/cp, S, d]
    out = _AllToAll.apply(out, group, True)  # [b, h, S/cp, d]
    b, _, s, _ = out.shape
    return out.transpose(1, 2).reshape(b, s, -1), None
