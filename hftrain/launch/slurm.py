"""Slurm: derive the launch from Slurm's environment, start the launcher, and pass on preemption.

``scripts/slurm/hftrain.sbatch`` runs ``python -m hftrain.launch.slurm`` once per node (``srun
--ntasks-per-node=1``). On each node this derives the master address (first host of
``SLURM_JOB_NODELIST``, expanded by ``scontrol show hostnames`` when present, else by ``expand_nodelist``),
the node rank (``SLURM_NODEID``), the node count and the processes per node, then starts torchrun,
``accelerate launch`` or ``deepspeed`` with them (an argument list, never a shell). A SIGUSR1/SIGTERM it
receives (Slurm's ``--signal``, forwarded by the batch script through srun) is passed to the training
processes only, whose hftrain checkpoints at the next step boundary and exits 75; launchers like torchrun
report any worker failure as 1, so this wrapper exits 75 itself after a preemption, and the batch script
requeues the job, which continues with ``--resume_from_checkpoint auto``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hftrain.errors import ConfigError, HFTrainError
from hftrain.files import write_file
from hftrain.launch.hostfile import host_key

MAX_HOSTS = 65536
LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
_GROUP = re.compile(r"\[([^\[\]]*)\]")


class SlurmError(ConfigError):
    """Slurm's environment is missing a variable or holds something hftrain cannot launch from."""


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list (``node[01-03,7],gpu-a[1-2]-x``) as ``scontrol show hostnames`` does.

    Args:
        nodelist: the value of ``SLURM_JOB_NODELIST``.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item, nodelist))
        if len(hosts) > MAX_HOSTS:
            raise SlurmError(f"SLURM_JOB_NODELIST expands to more than {MAX_HOSTS} hosts")
    for host in hosts:
        if host_key(host) is None:
            raise SlurmError(f"SLURM_JOB_NODELIST: '{host[:60]}' is not a plain host name or IP address")
    if not hosts:
        raise SlurmError("SLURM_JOB_NODELIST is empty; run inside a Slurm allocation")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in nodelist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise SlurmError(f"SLURM_JOB_NODELIST '{nodelist[:80]}' has unbalanced brackets")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise SlurmError(f"SLURM_JOB_NODELIST '{nodelist[:80]}' has unbalanced brackets")
    return [*items, current] if current or items else []


def _expand_item(item: str, nodelist: str) -> list[str]:
    match = _GROUP.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise SlurmError(f"SLURM_JOB_NODELIST '{nodelist[:80]}': '{part}' is not a number or range")
        if high and int(high) - int(low) >= MAX_HOSTS:
            raise SlurmError(f"SLURM_JOB_NODELIST expands to more than {MAX_HOSTS} hosts")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return [f"{head}{value}{rest}" for value in values for rest in _expand_item(tail, nodelist)]


@dataclass(frozen=True)
class SlurmLaunch:
    """One node's place in the job, from Slurm's environment.

    Args:
        hosts: the allocation's hosts, in order.
        node_rank: this node's index (``SLURM_NODEID``).
        nproc_per_node: training processes per node.
        master_port: rendezvous port (``MASTER_PORT``, else derived from the job id).
    """

    hosts: list[str]
    node_rank: int
    nproc_per_node: int
    master_port: int

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @property
    def nnodes(self) -> int:
        return len(self.hosts)


def slurm_launch(environ: Mapping[str, str], *, nproc_per_node: int | None = None, hosts: list[str] | None = None):
    """Derive this node's launch from the variables Slurm sets.

    Args:
        environ: the environment (``SLURM_JOB_NODELIST``, ``SLURM_NODEID``, ``SLURM_JOB_NUM_NODES``,
            ``SLURM_JOB_ID``, optionally ``SLURM_GPUS_ON_NODE`` and ``MASTER_PORT``).
        nproc_per_node: processes per node; default ``SLURM_GPUS_ON_NODE``.
        hosts: the expanded node list when ``scontrol`` gave it; else it is expanded here.
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set; run inside a Slurm allocation (sbatch/srun)")
    hosts = hosts or expand_nodelist(nodelist)
    nnodes = _number(environ, "SLURM_JOB_NUM_NODES", fallback="SLURM_NNODES", minimum=1)
    if nnodes != len(hosts):
        raise SlurmError(f"SLURM_JOB_NUM_NODES is {nnodes} but SLURM_JOB_NODELIST lists {len(hosts)} hosts")
    node_rank = _number(environ, "SLURM_NODEID", minimum=0)
    if node_rank >= nnodes:
        raise SlurmError(f"SLURM_NODEID {node_rank} is not below the node count {nnodes}")
    if nproc_per_node is None:
        if not environ.get("SLURM_GPUS_ON_NODE"):
            raise SlurmError("processes per node unknown: pass --nproc_per_node N (no SLURM_GPUS_ON_NODE)")
        nproc_per_node = _number(environ, "SLURM_GPUS_ON_NODE", minimum=1)
    if environ.get("MASTER_PORT"):
        port = _number(environ, "MASTER_PORT", minimum=1)
    else:  # the same on every node, and different for jobs sharing a first node
        port = 20000 + _number(environ, "SLURM_JOB_ID", minimum=0) % 20000
    if port > 65535:
        raise SlurmError(f"MASTER_PORT {port} is not a TCP port")
    return SlurmLaunch(hosts=hosts, node_rank=node_rank, nproc_per_node=nproc_per_node, master_port=port)


def _number(environ: Mapping[str, str], name: str, *, minimum: int, fallback: str | None = None) -> int:
    value = environ.get(name) or (environ.get(fallback) if fallback else None)
    if value is None:
        raise SlurmError(f"{name} is not set; run inside a Slurm allocation (sbatch/srun)")
    if not value.isdigit() or int(value) < minimum:
        raise SlurmError(f"{name}='{value[:40]}' is not an integer >= {minimum}")
    return int(value)


def scontrol_hostnames(nodelist: str) -> list[str] | None:
    """Slurm's own expansion of the node list (validated like ours), or None when ``scontrol`` is absent."""
    if shutil.which("scontrol") is None:
        return None
    done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SlurmError(f"scontrol show hostnames failed ({done.stderr.strip()[:200]})")
    hosts = done.stdout.split()
    for host in hosts:
        if host_key(host) is None:
            raise SlurmError(f"scontrol returned '{host[:60]}', which is not a plain host name or IP address")
    return hosts


def launcher_command(
    launch: SlurmLaunch, launcher: str, script: list[str], *, accelerate_config: str | None, workdir: Path
) -> list[str]:
    """The launcher's command line for this node.

    Args:
        launch: this node's place in the job.
        launcher: ``torchrun``, ``accelerate`` or ``deepspeed``.
        script: the training script and its arguments.
        accelerate_config: ``accelerate launch --config_file`` (accelerate only).
        workdir: where a DeepSpeed hostfile may be written.
    """
    python = [sys.executable, "-m"]
    addr, port = launch.master_addr, str(launch.master_port)
    if launcher == "torchrun":
        return [*python, "torch.distributed.run", "--nnodes", str(launch.nnodes), "--node_rank",
                str(launch.node_rank), "--nproc_per_node", str(launch.nproc_per_node), "--master_addr", addr,
                "--master_port", port, *script]  # fmt: skip
    if launcher == "accelerate":
        config = ["--config_file", accelerate_config] if accelerate_config else ["--multi_gpu"]
        return [*python, "accelerate.commands.launch", *config, "--num_machines", str(launch.nnodes),
                "--machine_rank", str(launch.node_rank), "--main_process_ip", addr, "--main_process_port", port,
                "--num_processes", str(launch.nnodes * launch.nproc_per_node), *script]  # fmt: skip
    hostfile = workdir / "hostfile"
    write_file(hostfile, "".join(f"{host} slots={launch.nproc_per_node}\n" for host in launch.hosts))  # not via a link
    return [*python, "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank",
            str(launch.node_rank), "--master_addr", addr, "--master_port", port, *script]  # fmt: skip


def run_launcher(command: list[str], script: str) -> int:
    """Run the launcher; pass SIGUSR1/SIGTERM on to the training processes; 75 after a preemption.

    Args:
        command: the launcher's command line.
        script: the training script, to tell the training processes from the launcher's own.
    """
    from hftrain.checkpoint.preemption import PREEMPTED_EXIT_CODE

    child = subprocess.Popen(command)
    preempted: list[int] = []

    def forward(signum: int, frame: object) -> None:
        preempted.append(signum)
        for process in training_processes(child.pid, script):
            process.send_signal(signal.SIGUSR1)  # hftrain's preemption signal; launchers are not signalled

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == PREEMPTED_EXIT_CODE or (preempted and code != 0):
        return PREEMPTED_EXIT_CODE
    return code


def training_processes(pid: int, script: str) -> list:
    """The processes under ``pid`` that run ``script`` (the training processes), not the launchers between.

    Args:
        pid: the launcher's process id.
        script: the training script as given on the command line.
    """
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for process in descendants:
        try:
            command = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        # a launcher's command line holds the script too, after its module: python -m torch.distributed.run ...
        if script in command and "-m" not in command[: command.index(script)]:
            found.append(process)
    return found


def main(argv: list[str] | None = None) -> int:
    """``python -m hftrain.launch.slurm [options] -- SCRIPT ARGS``: launch this node of a Slurm job."""
    parser = argparse.ArgumentParser(prog="python -m hftrain.launch.slurm", description=main.__doc__)
    parser.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    parser.add_argument("--nproc_per_node", type=int, help="processes per node (default SLURM_GPUS_ON_NODE)")
    parser.add_argument("--accelerate_config", help="accelerate launch --config_file (launcher accelerate)")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- the training script and its arguments")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    try:
        if not script:
            raise SlurmError("no training script given; end the options with -- scripts/train.py --config job.yaml")
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
        hosts = scontrol_hostnames(nodelist) if nodelist else None
        launch = slurm_launch(os.environ, nproc_per_node=args.nproc_per_node, hosts=hosts)
        with tempfile.TemporaryDirectory(prefix="hftrain-slurm-") as workdir:
            command = launcher_command(
                launch, args.launcher, script, accelerate_config=args.accelerate_config, workdir=Path(workdir)
            )
            print(
                f"hftrain slurm: node {launch.node_rank} of {launch.nnodes}, {launch.nproc_per_node} processes, "
                f"master {launch.master_addr}:{launch.master_port}, launcher {args.launcher}",
                flush=True,
            )
            return run_launcher(command, script[0])
    except HFTrainError as error:
        print(f"hftrain: error: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
