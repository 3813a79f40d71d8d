"""Conditions that stop a run as soon as they appear, before it writes anything worse than what it has."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hftrain.errors import HFTrainError


class NonFiniteLossError(HFTrainError):
    """The training loss became inf or NaN: every later step (and checkpoint) would be worthless."""


def check_finite_loss(loss: float, *, step: int, last_checkpoint: Path | None, read_at: int | None = None) -> None:
    """Stop when a logged loss is not finite, writing no checkpoint for its step or any later one.

    The loss is the one already reduced over processes, so every rank sees the same value and stops together. The
    trainer reads its losses once per logging window (and before every evaluation and checkpoint), so the run stops
    at the window's read, up to ``logging_steps - 1`` steps after the step that went wrong, none of them saved.

    Args:
        loss: the step's loss, averaged over the accumulation window and the processes.
        step: the optimizer step it belongs to.
        last_checkpoint: the last complete checkpoint (left as it is), for the message.
        read_at: the step at which it was read, when later than ``step``.
    """
    if math.isfinite(loss):
        return
    kept = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
    late = read_at is not None and read_at > step
    where = f"at step {step}" + (f", read {read_at - step} step(s) later with its logging window" if late else "")
    raise NonFiniteLossError(
        f"training loss is {loss} {where}; stopped there without writing a checkpoint or export, {kept}; "
        "lower training.learning_rate or max_grad_norm, raise warmup_steps, or check the data"
    )


class StopVote:
    """The ranks' agreement to stop (a preemption signal on any rank), one optimizer step late, without waiting.

    At the end of every step each rank starts an all-reduce (max) of its flag over the host group
    (``parallel.host.host_group``, gloo, ``async_op=True``) and reads the one it started at the end of the previous
    step, which the step in between has had time to complete. Every rank reads the same reduced value at the same step
    boundary, so all of them stop, and checkpoint, at that boundary: one step after the first signal instead of right
    after it, and no rank waits for the others at any step. One process reads its own flag at once (no collective).
    :meth:`settle` waits for the vote in flight and agrees on the current flag at once (a run's last step, whose stop
    decides whether the final evaluation and export run).

    Args:
        processes: the run's processes (1: no collective).
    """

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._flag: Any = None  # the CPU tensor of the vote in flight
        self._work: Any = None

    def poll(self, flag: bool) -> bool:
        """Whether any rank had a flag at the previous call (its vote read now); starts this call's vote."""
        if self.processes == 1:
            return flag
        agreed = self._read()
        if agreed:  # every rank stops here alike: no vote left in flight
            return True
        import torch
        import torch.distributed as dist

        from hftrain.parallel.host import host_group

        self._flag = torch.tensor([float(flag)])
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=host_group(), async_op=True)
        return agreed

    def settle(self, flag: bool) -> bool:
        """Whether any rank has a flag now or had one at the previous :meth:`poll` (blocking; collective)."""
        if self.processes == 1:
            return flag
        from hftrain.parallel.host import any_rank

        return self._read() | any_rank(flag)

    def _read(self) -> bool:
        if self._work is None:
            return False
        self._work.wait()
        # host memory of the gloo group by construction: reading it waits for no device (numpy: not counted as a
        # device read by hftrain.metrics.syncs, which cannot tell it from one on a CPU run)
        agreed = bool(self._flag.numpy()[0] > 0)
        self._flag = self._work = None
        return agreed
