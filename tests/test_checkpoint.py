"""Checkpoints: interrupted-then-resumed equals uninterrupted under every strategy; topology changes;
atomicity under SIGKILL; a real SIGTERM to a 2-process job; bad checkpoints refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hftrain.checkpoint.manager import CheckpointError, CheckpointManager, read_checkpoint
from hftrain.errors import HFTrainError
from tests.conftest import launch_env
from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "zero3+offload": ("zero3", {"offload_optimizer": True, "offload_params": True}),
    "fsdp1": ("fsdp", {"fsdp_version": 1}),
    "fsdp2": ("fsdp", {"fsdp_version": 2}),
}
# 96 examples, global batch 4 x 2 processes x accumulation 2 = 16: 6 steps per epoch; step 8 is mid-epoch 1.
COMMON = {"micro": 4, "gas": 2, "steps": 12, "save_steps": 5, "return_weights": True}


def _interrupted_and_uninterrupted(root: str) -> dict:
    runs = {}
    for label, (strategy, options) in STRATEGIES.items():
        kwargs = {**COMMON, "strategy": strategy, "strategy_options": options}
        try:
            full = run_tiny_training(output_dir=f"{root}/{label}/full", **kwargs)
            part = run_tiny_training(output_dir=f"{root}/{label}/part", stop_at_step=8, **kwargs)
            resumed = run_tiny_training(output_dir=f"{root}/{label}/part", resume_from_checkpoint="latest", **kwargs)
        except Exception as error:  # reported per strategy so one failure does not hide the others
            runs[label] = {"error": f"{type(error).__name__}: {error}"}
            continue
        runs[label] = {"full": full, "part": part, "resumed": resumed}
    # epoch boundary (step 6 ends epoch 0) and RNG restore (dropout on, random order) under DDP
    for label, extra in {
        "ddp-epoch-boundary": {"stop": 6},
        "ddp-dropout-random": {"dropout": 0.1, "order": "random"},
    }.items():
        kwargs = {**COMMON, "dropout": extra.get("dropout", 0.0), "order": extra.get("order", "group_by_length")}
        full = run_tiny_training(output_dir=f"{root}/{label}/full", **kwargs)
        run_tiny_training(output_dir=f"{root}/{label}/part", stop_at_step=extra.get("stop", 8), **kwargs)
        resumed = run_tiny_training(output_dir=f"{root}/{label}/part", resume_from_checkpoint="latest", **kwargs)
        runs[label] = {"full": full, "resumed": resumed}
    return runs


def _resume_on_one_process(root: str) -> dict:
    """Resume 2-process checkpoints on 1 process: DDP reshards (micro doubled keeps the global batch)."""
    outcomes = {}
    cases = {
        "ddp": dict(strategy="ddp", micro=8),
        "ddp-batch-changed": dict(strategy="ddp", micro=4),
        "zero2": dict(strategy="zero2", micro=8),
    }
    for label, kwargs in cases.items():
        source = label.split("-")[0]
        try:
            outcomes[label] = run_tiny_training(
                **{**COMMON, **kwargs}, output_dir=f"{root}/{source}/part", resume_from_checkpoint="latest"
            )
        except HFTrainError as error:
            outcomes[label] = {"error": str(error)}
    return outcomes


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("resume"))
    two = run_distributed(_interrupted_and_uninterrupted, nprocs=2, root=root)[0]
    one = run_distributed(_resume_on_one_process, nprocs=1, root=root)[0]
    return {"two": two, "one": one, "root": root}


def _assert_same_weights(a: dict, b: dict, *, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(STRATEGIES))
def test_resumed_equals_uninterrupted(runs, label):
    run = runs["two"][label]
    assert "error" not in run, run.get("error")
    full, part, resumed = run["full"], run["part"], run["resumed"]
    assert part["preempted"] == "stop_at_step" and part["global_step"] == 8
    assert resumed["global_step"] == full["global_step"] == 12
    assert resumed["losses"] == full["losses"]  # restored log history + identical continuation
    # the LR schedule continues, it does not restart (pitfall "LR schedule resets after resume", docs/pitfalls.md)
    assert resumed["lrs"] == full["lrs"]
    _assert_same_weights(resumed["weights"], full["weights"])
    assert resumed["metrics"] == pytest.approx(full["metrics"])


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["ddp-epoch-boundary", "ddp-dropout-random"])
def test_resume_at_epoch_boundary_and_with_rng(runs, label):
    # dropout and per-epoch shuffles only replay exactly if RNG and sampler epoch are restored
    # (pitfall "epoch and RNG state not restored", docs/pitfalls.md)
    run = runs["two"][label]
    assert run["resumed"]["losses"] == run["full"]["losses"]
    _assert_same_weights(run["resumed"]["weights"], run["full"]["weights"])


@pytest.mark.distributed
def test_ddp_checkpoint_reshards_to_one_process_keeping_the_global_batch(runs):
    resumed, full = runs["one"]["ddp"], runs["two"]["ddp"]["full"]
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5)
    for key, value in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
def test_topology_changes_that_cannot_work_are_refused(runs):
    assert "would change the global batch from 16 to 8" in runs["one"]["ddp-batch-changed"]["error"]
    # ZeRO on one process is refused before anything is built; between two counts > 1 the topology check
    # refuses it (test_resume_checks_model_task_strategy_and_trust).
    assert "partitions across processes but 1 was launched" in runs["one"]["zero2"]["error"]


@pytest.mark.distributed
def test_checkpoint_layout_and_rotation(runs):
    root = Path(runs["root"]) / "zero3" / "full" / "checkpoints"
    steps = sorted(p.name for p in root.iterdir())
    assert steps == ["step_00000005", "step_00000010", "step_00000012"]
    meta = read_checkpoint(root / "step_00000012")
    assert meta["trainer_state"]["global_step"] == 12 and meta["topology"]["world_size"] == 2
    assert meta["topology"]["strategy"] == "zero3" and "torch" in meta["versions"]
    # ZeRO writes the sharded format (hftrain.checkpoint.sharded): each rank its own file of its partitions, which
    # any strategy and process count reads (tests/test_checkpoint_reshard.py), not DeepSpeed's per-rank layout
    # (pitfall "full gather at save time runs out of memory", docs/pitfalls.md)
    state = root / "step_00000012" / "state"
    assert json.loads((state / "sharded.json").read_text())["format"] == "hftrain-dcp-v1"
    assert sorted(p.name for p in (state / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(state.rglob("*zero_pp_rank_*"))


# ----------------------------------------------------------------- bad checkpoints (one process, no launch)
def _fake_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints" / "step_00000003"
    (path / "state").mkdir(parents=True)
    (path / "state" / "model.safetensors").write_bytes(b"weights" * 100)
    from hftrain.checkpoint.manager import file_checksum

    marker = {
        "format_version": 1,
        "step": 3,
        "trainer_state": {"epoch": 0, "global_step": 3, "micro_step": 3, "samples_seen": 12},
        "topology": {"strategy": "ddp", "world_size": 1, "micro_batch": 4, "global_batch": 4},
        "config": {},
        "files": {"state/model.safetensors": file_checksum(path / "state" / "model.safetensors")},
    }
    (path / "checkpoint.json").write_text(json.dumps(marker))
    return path


def test_bad_checkpoints_are_refused(tmp_path):
    good = _fake_checkpoint(tmp_path)
    assert read_checkpoint(good)["step"] == 3
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not a complete hftrain checkpoint"):
        read_checkpoint(tmp_path)
    weights = good / "state" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_checkpoint(good)
    weights.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        read_checkpoint(good)


def test_checkpoints_record_xxh3_checksums_and_those_written_before_with_sha256_still_verify(tmp_path):
    import hashlib

    path = _fake_checkpoint(tmp_path)
    marker = path / "checkpoint.json"
    meta = json.loads(marker.read_text())
    weights = path / "state" / "model.safetensors"
    assert meta["files"]["state/model.safetensors"].startswith("xxh3_128:")
    meta["files"]["state/model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()  # before 2026-11-24
    marker.write_text(json.dumps(meta))
    assert read_checkpoint(path)["step"] == 3
    weights.write_bytes(b"other" * 100)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_checkpoint(path)
    meta["files"]["state/model.safetensors"] = "md5:0123"
    marker.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="checksum of kind 'md5'.*the hftrain version that wrote it"):
        read_checkpoint(path)


def test_latest_ignores_staging_and_unmarked_folders(tmp_path):
    _fake_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / ".staging-step_00000009").mkdir()
    (tmp_path / "checkpoints" / "step_00000008").mkdir()  # no marker: an interrupted non-atomic write
    manager = CheckpointManager(tmp_path / "checkpoints")
    assert manager.resolve("latest").name == "step_00000003"
    assert CheckpointManager(tmp_path / "empty").resolve("auto") is None
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        CheckpointManager(tmp_path / "empty").resolve("latest")


def test_resume_checks_model_task_and_trust_and_reshards_the_rest(tmp_path):
    from hftrain.checkpoint.resume import check_resumable, check_trusted

    meta = {"config": {"model.num_labels": 2}, "topology": {"strategy": "zero2", "world_size": 2, "global_batch": 16}}
    here = {"strategy": "zero2", "world_size": 2, "global_batch": 16}
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "sharded.json").write_text(json.dumps({"format": "hftrain-dcp-v1", "strategy": "zero2"}))
    with pytest.raises(CheckpointError, match="different model or task"):
        check_resumable(meta, path=tmp_path, run_config={"model.num_labels": 3}, topology=here)
    for there in ({**here, "strategy": "ddp"}, {**here, "world_size": 4}):  # the sharded format reshards
        assert check_resumable(meta, path=tmp_path, run_config={}, topology=there)[0].startswith("resharding")
    with pytest.raises(CheckpointError, match="trust_external_checkpoint"):
        check_trusted(tmp_path / "elsewhere", tmp_path / "run", trusted=False)
    check_trusted(tmp_path / "run" / "checkpoints" / "step_1", tmp_path / "run", trusted=False)


# ----------------------------------------------------------------- real processes and signals
def _args(job: dict[str, str], out: Path, steps: int, save_steps: int | None = None) -> list[str]:
    args = [
        "--model_name_or_path",
        job["model"],
        "--train_file",
        job["data_400"],  # 400 rows: enough steps to interrupt
        "--output_dir",
        str(out),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        "4",
        "--gradient_accumulation_steps",
        "2",
        "--log_with",
        "none",
        "--max_seq_length",
        "32",
        "--learning_rate",
        "1e-3",
        "--logging_steps",
        "1",
    ]
    return args + (["--save_steps", str(save_steps)] if save_steps else [])


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)


def _assert_same_exports(ours: Path, theirs: Path, *, atol: float) -> None:
    from safetensors.torch import load_file

    _assert_same_weights(load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors"), atol=atol)


def _signal_the_group(
    command: list[str], ready: Callable[[], bool], signum: int, *, settle: float = 0.0
) -> tuple[subprocess.Popen, str]:
    """Start ``command`` in a process group of its own (as a scheduler starts a job), send ``signum`` to the whole
    group once ``ready()`` (and ``settle`` seconds more), and return the process and its output."""
    process = subprocess.Popen(
        command, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(ready, process)
        time.sleep(settle)
        os.killpg(process.pid, signum)
        output = process.communicate(timeout=300)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process, output


def _wait_for(predicate, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.02)


@pytest.mark.distributed
def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(tiny_job, tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "hftrain",
        "train",
        *_args(tiny_job, out, steps=40, save_steps=1),
        "--save_total_limit",
        "3",
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    checkpoints = out / "checkpoints"

    def writing() -> bool:
        return any(checkpoints.glob(".staging-*/state/*"))

    try:
        _wait_for(lambda: len(list(checkpoints.glob("step_*"))) >= 2, process)
        # A tiny checkpoint is written in milliseconds: freeze the job when a write is seen, and kill it only if the
        # write is still in progress once frozen (else let it go on to the next one; it checkpoints every step).
        for _ in range(20):
            _wait_for(writing, process)
            process.send_signal(signal.SIGSTOP)
            if writing():
                break
            process.send_signal(signal.SIGCONT)
        process.kill()  # SIGKILL in the middle of writing
    finally:
        process.kill()
        process.wait()
    manager = CheckpointManager(checkpoints)
    latest = manager.resolve("latest")
    assert list(checkpoints.glob(".staging-*")), "the kill should have hit a write in progress"
    meta = read_checkpoint(latest)  # complete and uncorrupted
    assert meta["step"] >= 2
    again = _run([*command, "--resume_from_checkpoint", "latest"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {latest}" in again.stdout
    assert not list(checkpoints.glob(".staging-*"))


@pytest.mark.distributed
def test_sigterm_to_a_two_process_job_checkpoints_and_the_rerun_matches(tiny_job, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "scripts/train.py"]
    reference, preempted = tmp_path / "reference", tmp_path / "preempted"
    # Long enough that the signal always lands mid-run: on an idle machine this tiny job runs ~25 steps/s.
    steps = 200
    done = _run([*torchrun, *_args(tiny_job, reference, steps=steps)])
    assert done.returncode == 0, done.stderr[-3000:]
    command = [*torchrun, *_args(tiny_job, preempted, steps=steps), "--resume_from_checkpoint", "auto"]
    # what a scheduler does: the whole job gets SIGTERM
    process, output = _signal_the_group(command, lambda: (preempted / "hftrain_strategy.json").is_file(),
                                        signal.SIGTERM, settle=0.5)  # fmt: skip
    assert "preempted (SIGTERM)" in output, output[-3000:]
    stopped_at = CheckpointManager(preempted / "checkpoints").resolve("latest")
    assert 0 < read_checkpoint(stopped_at)["step"] < steps
    rerun = _run(command)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {stopped_at}" in rerun.stdout
    _assert_same_exports(preempted / "model", reference / "model", atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_process_group_ends_in_the_preemption_exit_code(tiny_job, tmp_path, signum):
    """``kill -TERM -PGID`` (``timeout``, Slurm's signal to a job step) reaches every process of the job's group: the
    run still checkpoints and exits 75 with its "preempted" line. The process drawing training_curves.png was in
    that group, died with it, and its failure ended the run with exit code 1 instead."""
    from hftrain.checkpoint.preemption import PREEMPTED_EXIT_CODE

    out = tmp_path / "run"
    command = [sys.executable, "-m", "hftrain", "train", *_args(tiny_job, out, steps=2000, save_steps=5)]
    # once the drawing process is in use
    process, output = _signal_the_group(command, lambda: (out / "training_curves.png").is_file(), signum)
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]
    stopped_at = CheckpointManager(out / "checkpoints").resolve("latest")
    step = read_checkpoint(stopped_at)["step"]  # complete: its checksums verify
    assert f"preempted ({signum.name}) at step {step}; checkpoint {stopped_at}" in output, output[-3000:]
    assert 5 <= step < 2000 and "Traceback" not in output and "drawing" not in output


@pytest.mark.distributed
# slow: 41 s of torchrun to count one message per machine; damaged checkpoints are refused in tests/test_bad_input.py
@pytest.mark.slow
def test_a_damaged_zero_checkpoint_is_said_once_per_machine_under_torchrun(tiny_job, tmp_path):
    """A ZeRO-2 checkpoint with a truncated shard and its checksums recomputed fails to load on both ranks of the
    machine alike: one line, not one per rank, on resume and on export (a missing weight or another shape in the
    DCP .metadata took the same path: two lines each)."""
    from tests.forged_checkpoints import STEP2, reseal

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hftrain"]
    run, zero2 = tmp_path / "run", ["--strategy.name", "zero2"]
    done = _run([*torchrun, "train", *_args(tiny_job, run, steps=2, save_steps=2), *zero2])
    assert done.returncode == 0, done.stderr[-3000:]
    shard = run / STEP2 / "state" / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    reseal(run, STEP2)
    resumed = [*_args(tiny_job, run, steps=4, save_steps=2), *zero2, "--resume_from_checkpoint", "auto"]
    for done in (_run([*torchrun, "train", *resumed]), _run([*torchrun, "export", str(run), str(tmp_path / "out")])):
        errors = [line for line in done.stderr.splitlines() if line.startswith("hftrain: error:")]
        assert "exitcode  : 2" in done.stderr and len(errors) == 1, errors
        assert "its files are damaged" in errors[0], errors


@pytest.mark.distributed
def test_export_command_from_a_zero_checkpoint(tiny_job, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    out = tmp_path / "run"
    done = _run([*torchrun, "scripts/train.py", *_args(tiny_job, out, steps=4), "--strategy.name", "zero2"])
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = str(out / "checkpoints" / "step_00000004")
    own = ["--output_dir", str(out)]  # the run the checkpoint belongs to, named by the command: no trust flag
    one = _run([sys.executable, "-m", "hftrain", "export", checkpoint, str(tmp_path / "one"), *own])
    assert one.returncode == 2 and "this export runs on 1; launch it on 2 processes" in one.stderr
    assert not (tmp_path / "one").exists()
    two = _run([*torchrun, "-m", "hftrain", "export", checkpoint, str(tmp_path / "two"), *own])
    assert two.returncode == 0, two.stderr[-3000:]
    _assert_same_exports(tmp_path / "two", out / "model", atol=0)
    again = _run([sys.executable, "-m", "hftrain", "export", checkpoint, str(tmp_path / "two"), *own])
    assert again.returncode == 2 and "is not empty" in again.stderr


def test_a_signal_during_the_export_finishes_the_run_and_says_so():
    """SIGTERM once the end-of-run export has begun: too late to stop (the export is what a resume would redo), so
    the run completes, exports, is not preempted (exit 0), and says in one line that the signal came and was not
    acted on; before, it said nothing. The signal is sent from inside the export, so the case is deterministic."""
    import os
    import signal

    from tests.tiny import _fresh_output_dir, fp32_args, tiny_classifier_trainer

    trainer = tiny_classifier_trainer(
        fp32_args(_fresh_output_dir(), per_device_train_batch_size=4, max_steps=3), n_train=24, n_eval=6
    )
    lines: list[str] = []
    log = trainer._log
    trainer._log = lambda line, *a, **k: (lines.append(line), log(line, *a, **k))
    exported: list[bool] = []
    result = trainer.fit(beside_last_save=lambda: (os.kill(os.getpid(), signal.SIGTERM), exported.append(True)))
    assert exported and result.preempted is None and result.global_step == 3
    said = [line for line in lines if "arrived during the export" in line]
    assert said == ["SIGTERM arrived during the export; the export was finished and the run is complete (exit 0: "
                    "nothing to resume)"], lines  # fmt: skip
