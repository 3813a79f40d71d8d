"""The vocabulary-parallel cross-entropy against ``F.cross_entropy`` on the full logits, and its memory.

Correctness: one launch of 4 gloo processes checks tp = 4 (the world), tp = 2 (groups {0, 1} and {2, 3}) and tp = 1
(a group of one rank, and ``tp_group=None``). Every rank builds the same full logits, labels (some ignored) and
per-token loss weights from one seed, takes its slice of the padded vocabulary, and compares the loss and its
slice's gradient with single-process ``F.cross_entropy(reduction="none")`` on the unpadded full logits. Vocabularies
that tp does not divide are padded as ``padded_vocab_size`` pads them, and the padding columns hold garbage (large
values, ``inf``, ``nan``) that must not change anything.

Memory: at tp = 4 with GPT-2's vocabulary (50,257), 1,024 tokens and fp32, each rank's peak resident memory
(``VmHWM``, reset through ``/proc/self/clear_refs``) added by the lm_head's local matmul, the loss and the backward,
in fresh processes per approach: the vocabulary-parallel loss against the gathered approach (all-gather the logits to
the full vocabulary, then ``F.cross_entropy``).
"""

from __future__ import annotations

import time

import pytest

from tests.distributed import run_distributed
from tests.memory import process_memory, reset_peak

LOSS_TOL = 1e-6
GRAD_TOL = 1e-6
BF16_REL = 2.0**-8  # bf16 keeps 8 significant bits: a rounded gradient is within 2^-9 of its value


def _full_case(vocab: int, padded: int, shape: tuple[int, ...], ignore_index: int, seed: int):
    """The same full padded logits (garbage in the padding), labels and loss weights on every rank."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, padded, generator=generator)
    garbage = torch.tensor([1e4, float("inf"), float("nan"), -3.0])
    logits[..., vocab:] = garbage.repeat(padded)[: padded - vocab]
    labels = torch.randint(0, vocab, shape, generator=generator)
    flat = labels.view(-1)
    flat[0] = vocab - 1  # the last real column (next to the padding)
    flat[1] = 0
    flat[2::5] = ignore_index
    weights = torch.rand(shape, generator=generator) + 0.5  # a non-uniform incoming gradient
    return logits, labels, weights


def _check_slice(group, tp: int, rank: int, dtype, vocab: int, shape, *, multiple: int = 1, ignore_index: int = -100):
    """One configuration: this rank's loss and gradient against the full reference; returns the largest errors."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hftrain.parallel.collectives import record_collectives
    from hftrain.parallel.cross_entropy import vocab_parallel_cross_entropy
    from hftrain.parallel.plans import padded_vocab_size

    padded = padded_vocab_size(vocab, tp, multiple)
    width = padded // tp
    full, labels, weights = _full_case(vocab, padded, shape, ignore_index, seed=vocab * 7 + tp)
    full = full.to(dtype)

    reference = full[..., :vocab].float().requires_grad_(True)  # the same (rounded) values, unsplit and unpadded
    ref_loss = F.cross_entropy(
        reference.reshape(-1, vocab), labels.reshape(-1), reduction="none", ignore_index=ignore_index
    ).view(labels.shape)
    (ref_loss * weights).sum().backward()
    ref_grad = F.pad(reference.grad, (0, padded - vocab))[..., rank * width : (rank + 1) * width]

    local = full[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    untouched = local.detach().clone()
    with record_collectives() as forward_counts:
        loss = vocab_parallel_cross_entropy(
            local, labels, tp_group=group, vocab_start=rank * width, vocab_size=vocab, ignore_index=ignore_index
        )
    with record_collectives() as backward_counts:
        (loss * weights).sum().backward()

    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert local.grad.dtype == dtype and local.grad.shape == local.shape
    assert torch.allclose(local.detach(), untouched, rtol=0, atol=0, equal_nan=True)  # the input is not modified
    loss_error = (loss - ref_loss).abs().max().item()
    assert loss_error <= LOSS_TOL, loss_error
    ignored = labels == ignore_index
    assert torch.all(loss[ignored] == 0)
    assert torch.all(local.grad[ignored] == 0)  # ignored tokens: no gradient on any column
    real = max(0, min(width, vocab - rank * width))
    assert torch.all(local.grad[..., real:] == 0)  # padding columns: exactly zero, garbage notwithstanding
    grad = local.grad.float()
    grad_error = (grad - ref_grad).abs().max().item()
    if dtype == torch.float32:
        assert grad_error <= GRAD_TOL, grad_error
    else:  # the fp32 gradient rounded once to bf16
        bound = BF16_REL * ref_grad.abs() + 1e-12
        assert torch.all((grad - ref_grad).abs() <= bound), grad_error
    size = 1 if group is None else dist.get_world_size(group)
    expected = {"forward all_reduce": 3} if size > 1 else {}
    assert dict(forward_counts) == expected, dict(forward_counts)  # max, sum of exp, target logit
    assert dict(backward_counts) == {}, dict(backward_counts)  # no collective in the backward
    return {"loss": loss_error, "grad": grad_error}


def _correctness_checks() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    singles = [dist.new_group([r]) for r in range(world)]
    groups = {4: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2), 1: (singles[rank], 0)}
    report: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tp, (group, tp_rank) in groups.items():
            for vocab in (50, 51, 64):  # 50: padded to 52 at tp 4; 51: to 52 at tp 2 and 4; 64: no padding
                report[(dtype, tp, vocab)] = _check_slice(group, tp, tp_rank, dtype, vocab, (3, 7))
            # logits [N, V]; a custom ignore_index inside the vocabulary; V = 5 padded to 8 (multiple 2) at tp 4,
            # so rank 3 holds padding only
            report[(dtype, tp, "2d")] = _check_slice(group, tp, tp_rank, dtype, 37, (23,), ignore_index=3)
            report[(dtype, tp, "tiny")] = _check_slice(group, tp, tp_rank, dtype, 5, (4, 3), multiple=2)
        # tp = 1 without any group: the whole padded vocabulary on one rank, no collective
        report[(dtype, "none")] = _check_slice(None, 1, 0, dtype, 50, (3, 7), multiple=4)
    dist.destroy_process_group()
    return report


@pytest.mark.distributed
def test_vocab_parallel_loss_matches_full_cross_entropy():
    """tp 4, 2 and 1 in one launch of 4 processes (each check asserted in the ranks); here the largest errors."""
    import torch

    start = time.perf_counter()
    reports = run_distributed(_correctness_checks, nprocs=4, timeout=300)
    for dtype in (torch.float32, torch.bfloat16):
        errors = [errors for report in reports for key, errors in report.items() if key[0] == dtype]
        worst = {kind: max(e[kind] for e in errors) for kind in ("loss", "grad")}
        print(
            f"{dtype}: {len(errors)} checks, largest error of the loss {worst['loss']:.2e}, "
            f"of the gradient {worst['grad']:.2e}"
        )
    print(f"correctness launch: {time.perf_counter() - start:.1f} s")


def test_unsplit_loss_and_refusals():
    """One process: the unsplit helper, ``tp_group=None`` on an unpadded vocabulary, bad labels, a second backward."""
    import torch
    import torch.nn.functional as F

    from hftrain.parallel.cross_entropy import cross_entropy_per_token, vocab_parallel_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    loss = cross_entropy_per_token(logits, labels)
    expected = F.cross_entropy(logits.float().view(-1, 11), labels.view(-1), reduction="none").view(2, 5)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected)
    split = vocab_parallel_cross_entropy(logits, labels, tp_group=None, vocab_start=0, vocab_size=11)
    assert (split - loss).abs().max() <= LOSS_TOL

    # views: a causal LM's shifted logits and a sequence-first transpose (gradients against the unsplit helper's)
    base = torch.randn(2, 6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 6))
    for view in (lambda t: t[:, :-1], lambda t: t.transpose(0, 1)):
        ours = vocab_parallel_cross_entropy(view(base), view(targets), tp_group=None, vocab_start=0, vocab_size=11)
        (grad,) = torch.autograd.grad(ours.sum(), base)
        theirs = cross_entropy_per_token(view(base), view(targets))
        (expected_grad,) = torch.autograd.grad(theirs.sum(), base)
        assert (ours - theirs).abs().max() <= LOSS_TOL and (grad - expected_grad).abs().max() <= GRAD_TOL

    bad = labels.clone()
    bad[1, 1] = 11  # a padding column's id, or beyond
    with pytest.raises(IndexError):
        vocab_parallel_cross_entropy(logits, bad, tp_group=None, vocab_start=0, vocab_size=11)
    with pytest.raises(ValueError):
        vocab_parallel_cross_entropy(logits, labels[0], tp_group=None, vocab_start=0, vocab_size=11)

    leaf = torch.randn(4, 11, requires_grad=True)
    twice = vocab_parallel_cross_entropy(leaf, torch.arange(4), tp_group=None, vocab_start=0, vocab_size=11).sum()
    twice.backward(retain_graph=True)
    # the saved softmax became the first backward's gradient: a second backward is refused
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        twice.backward()


def _gather_vocab(x, group):
    """The gathered approach's head: all-gather the vocabulary slices forward, keep this rank's slice backward."""
    import torch
    import torch.distributed as dist

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local):
            ctx.rank, ctx.width = dist.get_rank(group), local.shape[-1]
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            return torch.cat(parts, -1)

        @staticmethod
        def backward(ctx, grad):  # every rank computed the same full loss: its slice's gradient is its own
            return grad.narrow(-1, ctx.rank * ctx.width, ctx.width)

    return Gather.apply(x)


def _memory_case(approaches: tuple[str, ...], vocab: int, seq: int, hidden: int) -> dict:
    """Peak resident memory added by lm_head (local matmul) + loss + backward on this rank, per approach in the
    order given (each after a reset of the peak, its predecessor's tensors released), and the results."""
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hftrain.parallel.collectives import copy_to_tp
    from hftrain.parallel.cross_entropy import cross_entropy_per_token, vocab_parallel_cross_entropy
    from hftrain.parallel.plans import padded_vocab_size

    dist.init_process_group("gloo")
    group, rank, tp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    width = padded_vocab_size(vocab, tp) // tp
    torch.manual_seed(0)
    head = torch.randn(tp * width, hidden) * 0.02
    head[vocab:] = 0  # the padding rows, as VocabParallelEmbedding / Split pad them
    weight = head[rank * width : (rank + 1) * width].clone().requires_grad_(True)
    del head
    states = torch.randn(1, seq, hidden)
    labels = torch.randint(0, vocab, (1, seq))
    labels[0, ::10] = -100

    def step(approach: str, x: torch.Tensor, y: torch.Tensor) -> float:
        logits = F.linear(copy_to_tp(x, group), weight)  # the column-parallel lm_head: [1, seq, V/p]
        if approach == "vocab_parallel":
            loss = vocab_parallel_cross_entropy(logits, y, tp_group=group, vocab_start=rank * width, vocab_size=vocab)
        else:
            loss = cross_entropy_per_token(_gather_vocab(logits, group)[..., :vocab], y)
        del logits
        total = loss.sum()
        total.backward()
        return total.item()

    results = {}
    for approach in approaches:
        step(approach, states[:, :8].clone().requires_grad_(True), labels[:, :8])  # first-call allocations
        x = states.clone().requires_grad_(True)
        weight.grad = None
        gc.collect()
        dist.barrier()
        before = process_memory("VmRSS")
        reset_peak()
        start = time.perf_counter()
        loss = step(approach, x, labels)
        seconds = time.perf_counter() - start
        peak = process_memory("VmHWM") - before
        dist.barrier()
        results[approach] = {
            "peak": peak,
            "seconds": seconds,
            "loss": loss,
            "weight_grad": weight.grad.clone(),
            "states_grad": x.grad.clone(),
        }
        del x
        weight.grad = None
    dist.destroy_process_group()
    return results


def _compare_memory(vocab: int, seq: int, hidden: int, *, fresh: bool) -> float:
    """The worst rank's vocabulary-parallel peak over the best rank's gathered peak (printed). ``fresh``: each
    approach in its own launch of fresh processes; otherwise both in one launch, the vocabulary-parallel one first
    (so that any memory a first computation leaves behind counts against it, not for it)."""
    import torch

    start = time.perf_counter()
    kwargs = {"vocab": vocab, "seq": seq, "hidden": hidden}
    if fresh:
        split = run_distributed(_memory_case, nprocs=4, timeout=300, approaches=("vocab_parallel",), **kwargs)
        gathered = run_distributed(_memory_case, nprocs=4, timeout=300, approaches=("gathered",), **kwargs)
        reports = [{**s, **g} for s, g in zip(split, gathered, strict=True)]
    else:
        both = ("vocab_parallel", "gathered")
        reports = run_distributed(_memory_case, nprocs=4, timeout=300, approaches=both, **kwargs)
    for report in reports:  # the same loss and gradients either way
        mine, theirs = report["vocab_parallel"], report["gathered"]
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * abs(theirs["loss"])
        torch.testing.assert_close(mine["weight_grad"], theirs["weight_grad"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(mine["states_grad"], theirs["states_grad"], rtol=1e-4, atol=1e-6)
    mib = [(r["vocab_parallel"]["peak"] / 2**20, r["gathered"]["peak"] / 2**20) for r in reports]
    ratio = max(mine for mine, _ in mib) / min(theirs for _, theirs in mib)
    seconds = [(r["vocab_parallel"]["seconds"], r["gathered"]["seconds"]) for r in reports]
    print(
        f"\nvocab {vocab}, seq {seq}, hidden {hidden}, tp 4, fp32 (full logits {seq * vocab * 4 / 2**20:.0f} MiB), "
        f"{'fresh processes per approach' if fresh else 'one launch'}: peak added per rank, "
        f"vocab-parallel {[round(m) for m, _ in mib]} MiB in {max(s for s, _ in seconds):.2f} s, "
        f"gathered {[round(g) for _, g in mib]} MiB in {max(g for _, g in seconds):.2f} s; "
        f"ratio (worst vocab-parallel rank / best gathered rank) {ratio:.3f}; test {time.perf_counter() - start:.1f} s"
    )
    assert ratio <= 0.3, mib
    return ratio


@pytest.mark.distributed
def test_vocab_parallel_loss_memory_small():
    """The fast version: GPT-2's vocabulary, 256 tokens, hidden 128, tp 4, both approaches in one launch (each after a
    reset of the peak, the vocabulary-parallel one first): its peak at most 0.3 of the gathered one."""
    _compare_memory(vocab=50_257, seq=256, hidden=128, fresh=False)


@pytest.mark.slow
@pytest.mark.distributed
def test_vocab_parallel_loss_memory_gpt2_vocab():
    """GPT-2's vocabulary, 1,024 tokens, hidden 768 (GPT-2's), tp 4, fp32, each approach in its own fresh processes
    (two launches, ~20-30 s): the vocabulary-parallel peak at most 0.3 of the gathered one."""
    _compare_memory(vocab=50_257, seq=1024, hidden=768, fresh=True)
