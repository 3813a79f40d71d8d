"""Every shipped accelerate config starts a real short run; both ways of choosing a strategy agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import job_args, logged_losses, run_ok, torchrun

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "accelerate_configs").glob("*.yaml") if not p.name.startswith("multinode"))
EXPECTED_TYPE = {"ddp": "MULTI_CPU", "fsdp": "FSDP"}

pytestmark = pytest.mark.distributed


def _accelerate(config: str, args: list[str]) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}"]
    return run_ok([*launcher, "scripts/train.py", *args])


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    return torchrun(2, ["scripts/train.py", *args], timeout=600)


# the slow tier's: the offload configs (37 s together; test_deepspeed trains both offloads in every run), and ZeRO-1
# and FSDP1 (29 s; the zero2, zero3 and fsdp2 configs run here, and test_deepspeed / test_fsdp train both strategies)
SLOW_CONFIGS = ("offload", "zero1", "fsdp1")


@pytest.mark.parametrize(
    "config", [pytest.param(c, marks=pytest.mark.slow) if any(s in c for s in SLOW_CONFIGS) else c for c in CONFIGS]
)
def test_shipped_accelerate_config_runs(tiny_job, tmp_path, config):
    out = tmp_path / "out"
    _accelerate(config, job_args(tiny_job, out))
    summary = json.loads((out / "hftrain_strategy.json").read_text())
    name = config.removesuffix(".yaml")
    strategy = "fsdp" if name.startswith("fsdp") else name.split("_")[0]
    assert summary["strategy"] == strategy
    assert summary["distributed_type"] == EXPECTED_TYPE.get(strategy, "DEEPSPEED")
    assert summary["world_size"] == summary["dp_size"] == 2
    assert summary["global_batch"] == 4 * 2 * 2
    if name.endswith("offload"):
        assert summary["offload_optimizer"] == "cpu"
    assert len(logged_losses(out)) == 4
    assert (out / "model" / "model.safetensors").is_file()


# zero2's agreement is the slow tier's (31 s): the shipped zero2.yaml run above starts the same strategy from its config
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.slow)])
def test_config_named_strategy_agrees_with_accelerate_config(tiny_job, tmp_path, strategy):
    via_accelerate, via_config = tmp_path / "accelerate", tmp_path / "config"
    _accelerate(f"{strategy}.yaml", job_args(tiny_job, via_accelerate))
    _torchrun([*job_args(tiny_job, via_config), "--strategy.name", strategy])
    assert logged_losses(via_config) == pytest.approx(logged_losses(via_accelerate), rel=1e-6)
    summary = json.loads((via_config / "hftrain_strategy.json").read_text())
    assert summary["strategy"] == strategy and summary["world_size"] == 2


def test_disagreeing_launcher_and_config_is_refused(tiny_job, tmp_path):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/zero2.yaml",
        "scripts/train.py",
        *job_args(tiny_job, tmp_path / "out"),
        "--strategy.name",
        "zero3",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "strategy.name is 'zero3' but accelerate launch's config selects 'zero2'" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "accelerate_configs").glob("*.yaml")))
def test_every_shipped_accelerate_config_loads(config):
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(ROOT / "accelerate_configs" / config))
    assert loaded.num_processes >= 2
    ds_file = (loaded.deepspeed_config or {}).get("deepspeed_config_file")
    if ds_file:
        assert (ROOT / ds_file).is_file()


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_job_configs_load(config):
    from hftrain.config import load_config

    job = load_config(config)
    assert job.model.model_name_or_path.startswith("embedded:")
