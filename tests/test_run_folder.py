"""The run folder is hftrain's alone (issue 52): no write follows a planted link, no delete enters one, nothing waits
on a FIFO, and one command at a time holds a folder.

- Files a run rewrites (``trainer_state.json``, ``hftrain_strategy.json``, ``run_summary.json``, the pictures) are
  new files renamed over the old: a symlink or a hard link to a file outside the run is replaced, the outside file
  keeps its bytes (and a FIFO is replaced without being opened).
- Entries a run, ``export`` or ``convert`` deletes or writes into as folders (``model``, ``checkpoints``, a
  ``step_<N>``, ``.staging-*``, ``.previous-*``, ``runs``, the export and convert targets) that are a link or a
  FIFO are refused in one line, exit 2, before anything is written; never followed, never waited on.
- A training run holds ``output_dir/.hftrain.lock`` for its life; ``export`` and ``convert`` hold a lock beside their
  output folder. A second command is refused naming the holder; a lock left by a killed run does not block.
- TensorBoard writes into ``output_dir/runs``, which ``overwrite_output_dir`` removes.

Every launched command runs under a subprocess timeout, so that a FIFO regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, assert_refused, job_args, launch_env

TIMEOUT = 240  # seconds for one launched command: a hang on a FIFO fails the test instead of blocking it


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hftrain", *args]


def _run(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(_command(*args), cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)


def _start(log: Path, *args: str) -> subprocess.Popen:
    """Launch ``hftrain ARGS`` in the background, its stderr into the file ``log`` (a pipe would fill up)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stderr:
        process = subprocess.Popen(
            _command(*args), cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True
        )
    process.log = log
    return process


def _finish(process: subprocess.Popen, timeout: float = TIMEOUT) -> tuple[int, str]:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"hftrain hung (killed after {timeout} s): {process.log.read_text()[-2000:]}") from None
    return process.returncode, process.log.read_text()


def _ok(done: subprocess.CompletedProcess | tuple[int, str]) -> None:
    code, err = (done.returncode, done.stderr) if isinstance(done, subprocess.CompletedProcess) else done
    assert code == 0, err[-3000:]


def _train_args(tiny_job: dict[str, str], out: Path, *extra: str, steps: int = 2) -> list[str]:
    return ["train", *job_args(tiny_job, out, steps=steps), "--save_steps", "2", *extra]


def _tree(folder: Path) -> dict[str, tuple]:
    """Every entry below ``folder`` (links not followed) with its kind, size and modification time."""
    found = {}
    for path in sorted(folder.rglob("*")):
        status = path.lstat()
        found[str(path.relative_to(folder))] = (status.st_mode, status.st_size, status.st_mtime_ns)
    return found


def _wait_for(condition, what: str, process: subprocess.Popen | None = None, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {process.log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


def _steps(out: Path) -> list[str]:
    folder = out / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) if folder.is_dir() else []


@pytest.fixture(scope="module")
def finished_run(tiny_job, tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoint step 2, export ``model``) with TensorBoard logs; copy it before changing it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    _ok(_run(*_train_args(tiny_job, out, "--log_with", "tensorboard")))
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


# ----------------------------------------------------------------------------------------------- writes replace links
def test_a_resumed_run_replaces_planted_links_and_hard_links_instead_of_writing_through(
    tiny_job, finished_run, tmp_path
):
    """On resume, run files that are symlinks, hard links or FIFOs are replaced: the outside files keep their bytes,
    no write waits on a FIFO, and the run's files are regular files of its own afterwards. TensorBoard wrote into
    ``runs/``, never ``output_dir/hftrain``."""
    assert (finished_run / "runs" / "hftrain").is_dir() and not (finished_run / "hftrain").exists()
    assert list((finished_run / "runs" / "hftrain").glob("events.out.tfevents.*"))
    out = _copy(finished_run, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    names = ("trainer_state.json", "hftrain_strategy.json", "run_summary.json", "training_curves.png")
    for rounds, kinds in enumerate(
        (("symlink", "hardlink", "symlink", "fifo"), ("hardlink", "symlink", "fifo", "symlink"))
    ):
        planted = {}
        for name, kind in zip(names, kinds, strict=True):
            target = outside / f"{rounds}-{name}"
            target.write_text(f"the user's own {name}\n")
            (out / name).unlink()
            if kind == "symlink":
                (out / name).symlink_to(target)
            elif kind == "hardlink":
                os.link(target, out / name)
            else:
                os.mkfifo(out / name)
            planted[target] = target.read_text()
        steps = str(4 + 2 * rounds)
        _ok(_run(*_train_args(tiny_job, out, "--resume_from_checkpoint", "auto", steps=int(steps))))
        for target, text in planted.items():
            assert target.read_text() == text, target  # not written through
        for name in names:
            status = (out / name).lstat()
            assert stat_is_regular(status.st_mode) and status.st_nlink == 1, name
        assert json.loads((out / "trainer_state.json").read_text())["global_step"] == int(steps)
    assert not (out / ".hftrain.lock").exists()  # released when the run ended


def stat_is_regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


# ------------------------------------------------------------------------ links and FIFOs where hftrain deletes
def run_commands(cases_file: str) -> None:
    """Run each ``argv`` of ``cases_file`` (a JSON list) through ``hftrain.cli.main`` in this process; write each
    exit code and stderr next to it (``<cases_file>.out``). One interpreter for many quick refusals."""
    import contextlib
    import io

    from hftrain.cli import main

    results = []
    for argv in json.loads(Path(cases_file).read_text()):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = main(argv)
        results.append([code, stderr.getvalue()])
        Path(cases_file + ".out").write_text(json.dumps(results))


def _refusals(tmp_path: Path, commands: list[list[str]]) -> list[tuple[int, str]]:
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(commands))
    code = f"from tests.test_run_folder import run_commands; run_commands({str(cases)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(result) for result in json.loads((tmp_path / "cases.json.out").read_text())]


def _plant(path: Path, kind: str, outside: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(outside, target_is_directory=True)
    else:
        path.mkdir()


def test_links_and_fifos_where_hftrain_deletes_or_writes_a_folder_are_refused_before_anything_is_written(
    tiny_job, finished_run, tmp_path
):
    """Each planted entry: one line, exit 2, no hang, the run folder and the outside folder unchanged."""
    resume = ["--resume_from_checkpoint", "auto"]
    overwrite = ["--overwrite_output_dir", "true"]
    run_cases = [  # (entry under the run folder, kind, extra arguments, fragment of the line)
        ("model", "link", resume, "model' is a symbolic link"),
        ("model", "fifo", resume, "model' is a FIFO"),
        ("model", "link", overwrite, "model' is a symbolic link"),
        (".staging-model", "link", resume, ".staging-model' is a symbolic link"),
        (".staging-model", "fifo", resume, ".staging-model' is a FIFO"),
        (".previous-model", "link", resume, ".previous-model' is a symbolic link"),
        ("model_merged", "fifo", resume, "model_merged' is a FIFO"),
        ("checkpoints/step_00000004", "fifo", resume, "step_00000004' is a FIFO"),
        ("checkpoints/step_00000006", "link", resume, "step_00000006' is a symbolic link"),
        ("checkpoints/.staging-step_00000004", "fifo", resume, ".staging-step_00000004' is a FIFO"),
        ("checkpoints/.staging-step_00000004", "link", resume, ".staging-step_00000004' is a symbolic link"),
        ("runs", "link", resume, "runs' is a symbolic link"),
        ("runs/hftrain", "fifo", resume, "runs/hftrain' is a FIFO"),
        ("trainer_state.json", "folder", resume, "is a folder where the run writes a file"),
        ("trainer_state.json", "fifo", overwrite, "trainer_state.json' is a FIFO"),
        ("run_summary.json", "link", overwrite, "run_summary.json' is a symbolic link"),
        (".hftrain.lock", "link", resume, ".hftrain.lock' is a symbolic link"),
        (".hftrain.lock", "fifo", overwrite, ".hftrain.lock' is a FIFO"),
    ]
    commands, checks = [], []

    def case(command: list[str], folder: Path, outside: Path, fragment: str) -> None:
        commands.append(command)
        checks.append((folder, outside, _tree(folder), _tree(outside), fragment))

    for index, (entry, kind, extra, fragment) in enumerate(run_cases):
        out = _copy(finished_run, tmp_path / f"run{index}")
        outside = tmp_path / f"outside{index}"
        outside.mkdir()
        _plant(out / entry, kind, outside)
        case(_train_args(tiny_job, out, *extra, steps=6), out, outside, fragment)
    # the checkpoints folder itself a link: its checkpoints live elsewhere (a resume from it is refused as an outside
    # checkpoint), and an overwrite would delete through it
    out = _copy(finished_run, tmp_path / "run-checkpoints-link")
    outside = tmp_path / "outside-checkpoints"
    shutil.move(out / "checkpoints", outside)
    (out / "checkpoints").symlink_to(outside, target_is_directory=True)
    case(_train_args(tiny_job, out, *overwrite, steps=6), out, outside, "checkpoints' is a symbolic link")
    # a step that rotation deletes (save_total_limit 1) a link to a complete checkpoint elsewhere: refused before the
    # run writes anything (it used to publish step 4, then fail on "Cannot call rmtree on a symbolic link")
    out = _copy(finished_run, tmp_path / "run-rotated-link")
    rotated = tmp_path / "outside-rotated"
    shutil.copytree(out / "checkpoints" / "step_00000002", rotated)
    (out / "checkpoints" / "step_00000001").symlink_to(rotated, target_is_directory=True)
    limit = ["--save_total_limit", "1"]
    case(_train_args(tiny_job, out, *resume, *limit, steps=6), out, rotated, "step_00000001' is a symbolic link")
    # hftrain export RUN OUT / hftrain convert RUN OUT: the staging and previous folders beside OUT, OUT itself
    for command in ("export", "convert"):
        for entry, kind in ((".staging-OUT", "link"), (".staging-OUT", "fifo"), (".previous-OUT", "link"),
                            ("OUT", "link"), ("OUT", "fifo"), (".OUT.hftrain.lock", "fifo")):  # fmt: skip
            place = tmp_path / f"{command}-{entry}-{kind}"
            outside = tmp_path / f"outside-{command}-{entry}-{kind}"
            outside.mkdir()
            _plant(place / entry, kind, outside)
            word = "a symbolic link" if kind == "link" else "a FIFO"
            case([command, str(finished_run), str(place / "OUT")], place, outside, f"{entry}' is {word}")
    before = _tree(finished_run)
    results = _refusals(tmp_path, commands)
    assert len(results) == len(checks) == 32
    for (code, err), (folder, outside, tree, outside_tree, fragment) in zip(results, checks, strict=True):
        assert_refused(err, code, fragment)
        assert _tree(folder) == tree, (folder, fragment)  # nothing written, nothing removed
        assert _tree(outside) == outside_tree, (folder, fragment)  # nothing written through the link
    assert _tree(finished_run) == before
    link = tmp_path / "run-rotated-link" / "checkpoints" / "step_00000001"
    assert link.is_symlink() and os.readlink(link) == str(rotated)  # the link kept, its checkpoint whole
    assert (rotated / "checkpoint.json").is_file() and (rotated / "state").is_dir()


# -------------------------------------------------------------------------------------------- one command at a time
def test_two_runs_started_together_into_one_folder(tiny_job, tmp_path):
    """One is refused in one line (the folder is held, or another run now owns it); the other completes, and its run
    resumes."""
    out = tmp_path / "run"
    first, second = (_start(tmp_path / "logs" / f"{i}", *_train_args(tiny_job, out, steps=4)) for i in range(2))
    results = [_finish(first), _finish(second)]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, err in results]
    code, err = next(result for result in results if result[0] == 2)
    assert_refused(err, code, "training.output_dir")
    assert any(text in err for text in ("in use by another hftrain command (command train", "already holds this run",
                                          "changed while this command was starting")), err  # fmt: skip
    _ok(_run(*_train_args(tiny_job, out, "--resume_from_checkpoint", "auto", steps=6)))
    run_id = (out / "hftrain_config.yaml").read_text().split("run_id: ")[1].split()[0]
    for step in _steps(out):
        assert json.loads((out / "checkpoints" / step / "checkpoint.json").read_text())["run_id"] == run_id
    assert _steps(out)[-1] == "step_00000006" and not (out / ".hftrain.lock").exists()


def test_a_live_run_holds_its_folder_against_overwrite_and_a_planted_fifo_stops_it_in_one_line(tiny_job, tmp_path):
    """``overwrite_output_dir`` during a live run is refused naming the run (its checkpoints intact); a FIFO planted at
    the live run's next checkpoint stops it in one line instead of hanging it; a lock left behind does not block
    the next command, whose overwrite removes the earlier run's TensorBoard logs."""
    out = tmp_path / "run"
    live = _start(tmp_path / "live.log", *_train_args(tiny_job, out, "--log_with", "tensorboard", steps=100000))
    _wait_for(lambda: (out / ".hftrain.lock").exists() and _steps(out), "lock and first checkpoint", live)
    holder = json.loads((out / ".hftrain.lock").read_text())
    assert holder["pid"] == live.pid and holder["command"] == "train" and holder["run_id"]
    steps = _steps(out)
    done = _run(*_train_args(tiny_job, out, "--overwrite_output_dir", "true"))
    assert_refused(done.stderr, done.returncode, f"pid {live.pid}")
    assert f"run_id {holder['run_id']}" in done.stderr
    assert set(steps) <= set(_steps(out)) and live.poll() is None  # the live run's checkpoints are intact
    # a FIFO where the live run writes its next checkpoint: refused there, not waited on
    step = int(_steps(out)[-1].split("_")[1]) + 10  # ahead of the steps trained since the last publication
    os.mkfifo(out / "checkpoints" / f"step_{step:08d}")
    code, err = _finish(live)
    assert_refused(err, code, f"step_{step:08d}' is a FIFO")
    # a lock file whose holder died (SIGKILL leaves it; the kernel dropped the lock) blocks nothing
    (out / ".hftrain.lock").write_text(json.dumps({**holder, "pid": 999999}) + "\n")
    old_events = set((out / "runs" / "hftrain").glob("events.out.tfevents.*"))
    assert old_events
    _ok(_run(*_train_args(tiny_job, out, "--overwrite_output_dir", "true", "--log_with", "tensorboard")))
    new_events = set((out / "runs" / "hftrain").glob("events.out.tfevents.*"))
    assert len(new_events) == 1 and not new_events & old_events  # the old curves are gone with the old run
    assert _steps(out) == ["step_00000002"] and not (out / ".hftrain.lock").exists()


def test_a_killed_run_leaves_a_lock_file_that_blocks_nothing(tiny_job, tmp_path):
    """SIGKILL: the kernel drops the lock, the file stays; ``auto`` resumes the run."""
    out = tmp_path / "run"
    live = _start(tmp_path / "live.log", *_train_args(tiny_job, out, steps=100000))
    _wait_for(lambda: _steps(out), "first checkpoint", live)
    live.send_signal(signal.SIGKILL)
    live.wait(timeout=TIMEOUT)
    assert (out / ".hftrain.lock").exists()
    latest = int(_steps(out)[-1].split("_")[1])
    _ok(_run(*_train_args(tiny_job, out, "--resume_from_checkpoint", "auto", steps=latest + 2)))
    assert _steps(out)[-1] == f"step_{latest + 2:08d}" and not (out / ".hftrain.lock").exists()


@pytest.mark.parametrize("command", ["export", "convert"])
def test_two_exports_or_converts_into_one_folder(finished_run, tmp_path, command):
    """One is refused in one line (the folder is held, or no longer empty); the other exits 0 with its folder
    complete, and no staging or previous folder is left."""
    out = tmp_path / "OUT"
    processes = [
        _start(tmp_path.parent / f"{tmp_path.name}-{i}.log", command, str(finished_run), str(out)) for i in range(2)
    ]
    results = [_finish(process) for process in processes]
    assert sorted(code for code, _ in results) == [0, 2], [err[-2000:] for _, err in results]
    code, err = next(result for result in results if result[0] == 2)
    field = "export directory" if command == "export" else "convert output"
    assert_refused(err, code, field)
    assert f"in use by another hftrain command (command {command}" in err or "is not empty" in err, err
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT"]  # no lock, staging or previous folder left


# ------------------------------------------------------------------------------------------------- other writers
def test_the_other_writers_replace_links_and_refuse_to_write_through_them(tmp_path):
    """Pictures, ``plan --write-configs``, the Slurm hostfile, the streamed safetensors writer and the lock of the
    other ranks: each probed with a planted link."""
    from hftrain.cli import main
    from hftrain.errors import HFTrainError
    from hftrain.files import FolderLock, UnsafePathError
    from hftrain.job import hold_folder
    from hftrain.launch.slurm import launcher_command, slurm_launch
    from tests.tiny import tiny_config

    outside = tmp_path / "outside.txt"
    outside.write_text("the user's own\n")
    # a picture drawn over a link: the link is replaced
    from hftrain.pictures import render_curves

    picture = tmp_path / "training_curves.png"
    picture.symlink_to(outside)
    render_curves([{"step": 1, "loss": 0.5, "learning_rate": 1e-3}], picture)
    assert not picture.is_symlink() and outside.read_text() == "the user's own\n"
    # the Slurm launcher's hostfile
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    (workdir / "hostfile").symlink_to(outside)
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1", "SLURM_JOB_ID": "123456", "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
    launcher_command(slurm_launch(env), "deepspeed", ["t.py"], accelerate_config=None, workdir=workdir)
    assert not (workdir / "hostfile").is_symlink() and outside.read_text() == "the user's own\n"
    # plan --write-configs into a link to an empty folder
    tiny_config("bert").save_pretrained(tmp_path / "model")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "configs").symlink_to(empty, target_is_directory=True)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["plan", "--model", str(tmp_path / "model"), "--write-configs", str(tmp_path / "configs")])
    assert_refused(err.getvalue(), code, "is a symbolic link")
    assert not any(empty.iterdir())
    # the streamed writer, in its staging folder: a planted link is refused, not written through
    import torch

    from hftrain.checkpoint.stream import StreamedSafetensorsWriter, TensorSpec

    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "model.safetensors").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        StreamedSafetensorsWriter(stage, [TensorSpec("w", (2,), torch.float32)])
    assert outside.read_text() == "the user's own\n"
    # the other ranks: the main process's lock, for this run; refused for another run or without one
    folder = tmp_path / "run"

    class Rank1:
        is_main_process, num_processes = False, 2

        @staticmethod
        def any_rank(flag: bool) -> bool:
            return flag

    # (out of a process group, the main process's broadcast is this process's own holder: this pid, this host)
    lock = FolderLock(folder / ".hftrain.lock", "training.output_dir")
    with FolderLock(folder / ".hftrain.lock", "training.output_dir", run_id="a", command="train"):
        assert hold_folder(lock, Rank1(), lambda: None) is None
    (folder / ".hftrain.lock").write_text(json.dumps({"host": "elsewhere", "pid": os.getpid()}))
    with pytest.raises(HFTrainError, match="held by another command"):
        hold_folder(lock, Rank1(), lambda: None)
    (folder / ".hftrain.lock").unlink()
    with pytest.raises(HFTrainError, match="holds no lock"):
        hold_folder(lock, Rank1(), lambda: None)


def test_publishing_checks_every_target_before_the_first_rename(tmp_path):
    """An export's (or convert's) targets, checked before anything is renamed: a link or a FIFO at the second target
    or a ``.previous-`` folder leaves the first target and both staging folders as they were, and nothing waits."""
    from hftrain.checkpoint.export import _publish_all
    from hftrain.files import UnsafePathError

    outside = tmp_path / "outside"
    outside.mkdir()
    for planted in ("model_merged", ".previous-model_merged", ".previous-model"):
        root = tmp_path / planted
        staged = []
        for name in ("model", "model_merged"):
            (root / f".staging-{name}").mkdir(parents=True)
            (root / f".staging-{name}" / "config.json").write_text("{}")
            staged.append((root / f".staging-{name}", root / name))
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text('{"old": 1}')
        if planted.startswith(".previous-model_"):
            os.mkfifo(root / planted)
        else:
            (root / planted).symlink_to(outside)
        before = _tree(root)
        with pytest.raises(UnsafePathError, match="is a (symbolic link|FIFO)"):
            _publish_all(staged)
        assert _tree(root) == before and not any(outside.iterdir())


def test_rotation_keeps_a_checkpoint_another_command_is_reading(tmp_path):
    """An export or a conversion reading step_N (a shared flock held through ``VerifiedCheckpoint.active``) keeps the
    live run's rotation from deleting it under the reader; the next save removes it."""
    from hftrain.checkpoint.manager import MARKER, CheckpointManager
    from hftrain.files import reading_folder, remove_unless_read

    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root, keep=1)

    def save(step: int) -> Path:
        staging = root / f".staging-step_{step:08d}"
        (staging / "state").mkdir(parents=True)
        (staging / "state" / "weights").write_bytes(b"w")
        final = root / f"step_{step:08d}"
        manager._finish(staging, final, {"step": step})
        assert (final / MARKER).is_file()
        return final

    first = save(2)
    with reading_folder(first):
        assert not remove_unless_read(first, "a checkpoint")
        second = save(4)
        assert first.is_dir() and second.is_dir()  # kept while read
    third = save(6)
    assert not first.exists() and not second.exists() and third.is_dir()
