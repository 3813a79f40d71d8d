"""Slurm without Slurm: the environment derivation fed the variables Slurm sets, and the batch script run end to
end on this machine (``srun`` and ``scontrol`` replaced by two-line shell stand-ins that run the step and
record the requeue), preempted by SIGUSR1 and then continued by its requeued run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hftrain.launch.slurm import SlurmError, expand_nodelist, launcher_command, slurm_launch
from tests.conftest import job_args

ROOT = Path(__file__).resolve().parents[1]

EXPANSIONS = {
    "node1": ["node1"],
    "node[01-03,7]": ["node01", "node02", "node03", "node7"],
    "gpu-a[1-2]-x,login": ["gpu-a1-x", "gpu-a2-x", "login"],
    "rack[1-2]-n[8-9]": ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"],
    "10.0.0.[1-2],c[009-010]": ["10.0.0.1", "10.0.0.2", "c009", "c010"],
}
BAD_NODELISTS = {
    "node[1-2": "unbalanced",
    "node[3-1]": "not a number or range",
    "node[a-b]": "not a number or range",
    "$(reboot)": "not a plain host name",
    "n[1-2];id": "not a plain host name",
    "n[0-99999999]": "more than",
    "": "empty",
}
ENV = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456"}


@pytest.mark.parametrize("nodelist", list(EXPANSIONS))
def test_nodelist_expands_like_scontrol(nodelist):
    assert expand_nodelist(nodelist) == EXPANSIONS[nodelist]


@pytest.mark.parametrize("nodelist", list(BAD_NODELISTS))
def test_bad_nodelist_is_refused(nodelist):
    with pytest.raises(SlurmError, match=BAD_NODELISTS[nodelist]):
        expand_nodelist(nodelist)


def test_launch_is_derived_from_slurm_variables(tmp_path):
    launch = slurm_launch({**ENV, "SLURM_GPUS_ON_NODE": "4"})
    assert (launch.master_addr, launch.node_rank, launch.nnodes, launch.nproc_per_node) == ("gpu07", 1, 2, 4)
    assert launch.master_port == 20000 + 123456 % 20000  # the same on every node of the job
    assert slurm_launch({**ENV, "MASTER_PORT": "29555"}, nproc_per_node=2).master_port == 29555
    torchrun = launcher_command(launch, "torchrun", ["scripts/train.py", "--x", "1"], accelerate_config=None,
                                workdir=tmp_path)  # fmt: skip
    assert torchrun[1:] == ["-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", "1", "--nproc_per_node",
                            "4", "--master_addr", "gpu07", "--master_port", str(launch.master_port),
                            "scripts/train.py", "--x", "1"]  # fmt: skip
    accelerate = launcher_command(launch, "accelerate", ["t.py"], accelerate_config="a.yaml", workdir=tmp_path)
    assert ["--machine_rank", "1"] == accelerate[accelerate.index("--machine_rank") :][:2]
    assert accelerate[accelerate.index("--num_processes") + 1] == "8"
    deepspeed = launcher_command(launch, "deepspeed", ["t.py"], accelerate_config=None, workdir=tmp_path)
    assert (tmp_path / "hostfile").read_text() == "gpu07 slots=4\ngpu08 slots=4\n"
    assert deepspeed[deepspeed.index("--node_rank") + 1] == "1" and "--no_ssh" in deepspeed


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_NODEID": None}, "SLURM_NODEID is not set"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID 2 is not below the node count 2"),
        ({"SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES is 3 but SLURM_JOB_NODELIST lists 2 hosts"),
        ({"SLURM_JOB_ID": "x1"}, "SLURM_JOB_ID='x1' is not an integer"),
        ({"MASTER_PORT": "70000"}, "not a TCP port"),
    ],
)
def test_bad_slurm_environment_is_one_clear_error(change, fragment):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(SlurmError, match=fragment):
        slurm_launch(env, nproc_per_node=1)


def test_missing_process_count_and_script_are_errors():
    with pytest.raises(SlurmError, match="pass --nproc_per_node"):
        slurm_launch(ENV)
    done = subprocess.run([sys.executable, "-m", "hftrain.launch.slurm"], capture_output=True, text=True,
                          env={**os.environ, **ENV}, timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("hftrain: error: no training script given")


STUBS = {  # Slurm's commands, as far as the batch script uses them on one node
    "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n[ "$1 $2" = "show hostnames" ] && echo "$3"\nexit 0\n',
}


def _batch(tiny_job, tmp_path: Path, out: Path) -> subprocess.Popen:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SCONTROL_LOG": str(tmp_path / "scontrol.log")}
    env |= {"SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    env |= {"SLURM_JOB_ID": "4242", "HFTRAIN_PYTHON": sys.executable, "HFTRAIN_NPROC_PER_NODE": "2"}
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [*job_args(tiny_job, out), "--max_steps", "40", "--save_steps", "2", "--gradient_accumulation_steps", "1"]
    log = (tmp_path / "job.out").open("a")
    return subprocess.Popen(["bash", "scripts/slurm/hftrain.sbatch", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


def test_batch_script_checkpoints_on_usr1_requeues_and_continues(tiny_job, tmp_path):
    out = tmp_path / "out"
    job = _batch(tiny_job, tmp_path, out)
    try:
        deadline = time.monotonic() + 300
        while not list((out / "checkpoints").glob("step_*/checkpoint.json")):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.out").read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # what Slurm sends the batch shell 120 s before the time limit
        assert job.wait(timeout=300) == 75, (tmp_path / "job.out").read_text()[-3000:]
    finally:
        job.kill()
    log = (tmp_path / "job.out").read_text()
    assert "hftrain slurm: node 0 of 1, 2 processes, master 127.0.0.1:" in log
    assert "preempted (SIGUSR1)" in log and "requeueing job 4242" in log
    assert (tmp_path / "scontrol.log").read_text().splitlines()[-1] == "requeue 4242"
    stopped_at = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*"))
    assert 0 < stopped_at < 40 and not (out / "model").exists()
    # Slurm starts the requeued job with the same script: it resumes and finishes
    job = _batch(tiny_job, tmp_path, out)
    assert job.wait(timeout=300) == 0, (tmp_path / "job.out").read_text()[-3000:]
    log = (tmp_path / "job.out").read_text()
    assert f"at step {stopped_at}" in log.split("resumed from")[-1].splitlines()[0]
    assert (out / "model" / "model.safetensors").is_file()
    assert (tmp_path / "scontrol.log").read_text().count("requeue") == 1
