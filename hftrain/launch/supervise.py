"""A launched job ends as its ranks ended: ``hftrain launch`` is torchrun whose exit code is the ranks' own (75 after
a preemption, 2 after a bad input), workers die with their agent, and Ctrl-C is one line.

torchrun reports any worker failure as exit code 1 with a traceback (``ChildFailedError``), and a signal to the
agent as another traceback (``SignalException``), so a requeue script waiting for 75 (``EX_TEMPFAIL``,
``hftrain.checkpoint.preemption``) never sees it. It handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by sending the same
signal to its workers and killing them 30 s later; SIGUSR1 (Slurm's ``--signal``) kills the agent itself and leaves
its workers running unsupervised. ``hftrain launch`` runs torchrun's own launcher (``torch.distributed.run``, in this
process) with SIGUSR1 among the handled signals and a shutdown grace long enough for a checkpoint
(``SHUTDOWN_GRACE_S``, unless the command sets one), then maps the outcome:

- every worker exited 0: 0;
- the workers exited with one code (75 preempted, 2 bad input, 130 interrupted): that code, with one line (none
  after 2, or after 130 when the main process printed its own "interrupted" line: Ctrl-C is one line);
- a signal stopped the agent: each worker records its exit code in ``$HFTRAIN_LAUNCH_STATUS_DIR`` as it exits
  (torchrun's exception carries none), and the same rule applies; ranks that recorded nothing leave the signal's
  status, ``128 + signal``;
- otherwise the first failed rank's code, with one line naming it (its own output is above).

A worker started by any agent (torchrun, ``accelerate launch``, ``deepspeed``) asks the kernel for SIGTERM when
its parent dies (``PR_SET_PDEATHSIG``, :func:`die_with_parent`): the preemption path then checkpoints and exits,
instead of a rank training on with no agent to stop it. Written by hand: torchrun offers neither the exit-code rule
nor a parent-death signal. Pitfall "preemption exit code lost by the launcher", docs/pitfalls.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hftrain.errors import UsageError

STATUS_DIR_ENV = "HFTRAIN_LAUNCH_STATUS_DIR"
"""The folder where each worker of ``hftrain launch`` records its exit code (``rank_<RANK>``)."""
SHUTDOWN_GRACE_S = 300
"""Seconds torchrun waits for signalled workers to checkpoint and exit before it kills them (its default is 30)."""
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C (128 + SIGINT), as a shell reports it."""
_PR_SET_PDEATHSIG = 1


def launched(environ: Mapping[str, str]) -> bool:
    """Whether this process is a worker an agent started (torchrun, ``accelerate launch``, ``deepspeed``).

    Args:
        environ: the process environment.
    """
    return "LOCAL_RANK" in environ and ("TORCHELASTIC_RUN_ID" in environ or "WORLD_SIZE" in environ)


def die_with_parent(environ: Mapping[str, str]) -> bool:
    """Under an agent, have the kernel send SIGTERM to this process when the agent dies (Linux); True if set.

    SIGTERM, not SIGKILL: hftrain's preemption handler turns it into a checkpoint at the next step boundary and
    exit 75. An agent already gone before the request (the parent is now init or a subreaper) sends it now.

    Args:
        environ: the process environment.
    """
    if not launched(environ) or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def record_exit(code: int, environ: Mapping[str, str]) -> None:
    """A worker of ``hftrain launch``: record this rank's exit code for the launcher (nothing otherwise), and
    whether it is the process that prints the command's one line (:func:`reports_errors`).

    Args:
        code: the exit code the process returns.
        environ: the process environment.
    """
    folder = environ.get(STATUS_DIR_ENV)
    rank = environ.get("RANK", "").strip()
    if not folder or not rank.isdigit():
        return
    with contextlib.suppress(OSError):
        from hftrain.files import write_file

        write_file(Path(folder) / f"rank_{int(rank)}", f"{code} {int(reports_errors(environ))}\n")


def reports_errors(environ: Mapping[str, str]) -> bool:
    """Whether this process prints a bad input's line: the main process of its machine, or no launcher at all.

    The launcher's ``LOCAL_RANK`` (else ``RANK``) says which process that is; a value that is not a rank (unset,
    malformed) prints, so an error is never lost. One line per machine, not one per job: an input that is bad on
    one machine only (a file missing there) is still reported on that machine.

    Args:
        environ: the process environment.
    """
    rank = environ.get("LOCAL_RANK", environ.get("RANK", "0")).strip()
    return not (rank.isascii() and rank.isdigit() and int(rank) > 0)


def launch_main(argv: list[str]) -> int:
    """``hftrain launch [torchrun options] -- [hftrain command and arguments]``: run them under torchrun, and exit
    with the ranks' own code (see the module docstring).

    Args:
        argv: the arguments after ``launch``.
    """
    if "--" not in argv:
        raise UsageError(
            "hftrain launch: separate torchrun's options from hftrain's command with --, e.g. "
            "hftrain launch --nproc_per_node 2 -- train --config job.yaml"
        )
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    if not command:
        raise UsageError("hftrain launch: no hftrain command after --; e.g. -- train --config job.yaml")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        args = parse_args([*options, "--module", "hftrain", *command])
    except SystemExit:  # torchrun's parser printed its usage line: one more line names the fix
        raise UsageError("hftrain launch: torchrun refused the options before --; see torchrun --help") from None
    if "PET_SIGNALS_TO_HANDLE" not in os.environ and not _given(options, "signals"):
        args.signals_to_handle = HANDLED_SIGNALS
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = SHUTDOWN_GRACE_S
    with tempfile.TemporaryDirectory(prefix="hftrain-launch-") as status_dir:
        os.environ[STATUS_DIR_ENV] = status_dir
        try:
            run(args)
        except ChildFailedError as failed:
            codes = {rank: failure.exitcode for rank, failure in failed.failures.items()}
            return _outcome(codes, _recorded(Path(status_dir))[1])
        except SignalException as stopped:
            return _outcome(*_recorded(Path(status_dir)), signalled=stopped.sigval)
        finally:
            os.environ.pop(STATUS_DIR_ENV, None)
    return 0


def _given(options: list[str], word: str) -> bool:
    return any(option.lstrip("-").replace("-", "_").startswith(f"{word}_to_handle") for option in options)


def _recorded(folder: Path) -> tuple[dict[int, int], set[int]]:
    """What the workers recorded (:func:`record_exit`): each rank's exit code, and the ranks that print the
    command's line."""
    codes, reporters = {}, set()
    for entry in folder.glob("rank_*"):
        with contextlib.suppress(ValueError, OSError):
            rank = int(entry.name.removeprefix("rank_"))
            code, *said = entry.read_text().split()
            codes[rank] = int(code)
            if said == ["1"]:
                reporters.add(rank)
    return codes, reporters


def _outcome(codes: dict[int, int], reporters: set[int], signalled: signal.Signals | None = None) -> int:
    """The exit code and line of a launch that did not end with every worker at 0.

    Args:
        codes: each worker's exit code (rank -> code); the ranks that recorded none are left out.
        reporters: the ranks that print the command's line (the main process of this machine), as recorded.
        signalled: the signal that stopped the agent, if one did.
    """
    from hftrain.checkpoint.preemption import PREEMPTED_EXIT_CODE

    failed = {rank: code for rank, code in codes.items() if code != 0}
    what = f"torchrun was sent {signal.Signals(signalled).name}; " if signalled is not None else ""
    if failed and len(set(failed.values())) == 1:
        code = next(iter(failed.values()))
        if code == PREEMPTED_EXIT_CODE:
            _say(
                f"{what}preempted: the ranks saved a checkpoint and exited {code}; run the same command with "
                "--resume_from_checkpoint auto to continue"
            )
        elif code == INTERRUPTED_EXIT_CODE and not reporters & failed.keys():
            # no main process printed its "interrupted" line (Ctrl-C is one line: when it did, that line is it)
            _say(f"{what}interrupted: the ranks stopped (exit code {code})")
        # 2: the main rank printed the bad input's line already
        return code
    if failed:
        rank = min(failed)
        _say(f"{what}rank {rank} exited with code {failed[rank]} (its output is above); exit codes {failed}")
        return failed[rank]
    if signalled is not None:
        if signalled == signal.SIGINT:
            _say("interrupted (Ctrl-C)")
            return INTERRUPTED_EXIT_CODE
        _say(f"{what}the workers were stopped before they recorded an exit code")
        return 128 + int(signalled)
    return 1


def _say(line: str) -> None:
    print(f"hftrain launch: {line}", file=sys.stderr, flush=True)
