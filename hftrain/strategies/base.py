"""The strategy interface: how a job's model, optimizer and data are distributed.

The trainer only talks to this interface; it never asks which strategy it runs. A strategy turns hftrain's
config into Accelerate plugin/handler objects, fixes up the Accelerate state where the platform needs it,
and owns the context in which the model is constructed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hftrain.errors import ConfigError, HFTrainError
from hftrain.tasks import DEFAULT_TASK

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hftrain.config import ParallelismConfig, StrategyConfig, TrainingConfig
    from hftrain.models.weights import BlockLoading
    from hftrain.strategies.platform import HeapWarmer, Platform
    from hftrain.strategies.runtime import AccelerateRuntime, RuntimeTask


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher (torchrun / accelerate launch / deepspeed) told this process.

    Args:
        world_size: processes in the job (``WORLD_SIZE``, 1 without a launcher).
        local_world_size: processes on this machine.
        accelerate_strategy: the strategy named by ``accelerate launch --config_file`` (None when absent).
        accelerate_settings: the launcher's strategy settings (e.g. a DeepSpeed config file, FSDP options).
    """

    world_size: int = 1
    local_world_size: int = 1
    accelerate_strategy: str | None = None
    accelerate_settings: dict[str, str] | None = None


class Strategy(ABC):
    """One way to distribute training; subclasses live one per file and register by ``name``.

    Args:
        config: the ``strategy`` config section.
        platform: device and backend of this machine.
        launch: what the launcher set up.
        parallelism: the ``parallelism`` section; a strategy that does not split the model (``splits_model``
            False) refuses any value there but the defaults.
    """

    name: ClassVar[str]
    splits_model: ClassVar[bool] = False
    """Whether the strategy takes the ``parallelism`` section's axes (tensor, pipeline, context, expert)."""

    def __init__(
        self,
        config: StrategyConfig,
        *,
        platform: Platform,
        launch: LaunchInfo,
        parallelism: ParallelismConfig | None = None,
    ) -> None:
        from hftrain.config import ParallelismConfig

        self.config = config
        self.parallelism = parallelism or ParallelismConfig()
        self.platform = platform
        self.launch = launch
        changed = [] if self.splits_model else self.parallelism.changed()
        if changed:
            raise ConfigError(
                f"parallelism.{changed[0]} is a megatron option but strategy.name is {self.name}; "
                "set strategy.name: megatron or drop it"
            )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this strategy cannot run on this machine, or None when it can (for ``hftrain env``)."""
        return None

    def preflight(self, training: TrainingConfig) -> None:
        """Check everything that can be checked before processes talk or files are written (default: nothing)."""

    @abstractmethod
    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        """Keyword arguments for ``Accelerator`` (plugins, kwargs handlers, cpu flag) for this strategy."""

    def configure_accelerator(self, accelerator: Accelerator) -> None:
        """Adjust the freshly built Accelerate state where the platform needs it (default: nothing)."""

    def model_init_context(self) -> contextlib.AbstractContextManager:
        """The context the model must be constructed in (default: none)."""
        return contextlib.nullcontext()

    def check_model(self, model_config: Any, *, use_lora: bool, task: str = DEFAULT_TASK) -> None:
        """Refuse a model this strategy cannot distribute, before any process group exists (default: any).

        Args:
            model_config: the model's ``transformers`` config.
            use_lora: whether LoRA adapters are trained.
            task: ``model.task``.
        """

    def build_runtime(self, accelerator: Accelerator, task: RuntimeTask) -> AccelerateRuntime:
        """The object the Trainer runs every distributed operation through (see ``hftrain.strategies.runtime``).

        The default delegates to Accelerate; a strategy that owns wrapping, data sharding or the backward pass
        (tensor/pipeline parallelism) returns its own subclass.

        Args:
            accelerator: the run's accelerator.
            task: what the runtime knows of the task (its head, how its loss adds up).
        """
        from hftrain.strategies.runtime import AccelerateRuntime

        return AccelerateRuntime(accelerator, **self.runtime_hooks(task))

    def runtime_hooks(self, task: RuntimeTask) -> dict[str, Any]:
        """What an Accelerate runtime needs from this strategy and the task: the task's traits, the strategy's
        model-construction context and its way to load a pretrained model's blocks."""
        return {"task": task, "plain_model_context": self.model_init_context, "block_loading": self.block_loading}

    def block_loading(self, accelerator: Accelerator) -> BlockLoading | None:
        """How this rank holds a pretrained model's transformer blocks as it loads them
        (``hftrain.strategies.loading``), so that no rank needs a whole copy it would only shard or overwrite; None
        (the default): load the whole model.

        Args:
            accelerator: the run's accelerator (rank, process count, plugins).
        """
        return None

    shards_model_states: ClassVar[bool] = False
    """Whether the point of this strategy is to hold less than a whole model's states per rank (ZeRO, FSDP)."""

    def tune_host_allocator(self) -> str:
        """Tune the host allocator for this strategy's runs; says what it did.

        The platform's speed tuning keeps freed blocks below 1 GiB in the heap for reuse. Under a sharding strategy
        that would keep the whole model each rank builds before it is partitioned, and every gathered layer freed
        since, resident for the rest of the run: a ZeRO-3 or FSDP2 rank then holds as much as one process training
        alone (issue 42, ``benchmarks/memory_timeline.py``). Those strategies take the lean setting: freed blocks of a
        layer's size go back to the system at once.
        """
        return self.platform.tune_host_allocator(lean=self.shards_model_states)

    def warm_heap(self, nbytes: int) -> HeapWarmer | None:
        """Fault in heap for the first training step on another thread (``Platform.warm_heap``); None by default.

        Args:
            nbytes: the whole model's trained states the first step creates (gradients, optimizer moments); only a
                strategy whose every process holds all of them in host memory warms that much (``ddp``).
        """
        return None

    def describe(self) -> dict[str, Any]:
        """Strategy-specific facts for the start-of-run log (stage, offload, sharding...)."""
        return {}

    def resolve_training(self, training: TrainingConfig) -> tuple[TrainingConfig, list[str]]:
        """``training`` with its ``auto`` fields made concrete for this strategy on this machine, and why.

        Returns:
            the resolved section (``mixed_precision``, ``optim`` and ``dropout_kernel`` no longer ``auto``) and one
            log line per choice.
        """
        launched = launcher_precision(self.launch)
        if training.mixed_precision == "auto" and launched != "no":
            precision, reason = launched, "auto: set by the accelerate config"
        else:
            precision, reason = self.platform.resolve_precision(training.mixed_precision)
        optim = self.resolve_optim(training.optim)
        dropout_kernel, dropout_reason = self.platform.resolve_dropout_kernel(
            training.dropout_kernel, compiled=training.compile
        )
        notes = [
            f"mixed_precision: {precision} ({reason})",
            f"optim: {optim}" + " (auto)" * (training.optim == "auto"),
            f"dropout_kernel: {dropout_kernel} ({dropout_reason})",
        ]
        # the trackers installed here: a named one that is not is refused with its install command (before any write:
        # hftrain.validate runs this), and ``all`` becomes the installed ones
        from hftrain.metrics.trackers import requested, resolve_trackers

        log_with = resolve_trackers(training.log_with)
        if requested(training.log_with) == ["all"]:
            notes.append(f"log_with: {', '.join(log_with) or 'none'} (all: the trackers installed here)")
        resolved = dataclasses.replace(
            training, mixed_precision=precision, optim=optim, dropout_kernel=dropout_kernel, log_with=log_with or None
        )
        return resolved, notes

    def resolve_optim(self, optim: str) -> str:
        """The AdamW implementation for ``training.optim``; ``auto`` is the fused kernel wherever the strategy
        steps the torch optimizer the trainer built (checked per strategy by the parity and resume tests)."""
        return "adamw_torch_fused" if optim == "auto" else optim

    def summary(self, training: TrainingConfig, accelerator: Accelerator) -> dict[str, Any]:
        """The resolved strategy and batch geometry, logged at start and saved with the run."""
        dp_size = accelerator.num_processes
        micro, gas = training.per_device_train_batch_size, training.gradient_accumulation_steps
        return {
            "strategy": self.name,
            **self.describe(),
            "distributed_type": str(accelerator.distributed_type).split(".")[-1],
            "backend": self.platform.backend,
            "world_size": accelerator.num_processes,
            "dp_size": dp_size,
            "micro_batch": micro,
            "gradient_accumulation_steps": gas,
            "global_batch": micro * gas * dp_size,
            "mixed_precision": training.mixed_precision,
            "optim": training.optim,
            "dropout_kernel": training.dropout_kernel,
        }

    def start_processes(self, training: TrainingConfig) -> None:
        """Start the process group now, before the data is read, exactly as this strategy's ``Accelerator`` would.

        transformers' ``TrainingArguments`` does the same (a ``PartialState`` before the data): the job's data
        preparation then runs on a live group (``hftrain.parallel.host``: the main process of each node tokenizes,
        the others wait), and ``Accelerator(...)`` later finds the state started and only adds its own part. The
        ``PartialState`` gets what ``Accelerator.__init__`` hands ``AcceleratorState`` -> ``PartialState``: ``cpu``
        (forced by ``ACCELERATE_USE_CPU``, as ``AcceleratorState`` does) and the ``InitProcessGroupKwargs`` handler's
        ``backend``/``timeout``; and the environment flags ``Accelerator.__init__`` sets for a DeepSpeed or FSDP
        plugin before it builds the state (``PartialState`` reads them: DeepSpeed's ``init_distributed``, FSDP's
        ``cpu:gloo`` beside nccl). The kwargs are :meth:`accelerator_kwargs`'s, so nothing differs for any strategy.
        On a GPU the default group is started first, bound to the rank's device (``Platform.start_group_eagerly``).
        Idempotent: a started state is left as it is.

        Args:
            training: the ``training`` section, resolved (``resolve_training``) as the trainer will run it.
        """
        import os

        from accelerate.state import PartialState
        from accelerate.utils import InitProcessGroupKwargs, parse_flag_from_env

        if PartialState._shared_state:  # started (a notebook's earlier run, or this job's trainer)
            return
        kwargs = {"kwargs_handlers": self.platform.default_handlers(), **self.accelerator_kwargs(training)}
        init = [handler for handler in kwargs["kwargs_handlers"] if isinstance(handler, InitProcessGroupKwargs)]
        for plugin, flag in (("deepspeed_plugin", "ACCELERATE_USE_DEEPSPEED"), ("fsdp_plugin", "ACCELERATE_USE_FSDP")):
            if kwargs.get(plugin) is not None:
                os.environ[flag] = "true"  # what Accelerator.__init__ sets before its state, to the same value
        cpu = bool(kwargs.get("cpu", False)) or parse_flag_from_env("ACCELERATE_USE_CPU")
        if init and not cpu:  # on a GPU: the group bound to this rank's device now (Accelerate keeps it)
            self.platform.start_group_eagerly(init[-1].backend, init[-1].timeout)
        PartialState(cpu, **(init[-1].to_kwargs() if init else {}))

    def build_accelerator(
        self, training: TrainingConfig, *, project_dir: str | None = None, logging_dir: str | None = None
    ) -> Accelerator:
        """Construct the ``Accelerator`` for this strategy and refuse a silently unsynchronised job.

        Args:
            training: the ``training`` config section (precision, accumulation, trackers).
            project_dir: the run's folder (``output_dir``; the pipeline's timeline is written there).
            logging_dir: where trackers write (``output_dir/runs``); ``project_dir`` when not given.
        """
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

        from hftrain.metrics.trackers import resolve_trackers

        check_launcher_precision(training, self.launch)
        self.platform.check_precision(training.mixed_precision)
        self.preflight(training)
        kwargs = {"kwargs_handlers": self.platform.default_handlers(), **self.accelerator_kwargs(training)}
        accelerator = Accelerator(
            mixed_precision=training.mixed_precision,
            gradient_accumulation_steps=training.gradient_accumulation_steps,
            # installed, checked (resolve_training): Accelerate itself would drop a missing one at debug level
            log_with=resolve_trackers(training.log_with) or None,
            project_config=ProjectConfiguration(project_dir=project_dir, logging_dir=logging_dir or project_dir),
            # hftrain's loop owns the optimizer-step boundary and steps the scheduler itself
            # (pitfall "accumulation differs under DeepSpeed", docs/pitfalls.md).
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(
                use_seedable_sampler=True, non_blocking=self.platform.pinned_batches
            ),
            **kwargs,
        )
        self.configure_accelerator(accelerator)
        check_synchronised(accelerator, self.launch, strategy=self.name)
        return accelerator


def launcher_precision(launch: LaunchInfo) -> str:
    """The mixed precision the accelerate config set (``no``, its default, defers to the job)."""
    return (launch.accelerate_settings or {}).get("ACCELERATE_MIXED_PRECISION", "no")


def check_launcher_precision(training: TrainingConfig, launch: LaunchInfo) -> None:
    """Refuse an accelerate config whose mixed_precision contradicts the job's (its default 'no' defers)."""
    launched = launcher_precision(launch)
    if launched != "no" and launched != training.mixed_precision:
        raise HFTrainError(
            f"training.mixed_precision is '{training.mixed_precision}' but the accelerate config sets "
            f"mixed_precision '{launched}'; make them agree"
        )


def check_synchronised(accelerator: Accelerator, launch: LaunchInfo, *, strategy: str) -> None:
    """Refuse a multi-process launch whose Accelerate state resolved to no distributed type.

    Args:
        accelerator: the constructed accelerator.
        launch: the launcher's world size.
        strategy: the strategy name, for the message.
    """
    from accelerate.utils import DistributedType

    if launch.world_size > 1 and accelerator.distributed_type == DistributedType.NO:
        raise HFTrainError(
            f"strategy '{strategy}': {launch.world_size} processes were launched but Accelerate resolved no "
            "distributed type, so each would train alone without gradient sync; launch with an "
            "accelerate_configs/ file or set strategy.name"
        )
    if accelerator.num_processes != launch.world_size:
        raise HFTrainError(
            f"strategy '{strategy}': Accelerate sees {accelerator.num_processes} processes but the launcher "
            f"started {launch.world_size}; check the launcher's --num_processes and the strategy config"
        )
