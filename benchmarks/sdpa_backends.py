"""Time each of SDPA's CUDA kernels (flash, memory-efficient, cuDNN, math) at the bucketed shapes, with and without
dropout: the figures behind ``training.sdpa_backend: auto`` (``hftrain.strategies.platform.SDPA_ORDER``).

For each shape, mask and dropout, each backend alone (``torch.nn.attention.sdpa_kernel(backend)``) runs
``scaled_dot_product_attention`` forward and backward in bf16: the first call is timed on its own (cuDNN builds its
plan per shape there, forward and backward apart: host time, no sync), then the median of ``--iters`` calls after
``--warmup`` (CUDA events). A backend that cannot run a case (flash takes no attention mask) says so.

Shapes (``--shapes``): the default job's buckets (MiniLM: 12 heads of 32; batch 32 and evaluation's 64, lengths 64
and 128, the ``[b, 1, s, s]`` padding mask transformers builds) and a language-model block (32 heads of 64, batch 4,
2048 tokens, causal). Prints one Markdown table for ``benchmarks/README.md``, with the GPU's name.

Usage: ``python benchmarks/sdpa_backends.py [--iters 20] [--warmup 3]``. Needs a CUDA GPU: on a machine without one
it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

BACKENDS = ("flash", "efficient", "cudnn", "math")
# (label, batch, heads, head_dim, length, masked, causal)
SHAPES = (
    ("minilm train 32x64", 32, 12, 32, 64, True, False),
    ("minilm train 32x128", 32, 12, 32, 128, True, False),
    ("minilm eval 64x128", 64, 12, 32, 128, True, False),
    ("lm block 4x2048 causal", 4, 32, 64, 2048, False, True),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "sdpa_backends.py times CUDA kernels and this machine has no CUDA GPU (torch.cuda.is_available() is "
            "False); run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    torch.ones(1024, 1024, device="cuda").matmul(torch.ones(1024, 1024, device="cuda"))  # context, cuBLAS: not timed
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, forward + backward")
    print("| shape | dropout | " + " | ".join(f"{b} first / median ms" for b in BACKENDS) + " |")
    print("|---|---|" + "---|" * len(BACKENDS))
    for label, batch, heads, dim, length, masked, causal in SHAPES:
        for dropout in (0.0, 0.1):
            cells = []
            for backend in BACKENDS:
                try:
                    with sdpa_kernel(names[backend]):
                        first, median = _time(batch, heads, dim, length, masked, causal, dropout, args)
                    cells.append(f"{first:.1f} / {median:.3f}")
                except RuntimeError as error:  # "No available kernel": this backend cannot run the case
                    cells.append("n/a: " + str(error).splitlines()[0][:40])
            print(f"| {label} | {dropout} | " + " | ".join(cells) + " |")
    return 0


def _time(
    batch: int, heads: int, dim: int, length: int, masked: bool, causal: bool, dropout: float, args: argparse.Namespace
) -> tuple[float, float]:
    """(first call's ms, host clock; median ms over ``args.iters``, CUDA events) of SDPA forward + backward."""
    shape = (batch, heads, length, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = None
    if masked:  # transformers' padding mask: the last quarter of every other row is padding
        keep = torch.ones(batch, length, dtype=torch.bool, device="cuda")
        keep[::2, -length // 4 :] = False
        mask = keep[:, None, None, :].expand(batch, 1, length, length)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
        )
        out.backward(grad)

    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = 1000 * (time.perf_counter() - start)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return first, statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
