"""Preemption: a signal only sets a flag; the loop checkpoints collectively at the next step boundary.

Doing the save inside the handler would run collectives and file I/O from an arbitrary point of the
program (pitfall "preemption work done in the signal handler", docs/pitfalls.md). SIGTERM is what schedulers and
``kill`` send; Slurm sends SIGUSR1 ahead of a time limit when asked (``#SBATCH --signal=USR1@120``).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run that stopped on a signal after writing its checkpoint (EX_TEMPFAIL: run it again)."""

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    """Records that a preemption signal arrived; install in the main thread of every rank.

    Args:
        signals: the signals that request a checkpoint-and-exit.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> PreemptionFlag:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.received is not None
