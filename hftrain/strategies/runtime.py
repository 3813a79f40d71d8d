"""The runtime: every distributed operation the Trainer performs, owned by the strategy.

This is the one extension of the strategy interface (``Strategy.build_runtime``). The Trainer asks the runtime,
never the ``Accelerator`` and never the strategy's name, to wrap the model and shard the data, to run one
micro-batch's forward and backward, to clip, reduce and gather, and to save, load and export state.

``AccelerateRuntime`` (the default) delegates each operation to Accelerate, exactly as the Trainer did before, so
DDP, FSDP and ZeRO keep going through Accelerate unchanged. A strategy that Accelerate cannot run (hftrain's
Megatron-style tensor and pipeline parallelism) subclasses it and overrides what it owns:

============================  ====================================================================================
``prepare``                   wrap the model, shard the loaders (by data-parallel rank), wrap the optimizer
``forward_backward``          one micro-batch's loss and gradients (a pipeline runs its micro-batch schedule here)
``evaluation_step``           one evaluation batch's per-example outputs, gathered so each example counts once
``clip_grad_norm_``           the global gradient norm, each parameter counted once however it is split
``reduce_mean``/``any_rank``  scalars over the data-parallel replicas
``save_extras``/``snapshot``  a checkpoint's state: this rank's shards (the manager writes, checksums, rotates)
``load_state``                a checkpoint's state back, from any strategy and process count
``get_state_dict``            the full, unsharded state dict for ``save_pretrained`` (collective)
============================  ====================================================================================

The whole public interface, each member with what it does, is ``docs/architecture.md``'s runtime table (a test
checks the two agree).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from hftrain.checkpoint.sharded import Chunked, Snapshot
    from hftrain.models.weights import BlockLoading

Batch = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class RuntimeTask:
    """What a runtime knows of the task from its construction on (``Strategy.build_runtime``), before any model.

    Args:
        head: the task's head (the Trainer's ``stage_head``: a kind of ``hftrain.parallel.heads.HEADS``, which the
            family builds, or a task's own ``StageHead``): read by a strategy that cuts the model into pipeline
            stages or splits the sequence.
        loss_is_example_mean: the task's loss is its micro-batch's mean over examples (a classifier's): a pipeline
            weights each of its micro-batches' losses by its share of the examples then, and adds them as they are
            otherwise (a per-token loss already scaled to the global batch).
    """

    head: Any = "sequence_classification"
    loss_is_example_mean: bool = True


class AccelerateRuntime:
    """The Trainer's distributed operations done by Accelerate (DDP, FSDP1/2, DeepSpeed ZeRO).

    Besides the operations above it exposes the few ``Accelerator`` facts the Trainer, the checkpoint manager and
    the export read (``is_main_process``, ``wait_for_everyone``, ``device``, ``mixed_precision``...), so those
    take a runtime wherever they took an accelerator.

    Args:
        accelerator: the run's accelerator (also the trainer's trackers).
        task: what the runtime knows of the task (its head, how its loss adds up); the default: a sequence
            classifier's.
        plain_model_context: the context a plain, unsharded model is built in (the export's reload): the
            strategy's model-construction context (ZeRO-3 keeps transformers out of ``deepspeed.zero.Init``).
        block_loading: the strategy's way to hold a pretrained model's blocks as it loads them, given the
            accelerator (``Strategy.block_loading``); None, or None returned: every rank loads the whole model.
    """

    clip_returns_this_steps_norm = True
    """Whether :meth:`clip_grad_norm_` returns the norm of the gradients it clips (the Trainer logs it as
    ``train/grad_norm``); not under DeepSpeed, where Accelerate returns the engine's norm of the previous step."""

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        task: RuntimeTask = RuntimeTask(),
        plain_model_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        block_loading: Callable[[Accelerator], BlockLoading | None] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.stage_head = task.head
        self.loss_is_example_mean = task.loss_is_example_mean
        self._prepared_model: Any = None
        self._prepared_optimizer: Any = None
        self._plain_model_context = plain_model_context or contextlib.nullcontext
        self._block_loading = block_loading

    def plain_model_context(self) -> contextlib.AbstractContextManager:
        """The context in which a plain model is built and loaded while this run's strategy is live."""
        return self._plain_model_context()

    def gradients_released(self) -> contextlib.AbstractContextManager:
        """A context in which no gradient is needed (an export after the last optimizer step): a runtime that keeps a
        gradient buffer between steps lends its memory to what runs inside. Here nothing is kept: the loop's
        ``zero_grad(set_to_none=True)`` has freed the gradients already."""
        return contextlib.nullcontext()

    def build_model(self, model_init: Callable[[], Any]) -> Any:
        """The run's model, built by ``model_init`` in the strategy's construction context: with its transformer
        blocks held as the strategy holds them (``hftrain.strategies.loading``) where ``model_init`` is a pretrained
        folder's builder and the strategy has a way; otherwise whole on every rank (a pipeline runtime leaves other
        stages' layers unbuilt)."""
        build = getattr(model_init, "build", None)
        loading = self._block_loading(self.accelerator) if build is not None and self._block_loading else None
        with self.plain_model_context():
            return build(loading=loading) if loading is not None else model_init()

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

    def apply_compile(self, model: Any, mode: str) -> str:
        """``torch.compile`` every transformer block of ``model`` in place (``training.compile``), before ``prepare``;
        returns the line to log. Refuses (``ConfigError``, one line) what cannot run compiled.

        As torchtitan's ``apply_compile``: one ``torch.compile`` per block, not the whole model, so the compile is
        one block's graph (shared by every block of that class and batch shape: dynamo guards on the module's
        structure, not its identity) and the code between blocks (embeddings, head, loss, the strategy's hooks)
        stays eager. ``block.compile()`` sets the block's compiled call in place, so parameter names keep no
        ``_orig_mod.``: checkpoints, resume, export and LoRA see the model they always saw. The compile is lazy
        (at the first forward), so a strategy may still shard or split the block's submodules in ``prepare``:
        FSDP2's ``fully_shard`` hooks and ZeRO-3's gathers run inside the compiled call, megatron's tensor-parallel
        layers replace the linears inside it. ``dynamic=False``: one graph per batch shape (bucket the lengths),
        never a symbolic-shape graph whose guards would change with every new length.

        Args:
            model: the freshly built model (activation recomputation already applied).
            mode: ``torch.compile``'s mode: ``"default"``, ``"reduce-overhead"`` (CUDA graphs) or
                ``"max-autotune"``.
        """
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and getattr(plugin, "fsdp_version", 2) == 1:
            refuse_compile("FSDP1 flattens each unit's parameters into one FlatParameter; use fsdp_version: 2")
        return compile_blocks(model, mode, device=self.device)

    # ----------------------------------------------------------------- facts
    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: processes that see different examples (all of them under DDP/FSDP/ZeRO)."""
        return self.accelerator.num_processes

    @property
    def example_group(self) -> Any:
        """The process group a global batch's examples are split over, for a loss term computed over the whole
        batch (a mixture of experts' load-balancing loss); None in one process."""
        import torch.distributed as dist

        return dist.group.WORLD if self.accelerator.num_processes > 1 else None

    @property
    def pad_to_multiple_of(self) -> int | None:
        """The multiple every batch's sequence length must be padded to (None: any length will do); the length
        buckets (``data.pad_to_multiple_of``) combine with it (``hftrain.data.batching.LengthBuckets.combine``)."""
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
        self._prepared_model, self._prepared_optimizer = model, optimizer  # what checkpoints save and load
        eval_loader = self.accelerator.prepare(eval_loader) if eval_loader is not None else None
        return model, optimizer, train_loader, eval_loader

    def register_for_checkpointing(self, obj: Any) -> None:
        """Save and restore ``obj`` (the LR scheduler) with the checkpoint's state."""
        self.accelerator.register_for_checkpointing(obj)

    # ----------------------------------------------------------------- one step
    def accumulate(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The context of one micro-batch: decides ``sync_gradients`` and skips the gradient sync inside a window."""
        return self.accelerator.accumulate(model)

    def forward_backward(self, model: torch.nn.Module, batch: Batch, task: Any) -> torch.Tensor:
        """Forward and backward one micro-batch; returns its loss, detached.

        Args:
            model: the prepared model.
            batch: one micro-batch of this process.
            task: the Trainer: a data-parallel runtime runs ``task.compute_loss(model, batch) -> scalar`` (by default
                ``task.loss(task.forward(model, batch), batch)``); a pipeline hands its last stage's output to
                ``task.loss(output, batch)``.
        """
        loss = task.compute_loss(model, batch)
        # backward() divides the loss by gradient_accumulation_steps.
        self.accelerator.backward(loss)
        return loss.detach()

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm of ``model`` to ``max_norm``; returns the norm before clipping."""
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def evaluation_context(self) -> contextlib.AbstractContextManager:
        """The context of a whole evaluation (every batch's forward runs inside it); nothing by default."""
        return contextlib.nullcontext()

    def evaluation_step(self, model: torch.nn.Module, batch: Batch, task: Any) -> tuple[torch.Tensor, ...]:
        """Per-example outputs of one evaluation batch, gathered over the data-parallel ranks.

        Args:
            model: the prepared model (in eval mode).
            batch: this process's evaluation batch.
            task: the Trainer: ``task.prediction_step(model, batch)`` here (``task.predictions(output, batch)`` of the
                last stage's output in a pipeline).
        """
        # gather_for_metrics drops the duplicates Accelerate adds to even out the last batch
        # (pitfall "eval skewed by padding duplicates", docs/pitfalls.md).
        return self.accelerator.gather_for_metrics(task.prediction_step(model, batch))

    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the data-parallel replicas (the logged loss)."""
        return self.accelerator.reduce(tensor, reduction="mean")

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (one all-reduce over the host group, ``parallel.host``:
        the default group of an NCCL run takes no CPU tensor; free in one process)."""
        from hftrain.parallel.host import any_rank

        return flag if self.num_processes == 1 else any_rank(flag)

    def reports(self, error: Exception | None) -> bool:
        """Whether this rank prints ``error`` (None: it did not fail), met where every rank fails together (collective:
        every rank calls it): once per machine for each distinct line (``parallel.host.once_per_machine``). Set it as
        the error's ``every_rank``, which the CLI reads.

        Args:
            error: what this rank failed with, or None.
        """
        from hftrain.parallel.host import once_per_machine

        line = None if error is None else str(error)
        if self.num_processes == 1:
            return line is not None
        return once_per_machine(line, local_rank=self.accelerator.local_process_index)

    def skip_first_batches(self, loader: Any, num_batches: int) -> Any:
        """``loader`` without its first ``num_batches`` batches, skipped at the sampler level.

        Pitfall "slow batch skipping on resume", docs/pitfalls.md.
        """
        return self.accelerator.skip_first_batches(loader, num_batches)

    # ----------------------------------------------------------------- state
    def save_extras(self, directory: str) -> None:
        """Scheduler, sampler and per-rank RNG through ``accelerator.save_state``: everything but the model and
        optimizer, which :meth:`snapshot` gives to the sharded format (collective)."""
        with _without_model_and_optimizer(self.accelerator):
            self.accelerator.save_state(directory, safe_serialization=True)

    def snapshot(self) -> Snapshot:
        """This rank's boxes of the model's and optimizer's logical tensors (views of the live state), the
        optimizer's parameter groups and what the export needs (``hftrain.checkpoint.sharded``)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from hftrain.checkpoint.sharded import Snapshot

        model_state, optim_state = get_state_dict(self._prepared_model, self._inner_optimizer())
        replicas = (self.accelerator.process_index, self.num_processes)  # plain tensors are on every rank
        return Snapshot(
            state=flat_state(model_state, optim_state, replicas=replicas),
            param_groups=[
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(group["params"])}
                for group in optim_state["param_groups"]
            ],
            info={"world_size": self.num_processes},
            model=self.unwrap_model(self._prepared_model),
        )

    def load_state(self, directory: str, *, model: torch.nn.Module, optimizer: Any) -> None:
        """Restore a checkpoint's ``state/`` into the live (prepared) model, optimizer and scheduler: what
        :meth:`save_extras` wrote, then the sharded state (of any strategy and process count) through
        :meth:`load_snapshot` (a checkpoint in a per-strategy format from before it never gets here:
        ``hftrain.checkpoint.sharded.check_sharded`` refuses it on resume).

        Args:
            directory: a checkpoint's ``state/`` folder.
            model: the prepared model.
            optimizer: the prepared optimizer.
        """
        self.load_extras(directory)
        self.load_snapshot(directory)

    def load_extras(self, directory: str) -> None:
        """What :meth:`save_extras` wrote: scheduler, sampler and this rank's RNG (collective).

        Accelerate reads a private copy of the very bytes that were checked (``checkpoint.safety.verified_copy``),
        never the checkpoint's files again: a file swapped after its check would otherwise be unpickled.
        """
        from hftrain.checkpoint.safety import verified_copy

        with _without_model_and_optimizer(self.accelerator), verified_copy(directory) as private:
            self.accelerator.load_state(private)

    def load_snapshot(self, directory: str) -> None:
        """Fill the live model and optimizer from the sharded state in ``directory`` (collective): each rank
        reads the stored pieces overlapping its own boxes, then torch's ``set_state_dict`` puts them in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from hftrain.checkpoint.sharded import read_snapshot

        optimizer = self._inner_optimizer()
        # get_state_dict gives a fresh optimizer its state tensors first (a zero learning-rate step), so that
        # the moments have somewhere to load into.
        model_state, optim_state = get_state_dict(self._prepared_model, optimizer)
        # The saved hyper-parameters go into the state dict's groups, which set_state_dict makes the live ones.
        read_snapshot(directory, flat_state(model_state, optim_state), optim_state["param_groups"])
        set_state_dict(self._prepared_model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)

    def _inner_optimizer(self) -> Any:
        return getattr(self._prepared_optimizer, "optimizer", self._prepared_optimizer)

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict with the model's own names (collective; the main process holds it)."""
        if self.accelerator.distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU"):
            return self.unwrap_model(model).state_dict()  # every rank holds it whole (Accelerate's own branch)
        return self.accelerator.get_state_dict(model)

    def iter_full_state(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every tensor of the model's state dict, whole, one at a time: ``(name, tensor)`` on the main process,
        ``(name, None)`` elsewhere (collective: every rank iterates to the end). A streamed export writes each
        before the next is gathered, so no rank holds more than its own shards and one full tensor.

        Args:
            model: the prepared model.
        """
        import torch
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        if self.accelerator.distributed_type in ("NO", "MULTI_CPU", "MULTI_GPU"):
            for name, tensor in self.unwrap_model(model).state_dict().items():  # every rank holds it whole
                yield name, tensor if self.is_main_process else None
            return
        main = self.is_main_process
        for name, value in get_model_state_dict(model).items():  # wrapper-free names; FSDP's shards
            if isinstance(value, DTensor):  # FSDP2: all-gather of one parameter
                full = value.full_tensor()
            elif isinstance(value, ShardedTensor):  # FSDP1: gathered to rank 0, on the shards' device (NCCL's)
                shards = value.local_shards()
                device = shards[0].tensor.device if shards else self.device
                full = torch.empty(value.size(), dtype=value.dtype, device=device) if main else None
                value.gather(dst=0, out=full)
            else:
                full = value
            yield name, full if main else None
            del full

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


@contextlib.contextmanager
def _without_model_and_optimizer(accelerator: Accelerator) -> Iterator[None]:
    """``accelerator.save_state``/``load_state`` of everything but the model and optimizer (the sharded format
    holds those): Accelerate saves what it prepared, so the prepared ones are set aside for the call."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def flat_state(
    model_state: dict[str, Any], optim_state: dict[str, Any], *, replicas: tuple[int, int] = (0, 1)
) -> dict[str, Chunked]:
    """torch's ``get_state_dict`` pair as the sharded format's flat keys (``model.<name>``,
    ``optim.<name>.<key>``), each value this rank's boxes of it (views, so a load fills them in place).

    Args:
        model_state: ``get_state_dict``'s model part (tensors, DTensors or ShardedTensors).
        optim_state: its optimizer part.
        replicas: ``(this rank, ranks)`` over which plain tensors are replicated: a save keeps the ones this rank
            writes (``split_replicated``); a load, which fills everything it holds, passes the default.
    """
    import torch

    from hftrain.checkpoint.sharded import MODEL_PREFIX, OPTIM_PREFIX, Chunked, split_replicated

    values = {MODEL_PREFIX + name: value for name, value in model_state.items()}
    for name, state in optim_state["state"].items():
        values.update({f"{OPTIM_PREFIX}{name}.{key}": value for key, value in state.items() if hasattr(value, "shape")})
    flat = {key: Chunked.of(value) for key, value in values.items()}
    replicated = [key for key, value in values.items() if type(value) is torch.Tensor]  # not a DTensor's shard
    return split_replicated(flat, replicated, *replicas)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


def refuse_compile(reason: str) -> None:
    """Raise the one-line refusal of ``training.compile`` for ``reason`` (what cannot run compiled, and the fix)."""
    from hftrain.errors import ConfigError

    raise ConfigError(f"training.compile: {reason}; or set training.compile: false")


def refuse_full_recomputation() -> None:
    """Refuse ``training.compile`` with full recomputation: the layer checkpoint runs inside the compiled block, where
    torch requires ``checkpoint``'s ``context_fn`` to return two ``TorchDispatchMode``s, and
    ``hftrain.parallel.recompute`` passes its own (null contexts, or the RNG tracker's stream switches)."""
    refuse_compile(
        "gradient_checkpointing: full checkpoints each block with a context_fn that torch.compile refuses inside the "
        "compiled block; use gradient_checkpointing: selective (or false)"
    )


RECOMPILE_LIMIT = 64
"""Graphs a compiled block may hold: every length bucket, in training and in evaluation, with and without padding."""

GRAPHS_PER_LENGTH = 4
"""Graphs one padded length can cost a compiled block: training and evaluation, each with and without a padding
mask."""


def check_compiled_shapes(lengths: int, ceiling: int) -> None:
    """Refuse (one line, before training) length buckets that would give a compiled block more graphs than
    :data:`RECOMPILE_LIMIT`: dynamo would stop the run at the limit, mid-epoch.

    Args:
        lengths: the padded lengths the run can see (``LengthBuckets.lengths``).
        ceiling: the longest padded length.
    """
    if lengths * GRAPHS_PER_LENGTH <= RECOMPILE_LIMIT:
        return
    smallest = -(-ceiling // (RECOMPILE_LIMIT // GRAPHS_PER_LENGTH))
    refuse_compile(
        f"data.pad_to_multiple_of allows {lengths} batch lengths, each up to {GRAPHS_PER_LENGTH} graphs of a compiled "
        f"block, beyond its {RECOMPILE_LIMIT}; set data.pad_to_multiple_of: auto (or at least {smallest})"
    )


def compile_blocks(model: Any, mode: str, *, device: torch.device) -> str:
    """``block.compile(mode=mode, dynamic=False)`` on every transformer block of ``model`` (transformers'
    ``GradientCheckpointingLayer``: the layers ``gradient_checkpointing`` recomputes); returns the line to log.

    Args:
        model: an HF model (possibly in PEFT adapters).
        mode: ``torch.compile``'s mode (``COMPILE_MODES``).
        device: the run's device: ``reduce-overhead`` captures CUDA graphs, so it needs a CUDA device.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if mode not in COMPILE_MODES:
        refuse_compile(f"compile_mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "reduce-overhead" and device.type != "cuda":
        refuse_compile(
            f"compile_mode reduce-overhead replays CUDA graphs, and this run is on {device.type}; use compile_mode: "
            "default"
        )
    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not blocks:
        refuse_compile(f"{type(model).__name__} has no transformers GradientCheckpointingLayer blocks to compile")
    if any(getattr(block, "gradient_checkpointing", False) for block in blocks):
        refuse_full_recomputation()
    import torch._dynamo

    # one graph per (shape, grad mode) a block meets: length buckets (≤ 8 on CUDA) in training and evaluation, beyond
    # dynamo's default 8 graphs per code object, after which it would run eager with only a warning: room for them,
    # and a failure instead of a silent fall back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for block in blocks:
        block.compile(mode=mode, dynamic=False)
    classes = sorted({type(block).__name__ for block in blocks})
    return (
        f"compile: {len(blocks)} blocks ({', '.join(classes)}) with torch.compile, mode {mode}, dynamic=False (one "
        "graph per batch shape, compiled at its first step)"
    )
