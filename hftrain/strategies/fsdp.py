"""FSDP: parameters, gradients and optimizer state sharded across processes, gathered layer by layer.

FSDP1 (``FullyShardedDataParallel``) keeps each wrapped layer as one flat parameter; FSDP2 (``fully_shard``)
keeps every parameter as a DTensor sharded on dim 0. Both wrap each transformer layer (the model's
``_no_split_modules``) as its own unit, so only one layer is gathered at a time.

Fixed by hftrain whatever the launcher says: ``use_orig_params=True`` for FSDP1 (real parameter names for the
optimizer groups and PEFT, pitfall "PEFT + FSDP1 key prefixes", docs/pitfalls.md) and sharded resume checkpoints
(``SHARDED_STATE_DICT``, pitfall "FSDP state-dict type confusion", docs/pitfalls.md;
the ``save_pretrained`` export always gathers the full state). On CPU, Accelerate never selects FSDP by
itself; ``Platform.force_fsdp`` sets the state after construction.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accelerate.utils import FullyShardedDataParallelPlugin

from hftrain.errors import ConfigError
from hftrain.strategies.base import Strategy
from hftrain.strategies.loading import BlockLoading, ShardedLoading

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from hftrain.config import StrategyConfig, TrainingConfig
    from hftrain.models.weights import Weights

# FSDP2 has one knob: reshard parameters after forward (FULL_SHARD) or keep them until backward (SHARD_GRAD_OP).
# NO_SHARD maps to False as in Accelerate's ``to_fsdp2`` (used to compare with a launcher's setting); a job that
# asks FSDP2 for NO_SHARD is refused, since FSDP2 would still shard between steps.
RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "HYBRID_SHARD": True, "SHARD_GRAD_OP": False, "NO_SHARD": False}
# torch's ShardingStrategy order (enum value - 1), as Accelerate's config files may give numbers.
ACCELERATE_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


@dataclass(frozen=True)
class FSDPSettings:
    """The FSDP settings a run uses: hftrain's config merged with ``accelerate launch``'s."""

    fsdp_version: int
    sharding_strategy: str
    offload_params: bool


class FSDPStrategy(Strategy):
    """FSDP1 or FSDP2 through Accelerate's ``FullyShardedDataParallelPlugin``; every check runs at construction.

    Args:
        config: the ``strategy`` config section.
        platform: device and backend of this machine.
        launch: what the launcher set up (its ``FSDP_*`` settings must agree with ``config``).
    """

    shards_model_states = True

    name = "fsdp"

    def __init__(self, config: StrategyConfig, **context: Any) -> None:
        super().__init__(config, **context)  # platform, launch, parallelism: see Strategy
        platform, launch = self.platform, self.launch
        launched = (launch.accelerate_settings or {}) if launch.accelerate_strategy == "fsdp" else {}
        self.settings = resolve_settings(config, launched)
        self.single_node = launch.local_world_size == launch.world_size
        s = self.settings
        if launch.world_size < 2:
            raise ConfigError("strategy 'fsdp' shards across processes but 1 was launched; launch 2 or more or use ddp")
        if self.hybrid_mesh is not None and launch.world_size % launch.local_world_size:
            raise ConfigError(
                f"strategy.sharding_strategy HYBRID_SHARD shards inside a node and replicates across nodes: every node "
                f"must run as many processes ({launch.local_world_size} here, {launch.world_size} in all); launch the "
                "same number per node, or use FULL_SHARD"
            )
        if s.sharding_strategy == "NO_SHARD" and s.fsdp_version == 2:  # FSDP2 would still shard: no silent swap
            raise ConfigError("strategy.sharding_strategy NO_SHARD has no FSDP2 form; use ddp, or fsdp_version 1")
        if platform.is_cpu and s.offload_params:  # torch pins the offloaded memory, which needs an accelerator
            raise ConfigError("strategy.offload_params needs a GPU (on CPU the parameters are in CPU memory already)")
        if platform.is_cpu and launched.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true":
            raise ConfigError("fsdp_cpu_ram_efficient_loading needs a GPU; set it to false in the accelerate config")
        self.plugin: FullyShardedDataParallelPlugin | None = None

    def accelerator_kwargs(self, training: TrainingConfig) -> dict[str, Any]:
        # No cpu=True: on CPU that would make MULTI_CPU (DDP); the gloo group comes from the handler instead.
        self.plugin = self.build_plugin()
        handlers = self.platform.process_group_handlers(cpu_collectives=self.settings.offload_params)
        return {"fsdp_plugin": self.plugin, "kwargs_handlers": handlers}

    @property
    def hybrid_mesh(self) -> tuple[int, int] | None:
        """FSDP2's hybrid sharding across nodes as ``(replicas, shards)``: a 2-D mesh of the nodes (replicated,
        gradients all-reduced across them) by each node's processes (sharded, reduce-scattered inside a node); None
        where the sharding is not hybrid, is FSDP1's (its own process groups) or runs on one node (full sharding)."""
        s = self.settings
        if s.sharding_strategy != "HYBRID_SHARD" or s.fsdp_version != 2 or self.single_node:
            return None
        local = self.launch.local_world_size
        return self.launch.world_size // local, local

    def configure_accelerator(self, accelerator: Accelerator) -> None:
        self.platform.force_fsdp(accelerator, self.plugin)
        if self.hybrid_mesh is not None:
            # Accelerate's HSDP: fully_shard over mesh["dp_replicate", "dp_shard_cp"] (fsdp2_prepare_model, and
            # FSDP2Loading for the blocks). Set on the state after construction: on CPU the state becomes FSDP only
            # here (force_fsdp), and Accelerate's constructor refuses a parallelism config for a non-FSDP state.
            from accelerate.parallelism_config import ParallelismConfig

            replicas, shards = self.hybrid_mesh
            config = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=shards)
            accelerator.state.parallelism_config = config
            accelerator.state.device_mesh = config.get_device_mesh(accelerator.device.type)

    def build_plugin(self) -> FullyShardedDataParallelPlugin:
        """Accelerate's plugin for these settings (fields not set here come from the launcher's ``FSDP_*``)."""
        s = self.settings
        # On one node, hybrid (shard inside a node, replicate across nodes) is exactly full sharding.
        sharding = "FULL_SHARD" if s.sharding_strategy == "HYBRID_SHARD" and self.single_node else s.sharding_strategy
        common = {
            "fsdp_version": s.fsdp_version,
            "auto_wrap_policy": "transformer_based_wrap",
            "cpu_offload": s.offload_params,
            "state_dict_type": "SHARDED_STATE_DICT",
        }
        if s.fsdp_version == 2:
            return LayerWrapPlugin(reshard_after_forward=RESHARD_AFTER_FORWARD[sharding], **common)
        # FSDP1 reads sharding_strategy before reshard_after_forward (and the launcher always exports one), so it
        # is given explicitly despite Accelerate's deprecation warning. Every rank builds the same weights (same
        # seed), so no broadcast from rank 0 is needed; Accelerate's broadcast needs a GPU.
        return FullyShardedDataParallelPlugin(
            sharding_strategy=sharding, use_orig_params=True, sync_module_states=False, **common
        )

    def block_loading(self, accelerator: Accelerator) -> BlockLoading | None:
        """FSDP2 shards each block as it is read (:class:`FSDP2Loading`); FSDP1 leaves the blocks on ``meta`` and
        reads each as ``prepare`` wraps it (:class:`FSDP1Loading`: its flat parameters are made there)."""
        if self.settings.fsdp_version == 2:
            return FSDP2Loading(accelerator)
        return FSDP1Loading(accelerator.state.fsdp_plugin)

    def describe(self) -> dict[str, Any]:
        s = self.settings
        facts: dict[str, Any] = {
            "fsdp_version": s.fsdp_version,
            "sharding_strategy": s.sharding_strategy,
            "offload_params": s.offload_params,
            "state_dict_type": "SHARDED_STATE_DICT",
        }
        if s.sharding_strategy == "HYBRID_SHARD" and self.single_node:
            facts["note"] = "HYBRID_SHARD on one node is FULL_SHARD"
        if self.hybrid_mesh is not None:
            replicas, shards = self.hybrid_mesh
            facts["mesh"] = f"{replicas} replicas (nodes) × {shards} shards (processes per node)"
        return facts


class FSDP2Loading(ShardedLoading):
    """Each block ``fully_shard``-ed as soon as it is read, with the arguments Accelerate's FSDP2 preparation gives
    every wrapped layer (``accelerate.utils.fsdp_utils.fsdp2_prepare_model``, 1.15: the plugin's
    ``reshard_after_forward``, ``cpu_offload`` and mixed-precision policy, and the accelerator's mesh), after the
    same fp32 upcast of trained parameters under mixed precision. ``prepare`` then skips the blocks (already
    ``FSDPModule``) and shards the rest as before, and maps the optimizer's parameters to the sharded ones by their
    local tensors, which the blocks already are.

    LoRA adapters are not taken: added after this, they would belong to no block's unit.
    """

    name = "FSDP2"
    supports_lora = False

    def __init__(self, accelerator: Accelerator) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        plugin = accelerator.state.fsdp_plugin
        mesh = getattr(accelerator, "torch_device_mesh", None)
        self._kwargs = {
            "reshard_after_forward": plugin.reshard_after_forward,
            "offload_policy": plugin.cpu_offload,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
            "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
        }
        self._upcast = accelerator.mixed_precision != "no"

    def shard(self, block: torch.nn.Module) -> None:
        import torch
        from torch.distributed.fsdp import fully_shard

        if self._upcast:
            for param in block.parameters():
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.to(torch.float32)
        fully_shard(block, **self._kwargs)


class FSDP1Loading(BlockLoading):
    """The blocks left on ``meta`` until FSDP1 wraps them; each is read when its unit is built, then sharded.

    FSDP1 makes a unit's flat parameter in its constructor (``prepare``), one unit at a time: the auto-wrap policy
    wraps the ``_no_split_modules`` layers in post-order (``torch.distributed.fsdp._wrap_utils._auto_wrap``), the
    root last. A unit whose parameters are on ``meta`` is first materialised by ``param_init_fn(module)``, called
    for every module of the unit that no inner unit took (``_init_utils._materialize_with_param_init_fn``,
    breadth-first); then FSDP moves it to ``device_id``, flattens it into one ``FlatParameter`` and keeps this
    rank's ``1/N`` of it (``use_orig_params=True``: the parameters become views of the shard). So the plugin's
    ``param_init_fn`` is :meth:`init_module`, which gives each module of a block host memory and reads its own
    parameters (``recurse=False``) with ``pread``: a rank holds its shards plus one block (plus its flat copy while
    FSDP flattens it), never the whole model. The root unit (embeddings, final norm, the new head) was loaded by
    ``from_pretrained`` and is not materialised again. No collective: every rank reads its blocks from the folder.

    The optimizer is built before ``prepare`` over the ``meta`` parameters, and Accelerate's FSDP1 preparation does
    not remap its parameters (``use_orig_params=True`` keeps the original ``Parameter`` objects as views of the
    flat shard). So a parameter is materialised in place (``torch.utils.swap_tensors``: the same object, now host
    memory), never replaced as ``Module.to_empty`` replaces a ``meta`` parameter.

    A wrap policy that puts a block in a larger unit (an ``accelerate launch`` that names other classes to wrap)
    still loads exactly: that unit reads all its blocks when it is wrapped. LoRA adapters are not taken: PEFT moves
    each new adapter to its base layer's device (``meta``), dropping the values it drew from the random stream.

    Args:
        plugin: the run's FSDP1 plugin; its ``param_init_fn`` is set when the blocks are left on ``meta``. One it
            had already (Accelerate's ``to_empty`` under ``cpu_ram_efficient_loading``) is kept for the modules
            that are not in a block.
    """

    name = "FSDP1"
    supports_lora = False

    def __init__(self, plugin: FullyShardedDataParallelPlugin) -> None:
        self._plugin = plugin
        self._paths: dict[torch.nn.Module, str] = {}  # every module of a block still on meta -> its dotted path
        self._weights: Weights | None = None
        self._previous: Any = None

    def materialize(self, model: torch.nn.Module, blocks: list[str], weights: Weights) -> None:
        for path in blocks:
            for name, module in model.get_submodule(path).named_modules():
                self._paths[module] = f"{path}.{name}" if name else path
        self._weights = weights
        self._previous, self._plugin.param_init_fn = self._plugin.param_init_fn, self.init_module

    def init_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """FSDP1's ``param_init_fn``: give ``module``'s own ``meta`` parameters host memory and the file's values;
        returns ``module`` (Accelerate's ``ensure_weights_retied`` wrapper reads it)."""
        import torch

        path = self._paths.pop(module, None)
        if path is None:  # outside every block: loaded by from_pretrained, or the previous init function's
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if not any(t.is_meta for t in own):
                return module
            assert self._previous is not None, f"{type(module).__name__} on meta is in no block FSDP1Loading read"
            return self._previous(module) or module
        assert self._weights is not None
        for name, param in module.named_parameters(recurse=False):
            if not param.is_meta:  # tied to a parameter read already
                continue
            entry = self._weights.find(f"{path}.{name}", tuple(param.shape))
            assert entry is not None, f"{path}.{name}: blocks_in chose a block whose tensor is not stored"
            host = torch.nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
            self._weights.read_into(entry, host.data)
            host.__dict__.update(param.__dict__)  # swap_tensors swaps the attributes too: keep the parameter's own
            torch.utils.swap_tensors(param, host)
        return module

    def describe(self, count: int) -> str:
        return (
            f"{count} transformer blocks read from the safetensors files one at a time and sharded ({self.name}: "
            "left on meta, each read as prepare wraps it)"
        )


class LayerWrapPlugin(FullyShardedDataParallelPlugin):
    """Accelerate's plugin, wrapping no layer class that contains the input embeddings under FSDP2.

    Accelerate's FSDP2 preparation (1.15) wraps the ``_no_split_modules`` classes, then shards the input
    embeddings as a unit of their own; when a wrapped class contains them (BERT's ``BertEmbeddings``) they are
    sharded twice and ``fully_shard`` fails. Such a class is left to the root unit instead.

    A class whose every layer :class:`FSDP2Loading` sharded as it was read is named as ``fully_shard`` renamed it
    (``FSDP`` + the name): Accelerate looks the wrapped classes up by name and refuses one it cannot find, and skips
    the layers that are ``FSDPModule`` already.
    """

    def set_auto_wrap_policy(self, model: torch.nn.Module) -> None:
        if self.fsdp_version == 2 and self.transformer_cls_names_to_wrap is None:
            embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            holders = {type(m).__name__ for m in model.modules() if m is not embeddings and embeddings in m.modules()}
            self.transformer_cls_names_to_wrap = sorted(set(getattr(model, "_no_split_modules", None) or ()) - holders)
        if self.fsdp_version == 2 and self.transformer_cls_names_to_wrap:
            present = {type(m).__name__ for m in model.modules()}
            self.transformer_cls_names_to_wrap = [
                f"FSDP{name}" if name not in present and f"FSDP{name}" in present else name
                for name in self.transformer_cls_names_to_wrap
            ]
        super().set_auto_wrap_policy(model)


def resolve_settings(config: StrategyConfig, launched: dict[str, str]) -> FSDPSettings:
    """Merge hftrain's FSDP fields with ``accelerate launch``'s ``FSDP_*`` settings.

    A field hftrain leaves at its default takes the launcher's value; a field it sets must agree with the
    launcher (compared as FSDP2 would run it where that is coarser), else ``ConfigError``.

    Args:
        config: the ``strategy`` section.
        launched: the launcher's ``FSDP_*`` environment (empty without ``accelerate launch``).
    """
    from hftrain.config import StrategyConfig

    default = StrategyConfig()
    version = _merge("fsdp_version", config.fsdp_version, default.fsdp_version, _launched_version(launched))
    if version not in (1, 2):
        raise ConfigError(f"strategy.fsdp_version: {version} is not 1 or 2")
    same_sharding = (lambda a, b: RESHARD_AFTER_FORWARD[a] == RESHARD_AFTER_FORWARD[b]) if version == 2 else None
    sharding = _merge(
        "sharding_strategy",
        config.sharding_strategy,
        default.sharding_strategy,
        _launched_sharding(launched, version),
        same=same_sharding,
    )
    offload = launched.get("FSDP_OFFLOAD_PARAMS")
    offload = _merge(
        "offload_params",
        config.offload_params,
        default.offload_params,
        None if offload is None else offload.lower() == "true",
    )
    return FSDPSettings(fsdp_version=version, sharding_strategy=sharding, offload_params=offload)


def _merge(key: str, mine: Any, default: Any, launched: Any, *, same: Any = None) -> Any:
    if launched is None:
        return mine
    if mine == default:
        return launched
    if not (same or operator.eq)(mine, launched):
        raise ConfigError(
            f"strategy.{key} is {mine!r} but accelerate launch's config sets {launched!r}; make them agree or drop one"
        )
    return mine


def _launched_version(launched: dict[str, str]) -> int | None:
    value = launched.get("FSDP_VERSION")
    if value is None:
        return None
    if not value.isdigit():
        raise ConfigError(f"accelerate config: fsdp_version '{value}' is not 1 or 2")
    return int(value)


def _launched_sharding(launched: dict[str, str], version: int) -> str | None:
    """The launcher's sharding in hftrain's names (FSDP2: its reshard_after_forward flag)."""
    if "FSDP_VERSION" not in launched:
        return None
    reshard = launched.get("FSDP_RESHARD_AFTER_FORWARD", "true").upper()
    if version == 2:
        return "FULL_SHARD" if RESHARD_AFTER_FORWARD.get(reshard, reshard == "TRUE") else "SHARD_GRAD_OP"
    # FSDP1 files written by `accelerate config` name the strategy in fsdp_reshard_after_forward.
    name = reshard if reshard in RESHARD_AFTER_FORWARD else launched.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if name.isdigit() and 1 <= int(name) <= len(ACCELERATE_SHARDINGS):  # Accelerate also accepts enum values
        name = ACCELERATE_SHARDINGS[int(name) - 1]
    if name not in RESHARD_AFTER_FORWARD:
        raise ConfigError(f"accelerate config: fsdp sharding '{name}' is not one of {', '.join(RESHARD_AFTER_FORWARD)}")
    return name
