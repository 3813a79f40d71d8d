"""DeepSpeed ZeRO-1/2/3 (and CPU offload) on 2 gloo processes equal single-process training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hftrain.config import TrainingConfig
from hftrain.errors import ConfigError
from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

ROOT = Path(__file__).resolve().parents[1]
CASES = [("bert", 1), ("bert", 2), ("gpt2", 1), ("gpt2", 2)]
OFFLOAD = {
    "zero2+offload_optimizer": ("zero2", {"offload_optimizer": True}),
    "zero3+offload_optimizer+params": ("zero3", {"offload_optimizer": True, "offload_params": True}),
}
STEPS = 20


def _reference(micro: int) -> dict:
    return {case: run_tiny_training(kind=case[0], gas=case[1], micro=micro, steps=STEPS) for case in CASES}


def _zero3_partitions(trainer) -> dict:
    """ZeRO-3's optimizer sub groups after training: how many, and whether each fp32 master is the working partition
    itself (one copy of the rank's parameters in fp32 training, not two)."""
    zero = trainer.optimizer.optimizer  # Accelerate's wrapper around DeepSpeed's ZeRO-3 optimizer
    pairs = list(zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True))
    return {"groups": len(pairs), "aliased": all(m.data_ptr() == w.data_ptr() for m, w in pairs)}


def _zero_runs(micro: int) -> dict:
    runs = {}
    for stage in ("zero1", "zero2", "zero3"):
        for kind, gas in CASES:
            runs[(stage, kind, gas)] = run_tiny_training(
                kind=kind, gas=gas, micro=micro, steps=STEPS, strategy=stage,
                inspect=_zero3_partitions if stage == "zero3" else None,
            )  # fmt: skip
    for label, (stage, options) in OFFLOAD.items():
        runs[(label, "bert", 2)] = run_tiny_training(
            kind="bert", gas=2, micro=micro, steps=STEPS, strategy=stage, strategy_options=options,
            inspect=_zero3_partitions if stage == "zero3" else None,
        )  # fmt: skip
    return runs


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_reference, nprocs=1, micro=8)[0]


@pytest.fixture(scope="module")
def zero() -> list[dict]:
    return run_distributed(_zero_runs, nprocs=2, micro=4)


ALL = [(stage, kind, gas) for stage in ("zero1", "zero2", "zero3") for kind, gas in CASES] + [
    (label, "bert", 2) for label in OFFLOAD
]


@pytest.mark.distributed
@pytest.mark.parametrize("key", ALL, ids=["-".join(map(str, k)) for k in ALL])
def test_zero_matches_single_process(reference, zero, key):
    _, kind, gas = key
    ref, rank0, rank1 = reference[(kind, gas)], zero[0][key], zero[1][key]
    assert rank0["distributed_type"] == "DistributedType.DEEPSPEED" and rank0["num_processes"] == 2
    assert len(rank0["losses"]) == STEPS
    # The first loss equal too: ZeRO-3 must build the head exactly as one process does
    # (pitfall "ZeRO-3 leaves the new head uninitialised", docs/pitfalls.md).
    assert rank0["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert rank1["losses"] == rank0["losses"]
    assert rank0["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
    assert rank0["metrics"]["eval_samples"] == 25
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.distributed
def test_zero3_holds_one_fp32_copy_of_its_partition_and_steps_in_sub_groups(zero):
    """fp32 ZeRO-3 without offload: the fp32 master is the working partition (DeepSpeed meant to alias them, and its
    device check compares a torch.device with a str: a second 4Ψ/N copy per rank), and the optimizer steps the
    partition in model-sized sub groups (``sub_group_size`` 24h²: its flat gradient copy is two layers', not all). The
    parity test above shows the same losses. Under optimizer and parameter offload (both on the host) too."""
    for key in (("zero3", "bert", 1), ("zero3", "bert", 2), ("zero3+offload_optimizer+params", "bert", 2)):
        layout = zero[0][key]["inspected"]
        assert layout["aliased"] and layout["groups"] > 1, (key, layout)


# ----------------------------------------------------------------- the DeepSpeed JSON (no processes)
def _strategy(name: str, world: int = 2, **options):
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    return strategy_from_options(name, options, launch=LaunchInfo(world_size=world), platform=Platform("cpu", "gloo"))


def test_batch_size_is_written_so_the_assertion_cannot_fire():
    args = TrainingConfig(per_device_train_batch_size=3, gradient_accumulation_steps=5, max_grad_norm=0.5)
    config = _strategy("zero2", world=4).ds_config(args)
    assert config["train_batch_size"] == 3 * 5 * 4
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["gradient_accumulation_steps"] == 5
    assert config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"] is False


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_shipped_ds_configs_are_the_strategy_defaults(name):
    from hftrain.strategies.deepspeed import default_ds_config

    shipped = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    stage = int(name[4])
    offload = name.endswith("offload")
    assert shipped == default_ds_config(stage, offload_optimizer=offload, offload_params=offload and stage == 3)
    if stage == 3:
        assert shipped["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def _json(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("name", "options", "json_config", "fragment"),
    [
        ("zero2", {}, {"train_batch_size": 64, "zero_optimization": {"stage": 2}}, "train_batch_size is 64"),
        (
            "zero2",
            {},
            {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}},
            "gradient_accumulation_steps",
        ),
        ("zero2", {}, {"zero_optimization": {"stage": 3}}, "zero_optimization.stage 3"),
        ("zero2", {}, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "training.mixed_precision"),
        (
            "zero3",
            {},
            {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
            "stage3_gather_16bit_weights_on_model_save",
        ),
        ("zero2", {}, {"train_batch_size": 8}, "no zero_optimization"),
        ("zero1", {"offload_optimizer": True}, None, "optimizer offload needs ZeRO stage 2 or 3"),
        ("zero2", {"offload_params": True}, None, "parameter offload needs ZeRO stage 3"),
    ],
)
def test_contradicting_deepspeed_settings_are_refused(tmp_path, name, options, json_config, fragment):
    if json_config is not None:
        options = {**options, "deepspeed_config": _json(tmp_path, json_config)}
    with pytest.raises(ConfigError) as error:
        _strategy(name, **options).ds_config(TrainingConfig(per_device_train_batch_size=4))
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_launcher_and_config_must_agree():
    from hftrain.cli import launch_info_from_environ
    from hftrain.strategies import resolve_strategy_name

    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ROOT / "ds_configs/zero3.json")}
    assert launch_info_from_environ(env).accelerate_strategy == "zero3"
    with pytest.raises(ConfigError, match="strategy.name is 'zero2'"):
        resolve_strategy_name("zero2", "zero3")
    with pytest.raises(ConfigError, match="FSDP and DeepSpeed"):
        launch_info_from_environ({**env, "ACCELERATE_USE_FSDP": "true"})
    assert launch_info_from_environ({"ACCELERATE_USE_FSDP": "true"}).accelerate_strategy == "fsdp"
    assert launch_info_from_environ({}).accelerate_strategy is None


def test_model_sized_limits_are_filled_from_the_hidden_size_and_numbers_are_kept():
    """DeepSpeed's 5e8-element reduce bucket and 1e9 live/reuse limits would keep a whole model gathered per rank
    below 1e9 parameters (issue 42): the shipped JSONs say "auto" and hftrain sizes them from the model."""
    import types

    from hftrain.errors import ConfigError
    from hftrain.strategies.deepspeed import MODEL_SIZED, default_ds_config, fill_model_sized

    config = default_ds_config(3)
    config["zero_optimization"]["stage3_max_live_parameters"] = 123  # a user's number stays
    filled = fill_model_sized(config, types.SimpleNamespace(hidden_size=64))
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 640 and zero["stage3_max_reuse_distance"] == 24 * 64 * 64
    assert zero["sub_group_size"] == 24 * 64 * 64  # the step's flat fp32 copy of the gradients: two layers, not all
    assert zero["stage3_max_live_parameters"] == 123 and "stage3_max_live_parameters" not in filled
    assert not any(value == "auto" for value in zero.values())
    stage2 = default_ds_config(2)["zero_optimization"]
    assert [k for k in MODEL_SIZED if k in stage2] == ["reduce_bucket_size"]  # ZeRO-2 reads no stage3_ key
    with pytest.raises(ConfigError, match="zero_optimization.reduce_bucket_size.*no hidden_size"):
        fill_model_sized(default_ds_config(2), types.SimpleNamespace())
