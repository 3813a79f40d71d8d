"""Strict dataclass configs: loaded from YAML, overridden from the command line, validated at load.

A config file has one section per dataclass (``model``, ``data``, ``training``, ``strategy``, ``parallelism``,
``lora``). Field names follow transformers' ``TrainingArguments`` where the concept is the same, and Accelerate's
``mixed_precision``/``log_with``. Every field name is unique across sections, so a command-line override
may name the field alone (``--learning_rate 1e-4``) or with its section (``--training.learning_rate=1e-4``).

The dataclasses and their validation are in ``schema``; reading YAML, overrides, coercion and saving in ``loader``.
"""

from __future__ import annotations

from hftrain.config.loader import (
    CONFIG_FILENAME,
    MOVED_KEYS,
    RUN_ID_KEY,
    coerce,
    config_differences,
    config_from_flat,
    from_dict,
    load_config,
    nest_fields,
    save_config,
    set_field,
)
from hftrain.config.schema import (
    PIPELINE_FIELDS,
    RUN_INVARIANT_EXEMPT,
    DataConfig,
    LoraConfig,
    ModelConfig,
    ParallelismConfig,
    StrategyConfig,
    TrainConfig,
    TrainingConfig,
)

__all__ = [
    "CONFIG_FILENAME",
    "MOVED_KEYS",
    "PIPELINE_FIELDS",
    "RUN_ID_KEY",
    "RUN_INVARIANT_EXEMPT",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelismConfig",
    "StrategyConfig",
    "TrainConfig",
    "TrainingConfig",
    "coerce",
    "config_differences",
    "config_from_flat",
    "from_dict",
    "load_config",
    "nest_fields",
    "save_config",
    "set_field",
]
