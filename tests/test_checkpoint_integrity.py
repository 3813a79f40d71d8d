"""Verify what you load, and load what you verified (issue 52): every file of a checkpoint is listed and checked, each
is read once and parsed from the bytes whose checksum was checked, counters are bounded by the checkpoint's step,
markers that are links or FIFOs are named, and a resealed config that no longer fits the tensors is refused.

One real checkpoint is written by a 2-step DDP run (module fixture); each case copies it, forges it as an attacker or
a careless user would (checksums recomputed where a forger would), and runs ``hftrain convert`` in this process or a
resume in a subprocess: one ``hftrain: error:`` line, exit 2, nothing written, and no planted code run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hftrain.checkpoint.manager import CheckpointError, open_checkpoint
from tests.conftest import assert_refused, cli_in_process
from tests.forged_checkpoints import STEP2, planted_bytes, reseal
from tests.tiny import save_model_folder, write_csv

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def _train_args(root: Path, out: Path, steps: int = 2) -> list[str]:
    return [
        "train", "--model_name_or_path", str(root / "model"), "--dataset_name", "null",
        "--train_file", str(root / "train.csv"), "--output_dir", str(out), "--log_with", "none",
        "--per_device_train_batch_size", "4", "--max_steps", str(steps), "--save_steps", "2",
        "--mixed_precision", "no",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    save_model_folder(root / "model")
    write_csv(root / "train.csv", rows=40)
    done = subprocess.run([sys.executable, "-m", "hftrain", *_train_args(root, root / "run")], cwd=root,
                          env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True)
    return copy


def _convert(source: Path, out: Path, fragment: str) -> None:
    """``hftrain convert`` in this process: refused in one line, nothing written."""
    code, stderr = cli_in_process(["convert", str(source), str(out)])
    assert_refused(stderr, code, fragment)
    assert not out.exists() and not out.with_name(f".staging-{out.name}").exists()


def _resume(run: Path, fragment: str) -> None:
    """A resume of the run's latest checkpoint: refused in one line, no later checkpoint written."""
    args = _train_args(Path(os.environ["HFTRAIN_INTEGRITY_ROOT"]), run, steps=4)
    done = subprocess.run([sys.executable, "-m", "hftrain", *args, "--resume_from_checkpoint", "auto"],
                          cwd=Path.cwd(), env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert_refused(done.stderr, done.returncode, fragment)
    assert not (run / "checkpoints" / "step_00000004").exists()


@pytest.fixture(autouse=True)
def _root(run, monkeypatch, tmp_path):
    monkeypatch.setenv("HFTRAIN_INTEGRITY_ROOT", str(run.parent))  # the model and data of the run
    monkeypatch.chdir(tmp_path)  # a planted pickle that ran would leave PWNED here


def _edit_marker(run: Path, edit) -> None:
    marker = run / STEP2 / "checkpoint.json"
    meta = json.loads(marker.read_text())
    edit(meta)
    marker.write_text(json.dumps(meta))


# ----------------------------------------------------------------- check, then load
def _swapper(target: Path, genuine: bytes, forged: bytes, stop: threading.Event) -> threading.Thread:
    """A writer that renames the forged and the genuine file over ``target`` in turn, every ~0.3 ms."""
    staging = target.with_name(target.name + ".swap")

    def swap() -> None:
        turn = 0
        while not stop.is_set():
            staging.write_bytes(forged if turn % 2 else genuine)
            os.replace(staging, target)
            turn += 1
            time.sleep(0.0003)

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    return thread


def _converts_under_a_swapping_writer(
    target: Path, forged: bytes, tries: int, convert: Callable[[int], tuple[int, str]]
) -> list[int]:
    """Run ``convert(attempt)`` ``tries`` times while a writer swaps ``forged`` and the genuine bytes over
    ``target``; each try converts or is refused in one line, and the planted code never runs. Returns the codes."""
    stop = threading.Event()
    thread = _swapper(target, target.read_bytes(), forged, stop)
    codes = []
    try:
        for attempt in range(tries):
            code, stderr = convert(attempt)
            codes.append(code)
            assert code in (0, 2) and "Traceback" not in stderr, stderr[-2000:]
    finally:
        stop.set()
        thread.join()
    assert not Path("PWNED").exists(), codes
    return codes


@pytest.mark.parametrize("file", ["state/dcp/.metadata", "state/custom_checkpoint_0.pkl"])
def test_a_file_swapped_while_it_is_checked_and_loaded_never_runs_code(run, tmp_path, file):
    """The race of issue 52: the checksum sees the genuine file, the loader would read the planted one. Every read
    now parses the bytes whose checksum it checked, so each try loads the genuine file or is refused; none runs."""
    from hftrain.checkpoint.safety import verified_copy
    from hftrain.checkpoint.sharded import dcp_metadata

    copy = _copy(run, tmp_path)
    checkpoint = copy / STEP2
    target = checkpoint / file
    genuine, forged = target.read_bytes(), planted_bytes("bare")
    outcomes = {"loaded": 0, "refused": 0}
    stop = threading.Event()
    thread = _swapper(target, genuine, forged, stop)
    try:
        deadline = time.monotonic() + 8
        tries = 0
        while time.monotonic() < deadline and tries < 300:
            tries += 1
            try:
                verified = open_checkpoint(checkpoint)
                with verified.active():
                    if file.endswith(".metadata"):
                        dcp_metadata(checkpoint / "state" / "dcp")
                    else:
                        with verified_copy(checkpoint / "state") as private:
                            import torch

                            torch.load(Path(private) / "custom_checkpoint_0.pkl", weights_only=False)  # Accelerate's
                outcomes["loaded"] += 1
            except CheckpointError:
                outcomes["refused"] += 1
    finally:
        stop.set()
        thread.join()
    assert not Path("PWNED").exists(), outcomes
    assert outcomes["loaded"] and outcomes["refused"], outcomes  # the race was run both ways


def test_convert_under_a_racing_writer_never_runs_code(run, tmp_path):
    copy = _copy(run, tmp_path)
    target = copy / STEP2 / "state" / "dcp" / ".metadata"
    _converts_under_a_swapping_writer(
        target,
        planted_bytes("bare"),
        12,
        lambda attempt: cli_in_process(
            ["convert", str(copy / STEP2), str(tmp_path / f"out{attempt}"), "--output_dir", str(copy)]
        ),
    )


# ----------------------------------------------------------------- every file listed and checked
def test_a_file_whose_entry_is_removed_is_refused(run, tmp_path):
    copy = _copy(run, tmp_path)
    _edit_marker(copy, lambda meta: meta["files"].pop("state/custom_checkpoint_0.pkl"))
    _convert(copy, tmp_path / "out", "state/custom_checkpoint_0.pkl is not listed in checkpoint.json")


def test_an_unlisted_rng_file_is_refused_on_resume(run, tmp_path):
    """Resumed on one process a planted random_states_1.pkl would be ignored, on two it would be loaded unchecked:
    refused either way, before anything loads."""
    copy = _copy(run, tmp_path)
    state = copy / STEP2 / "state"
    shutil.copy(state / "random_states_0.pkl", state / "random_states_1.pkl")
    _resume(copy, "state/random_states_1.pkl is not listed in checkpoint.json")


def test_a_dcp_metadata_missing_is_one_line_on_convert_and_resume(run, tmp_path):
    copy = _copy(run, tmp_path)
    (copy / STEP2 / "state" / "dcp" / ".metadata").unlink()
    reseal(copy, STEP2)  # a forger, or a careless copy that left it out and recomputed the list
    _convert(copy / STEP2, tmp_path / "out", ".metadata")
    _resume(copy, ".metadata")


# ----------------------------------------------------------------- counters bounded by the run
def _forge_pickle(path: Path, edit) -> None:
    import torch

    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def test_a_scheduler_beyond_the_checkpoints_step_is_refused(run, tmp_path):
    copy = _copy(run, tmp_path)
    _forge_pickle(copy / STEP2 / "state" / "custom_checkpoint_0.pkl",
                  lambda s: s.update(last_epoch=10**9, _step_count=10**9 + 1))  # fmt: skip
    reseal(copy, STEP2)
    _resume(copy, "last_epoch 1000000000 is not a step in [0, 2]")


def test_scheduler_rates_above_the_optimizers_initial_rate_are_refused(run, tmp_path):
    """A forged base_lrs of 1 (under the bound of 10, above the run's 5e-5) would set the rate at the next step."""
    copy = _copy(run, tmp_path)
    _forge_pickle(copy / STEP2 / "state" / "custom_checkpoint_0.pkl",
                  lambda s: s.update(base_lrs=[1.0] * len(s["base_lrs"])))  # fmt: skip
    reseal(copy, STEP2)
    _resume(copy, "the scheduler's base_lrs [1.0, 1.0] lie above optimizer.json's initial_lr 5e-05")


def test_scheduler_counters_and_rates_are_checked():
    from hftrain.checkpoint.safety import check_counters

    meta = {"step": 2}
    good = {"last_epoch": 2, "_step_count": 3, "base_lrs": [5e-5], "_last_lr": [0.0]}
    check_counters(Path("c"), "s", good, meta)
    for forged, fragment in (
        ({"last_epoch": -1}, "last_epoch -1"),
        ({"last_epoch": 3, "_step_count": 4}, "last_epoch 3"),
        ({"_step_count": 7}, "_step_count 7"),
        ({"base_lrs": [1e30]}, "base_lrs"),
        ({"_last_lr": [float("nan")]}, "_last_lr"),
    ):
        with pytest.raises(CheckpointError, match=fragment):
            check_counters(Path("c"), "s", {**good, **forged}, meta)
    check_counters(Path("c"), "s", good, meta, initial_rates=[5e-5, 5e-5])
    with pytest.raises(CheckpointError, match=r"_last_lr \[0.001\] lie above optimizer.json's initial_lr 5e-05"):
        check_counters(Path("c"), "s", {**good, "_last_lr": [1e-3]}, meta, initial_rates=[5e-5])


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("lr", 1e30, "optimizer.json is damaged (param_groups[0].lr 1e+30 is above 10"),
        ("eps", 0.0, "optimizer.json is damaged (param_groups[0].eps 0.0 is below 1.175e-38"),
        # fused fp32 Adam flushes it to 0: NaN some steps later, blamed on training.learning_rate before
        ("eps", 1e-300, "optimizer.json is damaged (param_groups[0].eps 1e-300 is below 1.175e-38"),
        # below the bound of 10 but above the run's 5e-5: it would have trained silently at 20000 x the rate
        ("lr", 1.0, "optimizer.json's param_groups[0].lr 1.0 is above this run's training.learning_rate 5e-05"),
        ("initial_lr", 1.0, "param_groups[0].initial_lr 1.0 is above this run's training.learning_rate 5e-05"),
    ],
)
def test_a_forged_optimizer_hyperparameter_is_refused_naming_the_file(run, tmp_path, key, value, fragment):
    copy = _copy(run, tmp_path)
    groups = copy / STEP2 / "state" / "optimizer.json"
    data = json.loads(groups.read_text())
    assert key in data["param_groups"][0]
    data["param_groups"][0][key] = value
    groups.write_text(json.dumps(data))
    reseal(copy, STEP2)
    _resume(copy, fragment)


def test_optimizer_steps_beyond_the_checkpoints_are_refused(run, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from hftrain.checkpoint.sharded import Chunked, read

    copy = _copy(run, tmp_path)
    checkpoint, key = copy / STEP2, "optim.classifier.bias.step"
    with open_checkpoint(checkpoint).active():
        read({key: Chunked.whole(torch.tensor(0.0))}, checkpoint / "state" / "dcp")  # the genuine step (2) loads
    shutil.rmtree(checkpoint / "state" / "dcp")
    dcp.save({key: torch.tensor(1e9)}, checkpoint_id=str(checkpoint / "state" / "dcp"), no_dist=True)
    reseal(copy, STEP2)
    with open_checkpoint(checkpoint).active(), pytest.raises(CheckpointError, match="more optimizer steps than"):
        read({key: Chunked.whole(torch.tensor(0.0))}, checkpoint / "state" / "dcp")


# ----------------------------------------------------------------- markers
def test_a_marker_that_is_a_fifo_or_a_link_is_named_and_never_waited_on(run, tmp_path):
    copy = _copy(run, tmp_path)
    newer = copy / "checkpoints" / "step_00000003"
    newer.mkdir()
    os.mkfifo(newer / "checkpoint.json")
    _convert(copy, tmp_path / "out", "step_00000003': checkpoint.json is a FIFO")
    (newer / "checkpoint.json").unlink()
    os.symlink("../step_00000002/checkpoint.json", newer / "checkpoint.json")
    _convert(copy, tmp_path / "out", "checkpoint.json is a symbolic link")


def test_a_newer_step_without_a_marker_is_logged(run, tmp_path, capsys):
    from hftrain.checkpoint.manager import CheckpointManager

    copy = _copy(run, tmp_path)
    (copy / "checkpoints" / "step_00000003").mkdir()
    assert CheckpointManager(copy / "checkpoints").resolve("auto").name == "step_00000002"
    said = capsys.readouterr()
    assert "step_00000003 has no checkpoint.json (a checkpoint write that did not finish)" in said.out + said.err


# ----------------------------------------------------------------- a resealed config
def test_a_resealed_model_type_is_refused_by_convert(run, tmp_path):
    copy = _copy(run, tmp_path)
    config = copy / STEP2 / "state" / "hf_model" / "config.json"
    data = json.loads(config.read_text())
    data["model_type"] = "roberta"  # BertForSequenceClassification's names would load as RoBERTa's: random weights
    config.write_text(json.dumps(data))
    reseal(copy, STEP2)
    _convert(copy, tmp_path / "out", "does not hold the model its config describes")


# ----------------------------------------------------------------- a DeepSpeed folder in convert
def _zero2_save(directory: str) -> None:
    """A tiny BERT trained 2 steps under ZeRO-2 on one gloo process, written by ``engine.save_checkpoint``."""
    import deepspeed
    import torch

    from tests.tiny import tiny_config, tiny_model_init

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = tiny_model_init("bert")()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)  # fmt: skip
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=torch.tensor([0, 1])).loss)
        engine.step()
    engine.save_checkpoint(f"{directory}/zero2")
    tiny_config("bert").save_pretrained(f"{directory}/config")


@pytest.fixture(scope="module")
def zero_folder(tmp_path_factory) -> Path:
    from tests.distributed import run_distributed

    directory = tmp_path_factory.mktemp("zero")
    run_distributed(_zero2_save, nprocs=1, directory=str(directory))
    return directory


def _convert_zero(folder: Path, out: Path, config: Path) -> tuple[int, str]:
    return cli_in_process(["convert", str(folder), str(out), "--config", str(config), "--trust_external_checkpoint"])


def test_a_deepspeed_file_swapped_while_convert_checks_and_loads_it_never_runs_code(zero_folder, tmp_path):
    """DeepSpeed's zero_to_fp32 unpickles its *_states.pt without a restriction: it is handed a private copy of the
    files the restricted unpickler checked, never the folder a writer is swapping files in."""
    folder = tmp_path / "zero2"
    shutil.copytree(zero_folder / "zero2", folder)
    target = folder / "global_step2" / "mp_rank_00_model_states.pt"
    codes = _converts_under_a_swapping_writer(
        target,
        planted_bytes("torch"),
        16,
        lambda attempt: _convert_zero(folder, tmp_path / f"out{attempt}", zero_folder / "config"),
    )
    assert 0 in codes and 2 in codes, codes  # the race was run both ways
    assert not list(tmp_path.glob(".hftrain-verified-*"))  # the private copies are gone


def test_deepspeed_folder_links_fifos_and_tags_are_one_line(zero_folder, tmp_path):
    config = zero_folder / "config"
    folder = tmp_path / "zero2"
    shutil.copytree(zero_folder / "zero2", folder)
    code, stderr = _convert_zero(folder, tmp_path / "ok", config)
    assert code == 0, stderr
    latest = folder / "latest"
    for plant, fragment in (
        (lambda: os.mkfifo(latest), "'latest' is a FIFO"),
        (lambda: os.symlink("global_step2", latest), "'latest' is a symbolic link"),
        (lambda: latest.write_text("x" * 5000), "'latest' is 5000 bytes"),
        (lambda: latest.write_text("../zero2/global_step2"), "is not a folder name of it"),
    ):
        latest.unlink()
        plant()
        code, stderr = _convert_zero(folder, tmp_path / "out", config)
        assert_refused(stderr, code, fragment)
        assert not (tmp_path / "out").exists()
    latest.unlink()
    latest.write_text("global_step2")
    state = folder / "global_step2" / "mp_rank_00_model_states.pt"
    state.rename(folder / "elsewhere.pt")
    os.symlink("../elsewhere.pt", state)
    code, stderr = _convert_zero(folder, tmp_path / "out", config)
    assert_refused(stderr, code, "is a symbolic link")
    state.unlink()
    os.mkfifo(state)
    code, stderr = _convert_zero(folder, tmp_path / "out", config)
    assert_refused(stderr, code, "a FIFO")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".hftrain-verified-*"))


# ----------------------------------------------------------------- every rank compares what it opens
def test_every_rank_compares_the_file_it_opens_with_the_main_process_record(run, tmp_path):
    """Another rank adopts the main process's record: a .distcp renamed over after the check is refused there too,
    through another machine's mount by size and modification time, and without a record by its checksum."""
    from hftrain.checkpoint.manager import machine_id

    copy = _copy(run, tmp_path)
    checkpoint = copy / STEP2
    name = next(str(p.relative_to(checkpoint)) for p in (checkpoint / "state" / "dcp").glob("*.distcp"))
    main = open_checkpoint(checkpoint)
    assert main.machine == machine_id() and name in main.identities
    other = open_checkpoint(checkpoint, verify_files=False)
    other.adopt(main.identities, main.machine)
    other.open(checkpoint / name).close()  # the very file: taken
    genuine = (checkpoint / name).read_bytes()
    forged = bytearray(genuine)
    forged[-1] ^= 1  # same size, another byte: what a forger renames over the file after the check
    os.replace(_written(checkpoint / "swap", bytes(forged)), checkpoint / name)
    for rank in (main, other):
        with pytest.raises(CheckpointError, match="was replaced after its checksum was verified"):
            rank.open(checkpoint / name)
    remote = open_checkpoint(checkpoint, verify_files=False)
    remote.adopt(main.identities, "another machine")  # its own device and inode numbers: size and mtime compared
    with pytest.raises(CheckpointError, match="was replaced"):
        remote.open(checkpoint / name)
    bare = open_checkpoint(checkpoint, verify_files=False)  # no record: the checksum, on the descriptor read
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        bare.open(checkpoint / name)
    os.replace(_written(checkpoint / "swap", genuine), checkpoint / name)
    bare.open(checkpoint / name).close()


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------- read from the bytes that were checked
def test_convert_builds_the_config_from_the_checked_bytes(run, tmp_path, monkeypatch):
    """config.json is parsed from the bytes whose checksum was checked, never opened by transformers by path; a
    checkpoint's auto_map is not followed (no prompt, no code) and a model type transformers lacks is one line."""
    import transformers

    copy = _copy(run, tmp_path)
    original = transformers.PretrainedConfig.get_config_dict.__func__

    def never_the_checkpoints(cls, where, *args, **kwargs):
        assert str(copy) not in str(where), "config.json read again by path"
        return original(cls, where, *args, **kwargs)  # the tokenizer's model folder, named by the run's config

    monkeypatch.setattr(transformers.PretrainedConfig, "get_config_dict", classmethod(never_the_checkpoints))
    config = copy / STEP2 / "state" / "hf_model" / "config.json"
    data = json.loads(config.read_text())
    data["auto_map"] = {"AutoConfig": "planted.PlantedConfig"}
    config.write_text(json.dumps(data))
    (config.parent / "planted.py").write_text("open('PWNED', 'w').close()\n")
    reseal(copy, STEP2)
    code, stderr = cli_in_process(["convert", str(copy / STEP2), str(tmp_path / "out"), "--output_dir", str(copy)])
    assert code == 0, stderr
    assert not Path("PWNED").exists()
    data["model_type"] = "planted"
    config.write_text(json.dumps(data))
    reseal(copy, STEP2)
    _convert(copy, tmp_path / "out2", "model_type 'planted' is not one this transformers knows")
    config.write_text("[1, 2]")
    reseal(copy, STEP2)
    _convert(copy, tmp_path / "out2", "config.json holds a list, not a config")


def test_rng_streams_are_parsed_from_the_bytes_read(tmp_path):
    """Megatron's RNG streams: parsed from the bytes ``read`` returns (the resume's checked read), a truncated file is
    an error, not a silent rebuild, and a FIFO in its place is refused by the reader, never waited on."""
    from types import SimpleNamespace

    from hftrain.checkpoint.sharded import read_verified
    from hftrain.parallel.random import FILE, RNGTracker, load_streams, save_streams

    groups = SimpleNamespace(coordinates={"tp": 0}, dims=SimpleNamespace(sizes={"tp": 1}))
    tracker = RNGTracker(seed=3, tp_rank=0, pp_rank=0).seed_streams()
    import unittest.mock

    with unittest.mock.patch("hftrain.parallel.host.gather_bytes", lambda flat: [flat]), \
         unittest.mock.patch("torch.distributed.get_rank", lambda: 0):  # fmt: skip
        save_streams(tmp_path, tracker, groups=groups)
    data = (tmp_path / FILE).read_bytes()
    reads = []
    fresh = RNGTracker(seed=4, tp_rank=0, pp_rank=0).seed_streams()
    assert load_streams(tmp_path, fresh, groups=groups, read=lambda p: reads.append(p) or data) is None
    assert reads == [tmp_path / FILE]
    assert all(bool((fresh.states()[s] == tracker.states()[s]).all()) for s in ("default", "tensor"))
    with pytest.raises(ValueError, match="truncated"):
        load_streams(tmp_path, fresh, groups=groups, read=lambda p: data[:20])
    (tmp_path / FILE).unlink()
    os.mkfifo(tmp_path / FILE)
    with pytest.raises(Exception, match="FIFO"):
        load_streams(tmp_path, fresh, groups=groups, read=read_verified)


# ----------------------------------------------------------------- probes: sizes, nesting, extents, remote code
_DEEP = "[" * 200_000 + "]" * 200_000  # nested past Python's stack: json raises RecursionError, not ValueError


@pytest.mark.parametrize(
    ("file", "fragment"),
    [
        ("checkpoint.json", "checkpoint.json is corrupted"),
        ("state/sharded.json", "state/sharded.json is damaged (maximum recursion depth"),
        ("state/hf_model/config.json", "state/hf_model/config.json is damaged (maximum recursion depth"),
    ],
)
def test_json_nested_past_the_stack_is_damage_not_a_traceback(run, tmp_path, file, fragment):
    copy = _copy(run, tmp_path)
    (copy / STEP2 / file).write_text(_DEEP)
    if file != "checkpoint.json":
        reseal(copy, STEP2)
    _convert(copy, tmp_path / "out", fragment)


@pytest.mark.parametrize("file", ["checkpoint.json", "state/sharded.json"])
def test_a_sparse_terabyte_file_is_refused_unread(run, tmp_path, file):
    """A file read whole is bounded before a byte is read or hashed: a sparse file costs its forger nothing."""
    copy = _copy(run, tmp_path)
    if file != "checkpoint.json":
        os.truncate(copy / STEP2 / file, 1 << 40)
        _edit_marker(copy, lambda meta: meta["files"].__setitem__(file, "xxh3_128:" + "0" * 32))
    else:
        os.truncate(copy / STEP2 / file, 1 << 40)
    started = time.monotonic()
    _convert(copy, tmp_path / "out", f"{file} is 1099511627776 bytes, more than the 1024 MiB")
    assert time.monotonic() - started < 30


def test_a_dcp_chunk_beyond_its_file_is_named_on_convert_and_resume(run, tmp_path):
    """A .distcp shorter than its .metadata lists (truncated, resealed): the chunk and the file's size are named,
    not an EOFError or a message about torch's internals."""
    import torch

    from hftrain.checkpoint.sharded import Chunked, dcp_metadata, read

    copy = _copy(run, tmp_path)
    dcp = copy / STEP2 / "state" / "dcp"
    distcp = next(dcp.glob("*.distcp"))
    os.truncate(distcp, 100)
    reseal(copy, STEP2)
    _convert(copy, tmp_path / "out", "beyond the end of its 100-byte file")
    with open_checkpoint(copy / STEP2).active():
        metadata = dcp_metadata(dcp)
        state = {key: Chunked.whole(torch.zeros(tuple(entry.size), dtype=entry.properties.dtype))
                 for key, entry in metadata.state_dict_metadata.items()}  # fmt: skip
        with pytest.raises(CheckpointError, match="beyond the end of its 100-byte file"):
            read(state, dcp)


def test_the_tokenizer_folder_a_checkpoint_names_runs_no_code_even_on_yes(run, tmp_path, monkeypatch):
    """convert copies the tokenizer of the model the checkpoint's config names: one with an auto_map would make
    transformers ask "run the custom code? [y/N]"; a "y" on stdin ran it. Now it is never asked."""
    import io

    evil = tmp_path / "evil"
    evil.mkdir()
    auto = {"AutoConfig": "evil.C", "AutoTokenizer": ["evil.Tok", None]}
    (evil / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": auto}))  # no local class
    (evil / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto, "tokenizer_class": "Tok"}))
    (evil / "evil.py").write_text("open('PWNED', 'w').close()\n")
    copy = _copy(run, tmp_path)
    _edit_marker(copy, lambda meta: meta["config"].__setitem__("model.model_name_or_path", str(evil)))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    code, stderr = cli_in_process(["convert", str(copy), str(tmp_path / "out")])
    assert code == 0, stderr
    assert not Path("PWNED").exists()


def test_a_sparse_or_bare_pickle_deepspeed_file_is_refused_before_it_is_copied(zero_folder, tmp_path):
    folder = tmp_path / "zero2"
    shutil.copytree(zero_folder / "zero2", folder)
    state = folder / "global_step2" / "mp_rank_00_model_states.pt"
    state.write_bytes(planted_bytes("bare"))
    code, stderr = _convert_zero(folder, tmp_path / "out", zero_folder / "config")
    assert_refused(stderr, code, "holds a pickled object (posix.system)")
    state.unlink()
    with state.open("wb") as handle:  # a sparse terabyte: never streamed into the private copy
        handle.truncate(1 << 40)
    started = time.monotonic()
    code, stderr = _convert_zero(folder, tmp_path / "out", zero_folder / "config")
    assert_refused(stderr, code, "mp_rank_00_model_states.pt is damaged")
    assert time.monotonic() - started < 30
    assert not Path("PWNED").exists() and not list(tmp_path.glob(".hftrain-verified-*"))
