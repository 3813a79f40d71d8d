"""Two simulated machines (network namespaces + veth): torchrun, accelerate launch and deepspeed across them.

Each case trains a tiny BERT for a few steps with DDP or ZeRO-3, 1 process per machine (one case 2), and
checks that every rank ends with the same parameters and that the losses and weights equal one process
training on the same global batch. Also: a node-local ``output_dir`` is refused at start, and a failing
rank fails the launch with its error visible.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import assert_same_exports, job_args, logged_losses
from tests.distributed import free_port
from tests.netns import run_on_nodes, two_nodes

ROOT = Path(__file__).resolve().parents[1]
WORKER = "tests/launch_worker.py"
GAS = 2  # job_args: 4 optimizer steps, accumulation 2


def _job_args(job: dict[str, str], output_dir: Path) -> list[str]:
    """The launch tests' tiny job in fp32: the multi-machine runs are compared with 1 process at 1e-5."""
    return [*job_args(job, output_dir), "--mixed_precision", "no"]


# micro-batch by world size: 72 training rows split into full global batches only (a partial last batch is
# padded with duplicates across ranks, which one process does not do)
MICRO = {2: 4, 4: 3}

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def nodes():
    with two_nodes() as found:
        if isinstance(found, str):
            pytest.skip(found)
        yield found


@pytest.fixture(scope="module")
def references(tiny_job):
    """Single-process runs with the same global batch, by world size (computed when first asked for)."""
    cache: dict[int, Path] = {}

    def reference(world: int) -> Path:
        if world not in cache:
            out = Path(tiny_job["root"]) / f"reference-{world}"
            command = [sys.executable, "-m", "hftrain", "train", *_job_args(tiny_job, out)]
            command += ["--per_device_train_batch_size", str(MICRO[world] * world)]
            done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            cache[world] = out
        return cache[world]

    return reference


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    for key in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)  # hftrain must derive the interface itself; nothing leaks in from the test runner
    return env


def _launcher(kind: str, strategy: str, *, node_rank: int, per_node: int, master: str, port: int, hostfile: Path):
    """The launcher's command line for one machine, as its docs (and hftrain's README) give it."""
    python = [sys.executable, "-m"]
    if kind == "torchrun":
        name, _, sharding = strategy.partition(":")  # fsdp:HYBRID_SHARD
        options = ["--strategy.sharding_strategy", sharding] if sharding else []
        return [*python, "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
                "--nproc_per_node", str(per_node), "--master_addr", master, "--master_port", str(port), WORKER,
                "--strategy.name", name, *options]  # fmt: skip
    if kind == "accelerate":
        config = f"accelerate_configs/multinode_{strategy}.yaml"
        return [*python, "accelerate.commands.launch", "--config_file", config, "--machine_rank", str(node_rank),
                "--main_process_ip", master, "--main_process_port", str(port),
                "--num_processes", str(2 * per_node), WORKER]  # fmt: skip
    ds = ["--deepspeed", "ds_configs/zero3.json"] if strategy == "zero3" else []
    return [*python, "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
            str(node_rank), "--master_addr", master, "--master_port", str(port), WORKER, *ds]  # fmt: skip


def _launch(nodes, tiny_job, tmp_path, kind, strategy, per_node, *, output_dirs=None, extra=(), tag=""):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n.address} slots={per_node}\n" for n in nodes))
    port = free_port()
    outs = output_dirs or [tmp_path / "out"] * 2
    micro = ["--per_device_train_batch_size", str(MICRO[2 * per_node])]
    commands = []
    for i, node in enumerate(nodes):
        launcher = _launcher(
            kind, strategy, node_rank=i, per_node=per_node, master=nodes[0].address, port=port, hostfile=hostfile
        )
        commands.append(node.command([*launcher, *_job_args(tiny_job, outs[i]), *micro, *extra]))
    logs = [tmp_path / f"node{i}{tag}.log" for i in range(2)]
    codes = run_on_nodes(commands, logs, env=_env(HFTRAIN_TEST_DIGESTS=str(tmp_path / "digests")), timeout=500)
    return codes, [log.read_text() for log in logs]


CASES = [  # (launcher, strategy, processes per machine); the default suite runs two, the rest are slow
    ("torchrun", "ddp", 1),
    ("deepspeed", "zero3", 1),
    pytest.param("accelerate", "ddp", 1, marks=pytest.mark.slow),
    pytest.param("torchrun", "zero3", 2, marks=pytest.mark.slow),
    pytest.param("accelerate", "zero3", 1, marks=pytest.mark.slow),
    pytest.param("deepspeed", "ddp", 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("kind", "strategy", "per_node"), CASES)
def test_two_machines_train_like_one_process(nodes, tiny_job, references, tmp_path, kind, strategy, per_node):
    codes, logs = _launch(nodes, tiny_job, tmp_path, kind, strategy, per_node)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    world = 2 * per_node
    out = tmp_path / "out"
    summary = json.loads((out / "hftrain_strategy.json").read_text())
    assert summary["strategy"] == strategy and summary["world_size"] == world
    assert summary["distributed_type"] == ("DEEPSPEED" if strategy == "zero3" else "MULTI_CPU")
    assert summary["global_batch"] == MICRO[world] * GAS * world
    # hftrain found the veth itself on each machine (gloo would otherwise bind to loopback)
    for node, log in zip(nodes, logs, strict=True):
        assert f"GLOO_SOCKET_IFNAME was unset; set it to {node.interface} ({node.address})" in log
    digests = {p.name: p.read_text() for p in (tmp_path / "digests").iterdir()}
    assert sorted(digests) == [f"rank{r}.txt" for r in range(world)]
    assert len(set(digests.values())) == 1, digests  # every rank holds the same parameters
    reference = references(world)
    losses, reference_losses = logged_losses(out), logged_losses(reference)
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert len(losses) == 4 and reference_losses[-1] != pytest.approx(reference_losses[0], rel=1e-4)
    assert_same_exports(out, reference, atol=1e-5)


def test_fsdp2_hybrid_shards_inside_a_node_and_replicates_across(nodes, tiny_job, tmp_path):
    """FSDP2 ``HYBRID_SHARD`` on 2 machines × 2 processes: a 2-D mesh, each parameter sharded over the 2 processes
    of its machine and replicated across the machines (gradients reduce-scattered inside a node, all-reduced across),
    stopped after step 2 and resumed to step 4, equal to one process on the same global batch: every step's loss and
    the exported weights. Its step-2 checkpoint also resumes in one process (another layout) to the same end. (A
    constant learning rate: the stopped run's ``max_steps`` is 2, and a decaying schedule would differ by it.)"""
    resume = ["--save_steps", "2", "--resume_from_checkpoint", "auto", "--lr_scheduler_type", "constant"]
    strategy = "fsdp:HYBRID_SHARD"
    codes, logs = _launch(nodes, tiny_job, tmp_path, "torchrun", strategy, 2, extra=[*resume, "--max_steps", "2"])
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    shutil.copytree(tmp_path / "out", tmp_path / "one")  # the step-2 run, for the one-process resume below
    codes, logs = _launch(nodes, tiny_job, tmp_path, "torchrun", strategy, 2, extra=resume, tag="-resumed")
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "resumed from" in logs[0], logs[0][-3000:]
    summary = json.loads((tmp_path / "out" / "hftrain_strategy.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 4, summary
    assert summary["sharding_strategy"] == "HYBRID_SHARD", summary
    assert summary["mesh"] == "2 replicas (nodes) × 2 shards (processes per node)", summary
    written = {p.name: p.read_text() for p in (tmp_path / "digests").iterdir()}
    assert {written[f"mesh{r}.txt"] for r in range(4)} == {"[[2, 2]]"}, written  # every parameter on the 2-D mesh
    assert len({written[f"rank{r}.txt"] for r in range(4)}) == 1, written  # the same full parameters everywhere

    def one_process(out: Path) -> None:  # micro-batch = the 2 × 2 processes' global batch
        command = [sys.executable, "-m", "hftrain", "train", *_job_args(tiny_job, out), *resume]
        command += ["--per_device_train_batch_size", str(MICRO[4] * 4)]
        done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    reference = tmp_path / "reference"
    one_process(reference)
    losses, reference_losses = logged_losses(tmp_path / "out"), logged_losses(reference)
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert len(losses) == 4 and reference_losses[-1] != pytest.approx(reference_losses[0], rel=1e-4)
    assert_same_exports(tmp_path / "out", reference, atol=1e-5)
    one_process(tmp_path / "one")  # the hybrid checkpoint of step 2, resumed by one process: the same end
    assert logged_losses(tmp_path / "one") == pytest.approx(reference_losses, rel=1e-5)
    assert_same_exports(tmp_path / "one", reference, atol=1e-5)


def test_node_local_output_dir_is_refused_at_start(nodes, tiny_job, tmp_path):
    disks = [tmp_path / "disk0", tmp_path / "disk1"]  # each machine's own disk: the same path on neither
    for disk in disks:
        disk.mkdir()
    codes, logs = _launch(nodes, tiny_job, tmp_path, "torchrun", "ddp", 1, output_dirs=[d / "out" for d in disks])
    assert codes[0] != 0 and codes[1] != 0
    for log in logs:
        assert "hftrain: error: training.output_dir" in log and "is not shared by all machines" in log
    for disk in disks:
        assert list(disk.iterdir()) == []  # nothing written, markers removed


SINGLE_MACHINE = {
    "torchrun": ["torch.distributed.run", "--nproc_per_node", "2"],
    "deepspeed": ["deepspeed.launcher.runner", "--num_gpus", "2"],
    "accelerate": ["accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"],
}


@pytest.mark.parametrize("kind", list(SINGLE_MACHINE))
def test_a_failing_rank_fails_the_launch_with_its_error(tiny_job, tmp_path, kind):
    # Every rank is told --local_rank=0: rank 1's own launcher environment contradicts it, so rank 1 stops.
    launcher = [sys.executable, "-m", *SINGLE_MACHINE[kind], WORKER]
    command = [*launcher, *_job_args(tiny_job, tmp_path / "out"), "--local_rank=0"]
    env = _env(HFTRAIN_TEST_DIGESTS=str(tmp_path / "digests"), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "hftrain: error: command line: --local_rank=0 but LOCAL_RANK=1 in the environment" in output
    assert not (tmp_path / "out").exists()


def test_doctor_across_machines(nodes, tmp_path):
    """The doctor on each machine: hostfile, rendezvous over the veth, interface, versions compared."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n.address} slots=1\n" for n in nodes))
    port = str(free_port())
    doctor = [sys.executable, "-m", "hftrain", "doctor", "--hostfile", str(hostfile), "--master_port", port]
    doctor += ["--nproc_per_node", "1", "--timeout", "30"]
    logs = [tmp_path / "doctor0.log", tmp_path / "doctor1.log"]
    commands = [
        nodes[0].command([*doctor, "--node_rank", "0", "--wait", "60"]),
        nodes[1].command([*doctor, "--node_rank", "1"]),
    ]
    codes = run_on_nodes(commands, logs, env=_env(), timeout=200)
    main_log, peer_log = (log.read_text() for log in logs)
    assert codes == [0, 0], main_log + peer_log
    master = f"{nodes[0].address}:{port}"
    assert f"this machine hosts {master}: port opened and reachable" in main_log
    assert f"node 1 ({nodes[1].address}) has the same versions" in main_log
    assert f"ok    rendezvous: {master} reachable" in peer_log
    for node, log in zip(nodes, (main_log, peer_log), strict=True):
        assert f"GLOO_SOCKET_IFNAME={node.interface} ({node.address} reaches {master})" in log
    # no doctor on the main machine any more: the rendezvous cannot be reached from the other one
    done = subprocess.run(nodes[1].command([*doctor, "--node_rank", "1", "--timeout", "1"]), capture_output=True,
                          text=True, env=_env(), timeout=120)  # fmt: skip
    assert done.returncode == 1 and f"cannot connect to {master}" in done.stdout


@pytest.mark.slow
def test_elastic_restart_across_machines(nodes, tiny_job, tmp_path):
    """c10d rendezvous over the veth, ``--max-restarts``: a worker SIGKILLed on machine 1 restarts both groups,
    which resume from the last checkpoint and end with the losses of one process on the same global batch."""
    import signal
    import time

    from hftrain.launch.slurm import training_processes
    from tests.netns import kill_tree

    args = [*_job_args(tiny_job, tmp_path / "out"), "--max_steps", "16", "--save_steps", "2"]
    args += ["--resume_from_checkpoint", "auto", "--per_device_train_batch_size", str(MICRO[2])]
    endpoint = f"{nodes[0].address}:{free_port()}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "hftrain-test"]
    torchrun += ["--max-restarts", "3"]
    env = _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    agents = []
    for i, (node, log) in enumerate(zip(nodes, logs, strict=True)):
        # which machine hosts the rendezvous store: its host name does not resolve to the veth address here
        host = ["--rdzv-conf", f"is_host={str(i == 0).lower()}", "--local-addr", node.address]
        command = node.command([*torchrun, *host, "scripts/train.py", *args])
        with log.open("w") as handle:
            agents.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    try:
        deadline = time.monotonic() + 400
        while not list((tmp_path / "out" / "checkpoints").glob("step_*/checkpoint.json")):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), logs[0].read_text()[-3000:]
            time.sleep(0.1)
        workers = training_processes(agents[1].pid, "scripts/train.py")
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGKILL)
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            kill_tree(agent)
    main_log = logs[0].read_text()
    assert codes == [0, 0], main_log[-3000:] + logs[1].read_text()[-3000:]
    assert "resumed from" in main_log
    reference = tmp_path / "reference"
    command = [sys.executable, "-m", "hftrain", "train", *_job_args(tiny_job, reference), "--max_steps", "16"]
    command += ["--per_device_train_batch_size", str(MICRO[2] * 2)]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert logged_losses(tmp_path / "out") == pytest.approx(logged_losses(reference), rel=1e-5)
    assert_same_exports(tmp_path / "out", reference, atol=1e-5)
