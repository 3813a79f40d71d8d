"""``hftrain doctor``: the preflight of a launch, by hand, on every machine before the real launch.

It checks the hostfile strictly, the process counts against it, that the rendezvous can be reached (or, on
the machine that hosts it, that its port can be opened), names the backend and the interface variable it
needs, and compares versions across machines: the doctor on the rendezvous machine (``--wait S``) listens
on the rendezvous port for the other machines' doctors, which send their versions and receive its own.
Every problem is a ``FAIL`` line and makes the exit code 1; a launch with the same settings would fail. The
doctor's own options are checked first: a count below 1, a port outside 1-65535 (0 included: the launchers
would not take it either), a timeout or wait that is not a finite number of seconds, is bad input (one line,
exit code 2), never silently replaced by a default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field

from hftrain.errors import ConfigError, HFTrainError
from hftrain.launch.hostfile import HostEntry, parse_hostfile
from hftrain.launch.rendezvous import (
    INTERFACE_VARIABLES,
    Rendezvous,
    check_connect,
    interface_addresses,
    interface_for,
    is_local,
    is_loopback,
    parse_rendezvous,
)

DEFAULT_PORT = 29500  # torchrun's and DeepSpeed's default master port
MAX_SECONDS = 86400.0  # --timeout and --wait: a day at most (sockets take no unbounded timeout)
VERSION_PACKAGES = ("hftrain", "torch", "deepspeed", "accelerate", "transformers")
_HELLO = "hftrain-doctor"


@dataclass
class DoctorSettings:
    """What the launch will be told.

    Args:
        hostfile: a DeepSpeed hostfile.
        master_addr: rendezvous address (default: ``MASTER_ADDR``, else the hostfile's first host).
        master_port: rendezvous port (default: ``MASTER_PORT``, else 29500).
        nnodes: machines in the job.
        node_rank: this machine's index (0 hosts the rendezvous).
        nproc_per_node: processes per machine.
        num_processes: processes in the whole job.
        timeout: seconds to wait for a TCP connection.
        wait: on the rendezvous machine, seconds to wait for the other machines' doctors (0: do not wait).
    """

    hostfile: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    nproc_per_node: int | None = None
    num_processes: int | None = None
    timeout: float = 5.0
    wait: float = 0.0

    def validate(self) -> DoctorSettings:
        """Refuse options no launch can have (one line naming the option and the fix); returns ``self``."""
        for name in ("nnodes", "nproc_per_node", "num_processes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name} {value}: must be a positive integer (processes or machines, at least 1)")
        rank = self.node_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"--node_rank {rank}: must be an integer >= 0 (0 is the machine hosting the rendezvous)")
        if rank is not None and self.nnodes is not None and rank >= self.nnodes:
            raise ConfigError(f"--node_rank {rank}: must be below --nnodes {self.nnodes} (0..{self.nnodes - 1})")
        port = self.master_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
            raise ConfigError(
                f"--master_port {port}: not a TCP port the launchers take (1-65535); give the port the launch will "
                f"use, e.g. --master_port {DEFAULT_PORT}"
            )
        for name, low, inclusive in (("timeout", 0.0, False), ("wait", 0.0, True)):
            value = getattr(self, name)
            number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
            if not math.isfinite(number) or number > MAX_SECONDS or number < low or (number == low and not inclusive):
                bound = ">= 0 (0: do not wait)" if inclusive else "> 0"
                shown = f"{value:g}" if isinstance(value, float) else value
                raise ConfigError(
                    f"--{name} {shown}: must be a finite number of seconds {bound} and at most {MAX_SECONDS:g}"
                )
        return self


@dataclass
class DoctorReport:
    """Check results, in order: ``(status, check, detail)`` with status ``ok``, ``FAIL`` or ``info``."""

    lines: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, status: str, check: str, detail: str) -> None:
        self.lines.append((status, check, detail))

    @property
    def failures(self) -> list[str]:
        return [f"{check}: {detail}" for status, check, detail in self.lines if status == "FAIL"]

    def render(self) -> str:
        return "\n".join(f"{status:<4}  {check}: {detail}" for status, check, detail in self.lines)


def versions() -> dict[str, str]:
    """Versions of the packages every machine must agree on."""
    import importlib.metadata

    import hftrain

    found = {"hftrain": hftrain.__version__}
    for name in VERSION_PACKAGES[1:]:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def run_doctor(settings: DoctorSettings, environ: dict[str, str] | None = None) -> DoctorReport:
    """Run every check and return the report (nothing is raised for a failed check).

    Args:
        settings: the launch settings to check (options no launch can have raise ``ConfigError`` first).
        environ: the environment (``MASTER_ADDR``/``MASTER_PORT`` and interface variables); ``os.environ``.
    """
    settings.validate()
    env = dict(os.environ if environ is None else environ)
    report = DoctorReport()
    hosts = _check_hostfile(settings, report)
    rendezvous = _rendezvous(settings, env, hosts, report)
    if settings.nnodes is None and hosts:
        settings = dataclasses.replace(settings, nnodes=len(hosts))  # the hostfile says how many machines
    backend = _check_backend(rendezvous, env, report, machines=settings.nnodes)
    mine = versions()
    report.add("info", "versions", ", ".join(f"{k} {v}" for k, v in mine.items()))
    if rendezvous is not None:
        _check_rendezvous(settings, rendezvous, mine, report)
    report.add("info", "backend", backend)
    return report


def _check_hostfile(settings: DoctorSettings, report: DoctorReport) -> list[HostEntry] | None:
    if settings.hostfile is None:
        return None
    try:
        hosts = parse_hostfile(settings.hostfile)
    except HFTrainError as error:
        report.add("FAIL", "hostfile", str(error))
        return None
    slots = sum(h.slots for h in hosts)
    listed = ", ".join(f"{h.host} slots={h.slots}" for h in hosts)
    report.add("ok", "hostfile", f"{settings.hostfile}: {len(hosts)} hosts, {slots} processes ({listed})")
    problems = []
    if settings.num_processes is not None and settings.num_processes != slots:
        problems.append(f"--num_processes {settings.num_processes} but the hostfile's slots add up to {slots}")
    if settings.nnodes is not None and settings.nnodes != len(hosts):
        problems.append(f"--nnodes {settings.nnodes} but the hostfile lists {len(hosts)} hosts")
    uneven = [h for h in hosts if settings.nproc_per_node not in (None, h.slots)]
    if uneven:
        problems.append(f"--nproc_per_node {settings.nproc_per_node} but {uneven[0].host} has slots={uneven[0].slots}")
    if settings.node_rank is not None and not 0 <= settings.node_rank < len(hosts):
        problems.append(f"--node_rank {settings.node_rank} is not in 0..{len(hosts) - 1}")
    for problem in problems:
        report.add("FAIL", "process count", f"{problem}; make the launcher settings match the hostfile")
    return hosts


def _rendezvous(
    settings: DoctorSettings, env: dict[str, str], hosts: list[HostEntry] | None, report: DoctorReport
) -> Rendezvous | None:
    addr = settings.master_addr or env.get("MASTER_ADDR") or (hosts[0].host if hosts else None)
    port = settings.master_port if settings.master_port is not None else env.get("MASTER_PORT")  # 0 stays 0
    port = port if port not in (None, "") else (DEFAULT_PORT if addr else None)
    try:
        return parse_rendezvous(addr, port, source="rendezvous (--master_addr/--master_port or MASTER_ADDR/PORT)")
    except HFTrainError as error:
        report.add("FAIL", "rendezvous", str(error))
        return None


def _check_backend(
    rendezvous: Rendezvous | None, env: dict[str, str], report: DoctorReport, *, machines: int | None
) -> str:
    from hftrain.strategies.platform import Platform

    backend = Platform.detect().backend
    if rendezvous is None:
        return backend
    variable = INTERFACE_VARIABLES[backend]
    try:
        interface, source = interface_for(rendezvous.addr)
    except HFTrainError as error:
        report.add("FAIL", "interface", str(error))
        return backend
    if is_loopback(interface, interface_addresses()):
        if machines and machines > 1:
            report.add("FAIL", "interface", f"{rendezvous} is loopback but the job spans {machines} machines; give "
                       "the main machine's address on the network the machines share")  # fmt: skip
        else:
            report.add("info", "interface", f"{rendezvous} is loopback: one machine only, no {variable} needed")
        return backend
    current = env.get(variable)
    if current and any(name not in interface_addresses() for name in current.split(",")):
        report.add("FAIL", "interface", f"{variable}={current} names an interface this machine does not have")
    elif current and interface not in current.split(","):
        report.add("FAIL", "interface", f"{variable}={current} but {rendezvous} is reached over {interface}")
    else:
        report.add("ok", "interface", f"{variable}={current or interface} ({source} reaches {rendezvous})")
    return backend


def _check_rendezvous(
    settings: DoctorSettings, rendezvous: Rendezvous, mine: dict[str, str], report: DoctorReport
) -> None:
    hosting = settings.node_rank == 0 if settings.node_rank is not None else is_local(rendezvous.addr)
    if hosting:
        _serve(settings, rendezvous, mine, report)
        return
    deadline = time.monotonic() + settings.timeout
    reason = check_connect(rendezvous, timeout=settings.timeout)
    while reason is not None and time.monotonic() < deadline:
        time.sleep(0.2)
        reason = check_connect(rendezvous, timeout=max(0.1, deadline - time.monotonic()))
    if reason is not None:
        report.add("FAIL", "rendezvous", f"{reason}; start the main machine's doctor (--wait) or check the address")
        return
    report.add("ok", "rendezvous", f"{rendezvous} reachable")
    theirs = _exchange(rendezvous, mine, settings.node_rank, timeout=settings.timeout)
    if theirs is None:
        report.add("info", "versions", f"not compared: the listener at {rendezvous} is not an hftrain doctor")
    else:
        _compare(mine, theirs, "the rendezvous machine", report)


def _serve(settings: DoctorSettings, rendezvous: Rendezvous, mine: dict[str, str], report: DoctorReport) -> None:
    """On the rendezvous machine: open the port, then answer the other machines' doctors for ``wait`` s."""
    family = socket.AF_INET6 if ":" in rendezvous.addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((rendezvous.addr, rendezvous.port))
            server.listen(16)
        except OSError as error:
            report.add("FAIL", "rendezvous", f"cannot listen on {rendezvous} ({error.strerror}); choose a free port")
            return
        reason = check_connect(rendezvous, timeout=settings.timeout)
        if reason is not None:
            report.add("FAIL", "rendezvous", f"this machine hosts {rendezvous} but {reason}")
            return
        report.add("ok", "rendezvous", f"this machine hosts {rendezvous}: port opened and reachable")
        if settings.wait > 0:
            _answer_peers(server, settings, mine, report)


def _answer_peers(server: socket.socket, settings: DoctorSettings, mine: dict[str, str], report: DoctorReport) -> None:
    expected = (settings.nnodes or 2) - 1
    seen: set[str] = set()
    deadline = time.monotonic() + settings.wait
    while len(seen) < expected and time.monotonic() < deadline:
        server.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            conn, (peer, *_) = server.accept()
        except TimeoutError:
            break
        with conn:
            message = _read_message(conn, settings.timeout)
            if message is None:
                continue  # a connectivity probe (our own, or a port scanner): nothing to compare
            conn.sendall((json.dumps({"hello": _HELLO, "versions": mine}) + "\n").encode())
        seen.add(str(message.get("node_rank", peer)))
        _compare(mine, message.get("versions", {}), f"node {message.get('node_rank', '?')} ({peer})", report)
    if len(seen) < expected:
        report.add(
            "FAIL",
            "machines",
            f"{len(seen)} of {expected} other machines' doctors reported within "
            f"{settings.wait:g} s; run hftrain doctor on every machine",
        )
    else:
        report.add("ok", "machines", f"all {expected} other machines reported")


def _exchange(rendezvous: Rendezvous, mine: dict[str, str], node_rank: int | None, *, timeout: float):
    try:
        with socket.create_connection((rendezvous.addr, rendezvous.port), timeout=timeout) as conn:
            hello = {"hello": _HELLO, "node_rank": node_rank, "versions": mine}
            conn.sendall((json.dumps(hello) + "\n").encode())
            return (_read_message(conn, timeout) or {}).get("versions")
    except OSError:
        return None


def _read_message(conn: socket.socket, timeout: float) -> dict | None:
    """One JSON line from a peer doctor, or None (closed, not JSON, not a doctor, oversized)."""
    conn.settimeout(timeout)
    data = b""
    try:
        while b"\n" not in data and len(data) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        message = json.loads(data.split(b"\n", 1)[0])
    except (OSError, ValueError):
        return None
    if not isinstance(message, dict) or message.get("hello") != _HELLO or not isinstance(message.get("versions"), dict):
        return None
    return message


def _compare(mine: dict[str, str], theirs: dict[str, str], who: str, report: DoctorReport) -> None:
    different = [f"{k} {theirs.get(k)} vs {v} here" for k, v in mine.items() if theirs.get(k) != v]
    if different:
        report.add("FAIL", "versions", f"{who} differs: {'; '.join(different)}; install the same versions everywhere")
    else:
        report.add("ok", "versions", f"{who} has the same versions")


def main_doctor(settings: DoctorSettings) -> int:
    """Print the report; exit code 0 when a launch can proceed, 1 with the reasons when it would fail."""
    report = run_doctor(settings)
    print(report.render())
    if report.failures:
        print(f"hftrain doctor: a launch would fail: {report.failures[0]}", flush=True)
        return 1
    print("hftrain doctor: no problem found")
    return 0


def settings_from_args(args: object) -> DoctorSettings:
    """The doctor settings from the parsed ``hftrain doctor`` arguments."""
    names = DoctorSettings.__dataclass_fields__
    return DoctorSettings(**{k: getattr(args, k) for k in names if getattr(args, k, None) is not None})


__all__ = ["DoctorReport", "DoctorSettings", "run_doctor", "main_doctor", "versions"]
