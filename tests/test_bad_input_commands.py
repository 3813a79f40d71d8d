"""Bad input to the newer commands (plan, groups, doctor), to data files and to the Python API: one line, exit 2.

Every case of the table runs ``hftrain.cli.main`` in-process and must give exit code 2, exactly one
``hftrain: error:`` line naming the option, field or file, no traceback, and leave the scratch folder as it was
(no file changed, nothing new). Beside the table: the Python API's dict configs, write failures reported by their
real cause (a real tmpfs, full or read-only; skipped with the reason where it cannot be mounted), ``groups``
answering at once for any size, and a bad input said once under a launcher, not once per rank.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from hftrain.cli import main
from tests.conftest import assert_refused
from tests.tiny import reset_accelerate_state, synthetic_texts, tiny_config, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SIZES = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "50000"]
HUGE = "1" + "0" * 30


def checksums(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its content (the scratch folders here are small)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@dataclass
class Ctx:
    """What a case builds its command from: a full tiny model folder (train) and the scratch folder."""

    model: Path
    scratch: Path

    def file(self, name: str, text: str) -> str:
        path = self.scratch / name
        path.write_text(text)
        return str(path)

    def config_json(self, name: str, text: str | None = None, **changes) -> str:
        """A model folder holding only a config.json: the tiny BERT's with ``changes``, or ``text`` as written."""
        folder = self.scratch / name
        folder.mkdir()
        (folder / "config.json").write_text(_bert_json(**changes) if text is None else text)
        return str(folder)

    def train(self, *args: str) -> list[str]:
        """``hftrain train`` on the tiny model, into a new folder under the scratch folder."""
        return ["train", "--model_name_or_path", str(self.model), "--log_with", "none", "--max_steps", "1",
                "--output_dir", str(self.scratch / "new-run"), *args]  # fmt: skip

    def train_on(self, rows: list[dict], *args: str) -> list[str]:
        """``hftrain train`` on a JSONL file of ``rows`` (valid rows first, to fill the split)."""
        texts, labels = synthetic_texts(20)
        good = [{"text": t, "label": y} for t, y in zip(texts, labels, strict=True)]
        data = self.file("train.jsonl", "".join(json.dumps(row) + "\n" for row in good + rows))
        return self.train("--dataset_name", "null", "--train_file", data, *args)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny BERT classifier with its tokenizer, as a user's model folder."""
    from transformers import AutoModelForSequenceClassification

    path = tmp_path_factory.mktemp("model")
    AutoModelForSequenceClassification.from_config(tiny_config("bert")).save_pretrained(path)
    tiny_tokenizer("bert").save_pretrained(path)
    return path


def _plan_model(c: Ctx, **changes) -> list[str]:
    return ["plan", "--model", c.config_json("m", **changes)]


def _bert_json(**changes) -> str:
    """The tiny BERT's config.json text with ``changes``."""
    return json.dumps({**json.loads(tiny_config("bert").to_json_string()), **changes})


# id -> (command builder, a fragment the one error line must contain)
CASES: dict[str, tuple[Callable[[Ctx], list[str]], str]] = {
    # ------------------------------------------------------------------ plan: hardware and sizes
    "plan: GPU memory nan": (lambda c: ["plan", *SIZES, "--gpu-memory", "nan"], "--gpu-memory: 'nan' is not a finite"),
    "plan: GPU memory inf": (lambda c: ["plan", *SIZES, "--gpu-memory", "inf"], "--gpu-memory: 'inf' is not a finite"),
    "plan: GPU memory beyond bytes": (lambda c: ["plan", *SIZES, "--gpu-memory", "1e300"], "--gpu-memory 1e+300"),
    "plan: negative reserve": (lambda c: ["plan", *SIZES, "--reserve", "-5"], "--reserve -5: must be >= 0 GB"),
    "plan: TFLOP/s nan": (lambda c: ["plan", *SIZES, "--tflops", "nan"], "--tflops: 'nan' is not a finite number"),
    "plan: TFLOP/s inf": (lambda c: ["plan", *SIZES, "--tflops", "inf"], "--tflops: 'inf' is not a finite number"),
    "plan: TFLOP/s zero": (lambda c: ["plan", *SIZES, "--tflops", "0"], "--tflops 0: must be > 0"),
    "plan: efficiency above 1": (lambda c: ["plan", *SIZES, "--efficiency", "2"], "--efficiency 2: must be in (0, 1]"),
    "plan: negative CPU memory": (lambda c: ["plan", *SIZES, "--cpu-memory", "-1"], "--cpu-memory -1: must be >= 0"),
    "plan: zero key/value heads": (lambda c: ["plan", *SIZES, "--kv-heads", "0"], "--kv-heads 0: must be a positive"),
    "plan: more key/value heads than heads": (
        lambda c: ["plan", *SIZES, "--kv-heads", "64"],
        "--kv-heads 64: key/value heads must divide the 32 attention heads",
    ),
    "plan: key/value heads not dividing heads": (lambda c: ["plan", *SIZES, "--kv-heads", "5"], "valid: 1, 2, 4, 8"),
    "plan: zero MLP width": (lambda c: ["plan", *SIZES, "--intermediate", "0"], "--intermediate 0: must be"),
    "plan: parameters 1e400": (lambda c: ["plan", *SIZES, "--parameters", "1e400"], "--parameters: '1e400' is not"),
    "plan: parameters nan": (lambda c: ["plan", *SIZES, "--parameters", "nan"], "--parameters: 'nan' is not"),
    "plan: vocabulary beyond any model": (
        lambda c: ["plan", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", HUGE],
        f"--vocab {HUGE}: larger than any model",
    ),
    "plan: GPUs per node beyond any machine": (
        lambda c: ["plan", *SIZES, "--gpus-per-node", HUGE],
        f"--gpus-per-node {HUGE}: more than the planner takes",
    ),
    "plan: nodes beyond any cluster": (lambda c: ["plan", *SIZES, "--nodes", HUGE], f"--nodes {HUGE}: more than"),
    # ------------------------------------------------------------------ plan: --model with a broken config.json
    "plan: unknown model type": (lambda c: _plan_model(c, model_type="nope"), "model type `nope`"),
    "plan: layer count a string": (
        lambda c: _plan_model(c, num_hidden_layers="2"),
        "Field 'num_hidden_layers' expected int, got str",
    ),
    "plan: hidden size null": (lambda c: _plan_model(c, hidden_size=None), "Field 'hidden_size' expected int"),
    "plan: zero heads": (lambda c: _plan_model(c, num_attention_heads=0), "does not describe a buildable"),
    "plan: hidden not divisible by heads": (
        lambda c: _plan_model(c, num_attention_heads=3),
        "is not a multiple of the number of attention heads",
    ),
    "plan: zero vocabulary": (lambda c: _plan_model(c, vocab_size=0), "does not describe a buildable"),
    "plan: zero layers": (lambda c: _plan_model(c, num_hidden_layers=0), "num_hidden_layers 0"),
    "plan: empty config.json": (lambda c: ["plan", "--model", c.config_json("m", "")], "is not valid JSON"),
    "plan: config.json a list": (lambda c: ["plan", "--model", c.config_json("m", "[1, 2]")], "has no model_type"),
    "plan: no model_type": (
        lambda c: ["plan", "--model", c.config_json("m", '{"hidden_size": 32}')],
        "has no model_type",
    ),
    "plan: a named config file with a string layer count": (
        lambda c: ["plan", "--model", c.file("bert.json", _bert_json(num_hidden_layers="2"))],
        "bert.json: Validation error for field 'num_hidden_layers'",
    ),
    "plan: a named config file that is a list": (
        lambda c: ["plan", "--model", c.file("bert.json", "[]")],
        "bert.json has no model_type",
    ),
    "plan: write-configs under a file": (
        lambda c: ["plan", "--model", "embedded:minilm", "--write-configs", c.file("f", "x") + "/out"],
        "Not a directory",
    ),
    "plan: write-configs into a folder that cannot exist": (
        lambda c: ["plan", "--model", "embedded:minilm", "--write-configs", "/proc/hftrain-no-such/out"],
        "--write-configs '/proc/hftrain-no-such/out': No such file or directory",
    ),
    # ------------------------------------------------------------------ groups
    "groups: world size 10**9": (
        lambda c: ["groups", "--world-size", str(10**9)],
        "--world-size 1000000000: hftrain groups prints layouts of at most 65536 processes",
    ),
    "groups: world size 10**18 with tp 7": (
        lambda c: ["groups", "--world-size", str(10**18), "--tp", "7"],
        "at most 65536 processes",
    ),
    "groups: world size 0": (lambda c: ["groups", "--world-size", "0"], "--world-size 0: must be a positive integer"),
    "groups: negative tp": (lambda c: ["groups", "--world-size", "8", "--tp", "-2"], "--tp -2: must be a positive"),
    "groups: huge tp": (lambda c: ["groups", "--world-size", "8", "--tp", HUGE], "--tp: tp="),
    # ------------------------------------------------------------------ doctor
    "doctor: timeout nan": (lambda c: ["doctor", "--timeout", "nan"], "--timeout nan: must be a finite number"),
    "doctor: timeout inf": (lambda c: ["doctor", "--timeout", "inf"], "--timeout inf: must be a finite number"),
    "doctor: negative timeout": (lambda c: ["doctor", "--timeout", "-1"], "--timeout -1: must be"),
    "doctor: zero timeout": (lambda c: ["doctor", "--timeout", "0"], "--timeout 0: must be"),
    "doctor: wait nan": (lambda c: ["doctor", "--wait", "nan"], "--wait nan: must be a finite number"),
    "doctor: wait inf": (lambda c: ["doctor", "--wait", "inf"], "--wait inf: must be a finite number"),
    "doctor: negative wait": (lambda c: ["doctor", "--wait", "-5"], "--wait -5: must be"),
    "doctor: master port 0": (
        lambda c: ["doctor", "--master_addr", "127.0.0.1", "--master_port", "0"],
        "--master_port 0: not a TCP port the launchers take (1-65535)",
    ),
    "doctor: master port 70000": (lambda c: ["doctor", "--master_port", "70000"], "--master_port 70000"),
    "doctor: zero machines": (lambda c: ["doctor", "--nnodes", "0"], "--nnodes 0: must be a positive integer"),
    "doctor: negative processes per machine": (lambda c: ["doctor", "--nproc_per_node", "-1"], "--nproc_per_node -1"),
    "doctor: zero processes": (lambda c: ["doctor", "--num_processes", "0"], "--num_processes 0: must be a positive"),
    "doctor: negative node rank": (lambda c: ["doctor", "--node_rank", "-1"], "--node_rank -1: must be an integer"),
    "doctor: node rank beyond the machines": (
        lambda c: ["doctor", "--nnodes", "2", "--node_rank", "2"],
        "--node_rank 2: must be below --nnodes 2",
    ),
    # ------------------------------------------------------------------ data and config (train)
    "train: JSONL text that is a list": (
        lambda c: c.train_on([{"text": ["a", "b"], "label": 1}]),
        "data.text_column: column 'text' of {scratch}/train.jsonl holds a list at row 21 (['a', 'b'])",
    ),
    "train: JSONL text that is an object": (
        lambda c: c.train_on([{"text": {"a": 1}, "label": 1}]),
        "holds an object at row 21 ({'a': 1})",
    ),
    "train: boolean labels": (
        lambda c: c.train_on([{"text": "yes", "label": True}]),
        "data.label_column: labels in column 'label' of {scratch}/train.jsonl must be integer class ids "
        "0..num_labels-1, found True (a boolean) at row 21",
    ),
    "train: a label of 10**30": (
        lambda c: c.train_on([{"text": "big", "label": 10**30}]),
        "model.num_labels: label 1e+30 in column 'label'",
    ),
    "train: negative weight decay": (
        lambda c: c.train("--weight_decay", "-5"),
        "training.weight_decay must be >= 0",
    ),
}


_refused = assert_refused


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(tiny_model, tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)  # anything written to a relative default path would land here
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ctx = Ctx(model=tiny_model, scratch=tmp_path)
    build, fragment = CASES[case]
    argv = build(ctx)
    before = checksums(tmp_path)
    reset_accelerate_state()
    capsys.readouterr()
    started = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    _refused(err, code, fragment.replace("{scratch}", str(tmp_path)))
    assert checksums(tmp_path) == before
    assert not (tmp_path / "new-run").exists()
    if argv[0] != "train":
        assert out == ""  # refused before anything is printed
    if argv[0] == "groups":
        assert elapsed < 0.5, f"{case}: {elapsed:.2f} s"


def test_every_command_has_cases():
    assert len(CASES) >= 50
    assert {case.split(":")[0] for case in CASES} == {"plan", "groups", "doctor", "train"}


# ---------------------------------------------------------------------- what still works
def test_plan_counts_a_model_folder_and_takes_grouped_query_heads(tmp_path, capsys):
    tiny_config("llama").save_pretrained(tmp_path / "llama")
    assert main(["plan", "--model", str(tmp_path / "llama"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["layers"] == 2
    assert main(["plan", *SIZES, "--kv-heads", "8", "--parameters", "7.5B", "--reserve", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["kv_heads"] == 8 and data["model"]["parameters"] == 7_500_000_000


def test_groups_prints_the_layout_lazily():
    from hftrain.parallel.dims import ParallelDims, format_groups, group_lines, groups_json_chunks

    dims = ParallelDims(16, tp=2, pp=4)
    assert json.loads("".join(groups_json_chunks(dims))) == dims.rank_groups()
    lines = format_groups(dims).splitlines()
    assert lines[0].startswith("world size 16 = tp 2 × dp 2 × pp 4") and "  tp1: [2, 3]" in lines
    largest = group_lines(ParallelDims(65536, tp=8, pp=4))  # a generator: the first lines come at once
    started = time.perf_counter()
    first = [next(largest) for _ in range(3)]
    assert time.perf_counter() - started < 0.1
    assert first[1:] == ["tensor parallel groups (8192 groups of 8 ranks):", "  tp0: [0, 1, 2, 3, 4, 5, 6, 7]"]


def test_groups_of_the_largest_world_in_about_a_second(tmp_path):
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "groups", "--world-size", "65536", "--tp", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - started < 10  # interpreter start and 65536 ranks of JSON, on 2 shared cores
    groups = json.loads(done.stdout)
    assert len(groups["tp"]) == 8192 and groups["dp"][0][:2] == [0, 8] and len(groups["dp"]) == 8


# ---------------------------------------------------------------------- the Python API
def test_api_takes_a_dict_of_sections_like_a_yaml_file(tmp_path):
    import hftrain
    from hftrain.config import TrainConfig, load_config

    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("training:\n  max_steps: 7\n  learning_rate: 0.001\nlora:\n  use_lora: true\n")
    from_dict = hftrain.make_config({"training": {"max_steps": 7, "learning_rate": 1e-3}, "lora": {"use_lora": True}})
    assert isinstance(from_dict, TrainConfig) and from_dict == load_config(yaml_file)
    changed = hftrain.make_config({"training": {"max_steps": 7}}, seed=3)
    assert (changed.training.max_steps, changed.training.seed) == (7, 3)
    assert hftrain.make_config(changed, seed=4).training.seed == 4 and changed.training.seed == 3  # copied
    assert hftrain.make_config({}) == TrainConfig().validate()


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"max_steps": 5}, "config dict: 'max_steps' is a field of section 'training', not a section; nest it"),
        ({"trainig": {"seed": 1}}, "config dict: unknown section 'trainig'; did you mean 'training'?"),
        ({"training": 5}, "config dict: section 'training' must be a mapping of fields"),
        ({"training": {"max_steps": "many"}}, "training.max_steps"),
        ({"training": {"weight_decay": -5}}, "training.weight_decay must be >= 0"),
        (5, "config: expected a TrainConfig, a job YAML path or a dict of sections"),
        ([("training", {})], "got list"),
    ],
)
def test_api_refuses_a_bad_config_in_one_line_before_writing(tmp_path, monkeypatch, config, fragment):
    import hftrain
    from hftrain.errors import HFTrainError

    monkeypatch.chdir(tmp_path)
    for call in (hftrain.make_config, hftrain.train, hftrain.load_splits):
        with pytest.raises(HFTrainError) as refused:
            call(config)
        assert fragment in str(refused.value) and "\n" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- write failures by their cause


def _fill(disk: Path) -> None:
    """Fill ``disk`` to the last byte."""
    handle = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(handle, b"\0" * 4096)
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(handle)
    assert os.statvfs(disk).f_bavail == 0


def test_a_full_disk_reports_each_write_failure_by_its_errno(tmp_path, tmpfs):
    import torch

    from hftrain.errors import WriteError, writing

    disk = tmpfs("full", "size=64k")
    (disk / "a-file").write_text("x")
    _fill(disk)
    with pytest.raises(WriteError, match=r"^no space left on device while writing x; free space and rerun$"):
        with writing("x", location=disk):
            (disk / "more").write_bytes(b"\0" * 8192)
    with pytest.raises(WriteError, match=r"cannot write x: Not a directory \(.*a-file/sub\); a part of the path"):
        with writing("x", location=disk / "a-file" / "sub"):
            (disk / "a-file" / "sub").mkdir()
    with pytest.raises(WriteError, match=r"cannot write x: No such file or directory .*; a folder on the path is"):
        with writing("x", location=disk / "gone" / "f"):
            (disk / "gone" / "f").write_text("x")
    with pytest.raises(WriteError, match=r"cannot write x: Permission denied \(/f\); choose a location you may"):
        with writing("x", location=disk):  # root may write anywhere: the errno an unprivileged user gets
            raise OSError(errno.EACCES, "Permission denied", "/f")
    with pytest.raises(WriteError, match="cannot write x: Read-only file system"):
        with writing("x", location=disk, catch=(Exception,)):  # a library's error raised from the OSError
            try:
                raise OSError(errno.EROFS, "Read-only file system", str(disk))
            except OSError as error:
                raise RuntimeError("save failed") from error
    with pytest.raises(RuntimeError, match="^a bug$"):  # not a write failure, however full the disk
        with writing("x", location=disk, catch=(Exception,)):
            raise RuntimeError("a bug")
    # torch.save hides ENOSPC ("unexpected pos"): on a full disk that is a full disk, with the run's last checkpoint
    with pytest.raises(WriteError, match="no space left on device while writing y; the last complete checkpoint is c"):
        with writing("y", location=disk, last_checkpoint=lambda: "c", catch=(Exception,)):
            torch.save({"w": torch.zeros(100_000)}, disk / "w.pt")


def test_the_same_stream_failure_with_space_left_is_not_called_a_full_disk(tmp_path):
    from hftrain.errors import writing

    with pytest.raises(RuntimeError, match="unexpected pos"):
        with writing("x", location=tmp_path, catch=(Exception,)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")


def test_plan_write_configs_reports_read_only_and_full_disks_and_leaves_nothing(tmp_path, tmpfs, capsys):
    read_only = tmpfs("ro", "size=1m")
    (read_only / "empty").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(read_only)], check=True)
    for target in (read_only / "empty", read_only / "new" / "deeper"):
        code = main(["plan", "--model", "embedded:minilm", "--write-configs", str(target)])
        _refused(capsys.readouterr().err, code, f"--write-configs '{target}': Read-only file system")
    assert [p.name for p in read_only.rglob("*")] == ["empty"]
    full = tmpfs("full", "size=64k")
    _fill(full)
    target = full / "new" / "deeper"
    code = main(["plan", "--model", "embedded:minilm", "--write-configs", str(target)])
    _refused(
        capsys.readouterr().err,
        code,
        f"no space left on device while writing the planned configs into --write-configs '{target}'; free space",
    )
    assert [p.name for p in full.iterdir()] == ["filler"]  # no folder, no partial set of files


# ---------------------------------------------------------------------- one line per launch, not per rank
@pytest.mark.parametrize(
    ("env", "prints"),
    [
        ({}, True),
        ({"RANK": "0", "LOCAL_RANK": "0"}, True),
        ({"RANK": "1", "LOCAL_RANK": "1"}, False),
        ({"RANK": "3"}, False),
        ({"RANK": "2", "LOCAL_RANK": "0"}, True),  # the main process of the second machine
        ({"LOCAL_RANK": "x"}, True),  # not a rank: never lose the line
    ],
)
def test_only_the_main_process_of_a_machine_prints_and_every_rank_exits_2(monkeypatch, capsys, env, prints):
    from hftrain import cli

    monkeypatch.setattr(cli, "SILENT_RANK_GRACE_S", 0.0)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["groups", "--world-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err == ("hftrain: error: --world-size 0: must be a positive integer\n" if prints else "")
    # a rank's own write failure is that rank's to say, whichever rank it is
    assert main(["plan", "--model", "embedded:minilm", "--write-configs", "/proc/hftrain-no-such/out"]) == 2
    assert capsys.readouterr().err.startswith("hftrain: error: cannot write the planned configs")


def test_under_torchrun_a_bad_input_is_said_once(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    argv = ["-m", "hftrain", "train", "--weight_decay", "-5", "--output_dir", str(tmp_path / "out")]
    done = subprocess.run([*torchrun, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("hftrain: error:")]
    assert errors == ["hftrain: error: training.weight_decay must be >= 0 (0 disables weight decay)"], done.stderr
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists()
