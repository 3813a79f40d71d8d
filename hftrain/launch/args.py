"""Arguments that launchers add to the training command, translated to hftrain's config.

- DeepSpeed's launcher appends ``--local_rank=N`` to every process's command line (it also sets
  ``LOCAL_RANK``, which is what hftrain and Accelerate read); ``torch.distributed.launch`` passes
  ``--local-rank N``. Both are checked against the environment and dropped.
- ``--deepspeed ds.json`` is the HF Trainer's name for the DeepSpeed JSON: it selects the ZeRO strategy of the
  JSON's stage and sets ``strategy.deepspeed_config``. A config or launcher that selects another strategy is
  an error, never an override.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.errors import ConfigError, ProcessError
from hftrain.files import read_input

if TYPE_CHECKING:
    from hftrain.config import TrainConfig

_LOCAL_RANK = ("--local_rank", "--local-rank")
_LAUNCHER_OPTIONS = (*_LOCAL_RANK, "--deepspeed")


@dataclass(frozen=True)
class LauncherArgs:
    """What remains of the command line for the config, and what the launcher arguments selected.

    Args:
        overrides: config overrides (``--key value``) with the launcher's arguments removed.
        deepspeed_config: the JSON given with ``--deepspeed``, or None.
        deepspeed_strategy: the strategy that JSON's ZeRO stage selects (``zero1``/``zero2``/``zero3``).
    """

    overrides: list[str]
    deepspeed_config: str | None = None
    deepspeed_strategy: str | None = None

    def apply(self, config: TrainConfig) -> TrainConfig:
        """Set the strategy ``--deepspeed`` selected; a config that names another one is an error.

        Args:
            config: the loaded job config (changed in place).
        """
        if self.deepspeed_config is None:
            return config
        given = f"--deepspeed {self.deepspeed_config}"
        strategy = config.strategy
        if strategy.name not in (None, self.deepspeed_strategy):
            raise ConfigError(
                f"strategy.name is '{strategy.name}' but {given} selects '{self.deepspeed_strategy}' (its "
                "zero_optimization.stage); drop one of them or make them agree"
            )
        mine = strategy.deepspeed_config
        if mine and Path(mine).resolve() != Path(self.deepspeed_config).resolve():
            raise ConfigError(
                f"strategy.deepspeed_config is '{mine}' but the command line gives {given}; give one DeepSpeed JSON"
            )
        strategy.name, strategy.deepspeed_config = self.deepspeed_strategy, self.deepspeed_config
        return config


def translate_launcher_args(argv: list[str], environ: Mapping[str, str]) -> LauncherArgs:
    """Strip ``--local_rank`` and ``--deepspeed`` from the training command line and check them.

    Args:
        argv: the arguments after ``hftrain train`` / ``scripts/train.py``.
        environ: the process environment (``LOCAL_RANK``, the accelerate launcher's settings).
    """
    overrides: list[str] = []
    deepspeed: str | None = None
    i = 0
    while i < len(argv):
        name = argv[i].split("=", 1)[0]
        if name not in _LAUNCHER_OPTIONS:
            overrides.append(argv[i])
            i += 1
            continue
        value, i = _value(argv, i)
        if name == "--deepspeed":
            if deepspeed is not None:
                raise ConfigError("--deepspeed is given twice; give one DeepSpeed JSON")
            deepspeed = value
        else:
            _check_local_rank(name, value, environ)
    if deepspeed is None:
        return LauncherArgs(overrides)
    return LauncherArgs(overrides, deepspeed, _deepspeed_strategy(deepspeed, environ))


def _value(argv: list[str], i: int) -> tuple[str, int]:
    """The value of the launcher option at ``argv[i]`` (``--name=value`` or ``--name value``), and the next index."""
    name, eq, value = argv[i].partition("=")
    if eq:
        return value, i + 1
    if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
        raise ConfigError(f"command line: '{name}' needs a value")
    return argv[i + 1], i + 2


def _check_local_rank(name: str, value: str, environ: Mapping[str, str]) -> None:
    if not value.isdigit():
        raise ProcessError(f"command line: {name} '{value}' is not a process index; the launcher passes an integer")
    env_rank = environ.get("LOCAL_RANK")
    if env_rank is not None and env_rank != value:
        raise ProcessError(
            f"command line: {name}={value} but LOCAL_RANK={env_rank} in the environment; start the processes with "
            "one launcher"
        )


def _deepspeed_strategy(path: str, environ: Mapping[str, str]) -> str:
    """The ZeRO strategy a DeepSpeed JSON selects; a launcher that chose FSDP is an error."""
    if environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        raise ConfigError(
            f"--deepspeed {path} asks for DeepSpeed but the accelerate config launched FSDP; launch with a "
            "DeepSpeed accelerate config (accelerate_configs/zero*.yaml) or drop --deepspeed"
        )
    try:
        raw = json.loads(read_input(path, "--deepspeed"))
    except OSError:
        raise ConfigError(f"--deepspeed: cannot read '{path}'; give an existing DeepSpeed JSON") from None
    except ValueError as error:
        raise ConfigError(f"--deepspeed: '{path}' is not valid JSON ({error}); fix the file") from None
    stage = raw.get("zero_optimization", {}).get("stage") if isinstance(raw, dict) else None
    if stage not in (1, 2, 3):
        raise ConfigError(
            f"--deepspeed: '{path}' sets zero_optimization.stage {stage!r}; hftrain runs ZeRO stage 1, 2 or 3"
        )
    return f"zero{stage}"
