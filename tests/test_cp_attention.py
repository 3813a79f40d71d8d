"""Context-parallel attention (``hftrain.parallel.context_parallel``) against unsplit attention.

Real gloo processes: every rank draws the same whole-sequence queries, keys, values and padding, keeps its zigzag
shard, and runs ring attention and all-to-all attention on it; the outputs and the gradients of queries, keys and
values (through a random weighting of the outputs) must equal PyTorch's ``scaled_dot_product_attention`` on the whole
sequence within 1e-6 of each tensor's largest entry (fp32), causal and not, with right padding and grouped-query
heads, causal over packed documents (no token sees another document's), and causal in a sliding window (Mistral's,
Gemma-3's local layers), at cp = 2 and 4. Then whole classifiers
split over cp = 2 against the unsplit model (recomputed too), running their own forward.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed


def _inputs(seed: int, b: int, h: int, h_kv: int, seq: int, d: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, seq, d, generator=g)
    k = torch.randn(b, h_kv, seq, d, generator=g)
    v = torch.randn(b, h_kv, seq, d, generator=g)
    weights = torch.randn(b, h, seq, d, generator=g)
    lengths = torch.tensor([seq, seq - 5, seq // 2 + 1][:b])
    keep = torch.arange(seq)[None, :] < lengths[:, None]
    return q, k, v, weights, keep


def _packed_positions(b: int, seq: int):
    """Position ids of packed rows: documents of 1 to seq/4 tokens, each numbered from 0 (a row's documents differ)."""
    import torch

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(b):
        row: list[int] = []
        while len(row) < seq:
            row += list(range(int(torch.randint(1, seq // 4 + 1, (1,), generator=g))))
        rows.append(row[:seq])
    return torch.tensor(rows)


def _reference(q, k, v, weights, keep, causal, segments=None, window=None):
    import torch
    import torch.nn.functional as F

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    mask = keep[:, None, None, :].expand(-1, 1, q.shape[2], -1)
    if causal:
        mask = mask & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    if segments is not None:  # packed documents: a token sees only its own document (transformers' packed mask)
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    if window is not None:  # transformers' sliding_window_overlay: kv_idx > q_idx - window
        index = torch.arange(q.shape[2])
        mask = mask & (index[None, :] > index[:, None] - window)
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), attn_mask=mask
    )
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _with_cuda_contract(kernel):
    """``kernel`` that first checks its arguments as torch's memory-efficient CUDA kernel (the ring's kernel on a GPU)
    does: it broadcasts no dimension of the additive mask (``attn_bias: wrong shape (seqlenQ dimension)`` for a
    ``[b, h, 1, sk]`` mask, which the CPU's flash kernel takes), wants it in the query's dtype with a contiguous,
    aligned last dimension, and the log-sum-exp ``[b, h, sq]``. The ring runs through it on CPU, so a GPU-only shape
    error is caught here."""
    from hftrain.parallel.context_parallel import BlockKernel

    def check(q, k, bias):
        assert q.stride(-1) == 1 and k.stride(-1) == 1
        if bias is None:  # no mask (the kernel's is_causal, or none): nothing to shape
            return
        expected = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        assert bias.dim() == 4 and tuple(bias.shape) == expected, f"bias {tuple(bias.shape)}, kernel wants {expected}"
        assert bias.dtype == q.dtype and bias.stride(3) == 1 and bias.stride(2) % 16 == 0, bias.stride()

    def forward(q, k, v, bias, scale, causal=False):
        check(q, k, bias)
        assert not causal or (bias is None and q.shape[2] == k.shape[2])  # a square diagonal block, unmasked
        return kernel.forward(q, k, v, bias, scale, causal)

    def backward(dout, q, k, v, bias, out, lse, scale, causal=False):
        check(q, k, bias)
        assert lse.shape == q.shape[:3], (lse.shape, q.shape)
        return kernel.backward(dout, q, k, v, bias, out, lse, scale, causal)

    return BlockKernel(forward, backward)


def _compare(h: int, h_kv: int) -> dict:
    import torch
    import torch.distributed as dist

    from hftrain.parallel import context_parallel, cp_attention
    from hftrain.parallel.context_parallel import (
        Shard,
        all_to_all_attention,
        packed_segments,
        ring_attention,
        zigzag_positions,
    )

    context_parallel.BLOCK_KERNELS["cpu"] = _with_cuda_contract(context_parallel.BLOCK_KERNELS["cpu"])
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    b, seq, d = 3, 8 * cp, 8
    errors = {}
    # a sliding window of 5 (chunks of 4): pairs of chunks wholly outside it are skipped, the rest masked
    for causal, packed, window in ((False, False, None), (True, False, None), (True, True, None), (True, False, 5),
                                   (True, True, 5)):  # fmt: skip
        q, k, v, weights, keep = _inputs(0, b, h, h_kv, seq, d)
        segments = packed_segments(_packed_positions(b, seq)) if packed else None
        if packed:  # packed blocks carry no padding mask (a document of padding only would see no key)
            keep = torch.ones_like(keep)
        assert not packed or (segments[:, -1] > 2).all()  # several documents in every row
        expected = _reference(q, k, v, weights, keep, causal, segments, window)
        pos = zigzag_positions(seq, cp, rank)
        mine_segments = None if segments is None else segments[:, pos]
        runs = context_parallel.zigzag_runs(seq, cp)
        for name, attention in (("ring", ring_attention), ("all_to_all", all_to_all_attention), ("ring, runs", None)):
            mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            if attention is None:  # the runs known on the host: the ring reads no positions from the tensors
                chunks, cp_attention._chunks = cp_attention._chunks, None  # where the ring looks it up
                try:
                    shard = Shard(keep[:, pos], pos, causal, d**-0.5, dist.group.WORLD, runs, mine_segments, window)
                    out = ring_attention(*mine, shard)
                    (out * weights[:, :, pos]).sum().backward()
                finally:
                    cp_attention._chunks = chunks
            else:
                shard = Shard(keep[:, pos], pos, causal, d**-0.5, dist.group.WORLD, None, mine_segments, window)
                out = attention(*mine, shard)
                (out * weights[:, :, pos]).sum().backward()
            got = (out.detach(), *(t.grad for t in mine))
            # relative to the tensor's largest entry: fp32 sums in another order differ by a few units of 6e-8
            errors[f"{name} causal={causal} packed={packed} window={window}"] = max(
                ((g - e[:, :, pos]).abs().max() / e.abs().max()).item() for g, e in zip(got, expected, strict=True)
            )
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("cp, heads", [(2, (4, 2)), (4, (8, 4))])
def test_ring_and_all_to_all_attention_equal_unsplit_attention(cp, heads):
    for errors in run_distributed(_compare, nprocs=cp, timeout=300, h=heads[0], h_kv=heads[1]):
        assert max(errors.values()) < 1e-6, errors


def test_zigzag_gives_every_rank_one_early_and_one_late_chunk():
    import torch

    from hftrain.parallel.context_parallel import unzigzag_order, zigzag_positions

    chunks = [zigzag_positions(16, 4, r) for r in range(4)]
    assert torch.equal(torch.sort(torch.cat(chunks)).values, torch.arange(16))
    assert torch.equal(torch.cat(chunks)[unzigzag_order(16, 4)], torch.arange(16))  # the gather's token order
    assert chunks[0].tolist() == [0, 1, 14, 15] and chunks[3].tolist() == [6, 7, 8, 9]
    # causal work (keys at or before each query) is the same on every rank
    assert len({int((c + 1).sum()) for c in chunks}) == 1


def _model_parity(kinds: list[str], cases: list[tuple[str, str | None]], seq: int) -> dict:
    """Each model × (communication, recomputation): the cp-split classifier's loss, logits and cp-averaged gradients
    against the same model unsplit, on a padded batch; and whether the split model still runs its class's own
    ``forward`` (no instance attribute replacing it) with context parallelism's hooks on its base model."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from hftrain.parallel.context_parallel import apply_context_parallel
    from hftrain.parallel.families import stages_for
    from hftrain.parallel.recompute import apply_activation_checkpointing
    from tests.tiny import tiny_config

    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    errors, own_forward, gathered = {}, {}, {}
    for kind in kinds:
        for comm, recompute in cases:
            torch.manual_seed(0)
            config = tiny_config(kind, num_labels=3, vocab_size=128)
            # RoBERTa numbers positions from its padding index: pad + seq at most
            config.max_position_embeddings = config.n_positions = seq + 2
            config.pad_token_id = 0
            model = AutoModelForSequenceClassification.from_config(config).train()
            reference = copy.deepcopy(model)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(1, 128, (3, seq), generator=g)
            mask = (torch.arange(seq)[None] < torch.tensor([seq, seq - 56, seq // 2 + 3])[:, None]).long()
            batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}
            expected = reference(**batch)
            expected.loss.backward()
            trunk = stages_for(model.config, axis="cp")  # what parallelize passes (a classifier head)
            apply_context_parallel(model, trunk=trunk, per_token=False, cp_group=dist.group.WORLD, comm=comm)
            if recompute is not None:
                apply_activation_checkpointing(model, recompute)
            label = f"{kind} {comm}" + (f" recompute={recompute}" if recompute else "")
            own_forward[label] = (
                "forward" not in vars(model)
                and model.forward.__func__ is type(model).forward
                and len(model.base_model._forward_pre_hooks) == 1
            )
            gathers, all_gather = [], dist.all_gather

            def counted(*a, gathers=gathers, all_gather=all_gather, **k):
                gathers.append(1)
                return all_gather(*a, **k)

            dist.all_gather = counted
            try:
                got = model(**batch)
            finally:
                dist.all_gather = all_gather
            gathered[label] = (len(gathers), config.num_hidden_layers)
            got.loss.backward()
            worst = max(
                (got.loss - expected.loss).abs().item() / expected.loss.abs().item(),
                ((got.logits - expected.logits).abs().max() / expected.logits.abs().max()).item(),
            )
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                grad = p.grad.clone()
                dist.all_reduce(grad)
                grad /= cp
                # A key bias's gradient is 0 in exact arithmetic (softmax ignores a per-query constant): rounding
                # noise of 1e-9 there is no error, so the scale has a floor.
                worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-4)).item())
            errors[label] = worst
    return {"errors": errors, "own_forward": own_forward, "gathered": gathered}


@pytest.fixture(scope="module")
def classifier_runs() -> list[dict]:
    """cp = 2, sequence length 256 with padding: BERT (not causal; its pooler inside the base model reads the first
    token), RoBERTa (positions numbered from the padding index over the whole sequence), GPT-2 and Llama (causal,
    zigzag; the last non-pad token pooled), each with ring and all-to-all attention, and with full and selective
    recomputation."""
    cases = [("ring", None), ("all_to_all", None), ("ring", "full"), ("all_to_all", "selective")]
    return run_distributed(
        _model_parity, nprocs=2, timeout=600, kinds=["bert", "roberta", "gpt2", "llama"], cases=cases, seq=256
    )


@pytest.mark.distributed
def test_context_parallel_classifiers_equal_the_unsplit_model(classifier_runs):
    """Loss, logits and every gradient (averaged over cp) within 1e-5 of the unsplit model's."""
    for run in classifier_runs:
        assert max(run["errors"].values()) < 1e-5, run["errors"]


@pytest.mark.distributed
def test_context_parallel_runs_the_models_own_forward(classifier_runs):
    """Context parallelism wraps the inputs and the attention only: the split classifier's ``forward`` is its class's
    own (no replacement set on the instance), with one pre-hook on its base model; its head, pooling and loss are
    transformers' (their equality with one process, recomputed or not, is the test above)."""
    for run in classifier_runs:
        assert len(run["own_forward"]) == 16 and all(run["own_forward"].values()), run["own_forward"]


@pytest.mark.distributed
def test_the_all_to_all_gathers_and_masks_once_per_forward(classifier_runs):
    """The all-to-all's keep mask and positions are gathered by the forward's first attention call and its mask built
    once per (causal, window), shared by every layer: two all-gathers per forward whatever the depth (before: two
    per layer, and a ``[b, 1, S, S]`` mask per layer, each kept for the backward): two more than the ring's forward
    (whose own gathers, the pooled token's, are the model's)."""
    for run in classifier_runs:
        seen = run["gathered"]
        for kind in ("bert", "roberta", "gpt2", "llama"):
            (ring, layers), (all_to_all, _) = seen[f"{kind} ring"], seen[f"{kind} all_to_all"]
            assert layers >= 2 and all_to_all - ring == 2, (kind, seen)


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_the_same_on_every_rank(cp):
    """The query-key scores each rank computes over the whole ring (pairs wholly in the causal future skipped):
    equal on every rank with the zigzag split, unlike a contiguous split (rank cp−1 would do 2·cp − 1 times
    rank 0's work)."""
    from hftrain.parallel.context_parallel import _chunks, _visible_pairs, zigzag_positions

    seq = 16 * cp
    shards = [zigzag_positions(seq, cp, r) for r in range(cp)]
    work = [
        sum(
            (q.stop - q.start) * (k.stop - k.start)
            for b in shards
            for q, k, _pattern in _visible_pairs(_chunks(s), _chunks(b), True)
        )
        for s in shards
    ]
    assert len(set(work)) == 1, work
