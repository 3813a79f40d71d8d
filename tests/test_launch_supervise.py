"""``hftrain launch`` (torchrun whose exit code is the ranks' own), workers that die with their agent, and Ctrl-C in
one line: each case as a user meets it, signals sent to a real launched job's process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hftrain.launch.supervise import launched
from tests.conftest import assert_refused, job_args, launch_env

ROOT = Path(__file__).resolve().parents[1]


def _start(command: list[str], log: Path) -> subprocess.Popen:
    """Start ``command`` in a process group of its own (signals then go to the group, as a scheduler's do), with
    SIGINT's default disposition: a suite started in the background by a non-interactive shell (``.ci/run &``) runs
    with SIGINT ignored, every child inherits that, and Python then installs no Ctrl-C handler at all."""
    with log.open("a") as out:
        return subprocess.Popen(
            command, cwd=ROOT, env=launch_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_default_sigint,
        )  # fmt: skip


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_checkpoint(job: subprocess.Popen, out: Path, log: Path) -> None:
    deadline = time.monotonic() + 300
    while not list((out / "checkpoints").glob("step_*/checkpoint.json")):
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def _long_run(tiny_job, out: Path) -> list[str]:
    """A run long enough to be signalled after its first checkpoint."""
    return [*job_args(tiny_job, out), "--max_steps", "400", "--save_steps", "2", "--gradient_accumulation_steps", "1"]


def _launch(tiny_job, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hftrain",
        "launch",
        "--nproc_per_node",
        "2",
        "--",
        "train",
        *_long_run(tiny_job, out),
    ]


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_to_the_group_ends_hftrain_launch_in_75_and_the_run_resumes(tiny_job, tmp_path, sent):
    """SIGTERM or SIGUSR1 to the whole group (agent and workers, as Slurm and Kubernetes send it): the ranks
    checkpoint, and the launcher exits 75 with one line, no traceback (plain torchrun exits 1 with one, and dies of
    SIGUSR1 leaving its workers). SIGINT (Ctrl-C in the terminal) to the group: exit 130, one "interrupted" line,
    no traceback, no export."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    job = _start(_launch(tiny_job, out), log)
    expected = 130 if sent == signal.SIGINT else 75
    try:
        _wait_for_checkpoint(job, out, log)
        os.killpg(job.pid, sent)
        assert job.wait(timeout=300) == expected, log.read_text()[-3000:]
    finally:
        with_children_killed(job)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    launcher = [line for line in text.splitlines() if line.startswith("hftrain launch:")]
    if sent == signal.SIGINT:  # Ctrl-C is one line: the main process's, naming the resume (the launcher adds none)
        interrupted = [line for line in text.splitlines() if "interrupted" in line]
        assert len(interrupted) == 1 and not launcher, text[-3000:]
        assert interrupted[0].startswith("hftrain: interrupted (Ctrl-C)") and "exit code 130" in interrupted[0]
        assert "preempted" not in text
    else:
        assert f"preempted ({sent.name})" in text
        assert len(launcher) == 1 and f"exited {expected}" in launcher[0], text[-3000:]
    stopped = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert 0 < stopped < 400 and not (out / "model").exists()


def test_a_bad_input_under_hftrain_launch_is_exit_2(tiny_job, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "launch", "--nproc_per_node", "2", "--", "train",
         *job_args(tiny_job, tmp_path / "out"), "--learning_rate", "-1"],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    assert sum(line.startswith("hftrain: error:") for line in done.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_hftrain_launch_without_the_separator_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "launch", "--nproc_per_node", "2", "train"],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_refused(done.stderr, done.returncode, "separate torchrun's options from hftrain's command with --")


def test_workers_die_with_their_agent(tiny_job, tmp_path):
    """SIGKILL to torchrun alone: its workers get SIGTERM from the kernel (PR_SET_PDEATHSIG), checkpoint and exit,
    instead of training on unsupervised."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hftrain", "train",
               *_long_run(tiny_job, out)]  # fmt: skip
    agent = _start(command, log)
    try:
        _wait_for_checkpoint(agent, out, log)
        workers = psutil.Process(agent.pid).children()
        assert len(workers) == 2
        agent.kill()
        agent.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=120)
        assert not alive, log.read_text()[-3000:]
    finally:
        with_children_killed(agent)
    assert "preempted (SIGTERM)" in log.read_text()
    assert not (out / "model").exists()


def test_ctrl_c_is_one_line(tiny_job, tmp_path):
    out, log = tmp_path / "out", tmp_path / "job.log"
    job = _start([sys.executable, "-m", "hftrain", "train", *_long_run(tiny_job, out)], log)
    try:
        _wait_for_checkpoint(job, out, log)
        os.killpg(job.pid, signal.SIGINT)
        assert job.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        with_children_killed(job)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert sum(line.startswith("hftrain: interrupted (Ctrl-C)") for line in text.splitlines()) == 1


def test_launched_is_read_from_the_launchers_variables():
    assert launched({"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"})
    assert launched({"LOCAL_RANK": "1", "WORLD_SIZE": "2"})  # deepspeed, accelerate
    assert not launched({})
    assert not launched({"WORLD_SIZE": "2"})


def with_children_killed(job: subprocess.Popen) -> None:
    """Kill whatever is left of a job's process group (a failed test must not leave ranks training)."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_sigterm_after_the_last_step_is_a_preemption_not_143(tiny_job, tmp_path):
    """SIGTERM while the run evaluates, saves and exports after its last step: the signal is a preemption (exit 75,
    the 'preempted' line, the export left to the resumed run) or, once the export began, the run finishes (exit 0,
    the model exported); never the default action's 143 with no word. The resumed run then exports."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    args = [*job_args(tiny_job, out, steps=4), "--gradient_accumulation_steps", "1"]
    job = _start([sys.executable, "-m", "hftrain", "train", *args], log)
    try:
        deadline = time.monotonic() + 300
        while not list((out / "checkpoints").glob("*step_00000004")):  # the final save began: the loop is over
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        os.killpg(job.pid, signal.SIGTERM)
        code = job.wait(timeout=300)
    finally:
        with_children_killed(job)
    text = log.read_text()
    assert code in (0, 75) and "Traceback" not in text, (code, text[-3000:])
    if code == 75:
        assert "preempted (SIGTERM) at step 4" in text and not (out / "model").exists()
        resumed = subprocess.run(
            [sys.executable, "-m", "hftrain", "train", *args, "--resume_from_checkpoint", "auto"],
            cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "model" / "model.safetensors").is_file()
