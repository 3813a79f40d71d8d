"""No checkpoint runs code, trusted or not (``hftrain.checkpoint.safety``), under DDP, ZeRO-2, megatron and DCP.

Real checkpoints are written by real runs (DDP on one process, ZeRO-2 and megatron tp=2 on two gloo processes);
every file of theirs that a library unpickles is then replaced by a pickle whose loading would create a file
``PWNED`` (bare, in torch's zip format, and as protocol-0 ``INST``), with the checksums recomputed as a forger
would. Each must be refused before any library loads it; resumed inside the run, exported from a foreign folder
without the trust flag, and exported with it. The one-line refusals of the single-process cases are in
``test_bad_input.py``'s table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hftrain.checkpoint.manager import CheckpointError
from hftrain.checkpoint.safety import check_no_code, pickled_files
from tests.forged_checkpoints import STEP2, planted_bytes, reseal, symlinked_planted_dcp
from tests.tiny import save_model_folder, write_csv

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
PAYLOADS = {
    "torch zip": lambda: planted_bytes(),
    "bare pickle": lambda: planted_bytes("bare"),
    "protocol 0 INST": lambda: b"(S'touch PWNED'\niposix\nsystem\n.",
}


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


def _train_args(root: Path, out: Path) -> list[str]:
    return [
        "train",
        "--model_name_or_path",
        str(root / "model"),
        "--dataset_name",
        "null",
        "--train_file",
        str(root / "train.csv"),
        "--output_dir",
        str(out),
        "--log_with",
        "none",
        "--per_device_train_batch_size",
        "4",
        "--max_steps",
        "2",
        "--save_steps",
        "2",
        "--mixed_precision",
        "no",
    ]


STRATEGIES = {
    "ddp": (1, []),
    "zero2": (2, ["--strategy.name", "zero2"]),
    "megatron": (2, ["--strategy.name", "megatron", "--parallelism.tp", "2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trust")
    save_model_folder(root / "model")
    write_csv(root / "train.csv", rows=40)
    made = {}
    for name, (processes, extra) in STRATEGIES.items():
        launcher = [sys.executable, "-m", "hftrain"] if processes == 1 else [*TORCHRUN, "-m", "hftrain"]
        done = _run([*launcher, *_train_args(root, root / name), *extra], cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        made[name] = root / name
    return made


def _planted_copy(run: Path, where: Path, file: str, payload: bytes) -> Path:
    copy = where / f"{run.name}-planted"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy)
    (copy / STEP2 / "state" / file).write_bytes(payload)
    reseal(copy, STEP2)
    return copy


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_pickled_state_file_is_refused_with_every_payload(runs, strategy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a payload that ran would leave PWNED here
    checkpoint = runs[strategy] / STEP2
    state = checkpoint / "state"
    names = [str(p.relative_to(state)) for p in pickled_files(state)]
    # Every strategy's model and optimizer are in the sharded format: DCP's .metadata is its pickle (the .distcp
    # tensors are read with weights_only=True), beside Accelerate's scheduler and per-rank RNG files.
    expected = {"custom_checkpoint_0.pkl", "random_states_0.pkl", "dcp/.metadata"} | {
        "ddp": set(),
        "zero2": {"random_states_1.pkl"},
        "megatron": {"random_states_1.pkl"},
    }[strategy]
    assert expected <= set(names), names
    if strategy == "zero2":
        import deepspeed  # noqa: F401 - a ZeRO run has DeepSpeed loaded: its checkpoint's classes are allowed then

    check_no_code(checkpoint, state)  # the checkpoint as written loads
    for name in names:
        for payload_name, payload in PAYLOADS.items():
            copy = _planted_copy(runs[strategy], tmp_path, name, payload())
            with pytest.raises(CheckpointError) as refused:
                check_no_code(copy / STEP2, copy / STEP2 / "state")
            assert name in str(refused.value), (name, payload_name, str(refused.value))
            assert "could run code" in str(refused.value) or "is damaged" in str(refused.value)
    assert not (tmp_path / "PWNED").exists()


def _refused(done: subprocess.CompletedProcess, fragment: str) -> None:
    """Every rank exited 2 with the one line (torchrun itself reports a failed worker group as 1)."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("hftrain: error:")]
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr, done.stderr[-3000:]
    assert errors and fragment in errors[0], errors
    assert "/hftrain/" not in done.stderr.split("Traceback", 1)[-1]  # only torchrun's own ChildFailedError report


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["zero2", "megatron"])
def test_planted_pickles_never_run_on_resume_or_export(runs, strategy, tmp_path):
    """Resumed inside the run, exported without and with the trust flag: refused each time, nothing runs."""
    processes, extra = STRATEGIES[strategy]
    copy = _planted_copy(runs[strategy], tmp_path, "dcp/.metadata", planted_bytes("bare"))
    root = runs[strategy].parent
    resume = _run([*TORCHRUN, "-m", "hftrain", *_train_args(root, copy), *extra, "--max_steps", "4",
                   "--resume_from_checkpoint", "auto"], cwd=tmp_path)  # fmt: skip
    _refused(resume, "could run code")
    untrusted = _run([*TORCHRUN, "-m", "hftrain", "export", str(copy / STEP2), str(tmp_path / "a")], cwd=tmp_path)
    _refused(untrusted, "is outside the run folder this command names")
    trusted = _run(
        [*TORCHRUN, "-m", "hftrain", "export", str(copy / STEP2), str(tmp_path / "b"), "--trust_external_checkpoint"],
        cwd=tmp_path,
    )
    _refused(trusted, "could run code")
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.distributed
def test_a_symlinked_state_dcp_never_runs_code_under_torchrun(runs, tmp_path):
    """The symlink attack (``state/dcp -> ../dcpx`` with a planted ``.metadata``, checksums recomputed) on 2-process
    checkpoints: ZeRO-2 resumed under torchrun, megatron tp2 resumed under torchrun, resumed on one process as ddp
    and converted. Each is refused in one line naming the link before any library reads it; nothing runs. (On the
    code before the refusal every one of these ran the planted command.)"""
    for strategy in ("zero2", "megatron"):
        copy = tmp_path / f"{strategy}-linked"
        shutil.copytree(runs[strategy], copy)
        symlinked_planted_dcp(copy, STEP2)
        root = runs[strategy].parent
        resume = [*_train_args(root, copy), "--max_steps", "4", "--resume_from_checkpoint", "auto"]
        _refused(_run([*TORCHRUN, "-m", "hftrain", *resume, *STRATEGIES[strategy][1]], cwd=tmp_path),
                 "state/dcp is a symbolic link")  # fmt: skip
    one_process = _run([sys.executable, "-m", "hftrain", *resume, "--strategy.name", "ddp"], cwd=tmp_path)
    assert one_process.returncode == 2 and "state/dcp is a symbolic link" in one_process.stderr, one_process.stderr
    converted = _run([sys.executable, "-m", "hftrain", "convert", str(copy), str(tmp_path / "out")], cwd=tmp_path)
    assert converted.returncode == 2 and "state/dcp is a symbolic link" in converted.stderr, converted.stderr
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_a_tp2_checkpoint_resumed_on_one_process_says_which_rng_states_it_leaves(runs, tmp_path):
    """Going down in process count: the ranks beyond the new world have RNG states nobody restores; the run says
    so, as going up says which ranks start from their seed."""
    copy = tmp_path / "megatron-copy"
    shutil.copytree(runs["megatron"], copy)
    root = runs["megatron"].parent
    done = _run([sys.executable, "-m", "hftrain", *_train_args(root, copy), "--max_steps", "3",
                 "--resume_from_checkpoint", "auto", "--strategy.name", "ddp"], cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the RNG states of the checkpoint's process 1 are not used" in done.stdout + done.stderr


def test_dcp_metadata_and_its_byte_entries_are_checked(tmp_path, monkeypatch):
    """A torch.distributed.checkpoint folder (FSDP's layout): a planted .metadata, and a planted non-tensor entry
    inside a .distcp file (which DCP loads with weights_only=False), are refused."""
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    checkpoint = tmp_path / "step_00000001"
    folder = checkpoint / "state" / "optimizer_0"
    dcp.save({"weight": torch.ones(3), "param_groups": {"lr": 0.1, "betas": (0.9, 0.99)}}, checkpoint_id=folder)
    check_no_code(checkpoint, checkpoint / "state")
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    # Point one byte entry at a planted pickle appended to its .distcp file.
    index = next(i for i in metadata.storage_data if i.fqn == "param_groups.lr")
    info = metadata.storage_data[index]
    data_file = folder / info.relative_path
    payload = planted_bytes()
    offset = data_file.stat().st_size
    with data_file.open("ab") as handle:
        handle.write(payload)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload), info.transform_descriptors)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"param_groups\.lr\).*could run code"):
        check_no_code(checkpoint, checkpoint / "state")
    (folder / ".metadata").write_bytes(io.BytesIO(planted_bytes("bare")).getvalue())
    with pytest.raises(CheckpointError, match=r"optimizer_0/\.metadata holds a pickled object \(posix\.system\)"):
        check_no_code(checkpoint, checkpoint / "state")
    assert not (tmp_path / "PWNED").exists()


def test_a_damaged_json_file_is_one_line(tmp_path):
    state = tmp_path / "step_00000001" / "state"
    state.mkdir(parents=True)
    (state / "sharded.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"state/sharded\.json is damaged"):
        check_no_code(state.parent, state)
