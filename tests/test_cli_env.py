"""``hftrain env`` and the CPU Adam preflight check."""

from __future__ import annotations

import os
import subprocess
import sys


def test_env_reports_versions_and_strategies():
    from hftrain.env import report

    text = report(check_ops=False)
    assert "torch: " in text and "deepspeed: " in text and "backend: " in text
    for name in ("ddp", "fsdp", "zero1", "zero2", "zero3"):
        assert f"  {name}: can run" in text


def test_cpu_adam_that_cannot_build_is_one_actionable_line(tmp_path):
    # A real failed build: an empty extensions cache and a compiler that does not exist.
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
        "CXX": "/nonexistent/c++",
        "HF_HUB_OFFLINE": "1",
    }
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hftrain",
            "train",
            "--strategy.name",
            "zero2",
            "--offload_optimizer",
            "true",
            "--max_train_samples",
            "64",
            "--max_eval_samples",
            "16",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("hftrain: error:")]
    assert len(errors) == 1 and "CPU Adam op cannot be built" in errors[0] and "offload_optimizer: false" in errors[0]
    assert not out.exists()
