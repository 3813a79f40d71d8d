"""Sharding strategies shard the resident peak (issue 42), measured as a user feels it: whole ``hftrain train`` jobs
(load, 3 fp32 steps, final evaluation, checkpoint and export) of a 322M-parameter Llama classifier, each rank's
``VmHWM`` read from ``/proc`` by ``benchmarks/memory_timeline.py``, against the same job on 1 process.

Slow (about 6 minutes on 2 cores, ~11 GB of RAM at most): ``pytest -m slow tests/test_sharding_memory.py``.
Measured 2026-11-27 by ``benchmarks/memory_timeline.py`` (benchmarks/README.md, "Sharding that shards"): fsdp2×2
0.52 / 0.48, zero2×2 0.70 / 0.70, zero3×2 0.54 / 0.50, zero3 with offload 0.63 / 0.59 of the 1-process peak
(before: 1.01, 1.12-1.24, 1.55, 1.86).
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
    """The issue's targets: FSDP2 and ZeRO-3 at most 0.6 of the 1-process peak, ZeRO-2 at most 0.75; ZeRO-3 with
    offload well below where it was (1.86). DeepSpeed's 5e8/1e9 buffer and residency defaults, its 1e9 sub group
    (a flat copy of every gradient at each step), its cloned fp32 master at stage 3, the flat gradient buffer kept
    through the export's reload, the speed-tuned heap keeping the model each rank built, DCP's clone of every view
    in the last checkpoint, and ZeRO-1/2's gathered copy of each rank's share at a checkpoint would each bring an
    excess back."""
    assert ratios["fsdp2x2"] <= 0.6, ratios
    assert ratios["zero2x2"] <= 0.75, ratios
    assert ratios["zero3x2"] <= 0.6, ratios
    assert ratios["zero3_offloadx2"] <= 0.75, ratios


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xfail(
    strict=True,
    reason="open (issue 42): on a CPU-only machine offload moves nothing off the device (the host is the device) and "
    "adds DeepSpeed's CPU-Adam buffers; it lowers a GPU's peak, which this machine cannot show",
)
def test_offload_lowers_the_zero3_peak(ratios):
    assert ratios["zero3_offloadx2"] < ratios["zero3x2"], ratios
