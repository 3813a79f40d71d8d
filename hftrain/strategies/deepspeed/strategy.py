"""DeepSpeed ZeRO stages 1-3, with optimizer (stage 2/3) and parameter (stage 3) offload to CPU.

ZeRO partitions over the ``N`` data-parallel ranks (Ψ parameters, mixed-precision Adam, per rank):
stage 1 shards the optimizer state (4Ψ + 12Ψ/N bytes), stage 2 also the gradients (2Ψ + 14Ψ/N), stage 3
also the parameters (16Ψ/N). Collectives: stage 1/2 reduce-scatter gradients and all-gather updated
parameters after the step; stage 3 all-gathers each layer's parameters before its forward and backward.

The DeepSpeed JSON is the one source of batch truth: hftrain writes ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` and ``train_batch_size = micro × accumulation × dp size`` into it, so
DeepSpeed's batch assertion cannot fire (pitfall "DeepSpeed batch-size assertion", docs/pitfalls.md), and rejects a
JSON whose numbers contradict them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hftrain.errors import ConfigError
from hftrain.files import read_input
from hftrain.strategies.base import Strategy
from hftrain.strategies.loading import replica_loading

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hftrain.config import TrainingConfig
    from hftrain.models.weights import BlockLoading
    from hftrain.strategies.deepspeed.runtime import ZeroRuntime
    from hftrain.strategies.runtime import RuntimeTask


MODEL_SIZED: dict[str, tuple[int, Any]] = {
    # zero_optimization key: (the lowest stage that reads it, its value from the model's hidden size h)
    "reduce_bucket_size": (1, lambda h: h * h),
    "stage3_prefetch_bucket_size": (3, lambda h: int(0.9 * h * h)),
    "stage3_param_persistence_threshold": (3, lambda h: 10 * h),
    "stage3_max_live_parameters": (3, lambda h: 24 * h * h),
    "stage3_max_reuse_distance": (3, lambda h: 24 * h * h),
    "sub_group_size": (3, lambda h: 24 * h * h),
}
"""DeepSpeed's buffer and residency limits that hftrain sets from the model where the JSON says ``"auto"`` (the
shipped configs do). The first three are the HF integration's own values (Accelerate and transformers fill them
alike); DeepSpeed's defaults (5e8-element reduce bucket, 1e9 live parameters and reuse distance) are sized for
models of billions of parameters and, below that, keep the whole gradient in one bucket copy and every gathered
ZeRO-3 layer alive from its forward until its backward: a whole unsharded model on each rank. hftrain's limits keep
about two transformer layers (12h² parameters each) gathered at a time: the memory ZeRO-3 promises, for one more
all-gather of a layer that the backward reuses. ``sub_group_size`` (DeepSpeed's 1e9) is how many of a rank's
parameters one optimizer step takes at a time: ZeRO-3 flattens that many gradients into a fresh fp32 copy for the
step (``_prepare_fp32_grad_for_sub_group``), so below 1e9 parameters per rank its default copies every gradient the
rank holds once more at each step (+4Ψ/N bytes: 0.63 GB per rank for a 322M model on 2 ranks, measured); at 24h²
the copy is two layers'. What each one trades: docs/strategies.md."""


def fill_model_sized(config: dict[str, Any], model_config: Any) -> dict[str, int]:
    """Fill the ``"auto"`` keys of :data:`MODEL_SIZED` in ``config`` from the model's hidden size; returns them.

    Args:
        config: the DeepSpeed config, modified in place.
        model_config: the model's ``transformers`` config (``hidden_size``, or the largest of ``hidden_sizes``).
    """
    zero = config.get("zero_optimization", {})
    auto = [key for key in MODEL_SIZED if zero.get(key) == "auto"]
    if not auto:
        return {}
    hidden = getattr(model_config, "hidden_size", None) or max(getattr(model_config, "hidden_sizes", None) or [0])
    if not hidden:
        raise ConfigError(
            f'DeepSpeed JSON: zero_optimization.{auto[0]} is "auto" but the model\'s config has no hidden_size to '
            "size it from; give a number"
        )
    filled = {key: int(MODEL_SIZED[key][1](hidden)) for key in auto}
    zero.update(filled)
    return filled


def default_ds_config(stage: int, *, offload_optimizer: bool = False, offload_params: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON hftrain ships for a stage (``ds_configs/zero*.json`` are these, written out).

    Args:
        stage: ZeRO stage 1, 2 or 3.
        offload_optimizer: optimizer state and step on the CPU (stage 2/3).
        offload_params: parameters in CPU memory (stage 3).
    """
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # Without it save_pretrained under ZeRO-3 writes each rank's empty partition
        # (pitfall "ZeRO-3 save_pretrained writes empty weights", docs/pitfalls.md).
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    zero.update({key: "auto" for key, (lowest, _) in MODEL_SIZED.items() if stage >= lowest})
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO at ``stage`` through Accelerate's ``DeepSpeedPlugin``."""

    stage: ClassVar[int]
    shards_model_states = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import deepspeed  # noqa: F401
        except Exception as error:  # a broken install raises more than ImportError
            return f"deepspeed does not import ({type(error).__name__}: {error})"
        return None

    def preflight(self, training: TrainingConfig) -> None:
        """Validate the DeepSpeed JSON against the job and build the CPU Adam op if offload needs it."""
        if self._offloads_optimizer(self.ds_config(training)):
            check_cpu_adam()
        if self.launch.world_size < 2:
            raise ConfigError(
                f"strategy '{self.name}' partitions across processes but 1 was launched; start 2 or more "
                "(torchrun --nproc_per_node N / accelerate launch) or use ddp"
            )

    def resolve_optim(self, optim: str) -> str:
        """Under optimizer offload Accelerate replaces the torch optimizer by DeepSpeed's CPU Adam: no fused kernel."""
        if not self._offloads_optimizer(self._base_config()):
            return super().resolve_optim(optim)
        if optim == "adamw_torch_fused":
            raise ConfigError(
                f"training.optim: adamw_torch_fused cannot run under strategy '{self.name}' with optimizer offload "
                "(DeepSpeed steps its CPU Adam instead); set optim: auto or adamw_torch"
            )
        return "adamw_torch"

    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin

        config = self.ds_config(training)
        plugin = DeepSpeedPlugin(
            hf_ds_config=config,
            zero3_init_flag=self.stage == 3,
            zero3_save_16bit_model=self.stage == 3,
        )
        self._plugin = plugin
        kwargs: dict[str, Any] = {"deepspeed_plugin": plugin}
        if self.platform.is_cpu:
            # DeepSpeed on CPU: gloo, and *not* cpu=True (which would bypass DeepSpeed altogether).
            kwargs["kwargs_handlers"] = self.platform.process_group_handlers()
        return kwargs

    def ds_config(self, training: TrainingConfig) -> dict[str, Any]:
        """The DeepSpeed config for this run: the user's or launcher's JSON, or the shipped default, filled."""
        config = self._base_config()
        self._check_zero_section(config)
        fill_batch_settings(config, training, dp_size=self.dp_size)
        return config

    @property
    def dp_size(self) -> int:
        return self.launch.world_size

    def build_runtime(self, accelerator: Accelerator, task: RuntimeTask) -> ZeroRuntime:
        """A runtime that checkpoints ZeRO's partitions in the sharded format (``runtime.py`` beside this file)."""
        from hftrain.strategies.deepspeed.runtime import ZeroRuntime

        plugin = self._plugin
        return ZeroRuntime(
            accelerator,
            stage=self.stage,
            size_from_model=lambda model: fill_model_sized(plugin.deepspeed_config, model.config),
            **self.runtime_hooks(task),
        )

    def block_loading(self, accelerator: Accelerator) -> BlockLoading | None:
        """ZeRO-3 partitions each block as it is read; under ZeRO-1/2 the engine broadcasts rank 0's parameters,
        so the other ranks need the memory, not the reads (``hftrain.strategies.loading``)."""
        if self.stage < 3:
            return replica_loading(f"ZeRO-{self.stage}", accelerator)
        from hftrain.strategies.deepspeed.loading import Zero3Loading

        zero = self._plugin.deepspeed_config.get("zero_optimization", {})
        return Zero3Loading(zero, str(accelerator.mixed_precision))

    def describe(self) -> dict[str, Any]:
        zero = self._base_config().get("zero_optimization", {})
        return {
            "type": "deepspeed",
            "zero_stage": self.stage,
            "offload_optimizer": _device(zero, "offload_optimizer"),
            "offload_params": _device(zero, "offload_param"),
            "sharded": ["optimizer state", "gradients", "parameters"][: self.stage],
        }

    def _base_config(self) -> dict[str, Any]:
        path = self._config_path()
        if path is None:
            return default_ds_config(
                self.stage, offload_optimizer=self.config.offload_optimizer, offload_params=self.config.offload_params
            )
        try:
            config = json.loads(read_input(path, "strategy.deepspeed_config"))
        except OSError:
            raise ConfigError(
                f"strategy.deepspeed_config: cannot read '{path}'; give an existing DeepSpeed JSON"
            ) from None
        except ValueError as error:
            raise ConfigError(
                f"strategy.deepspeed_config: '{path}' is not valid JSON ({error}); fix the file"
            ) from None
        if not isinstance(config.get("zero_optimization"), dict):
            raise ConfigError(f"strategy.deepspeed_config: '{path}' has no zero_optimization section; add one")
        if self.config.offload_optimizer and not _device(config["zero_optimization"], "offload_optimizer"):
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.config.offload_params and not _device(config["zero_optimization"], "offload_param"):
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        return config

    def _config_path(self) -> str | None:
        launched = (self.launch.accelerate_settings or {}).get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        launched = None if launched in (None, "none") else launched
        mine = self.config.deepspeed_config
        if mine and launched and Path(mine).resolve() != Path(launched).resolve():
            raise ConfigError(
                f"strategy.deepspeed_config is '{mine}' but the accelerate config's deepspeed_config_file is "
                f"'{launched}'; make them the same file or drop one"
            )
        return mine or launched

    def _check_zero_section(self, config: dict[str, Any]) -> None:
        zero = config["zero_optimization"]
        if zero.get("stage", self.stage) != self.stage:
            raise ConfigError(
                f"strategy '{self.name}' runs ZeRO stage {self.stage} but the DeepSpeed JSON sets "
                f"zero_optimization.stage {zero.get('stage')}; make them agree"
            )
        zero["stage"] = self.stage
        if _device(zero, "offload_optimizer") and self.stage < 2:
            raise ConfigError(
                f"strategy '{self.name}': optimizer offload needs ZeRO stage 2 or 3; "
                "use zero2/zero3 or set offload_optimizer: false"
            )
        if _device(zero, "offload_param") and self.stage < 3:
            raise ConfigError(
                f"strategy '{self.name}': parameter offload needs ZeRO stage 3; use zero3 or set offload_params: false"
            )
        if self.stage == 3:
            zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
            if zero["stage3_gather_16bit_weights_on_model_save"] is not True:
                raise ConfigError(
                    "DeepSpeed JSON: zero_optimization.stage3_gather_16bit_weights_on_model_save must be true under "
                    "ZeRO-3, or save_pretrained writes empty weights; set it to true"
                )

    def _offloads_optimizer(self, config: dict[str, Any]) -> bool:
        return bool(_device(config["zero_optimization"], "offload_optimizer"))


def fill_batch_settings(config: dict[str, Any], training: TrainingConfig, *, dp_size: int) -> None:
    """Write hftrain's batch, clipping and precision settings into a DeepSpeed config ("auto" or equal only).

    Args:
        config: the DeepSpeed config, modified in place.
        training: the ``training`` config section.
        dp_size: data-parallel processes.
    """
    micro, gas = training.per_device_train_batch_size, training.gradient_accumulation_steps
    wanted = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp_size,
        "gradient_clipping": training.max_grad_norm,
    }
    for key, value in wanted.items():
        _fill(config, key, value, f"training settings give {value}")
    for precision in ("bf16", "fp16"):
        section = config.setdefault(precision, {})
        _fill(
            section,
            "enabled",
            training.mixed_precision == precision,
            f"training.mixed_precision is '{training.mixed_precision}'",
            label=f"{precision}.enabled",
        )


def _fill(section: dict[str, Any], key: str, value: Any, reason: str, *, label: str | None = None) -> None:
    current = section.get(key, "auto")
    if current != "auto" and current != value:
        raise ConfigError(
            f"DeepSpeed JSON: {label or key} is {current!r} but {reason}; "
            'set it to "auto" (hftrain fills it) or make them agree'
        )
    section[key] = value


def _device(zero: dict[str, Any], key: str) -> str | None:
    device = (zero.get(key) or {}).get("device", "none")
    return None if device in (None, "none") else device


def cpu_adam_status() -> str | None:
    """None when DeepSpeed's CPU Adam op loads (building it once if needed), else why not."""
    try:
        check_cpu_adam()
    except ConfigError as error:
        return str(error).split(": ", 1)[1]
    return None


def check_cpu_adam() -> None:
    """Build (or load the cached) DeepSpeed CPU Adam op now, so a broken toolchain fails before training."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # the JIT build raises many types: compiler, ninja, headers
        reason = str(error).strip().splitlines()[-1][:200] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"strategy.offload_optimizer: DeepSpeed's CPU Adam op cannot be built ({reason}); install a C++ compiler, "
            "ninja and the Python headers, or set offload_optimizer: false"
        ) from None


class Zero1Strategy(ZeroStrategy):
    """ZeRO-1: optimizer state sharded."""

    name = "zero1"
    stage = 1


class Zero2Strategy(ZeroStrategy):
    """ZeRO-2: optimizer state and gradients sharded."""

    name = "zero2"
    stage = 2


class Zero3Strategy(ZeroStrategy):
    """ZeRO-3: optimizer state, gradients and parameters sharded."""

    name = "zero3"
    stage = 3

    def model_init_context(self) -> contextlib.AbstractContextManager:
        """Build the model outside ``deepspeed.zero.Init``; DeepSpeed partitions it in ``prepare``.

        Under ``zero.Init`` transformers initialises new parameters (the classification head) on partitions,
        and they come out different from a single-process run (pitfall "ZeRO-3 leaves the new head uninitialised",
        docs/pitfalls.md, transformers#28244). Building
        the full model once per process and letting ``deepspeed.initialize`` partition it gives exactly the
        reference initialisation; it costs one full copy of the model in host memory during construction.
        """
        return without_hf_zero3(self._plugin)


@contextlib.contextmanager
def without_hf_zero3(plugin: Any) -> Iterator[None]:
    # transformers decides on zero.Init from a global weak reference to the DeepSpeed config; Accelerate's
    # zero3_init_context_manager(enable=False) leaves that reference in place, so unset it and restore it.
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()
