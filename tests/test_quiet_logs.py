"""The main job's output says what a user needs and nothing else (issue 25's "quiet logs").

The real default job (embedded MiniLM on embedded Rotten Tomatoes, one process, as ``hftrain train`` runs it) is
cut to two steps with a checkpoint at each and resumed for a third: its whole output (stdout and stderr, library
warnings left at Python's defaults) has one line for the new classifier head, no table (transformers' load report
lists that head as MISSING in one), and no warning a user cannot act on: DeepSpeed's "Setting accelerator to CPU"
(DeepSpeed is not even imported by such a run), DCP's "assuming the intent is to save in a single process" (it is),
setuptools' or transformers' notices. A library warning that matters still reaches the user (last test).
"""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT, launch_env

TQDM = re.compile(r"\d+%\|")  # a progress-bar frame: "  3%|▎   | 1/32 [...]"


def output_lines(done: subprocess.CompletedProcess) -> list[str]:
    """Every line the command printed, progress-bar frames (drawn with carriage returns) left out."""
    text = (done.stdout + "\n" + done.stderr).replace("\r", "\n")
    return [line for line in text.splitlines() if line.strip() and not TQDM.search(line)]


def run_main_job(*args: str) -> list[str]:
    command = [sys.executable, "-m", "hftrain", "train", "--max_train_samples", "64", "--max_eval_samples", "64"]
    command += ["--per_device_train_batch_size", "8", "--save_steps", "1", *args]
    env = {key: value for key, value in launch_env().items() if key != "PYTHONWARNINGS"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output_lines(done)


def assert_quiet(lines: list[str]) -> None:
    text = "\n".join(lines)
    for line in lines:
        assert "warn" not in line.lower(), f"a warning in the main job's output:\n{line}\n\nall of it:\n{text}"
        assert "|" not in line and "LOAD REPORT" not in line, f"a table in the main job's output:\n{text}"
        assert "Setting accelerator" not in line and "Traceback" not in line, text


def test_the_main_job_and_its_resume_print_no_table_and_no_warning_nobody_can_act_on(tmp_path):
    output_dir = str(tmp_path / "run")
    first = run_main_job("--output_dir", output_dir, "--max_steps", "2")
    assert_quiet(first)
    heads = [line for line in first if line.startswith("classifier head initialised: ")]
    assert len(heads) == 1 and "classifier.weight" in heads[0], "\n".join(first)
    assert any(line.startswith("validation accuracy") for line in first), "\n".join(first)

    resumed = run_main_job("--output_dir", output_dir, "--max_steps", "3", "--resume_from_checkpoint", "latest")
    assert_quiet(resumed)
    assert any("resum" in line.lower() for line in resumed), "\n".join(resumed)


def test_a_library_warning_that_matters_still_reaches_the_user(tmp_path):
    """hftrain filters notices by their text, never a library's warnings wholesale: a deprecation that a user's own
    code triggers (here a ``UserWarning`` from transformers' logger while the job's quieting is in place) prints."""
    code = (
        "from hftrain.job import quiet_libraries\n"
        "quiet_libraries()\n"
        "from transformers.utils import logging\n"
        "logging.get_logger('transformers.modeling_utils').warning('this argument is deprecated: use that one')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert done.returncode == 0 and "this argument is deprecated: use that one" in done.stderr, done.stderr


def test_a_logging_configuration_that_takes_hftrains_handler_loses_no_line_and_doubles_none(capsys, monkeypatch):
    """Another library's or a notebook's logging setup (its own handler on "hftrain", propagation back on, as
    ``logging.config.dictConfig`` leaves a logger it resets) does not make hftrain's lines vanish or print twice."""
    import logging

    from hftrain.log import get_logger, log_main

    logger = get_logger()
    saved = (list(logger.handlers), logger.propagate)
    try:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.addHandler(logging.NullHandler())
        logger.propagate = True
        capsys.readouterr()
        log_main("model: one line")
        log_main("model: one line")
        assert capsys.readouterr().out.splitlines() == ["model: one line", "model: one line"]
        # the rank prefix follows the environment of the line, not of the first call
        monkeypatch.setenv("WORLD_SIZE", "2")
        get_logger().info("model: two")
        monkeypatch.setenv("WORLD_SIZE", "1")
        get_logger().info("model: one")
        assert capsys.readouterr().out.splitlines() == ["[rank 0] model: two", "model: one"]
    finally:
        logger.handlers[:] = saved[0]
        logger.propagate = saved[1]
