"""The one helper that starts real gloo processes for distributed tests.

Test bodies are plain module-level functions; ``run_distributed`` runs one in ``nprocs`` new processes with the
usual launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and returns each rank's result.

The processes are forked from a fork server (``multiprocessing``'s ``forkserver`` start method) that imported
torch, transformers, Accelerate, DeepSpeed, PEFT and hftrain once (:data:`PRELOAD`), in each test worker. A spawned
rank imported them itself: about 4 s of CPU per rank, and the suite starts several hundred ranks (measured with
``/proc`` child times: 4.2 s per spawned rank against 0.9 s without DeepSpeed's and the models' imports). A forked
rank is the server's copy: nothing is imported twice, and no state is shared (the server never runs a collective,
touches a thread pool or a process group; every rank still makes its own). What the server cannot know is the
launching test's state, so each rank is given it: the test's environment (``os.environ`` as the test set it, not as
it was when the server started) and working directory. ``HFTRAIN_TEST_START_METHOD=spawn`` starts every rank as a
fresh interpreter instead.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

_PORT_FLOOR = 20000  # below Linux's ephemeral range (ip_local_port_range starts at 32768)
_PORT_SLICE = 2000  # ports per pytest-xdist worker: six workers fit under 32768


def _port_sequence() -> Iterator[int]:
    """This test process's ports: its own slice of [20000, 32000), walked in order from a pid-chosen start."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = _PORT_FLOOR + (int(worker) % 6 if worker.isdigit() else 0) * _PORT_SLICE
    start = os.getpid() % _PORT_SLICE
    return (low + (start + step) % _PORT_SLICE for step in itertools.count())


_PORTS = _port_sequence()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, and that no other test worker or connection takes.

    The port is only checked here; the ranks bind it seconds later, after spawn has imported torch. A port the
    OS hands out (``bind(0)``) comes from the ephemeral range, which every gloo connection of the other
    pytest-xdist worker also draws from, so in that window it could be taken: EADDRINUSE in
    ``test_pp_zero1``'s rendezvous in a clean-clone two-worker run. Each worker therefore takes ports from its
    own slice below the ephemeral range, and walks it, so consecutive launches never reuse a port still in
    TIME_WAIT.
    """
    for _ in range(_PORT_SLICE):
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in this worker's slice of [{_PORT_FLOOR}, {_PORT_FLOOR + 6 * _PORT_SLICE})")


PRELOAD = ["torch", "transformers", "accelerate", "deepspeed", "peft", "hftrain.trainers", "hftrain.strategies"]
"""What the fork server imports once (a module that fails to import is skipped by ``multiprocessing``, and then
imported by each rank that needs it)."""
mp.set_forkserver_preload(PRELOAD)


def _start_method() -> str:
    return os.environ.get("HFTRAIN_TEST_START_METHOD", "forkserver")


def _worker(
    rank: int, fn: Callable[..., Any], kwargs: dict, nprocs: int, port: int, out_dir: str, env: dict, cwd: str
) -> None:
    os.environ.clear()  # the launching test's environment, not the fork server's
    os.environ.update(env)
    os.chdir(cwd)
    tempfile.tempdir = None  # re-read TMPDIR
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    result = fn(**kwargs)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    _leave()


def _leave() -> None:
    """End the process once its result is written, without the interpreter's teardown.

    Test bodies leave trainers, wrapped models and the process group alive for inspection (``Trainer.close()``,
    which a real job calls, is not run). At interpreter exit gloo's threads could then be destroyed while still
    joinable, and a rank that had finished and written its result aborted with "terminate called without an
    active exception" (gloo work still holding tensors when the interpreter is finalised, pytorch PR #179291; the
    failure ``Trainer.close()`` orders its teardown against; seen in ``test_fsdp.py``'s module fixture in a
    clean-clone ``.ci/run``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable[..., Any], nprocs: int = 2, *, timeout: float = 600, **kwargs: Any) -> list[Any]:
    """Run ``fn(**kwargs)`` in ``nprocs`` processes (forked from the fork server, gloo-ready) and return their
    results by rank.

    Args:
        fn: a module-level function (pickled by name).
        nprocs: number of processes.
        timeout: seconds before all processes are killed and the test fails.
        kwargs: passed to ``fn`` in every process.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker,
            args=(fn, kwargs, nprocs, free_port(), out_dir, dict(os.environ), os.getcwd()),
            nprocs=nprocs,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s on {nprocs} processes")
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(nprocs)]
