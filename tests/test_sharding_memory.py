"""Sharding strategies shard the resident peak (issue 42), measured as a user feels it: whole ``hftrain train`` jobs
(load, 3 fp32 steps, final evaluation, checkpoint and export) of a 322M-parameter Llama classifier, each rank's
``VmHWM`` read from ``/proc`` by ``benchmarks/memory_timeline.py``, against the same job on 1 process.

Slow (about 6 minutes on 2 cores, ~11 GB of RAM at most): ``pytest -m slow tests/test_sharding_memory.py``.
Measured 2026-11-26 by this test (benchmarks/README.md, "Sharding that shards"): fsdp2×2 0.53 / 0.49, zero2×2
0.71 / 0.71, zero3×2 0.74 / 0.62, zero3 with offload 0.83 / 0.69 of the 1-process peak (before: 1.01, 1.12-1.24,
1.55, 1.86).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("ddp1", "fsdp2x2", "zero2x2", "zero3x2", "zero3_offloadx2")


@pytest.fixture(scope="module")
def ratios(tmp_path_factory) -> dict[str, float]:
    """Each layout's largest whole-run peak over its ranks, over the 1-process peak."""
    out = tmp_path_factory.mktemp("timeline") / "jobs.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/memory_timeline.py", "--model", "big", "--layouts", ",".join(LAYOUTS),
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    jobs = {job["layout"]: job for job in json.loads(out.read_text())}
    assert all(jobs[name]["rc"] == 0 for name in LAYOUTS), {name: jobs[name]["rc"] for name in LAYOUTS}
    peak = {name: max(rank["whole"] for rank in jobs[name]["summary"].values()) for name in LAYOUTS}
    return {name: peak[name] / peak["ddp1"] for name in LAYOUTS}


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_ranks_peak_below_one_process(ratios):
    """What holds today: FSDP2 and ZeRO-2 meet the issue's 0.6 and 0.75; ZeRO-3 (with or without offload) stays well
    below where it was (1.55-1.86). DeepSpeed's 5e8/1e9 buffer and residency defaults, the speed-tuned heap keeping
    the model each rank built, DCP's clone of every view in the last checkpoint, and ZeRO-1/2's gathered copy of
    each rank's share at a checkpoint would each bring an excess back."""
    assert ratios["fsdp2x2"] <= 0.6, ratios
    assert ratios["zero2x2"] <= 0.75, ratios
    assert ratios["zero3x2"] <= 0.8, ratios
    assert ratios["zero3_offloadx2"] <= 0.9, ratios


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xfail(
    strict=True,
    reason="open (issue 42): ZeRO-3's steps hold ~0.7 GB per rank beyond 16Ψ/N, activations, gathered layers and the "
    "process's libraries (not attributed yet), the export's reload check holds a whole model on rank 0, and on a "
    "CPU-only machine offload moves nothing off the device (the host is the device)",
)
def test_the_issue_targets_for_zero3(ratios):
    assert ratios["zero3x2"] <= 0.6, ratios
    assert ratios["zero3_offloadx2"] < ratios["zero3x2"], ratios
