"""Two simulated machines on one host: network namespaces joined by a veth pair on a private /30.

Traffic goes only between the two namespaces. Each namespace has only its loopback and its end of the veth,
so a process there reaches the other "machine" only over the veth, as across a real network. The test
removes both namespaces (and anything still running in them) when it is done, also on failure.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Node:
    """One simulated machine: its namespace, interface and address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def two_nodes() -> Iterator[tuple[Node, Node] | str]:
    """Yield two nodes, or a string saying why they cannot be created (the caller skips with it)."""
    tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
    nodes = (Node(f"hft{tag}a", f"hfv{tag}a", f"{subnet}.1"), Node(f"hft{tag}b", f"hfv{tag}b", f"{subnet}.2"))
    try:
        made = _ip("netns", "add", nodes[0].namespace)
    except FileNotFoundError:
        yield "the 'ip' command is not installed"
        return
    if made.returncode != 0:
        yield f"cannot create network namespaces here ({made.stderr.strip()}); run as root"
        return
    try:
        steps = [
            ("netns", "add", nodes[1].namespace),
            ("link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface),
        ]
        for node in nodes:
            steps += [
                ("link", "set", node.interface, "netns", node.namespace),
                ("-n", node.namespace, "addr", "add", f"{node.address}/30", "dev", node.interface),
                ("-n", node.namespace, "link", "set", node.interface, "up"),
                ("-n", node.namespace, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
        yield nodes
    finally:
        for node in nodes:
            _kill_namespace_processes(node.namespace)
            _ip("netns", "del", node.namespace)


def _kill_namespace_processes(namespace: str) -> None:
    pids = _ip("netns", "pids", namespace).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process we started and all its descendants."""
    import psutil

    try:
        parent = psutil.Process(process.pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass


def run_on_nodes(commands: list[list[str]], logs: list[Path], *, env: dict, timeout: float = 400) -> list[int]:
    """Start one command per node at once, wait for all; returns their exit codes (logs hold the output).

    Args:
        commands: full command lines (already wrapped in ``ip netns exec``).
        logs: a log file per command (stdout and stderr).
        env: the environment of every command.
        timeout: seconds before everything is killed and the test fails.
    """
    processes = []
    for command, log in zip(commands, logs, strict=True):
        with log.open("w") as handle:
            processes.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for process in processes:
            kill_tree(process)
        tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in logs)
        raise TimeoutError(f"launch did not finish in {timeout} s\n{tails}") from None
    return [p.returncode for p in processes]
