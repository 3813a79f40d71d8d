"""Context parallelism: per-rank memory, attention time balance and bytes exchanged, measured against cp = 1.

A 2-layer classifier with SmolLM2-135M's layer shape (Llama: hidden 576, 9 query / 3 key-value heads, head dim 64,
intermediate 1536; a 1,024-token vocabulary keeps the weights small beside the activations) runs one fp32
forward and backward on one sequence of S tokens, split over cp = 1, 2, 4 gloo processes with
``hftrain.parallel.apply_context_parallel`` (ring attention; all-to-all where the heads divide, at cp = 3 the
heads do, at 2 and 4 the 3 key/value heads do not). Each rank reports:

- ``peak``: VmHWM increase (``/proc/self/status``, reset through ``/proc/self/clear_refs``) over its resident
  memory with the model built, during the step: activations, the attention's per-block scores, gradients;
- ``scores``: the query-key scores its attention computed (forward and backward): their spread across ranks is
  the causal load balance of the zigzag split (pairs of chunks wholly in the future are skipped);
- ``attention s``: the time spent in its attention calls (forward and backward, waiting on the ring included);
- ``sent MiB``: the bytes its attention sent to other ranks, against the plan's formula
  (``hftrain.plan.context_parallel._context_bytes``).

Then the longest S (of 1k-32k) whose step fits a per-process budget (``--budget-gib``, default 1.5) at each cp,
from the measured peaks. Times are on 2 shared cores: cp = 4 runs 4 processes on 2 cores, so its step time is
not what 4 devices would give; the memory and the balance are.

``--ring-masks`` measures instead the ring's masks alone (issue 55): causal ring attention (9 query / 3 key-value
heads of 64, batch 1, fp32) over cp = 2 processes on an unpadded sequence, run with the padding flag set (every
block gets its dense additive bias, as before) and without it (a chunk against itself runs the kernel's
``is_causal``, chunks below the diagonal run unmasked), alternately, 3 times each after a warm-up round: the
biases built, the peak increase (the largest of the 3) and the median forward + backward time per rank.

Usage (about 4 minutes, 8 GB at most):
    python benchmarks/context_parallel.py [--seqs 2048,4096,8192] [--budget-gib 1.5]
    python benchmarks/context_parallel.py --comm all_to_all --cps 1,3 --seqs 3072   # 3 key/value heads: cp=3
    python benchmarks/context_parallel.py --ring-masks --seqs 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` and an uninstalled hftrain

from tests.distributed import run_distributed  # noqa: E402
from tests.memory import process_memory as _status  # noqa: E402
from tests.memory import reset_peak  # noqa: E402


def _step(seq: int, comm: str) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    import hftrain.parallel.context_parallel as cp_module
    import hftrain.parallel.cp_attention as cp_algorithms  # the ring and all-to-all look their helpers up here

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    config = LlamaConfig(
        vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=seq, num_labels=2, pad_token_id=0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    from hftrain.parallel.families import stages_for

    trunk = stages_for(config, axis="cp")
    cp_module.apply_context_parallel(model, trunk=trunk, per_token=False, cp_group=dist.group.WORLD, comm=comm)
    spent, sent = [0.0], [0]
    ring, a2a = cp_module._RingAttention, cp_module._AllToAll
    forward, backward = ring.forward, ring.backward
    a2a_forward, a2a_backward, attention = a2a.forward, a2a.backward, cp_module.ATTENTIONS["all_to_all"]

    def timed(fn):
        def run(*args):
            start = time.perf_counter()
            out = fn(*args)
            spent[0] += time.perf_counter() - start
            return out

        return staticmethod(run)

    exchange, pairs = cp_module._Block.exchange, cp_algorithms._visible_pairs
    work = [0]

    def counted_pairs(q_runs, k_runs, causal, window=None, plain=False):
        for qs, ks, pattern in pairs(q_runs, k_runs, causal, window, plain):
            work[0] += (qs.stop - qs.start) * (ks.stop - ks.start)  # query-key scores computed
            yield qs, ks, pattern

    cp_algorithms._visible_pairs = counted_pairs

    def counted(self, group):
        sent[0] += sum(t.numel() * t.element_size() for t in self.tensors)
        return exchange(self, group)

    ring.forward, ring.backward, cp_module._Block.exchange = timed(forward), timed(backward), counted
    exchange_all = cp_algorithms._exchange

    def counted_all(x, group, inverse):  # an all-to-all sends (cp - 1)/cp of its tensor
        size = dist.get_world_size(group)
        sent[0] += x.numel() * x.element_size() * (size - 1) // size
        return exchange_all(x, group, inverse)

    def timed_attention(*args):
        start = time.perf_counter()
        out = attention(*args)
        spent[0] += time.perf_counter() - start
        return out

    cp_algorithms._exchange = counted_all
    cp_module.ATTENTIONS["all_to_all"] = timed_attention
    a2a.backward = timed(a2a_backward)
    del a2a_forward  # the forward all-to-alls are inside the timed attention
    ids = torch.randint(1, 1024, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([1])}
    gc.collect()
    before = _status("VmRSS")
    reset_peak()
    start = time.perf_counter()
    model(**batch).loss.backward()
    step = time.perf_counter() - start
    return {
        "rank": rank,
        "peak": _status("VmHWM") - before,
        "attention": spent[0],
        "sent": sent[0],
        "step": step,
        "scores": work[0],
    }


def _ring_masks(seq: int) -> dict:
    """One rank of ``--ring-masks`` (module docstring)."""
    import gc
    import statistics

    import torch
    import torch.distributed as dist

    import hftrain.parallel.context_parallel as cp_module
    import hftrain.parallel.cp_attention as cp_algorithms  # the ring and all-to-all look their helpers up here

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    pos = cp_module.zigzag_positions(seq, cp, rank)
    q, k, v = (torch.randn(1, h, seq, 64, generator=g)[:, :, pos].contiguous() for h in (9, 3, 3))
    keep = torch.ones(1, seq // cp, dtype=torch.bool)
    runs = cp_module.zigzag_runs(seq, cp)
    built, bias = [0], cp_algorithms._bias

    def counted(*args, **kwargs):
        built[0] += 1
        return bias(*args, **kwargs)

    cp_algorithms._bias = counted
    result: dict = {}
    for round_ in range(4):  # the first is a warm-up of both (the allocator's first pages), not recorded
        for padded in (True, False):
            shard = cp_module.Shard(keep, pos, True, 0.125, dist.group.WORLD, runs, padded=padded)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            gc.collect()
            before, built[0] = _status("VmRSS"), 0
            reset_peak()
            start = time.perf_counter()
            cp_module.ring_attention(*leaves, shard).sum().backward()
            seconds = time.perf_counter() - start
            if round_ == 0:
                dist.barrier()
                continue
            entry = result.setdefault(padded, {"s": [], "peak": 0, "biases": 0})
            entry["s"].append(seconds)
            entry["peak"] = max(entry["peak"], _status("VmHWM") - before)
            entry["biases"] = built[0]
            dist.barrier()
    dist.destroy_process_group()
    return {padded: {**e, "s": statistics.median(e["s"])} for padded, e in result.items()} | {"rank": rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,4096,8192", help="comma-separated sequence lengths")
    parser.add_argument("--cps", default="1,2,4", help="comma-separated cp sizes")
    parser.add_argument("--comm", default="ring", choices=("ring", "all_to_all"), help="parallelism.cp_comm")
    parser.add_argument("--budget-gib", type=float, default=1.5, help="per-process memory budget for the longest S")
    parser.add_argument("--ring-masks", action="store_true", help="the ring's masks alone, dense bias against none")
    args = parser.parse_args()
    if args.ring_masks:
        mib = 1 << 20
        print("| S | rank | masks | biases built | peak increase MiB | forward+backward s |")
        print("|---|---|---|---|---|---|")
        for seq in map(int, args.seqs.split(",")):
            for r in run_distributed(_ring_masks, nprocs=2, timeout=1800, seq=seq):
                for padded, label in ((True, "dense bias (before)"), (False, "is_causal / none")):
                    e = r[padded]
                    print(f"| {seq} | {r['rank']} | {label} | {e['biases']} | {e['peak'] / mib:.0f} | {e['s']:.2f} |")
        return
    from hftrain.plan import Workload, model_from_config
    from hftrain.plan.context_parallel import _context_bytes

    mib = 1 << 20
    spec = dataclasses.replace(model_from_config("embedded:smollm2"), layers=2)
    print("| S | cp | peak per rank (MiB, max) | peak × cp / peak at cp=1 | scores per rank, max/min |"
          " attention s per rank (min-max) | sent MiB per rank (measured / plan) | step s (max) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    peaks: dict[tuple[int, int], float] = {}
    for seq in map(int, args.seqs.split(",")):
        for cp in map(int, args.cps.split(",")):
            runs = run_distributed(_step, nprocs=cp, timeout=1800, seq=seq, comm=args.comm)
            peak = max(r["peak"] for r in runs)
            peaks[seq, cp] = peak
            times, scores = [r["attention"] for r in runs], [r["scores"] for r in runs]
            work = Workload(precision="fp32", micro_batch=1, seq=seq)
            planned = _context_bytes(spec, 1, cp, work, comm=args.comm) if cp > 1 else 0
            sent = max(r["sent"] for r in runs)
            ratio = peak * cp / peaks[seq, 1] if (seq, 1) in peaks else float("nan")
            balance = f"{max(scores) / min(scores):.2f}" if min(scores) else "- (whole-sequence attention)"
            print(
                f"| {seq} | {cp} | {peak / mib:.0f} | {ratio:.2f} | {balance} | "
                f"{min(times):.2f}-{max(times):.2f} | {sent / mib:.1f} / {planned / mib:.1f} | "
                f"{max(r['step'] for r in runs):.2f} |",
                flush=True,
            )
    budget = args.budget_gib * (1 << 30)
    for cp in map(int, args.cps.split(",")):
        fitting = [seq for (seq, c), peak in peaks.items() if c == cp and peak <= budget]
        print(f"cp={cp}: longest measured S within {args.budget_gib} GiB per process: {max(fitting, default=0)}")


if __name__ == "__main__":
    main()
