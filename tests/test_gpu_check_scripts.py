"""``scripts/gpu_check.py`` (one GPU) and ``scripts/gpu_check_multi.py`` (two or more) without a GPU: they import,
the multi-GPU script names its checks (cp2, ep2, FSDP1 export among them) and skips them all with exit 0 where CUDA
is missing, its launch arguments carry the planner's layout, and its memory figures are parsed and set against the
plan. The launches themselves (``--cpu``: gloo processes) are the slow test at the end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_check_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def multi():
    return _script("gpu_check_multi")


def test_one_gpu_script_keeps_its_checks_and_times_past_warm_up():
    single = _script("gpu_check")
    assert 0 < single.MAIN_WARMUP < single.MAIN_STEPS and single.MAIN_WARMUP % 10 == 0  # losses read at its end
    assert single.BUDGET < 600 and sum(single.EXPECTED_SECONDS.values()) < single.BUDGET
    for name in ("ddp_fp32_resume", "megatron_tp1", "cp_kernels", "host_syncs_per_step", "main_job_bf16"):
        assert callable(getattr(single, name))
    assert not hasattr(single, "processes")  # the N-process checks moved to gpu_check_multi.py


def test_multi_gpu_script_names_every_layout(multi):
    names = set(multi.CHECK_NAMES)
    assert {"megatron cp2", "megatron ep2", "fsdp1 export"} <= names
    assert {"ddp", "zero2", "zero3", "fsdp2", "megatron tp2", "megatron pp2"} <= names
    fsdp1 = next(c for c in multi.CHECKS if c.name == "fsdp1 export")
    assert fsdp1.reload and fsdp1.strategy[-2:] == ["--strategy.fsdp_version", "1"]


def test_megatron_launches_use_the_plan_rows_layout(multi, tmp_path):
    setup = multi.Setup(tmp_path, nproc=2, cpu=True, hidden=32, budget=60)
    for item in (c for c in multi.CHECKS if c.axes is not None):
        row = multi._plan_row(setup, item)
        assert row is not None and row.fits, item.name
        args = multi._row_options(row)
        pairs = dict(zip(args[::2], args[1::2], strict=True))
        assert pairs["--strategy.name"] == "megatron"
        for axis, size in item.axes.items():
            assert int(pairs.get(f"--parallelism.{axis}", 1)) == size, (item.name, axis, args)
    ddp = next(c for c in multi.CHECKS if c.name == "ddp")
    assert multi._plan_row(setup, ddp).label == "ddp"


def test_memory_files_are_read_and_compared(multi, tmp_path):
    for rank, (peak, baseline) in enumerate(((300, 100), (500, 150))):
        first = {"baseline": baseline, "peak": peak, "process_peak": peak + 10}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(first) + "\n" + json.dumps({**first, "peak": 9e9}) + "\n")
    assert multi._memory(tmp_path, cpu=True) == (350, 360)  # the first launch's, less the imports, worst rank
    assert multi._memory(tmp_path, cpu=False) == (500, 510)
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0, 1\]: the default process group is not bound"):
        multi._check_bound(tmp_path)
    for rank in (0, 1):  # eager NCCL init: each rank's group bound to its GPU
        figures = {"baseline": 1, "peak": 2, "process_peak": 3, "bound_device": f"cuda:{rank}"}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(figures) + "\n")
    multi._check_bound(tmp_path)

    class Row:
        label, fits, total = "ddp", True, 400.0

    assert "measured/planned 1.10" in multi._compare(440, Row) and "FLAG" not in multi._compare(440, Row)
    assert "FLAG" in multi._compare(500, Row)
    Row.fits = False
    assert "does not fit" in multi._compare(500, Row)
    (tmp_path / "rank0.json").write_text(json.dumps({"baseline": 1, "process_peak": 2}) + "\n")
    with pytest.raises(RuntimeError, match="no peak memory"):
        multi._memory(tmp_path, cpu=True)


def test_without_cuda_every_multi_gpu_check_is_a_skip():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs to run the checks on")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "scripts/gpu_check_multi.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    skipped = [line for line in lines if line.startswith("SKIP ")]
    assert len(skipped) == len(_script("gpu_check_multi").CHECKS) and "--cpu" in skipped[0]
    assert lines[-1].startswith("PASS gpu_check_multi:")


@pytest.mark.slow
@pytest.mark.distributed
def test_cpu_launches_pass():
    """Two launches of the real thing on gloo: ep2 (Mixtral) and the FSDP1 export reloaded."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "scripts/gpu_check_multi.py",
        "--cpu",
        "--only",
        "megatron ep2",
        "--only",
        "fsdp1 export",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    passed = [line for line in done.stdout.splitlines() if line.startswith("PASS megatron ep2") or
              line.startswith("PASS fsdp1 export")]  # fmt: skip
    assert len(passed) == 2 and "measured/planned" in passed[0]
