"""Strategy registry: a new strategy is one file and one line in ``_REGISTRY``."""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError
from hftrain.strategies.base import LaunchInfo, Strategy

if TYPE_CHECKING:
    from hftrain.config import ParallelismConfig, StrategyConfig
    from hftrain.strategies.platform import Platform

# name -> "module:Class", imported only when chosen so that heavy backends stay lazy.
_REGISTRY: dict[str, str] = {
    "ddp": "hftrain.strategies.ddp:DDPStrategy",
    "fsdp": "hftrain.strategies.fsdp:FSDPStrategy",
    "zero1": "hftrain.strategies.deepspeed.strategy:Zero1Strategy",
    "zero2": "hftrain.strategies.deepspeed.strategy:Zero2Strategy",
    "zero3": "hftrain.strategies.deepspeed.strategy:Zero3Strategy",
    "megatron": "hftrain.strategies.megatron:MegatronStrategy",
}


def available_strategies() -> list[str]:
    """Names a config may give in ``strategy.name``."""
    return list(_REGISTRY)


def strategy_class(name: str) -> type[Strategy]:
    """The registered class for ``name``; an unknown name is a ``ConfigError`` naming the closest one."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of {', '.join(_REGISTRY)}"
        raise ConfigError(f"strategy.name: unknown strategy '{name}'; {hint}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_strategy(
    config: StrategyConfig,
    *,
    launch: LaunchInfo,
    platform: Platform | None = None,
    parallelism: ParallelismConfig | None = None,
) -> Strategy:
    """Resolve the strategy from the config and the launcher, and construct it.

    Args:
        config: the ``strategy`` config section.
        launch: what the launcher said (world size, the accelerate config's strategy).
        platform: device/backend; detected when None.
        parallelism: the ``parallelism`` section (the defaults when None: no axis splits the model).
    """
    from hftrain.strategies.platform import Platform

    name = resolve_strategy_name(config.name, launch.accelerate_strategy)
    cls = strategy_class(name)
    return cls(config, platform=platform or Platform.detect(), launch=launch, parallelism=parallelism)


def strategy_from_options(
    name: str | None, options: dict[str, Any] | None = None, *, launch: LaunchInfo, platform: Platform | None = None
) -> Strategy:
    """:func:`build_strategy` from flat options (``{"tp": 2, "shard_optimizer": True}``), for code that builds a
    job without a config file: each option goes to the section that owns it (``strategy`` or ``parallelism``), as a
    bare ``--tp`` does on the command line.

    Args:
        name: the strategy (None: the launcher's, else ``ddp``).
        options: fields of ``StrategyConfig`` and ``ParallelismConfig``; an unknown one is a ``ConfigError``.
        launch: what the launcher said.
        platform: device/backend; detected when None.
    """
    from hftrain.config import ParallelismConfig, StrategyConfig, nest_fields

    sections = nest_fields({"name": name, **(options or {})}, source="strategy options")
    other = sorted(set(sections) - {"strategy", "parallelism"})
    if other:
        field = next(iter(sections[other[0]]))
        raise ConfigError(f"strategy options: '{field}' is a field of section '{other[0]}', not a strategy option")
    config = StrategyConfig(**sections["strategy"])
    return build_strategy(
        config, launch=launch, platform=platform, parallelism=ParallelismConfig(**sections.get("parallelism", {}))
    )


def resolve_strategy_name(configured: str | None, launched: str | None) -> str:
    """The config's strategy, else the launcher's, else ``ddp``; a disagreement is an error."""
    if configured and launched and configured != launched:
        raise ConfigError(
            f"strategy.name is '{configured}' but accelerate launch's config selects '{launched}'; "
            "make them agree or drop one of them"
        )
    return configured or launched or "ddp"


__all__ = [
    "LaunchInfo",
    "Strategy",
    "available_strategies",
    "build_strategy",
    "strategy_class",
    "strategy_from_options",
]
