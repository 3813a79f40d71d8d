"""The ``megatron`` strategy: tensor × context × pipeline × data parallelism, its layout validated once.

``strategy: {name: megatron, shard_optimizer: false}`` with ``parallelism: {tp: 2, cp: 1, pp: 1, ep: 1,
sequence_parallel: false}``: the ``parallelism`` section is consumed whole. Its sizes make one ``ParallelDims``
(Megatron-LM's rank order: tp ranks adjacent, then cp, then dp, then pp; ep carved out of dp), built and validated
here once and passed down to the plugin's groups; its options reach ``hftrain.parallel`` by name (the fields each
axis's module reads, ``plugin.axis_options``), and each axis's refusals are its own module's (``AxisOps.not_built``).
The Trainer runs through :class:`~hftrain.strategies.megatron.runtime.MegatronRuntime` (``pp = 1``) or
:class:`~hftrain.strategies.megatron.pipeline_runtime.PipelineRuntime` (stages and a schedule).

Refused up front, before any process group: a ``tp`` that does not divide the world size or the model's sizes,
an unsupported model family, LoRA with an axis whose module does not take adapters yet (none today: they are split
with their layers under tp, ``hftrain.parallel.lora``, each pipeline stage keeps its layers' adapters, cp and ep
replicate them),
``ep`` on a dense model or one that does not divide the experts and dp, ``ep`` with context parallelism
(``ParallelDims.validate_trainable``), and another strategy's options (FSDP/DeepSpeed settings).
ZeRO-1 (``shard_optimizer``) shards each stage's dense optimizer state over dp and the experts' over edp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError
from hftrain.parallel.axis_ops import not_built
from hftrain.strategies.base import Strategy
from hftrain.strategies.megatron.checks import check_pipeline_training, num_microbatches
from hftrain.strategies.megatron.fields import named_by_config
from hftrain.strategies.megatron.plugin import axis_options
from hftrain.tasks import DEFAULT_TASK, task_of

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hftrain.config import StrategyConfig, TrainingConfig
    from hftrain.models.weights import BlockLoading
    from hftrain.strategies.megatron.runtime import MegatronRuntime
    from hftrain.strategies.runtime import RuntimeTask

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
        config: the ``strategy`` section (``shard_optimizer``).
        platform: device and backend.
        launch: the launcher's world size (the axes' product must divide it).
        parallelism: the ``parallelism`` section: the axis sizes and each axis's options.
    """

    name = "megatron"
    splits_model = True

    def __init__(self, config: StrategyConfig, **context: Any) -> None:
        from hftrain.parallel.dims import AXIS_SIZES, ParallelDims

        super().__init__(config, **context)  # platform, launch, parallelism: see Strategy
        for key, unused in _FOREIGN_OPTIONS.items():
            if getattr(config, key) != unused:
                raise ConfigError(
                    f"strategy.{key} is not a megatron option (megatron composes tp with plain data parallelism; "
                    "shard_optimizer gives ZeRO-1); drop it or choose its strategy"
                )
        with named_by_config():  # the layout, and ep with cp, checked as hftrain groups checks them
            sizes = {axis: getattr(self.parallelism, axis) for axis in AXIS_SIZES}
            self.dims = ParallelDims(self.launch.world_size, **sizes).validate_trainable()
        for axis, size, why in not_built(self.dims, "zero1") if config.shard_optimizer else ():
            raise ConfigError(
                f"strategy.shard_optimizer with parallelism.{axis}={size} is not supported yet ({why}); use "
                f"shard_optimizer: false or {axis}: 1"
            )

    def preflight(self, training: TrainingConfig) -> None:
        from hftrain.parallel import check_layout

        if training.mixed_precision == "fp16":  # Accelerate's gradient scaler would meet an optimizer it never saw
            raise ConfigError(
                "training.mixed_precision fp16 is not supported with strategy megatron (no gradient scaler); "
                "use bf16 or no"
            )
        with named_by_config():
            check_pipeline_training(self.parallelism, training)  # also at pp=1: an interleaved schedule is refused
            check_layout(self.dims, **axis_options(self.parallelism))

    def check_model(self, model_config: Any, *, use_lora: bool, task: str = DEFAULT_TASK) -> None:
        from hftrain.parallel import check_model
        from hftrain.parallel.axis_ops import per_token_layouts_not_built

        record = task_of(task)
        for axis in record.megatron_axes_not_built:
            if getattr(self.dims, axis) > 1:
                raise ConfigError(
                    f"parallelism.{axis}={getattr(self.dims, axis)} with model.task: {task} is not built yet (the "
                    f"{record.human}'s head runs on {', '.join(record.megatron_axes_not_built)} later); use {axis}: 1, "
                    "or strategy.name ddp, fsdp or zero1/2/3"
                )
        for axes in per_token_layouts_not_built() if record.per_token_loss else ():
            if all(getattr(self.dims, axis) > 1 for axis in axes):
                given = " with ".join(f"parallelism.{axis}={getattr(self.dims, axis)}" for axis in axes)
                raise ConfigError(
                    f"{given} with model.task: {task} is not built yet (a {record.human} takes each of them "
                    f"alone, with tp, sequence_parallel and dp); use {axes[-1]}: 1 or {axes[0]}: 1"
                )
        for axis, size, what in not_built(self.dims, "lora") if use_lora else ():
            raise ConfigError(
                f"lora.use_lora with parallelism.{axis}={size} is not supported yet (LoRA's adapters are not built "
                f"into {what} yet); use {axis}: 1, or train the full model"
            )
        with named_by_config():
            check_model(model_config, self.dims, head=record.pipeline_head, **axis_options(self.parallelism))

    def tune_host_allocator(self) -> str:
        """Under pipeline parallelism tune the host allocator for a lean resident set: memory is what stages are for.

        The platform's speed tuning keeps every freed block below 1 GiB in the heap for reuse; with stages, the
        gradients freed and re-allocated each step then left 15-30% of a rank's resident memory as retained free
        blocks (SmolLM2-135M at pp = 2: 1.30 of ``hftrain plan``'s model states), and glibc's adaptive defaults
        0-25% at random; the lean setting keeps peaks within 6% (``benchmarks/pipeline_memory.py``).
        """
        return self.platform.tune_host_allocator(lean=self.dims.pp > 1)

    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        # MULTI_CPU/MULTI_GPU gives the process group and accumulate()'s no_sync; the model is never prepare()d.
        return {"cpu": self.platform.is_cpu}

    def describe(self) -> dict[str, Any]:
        """The layout (every group's size: tp, pp, dp, and the groups of the other axes in use) with the options of
        the axes in use (tp's always), for the start-of-run log and ``hftrain_strategy.json``."""
        used = {axis for axis in self.dims.axes if getattr(self.dims, axis, 1) > 1}
        return {
            "type": "megatron",
            **self.dims.group_sizes,
            **self.parallelism.options(used | {"tp"}),
            "shard_optimizer": self.config.shard_optimizer,
            "checkpoint_format": "sharded (torch.distributed.checkpoint)",
            **({"num_microbatches": num_microbatches(self.parallelism)} if self.dims.pp > 1 else {}),
        }

    def summary(self, training: TrainingConfig, accelerator: Accelerator) -> dict[str, Any]:
        summary = super().summary(training, accelerator)
        micro, gas = training.per_device_train_batch_size, training.gradient_accumulation_steps
        return {**summary, "dp_size": self.dims.dp, "global_batch": micro * gas * self.dims.dp}

    def build_runtime(self, accelerator: Accelerator, task: RuntimeTask) -> MegatronRuntime:
        from hftrain.strategies.megatron.plugin import MegatronPlugin

        plugin = MegatronPlugin(self.parallelism, shard_optimizer=self.config.shard_optimizer).setup(
            device_type=self.platform.device, dims=self.dims
        )
        if self.dims.pp > 1:  # the stages run through the pipeline schedule
            from hftrain.strategies.megatron.pipeline_runtime import PipelineOptions, PipelineRuntime

            options = PipelineOptions(
                schedule=self.parallelism.schedule,
                num_microbatches=num_microbatches(self.parallelism),
                virtual_stages=self.parallelism.virtual_stages,
                balance=self.parallelism.balance,
            )
            return PipelineRuntime(
                accelerator,
                plugin,
                options,
                task=task,
                release_freed_memory=self.platform.release_freed_memory,
                block_loading=self.block_loading,
            )
        from hftrain.strategies.megatron.runtime import MegatronRuntime

        return MegatronRuntime(accelerator, plugin, task=task, block_loading=self.block_loading)

    def block_loading(self, accelerator: Accelerator) -> BlockLoading | None:
        """Each rank reads its pipeline stages' blocks only, and under tp only its slice of each split tensor, as
        ``prepare`` splits it (``hftrain.strategies.megatron.loading``); None where the layout's split is not tp's
        per block (an axis's own refusal), said in one line: every rank then loads its stages' part (pp) or the whole
        model."""
        from hftrain.strategies.megatron.loading import MegatronLoading, refusal

        why = refusal(self.dims)
        if why is not None:
            from hftrain.models.weights import say_loaded_whole

            say_loaded_whole(why, stages_only=self.dims.pp > 1)
            return None
        return MegatronLoading(tp=self.dims.tp, pp=self.dims.pp)
