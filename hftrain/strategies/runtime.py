"""The runtime: every distributed operation the Trainer performs, owned by the strategy.

This is the one extension of the strategy interface (``Strategy.build_runtime``). The Trainer asks the runtime,
never the ``Accelerator`` and never the strategy's name, to wrap the model and shard the data, to run one
micro-batch's forward and backward, to clip, reduce and gather, and to save, load and export state.

``AccelerateRuntime`` (the default) delegates each operation to Accelerate, exactly as the Trainer did before, so
DDP, FSDP and ZeRO keep going through Accelerate unchanged. A strategy that Accelerate cannot run (hftrain's
Megatron-style tensor and pipeline parallelism) subclasses it and overrides what it owns:

==========================  ====================================================================================
``prepare``                 wrap the model, shard the loaders (by data-parallel rank), wrap the optimizer
``forward_backward``        one micro-batch's loss and gradients (a pipeline runs its micro-batch schedule here)
``evaluation_step``         one evaluation batch's per-example outputs, gathered so each example counts once
``clip_grad_norm_``         the global gradient norm, each parameter counted once however it is split
``reduce_mean``/``any_rank``  scalars over the data-parallel replicas
``save_state``/``load_state``  the checkpoint's ``state/`` folder (the manager adds staging, checksums, rotation)
``get_state_dict``          the full, unsharded state dict for ``save_pretrained`` (collective)
==========================  ====================================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

Batch = dict[str, "torch.Tensor"]


class AccelerateRuntime:
    """The Trainer's distributed operations done by Accelerate (DDP, FSDP1/2, DeepSpeed ZeRO).

    Besides the operations above it exposes the few ``Accelerator`` facts the Trainer, the checkpoint manager and
    the export read (``is_main_process``, ``wait_for_everyone``, ``device``, ``mixed_precision``...), so those
    take a runtime wherever they took an accelerator.

    Args:
        accelerator: the run's accelerator (also the trainer's trackers).
        before_load_state: run on the live model and optimizer before a load (FSDP1's optimizer template).
        plain_model_context: the context a plain, unsharded model is built in (the export's reload): the
            strategy's model-construction context (ZeRO-3 keeps transformers out of ``deepspeed.zero.Init``).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        before_load_state: Callable[[Any, Any], None] | None = None,
        plain_model_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self._before_load_state = before_load_state
        self._plain_model_context = plain_model_context or contextlib.nullcontext

    def plain_model_context(self) -> contextlib.AbstractContextManager:
        """The context in which a plain model is built and loaded while this run's strategy is live."""
        return self._plain_model_context()

    def build_model(self, model_init: Callable[[], Any]) -> Any:
        """The run's model, built by ``model_init`` in the strategy's construction context (every rank whole;
        a pipeline runtime leaves other stages' layers unbuilt)."""
        with self.plain_model_context():
            return model_init()

    def apply_recomputation(self, model: Any, mode: str) -> str:
        """Recompute ``model``'s activations in the backward pass (``hftrain.parallel.recompute``), before
        ``prepare``: transformers' layer hook checkpoints inside whatever unit FSDP or ZeRO-3 later shards. Returns
        the line to log.

        Args:
            model: the freshly built model.
            mode: ``"full"`` or ``"selective"``.
        """
        from hftrain.parallel.recompute import apply_activation_checkpointing

        count = apply_activation_checkpointing(model, mode)
        return f"gradient_checkpointing: {mode} ({count} {'layers' if mode == 'full' else 'attention functions'})"

    # ----------------------------------------------------------------- facts
    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: processes that see different examples (all of them under DDP/FSDP/ZeRO)."""
        return self.accelerator.num_processes

    @property
    def pad_to_multiple_of(self) -> int | None:
        """The multiple every batch's sequence length must be padded to (None: any length will do)."""
        return None

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.accelerator.is_local_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def mixed_precision(self) -> str:
        return self.accelerator.mixed_precision

    @property
    def state(self) -> Any:
        """Accelerate's state (the export reads its DeepSpeed plugin)."""
        return self.accelerator.state

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch closes the accumulation window (an optimizer step happens)."""
        return self.accelerator.sync_gradients

    def wait_for_everyone(self) -> None:
        self.accelerator.wait_for_everyone()

    # ----------------------------------------------------------------- setup
    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: torch.utils.data.DataLoader,
        eval_loader: torch.utils.data.DataLoader | None,
    ) -> tuple[torch.nn.Module, Any, Any, Any]:
        """Wrap model and optimizer and shard the loaders; returns them in the same order.

        Args:
            model: the freshly built model (identical on every rank).
            optimizer: its optimizer.
            train_loader: the full training loader (every rank builds the same).
            eval_loader: the full evaluation loader, or None.
        """
        model, optimizer, train_loader = self.accelerator.prepare(model, optimizer, train_loader)
        eval_loader = self.accelerator.prepare(eval_loader) if eval_loader is not None else None
        return model, optimizer, train_loader, eval_loader

    def register_for_checkpointing(self, obj: Any) -> None:
        """Save and restore ``obj`` (the LR scheduler) with the checkpoint's state."""
        self.accelerator.register_for_checkpointing(obj)

    # ----------------------------------------------------------------- one step
    def accumulate(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The context of one micro-batch: decides ``sync_gradients`` and skips the gradient sync inside a window."""
        return self.accelerator.accumulate(model)

    def forward_backward(
        self, model: torch.nn.Module, batch: Batch, loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward one micro-batch; returns its mean loss, detached.

        Args:
            model: the prepared model.
            batch: one micro-batch of this process.
            loss_fn: the task's loss, ``loss_fn(model, batch) -> scalar``.
        """
        loss = loss_fn(model, batch)
        # backward() divides the loss by gradient_accumulation_steps.
        self.accelerator.backward(loss)
        return loss.detach()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm of ``model`` to ``max_norm``; returns the norm before clipping."""
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def evaluation_step(
        self,
        model: torch.nn.Module,
        batch: Batch,
        predict: Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...]:
        """Per-example outputs of one evaluation batch, gathered over the data-parallel ranks.

        Args:
            model: the prepared model (in eval mode).
            batch: this process's evaluation batch.
            predict: the task's ``prediction_step(model, batch)``.
        """
        # gather_for_metrics drops the duplicates Accelerate adds to even out the last batch
        # (pitfall "eval skewed by padding duplicates", docs/pitfalls.md).
        return self.accelerator.gather_for_metrics(predict(model, batch))

    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the data-parallel replicas (the logged loss)."""
        return self.accelerator.reduce(tensor, reduction="mean")

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """Accelerate's world-wide reduction (the checkpoint manager's ``any_rank`` agreement calls it).

        Args:
            tensor: this rank's tensor.
            reduction: ``"sum"`` or ``"mean"``.
        """
        return self.accelerator.reduce(tensor, reduction=reduction)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (one all-reduce; free in one process)."""
        import torch

        if self.num_processes == 1:
            return flag
        return self.accelerator.reduce(torch.tensor([float(flag)]), reduction="sum").item() > 0

    def skip_first_batches(self, loader: Any, num_batches: int) -> Any:
        """``loader`` without its first ``num_batches`` batches, skipped at the sampler level.

        Pitfall "slow batch skipping on resume", docs/pitfalls.md.
        """
        return self.accelerator.skip_first_batches(loader, num_batches)

    # ----------------------------------------------------------------- state
    def save_state(self, directory: str, *, safe_serialization: bool = True) -> None:
        """Write model, optimizer, scheduler and per-rank RNG into ``directory`` (collective)."""
        self.accelerator.save_state(directory, safe_serialization=safe_serialization)

    def load_state(self, directory: str, *, model: torch.nn.Module, optimizer: Any) -> None:
        """Restore what ``save_state`` wrote into the live (prepared) model, optimizer and scheduler.

        Args:
            directory: a checkpoint's ``state/`` folder.
            model: the prepared model.
            optimizer: the prepared optimizer.
        """
        if self._before_load_state is not None:
            self._before_load_state(model, getattr(optimizer, "optimizer", optimizer))
        self.accelerator.load_state(directory)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict with the model's own names (collective; the main process holds it)."""
        if self.accelerator.distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU"):
            return self.unwrap_model(model).state_dict()  # every rank holds it whole (Accelerate's own branch)
        return self.accelerator.get_state_dict(model)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model inside the strategy's wrappers."""
        import sys

        if "deepspeed" not in sys.modules:
            # Accelerate's unwrap imports DeepSpeed whenever it is installed (1-2 s and its "Setting accelerator to
            # CPU" warning); without it imported, no DeepSpeed engine can wrap the model, and the wrappers left are
            # DDP's and FSDP1's (FSDP2 keeps the module itself; a compiled module is kept, as Accelerate keeps it).
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.nn.parallel import DistributedDataParallel

            while isinstance(model, DistributedDataParallel | FullyShardedDataParallel):
                model = model.module
            return model
        return self.accelerator.unwrap_model(model)
