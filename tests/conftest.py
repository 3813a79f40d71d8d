"""Fixtures and helpers shared by several test files."""

from __future__ import annotations

import json
import multiprocessing.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.file_order import longest_first, recorded, recorder_from_environment

ROOT = Path(__file__).resolve().parents[1]
_RECORDER = recorder_from_environment()


def pytest_collection_modifyitems(session, config, items) -> None:
    """The files longest first (``tests.file_order``): the two workers' tail is the shortest files."""
    items[:] = longest_first(items, recorded())


def pytest_runtest_logreport(report) -> None:
    if _RECORDER is not None:
        _RECORDER.add(report)


def pytest_sessionfinish(session) -> None:
    # on the xdist controller (or a run without workers): every report has passed through it
    if _RECORDER is not None and not hasattr(session.config, "workerinput"):
        _RECORDER.write()


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory) -> Iterator[Path]:
    """Point TMPDIR (this process's and every launched rank's) at one folder that is removed when the suite ends.

    Runs that name their own output folder under the temporary directory (``tiny._fresh_output_dir``, checkpoints of
    the in-process runs) would otherwise stay behind in /tmp after every run: thousands of folders, gigabytes, until
    the disk is full.
    """
    # multiprocessing's own folder (the fork server's socket, tests.distributed) is made before TMPDIR moves: it is
    # removed by multiprocessing at exit, after this fixture has removed its root
    multiprocessing.util.get_temp_dir()
    root = tmp_path_factory.mktemp("tmpdir")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # re-read TMPDIR
    # the data cache too (hftrain.data.cache): shared by the suite's runs, gone with it, never the user's ~/.cache
    cache_before = os.environ.get("HFTRAIN_CACHE")
    os.environ["HFTRAIN_CACHE"] = str(root / "hftrain-data-cache")
    yield root
    if cache_before is None:
        os.environ.pop("HFTRAIN_CACHE", None)
    else:
        os.environ["HFTRAIN_CACHE"] = cache_before
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str, str], Path]]:
    """Mount small tmpfs file systems (root only); yields a function that mounts one at a path with given options.

    A real full or read-only disk, where the tests need one; skipped with the reason where it cannot be mounted.
    """
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode})")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):  # lazily: a failed writer's file may still be open in a kept traceback
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def assert_refused(stderr: str, code: int, fragment: str) -> None:
    """A bad input's refusal: exit code 2, exactly one ``hftrain: error:`` line holding ``fragment``, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("hftrain: error:")]
    assert code == 2, (code, stderr[-2000:])
    assert len(errors) == 1, lines
    assert "Traceback" not in stderr
    assert fragment in errors[0], errors[0]


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory) -> dict[str, str]:
    """Tiny model folders and small labelled CSVs for tests that run real jobs (one per test module).

    Keys: ``model`` and ``bert`` (a tiny BERT), ``gpt2``, ``deberta`` (a family the default ring cp refuses),
    ``bert_dropout`` (dropout 0.1); ``data`` (80 rows, seed 1) and ``data_400`` (400 rows, seed 2) as CSV files
    with columns ``text,label``; ``root``, the folder holding them.
    """
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import synthetic_texts, tiny_config, tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny_job")
    configs = {kind: tiny_config(kind) for kind in ("gpt2", "bert")}
    configs["deberta"] = tiny_config("deberta-v2")
    configs["bert_dropout"] = tiny_config("bert", dropout=0.1)
    for kind, config in configs.items():
        AutoModelForSequenceClassification.from_config(config).save_pretrained(root / kind)
        tiny_tokenizer("gpt2" if kind == "gpt2" else "bert").save_pretrained(root / kind)
    files = {"data": (80, 1), "data_400": (400, 2)}
    for name, (rows, seed) in files.items():
        texts, labels = synthetic_texts(rows, seed=seed)
        lines = "".join(f"{text},{label}\n" for text, label in zip(texts, labels, strict=True))
        (root / f"{name}.csv").write_text("text,label\n" + lines)
    return {
        **{kind: str(root / kind) for kind in configs},
        "model": str(root / "bert"),
        **{name: str(root / f"{name}.csv") for name in files},
        "root": str(root),
    }


def job_args(job: dict[str, str], output_dir: Path, *, steps: int = 4, data: str = "data") -> list[str]:
    """The command line of a short job on the ``tiny_job`` files: micro-batch 4 × accumulation 2, a loss every step.

    Args:
        job: the ``tiny_job`` fixture.
        output_dir: the run's ``output_dir``.
        steps: optimizer steps (``--max_steps``).
        data: which of ``tiny_job``'s CSV files trains (``data``: 80 rows, ``data_400``: 400).
    """
    return [
        "--model_name_or_path", job["model"], "--train_file", job[data], "--output_dir", str(output_dir),
        "--max_steps", str(steps), "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
        "--logging_steps", "1", "--log_with", "none", "--max_seq_length", "32", "--learning_rate", "1e-3",
    ]  # fmt: skip


def logged_losses(output_dir: Path) -> list[float]:
    """The training losses a finished run logged, in order (``output_dir/trainer_state.json``)."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def assert_same_exports(run: Path, reference: Path, *, atol: float) -> None:
    """The two runs' ``save_pretrained`` exports hold the same tensors, within ``atol``."""
    from safetensors.torch import load_file

    mine, theirs = (load_file(str(out / "model" / "model.safetensors")) for out in (run, reference))
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert (tensor - theirs[name]).abs().max().item() <= atol, name


def launch_env() -> dict[str, str]:
    """The environment of a launched job in tests: offline, no tokenizer threads."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_ok(command: list[str], *, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root as a launched job; assert it exits 0 (its output tail if not)."""
    done = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def torchrun(nprocs: int, args: list[str], *, timeout: float = 900) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node nprocs ARGS`` (e.g. ``scripts/train.py ...``) that must succeed."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs)]
    return run_ok([*launcher, *args], timeout=timeout)


def cli_in_process(argv: list[str]) -> tuple[int, str]:
    """Run ``hftrain`` in this (spawned) process; its exit code and what it printed on stderr."""
    import contextlib
    import io

    from hftrain.cli import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(argv)
    return code, stderr.getvalue()
