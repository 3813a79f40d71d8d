"""hftrain's pipeline schedules on ``--pp`` gloo processes: bubble vs the formula, and activation memory.

Two measurements, printed as markdown tables by rank 0, on stages of *even* compute (each chunk is the same
stack of ``d × d`` linear+GELU layers; the first chunk also embeds, the last pools and classifies, both
negligible next to the stack), through the same :func:`hftrain.parallel.build_schedule` the trainer uses:

1. **Bubble fraction**: for each schedule (gpipe, 1f1b; interleaved_1f1b, interleaved_zb and zbv with 2
   virtual stages; zero bubble is compared with the interleaved formula it aims to beat) and
   ``m`` in ``--microbatches``, the median over ``--steps`` steps of the measured idle fraction
   (:func:`hftrain.parallel.measured_bubble` over the recorded F/B events of all ranks) against
   ``(p-1)/(m+p-1)`` (interleaved: ``(p-1)/(v·m+p-1)``). Target: within 10 % of the formula.
2. **Peak activation memory per rank**, gpipe vs 1f1b: the largest number of bytes that autograd holds saved
   for backward at any moment of a step (counted with ``torch.autograd.graph.saved_tensors_hooks``;
   parameters excluded). Target: 1f1b ≤ ``p/m`` × gpipe on the first rank for ``m ≥ p``.

It also writes the timeline PNG of each schedule at the middle ``m`` to ``--out``.

Run from the repository root (2 cores: one thread per process)::

    python benchmarks/pipeline.py                      # pp=2, m in 2,4,8 (~1-2 min idle)
    python benchmarks/pipeline.py --hidden 256 --steps 3   # quicker, noisier
    python benchmarks/pipeline.py --sleep_ms 30            # boxes of exactly known length (the schedule alone)

With ``--sleep_ms`` every layer sleeps instead of computing: forward F, input gradient B and weight gradient W
each take that long. The stages are even by construction, and the ranks do not compete for the cores, caches and
memory bandwidth. On a 2-core machine that contention slows the overlapped boxes of real compute, which breaks the
equal-box premise of the formula. What is left to differ from the formula is the schedule itself and its
hand-overs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.*` and an uninstalled hftrain

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2))


def _sleep_layer_class():
    import time

    import torch

    class Sleep(torch.autograd.Function):
        """Identity that sleeps ``forward_s`` forward and ``backward_s`` backward (boxes of exactly known length)."""

        @staticmethod
        def forward(ctx, x, forward_s: float, backward_s: float):
            time.sleep(forward_s)
            ctx.backward_s = backward_s
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.backward_s)
            return grad, None, None

    class SleepLayer(torch.nn.Module):
        """F = B = W = ``seconds``, the zero-bubble papers' premise, with no contention between the ranks.

        The input-gradient path sleeps once (B) through ``Sleep`` on the activation; the weight-gradient path
        sleeps once (W) through ``Sleep`` on the layer's extra weight, which no input gradient needs. A schedule
        with whole backward boxes (GPipe, 1F1B, interleaved 1F1B) runs both in one box: B + W = 2F, as in real
        compute. The final GELU keeps the chunk's output from being a view, which torch's stage backward detaches
        in place.
        """

        def __init__(self, hidden: int, seconds: float) -> None:
            super().__init__()
            self.linear, self.seconds = torch.nn.Linear(hidden, hidden), seconds
            self.weight_clock = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            slept = Sleep.apply(x, self.seconds, self.seconds)
            clock = Sleep.apply(self.weight_clock, 0.0, self.seconds)  # 0 in value; only its backward takes time
            return torch.nn.functional.gelu(self.linear(slept) + clock)

    return SleepLayer


def _chunk_class():
    import torch

    class EvenChunk(torch.nn.Module):
        """``layers`` × (linear d→d + GELU); embeds ids first / mean-pools and classifies last.

        It maps the same activation tuple as the HF chunks (hidden, attention mask, pool weights).
        """

        def __init__(self, hidden: int, layers: int, *, first: bool, last: bool, sleep_ms: float = 0.0) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, hidden) if first else None
            if sleep_ms:
                sleep_layer = _sleep_layer_class()
                self.stack = torch.nn.Sequential(*[sleep_layer(hidden, sleep_ms / 1000) for _ in range(layers)])
            else:
                self.stack = torch.nn.Sequential(
                    *[m for _ in range(layers) for m in (torch.nn.Linear(hidden, hidden), torch.nn.GELU())]
                )
            self.head = torch.nn.Linear(hidden, 2) if last else None

        def forward(self, *acts):
            if self.embed is not None:
                ids, mask = acts
                hidden, pool = self.embed(ids), mask.float() / mask.sum(1, keepdim=True)
            else:
                hidden, mask, pool = acts
            hidden = self.stack(hidden)
            if self.head is not None:
                return self.head((hidden * pool.unsqueeze(-1)).sum(1))
            return hidden, mask, pool

    return EvenChunk


class SavedBytes:
    """Bytes autograd holds saved for backward right now, and the peak (parameters are not counted)."""

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.live = 0
        self.peak = 0

    def pack(self, tensor):
        size = 0 if tensor.untyped_storage().data_ptr() in self.params else tensor.numel() * tensor.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        return _Held(tensor, size, self)

    @staticmethod
    def unpack(held):
        return held.tensor


class _Held:
    """A saved tensor; when autograd frees it (after its backward) the live count drops."""

    def __init__(self, tensor, size: int, owner: SavedBytes) -> None:
        self.tensor, self.size, self.owner = tensor, size, owner

    def __del__(self) -> None:
        self.owner.live -= self.size


def _schedule(name: str, v: int, m: int, args, rank: int, recorder):
    import torch
    import torch.distributed as dist

    from hftrain.parallel import SCHEDULES as REGISTRY
    from hftrain.parallel import build_schedule
    from hftrain.parallel.pipeline import chunk_ids_of_rank

    chunk_class = _chunk_class()
    total = args.pp * v
    torch.manual_seed(0)
    ids = chunk_ids_of_rank(rank, pp=args.pp, virtual_stages=v, style=REGISTRY[name].style)
    chunks = []
    for c in ids:
        chunks.append(
            chunk_class(args.hidden, args.layers // v, first=c == 0, last=c == total - 1, sleep_ms=args.sleep_ms)
        )
        chunks[-1].index = c
    pipe = build_schedule(
        name,
        chunks,
        pp_group=dist.group.WORLD,
        pp_rank=rank,
        pp=args.pp,
        num_microbatches=m,
        loss_fn=torch.nn.functional.cross_entropy,
        device="cpu",
        recorder=recorder,
    )
    return pipe, chunks


def _batch(m: int, args):
    import torch

    ids = torch.randint(0, 64, (m * args.micro, args.seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 2, (m * args.micro,))


def _run(name: str, v: int, m: int, args, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from hftrain.parallel import TimelineRecorder, gather_events, measured_bubble

    recorder = TimelineRecorder(rank, max_steps=args.steps + 1)
    pipe, chunks = _schedule(name, v, m, args, rank, recorder)
    inputs, labels = _batch(m, args)
    pipe.train_step(inputs, labels)  # warm-up: shape inference, allocator
    bubbles = []
    for _ in range(args.steps):
        dist.barrier()
        pipe.train_step(inputs, labels)
    events = gather_events(recorder)
    steps = sorted({e.step for e in events})[1:]  # without the warm-up
    bubbles = [measured_bubble(events, step=s) for s in steps]
    saved = SavedBytes(p for c in chunks for p in c.parameters())
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        pipe.train_step(inputs, labels)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, saved.peak)
    return {"bubble": statistics.median(bubbles), "bubbles": bubbles, "peaks": peaks, "events": events}


def _chosen(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The ``SCHEDULES`` entries named by ``--schedules`` (all by default)."""
    return [(name, v) for name, v in SCHEDULES if name in args.schedules]


def _worker(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    from hftrain.parallel import render_timeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for name, v in _chosen(args):
            for m in args.microbatches:
                results[(name, m)] = _run(name, v, m, args, rank)
        if rank == 0:
            middle = args.microbatches[len(args.microbatches) // 2]
            for name, v in _chosen(args):
                render_timeline(
                    results[(name, middle)]["events"],
                    Path(args.out) / f"pipeline-{name}-m{middle}.png",
                    schedule=name,
                    pp=args.pp,
                    num_microbatches=middle,
                    virtual_stages=v,
                )
    finally:
        dist.destroy_process_group()
    for result in results.values():
        result.pop("events")
    return results if rank == 0 else None


def report(results: dict, args: argparse.Namespace) -> str:
    from hftrain.parallel import theoretical_bubble

    p = args.pp
    load = os.getloadavg()[0]
    lines = [
        f"load average {load:.1f} on {os.cpu_count()} cores at the end; pp={p}, hidden={args.hidden}, "
        + (f"layers sleep {args.sleep_ms} ms each in F, B and W, " if args.sleep_ms else "")
        + f"{args.layers} layers per rank, micro-batch {args.micro}×{args.seq} tokens, median of {args.steps} steps",
        "",
        "| schedule | m | measured bubble | formula | measured / formula |",
        "|---|---|---|---|---|",
    ]
    for name, v in _chosen(args):
        for m in args.microbatches:
            measured, ideal = results[(name, m)]["bubble"], theoretical_bubble(p, m, v)
            lines.append(f"| {name} (v={v}) | {m} | {measured:.3f} | {ideal:.3f} | {measured / ideal:.2f} |")
    if not {"gpipe", "1f1b"} <= {name for name, _ in _chosen(args)}:
        return "\n".join(lines)
    lines += ["", "| m | gpipe peak saved MiB (per rank) | 1f1b peak saved MiB | 1f1b / gpipe (rank 0) | p/m |"]
    lines.append("|---|---|---|---|---|")
    for m in args.microbatches:
        gpipe, one = results[("gpipe", m)]["peaks"], results[("1f1b", m)]["peaks"]
        mib = lambda xs: ", ".join(f"{x / 2**20:.1f}" for x in xs)  # noqa: E731
        lines.append(f"| {m} | {mib(gpipe)} | {mib(one)} | {one[0] / gpipe[0]:.3f} | {p / m:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4, help="linear layers per rank (split over virtual stages)")
    parser.add_argument("--micro", type=int, default=4, help="examples per micro-batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--schedules",
        type=lambda text: text.split(","),
        default=[name for name, _ in SCHEDULES],
        help="comma-separated subset of: " + ", ".join(name for name, _ in SCHEDULES),
    )
    parser.add_argument(
        "--sleep_ms",
        type=float,
        default=0.0,
        help="each layer sleeps this long forward, input-gradient and weight-gradient instead of computing: "
        "exactly even stages, "
        "no CPU contention between ranks; 0 computes (linear + GELU)",
    )
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "hftrain-pipeline-benchmark"))
    args = parser.parse_args()

    from tests.distributed import run_distributed

    results = run_distributed(_worker, nprocs=args.pp, timeout=1800, args=args)
    print(report(results[0], args))


if __name__ == "__main__":
    main()
