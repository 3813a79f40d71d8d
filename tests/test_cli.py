"""The CLI: fast help, and every bad input is one line on stderr, exit code 2, nothing written."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hftrain.cli import main


def test_help_is_fast():
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "hftrain", "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0 and "train" in done.stdout
    assert elapsed < 1.0, f"hftrain --help took {elapsed:.2f} s"
    modules = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hftrain.cli; "
            "print(sorted(m for m in ('torch','accelerate','transformers') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
    )
    assert modules.stdout.strip() == "[]"


def test_console_script_exits_2_on_bad_key(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "train", "--learnin_rate", "1", "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "did you mean 'learning_rate'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """``hftrain groups … | head -1``: the reader closes the pipe after one line; the command stops with SIGPIPE's
    status and no ``BrokenPipeError`` traceback (it printed one before)."""
    command = [sys.executable, "-m", "hftrain", "groups", "--world-size", "8192", "--tp", "8", "--pp", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().startswith("world size 8192 = tp 8")
    process.stdout.close()  # as head does after its line
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 141 and stderr == "", stderr


def _csv(tmp_path, text: str, name: str = "train.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


GOOD = "text,label\n" + "".join(f"good movie {i},1\nbad movie {i},0\n" for i in range(20))

BAD_INPUTS = {
    "missing data file": (lambda p: ["--train_file", str(p / "nope.csv")], "nope.csv"),
    "missing text column": (lambda p: ["--train_file", _csv(p, GOOD), "--text_column", "review"], "review"),
    "missing label column": (lambda p: ["--train_file", _csv(p, GOOD), "--label_column", "y"], "data.label_column"),
    "non-integer labels": (lambda p: ["--train_file", _csv(p, "text,label\na,pos\nb,neg\n")], "label"),
    "labels out of range": (lambda p: ["--train_file", _csv(p, "text,label\na,0\nb,5\n")], "model.num_labels"),
    "empty after dropping": (lambda p: ["--train_file", _csv(p, "text,label\n,1\nb,\n")], "train.csv"),
    "wrong type": (lambda p: ["--per_device_train_batch_size", "big"], "per_device_train_batch_size"),
    "unknown strategy": (lambda p: ["--strategy.name", "zero9"], "strategy.name"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, case):
    make_args, fragment = BAD_INPUTS[case]
    out = tmp_path / "out"
    code = main(["train", "--output_dir", str(out), *make_args(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("hftrain: error:"), err
    assert fragment in err[0]
    assert not out.exists()


def test_output_dir_with_a_different_run_is_refused(tmp_path, capsys):
    from hftrain.config import load_config, save_config

    out = tmp_path / "out"
    out.mkdir()
    save_config(load_config(None, ["--learning_rate", "1e-3", "--output_dir", str(out)]), out)
    marker = out / "checkpoints" / "step_00000001" / "checkpoint.json"  # a run with results, not a failed start
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    before = (out / "hftrain_config.yaml").read_text()
    code = main(["train", "--output_dir", str(out), "--train_file", _csv(tmp_path, GOOD)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "already holds a different run" in err and "training.learning_rate" in err
    assert (out / "hftrain_config.yaml").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "hftrain_config.yaml"]
