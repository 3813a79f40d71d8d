"""Conditions that stop a run as soon as they appear, before it writes anything worse than what it has."""

from __future__ import annotations

import math
from pathlib import Path

from hftrain.errors import HFTrainError


class NonFiniteLossError(HFTrainError):
    """The training loss became inf or NaN: every later step (and checkpoint) would be worthless."""


def check_finite_loss(loss: float, *, step: int, last_checkpoint: Path | None) -> None:
    """Stop at the first optimizer step whose logged loss is not finite, writing no checkpoint for it.

    The loss is the one already reduced over processes, so every rank sees the same value and stops together.

    Args:
        loss: the step's loss, averaged over the accumulation window and the processes.
        step: the optimizer step it belongs to.
        last_checkpoint: the last complete checkpoint (left as it is), for the message.
    """
    if math.isfinite(loss):
        return
    kept = f"the last complete checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written"
    raise NonFiniteLossError(
        f"training loss is {loss} at step {step}; stopped there without writing a checkpoint or export, {kept}; "
        "lower training.learning_rate or max_grad_norm, raise warmup_steps, or check the data"
    )
