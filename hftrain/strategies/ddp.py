"""DDP: every process holds the whole model; gradients are all-reduced after backward.

Also the strategy of a single-process run (Accelerate then wraps nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hftrain.strategies.base import Strategy
from hftrain.strategies.loading import replica_loading
from hftrain.strategies.runtime import AccelerateRuntime

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hftrain.config import TrainingConfig
    from hftrain.models.weights import BlockLoading
    from hftrain.strategies.platform import HeapWarmer
    from hftrain.strategies.runtime import RuntimeTask


class DDPStrategy(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` through Accelerate (``MULTI_GPU`` / ``MULTI_CPU``)."""

    name = "ddp"

    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        # On CPU, cpu=True is what makes Accelerate pick MULTI_CPU (gloo) instead of silently running NO.
        return {"cpu": self.platform.is_cpu}

    def build_runtime(self, accelerator: Accelerator, task: RuntimeTask) -> DDPRuntime:
        return DDPRuntime(accelerator, **self.runtime_hooks(task))

    def block_loading(self, accelerator: Accelerator) -> BlockLoading | None:
        # DDP's construction broadcasts rank 0's parameters to every other rank: they need the memory, not the reads
        return replica_loading("DDP", accelerator)

    def warm_heap(self, nbytes: int) -> HeapWarmer | None:
        # every process creates all the gradients and optimizer moments in its own host memory (on a CPU)
        return self.platform.warm_heap(nbytes)


class DDPRuntime(AccelerateRuntime):
    """Accelerate's DDP operations, with the gradient clipping folded into a fused AdamW step.

    ``torch.nn.utils.clip_grad_norm_`` reads every gradient for the norm and then rewrites every gradient,
    ``g <- g * c`` with ``c = min(1, max_norm / (||g|| + 1e-6))``; the fused AdamW step then reads them again. A
    fused torch optimizer takes a ``grad_scale`` ``s`` and divides each gradient by it inside its one pass (the
    protocol ``torch.amp.GradScaler`` uses), so :meth:`clip_grad_norm_` only computes the norm (torch's own
    ``get_total_norm``) and hands the optimizer ``s = 1 / c``: one pass over 22.7M gradients fewer per MiniLM
    step (the default job's steps 2.7% faster end to end on CPU). The result is the clipped step up to rounding
    (``g / (1/c)`` against ``g * c``; exact when nothing is clipped). Without a fused optimizer, or under fp16's
    GradScaler (which sets ``grad_scale`` itself), clipping is Accelerate's.
    """

    def __init__(self, accelerator: Accelerator, **hooks: Any) -> None:
        super().__init__(accelerator, **hooks)
        self._folds_into: torch.optim.Optimizer | None = None

    def build_model(self, model_init: Callable[[], Any]) -> Any:
        """The whole model (see the base), its trained parameters copied out of the weights file's memory map.

        transformers loads safetensors weights as views of the file, mapped copy-on-write: the first optimizer step
        then writes every page of every trained parameter one page fault and one 4-KiB copy at a time (0.27 s of
        the default job's first step, 22.7M parameters, against 0.015 s for the next steps). One copy per parameter
        here, at memory speed (0.024 s), makes the same private memory the first step would have made (blocks read
        into the process's memory, ``hftrain.strategies.loading.ReadLoading``, are its own already); frozen
        parameters (LoRA's base model) stay mapped. Only where each process trains the whole model in host memory: a
        sharded strategy copies the parameters into its own buffers anyway, and a GPU run's ``prepare`` copies them
        to the device straight from the map (a host copy first would only cost host memory).
        """
        model = super().build_model(model_init)
        if self.device.type != "cpu":
            return model
        with torch.no_grad():
            for param in model.parameters():
                # a mapped file's storage is not resizable; memory of the process's own (read blocks) is
                if param.requires_grad and not param.untyped_storage().resizable():
                    param.data = param.data.clone()
        return model

    def evaluation_context(self) -> contextlib.AbstractContextManager:
        """Accelerate's autocast around the whole evaluation, so that each weight is cast to bf16/fp16 once.

        The prepared model's forward enters autocast itself, and autocast drops the casts of the weights it cached
        when its outermost context exits: at every batch, an evaluation of 20 batches cast every linear weight 20
        times. Inside one outer context the casts are kept until the evaluation ends (the weights do not change
        during it; a copy of the weights in 16 bits, which every training step's forward holds too). Only where each
        process holds whole parameters: a sharded strategy gathers them for each forward, and a cache would keep
        them all gathered.
        """
        return self.accelerator.autocast()

    def prepare(self, *components: Any) -> tuple[torch.nn.Module, Any, Any, Any]:
        """Accelerate's preparation (see the base); then the fused optimizer, if any, takes the clipping."""
        prepared = super().prepare(*components)
        inner = getattr(prepared[1], "optimizer", prepared[1])
        if getattr(inner, "_step_supports_amp_scaling", False) and self.accelerator.scaler is None:
            self._folds_into = inner
            inner.register_step_post_hook(_drop_grad_scale)
        return prepared

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm; the next optimizer step applies the clipping (see the class)."""
        if self._folds_into is None:
            return super().clip_grad_norm_(model, max_norm)
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._folds_into.grad_scale = coefficient.reciprocal().to(torch.float32)
        return total


def _drop_grad_scale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After each step: the scale was that step's, never the next one's."""
    optimizer.__dict__.pop("grad_scale", None)
