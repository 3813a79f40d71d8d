"""Checks and command lines shared by the megatron, pipeline, context-parallel and TP-LoRA tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def assert_parity(run: dict, ref: dict, *, rel: float = 1e-5) -> None:
    """A 10-step run equals its 1-process reference: losses, learning rates, samples and eval counts."""
    assert len(run["losses"]) == len(ref["losses"]) == 10
    assert run["losses"] == pytest.approx(ref["losses"], rel=rel)
    assert run["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
    assert run["samples_seen"] == ref["samples_seen"]  # counted per data-parallel replica, not per process
    assert run["metrics"]["eval_samples"] == 25  # each validation example once, not once per tp rank
    # the loss moved: a run without gradient sync or without steps could not match this
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)


def assert_same_weights(a: dict, b: dict, *, atol: float) -> None:
    """Two full state dicts hold the same names and values within ``atol``."""
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def assert_resumed_equals_uninterrupted(ranks: list[dict]) -> None:
    """Every rank's run stopped at step 8 and resumed to 12 equals the run of 12 steps in one go."""
    for rank in ranks:
        full, part, resumed = rank["full"], rank["part"], rank["resumed"]
        assert part["preempted"] == "stop_at_step" and part["global_step"] == 8
        assert resumed["global_step"] == full["global_step"] == 12
        assert resumed["losses"] == full["losses"]
        assert resumed["lrs"] == full["lrs"]
        assert resumed["metrics"] == pytest.approx(full["metrics"])
    main = ranks[0]  # the full weights, merged from the shards, are returned on the main process
    assert_same_weights(main["resumed"]["weights"], main["full"]["weights"], atol=1e-6)


def assert_equals_reference(run: dict, ref: dict, *, steps: int = 12) -> None:
    """A run of ``steps`` steps (a resumed one's log holds the stopped run's losses too) equal to the 1-process
    reference: every loss, learning rate, the samples seen and the evaluation (each of the 25 examples once)."""
    assert run["global_step"] == ref["global_step"] == steps
    assert len(run["losses"]) == steps
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert run["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
    assert run["samples_seen"] == ref["samples_seen"]
    assert run["metrics"]["eval_samples"] == 25
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the loss moved


def assert_stopped_resumed_and_exported(runs: dict, label: str, *, stop: int = 8) -> None:
    """Each rank's run stopped at ``stop`` equals the reference's first losses, its resumed run equals the reference,
    and the main rank's gathered and exported weights equal the reference's (``runs``: ``"four"``, one entry per rank
    with ``"part"`` and ``"resumed"``, and ``"reference"``); prints the largest relative loss difference."""
    ref = runs["reference"]
    for rank in runs["four"]:
        assert rank["part"]["preempted"] == "stop_at_step" and rank["part"]["global_step"] == stop
        assert rank["part"]["losses"] == pytest.approx(ref["losses"][:stop], rel=1e-5)
        assert_equals_reference(rank["resumed"], ref)
    main = runs["four"][0]["resumed"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(main["losses"], ref["losses"], strict=True))
    print(f"\n{label}, stopped at {stop} and resumed: largest relative loss difference {worst:.1e}")
    assert_same_weights(main["weights"], ref["weights"], atol=1e-5)  # gathered over the split axes
    assert_same_weights(main["inspected"]["weights"], ref["weights"], atol=1e-5)  # the exported folder


def assert_resumed_without_zero1(runs: dict) -> None:
    """The ZeRO-1 checkpoint resumed without ``shard_optimizer`` (each rank's ``"plain"`` run) equals the reference."""
    ref = runs["reference"]
    for rank in runs["four"]:
        assert_equals_reference(rank["plain"], ref)
        assert not rank["plain"]["inspected"]["zero1"]
    assert_same_weights(runs["four"][0]["plain"]["weights"], ref["weights"], atol=1e-5)


def launch_on_two_four_one(root: str, two, four, one, *, timeout: float = 900) -> dict:
    """Run ``two``, ``four`` and ``one`` (module-level functions of ``root``) on 2, 4 and 1 gloo processes, in this
    order (the 1-process run last: it may start a process group the others must not see); every rank's results.

    Args:
        root: a folder all three share (checkpoints written by one and read by another).
        two: the 2-process body.
        four: the 4-process body.
        one: the 1-process body (its single result is returned, not a list).
        timeout: seconds allowed for each launch.
    """
    from tests.distributed import run_distributed

    ranks_of_two = run_distributed(two, nprocs=2, timeout=timeout, root=root)
    ranks_of_four = run_distributed(four, nprocs=4, timeout=timeout, root=root)
    (only,) = run_distributed(one, nprocs=1, timeout=timeout, root=root)
    return {"two": ranks_of_two, "four": ranks_of_four, "one": only}


def megatron_job_args(model: str, data: str, output_dir: Path, *extra: str) -> list[str]:
    """A 4-step fp32 megatron job on a tiny model folder and CSV (micro 4 × accumulation 2, a checkpoint every 2)."""
    return [
        "--model_name_or_path", model, "--train_file", data, "--output_dir", str(output_dir), "--max_steps", "4",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--save_steps", "2",
        "--logging_steps", "1", "--log_with", "none", "--max_seq_length", "32", "--learning_rate", "1e-3",
        "--strategy.name", "megatron", "--mixed_precision", "no", *extra,  # fp32: compared at 1e-5
    ]  # fmt: skip


def refused_as_launched_rank0(
    monkeypatch, capsys, tmp_path: Path, model: str, data: str, extra: list[str], world_size: str, message: str
) -> None:
    """``hftrain train`` as rank 0 of a launched job whose process group never starts: refused first, in one line.

    Args:
        monkeypatch: sets the launcher environment.
        capsys: reads the error line.
        tmp_path: holds the output_dir that must not be created.
        model: the model folder.
        data: the training CSV.
        extra: the arguments that make the input bad.
        world_size: the launched world size.
        message: what the one error line must contain.
    """
    from hftrain.cli import main
    from tests.distributed import free_port

    launcher = {"WORLD_SIZE": world_size, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": world_size}
    for key, value in {**launcher, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    output_dir = tmp_path / "out"
    code = main(["train", *megatron_job_args(model, data, output_dir, *extra)])
    assert_refused_before_writing(code, capsys, message, output_dir)


def assert_refused_before_writing(code: int, capsys, message: str, output_dir: Path) -> None:
    """Exit 2, one ``hftrain: error:`` line containing ``message``, and no ``output_dir`` created."""
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("hftrain: error: ") and message in err[0], err
    assert not output_dir.exists()  # refused before anything was written (and before any process group)
