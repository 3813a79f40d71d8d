"""The speed defaults (issue 13): chosen from what the machine can do, logged, and each one really in effect.

``auto`` precision is bf16 only where the device computes it natively (never on an AVX2-only CPU, where bf16 is
emulated and ~500x slower than fp32); ``auto`` optim is the
fused AdamW wherever the strategy steps the trainer's torch optimizer. Parity, resume and export of every strategy
with these defaults are the other test files' (the fp32 parity tests pin ``mixed_precision: no``).
"""

from __future__ import annotations

import json

import pytest

from hftrain.errors import ConfigError
from hftrain.strategies.platform import Platform

CPU = Platform(device="cpu", backend="gloo")


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "fma"}, "no"),  # AVX2-only (the AMD EPYC where bf16 matmul ran at 0.3 GFLOP/s)
        ({"avx2", "avx512f"}, "no"),  # AVX-512 without its bf16 extension still emulates bf16
        ({"avx2", "avx512f", "avx512_bf16"}, "bf16"),
        ({"avx2", "amx_bf16", "amx_tile"}, "bf16"),
        (set(), "no"),  # no /proc/cpuinfo (macOS, Windows): nothing is assumed
    ],
)
def test_auto_precision_is_bf16_only_with_a_native_bf16_flag(monkeypatch, flags, expected):
    from hftrain.strategies import platform

    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset(flags))
    precision, reason = CPU.resolve_precision("auto")
    assert precision == expected and reason.startswith("auto: ")
    for explicit in ("no", "bf16"):  # a value the user set is kept
        assert CPU.resolve_precision(explicit) == (explicit, "set in the config")


def test_this_machine_reads_its_own_flags():
    flags = open("/proc/cpuinfo").read()  # noqa: SIM115 - Linux CI; the parsed set must agree with the raw file
    native = "amx_bf16" in flags or "avx512_bf16" in flags
    assert (CPU.native_bf16() is not None) == native


def _strategy(name: str, **options):
    from hftrain.strategies import LaunchInfo, strategy_from_options

    return strategy_from_options(name, options, launch=LaunchInfo(world_size=2, local_world_size=2))


@pytest.mark.parametrize(
    "name, options, expected",
    [
        ("ddp", {}, "adamw_torch_fused"),
        ("fsdp", {"fsdp_version": 1}, "adamw_torch_fused"),
        ("fsdp", {"fsdp_version": 2}, "adamw_torch_fused"),
        ("zero1", {}, "adamw_torch_fused"),
        ("zero3", {}, "adamw_torch_fused"),
        ("zero2", {"offload_optimizer": True}, "adamw_torch"),  # Accelerate swaps in DeepSpeed's CPU Adam
        ("megatron", {"tp": 2}, "adamw_torch_fused"),
    ],
)
def test_auto_optimizer_per_strategy(name, options, expected):
    from hftrain.config import TrainingConfig

    training, notes = _strategy(name, **options).resolve_training(TrainingConfig())
    assert training.optim == expected and training.mixed_precision in ("no", "bf16")
    assert notes[0].startswith(f"mixed_precision: {training.mixed_precision} (auto: ")
    assert notes[1] == f"optim: {expected} (auto)"


def test_fused_adamw_is_refused_under_optimizer_offload():
    from hftrain.config import TrainingConfig

    with pytest.raises(ConfigError, match="training.optim: adamw_torch_fused cannot run under strategy 'zero3'"):
        _strategy("zero3", offload_optimizer=True).resolve_training(TrainingConfig(optim="adamw_torch_fused"))


def test_accelerate_config_precision_decides_auto():
    from hftrain.config import StrategyConfig, TrainingConfig
    from hftrain.strategies import LaunchInfo, build_strategy

    launch = LaunchInfo(accelerate_settings={"ACCELERATE_MIXED_PRECISION": "bf16"})
    training, notes = build_strategy(StrategyConfig(), launch=launch).resolve_training(TrainingConfig())
    assert training.mixed_precision == "bf16" and "accelerate config" in notes[0]


def test_defaults_are_in_effect_in_a_real_job(tmp_path):
    """The job a user runs: its optimizer is the fused kernel, its accelerator autocasts to the resolved precision,
    and the run's saved strategy says so."""
    from hftrain.config import load_config
    from hftrain.job import prepare_job
    from hftrain.strategies import LaunchInfo
    from tests.tiny import reset_accelerate_state, save_model_folder, write_csv

    reset_accelerate_state()
    model = save_model_folder(tmp_path / "model")
    out = tmp_path / "out"
    config = load_config(
        None,
        ["--model_name_or_path", str(model), "--train_file", str(write_csv(tmp_path / "train.csv")),
         "--output_dir", str(out), "--max_steps", "2", "--log_with", "none", "--max_seq_length", "32"],
    )  # fmt: skip
    trainer, _, _ = prepare_job(config, LaunchInfo())
    try:
        expected = "bf16" if CPU.native_bf16() else "no"
        assert trainer.accelerator.mixed_precision == expected
        assert all(group["fused"] for group in trainer.optimizer.optimizer.param_groups)
        trainer.fit()
        saved = json.loads((out / "hftrain_strategy.json").read_text())
        assert (saved["mixed_precision"], saved["optim"]) == (expected, "adamw_torch_fused")
    finally:
        trainer.close()


def test_host_allocator_is_tuned_on_cpu_only():
    import platform as host

    if host.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt is what is tuned")
    assert CPU.tune_host_allocator().startswith("host allocator: glibc keeps freed blocks")
    assert CPU.tune_host_allocator() == CPU.tune_host_allocator()  # idempotent: every Trainer of a process calls it
    assert Platform(device="cuda", backend="nccl").tune_host_allocator() == "host allocator: left as is (GPU)"


HEAP_PROBE = """
import resource, sys, torch
from hftrain.strategies.platform import Platform
cpu = Platform(device="cpu", backend="gloo")
n = 96 << 20
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.set_num_threads(2)
assert cpu.warm_heap(n) is None  # glibc not told to keep freed blocks: a freed block would be unmapped
cpu.tune_host_allocator()
torch.set_num_threads(1)
assert cpu.warm_heap(n) is None  # no idle core of its own
torch.set_num_threads(2)
warmer = cpu.warm_heap(n)
warmer.release()
warmer.release()  # idempotent
def step_tensors():  # what a first step does: many tensors, each smaller than the block, written
    tensors = [torch.empty(n // 16, dtype=torch.uint8) for _ in range(14)]
    for t in tensors:
        t.fill_(1)
    return tensors
start = faults(); first = step_tensors(); warm = faults() - start
start = faults(); second = step_tensors(); cold = faults() - start  # beside the first: fresh pages
cpu.tune_host_allocator(lean=True)
assert cpu.warm_heap(n) is None  # lean: freed blocks go back to the system
print(warm, cold)
"""


def test_the_heap_warmer_faults_in_the_pages_the_next_allocation_takes():
    """After ``Platform.warm_heap(n).release()`` tensors filling most of ``n`` bytes are written without page faults
    (read from the process: ``ru_minflt``), while the same tensors again, beside them, fault in their pages; refused
    without glibc's speed tuning, on one thread, and under the lean tuning."""
    import platform as host
    import subprocess
    import sys

    if host.libc_ver()[0] != "glibc":
        pytest.skip("glibc's heap is what is warmed")
    probe = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    warm, cold = map(int, probe.stdout.split())
    assert cold > 0 and warm * 10 < cold, (warm, cold)


def test_resuming_under_another_resolved_precision_is_logged(tmp_path):
    """A checkpoint trained in bf16 resumed where 'auto' is fp32 (another CPU) continues, and says so."""
    import json

    from hftrain.checkpoint.resume import check_resumable

    topology = {
        "strategy": "ddp",
        "world_size": 1,
        "global_batch": 32,
        "mixed_precision": "no",
        "optim": "adamw_torch_fused",
    }
    meta = {"config": {}, "topology": {**topology, "mixed_precision": "bf16", "dropout_kernel": "bits"}}
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "sharded.json").write_text(json.dumps({"format": "hftrain-dcp-v1", "strategy": "ddp"}))
    notes = check_resumable(meta, path=tmp_path, run_config={}, topology={**topology, "dropout_kernel": "torch"})
    assert notes == [
        "checkpoint trained with mixed_precision bf16; this run continues with no (the config or 'auto' on this "
        "machine decides; set it to keep the checkpoint's)",
        "checkpoint trained with dropout_kernel bits; this run continues with torch (the config or 'auto' on this "
        "machine decides; set it to keep the checkpoint's)",
    ]
    assert check_resumable({"config": {}, "topology": topology}, path=tmp_path, run_config={}, topology=topology) == []
