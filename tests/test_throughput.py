"""Throughput a user can see: FLOPs counted from the model's shapes, tokens/s, MFU, the summary and the curves.

The FLOP count of a training step (``hftrain.trainers.throughput.FlopModel``) is checked against an independent
count, ``torch.utils.flop_counter.FlopCounterMode`` over one real forward and backward, for each family, with and
without recomputation (which the hardware count includes and the model count does not). A real run writes
``run_summary.json`` (tokens/s, samples/s, TFLOP/s per process, MFU against the measured peak) and
``training_curves.png``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny import run_tiny_training, tiny_config


def _counted(kind: str, mode: str | None, batch: int = 4, length: int = 96) -> tuple[float, float, float]:
    """(FlopCounterMode's count, the model FLOPs, the hardware FLOPs) of one training step, dropout on."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForSequenceClassification

    from hftrain.models.dropout import use_bits_dropout
    from hftrain.parallel.recompute import apply_activation_checkpointing
    from hftrain.trainers.throughput import FlopModel

    torch.manual_seed(0)
    config = tiny_config(kind, dropout=0.1, num_layers=3, max_positions=128)
    config.update({"hidden_size": 64, "intermediate_size": 256} if kind != "gpt2" else {"n_embd": 64})
    model = AutoModelForSequenceClassification.from_config(config).train()
    use_bits_dropout(model)
    if mode:
        apply_activation_checkpointing(model, mode)
    ids = torch.randint(3, config.vocab_size, (batch, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=torch.zeros(batch, dtype=torch.long)).loss.backward()
    model_flops, hardware_flops = FlopModel.of(model).step(batch, length, recompute=mode)
    return counter.get_total_flops(), model_flops, hardware_flops


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_flop_count_matches_flop_counter_mode(kind, mode):
    counted, model_flops, hardware_flops = _counted(kind, mode)
    assert abs(hardware_flops / counted - 1) < 0.05, (hardware_flops, counted)
    if mode is None:
        assert model_flops == hardware_flops
    else:  # recomputation costs hardware FLOPs, not model FLOPs
        assert model_flops < hardware_flops


@pytest.mark.distributed
def test_a_run_reports_tokens_per_second_mfu_and_draws_its_curves(tmp_path):
    output_dir = tmp_path / "run"
    result = run_tiny_training(kind="bert", steps=6, save_steps=3, eval_steps=3, output_dir=str(output_dir))
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["global_step"] == 6 and summary["train_steps_seconds"] > 0
    # 6 steps × 4 sequences of 3-20 words (+ [CLS]): real tokens, not padded positions
    assert 6 * 4 * 4 <= summary["train_tokens"] <= 6 * 4 * 21
    assert summary["train_samples"] == 24
    assert summary["train_tokens_per_second"] > 0 and 0 < summary["train_mfu"] < 1
    assert summary["peak_source"].startswith("measured") and summary["peak_tflops_per_process"] > 0
    assert summary["model_flops"] == summary["hardware_flops"]  # no recomputation
    png = output_dir / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert result["global_step"] == 6


def test_curves_are_drawn_in_a_child_process_and_a_failed_drawing_is_one_warning(tmp_path, monkeypatch):
    from hftrain.pictures import BackgroundPainter

    history = [{"step": s, "loss": 1.0 / s, "learning_rate": 1e-4} for s in range(1, 5)]
    warnings: list[str] = []
    painter = BackgroundPainter("curves", tmp_path / "run" / "training_curves.png", warn=warnings.append)
    painter.draw(history, version=len(history))  # output_dir/run does not exist: the drawing fails with an OSError
    painter.wait()
    assert len(warnings) == 1 and warnings[0].startswith("warning: training_curves.png not drawn")
    painter.close()

    png = tmp_path / "training_curves.png"
    painter = BackgroundPainter("curves", png, warn=warnings.append)
    painter.draw(history, version=len(history))
    child = painter._child.process
    assert child.pid != os.getpid() and os.getsid(child.pid) == child.pid  # a session of its own
    history.append({"step": 5, "loss": 0.2, "learning_rate": 1e-4})  # the training thread goes on logging
    painter.wait()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(warnings) == 1
    with pytest.raises(TypeError):  # a value JSON cannot carry: raised in the caller, nothing sent
        painter.draw([*history, {"step": 6, "loss": object(), "learning_rate": 1e-4}], version=6)
    painter.draw([*history, {"step": 6, "loss": [[1.0, 2.0]], "learning_rate": 1e-4}], version=7)
    painter.wait()  # the renderer's error: a warning with the child's error line, never a stopped run
    assert len(warnings) == 2 and re.fullmatch(r"warning: training_curves.png not drawn \(\w+Error: .*\)", warnings[1])
    painter.draw(history, version=7)  # nothing new since the last drawing: nothing drawn or said
    assert not painter.drawing
    painter.wait()
    png.unlink()
    painter.draw(history, version=8)  # the same process draws on after a failed drawing
    painter.wait()
    assert png.is_file() and painter._child.process is child and child.poll() is None
    child.kill()  # a child that dies: its drawing fails (one warning), the next one starts another process
    child.wait()
    painter.draw(history, version=9)
    painter.wait()
    assert len(warnings) == 3 and warnings[2] == (
        "warning: training_curves.png not drawn (the drawing process ended: exit code -9)"
    )
    painter.draw(history, version=10)
    painter.wait()
    assert painter._child.process is not child
    painter.close()
    assert painter._child is None
    monkeypatch.setattr("sys.executable", str(tmp_path / "no-python"))  # no process to draw in: one more warning
    painter.draw(history, version=11)
    assert len(warnings) == 4 and "not drawn" in warnings[3] and painter._child is None and not painter.drawing
    monkeypatch.undo()
    heat_map = BackgroundPainter("expert_load", tmp_path / "expert_load.png", warn=warnings.append)
    heat_map.draw([[3.0, 1.0], [2.0, 2.0]], version=1)  # tokens per (MoE layer, expert)
    heat_map.close()
    assert (tmp_path / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(warnings) == 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_drawing_process_is_out_of_the_jobs_process_group_and_ends_with_its_parent(tmp_path):
    """A signal to the job's process group (preemption: the training process checkpoints and exits 75) does not
    reach the drawing process, which draws on; the parent killed outright (SIGKILL: no ``close``) while a forked
    process (a data loader's worker) holds the pipes' other ends, so that no end of input comes, still ends it."""
    import signal
    import subprocess
    import time

    script = f"""
import os, signal, sys, time
from hftrain.pictures import BackgroundPainter
warnings = []
painter = BackgroundPainter("curves", {str(tmp_path / "curves.png")!r}, warn=warnings.append)
history = [{{"step": 1, "loss": 1.0, "learning_rate": 1e-4}}]
painter.draw(history, version=1)
painter.wait()
signal.signal(signal.SIGTERM, lambda *_: None)  # as the training process's preemption flag
if os.fork() == 0:  # holds the pipes' ends, as a data loader's worker
    time.sleep(300)
    os._exit(0)
print(painter._child.process.pid, flush=True)
sys.stdin.readline()  # the group got its signal
painter.draw(history + [{{"step": 2, "loss": 0.5, "learning_rate": 1e-4}}], version=2)
painter.wait()
print(warnings, flush=True)
time.sleep(300)
"""
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )

    def alive(pid: int) -> bool:  # a zombie has ended (whoever reaps it)
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    try:
        child = int(parent.stdout.readline())
        os.killpg(parent.pid, signal.SIGTERM)
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "[]" and alive(child)  # drawn after the group's signal
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while alive(child):
            assert time.monotonic() < deadline, "the drawing process outlived its parent"
            time.sleep(0.05)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the forked holder


def test_a_prestarted_drawing_process_imports_matplotlib_before_the_first_drawing(tmp_path):
    """``pictures.prestart`` (a job's first step): the child imports matplotlib while the job sets up, the first
    painter takes it, and ``close`` ends it; a spare no painter took is ended by ``discard_spare``."""
    import threading
    import time

    from hftrain import pictures

    pictures.prestart()
    spare = pictures._spare.process
    deadline = time.monotonic() + 60
    while "matplotlib" not in Path(f"/proc/{spare.pid}/maps").read_text():  # its compiled modules mapped: imported
        assert time.monotonic() < deadline, "the prestarted process did not import matplotlib"
        time.sleep(0.05)
    painter = pictures.BackgroundPainter("curves", tmp_path / "curves.png", warn=print)
    painter.draw([{"step": 1, "loss": 1.0, "learning_rate": 1e-4}], version=1)
    assert painter._child.process is spare and pictures._spare is None
    holder = os.fork()  # as a data loader's worker: it holds the pipes' ends, so closing ours is no end of input
    if holder == 0:
        time.sleep(60)
        os._exit(0)
    try:
        closing = threading.Thread(target=painter.close)  # returns: the child is told to exit, not left waiting
        closing.start()  # for an end of input
        closing.join(30)
        assert not closing.is_alive(), "close() waits for an end of input that the forked process holds back"
        assert spare.poll() == 0 and (tmp_path / "curves.png").is_file()
    finally:
        os.kill(holder, 9)
        os.waitpid(holder, 0)
    pictures.prestart()
    unused = pictures._spare.process
    pictures.discard_spare()
    assert unused.poll() == 0 and pictures._spare is None


def test_what_a_drawing_prints_does_not_reach_the_answers():
    """The drawing process answers on its own copy of stdout; a library printing to stdout meanwhile (a renderer
    here) writes to stderr, so the painter reads one answer line per request."""
    import subprocess
    import sys

    script = (
        "import hftrain.pictures as pictures\n"
        "pictures.RENDERERS['loud'] = lambda data, path: print('noise from a library', data)\n"
        "pictures._serve(0)\n"
    )
    request = json.dumps({"kind": "loud", "path": "unused.png", "data": [1, 2]})
    done = subprocess.run(
        [sys.executable, "-c", script], input=f"{request}\n{request}\n\n", capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0
    assert [json.loads(line) for line in done.stdout.splitlines()] == [{"status": "drawn"}] * 2
    assert done.stderr.count("noise from a library [1, 2]") == 2


def test_gpu_datasheet_peaks_tell_parts_and_precisions_apart():
    """H100 PCIe is not rated as SXM, A100 not as A10, and an fp32 run is rated against the fp32 peak (or TF32's
    when torch allows it), never against the bf16 one."""
    import torch

    from hftrain.trainers.throughput import datasheet_peak

    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16")[0] == 989.0
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16")[0] == 756.0
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "bf16")[0] == 312.0
    assert datasheet_peak("NVIDIA A10", "bf16")[0] == 125.0
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert datasheet_peak("NVIDIA H100 80GB HBM3", "no") == (66.9, "NVIDIA H100 80GB HBM3 datasheet, fp32")
        torch.backends.cuda.matmul.allow_tf32 = True
        assert datasheet_peak("NVIDIA H100 80GB HBM3", "no")[0] == 989.0 / 2
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert datasheet_peak("Some Future GPU", "bf16") is None
