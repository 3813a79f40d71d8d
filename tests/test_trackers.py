"""Experiment trackers (``training.log_with``, ``hftrain.metrics.trackers``) with the real packages, offline.

W&B in offline mode (its ``.wandb`` transaction log read back record by record), MLflow's file store
(``mlflow.get_run`` and the metric history), trackio's local SQLite store; a run stopped and resumed is one tracker
run whose steps strictly increase; under ddp×2 only rank 0 writes; a missing package is refused in one line, exit 2,
nothing written (the package hidden from a child interpreter by a ``sitecustomize`` hftrain knows nothing of).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hftrain.errors import ConfigError
from tests.conftest import ROOT, assert_refused, job_args, launch_env, run_ok, torchrun

TRACKED = ["--log_with", "wandb,mlflow,trackio", "--eval_steps", "2", "--save_steps", "2"]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No network and nothing outside ``tmp_path``: W&B offline (its config, cache and data folders in tmp), trackio's
    store in tmp; MLflow's store is hftrain's default (``output_dir/runs/mlruns``)."""
    root = tmp_path / "trackers"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": root / "wandb_config",
        "WANDB_CACHE_DIR": root / "wandb_cache",
        "WANDB_DATA_DIR": root / "wandb_data",
        "TRACKIO_DIR": root / "trackio",
    }.items():
        monkeypatch.setenv(name, str(value))
    for name in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return root


def _hftrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "hftrain", "train", *args]


def _job(tiny_job: dict[str, str], out: Path, *, steps: int) -> list[str]:
    """``job_args`` without its ``--log_with none``."""
    args = job_args(tiny_job, out, steps=steps)
    at = args.index("--log_with")
    return args[:at] + args[at + 2 :]


def _wandb_records(path: Path) -> list:
    """The records of a W&B run's ``.wandb`` file: W&B's LevelDB-style log (a 7-byte header ``:W&B`` + magic +
    version, then 32 KiB blocks of chunks ``crc32 | length (2) | type (1) | data``: full, first, middle, last), each
    record a ``wandb_internal_pb2.Record``. wandb 0.31 ships no Python reader of it any more."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending, pos = path.read_bytes(), 32768, [], b"", 7
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb_runs(folder: Path) -> dict[str, dict]:
    """Per offline run folder: its run id, tags, config keys and history ``{key: [steps]}``."""
    runs = {}
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"history": {}, "config": set(), "tags": set(), "id": None}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["tags"] = record.run.run_id, set(record.run.tags)
            elif kind == "config":
                run["config"] |= {item.key for item in record.config.update}
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        run["history"].setdefault(key, []).append(record.history.step.num)
        runs[path.parent.name] = run
    return runs


def _read_back(out: Path) -> dict:
    """What MLflow's file store and trackio's store hold of the run, read in a child interpreter (MLflow's tracking
    URI is process-global)."""
    script = """
import json, os, sys
from mlflow.tracking import MlflowClient
import mlflow
out = sys.argv[1]
ids = json.load(open(os.path.join(out, "trainer_state.json")))["tracker_runs"]
mlflow.set_tracking_uri("file:" + os.path.join(out, "runs", "mlruns"))
run = mlflow.get_run(ids["mlflow"])
client = MlflowClient()
history = {k: [m.step for m in client.get_metric_history(ids["mlflow"], k)] for k in run.data.metrics}
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("hftrain", ids["trackio"])
trackio = {}
for entry in logs:
    for key in entry:
        if key not in ("step", "timestamp"):
            trackio.setdefault(key, []).append(entry["step"])
print(json.dumps({
    "ids": ids,
    "mlflow": {
        "params": run.data.params, "history": history,
        "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
        "runs": len(client.search_runs([run.info.experiment_id])),
        "pictures": [a.path for a in client.list_artifacts(ids["mlflow"], "pictures")],
    },
    "trackio": {"runs": SQLiteStorage.get_runs("hftrain"), "history": trackio},
}))
"""
    env = {**launch_env(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _increasing(steps: list[int]) -> bool:
    return all(a < b for a, b in zip(steps, steps[1:], strict=False))


def test_log_with_takes_one_name_a_list_all_or_none(tmp_path):
    from hftrain.config import load_config
    from hftrain.metrics.trackers import requested, resolve_trackers

    assert requested(None) == requested("none") == []
    assert requested("wandb") == ["wandb"]
    assert requested(["mlflow", "wandb", "mlflow"]) == ["mlflow", "wandb"]
    with pytest.raises(ConfigError, match="did you mean 'wandb'"):
        requested("wandbb")
    with pytest.raises(ConfigError, match="'none' stands alone"):
        requested(["wandb", "none"])
    assert {"tensorboard", "wandb", "mlflow", "trackio"} <= set(resolve_trackers("all"))
    # old configs keep loading; the command line takes a list
    for text, expected in (("tensorboard", "tensorboard"), ("none", None), ("[wandb, mlflow]", ["wandb", "mlflow"])):
        path = tmp_path / "job.yaml"
        path.write_text(f"training:\n  log_with: {text}\n")
        assert load_config(path).training.log_with == expected
    assert load_config(None, ["--log_with", "wandb,mlflow"]).training.log_with == ["wandb", "mlflow"]
    assert load_config(None, ["--log_with", "none"]).training.log_with is None


@pytest.mark.distributed
def test_a_resumed_run_is_one_tracker_run_in_wandb_mlflow_and_trackio(tiny_job, tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(offline / "wandb"))
    out = tmp_path / "run"
    args = [*_job(tiny_job, out, steps=2), "--validation_file", tiny_job["data"], *TRACKED]
    run_ok(_hftrain(*args))
    state = json.loads(next((out / "checkpoints").glob("step_*/checkpoint.json")).read_text())["trainer_state"]
    assert set(state["tracker_runs"]) == {"wandb", "mlflow", "trackio"}
    run_ok(_hftrain(*args, "--max_steps", "4", "--resume_from_checkpoint", "latest"))  # stopped at 2, resumed to 4
    facts = _read_back(out)
    assert facts["ids"] == state["tracker_runs"]  # the resume continued the same runs

    # W&B, offline: one run id over the two processes' files, each key's steps strictly increasing across them
    runs = _wandb_runs(offline / "wandb")
    assert len(runs) == 2 and {run["id"] for run in runs.values()} == {facts["ids"]["wandb"]}
    history: dict[str, list[int]] = {}
    for run in runs.values():  # folder names sort by start time
        for key, steps in run["history"].items():
            history.setdefault(key, []).extend(steps)
    assert history["train/loss"] == [1, 2, 3, 4]
    assert history["eval/loss"] == [2, 4]
    assert all(_increasing(steps) for steps in history.values()), history
    for key in ("train/learning_rate", "train/grad_norm", "train/tokens_per_second", "train/mfu", "eval/accuracy"):
        assert key in history, sorted(history)
    assert any(key.startswith("pictures/training_curves") for key in history)
    first = runs[min(runs)]
    assert {"training.learning_rate", "model.model_name_or_path", "topology/world_size"} <= first["config"]
    assert {"strategy:ddp", "world_size:1"} <= first["tags"]

    # MLflow's file store: params once (a resume changes none), every metric's steps strictly increasing, one run
    mlflow = facts["mlflow"]
    assert mlflow["runs"] == 1
    assert mlflow["params"]["training.learning_rate"] == "0.001" and mlflow["params"]["training.max_steps"] == "2"
    assert mlflow["history"]["train/loss"] == [1, 2, 3, 4] and mlflow["history"]["eval/loss"] == [2, 4]
    assert all(_increasing(steps) for steps in mlflow["history"].values()), mlflow["history"]
    assert mlflow["tags"]["strategy"] == "ddp" and mlflow["tags"]["world_size"] == "1"
    assert mlflow["pictures"] == ["pictures/training_curves.png"]

    # trackio, local: one run, its steps strictly increasing per key
    trackio = facts["trackio"]
    assert trackio["runs"] == [facts["ids"]["trackio"]]
    assert trackio["history"]["train/loss"] == [1, 2, 3, 4]
    assert all(_increasing(steps) for steps in trackio["history"].values()), trackio["history"]
    assert trackio["history"]["pictures/training_curves"] == [2, 4]


@pytest.mark.distributed
def test_only_rank_0_writes_to_the_trackers_under_ddp(tiny_job, tmp_path, offline):
    out = tmp_path / "run"  # W&B in hftrain's default folder: output_dir/runs
    torchrun(2, ["-m", "hftrain", "train", *_job(tiny_job, out, steps=2), *TRACKED])
    runs = _wandb_runs(out / "runs")
    assert len(runs) == 1, sorted(runs)
    (run,) = runs.values()
    assert {"world_size:2", "dp_size:2"} <= run["tags"] and run["history"]["train/loss"] == [1, 2]
    facts = _read_back(out)
    assert facts["mlflow"]["runs"] == 1 and facts["mlflow"]["tags"]["world_size"] == "2"
    assert facts["mlflow"]["history"]["train/loss"] == [1, 2]
    assert facts["trackio"]["runs"] == [facts["ids"]["trackio"]]
    assert not (offline / "wandb").exists()


def test_a_missing_tracker_package_is_refused_before_anything_is_written(tiny_job, tmp_path, offline):
    hide = tmp_path / "hide"
    hide.mkdir()
    # what an interpreter without wandb sees: the import fails and find_spec finds nothing (hftrain is not told)
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {**launch_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}
    check = subprocess.run([sys.executable, "-c", "import wandb"], cwd=ROOT, env=env, capture_output=True)
    assert check.returncode != 0  # the package is hidden indeed
    out = tmp_path / "run"
    args = [*_job(tiny_job, out, steps=1), "--log_with", "tensorboard,wandb"]
    done = subprocess.run(_hftrain(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert_refused(done.stderr, done.returncode, "pip install 'hftrain[wandb]'")
    assert not out.exists()
