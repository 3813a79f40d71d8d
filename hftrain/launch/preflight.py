"""The cheap checks every launched process runs first, before it joins a process group or writes a file.

A launcher hands each process its place in the job through the environment (torchrun, ``accelerate launch``
and DeepSpeed's launcher all set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
torchrun ``LOCAL_WORLD_SIZE``, DeepSpeed ``LOCAL_SIZE``). Missing or inconsistent values, and a multi-machine
job whose gloo would bind to the wrong interface, are reported here as one line instead of a hang later.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from hftrain.errors import ConfigError, ProcessError
from hftrain.launch.rendezvous import (
    INTERFACE_VARIABLES,
    Rendezvous,
    RendezvousError,
    interface_addresses,
    interface_for,
    is_loopback,
    parse_rendezvous,
)


@dataclass
class LaunchPreflight:
    """What the preflight found and set.

    Args:
        world_size: processes in the job.
        local_world_size: processes on this machine.
        rendezvous: the rendezvous endpoint (None for a single process).
        notes: lines to log (e.g. an interface variable that was set).
    """

    world_size: int = 1
    local_world_size: int = 1
    rendezvous: Rendezvous | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def num_machines(self) -> int:
        return self.world_size // self.local_world_size


def local_world_size(environ: MutableMapping[str, str]) -> int | None:
    """Processes on this machine, as the launcher said (torchrun/accelerate or DeepSpeed's name); None when unset.

    A value that is not a count of at least 1 is refused, not replaced by the world size.
    """
    name = "LOCAL_WORLD_SIZE" if environ.get("LOCAL_WORLD_SIZE") else "LOCAL_SIZE"
    if not environ.get(name):
        return None
    return _int(environ, name, minimum=1)


def preflight_launch(environ: MutableMapping[str, str], *, backend: str, gpus: int | None = None) -> LaunchPreflight:
    """Check the launcher's environment; set gloo's interface variable of a multi-machine job when unset.

    Args:
        environ: the process environment (``os.environ``; the interface variable may be added to it).
        backend: ``gloo`` or ``nccl``.
        gpus: GPUs visible on this machine (None: a CPU run): more local processes than GPUs would share one.
    """
    world = _int(environ, "WORLD_SIZE", default="1", minimum=1)
    if world == 1:
        return LaunchPreflight()
    rank = _int(environ, "RANK", minimum=0)
    local_rank = _int(environ, "LOCAL_RANK", minimum=0)
    local = local_world_size(environ) or world
    if rank >= world or local_rank >= local or local > world or world % local:
        raise ProcessError(
            f"launcher environment: RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world}, local processes "
            f"{local} are inconsistent (each machine must run the same number of processes); start with one launcher"
        )
    if gpus is not None and local > gpus:
        raise ProcessError(
            f"launcher environment: {local} processes on this machine but {gpus} GPU(s) visible; launch one process "
            f"per GPU (--nproc_per_node {gpus}), or make the GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    check_elastic(environ)
    report = LaunchPreflight(world, local, parse_rendezvous(environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")))
    if report.num_machines > 1:
        report.notes += check_interface(environ, report.rendezvous, backend=backend, machines=report.num_machines)
    return report


def check_interface(
    environ: MutableMapping[str, str], rendezvous: Rendezvous, *, backend: str, machines: int
) -> list[str]:
    """Make sure the backends talk over the interface that reaches the rendezvous; returns notes to log.

    gloo's variable is set when unset (and said so), under nccl too: hftrain's host-side agreements run over gloo
    groups beside the NCCL ones (``parallel.host``), as FSDP's CPU offload does. nccl chooses well by itself, so
    its variable is only reported. A variable naming an interface this machine lacks, or a loopback rendezvous for
    several machines, is an error.

    Args:
        environ: the process environment.
        rendezvous: the rendezvous endpoint.
        backend: ``gloo`` or ``nccl``.
        machines: machines in the job.
    """
    interface, source = interface_for(rendezvous.addr)
    addresses = interface_addresses()
    if is_loopback(interface, addresses):
        raise RendezvousError(
            f"MASTER_ADDR {rendezvous.addr} is reached over loopback ({interface}) but the job spans {machines} "
            "machines; set the launcher's master address to the main machine's address on the network they share"
        )
    backends = ["gloo"] if backend == "gloo" else ["gloo", backend]
    notes: list[str] = []
    for each in backends:
        notes += _check_variable(environ, each, rendezvous, interface, source, addresses)
    return notes


def _check_variable(
    environ: MutableMapping[str, str], backend: str, rendezvous: Rendezvous, interface: str, source: str, addresses: Any
) -> list[str]:
    variable = INTERFACE_VARIABLES[backend]
    current = environ.get(variable)
    if current is None:
        if backend != "gloo":
            return [f"{variable} unset; {backend} will choose (the rendezvous is reached over {interface})"]
        environ[variable] = interface
        return [f"{variable} was unset; set it to {interface} ({source}), the interface that reaches {rendezvous}"]
    unknown = [name for name in current.split(",") if name not in addresses]
    if unknown:
        raise RendezvousError(
            f"{variable}={current} names {', '.join(unknown)}, which this machine does not have; set it to "
            f"{interface} (the interface that reaches {rendezvous}) or unset it"
        )
    if interface not in current.split(","):
        return [f"warning: {variable}={current}, but {rendezvous} is reached over {interface}"]
    return [f"{variable}={current} (reaches {rendezvous})"]


def check_elastic(environ: MutableMapping[str, str]) -> None:
    """Refuse ``torchrun --max-restarts N`` whose workers share the agent's TCPStore across restarts.

    With the shared store (torchrun's default since torch 2.5), restarted workers can read the previous
    round's addresses and fail to connect (pytorch#135712, seen here as gloo's "connectFullMesh failed:
    Connection refused"), which spends every restart. torchrun gives each round its own store when
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set in its environment and the rendezvous is c10d (the static
    rendezvous, torchrun's default with ``--master_addr``, always shares its store).

    Args:
        environ: the worker's environment, as torchrun set it.
    """
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts.isdigit() and int(restarts) > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"torchrun --max-restarts {restarts} with its shared TCPStore: restarted workers would read the previous "
            "round's addresses and fail to connect (pytorch#135712); start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and the c10d rendezvous (--standalone, or "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT; the static one always shares)"
        )


def _int(environ: MutableMapping[str, str], name: str, *, default: str | None = None, minimum: int) -> int:
    value = environ.get(name, default)
    if value is None:
        raise ProcessError(
            f"launcher environment: {name} is not set though WORLD_SIZE={environ.get('WORLD_SIZE')}; start the "
            "processes with torchrun, accelerate launch or deepspeed"
        )
    if not (value.isascii() and value.isdigit()) or int(value) < minimum:
        raise ProcessError(f"launcher environment: {name}='{value}' is not an integer >= {minimum}")
    return int(value)
