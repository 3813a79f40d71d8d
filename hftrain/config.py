"""Strict dataclass configs: loaded from YAML, overridden from the command line, validated at load.

A config file has one section per dataclass (``model``, ``data``, ``training``, ``strategy``, ``lora``).
Field names follow transformers' ``TrainingArguments`` where the concept is the same, and Accelerate's
``mixed_precision``/``log_with``. Every field name is unique across sections, so a command-line override
may name the field alone (``--learning_rate 1e-4``) or with its section (``--training.learning_rate=1e-4``).
Unknown keys and wrong types are errors that name the key and the closest valid one; so are an empty file, a key
given twice, and non-finite numbers. A list field takes ``--field a b`` or ``--field a,b`` on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from hftrain.errors import ConfigError

CONFIG_FILENAME = "hftrain_config.yaml"
RUN_ID_KEY = "run_id"
"""The top-level key of a run's saved config that holds its id (``hftrain.checkpoint.run``); a job config that
carries one (a run's saved config reused as a job config) has it ignored: a run's id comes from its output_dir."""


@dataclass
class ModelConfig:
    """What model is fine-tuned."""

    model_name_or_path: str = "embedded:minilm"
    """A local model folder, or an embedded model (``embedded:minilm``, ``embedded:smollm2``)."""
    num_labels: int = 2
    """Number of classes of the sequence-classification head."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """transformers' attention kernel (its ``attn_implementation``). On CPU, eager measured no faster in the default
    job (length-grouped batches: 0.210 vs 0.201 s/step; random order: 2-4% faster), so sdpa stays the default."""

    def validate(self) -> None:
        _require(self.num_labels >= 2, "model.num_labels", "must be at least 2")


@dataclass
class DataConfig:
    """Where the labelled text comes from and how it is cut."""

    dataset_name: str | None = None
    """An embedded dataset (``embedded:rotten_tomatoes``, ``embedded:chinese_reviews``); the default
    when no ``train_file`` is given is ``embedded:rotten_tomatoes``."""
    train_file: str | None = None
    """A local CSV / JSON(L) / Parquet file with a text and an integer label column."""
    validation_file: str | None = None
    """Optional; without it ``validation_split_percentage`` of the training rows are held out."""
    text_column: str = "text"
    label_column: str = "label"
    validation_split_percentage: float = 10.0
    """Percent of training rows held out for validation (seeded, identical on every process)."""
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    max_seq_length: int = 128
    """Texts are truncated to this many tokens; batches are padded only to their longest text."""

    def validate(self) -> None:
        _require(
            not (self.dataset_name and self.train_file),
            "data.dataset_name",
            "and data.train_file are both set; set one (dataset_name: null to use your files)",
        )
        if not self.train_file and not self.dataset_name:
            self.dataset_name = "embedded:rotten_tomatoes"
        _require(0 < self.validation_split_percentage < 100, "data.validation_split_percentage", "must be in (0, 100)")
        _require(self.max_seq_length > 0, "data.max_seq_length", "must be positive")
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"data.{name}", "must be positive or null")


@dataclass
class TrainingConfig:
    """The training loop, with transformers' ``TrainingArguments`` names."""

    output_dir: str = "outputs/minilm-rotten-tomatoes"
    overwrite_output_dir: bool = False
    """Allow reusing an ``output_dir`` that holds a run with a different config."""
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 64
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    num_train_epochs: float = 1.0
    max_steps: int = -1
    """Optimizer steps to run; overrides ``num_train_epochs`` when positive."""
    warmup_steps: int | float = 0
    """Warmup optimizer steps (int), or a ratio of the total steps (float < 1), as in transformers 5."""
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
    ] = "linear"
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: int = 42
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """Accelerate's mixed precision. ``auto``: bf16 where the device computes it natively (a CUDA GPU with bf16, a
    CPU with AMX or AVX512-BF16), else ``no`` (fp32); the choice and its reason are logged. ``no`` pins fp32."""
    optim: Literal["auto", "adamw_torch_fused", "adamw_torch"] = "auto"
    """The AdamW implementation (transformers' names). ``auto``: ``adamw_torch_fused`` (one kernel per step, the
    transformers ``Trainer``'s default) wherever the strategy steps a torch optimizer, else what the strategy brings
    (DeepSpeed's CPU Adam under optimizer offload)."""
    dropout_kernel: Literal["auto", "torch", "bits"] = "auto"
    """How dropout masks are drawn in training. ``bits``: 64 random bits per draw (``hftrain.models.dropout``: torch's
    distribution with p rounded to a multiple of 2^-16, reproducible and resumable alike; faster on CPU: the
    default job's ablation is in benchmarks/README.md); ``torch``: torch's own dropout and SDPA's in-kernel attention
    dropout. ``auto``: ``bits`` on CPU, whose ``bernoulli_`` draws one element at a time, ``torch`` on GPU (fused
    kernels)."""
    gradient_checkpointing: bool | Literal["full", "selective"] = False
    """Activation recomputation (``hftrain.parallel.recompute``): ``true``/``full`` keeps only each transformer layer's
    input and recomputes the layer in the backward pass; ``selective`` recomputes only the attention core (scores,
    softmax, dropout: the part that grows with the sequence squared); ``false`` keeps everything. Dropout masks are
    recomputed identically (torch's and the RNG tracker's streams are restored)."""
    peak_tflops: float | None = None
    """One process's peak TFLOP/s for MFU; null measures a matmul at the start (CPU) or takes a known GPU's
    datasheet figure (``hftrain.trainers.throughput``)."""
    train_sampling_strategy: Literal["group_by_length", "random", "sequential"] = "group_by_length"
    """``group_by_length`` batches texts of similar length (less padding), shuffled per epoch."""
    logging_steps: int = 10
    eval_steps: int | None = None
    """Evaluate every N optimizer steps; null evaluates at the end of each epoch."""
    save_steps: int | None = None
    save_total_limit: int | None = None
    async_save: bool = True
    """Write checkpoints in the background: training goes on once each rank's state is copied to CPU memory (at
    most one save in flight; preemption and the end of the run wait for it)."""
    resume_from_checkpoint: str | None = None
    """``latest`` or ``auto`` (latest complete checkpoint in ``output_dir``, ``auto`` also when there is none),
    or a checkpoint folder."""
    trust_external_checkpoint: bool = False
    """Allow resuming from a checkpoint outside ``output_dir`` (its optimizer/RNG files are unpickled)."""
    log_with: Literal["tensorboard", "none"] = "tensorboard"
    """Accelerate tracker; tensorboard writes to ``output_dir/runs``."""
    dataloader_num_workers: int = 0
    torch_num_threads: int | None = None
    """Intra-op CPU threads per process; null divides the machine's cores among the local processes."""

    def validate(self) -> None:
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
        ):
            _require(getattr(self, name) > 0, f"training.{name}", "must be positive")
        _require(self.learning_rate > 0, "training.learning_rate", "must be positive")
        _require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0 (0 disables weight decay)")
        # numpy's and Python's generators take seeds in [0, 2**32); Accelerate's set_seed seeds all of them.
        _require(0 <= self.seed < 2**32, "training.seed", "must be in [0, 4294967295]")
        _require(self.max_steps > 0 or self.num_train_epochs > 0, "training.num_train_epochs", "must be positive")
        _require(self.max_grad_norm >= 0, "training.max_grad_norm", "must be >= 0 (0 disables clipping)")
        if isinstance(self.warmup_steps, float):
            _require(0 <= self.warmup_steps < 1, "training.warmup_steps", "as a float is a ratio in [0, 1)")
        _require(self.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
        _require(self.dataloader_num_workers >= 0, "training.dataloader_num_workers", "must be >= 0")
        for name in ("eval_steps", "save_steps", "save_total_limit", "torch_num_threads"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"training.{name}", "must be positive or null")


@dataclass
class StrategyConfig:
    """How the model is distributed; see ``hftrain.strategies``."""

    name: str | None = None
    """``ddp`` (also one process), ``fsdp``, ``zero1``, ``zero2``, ``zero3``, ``megatron``; null takes it from
    ``accelerate launch --config_file`` or uses ``ddp``."""
    fsdp_version: int = 2
    """FSDP only: 1 (``FullyShardedDataParallel``) or 2 (``fully_shard``)."""
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    """FSDP only: what is sharded (parameters+gradients+optimizer state, or gradients+optimizer state)."""
    offload_params: bool = False
    """FSDP and ZeRO-3: keep parameters in CPU memory."""
    offload_optimizer: bool = False
    """ZeRO-2/3: keep optimizer state (and the optimizer step) on the CPU (DeepSpeed's CPU Adam)."""
    deepspeed_config: str | None = None
    """ZeRO only: a DeepSpeed JSON (``"auto"`` values are filled by hftrain); null builds one from these fields."""
    tp: int = 1
    """megatron only: tensor-parallel size (ranks that split each layer); must divide the world size and the
    model's heads, hidden and intermediate sizes, and divide or be a multiple of its key/value heads (then
    replicated over ``tp / kv`` ranks). The vocabulary is padded to a multiple of ``tp × vocab_multiple``."""
    sequence_parallel: bool = False
    """megatron only: Megatron sequence parallelism (norm/dropout regions split along the sequence, which is
    padded to a multiple of ``tp``)."""
    shard_optimizer: bool = False
    """megatron only: ZeRO-1-style sharding of the optimizer state over the data-parallel ranks
    (``torch.distributed.optim.ZeroRedundancyOptimizer``)."""
    pp: int = 1
    """megatron only: pipeline-parallel size (stages); ``tp × pp`` must divide the world size."""
    num_microbatches: int | None = None
    """megatron with pp > 1: micro-batches each per-device batch is split into by the schedule; null uses ``pp``."""
    schedule: str = "1f1b"
    """megatron with pp > 1: the pipeline schedule, a name in ``hftrain.parallel.SCHEDULES`` (``gpipe``, ``1f1b``,
    ``interleaved_1f1b``, and the zero-bubble ones); checked with the batch by the strategy."""
    virtual_stages: int = 1
    """megatron with ``schedule: interleaved_1f1b``: model chunks per pipeline rank."""
    balance: Literal["layers", "parameters"] = "layers"
    """megatron with pp > 1: split the layers into stages of equal layer count or equal parameter count."""
    cp: int = 1
    """megatron only: context-parallel size (ranks that split every sequence; ``tp × cp × pp`` must divide the world
    size); sequences are padded to a multiple of ``2·cp`` and attention dropout must be 0."""
    cp_comm: Literal["ring", "all_to_all"] = "ring"
    """megatron with cp > 1: ring attention (key/value blocks passed around the cp ranks) or all-to-all
    (DeepSpeed-Ulysses: heads, and key/value heads, per tp rank must divide by ``cp``)."""
    vocab_multiple: int = 1
    """megatron only: the vocabulary-parallel embedding pads the vocabulary to a multiple of ``tp ×`` this many
    rows (Megatron's ``make-vocab-size-divisible-by``, e.g. 128 for aligned GPU matmuls); the zero padding rows
    never receive gradient and never reach a checkpoint's logical tensors or an export."""
    pad_to_multiple_of: int | None = None
    """megatron only: length buckets: pad every batch's sequence length up to a multiple of this, so dynamic padding
    gives a few lengths and pipeline schedules (built per shape) are reused; a multiple of ``tp`` under
    ``sequence_parallel``; null pads to the longest example (to a multiple of ``tp`` under sequence parallelism)."""

    def validate(self) -> None:
        _require(self.fsdp_version in (1, 2), "strategy.fsdp_version", "must be 1 or 2")
        _require(self.tp >= 1, "strategy.tp", "must be at least 1")
        _require(self.cp >= 1, "strategy.cp", "must be at least 1")
        _require(
            self.vocab_multiple >= 1,
            "strategy.vocab_multiple",
            f"must be a positive integer, got {self.vocab_multiple} (1: pad the vocabulary to a multiple of tp only; "
            "Megatron uses 128)",
        )
        _validate_pipeline(self)
        buckets = self.pad_to_multiple_of
        _require(buckets is None or buckets >= 1, "strategy.pad_to_multiple_of", "must be at least 1 or null")
        if self.name != "megatron":
            megatron_only = (
                "tp",
                "cp",
                "cp_comm",
                "sequence_parallel",
                "shard_optimizer",
                "pad_to_multiple_of",
                "vocab_multiple",
            )
            for key in (*megatron_only, *PIPELINE_FIELDS):
                _require(
                    getattr(self, key) == getattr(StrategyConfig, key),
                    f"strategy.{key}",
                    f"is a megatron option but strategy.name is {self.name or 'unset'}; "
                    "set strategy.name: megatron or drop it",
                )


PIPELINE_FIELDS = ("pp", "num_microbatches", "schedule", "virtual_stages", "balance")


def _validate_pipeline(strategy: StrategyConfig) -> None:
    """The pipeline sizes on their own (the schedule, the batch and the model are checked by the strategy)."""
    _require(strategy.pp >= 1, "strategy.pp", "must be at least 1")
    _require(strategy.virtual_stages >= 1, "strategy.virtual_stages", "must be at least 1")
    micro = strategy.num_microbatches
    _require(micro is None or micro >= 1, "strategy.num_microbatches", "must be at least 1 or null")


@dataclass
class LoraConfig:
    """Parameter-efficient fine-tuning with PEFT's LoRA; the classification head is trained and saved in full."""

    use_lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    """Module names to adapt; null uses PEFT's default for the architecture."""
    merge_lora_on_export: bool = False
    """Also write the adapter merged into a full model (``output_dir/model_merged``)."""

    def validate(self) -> None:
        _require(self.lora_r > 0, "lora.lora_r", "must be positive")
        _require(self.lora_alpha > 0, "lora.lora_alpha", "must be positive")
        _require(0 <= self.lora_dropout < 1, "lora.lora_dropout", "must be in [0, 1)")


@dataclass
class TrainConfig:
    """The whole job: one field per config-file section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> TrainConfig:
        for section in _sections(self):
            getattr(self, section).validate()
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """``{"section.field": value}`` for trackers and comparisons."""
        return {f"{s}.{k}": v for s, values in self.to_dict().items() for k, v in values.items()}


# Fields that may differ between invocations of one run (resuming, extending, moving it): they do not change
# what is trained. Everything else (model, data, optimisation, strategy, LoRA) defines the run. The global batch
# (micro-batch x accumulation x processes) is checked against the checkpoint, where the process count is known.
RUN_INVARIANT_EXEMPT = frozenset(
    {
        "training.output_dir",  # a moved or copied run directory resumes where it now lives
        "training.max_steps",  # extending a finished or interrupted run
        "training.num_train_epochs",
        "training.logging_steps",
        "training.eval_steps",
        "training.save_steps",
        "training.save_total_limit",
        "training.async_save",
        "training.log_with",
        "training.per_device_train_batch_size",
        "training.gradient_accumulation_steps",
        "training.per_device_eval_batch_size",
        "training.dataloader_num_workers",
        "training.resume_from_checkpoint",
        "training.overwrite_output_dir",
        "training.torch_num_threads",
        "training.trust_external_checkpoint",
        "lora.merge_lora_on_export",
    }
)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a validated config from an optional YAML file and command-line overrides.

    Args:
        path: YAML file with sections ``model``, ``data``, ``training``, ``strategy``; None for defaults.
        overrides: ``["--learning_rate", "1e-4", "--training.seed=3", ...]``.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    config = from_dict(raw, source=str(path) if path else "defaults")
    for key, values in _parse_overrides(overrides or []):
        set_field(config, key, _override_value(key, values), source="command line")
    return config.validate()


def from_dict(raw: dict[str, Any], *, source: str = "config") -> TrainConfig:
    """Build a config from ``{section: {field: value}}``, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(_sections(TrainConfig))})")
    config = TrainConfig()
    for section, values in raw.items():
        if section == RUN_ID_KEY:
            continue
        if not isinstance(section, str):  # YAML reads `1:` as an int key
            raise ConfigError(f"{source}: section name {section!r} is not a name; use {', '.join(_sections(config))}")
        _check_key(section, _sections(TrainConfig), f"{source}: unknown section", "")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of fields")
        for key, value in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {key!r} in section '{section}' is not a field name")
            set_field(config, f"{section}.{key}", value, source=source)
    return config


def config_from_flat(flat: dict[str, Any], *, source: str) -> TrainConfig:
    """The config stored flat (``{"section.field": value}``, as checkpoints keep it)."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, name = key.split(".", 1)
        nested.setdefault(section, {})[name] = value
    return from_dict(nested, source=source)


def set_field(config: TrainConfig, key: str, value: Any, *, source: str) -> None:
    """Set ``section.field`` (or a unique bare ``field``) with type checking."""
    section, name = _resolve_key(key, source)
    target = getattr(config, section)
    hint = typing.get_type_hints(_SECTION_TYPES[section])[name]
    setattr(target, name, coerce(value, hint, f"{section}.{name}"))


def save_config(config: TrainConfig, directory: str | Path, *, run_id: str | None = None) -> Path:
    """Write the resolved config as YAML into ``directory``, atomically (a reader sees the old or the new file).

    Args:
        config: the resolved config.
        directory: the run's ``output_dir`` (it must exist).
        run_id: the run's id, written as the top-level ``run_id`` key.
    """
    import os

    import yaml

    path = Path(directory) / CONFIG_FILENAME
    staging = path.with_name(f".{CONFIG_FILENAME}.tmp")
    saved: dict[str, Any] = {RUN_ID_KEY: run_id} if run_id else {}
    staging.write_text(yaml.safe_dump({**saved, **config.to_dict()}, sort_keys=False))
    os.replace(staging, path)
    return path


def config_differences(config: TrainConfig, other: TrainConfig) -> list[str]:
    """Keys whose values differ between two configs, ignoring run-invariant-exempt fields."""
    mine, theirs = config.flat(), other.flat()
    return sorted(k for k in mine if k not in RUN_INVARIANT_EXEMPT and mine[k] != theirs.get(k))


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a type hint, converting strings from YAML/CLI where unambiguous."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, typing.get_args(hint), key)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint_text = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{key}: '{value}' is not one of {', '.join(map(str, choices))}{hint_text}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(hint)
        return [coerce(v, item, key) for v in value]
    scalar = _SCALARS.get(hint)
    if scalar is None:
        raise TypeError(f"unsupported config type {hint} for {key}")
    return scalar(value, key)


def _coerce_union(value: Any, args: tuple[Any, ...], key: str) -> Any:
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
        if type(None) in args:
            return None
        raise ConfigError(f"{key}: may not be null")
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return coerce(value, arg, key)
        except ConfigError as error:
            errors.append(error)
    raise errors[-1]


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")


def _to_float(value: Any, key: str) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # PyYAML reads '5e-5' (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(number):  # inf/nan train on NaN from the first step
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    return number


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _sections(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def _field_owners() -> dict[str, str]:
    owners: dict[str, str] = {}
    for section in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            owners[f.name] = section.name
    return owners


def _resolve_key(key: str, source: str) -> tuple[str, str]:
    owners = _field_owners()
    if "." in key:
        section, name = key.split(".", 1)
        _check_key(section, _sections(TrainConfig), f"{source}: unknown section", "")
        fields = [k for k, s in owners.items() if s == section]
        _check_key(name, fields, f"{source}: unknown key", f"{section}.")
        return section, name
    _check_key(key, list(owners), f"{source}: unknown key", "")
    return owners[key], key


def _check_key(key: str, valid: list[str], prefix: str, qualifier: str) -> None:
    if key in valid:
        return
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{qualifier}{close[0]}'?" if close else f"; valid: {', '.join(valid)}"
    raise ConfigError(f"{prefix} '{qualifier}{key}'{hint}")


def _parse_overrides(args: list[str]) -> list[tuple[str, list[str]]]:
    """``[(key, values)]`` from ``--key v``, ``--key=v`` and, for list fields, ``--key a b`` / ``--key a,b``."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"command line: expected '--key value' or '--key=value', got '{arg}'")
        i += 1
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            pairs.append((key, [value]))
            continue
        values = []
        while i < len(args) and not args[i].startswith("--"):  # '-1' is a value, '--seed' the next key
            values.append(args[i])
            i += 1
        if not values:
            raise ConfigError(f"command line: '{arg}' needs a value")
        pairs.append((arg[2:], values))
    return pairs


def _override_value(key: str, values: list[str]) -> Any:
    """One command-line value, or a list for a list field (``a b`` and ``a,b`` both; ``null`` for none)."""
    section, name = _resolve_key(key, "command line")
    hint = typing.get_type_hints(_SECTION_TYPES[section])[name]
    takes_list = any(typing.get_origin(arg) is list for arg in (hint, *typing.get_args(hint)))
    if takes_list and values != ["null"] and values != ["none"]:
        return [piece for value in values for piece in value.split(",") if piece]
    if len(values) != 1:
        raise ConfigError(
            f"command line: {section}.{name} takes one value, got {len(values)} ({' '.join(values)}); "
            "quote a value that contains spaces"
        )
    return values[0]


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if path.is_dir():
        raise ConfigError(f"--config '{path}' is a directory; pass the YAML file itself")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file to --config")
    try:
        raw = yaml.load(path.read_text(), Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text; pass a YAML file") from None
    except OSError as error:
        raise ConfigError(f"config file '{path}' cannot be read ({error.strerror}); fix its permissions") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(error, "problem", None) or ""
        detail = f" ({problem})" if "duplicate" in problem else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}{detail}; fix its syntax") from None
    if raw is None:  # an empty file (or only comments) is almost always the wrong file
        raise ConfigError(f"config file '{path}' is empty; give at least one section, or drop --config for defaults")
    return raw


def _strict_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key}'", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {message}")


_SECTION_TYPES = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore[misc]
