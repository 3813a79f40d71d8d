"""Elastic restarts: under ``torchrun --max-restarts 3`` a worker SIGKILLed three times, at random steps, costs
nothing: torchrun restarts the group, which resumes from the last complete checkpoint
(``--resume_from_checkpoint auto``), and the run ends with the weights of an uninterrupted run.

The test watches progress from the outside only (complete checkpoint folders appearing in ``output_dir``)
and finds the workers as children of the torchrun agent.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hftrain.launch.slurm import training_processes
from tests.conftest import assert_same_exports, logged_losses
from tests.netns import kill_tree

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY, KILLS = 60, 2, 3

pytestmark = pytest.mark.distributed


def _command(job: dict, out: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    torchrun += ["--max-restarts", str(KILLS), "--monitor-interval", "0.5"]
    args = {
        "model_name_or_path": job["model"],
        "train_file": job["data"],
        "output_dir": out,
        "max_steps": STEPS,
        "save_steps": SAVE_EVERY,
        "save_total_limit": 3,
        "resume_from_checkpoint": "auto",
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "log_with": "none",
        "max_seq_length": 32,
        "learning_rate": 1e-3,
        "train_sampling_strategy": "random",
    }
    return [*torchrun, "scripts/train.py", *(x for k, v in args.items() for x in (f"--{k}", str(v)))]


def _env(share_store: bool = False) -> dict[str, str]:
    # torchrun shares its TCPStore with the workers unless told not to; restarts need their own (pytorch#135712)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return env if share_store else {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _latest_step(out: Path) -> int:
    """The newest complete checkpoint's step (a folder counts once its checkpoint.json is there)."""
    steps = [int(p.parent.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*/checkpoint.json")]
    return max(steps, default=0)


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(condition, agent: subprocess.Popen, timeout: float, what: str, output: list[str]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if agent.poll() is not None:
            raise AssertionError(f"torchrun exited ({agent.returncode}) while waiting for {what}: {output[-40:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s: {output[-40:]}")
        time.sleep(0.05)


def test_sigkilled_worker_three_times_ends_like_an_uninterrupted_run(tiny_job, tmp_path):
    rng = random.Random()
    uninterrupted = tmp_path / "uninterrupted"
    done = subprocess.run(_command(tiny_job, uninterrupted), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "chaos"
    agent = subprocess.Popen(
        _command(tiny_job, out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []

    def read() -> None:
        with (tmp_path / "chaos.log").open("w") as log:
            for line in agent.stdout:
                output.append(line)
                log.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    kills = []
    try:
        # three random steps in the first half, so that training is still running when the last kill lands
        targets = sorted(rng.sample(range(SAVE_EVERY, STEPS // 2 + 1, SAVE_EVERY), KILLS))
        seen = 0
        for target in targets:
            # past the target, and past the last kill: the restarted group is training again
            goal = max(target, seen + SAVE_EVERY)
            _wait_for(lambda g=goal: _latest_step(out) >= g, agent, 300, f"checkpoint of step {goal}", output)
            time.sleep(rng.uniform(0, 0.5))  # a random moment within the following steps
            victim = rng.choice(training_processes(agent.pid, "scripts/train.py"))
            victim.send_signal(signal.SIGKILL)
            seen = _latest_step(out)
            kills.append((seen, victim.pid))
            _wait_for(lambda v=victim: not _alive(v), agent, 60, "the kill", output)
        agent.wait(timeout=600)
    finally:
        kill_tree(agent)
        reader.join(timeout=10)
    log = "".join(output)
    assert agent.returncode == 0, log[-4000:]
    assert len(kills) == KILLS
    resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
    assert len(resumed) == KILLS, (kills, resumed, log[-4000:])
    assert all(0 < int(step) < STEPS for step in resumed), (kills, resumed)
    assert logged_losses(out) == pytest.approx(logged_losses(uninterrupted), rel=1e-6)
    assert_same_exports(out, uninterrupted, atol=1e-6)


def test_restarts_with_a_shared_store_are_refused_with_the_fix(tiny_job, tmp_path):
    command = _command(tiny_job, tmp_path / "out")
    command[command.index("--max-restarts") + 1] = "1"
    done = subprocess.run(command, cwd=ROOT, env=_env(share_store=True), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "hftrain: error: torchrun --max-restarts 1 with its shared TCPStore" in done.stdout + done.stderr
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stdout + done.stderr
    assert not (tmp_path / "out").exists()
