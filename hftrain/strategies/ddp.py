"""DDP: every process holds the whole model; gradients are all-reduced after backward.

Also the strategy of a single-process run (Accelerate then wraps nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hftrain.strategies.base import Strategy

if TYPE_CHECKING:
    from hftrain.config import TrainingConfig


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` through Accelerate (``MULTI_GPU`` / ``MULTI_CPU``)."""

    name = "ddp"
    reshardable_checkpoints = True  # every rank holds the full model and optimizer state

    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        # On CPU, cpu=True is what makes Accelerate pick MULTI_CPU (gloo) instead of silently running NO.
        return {"cpu": self.platform.is_cpu}
