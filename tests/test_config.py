"""Strict config loading: YAML sections, CLI overrides, types, closest-key hints."""

from __future__ import annotations

import pytest

from hftrain.config import TrainConfig, config_differences, load_config, save_config
from hftrain.config.loader import _field_owners
from hftrain.errors import ConfigError


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_embedded_job():
    config = load_config()
    assert config.model.model_name_or_path == "embedded:minilm"
    assert config.data.dataset_name == "embedded:rotten_tomatoes"
    assert config.training.mixed_precision == "auto" and config.training.optim == "auto"


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "training:\n  learning_rate: 5e-5\n  warmup_steps: 0.1\nstrategy:\n  name: ddp\n")
    config = load_config(path, ["--max_steps", "7", "--training.seed=3", "--warmup_steps", "4"])
    assert config.training.learning_rate == 5e-5  # PyYAML reads 5e-5 as a string; coerced to float
    assert config.training.max_steps == 7 and config.training.seed == 3
    assert config.training.warmup_steps == 4 and isinstance(config.training.warmup_steps, int)
    assert load_config(path).training.warmup_steps == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "fragment"),
    [
        ("training:\n  learnig_rate: 1e-4\n", [], "did you mean 'training.learning_rate'"),
        ("trainig:\n  seed: 1\n", [], "did you mean 'training'"),
        (
            "training:\n  per_device_train_batch_size: abc\n",
            [],
            "training.per_device_train_batch_size: expected an integer",
        ),
        ("training:\n  mixed_precision: bf61\n", [], "did you mean 'bf16'"),
        ("training:\n  overwrite_output_dir: maybe\n", [], "expected true or false"),
        ("", ["--per_device_train_batchsize", "8"], "did you mean 'per_device_train_batch_size'"),
        ("", ["--learning_rate", "-1"], "training.learning_rate must be positive"),
        ("", ["--warmup_steps", "1.5"], "training.warmup_steps as a float is a ratio"),
        ("", ["--max_steps"], "needs a value"),
        ("data:\n  dataset_name: embedded:rotten_tomatoes\n  train_file: x.csv\n", [], "data.dataset_name"),
        ("- a\n- b\n", [], "expected a mapping"),
        ("training: [1\n", [], "not valid YAML"),
    ],
)
def test_bad_config_names_the_key(tmp_path, yaml_text, overrides, fragment):
    with pytest.raises(ConfigError, match=None) as error:
        load_config(write(tmp_path, yaml_text) if yaml_text else None, overrides)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_field_names_are_unique_across_sections():
    # bare --field overrides rely on this
    import dataclasses

    names = [f.name for s in dataclasses.fields(TrainConfig) for f in dataclasses.fields(s.default_factory())]
    assert len(names) == len(set(names)) == len(_field_owners())


def test_training_names_match_transformers_training_arguments():
    import dataclasses

    from transformers import TrainingArguments

    hf = {f.name for f in dataclasses.fields(TrainingArguments)}
    ours = {
        "output_dir",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "num_train_epochs",
        "max_steps",
        "warmup_steps",
        "weight_decay",
        "lr_scheduler_type",
        "max_grad_norm",
        "seed",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "save_total_limit",
        "resume_from_checkpoint",
        "train_sampling_strategy",
        "per_device_eval_batch_size",
        "dataloader_num_workers",
    }
    assert ours <= hf, ours - hf


def test_saved_config_round_trips(tmp_path):
    config = load_config(None, ["--learning_rate", "1e-4"])
    save_config(config, tmp_path)
    again = load_config(tmp_path / "hftrain_config.yaml")
    assert config_differences(config, again) == []
    other = load_config(None, ["--learning_rate", "1e-4", "--seed", "1"])
    assert config_differences(config, other) == ["training.seed"]


def test_parallelism_section_takes_the_old_strategy_keys_with_one_deprecation_line(tmp_path, capsys):
    """The axes moved from ``strategy`` to ``parallelism``: an old key sets the new one with one line per key (not
    per use), a file setting both names of one field is refused, and a run's saved config converts silently."""
    from hftrain.config import MOVED_KEYS, ParallelismConfig, config_from_flat, loader

    assert set(MOVED_KEYS.values()) == {f"parallelism.{name}" for name in ParallelismConfig.__dataclass_fields__}
    loader._warned.clear()
    old = write(tmp_path, "strategy:\n  name: megatron\n  tp: 2\n  pp: 2\n  shard_optimizer: true\n")
    for _ in range(2):
        config = load_config(old, ["--strategy.cp_comm", "all_to_all"])
        assert (config.parallelism.tp, config.parallelism.pp, config.parallelism.cp_comm) == (2, 2, "all_to_all")
        assert config.strategy.shard_optimizer  # a strategy option stays in strategy
    lines = [line for line in capsys.readouterr().out.splitlines() if "deprecated" in line]
    assert sorted(line.split(": ")[1].split()[0] for line in lines) == [
        "strategy.cp_comm",
        "strategy.pp",
        "strategy.tp",
    ], lines
    assert all("write parallelism." in line for line in lines)
    new = write(tmp_path, "strategy:\n  name: megatron\nparallelism:\n  tp: 2\n  pp: 2\n")
    assert config_differences(load_config(new), config) == ["parallelism.cp_comm", "strategy.shard_optimizer"]
    both = write(tmp_path, "strategy:\n  name: megatron\n  tp: 2\nparallelism:\n  tp: 4\n")
    with pytest.raises(ConfigError, match=r"strategy.tp and parallelism.tp are one field .*; keep parallelism.tp"):
        load_config(both)
    loader._warned.clear()
    saved = config_from_flat({"strategy.name": "megatron", "strategy.tp": 2}, source="checkpoint.json")
    assert saved.parallelism.tp == 2 and "deprecated" not in capsys.readouterr().out


def test_parallelism_is_refused_by_a_strategy_that_does_not_split_the_model():
    from hftrain.config import ParallelismConfig, StrategyConfig
    from hftrain.strategies import LaunchInfo, build_strategy, strategy_from_options
    from hftrain.strategies.platform import Platform

    cpu = Platform("cpu", "gloo")
    for name in ("ddp", "zero2", "fsdp"):
        with pytest.raises(ConfigError, match=f"parallelism.cp is a megatron option but strategy.name is {name}"):
            build_strategy(
                StrategyConfig(name=name),
                launch=LaunchInfo(world_size=2, local_world_size=2),
                platform=cpu,
                parallelism=ParallelismConfig(cp=2),
            )
    megatron = strategy_from_options("megatron", {"tp": 2, "shard_optimizer": True}, launch=LaunchInfo(world_size=4))
    assert (megatron.dims.tp, megatron.dims.dp, megatron.config.shard_optimizer) == (2, 2, True)
    with pytest.raises(ConfigError, match="strategy options: unknown key 'tpp'; did you mean 'tp'"):
        strategy_from_options("megatron", {"tpp": 2}, launch=LaunchInfo(world_size=4))
    with pytest.raises(ConfigError, match="'learning_rate' is a field of section 'training', not a strategy option"):
        strategy_from_options("megatron", {"learning_rate": 1.0}, launch=LaunchInfo(world_size=4))
