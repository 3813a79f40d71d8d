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
