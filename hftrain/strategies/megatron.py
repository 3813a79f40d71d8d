"""megatron: hftrain's Megatron-style tensor parallelism composed with data parallelism (tp × dp).

``strategy: {name: megatron, tp: 2, sequence_parallel: false, shard_optimizer: false}``. The world is laid out in
Megatron-LM's order (tp ranks adjacent, then dp); each layer is split over its tp group by
``hftrain.parallel`` and the Trainer runs through :class:`MegatronRuntime`, which does what Accelerate cannot
here: DDP over the dp group only, data sharded by dp rank, the TP-aware gradient norm, evaluation gathered over
dp, logical (reshardable) checkpoints and the merged export. Accelerate still provides the process group,
gradient accumulation (``accumulate``/``backward``), autocast and the trackers.

Refused up front, before any process group: a ``tp`` that does not divide the world size or the model's sizes,
an unsupported model family, LoRA (its adapters would wrap the split layers; not supported yet), and another
strategy's options (FSDP/DeepSpeed settings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError
from hftrain.strategies.base import Strategy
from hftrain.strategies.pipeline_checks import pipeline_facts
from hftrain.strategies.runtime import AccelerateRuntime, Batch

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from accelerate import Accelerator

    from hftrain.config import StrategyConfig, TrainingConfig
    from hftrain.parallel.plugin import MegatronPlugin
    from hftrain.strategies.base import LaunchInfo
    from hftrain.strategies.platform import Platform

# Options of other strategies, with the values that mean "not used".
_FOREIGN_OPTIONS = {
    "fsdp_version": 2,
    "sharding_strategy": "FULL_SHARD",
    "offload_params": False,
    "offload_optimizer": False,
    "deepspeed_config": None,
}


class MegatronStrategy(Strategy):
    """Tensor parallelism over ``tp`` adjacent ranks, data parallelism over the rest.

    Args:
        config: the ``strategy`` section (``tp``, ``sequence_parallel``, ``shard_optimizer``).
        platform: device and backend.
        launch: the launcher's world size (``tp`` must divide it).
    """

    name = "megatron"
    reshardable_checkpoints = True  # logical full tensors: any tp and dp that fit the model

    def __init__(self, config: StrategyConfig, *, platform: Platform, launch: LaunchInfo) -> None:
        from hftrain.parallel.dims import ParallelDims

        super().__init__(config, platform=platform, launch=launch)
        for key, unused in _FOREIGN_OPTIONS.items():
            if getattr(config, key) != unused:
                raise ConfigError(
                    f"strategy.{key} is not a megatron option (megatron composes tp with plain data parallelism; "
                    "shard_optimizer gives ZeRO-1); drop it or choose its strategy"
                )
        self.dims = ParallelDims(launch.world_size, tp=config.tp, pp=config.pp).validate()

    def preflight(self, training: TrainingConfig) -> None:
        if training.mixed_precision == "fp16":  # Accelerate's gradient scaler would meet an optimizer it never saw
            raise ConfigError(
                "training.mixed_precision fp16 is not supported with strategy megatron (no gradient scaler); "
                "use bf16 or no"
            )
        from hftrain.strategies.pipeline_checks import check_pipeline_training

        check_pipeline_training(self.config, training)  # also at pp=1: an interleaved schedule there is refused

    def check_model(self, model_config: Any, *, use_lora: bool) -> None:
        from hftrain.parallel import check_tensor_parallel

        if use_lora:
            raise ConfigError(
                "lora.use_lora with strategy megatron is not supported (the adapters would wrap split layers); "
                "use strategy ddp/fsdp/zero for LoRA, or train the full model with megatron"
            )
        check_tensor_parallel(model_config, self.config.tp)
        if self.config.pp > 1:
            from hftrain.strategies.pipeline_checks import check_pipeline_model

            check_pipeline_model(self.config, model_config)

    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        # MULTI_CPU/MULTI_GPU gives the process group and accumulate()'s no_sync; the model is never prepare()d.
        return {"cpu": self.platform.is_cpu}

    def describe(self) -> dict[str, Any]:
        return {
            "type": "megatron",
            "tp": self.dims.tp,
            "pp": self.dims.pp,
            "sequence_parallel": self.config.sequence_parallel,
            "shard_optimizer": self.config.shard_optimizer,
            "checkpoint_format": "logical full tensors (reshardable)",
            **(pipeline_facts(self.config) if self.dims.pp > 1 else {}),
        }

    def summary(self, training: TrainingConfig, accelerator: Accelerator) -> dict[str, Any]:
        summary = super().summary(training, accelerator)
        micro, gas = training.per_device_train_batch_size, training.gradient_accumulation_steps
        return {**summary, "dp_size": self.dims.dp, "global_batch": micro * gas * self.dims.dp}

    def build_runtime(self, accelerator: Accelerator) -> MegatronRuntime:
        from hftrain.parallel.plugin import MegatronPlugin

        plugin = MegatronPlugin(
            tp=self.config.tp,
            sequence_parallel=self.config.sequence_parallel,
            shard_optimizer=self.config.shard_optimizer,
            pp=self.config.pp,
        ).setup(device_type=self.platform.device)
        if self.dims.pp > 1:  # the stages run through the pipeline schedule (hftrain.strategies.pipeline_runtime)
            from hftrain.strategies.pipeline_runtime import PipelineRuntime

            return PipelineRuntime(accelerator, self, plugin)
        return MegatronRuntime(accelerator, self, plugin)


class MegatronRuntime(AccelerateRuntime):
    """The Trainer's operations for tp × dp, through :class:`~hftrain.parallel.plugin.MegatronPlugin`.

    Args:
        accelerator: gives the process group, accumulation, autocast and trackers.
        strategy: the megatron strategy.
        plugin: the set-up plugin (its groups).
    """

    def __init__(self, accelerator: Accelerator, strategy: Strategy, plugin: MegatronPlugin) -> None:
        super().__init__(accelerator, strategy)
        self.plugin = plugin
        self._model: torch.nn.Module | None = None
        self._optimizer: Any = None

    @property
    def dp_size(self) -> int:
        return self.plugin.layout.dp_size

    @property
    def pad_to_multiple_of(self) -> int | None:
        # Sequence parallelism splits the sequence over tp: every batch the model sees must divide by tp.
        return self.plugin.tp if self.plugin.sequence_parallel and self.plugin.tp > 1 else None

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: torch.utils.data.DataLoader,
        eval_loader: torch.utils.data.DataLoader | None,
    ) -> tuple[torch.nn.Module, Any, Any, Any]:
        plugin, device = self.plugin, self.accelerator.device
        names = {id(p): n for n, p in model.named_parameters()}
        model = plugin.prepare_model(model, device=device)
        if self.mixed_precision != "no":
            _autocast_forward(model, self.accelerator)
        rebuilt = _rebuilt_over_shards(optimizer, names, _unwrap(model))
        train_loader = plugin.prepare_data_loader(train_loader, device=device)
        eval_loader = plugin.prepare_data_loader(eval_loader, device=device) if eval_loader is not None else None
        prepared = plugin.prepare_optimizer(rebuilt)
        # Kept for save_state, as Accelerate keeps what it prepared.
        self._model, self._optimizer = _unwrap(model), prepared.optimizer
        return model, prepared, train_loader, eval_loader

    def forward_backward(
        self, model: torch.nn.Module, batch: Batch, loss_fn: Callable[[torch.nn.Module, Batch], torch.Tensor]
    ) -> torch.Tensor:
        loss = super().forward_backward(model, batch, loss_fn)
        if self.sync_gradients:  # the window's gradients are complete (DDP reduced them over dp in this backward)
            self.plugin.finalize_grads(model)
        return loss

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return self.plugin.clip_grad_norm_(model, max_norm)

    def evaluation_step(
        self, model: torch.nn.Module, batch: Batch, predict: Callable[[torch.nn.Module, Batch], tuple]
    ) -> tuple[torch.Tensor, ...]:
        return self.plugin.gather_for_metrics(predict(model, batch))

    # reduce_mean and any_rank stay Accelerate's world-wide reductions: tp ranks of a replica hold the same loss,
    # so the world mean is the mean over dp.

    def save_state(self, directory: str, *, safe_serialization: bool = True) -> None:
        from hftrain.checkpoint.logical import save_logical_state

        # Scheduler and per-rank RNG through Accelerate (no model or optimizer is registered with it).
        self.accelerator.save_state(directory, safe_serialization=safe_serialization)
        save_logical_state(
            directory, self._model, self._optimizer, groups=self.plugin.layout, layout=self.layout_facts()
        )

    def load_state(self, directory: str, *, model: torch.nn.Module, optimizer: Any) -> None:
        from hftrain.checkpoint.logical import load_logical_state

        self.accelerator.load_state(directory)
        load_logical_state(directory, _unwrap(model), optimizer.optimizer, layout=self.layout_facts())

    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return self.plugin.full_state_dict(model)

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return _unwrap(model)

    def layout_facts(self) -> dict[str, int]:
        """This run's layout, recorded in checkpoints."""
        dims = self.plugin.layout.dims
        return {"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "world_size": dims.world_size}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from hftrain.parallel.plugin import unwrap

    return unwrap(model)


def _rebuilt_over_shards(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: torch.nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyper-parameters) over the split model's parameters.

    The Trainer builds the optimizer over the full model before the strategy splits it (as Accelerate expects);
    the split layers hold new parameters with the same names.

    Args:
        optimizer: the optimizer over the unsplit parameters (no state yet).
        names: ``id(parameter) -> name`` of the unsplit model.
        model: the split model (unwrapped).
    """
    shards = dict(model.named_parameters())
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [shards[names[id(p)]] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return type(optimizer)(groups)


def _autocast_forward(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """Run ``model``'s forward under Accelerate's autocast with fp32 outputs, as ``prepare(model)`` would."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)
