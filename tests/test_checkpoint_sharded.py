"""The sharded checkpoint format (``hftrain.checkpoint.sharded``): every tensor written once, by the rank that owns
it; background writes that a SIGKILL cannot turn into a partial ``latest``; checkpoints of the earlier formats still
resume, or are refused in one line.

The resume matrix across strategies and process counts is ``tests/test_checkpoint_reshard.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hftrain.checkpoint.manager import CheckpointManager, read_checkpoint
from hftrain.checkpoint.sharded import DCP_DIR, Chunked, read, read_model_tensors, write
from tests.conftest import job_args, launch_env, logged_losses
from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- the format itself (one process)
def test_boxes_of_a_flat_range_tile_it_exactly():
    """ZeRO's partitions are flat ranges: their boxes cover exactly the range, with at most 2·dim − 1 boxes."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        size = tuple(
            int(s) for s in torch.randint(1, 6, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen)
        )
        full = torch.arange(max(1, int(torch.tensor(size).prod())), dtype=torch.float32).view(size)
        n = full.numel()
        start = int(torch.randint(0, n, (1,), generator=gen))
        end = int(torch.randint(start + 1, n + 1, (1,), generator=gen))
        chunked = Chunked.flat_range(size, start, full.reshape(-1)[start:end])
        out = torch.full_like(full, -1.0)
        for offsets, box in chunked.boxes:
            out[tuple(slice(o, o + s) for o, s in zip(offsets, box.shape, strict=True))] = box
        flat = out.reshape(-1)
        assert torch.equal(flat[start:end], full.reshape(-1)[start:end]), (size, start, end)
        assert (flat[:start] == -1).all() and (flat[end:] == -1).all(), (size, start, end)
        assert len(chunked.boxes) <= max(1, 2 * len(size) - 1)


def test_a_load_reads_any_other_tiling_in_place(tmp_path):
    weight = torch.randn(7, 5)
    write({"model.w": Chunked((7, 5), [((0, 0), weight[:3]), ((3, 0), weight[3:])])}, tmp_path)
    target = torch.zeros(7, 5)
    read({"model.w": Chunked((7, 5), [((0, 1), target[:, 1:4])])}, tmp_path)  # a column block, across both pieces
    assert torch.equal(target[:, 1:4], weight[:, 1:4]) and (target[:, [0, 4]] == 0).all()
    with pytest.raises(Exception, match="shape"):
        read({"model.w": Chunked.whole(torch.zeros(5, 7))}, tmp_path)


def _several_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {f"model.w{i}": torch.randn(40 + 7 * i, 9, generator=gen) for i in range(7)}


def test_several_writer_threads_write_a_file_each_that_any_tiling_loads(tmp_path):
    """``threads=3``: a file per thread, the boxes dealt out over them; every tensor reads back, whole and as
    another tiling. By default a small state gets one thread (one file per rank); a large one up to min(4, CPUs)."""
    from hftrain.checkpoint.sharded import BYTES_PER_WRITER_THREAD, default_write_threads, write_threads

    tensors = _several_tensors()
    write({k: Chunked.whole(v) for k, v in tensors.items()}, tmp_path, threads=3)
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert min(p.stat().st_size for p in tmp_path.glob("*.distcp")) > 0
    for key, value in tensors.items():
        whole = torch.zeros_like(value)
        halves = torch.zeros_like(value)
        read({key: Chunked.whole(whole)}, tmp_path)
        read({key: Chunked(tuple(value.shape), [((0, 0), halves[:, :4]), ((0, 4), halves[:, 4:])])}, tmp_path)
        assert torch.equal(whole, value) and torch.equal(halves, value), key
    small = {k: Chunked.whole(v) for k, v in tensors.items()}
    assert write_threads(small) == 1 and write_threads(small, 2) == 2
    elements = 10 * BYTES_PER_WRITER_THREAD // 4  # 10 threads' worth of fp32 (an expanded view: no memory)
    big = {"model.big": Chunked((elements,), [((0,), torch.empty(1).expand(elements))])}
    assert 1 <= default_write_threads() <= 4 and write_threads(big) == default_write_threads()
    half = {"model.half": Chunked((elements // 20,), [((0,), torch.empty(1).expand(elements // 20))])}
    assert write_threads(half) == 1  # half a thread's worth


def test_a_failing_writer_thread_is_one_error_not_a_lost_file(tmp_path, capfd):
    """Every file but the first cannot be created (a folder in its place): whichever thread meets it, the write
    fails with that one error, and no thread prints a traceback (DCP's own extra threads print theirs and lose
    their files' records, so the checkpoint would have been published without them)."""
    tensors = _several_tensors()
    for i in (1, 2, 3):
        (tmp_path / f"__0_{i}.distcp").mkdir()
    with pytest.raises(OSError, match="Is a directory"):
        write({k: Chunked.whole(v) for k, v in tensors.items()}, tmp_path, threads=4)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_views_of_a_larger_storage_are_written_from_their_own_memory(tmp_path):
    """DCP's writer clones a view of a larger storage and keeps every clone until the file is written: a live ZeRO-3
    snapshot (views of DeepSpeed's flat partitions) cost the rank its whole state once more (issue 42). The planner
    hands DCP aliases whose storage is their own bytes: same memory, nothing for DCP to clone, same file."""
    from hftrain.checkpoint.sharded import _own_storage

    flat = torch.randn(1000)
    for view in (flat[100:300], flat[200:500].view(30, 10), flat.bfloat16()[7:9]):
        alias = _own_storage(view)
        assert alias.untyped_storage().nbytes() == view.nbytes and alias.data_ptr() == view.data_ptr()
        assert alias.dtype == view.dtype and alias.shape == view.shape and torch.equal(alias, view)
    strided = flat.view(100, 10)[:, :3]  # not contiguous: left to DCP's clone
    assert _own_storage(strided) is strided
    write({"w": Chunked.flat_range((400,), 0, flat[:400]), "v": Chunked.flat_range((10, 60), 0, flat[400:1000])},
          tmp_path)  # fmt: skip
    target = {"w": torch.zeros(400), "v": torch.zeros(10, 60)}
    read({"w": Chunked.whole(target["w"]), "v": Chunked.whole(target["v"])}, tmp_path)
    assert torch.equal(target["w"], flat[:400]) and torch.equal(target["v"].reshape(-1), flat[400:])


# ----------------------------------------------------------------- written once, by its owner; background = sync
def _two_ranks(root: str) -> dict:
    """ddp×2 and megatron tp2, each saved in the background and synchronously at the same step."""
    out = {}
    for label, strategy, options in (("ddp", "ddp", {}), ("tp2", "megatron", {"tp": 2})):
        for mode in ("background", "sync"):
            run_tiny_training(
                strategy=strategy, strategy_options=options, steps=3, output_dir=f"{root}/{label}-{mode}",
                async_save=mode == "background",
            )  # fmt: skip
    # bf16 autocast: the checkpoint and the export's weights are the fp32 master weights, equal
    bf16 = run_tiny_training(
        strategy="megatron", strategy_options={"tp": 2}, steps=3, output_dir=f"{root}/tp2-bf16",
        mixed_precision="bf16", return_weights=True,
    )  # fmt: skip
    out["bf16_export"] = bf16["weights"]
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sharded")
    return {"root": root, "ranks": run_distributed(_two_ranks, nprocs=2, timeout=900, root=str(root))}


def _stored(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(checkpoint / "state" / DCP_DIR)).read_metadata()


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["ddp", "tp2"])
def test_every_tensor_is_written_once_and_the_writes_are_spread_over_ranks(two, label):
    checkpoint = two["root"] / f"{label}-sync" / "checkpoints" / "step_00000003"
    metadata = _stored(checkpoint)
    data: dict[str, int] = {}  # file -> bytes of tensor data stored in it
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(index.offset))
        data[info.relative_path] = data.get(info.relative_path, 0) + chunk.sizes.numel() * md.properties.dtype.itemsize
    chunks = [c for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks") for c in md.chunks]
    assert len(metadata.storage_data) == len(chunks)  # one stored piece per box: nothing written by two ranks
    logical = sum(
        md.size.numel() * md.properties.dtype.itemsize
        for md in metadata.state_dict_metadata.values()
        if hasattr(md, "chunks")
    )
    assert sum(data.values()) == logical  # the pieces tile every tensor exactly once
    assert len(data) == 2 and min(data.values()) > 0.3 * logical, data  # both ranks write, about half each
    if label == "tp2":  # the split weights are stored as the ranks' slices, under their full logical shape
        word = metadata.state_dict_metadata["model.bert.embeddings.word_embeddings.weight"]
        assert tuple(word.size) == (64, 32) and len(word.chunks) == 2


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["ddp", "tp2"])
def test_a_background_save_writes_what_a_synchronous_one_writes(two, label):
    runs = {mode: two["root"] / f"{label}-{mode}" / "checkpoints" / "step_00000003" for mode in ("background", "sync")}
    tensors = {mode: read_model_tensors(path / "state") for mode, path in runs.items()}
    assert tensors["background"].keys() == tensors["sync"].keys()
    for name, tensor in tensors["sync"].items():
        assert torch.equal(tensors["background"][name], tensor), name
    read_checkpoint(runs["background"])  # complete: marker and every checksum


@pytest.mark.distributed
def test_bf16_megatron_checkpoints_and_exports_hold_the_fp32_master_weights(two):
    saved = read_model_tensors(two["root"] / "tp2-bf16" / "checkpoints" / "step_00000003" / "state")
    exported = two["ranks"][0]["bf16_export"]
    assert saved.keys() == exported.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == exported[name].dtype == torch.float32, name
        assert torch.equal(tensor, exported[name]), name


# ----------------------------------------------------------------- SIGKILL during a background write
def test_sigkill_during_a_background_write_resumes_from_the_last_complete_one_equal_to_uninterrupted(
    tiny_job, tmp_path
):
    steps = 12
    reference = tmp_path / "reference"
    base = [sys.executable, "-m", "hftrain", "train"]
    done = subprocess.run(
        [*base, *job_args(tiny_job, reference, steps=steps, data="data_400")],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    command = [*base, *job_args(tiny_job, out, steps=steps, data="data_400"), "--save_steps", "1"]
    process = subprocess.Popen(
        command, cwd=ROOT, env=launch_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
    )
    checkpoints = out / "checkpoints"

    def writing() -> bool:  # a background write in flight: its staging folder holds shards, not yet published
        return any(checkpoints.glob(".staging-*/state/dcp/*"))

    try:
        while CheckpointManager(checkpoints).latest() is None and process.poll() is None:
            time.sleep(0.01)  # a first checkpoint published
        for _ in range(200):  # freeze the job when a write is seen; kill it only if the write is still in flight
            while not writing() and process.poll() is None:
                pass
            process.send_signal(signal.SIGSTOP)
            if writing():
                break
            process.send_signal(signal.SIGCONT)
        process.kill()
    finally:
        process.kill()
        process.wait()
    assert list(checkpoints.glob(".staging-*")), "the kill should have hit a background write in flight"
    latest = CheckpointManager(checkpoints).resolve("latest")
    read_checkpoint(latest)  # the last published checkpoint is complete and verified
    again = subprocess.run(
        [*command, "--resume_from_checkpoint", "latest"], cwd=ROOT, env=launch_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {latest}" in again.stdout + again.stderr
    assert not list(checkpoints.glob(".staging-*"))
    assert logged_losses(out) == pytest.approx(logged_losses(reference), rel=1e-6, abs=1e-7)


def test_the_last_background_save_writes_the_live_states_without_a_staged_copy():
    """The save after the last step is written from the states themselves (nothing changes them before ``fit``
    waits for it): no staging buffer is allocated, and the checkpoint holds the final weights."""

    def inspect(trainer):
        model = trainer.runtime.unwrap_model(trainer.model)
        return {"staged": trainer.checkpoints.staged_saves, "last": str(trainer.last_checkpoint),
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}  # fmt: skip

    run = run_tiny_training(steps=3, async_save=True, inspect=inspect)["inspected"]
    assert run["staged"] == 0
    stored = read_model_tensors(Path(run["last"]) / "state")
    assert stored.keys() <= run["weights"].keys() and len(stored) > 10
    for name, tensor in stored.items():
        assert torch.equal(tensor, run["weights"][name]), name


# ----------------------------------------------------------------- memory at a real size (slow)
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp3", "pp2", "zero3", "fsdp2"])
def test_a_save_and_the_streamed_export_cost_each_rank_its_own_state_at_most(layout):
    """SmolLM2-135M's shape (1.54 GB with Adam): every rank's peak RSS increase during a synchronous save stays
    within 1.2 × its own state + 64 MiB, and during the streamed export within the largest tensor + 64 MiB
    (``benchmarks/checkpoint_memory.py`` prints the same per rank, with the background save's timings)."""
    from benchmarks.checkpoint_memory import LAYOUTS, _measure
    from benchmarks.pipeline_memory import saved_model

    strategy, options, processes = LAYOUTS[layout]
    runs = run_distributed(
        _measure, nprocs=processes, timeout=1800, strategy_name=strategy, options=options, folder=saved_model("smollm2")
    )
    largest = 49152 * 576 * 4  # the embedding
    for r in runs:
        assert r["sync_peak"] <= 1.2 * r["own"] + 64 * 2**20, r
        assert r["background_peak"] <= 1.2 * r["own"] + 64 * 2**20, r
        assert r["export_peak"] <= largest + 64 * 2**20, r  # beside its own shards: one full tensor at a time


# ----------------------------------------------------------------- another strategy in the same output_dir
def test_a_run_continues_under_another_strategy_in_its_own_output_dir(tiny_job, tmp_path):
    """``--strategy.name megatron --resume_from_checkpoint <its step 3>`` continues a DDP run from there: the reshard
    is one logged line, the run config records the new strategy, and the losses equal an uninterrupted DDP run's."""
    import yaml

    out, reference = tmp_path / "out", tmp_path / "reference"
    base = [sys.executable, "-m", "hftrain", "train"]

    def run(*args: str) -> subprocess.CompletedProcess:  # fp32: the two strategies' steps compared at 1e-6
        done = subprocess.run(
            [*base, *args, "--mixed_precision", "no"],
            cwd=ROOT,
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    run(*job_args(tiny_job, reference, steps=6))
    run(*job_args(tiny_job, out, steps=6), "--save_steps", "3")
    step3 = str(out / "checkpoints" / "step_00000003")  # the run's own checkpoint, mid-way
    done = run(*job_args(tiny_job, out, steps=6), "--strategy.name", "megatron", "--resume_from_checkpoint", step3)
    log = done.stdout + done.stderr
    assert "resharding checkpoint from ddp on 1 processes to megatron on 1 processes (tp=1 × pp=1 × dp=1)" in log
    assert yaml.safe_load((out / "hftrain_config.yaml").read_text())["strategy"]["name"] == "megatron"
    assert logged_losses(out) == pytest.approx(logged_losses(reference), rel=1e-6, abs=1e-7)
