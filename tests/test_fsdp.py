"""FSDP1/FSDP2 on 2 gloo processes x micro-batch b equal 1 process x 2b; parameters and optimizer state are sharded.

One 2-process launch runs every FSDP case (starting processes costs more than the tiny runs themselves) and
one 1-process launch the reference; module-scoped fixtures share them between the tests. The settings tests
read what ``accelerate launch`` really exports for the shipped configs; a full ``accelerate launch`` training
run of each shipped config is in ``test_launch_configs.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.distributed import free_port, run_distributed
from tests.tiny import run_tiny_training, tiny_model_init

pytestmark = pytest.mark.distributed

STEPS = 20
CASES = [("bert", 1), ("bert", 2), ("gpt2", 1), ("gpt2", 2)]  # (kind, gradient_accumulation_steps)
SHARDED_CASE = ("bert", 1)  # the run whose trainer is inspected after training
REPO = Path(__file__).resolve().parents[1]


def _recording_trainer():
    from hftrain.trainers import SequenceClassificationTrainer

    class Recording(SequenceClassificationTrainer):
        last = None

        def fit(self, **kwargs):
            Recording.last = self
            return super().fit(**kwargs)

    return Recording


def _runs(micro: int, strategy: str, versions: tuple[int, ...], export_dir: str) -> dict:
    """Every case per FSDP version (or once for the reference); the inspected case adds sharding facts."""
    recording = _recording_trainer()
    runs = {}
    for version in versions:
        options = {"fsdp_version": version} if strategy == "fsdp" else None
        for kind, gas in CASES:
            with mock.patch("hftrain.trainers.SequenceClassificationTrainer", recording):
                # One evaluation, at the end: loading the metrics dominates such tiny runs.
                run = run_tiny_training(
                    kind=kind,
                    strategy=strategy,
                    micro=micro,
                    gas=gas,
                    steps=STEPS,
                    eval_steps=STEPS,
                    strategy_options=options,
                )
            if (kind, gas) == SHARDED_CASE:
                run.update(_inspect(recording.last, kind, f"{export_dir}/v{version}"))
            runs[(version, kind, gas)] = run
    return runs


def _inspect(trainer, kind: str, export_dir: str) -> dict:
    """Wrapper types, this rank's parameter/optimizer bytes against the full model, and the exported weights."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    from hftrain.checkpoint.export import export_pretrained

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    model, acc = trainer.model, trainer.accelerator
    full = sum(p.numel() * p.element_size() for p in tiny_model_init(kind)().parameters())
    if isinstance(model, FullyShardedDataParallel):  # FSDP1: each unit holds one flat parameter's local shard
        units = FullyShardedDataParallel.fsdp_modules(model)
        local = sum(local_bytes(u._handle.flat_param) for u in units if u._handle is not None)
    else:
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:  # the root stays gathered after an eval forward; measure at rest
            unit.reshard()
        local = sum(local_bytes(p) for p in model.parameters())
    optimizer_state = trainer.optimizer.optimizer.state.values()
    optimizer = sum(local_bytes(v) for state in optimizer_state for k, v in state.items() if k != "step")
    export_pretrained(trainer.runtime, model, trainer.tokenizer, export_dir)
    exported = load_file(f"{export_dir}/model.safetensors") if acc.is_main_process else None
    return {
        "wrapper": type(model).__name__,
        "fsdp_units": len(units),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "param_fraction": local / full,
        "optimizer_fraction": optimizer / (2 * full),  # AdamW: exp_avg + exp_avg_sq per parameter
        "exported": exported,
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    export_dir = str(tmp_path_factory.mktemp("ref"))
    (runs,) = run_distributed(_runs, nprocs=1, micro=8, strategy="ddp", versions=(0,), export_dir=export_dir)
    return {(kind, gas): run for (_, kind, gas), run in runs.items()}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> list[dict]:
    export_dir = str(tmp_path_factory.mktemp("fsdp"))
    return run_distributed(_runs, nprocs=2, micro=4, strategy="fsdp", versions=(1, 2), export_dir=export_dir)


def _max_rel(values: list[float], ref: list[float]) -> float:
    return max(abs(v - r) / abs(r) for v, r in zip(values, ref, strict=False))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=[f"{k}-gas{g}" for k, g in CASES])
def test_loss_trajectory_matches_single_process(reference, fsdp, version, case):
    ref, rank0, rank1 = reference[case], fsdp[0][(version, *case)], fsdp[1][(version, *case)]
    assert rank0["distributed_type"] == "DistributedType.FSDP" and rank0["num_processes"] == 2
    assert len(rank0["losses"]) == len(ref["losses"]) == STEPS
    print(f"fsdp{version} {case}: max relative loss difference {_max_rel(rank0['losses'], ref['losses']):.2e}")
    assert _max_rel(rank0["losses"], ref["losses"]) < 1e-5
    assert rank1["losses"] == rank0["losses"]
    assert rank0["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
    assert rank0["metrics"]["eval_samples"] == 25
    assert rank0["metrics"]["eval_accuracy"] == pytest.approx(ref["metrics"]["eval_accuracy"])
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # it trained


@pytest.mark.parametrize("version", [1, 2])
def test_parameters_and_optimizer_state_are_sharded(fsdp, version):
    for rank in fsdp:
        facts = rank[(version, *SHARDED_CASE)]
        if version == 1:
            assert facts["wrapper"] == "FullyShardedDataParallel"
        else:
            assert facts["wrapper"].startswith("FSDP") and facts["all_dtensor"]
        assert facts["fsdp_units"] >= 3  # root + one per transformer layer (2 layers), not one flat model
        print(f"fsdp{version}: parameters {facts['param_fraction']:.3f}, optimizer {facts['optimizer_fraction']:.3f}")
        assert 0.45 < facts["param_fraction"] < 0.55
        assert 0.45 < facts["optimizer_fraction"] < 0.55
    assert sum(r[(version, *SHARDED_CASE)]["param_fraction"] for r in fsdp) >= 1.0


@pytest.mark.parametrize("version", [1, 2])
def test_export_gathers_the_full_trained_model(reference, fsdp, version):
    ref, exported = reference[SHARDED_CASE]["exported"], fsdp[0][(version, *SHARDED_CASE)]["exported"]
    assert fsdp[1][(version, *SHARDED_CASE)]["exported"] is None  # only rank 0 writes
    assert sorted(exported) == sorted(ref)  # full HF names: no FSDP wrapper prefixes
    assert all(exported[key].shape == tensor.shape for key, tensor in ref.items())
    worst = max((exported[key] - tensor).abs().max().item() for key, tensor in ref.items())
    print(f"fsdp{version}: exported weights differ from the reference's by at most {worst:.1e}")
    assert worst < 1e-4


# ----------------------------------------------------------------- settings (no training; the launcher's real env)
@pytest.fixture(scope="module")
def launcher_env(tmp_path_factory) -> dict[str, dict[str, str]]:
    """What ``accelerate launch --config_file accelerate_configs/fsdp{1,2}.yaml`` exports to its processes."""
    dump = tmp_path_factory.mktemp("env") / "dump.py"
    dump.write_text("import json, os\nif os.environ['RANK'] == '0': print(json.dumps(dict(os.environ)))\n")
    envs = {}
    for name in ("fsdp1", "fsdp2"):
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
        config = str(REPO / f"accelerate_configs/{name}.yaml")
        done = subprocess.run(
            [*launcher, "--config_file", config, str(dump)], capture_output=True, text=True, check=True
        )
        envs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    return envs


def _strategy(env: dict[str, str] | None = None, platform=None, world=(2, 2), **config):
    from hftrain.cli import launch_info_from_environ
    from hftrain.config import StrategyConfig
    from hftrain.strategies.fsdp import FSDPStrategy
    from hftrain.strategies.platform import Platform

    env = {**(env or {}), "WORLD_SIZE": str(world[0]), "LOCAL_WORLD_SIZE": str(world[1])}
    platform = platform or Platform(device="cpu", backend="gloo")
    return FSDPStrategy(StrategyConfig(name="fsdp", **config), platform=platform, launch=launch_info_from_environ(env))


@pytest.mark.parametrize("name, version", [("fsdp1", 1), ("fsdp2", 2)])
def test_shipped_accelerate_configs_are_read(launcher_env, name, version):
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    strategy = _strategy(launcher_env[name])
    assert (strategy.settings.fsdp_version, strategy.settings.sharding_strategy) == (version, "FULL_SHARD")
    assert strategy.settings.offload_params is False
    plugin = strategy.build_plugin()
    assert plugin.fsdp_version == version and plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    if version == 1:
        assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD and plugin.use_orig_params is True
    else:
        assert plugin.reshard_after_forward is True


CONFLICTS = {  # hftrain config (non-default) vs the launcher's file
    "version": ("fsdp2", {"fsdp_version": 1}, "strategy.fsdp_version is 1 but accelerate launch's config sets 2"),
    "sharding": ("fsdp1", {"sharding_strategy": "SHARD_GRAD_OP"}, "sets 'FULL_SHARD'"),
    "offload": ("fsdp2", {"offload_params": True}, "strategy.offload_params is True"),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_launcher_contradicting_the_config_is_one_line_error(launcher_env, case):
    from hftrain.errors import ConfigError

    name, config, fragment = CONFLICTS[case]
    with pytest.raises(ConfigError, match=re.escape(fragment)) as error:
        _strategy(launcher_env[name], **config)
    assert "\n" not in str(error.value)


def test_agreeing_or_default_config_takes_the_launchers_settings(launcher_env):
    assert _strategy(launcher_env["fsdp1"]).settings.fsdp_version == 1  # hftrain's default 2 yields
    assert _strategy(launcher_env["fsdp1"], fsdp_version=1, sharding_strategy="FULL_SHARD").settings.fsdp_version == 1
    env = {**launcher_env["fsdp2"], "FSDP_RESHARD_AFTER_FORWARD": "false"}
    assert _strategy(env, sharding_strategy="SHARD_GRAD_OP").settings.sharding_strategy == "SHARD_GRAD_OP"


REFUSED = {
    "one process": ({"world": (1, 1)}, "1 was launched"),
    "offload on CPU": ({"offload_params": True}, "needs a GPU"),
    "hybrid over uneven nodes": ({"world": (6, 4), "sharding_strategy": "HYBRID_SHARD"}, "as many processes"),
    "FSDP2 NO_SHARD": ({"sharding_strategy": "NO_SHARD"}, "no FSDP2 form"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_combinations_are_refused_before_any_process_group(case):
    from hftrain.errors import ConfigError

    kwargs, fragment = REFUSED[case]
    with pytest.raises(ConfigError, match=fragment):
        _strategy(**kwargs)


def test_sharding_names_map_as_accelerate_does():
    assert _strategy(sharding_strategy="HYBRID_SHARD").build_plugin().reshard_after_forward is True  # one node
    assert "FULL_SHARD" in _strategy(sharding_strategy="HYBRID_SHARD").describe()["note"]
    assert _strategy(sharding_strategy="SHARD_GRAD_OP").build_plugin().reshard_after_forward is False
    assert _strategy(world=(4, 2), sharding_strategy="HYBRID_SHARD").hybrid_mesh == (2, 2)  # FSDP2: nodes × local
    assert _strategy(sharding_strategy="HYBRID_SHARD").hybrid_mesh is None  # one node: full sharding
    hybrid_v1 = _strategy(world=(4, 2), fsdp_version=1, sharding_strategy="HYBRID_SHARD").build_plugin()
    assert hybrid_v1.sharding_strategy.name == "HYBRID_SHARD"


def test_gpu_platform_is_left_to_accelerate():
    from hftrain.strategies.platform import Platform

    gpu = Platform(device="cuda", backend="nccl")
    untouched = object()
    gpu.force_fsdp(untouched, plugin=None)  # would fail on any attribute access
    assert gpu.process_group_handlers()[0].backend == "nccl"
    assert gpu.process_group_handlers(cpu_collectives=True)[0].backend == "cuda:nccl,cpu:gloo"
