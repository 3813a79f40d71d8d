"""Packed documents on CPU: the dense block-diagonal mask against one SDPA call per document, and the varlen path's
CPU reference (``hftrain.models.packed_attention``), forward + backward of the attention alone, fp32. Ratios of
medians measured side by side in one run (``training.packed_attention: auto``'s CPU choice).

    .venv/bin/python benchmarks/packed_attention.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from hftrain.models.packed_attention import KERNELS, PackedDocuments
from hftrain.trainers.inputs import packed_causal_mask


def _positions(b: int, s: int, longest: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        row: list[int] = []
        while len(row) < s:
            row += range(int(torch.randint(2, longest + 1, (1,), generator=g)))
        rows.append(row[:s])
    return torch.tensor(rows)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(b: int, s: int, h: int, d: int, longest: int) -> str:
    """One shape's three timings (medians of 5 alternated rounds) as a line."""
    positions = _positions(b, s, longest)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    mask = packed_causal_mask(positions)
    documents = PackedDocuments.of(positions)
    bounds = documents.cu_seqlens.unique().tolist()  # the flattened documents' bounds on the host (the loop's)

    def flat() -> list[torch.Tensor]:
        return [x.transpose(1, 2).reshape(b * s, h, d) for x in (q, k, v)]

    def dense() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    def per_document() -> None:
        rows = flat()
        outs = [
            F.scaled_dot_product_attention(*(x[i:j].transpose(0, 1) for x in rows), is_causal=True)
            for i, j in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        torch.cat([o.transpose(0, 1) for o in outs]).sum().backward()

    def reference() -> None:
        KERNELS["cpu"](*flat(), documents, scale=None, window=None, grouped=False).sum().backward()

    repeats = 300 if s <= 32 else 5
    variants = {"dense": dense, "per_document": per_document, "reference": reference}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm
        _timed(fn, 3)
    for _ in range(5):  # alternated rounds
        for name, fn in variants.items():
            runs[name].append(_timed(fn, repeats))
    med = {name: statistics.median(t) * 1e3 for name, t in runs.items()}
    return (
        f"b={b} s={s} h={h} d={d} documents={len(bounds) - 1}: dense mask {med['dense']:.3f} ms, "
        f"per document {med['per_document']:.3f} ms ({med['per_document'] / med['dense']:.2f}x), "
        f"varlen CPU reference {med['reference']:.3f} ms ({med['reference'] / med['dense']:.2f}x)"
    )


def main() -> None:
    torch.manual_seed(0)
    # (b, s, heads, head dim, longest document): the trainer test's blocks, then a 1,024-token block
    for shape in ((2, 32, 4, 8, 14), (4, 1024, 8, 64, 256)):
        print(_case(*shape))


if __name__ == "__main__":
    main()
