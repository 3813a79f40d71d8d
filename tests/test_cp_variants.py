"""Context parallelism for the attention variants of Gemma-2 (soft-capped logits), ModernBERT (bidirectional local
windows) and ALBERT (one layer module run every layer), against one process.

- Kernel level (real gloo processes, cp = 2 and 4, fp32): ring and all-to-all attention with soft-capping (causal,
  padded, grouped-query; and in a causal sliding window), with a bidirectional window (padded, and without padding,
  where the ring runs unmasked blocks), both at once, and with a modification that reads the global positions,
  equal to the unsplit attention (outputs and the gradients of q, k, v) within 1e-5 of each tensor's largest entry.
  Every block kernel call is counted: score-modified attention never reaches the fused kernels, the plain cases
  never reach the score-modified one; block pairs wholly outside a
  bidirectional window are skipped.
- The bidirectional window's bound is transformers' own (``sliding_window_bidirectional_overlay``).
- Through the Trainer (2 processes, cp = 2, 10 steps): Gemma-2 with soft-capping and a sliding window of 4 tokens
  (ring and all-to-all), ModernBERT with local windows of 4 tokens (ring and all-to-all) and ALBERT (ring), texts of
  20-40 words; and the three at pp = 2 × cp = 2 (4 processes): each equals its one-process run (losses, learning
  rates, evaluation) within 1e-5.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed


def _distance_bias(scores, q_pos, k_pos):
    """A score modification that reads the positions (an ALiBi-like slope): the ring must hand it global ones."""
    return scores - 0.1 * (q_pos - k_pos).abs()


def _reference(q, k, v, weights, visible, scale, mod):
    """Eager attention on the whole sequence (transformers' order: scale, the modification, mask, softmax); a query
    that sees no key gives 0."""
    import torch

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(n_rep, 1).transpose(-1, -2) * scale
    if mod is not None:
        index = torch.arange(q.shape[2])
        scores = mod(scores, index[:, None], index[None, :])
    seen = visible.any(-1, keepdim=True)
    scores = torch.where(seen, scores.masked_fill(~visible, float("-inf")), torch.zeros_like(scores))
    out = (scores.softmax(-1) * seen) @ v.repeat_interleave(n_rep, 1)
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _visible(seq: int, keep, causal: bool, window: int | None):
    """``[b, 1, S, S]``: padding keys, causality, the window (causal ``q − k < w``, bidirectional ``|q − k| < w``)."""
    import torch

    index = torch.arange(seq)
    distance = index[:, None] - index[None, :]
    visible = keep[:, None, None, :].expand(-1, 1, seq, -1)
    if causal:
        visible = visible & (distance >= 0)
    if window is not None:
        visible = visible & ((distance if causal else distance.abs()) < window)
    return visible


def _counting(kernels: dict, name: str, counts: dict):
    """``kernels["cpu"]`` with each call counted under ``counts[name]``."""
    import dataclasses

    kernel = kernels["cpu"]
    wrapped = {}
    for field in dataclasses.fields(kernel):
        function = getattr(kernel, field.name)

        def counted(*args, function=function, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        wrapped[field.name] = counted
    kernels["cpu"] = type(kernel)(**wrapped)


# label -> (causal, window, softcap (or "distance": _distance_bias), padded)
CASES = {
    "softcap causal": (True, None, 2.0, True),
    "softcap causal window": (True, 5, 2.0, False),
    "bidirectional window": (False, 5, None, True),
    "bidirectional window unpadded": (False, 5, None, False),
    "softcap bidirectional window": (False, 5, 2.0, True),
    "distance-scored causal": (True, None, "distance", True),
}


def _kernels() -> dict:
    import torch
    import torch.distributed as dist

    from hftrain.parallel import context_parallel
    from hftrain.parallel.context_parallel import (
        SCORED_KERNELS,
        Shard,
        SoftCap,
        _chunks,
        _visible_pairs,
        all_to_all_attention,
        ring_attention,
        zigzag_positions,
        zigzag_runs,
    )

    counts = {"fused": 0, "scored": 0}
    _counting(context_parallel.BLOCK_KERNELS, "fused", counts)
    _counting(SCORED_KERNELS, "scored", counts)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    b, h, h_kv, seq, d = 3, 2 * cp, cp, 8 * cp, 8  # grouped-query heads the all-to-all divides by cp
    scale = d**-0.5
    g = torch.Generator().manual_seed(0)
    q, k, v, weights = (torch.randn(b, n, seq, d, generator=g) for n in (h, h_kv, h_kv, h))
    q = q * 3  # scores of several units: the cap of 2 bends them
    lengths = torch.tensor([seq, seq - 5, seq // 2 + 1])
    pos = zigzag_positions(seq, cp, rank)
    result: dict = {"errors": {}, "counts": {}}
    for label, (causal, window, cap, padded) in CASES.items():
        keep = torch.arange(seq)[None, :] < lengths[:, None] if padded else torch.ones(b, seq, dtype=torch.bool)
        mod = _distance_bias if cap == "distance" else None if cap is None else SoftCap(cap)
        expected = _reference(q, k, v, weights, _visible(seq, keep, causal, window), scale, mod)
        for comm, attention in (("ring", ring_attention), ("all_to_all", all_to_all_attention)):
            counts.update(fused=0, scored=0)
            mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            shard = Shard(
                keep[:, pos], pos, causal, scale, dist.group.WORLD, zigzag_runs(seq, cp), None, window,
                padded=padded, score_mod=mod,
            )  # fmt: skip
            out = attention(*mine, shard)
            (out * weights[:, :, pos]).sum().backward()
            got = (out.detach(), *(t.grad for t in mine))
            result["errors"][f"{comm} {label}"] = max(
                ((g - e[:, :, pos]).abs().max() / e.abs().max()).item() for g, e in zip(got, expected, strict=True)
            )
            result["counts"][f"{comm} {label}"] = dict(counts)
    # the ring's pairs over the whole sequence (chunks of 4 when cp = 2): those wholly outside the window skipped
    shards = [_chunks(zigzag_positions(seq, cp, r)) for r in range(cp)]
    every = sum(len(s) * len(t) for s in shards for t in shards)
    kept = sum(len(list(_visible_pairs(s, t, False, 5))) for s in shards for t in shards)
    result["pairs"] = (kept, every)
    dist.destroy_process_group()
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_soft_capped_and_bidirectional_window_attention_equal_unsplit_attention(cp):
    for got in run_distributed(_kernels, nprocs=cp, timeout=300):
        assert max(got["errors"].values()) < 1e-5, got["errors"]
        for label, counts in got["counts"].items():
            if (
                "scored" in label or "softcap" in label
            ):  # every block through the score-modified kernel, none through the fused one
                assert counts["scored"] > 0 and counts["fused"] == 0, (label, counts)
            else:  # the plain cases keep the fused kernels (the all-to-all's own SDPA call counts as neither)
                assert counts["scored"] == 0, (label, counts)
                assert counts["fused"] > 0 or label.startswith("all_to_all"), (label, counts)
        kept, every = got["pairs"]
        assert 0 < kept < every, got["pairs"]


def test_the_bidirectional_window_is_transformers_modernbert_mask():
    """``_mask`` with ModernBERT's window (the attention's ``sliding_window``: ``config.sliding_window + 1``) sees
    exactly the keys transformers' bidirectional sliding mask lets through (``|q − k| ≤ config.sliding_window``)."""
    import torch
    from transformers.masking_utils import sliding_window_bidirectional_overlay

    from hftrain.parallel.context_parallel import _visible_pairs
    from hftrain.parallel.cp_kernels import _mask
    from tests.tiny import tiny_config

    config = tiny_config("modernbert")
    window = config.sliding_window + 1  # what ModernBertAttention passes to the attention interface
    seq = 24
    positions = torch.arange(seq)
    ours = _mask(positions, positions, torch.ones(1, seq, dtype=torch.bool), False, window=window)[0, 0]
    overlay = sliding_window_bidirectional_overlay(config.sliding_window)
    theirs = torch.tensor([[bool(overlay(0, 0, i, j)) for j in range(seq)] for i in range(seq)])
    assert torch.equal(ours, theirs)
    assert theirs.sum(-1).max() == 2 * config.sliding_window + 1  # a window narrower than the sequence
    # runs of 4: a pair is kept exactly where some query sees some key, and unmasked where every one does
    runs = [(slice(i, i + 4), i, i + 3) for i in range(0, seq, 4)]
    for qs, ks, pattern in _visible_pairs(runs, runs, False, window, plain=True):
        block = theirs[qs, ks]
        assert block.any() and (pattern == "whole") == bool(block.all()), (qs, ks, pattern)
    kept = {(qs.start, ks.start) for qs, ks, _ in _visible_pairs(runs, runs, False, window)}
    assert kept == {(qs.start, ks.start) for qs, _, _ in runs for ks, _, _ in runs if theirs[qs, ks].any()}


# label -> (kind, strategy options)
TRAINER = {
    "gemma2-ring": ("gemma2", {"cp": 2}),
    "gemma2-all_to_all": ("gemma2", {"cp": 2, "cp_comm": "all_to_all"}),
    "modernbert-ring": ("modernbert", {"cp": 2}),
    "modernbert-all_to_all": ("modernbert", {"cp": 2, "cp_comm": "all_to_all"}),
    "albert-ring": ("albert", {"cp": 2}),
}
# 4 processes, pp = 2 × cp = 2: the pipeline chunks run the layers themselves (ALBERT's shared group on both stages)
PIPELINED = {
    f"{kind}-pp2cp2": (kind, {"cp": 2, "pp": 2, "num_microbatches": 2}) for kind in ("gemma2", "modernbert", "albert")
}
TEXTS = {"words": (20, 40), "max_seq_length": 64, "micro": 8}  # one replica: the global batch is 8 in every layout


def _trainer_runs(cases: dict) -> dict:
    from tests.tiny import run_tiny_training

    return {
        label: run_tiny_training(kind=kind, strategy="megatron", strategy_options=options, **TEXTS)
        for label, (kind, options) in cases.items()
    }


def _trainer_references() -> dict:
    from tests.tiny import run_tiny_training

    return {kind: run_tiny_training(kind=kind, strategy="ddp", **TEXTS) for kind in {k for k, _ in TRAINER.values()}}


@pytest.fixture(scope="module")
def trainer_runs() -> dict:
    two = run_distributed(_trainer_runs, nprocs=2, timeout=900, cases=TRAINER)
    four = run_distributed(_trainer_runs, nprocs=4, timeout=900, cases=PIPELINED)
    (one,) = run_distributed(_trainer_references, nprocs=1, timeout=900)
    return {"two": two, "four": four, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("layout, label", [*(("two", k) for k in TRAINER), *(("four", k) for k in PIPELINED)])
def test_each_variant_at_cp2_trains_as_one_process(trainer_runs, layout, label):
    from tests.megatron_runs import assert_parity

    reference = trainer_runs["one"][(TRAINER | PIPELINED)[label][0]]
    ranks = trainer_runs[layout]
    for rank in ranks:
        assert_parity(rank[label], reference)
        assert rank[label]["losses"] == ranks[0][label]["losses"]  # every rank logs the same loss
    assert ranks[0][label]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)


def test_the_cuda_kernels_forward_equals_the_cpu_math(monkeypatch):
    """The CUDA score-modified kernel's forward (torch's ``flex_attention``: the score modification by index, the
    block mask from the visibility, the natural-log ``lse``) run on a CPU without gradients (flex attention's CPU
    path is inference only; uncompiled here) equals the CPU math kernel's, blind rows included, for soft-capping and
    for a modification that reads the positions; its backward, which
    needs a GPU, is the shared ``scored_block_backward`` the distributed tests above check."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from hftrain.parallel import cp_scored
    from hftrain.parallel.cp_kernels import _mask

    monkeypatch.setattr(cp_scored, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(0)
    b, h, sq, sk, d = 2, 4, 24, 40, 8
    q, k, v = (
        torch.randn(b, h, sq, d, generator=g) * 3,
        torch.randn(b, h, sk, d, generator=g),
        torch.randn(b, h, sk, d, generator=g),
    )
    q_pos, k_pos = torch.arange(10, 10 + sq), torch.arange(sk)
    keep = torch.ones(b, sk, dtype=torch.bool)
    keep[1, 12:] = False  # row 1's queries past position 15 see no key in a window of 4: blind rows

    def distance_bias(scores, q_at, k_at):  # a modification that reads the positions (an ALiBi-like slope)
        return scores - 0.1 * (q_at - k_at).abs()

    cases = [(causal, window, mod) for causal, window in ((True, None), (False, 5), (True, 4))
             for mod in (distance_bias, cp_scored.SoftCap(2.0))]  # fmt: skip
    for causal, window, mod in cases:
        visible = _mask(q_pos, k_pos, keep, causal, window=window)
        with torch.no_grad():
            expected = cp_scored._math_forward(q, k, v, visible, 0.3, mod, q_pos, k_pos)
            got = cp_scored._flex_forward(q, k, v, visible, 0.3, mod, q_pos, k_pos)
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)  # −∞ where blind, in both
    assert torch.isneginf(expected[1]).any()
