"""Inputs hftrain must not trust, or that passed in silence (issue 52): model folders and checkpoints that name code
to run, data rows that flipped a whole column, runs with nothing to learn, and config values that allocated without
bound. Each is one ``hftrain: error:`` line, exit code 2, nothing written, and (for code) the planted code never ran
and no prompt was shown, with "y" waiting on stdin.

Every case runs in this process (``cli_in_process``) and is refused before any model is trained.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import assert_refused, cli_in_process, job_args

PROMPT = "Do you wish to run the custom code"


# ----------------------------------------------------------------- helpers
def _plant_code(folder: Path, marker: Path, *, model_type: str = "planted") -> Path:
    """Give a model folder an ``auto_map`` naming a ``planted.py`` beside it that leaves ``marker`` when imported."""
    (folder / "planted.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import BertConfig, BertForSequenceClassification\n"
        f"class PlantedConfig(BertConfig):\n    model_type = {model_type!r}\n"
        "class PlantedModel(BertForSequenceClassification):\n    config_class = PlantedConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {
        "AutoConfig": "planted.PlantedConfig",
        "AutoModelForSequenceClassification": "planted.PlantedModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _planted_folder(tiny_job: dict[str, str], tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "PLANTED_CODE_RAN"
    folder = tmp_path / "planted_model"
    shutil.copytree(tiny_job["model"], folder)
    return _plant_code(folder, marker), marker


def _refused_with_yes(monkeypatch, capsys, argv: list[str], fragment: str) -> None:
    """``hftrain ARGV`` with "y" on stdin: refused in one line, and no prompt printed."""
    monkeypatch.setattr("sys.stdin", io.StringIO("y\ny\ny\n"))
    code, stderr = cli_in_process(argv)
    out = capsys.readouterr()
    assert PROMPT not in stderr + out.out + out.err
    assert_refused(stderr, code, fragment)


def _write_dcp_checkpoint(model, run_dir: Path, model_path: str) -> Path:
    """A minimal hftrain checkpoint of ``model`` (step 4 of ``run_dir``), as ``test_convert`` writes one."""
    import torch.distributed.checkpoint as dcp

    from hftrain.checkpoint.manager import FORMAT_VERSION, file_checksum

    path = run_dir / "checkpoints" / "step_00000004"
    state = path / "state"
    dcp.save({f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()},
             checkpoint_id=str(state / "dcp"), no_dist=True)  # fmt: skip
    model.config.save_pretrained(state / "hf_model")
    (state / "sharded.json").write_text(json.dumps({"format": "hftrain-dcp-v1", "strategy": "ddp", "layout": {}}))
    files = {str(p.relative_to(path)): file_checksum(p) for p in sorted(path.rglob("*")) if p.is_file()}
    meta = {
        "format_version": FORMAT_VERSION, "step": 4, "run_id": "test-run",
        "trainer_state": {"epoch": 0, "global_step": 4, "micro_step": 0, "samples_seen": 0},
        "topology": {"strategy": "ddp", "world_size": 1, "micro_batch": 4, "global_batch": 4},
        "config": {"model.model_name_or_path": model_path, "model.num_labels": model.config.num_labels,
                   "lora.use_lora": False},
        "files": files,
    }  # fmt: skip
    (path / "checkpoint.json").write_text(json.dumps(meta))
    return path


def _reseal(path: Path) -> None:
    from hftrain.checkpoint.manager import file_checksum

    meta = json.loads((path / "checkpoint.json").read_text())
    meta["files"] = {
        str(p.relative_to(path)): file_checksum(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "checkpoint.json"
    }
    (path / "checkpoint.json").write_text(json.dumps(meta))


# ----------------------------------------------------------------- no remote code
def test_train_refuses_a_model_folder_that_names_code(tiny_job, tmp_path, monkeypatch, capsys):
    folder, marker = _planted_folder(tiny_job, tmp_path)
    out = tmp_path / "out"
    argv = ["train", *job_args({**tiny_job, "model": str(folder)}, out)]
    _refused_with_yes(monkeypatch, capsys, argv, "model.trust_remote_code")
    assert not marker.exists() and not out.exists()


def test_tokenizer_auto_map_is_refused_too(tiny_job, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "tokenizer_code"
    shutil.copytree(tiny_job["model"], folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["planted.PlantedTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    out = tmp_path / "out"
    argv = ["train", *job_args({**tiny_job, "model": str(folder)}, out)]
    _refused_with_yes(monkeypatch, capsys, argv, "tokenizer_config.json names Python code")
    assert not out.exists()


def test_plan_refuses_a_model_folder_that_names_code(tiny_job, tmp_path, monkeypatch, capsys):
    folder, marker = _planted_folder(tiny_job, tmp_path)
    _refused_with_yes(monkeypatch, capsys, ["plan", "--model", str(folder)], "auto_map")
    _refused_with_yes(monkeypatch, capsys, ["plan", "--model", str(folder / "config.json")], "auto_map")
    renamed = tmp_path / "other.json"
    shutil.copy(folder / "config.json", renamed)
    _refused_with_yes(monkeypatch, capsys, ["plan", "--model", str(renamed)], "auto_map")
    assert not marker.exists()


def test_trust_remote_code_runs_the_folders_own_code_when_the_user_says_so(tiny_job, tmp_path):
    """The field works: the user's own folder's code is imported (the checks build its model on meta)."""
    from hftrain.config import ModelConfig
    from hftrain.models.checks import check_model_folder

    folder, marker = _planted_folder(tiny_job, tmp_path)
    check_model_folder(ModelConfig(model_name_or_path=str(folder), trust_remote_code=True))
    assert marker.exists()


def test_a_trusted_models_run_exports_no_code(tiny_job, tmp_path):
    """With model.trust_remote_code the run trains and its export reloads (with the class already imported), yet
    the exported folder names no code: no auto_map, no copied module."""
    import subprocess
    import sys

    from tests.conftest import ROOT, launch_env

    folder, marker = _planted_folder(tiny_job, tmp_path)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "train", *job_args({**tiny_job, "model": str(folder)}, out, steps=2),
         "--trust_remote_code", "true"],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists()  # the user's own code ran, as asked
    exported = out / "model"
    assert not list(exported.glob("*.py"))
    assert all("auto_map" not in json.loads(p.read_text()) for p in exported.glob("*config.json"))


def test_a_checkpoint_config_never_grants_trust():
    from hftrain.config import config_from_flat

    config = config_from_flat({"model.trust_remote_code": True}, source="checkpoint.json")
    assert config.model.trust_remote_code is False


def test_convert_refuses_a_checkpoint_whose_config_names_code(tiny_job, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_job["model"])
    run = tmp_path / "run"
    step = _write_dcp_checkpoint(model, run, tiny_job["model"])
    marker = tmp_path / "PLANTED_CODE_RAN"
    _plant_code(step / "state" / "hf_model", marker)  # the .py shipped inside the checkpoint
    _reseal(step)
    out = tmp_path / "converted"
    _refused_with_yes(monkeypatch, capsys, ["convert", str(run), str(out)], "runs no code shipped with a checkpoint")
    assert not marker.exists() and not out.exists()


def test_export_runs_no_code_a_checkpoint_ships(tiny_job, tmp_path, monkeypatch, capsys):
    """``hftrain export`` of a (resealed) checkpoint whose ``state/hf_model`` ships a ``.py`` its ``auto_map``
    names: exported from the model folder the run named, with no prompt ("y" waiting on stdin), the shipped code
    never run, and no code named in what is written (the folder a checkpoint names with an ``auto_map``:
    ``test_export_refuses_a_model_folder_its_checkpoint_names_that_names_code``)."""
    from tests.tiny import reset_accelerate_state

    run = tmp_path / "run"
    reset_accelerate_state()  # trained in this process: whatever an earlier test set up in it is cleared
    code, stderr = cli_in_process(["train", *job_args(tiny_job, run, steps=2), "--save_steps", "2"])
    assert code == 0, stderr[-3000:]
    step = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "PLANTED_CODE_RAN"
    _plant_code(step / "state" / "hf_model", marker)
    _reseal(step)
    out = tmp_path / "exported"
    monkeypatch.setattr("sys.stdin", io.StringIO("y\ny\ny\n"))
    reset_accelerate_state()
    code, stderr = cli_in_process(["export", str(run), str(out)])
    said = capsys.readouterr()
    assert PROMPT not in stderr + said.out + said.err
    assert code == 0, stderr[-3000:]
    assert not marker.exists()
    assert (out / "config.json").is_file() and not list(out.rglob("*.py"))
    assert all("auto_map" not in json.loads(p.read_text()) for p in out.rglob("*config.json"))


def test_convert_writes_no_auto_map(tiny_job, tmp_path):
    """A config object that carries auto_map (a known model type: transformers keeps the key) is written without it."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_job["model"])
    run = tmp_path / "run"
    step = _write_dcp_checkpoint(model, run, tiny_job["model"])
    config_file = step / "state" / "hf_model" / "config.json"
    _reseal(step)
    from hftrain.checkpoint import convert as convert_module

    real = convert_module._read_config

    def read_with_code_keys(where: str, what: str):
        config = real(where, what)
        config.auto_map = {"AutoConfig": "planted.PlantedConfig"}
        config.trust_remote_code = True
        return config

    convert_module._read_config = read_with_code_keys
    try:
        code, stderr = cli_in_process(["convert", str(run), str(tmp_path / "converted")])
    finally:
        convert_module._read_config = real
    assert code == 0, stderr
    written = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert "auto_map" not in written and "trust_remote_code" not in written
    assert config_file.is_file()


def test_without_code_drops_the_keys_an_export_writes():
    from transformers import BertConfig

    from hftrain.models.remote_code import without_code

    config = BertConfig(auto_map={"AutoConfig": "x.Y"}, trust_remote_code=True)
    assert "auto_map" in config.to_dict()
    assert not {"auto_map", "trust_remote_code"} & set(without_code(config).to_dict())


# ----------------------------------------------------------------- data
def _classification_splits(tmp_path: Path, rows: list[str], *, num_labels: int = 3, problem_type: str | None = None):
    from hftrain.data.loading import load_classification_splits

    file = tmp_path / "data.jsonl"
    file.write_text("".join(rows))
    return load_classification_splits(
        dataset_name=None, train_file=str(file), validation_file=None, text_column="text", label_column="label",
        num_labels=num_labels, validation_split_percentage=25, max_train_samples=None, max_eval_samples=None,
        seed=0, log=lambda _: None, problem_type=problem_type,
    )  # fmt: skip


def _jsonl(labels: list) -> list[str]:
    return [json.dumps({"text": f"text number {i}", "label": label}) + "\n" for i, label in enumerate(labels)]


@pytest.mark.parametrize(
    ("odd", "fragment"),
    [([1, 0], "row 4 is not ([1, 0]: 2 values, not 3)"), ([2], "row 4 is not ([2]: 1 value, not 3)")],
    ids=["wrong-length", "class-id-row"],
)
def test_multi_label_rows_are_read_one_by_one(tmp_path, odd, fragment):
    from hftrain.errors import DataError

    hot = [[1, 0, 0], [0, 1, 1], [1, 0, 1]]
    with pytest.raises(DataError, match="row 1 is a multi-hot row") as caught:
        _classification_splits(tmp_path, _jsonl([*hot, odd] * 3))
    assert fragment in str(caught.value)
    splits = _classification_splits(tmp_path, _jsonl(hot * 4))  # all multi-hot: kept as written
    rows = {tuple(r) for split in splits.values() for r in split["label"]}
    assert rows == {(1, 0, 0), (0, 1, 1), (1, 0, 1)}


def test_class_id_lists_still_read_and_duplicates_refused(tmp_path):
    from hftrain.errors import DataError

    splits = _classification_splits(tmp_path, _jsonl([[0], [1, 2], [2], [0, 1]] * 3))
    assert {tuple(r) for split in splits.values() for r in split["label"]} == {
        (1, 0, 0), (0, 1, 1), (0, 0, 1), (1, 1, 0)
    }  # fmt: skip
    with pytest.raises(DataError, match=r"row 3 .* lists class 1 twice"):
        _classification_splits(tmp_path, _jsonl([[0], [1, 2], [0, 1, 1, 0]] * 3))


def test_regression_label_beyond_float32_is_refused(tmp_path):
    from hftrain.errors import DataError

    with pytest.raises(DataError, match=r"1e\+39 at row 3, which is inf in float32"):
        _classification_splits(tmp_path, _jsonl([0.5, 1.5, 1e39, 2.0] * 3), num_labels=1)


def test_a_pipe_as_data_file_is_named_and_never_waited_on(tiny_job, tmp_path):
    fifo = tmp_path / "data.csv"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    code, stderr = cli_in_process(["train", *job_args({**tiny_job, "data": str(fifo)}, out)])
    assert_refused(stderr, code, "is a pipe, not a regular file")
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a /dev/fd/N link to a pipe, as bash's <(...) gives
    try:
        link = f"/proc/self/fd/{read_end}"
        code, stderr = cli_in_process(["train", *job_args({**tiny_job, "data": link}, out)])
        assert_refused(stderr, code, "is a pipe, not a regular file")
    finally:
        os.close(read_end)
    assert not out.exists()


def test_a_pipe_as_config_file_is_named_and_never_waited_on(tiny_job, tmp_path):
    """``--config <(cat job.yaml)`` (a ``/dev/fd/N`` link to a pipe) and a FIFO: one line naming the pipe and the
    fix (it said "config file '/dev/fd/63' does not exist"); a missing file still says so."""
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    code, stderr = cli_in_process(["train", "--config", str(fifo), *job_args(tiny_job, out)])
    assert_refused(stderr, code, f"--config '{fifo}' is a pipe, not a regular file")
    assert "write the config to a file first" in stderr
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a /dev/fd/N link to a pipe, as bash's <(...) gives
    try:
        link = f"/proc/self/fd/{read_end}"
        code, stderr = cli_in_process(["train", "--config", link, *job_args(tiny_job, out)])
        assert_refused(stderr, code, f"--config '{link}' is a pipe, not a regular file")
    finally:
        os.close(read_end)
    code, stderr = cli_in_process(["train", "--config", str(tmp_path / "missing.yaml"), *job_args(tiny_job, out)])
    assert_refused(stderr, code, "missing.yaml' does not exist")
    assert not out.exists()


def test_causal_lm_with_every_response_cut_away_is_refused(tiny_job, tmp_path):
    rows = "".join(json.dumps({"prompt": " ".join(["w1"] * 40), "response": "w2 w3"}) + "\n" for _ in range(40))
    data = tmp_path / "pairs.jsonl"
    data.write_text(rows)
    out = tmp_path / "out"
    argv = ["train", *job_args({**tiny_job, "model": tiny_job["gpt2"], "data": str(data)}, out),
            "--task", "causal_lm", "--max_seq_length", "16", "--long_documents", "truncate"]  # fmt: skip
    code, stderr = cli_in_process(argv)
    assert_refused(stderr, code, "has no token to train on")
    assert not out.exists()


# ----------------------------------------------------------------- config and commands
def test_both_names_of_a_field_on_the_command_line_are_refused():
    from hftrain.config import load_config
    from hftrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--strategy.tp and --parallelism.tp are one field"):
        load_config(None, ["--strategy.tp", "2", "--parallelism.tp", "4"])
    with pytest.raises(ConfigError, match=r"--tp and --strategy.tp are one field"):
        load_config(None, ["--tp", "2", "--strategy.tp", "4"])
    assert load_config(None, ["--max_steps", "4", "--max_steps", "8"]).training.max_steps == 8  # an override


def test_plan_with_sizes_no_layout_admits_is_one_line():
    for argv in (["--cp", "3"], ["--tp", "3"], ["--pp", "3", "--cp", "3"]):
        code, stderr = cli_in_process(["plan", "--model", "embedded:minilm", *argv])
        assert_refused(stderr, code, "no layout of 8 GPUs")


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        (["--pad_to_multiple_of", "1000000000"], "data.pad_to_multiple_of is 1,000,000,000, more than"),
        (["--lora_r", "1000000000", "--use_lora", "true"], "lora.lora_r must be at most 65,536"),
        (["--num_labels", "1000000000"], "model.num_labels must be at most 1,048,576"),
        (["--max_seq_length", "1000000000"], "data.max_seq_length must be at most 2,097,152"),
        (["--dataloader_num_workers", "1000000000"], "training.dataloader_num_workers must be at most 1024"),
        (["--torch_num_threads", "1000000000"], "training.torch_num_threads must be at most 1024"),
    ],
    ids=["pad_to_multiple_of", "lora_r", "num_labels", "max_seq_length", "workers", "threads"],
)
def test_sizes_that_would_allocate_without_bound_are_refused(override, fragment):
    """Checked on the config alone: reverted, a run would allocate (or start workers) before any other check."""
    from hftrain.config import load_config
    from hftrain.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config(None, override)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_lora_rank_is_bounded_by_the_adapted_layers(tiny_job):
    from transformers import AutoModelForSequenceClassification

    from hftrain.config import LoraConfig
    from hftrain.errors import ConfigError
    from hftrain.models.lora import apply_lora

    model = AutoModelForSequenceClassification.from_pretrained(tiny_job["model"])
    smallest = min(min(m.weight.shape) for n, m in model.named_modules() if n.endswith((".query", ".value")))
    with pytest.raises(ConfigError, match=rf"set lora_r to at most {smallest}"):
        apply_lora(model, LoraConfig(use_lora=True, lora_r=smallest + 1))
    apply_lora(model, LoraConfig(use_lora=True, lora_r=smallest))


def test_saved_config_replaces_a_planted_link(tmp_path):
    from hftrain.config import TrainConfig, save_config

    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".hftrain_config.yaml.tmp").symlink_to(outside)  # the old fixed staging name
    (run / "hftrain_config.yaml").symlink_to(outside)
    save_config(TrainConfig(), run)
    assert outside.read_text() == "mine"
    assert not (run / "hftrain_config.yaml").is_symlink()


@pytest.mark.parametrize("line", ["[1, 2]", "3", '"text"'], ids=["list", "number", "string"])
def test_a_json_lines_row_that_is_not_an_object_is_named(tmp_path, line):
    from hftrain.errors import DataError

    rows = [*_jsonl([0, 1]), line + "\n", *_jsonl([1, 0])]
    with pytest.raises(DataError, match=r"line 3 of .* is .*, not a JSON object"):
        _classification_splits(tmp_path, rows, num_labels=2)


def test_an_exports_config_names_no_code(tmp_path):
    """The non-streamed export (a LoRA's merged model, a full model written by save_pretrained) rewrites the
    config.json save_pretrained wrote without auto_map and trust_remote_code, with the saved dtype."""
    from hftrain.checkpoint.export import _clean_config

    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model_type": "bert", "auto_map": {"AutoConfig": "x.Y"},
                                       "trust_remote_code": True, "dtype": "float32"}))  # fmt: skip
    _clean_config(config_file, "bfloat16")
    written = json.loads(config_file.read_text())
    assert written == {"model_type": "bert", "dtype": "bfloat16"}


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--deepspeed", "{fifo}"], "--deepspeed '{fifo}' is a FIFO, not a file"),
        (
            ["--strategy.name", "zero2", "--strategy.deepspeed_config", "{fifo}"],
            "strategy.deepspeed_config '{fifo}' is a FIFO",
        ),
    ],
)
def test_a_fifo_named_as_a_config_file_is_refused_not_waited_on(tiny_job, tmp_path, flags, fragment):
    """A DeepSpeed JSON that is a FIFO (``--deepspeed <(...)``, a planted pipe) is refused in one line; it used to
    block the command forever on open()."""
    import subprocess
    import sys

    from tests.conftest import ROOT, launch_env

    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    flags = [flag.format(fifo=fifo) for flag in flags]
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "train", *job_args(tiny_job, out, steps=1), *flags],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_refused(done.stderr, done.returncode, fragment.format(fifo=fifo))
    assert not out.exists()


def test_export_refuses_a_model_folder_its_checkpoint_names_that_names_code(tiny_job, tmp_path, monkeypatch, capsys):
    """``hftrain export`` builds the model from the folder the checkpoint's config names: with an ``auto_map`` there
    (planted after the run), "y" on stdin runs nothing; the export is refused in one line (a checkpoint never grants
    trust), nothing written."""
    from transformers import AutoModelForSequenceClassification

    folder, marker = _planted_folder(tiny_job, tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_job["model"])
    run = tmp_path / "run"
    _write_dcp_checkpoint(model, run, str(folder))
    out = tmp_path / "exported"
    _refused_with_yes(monkeypatch, capsys, ["export", str(run), str(out)], "model.trust_remote_code")
    assert not marker.exists() and not out.exists()
