"""A background save's staging copy (issue 55): one block of exactly the boxes' bytes (each box 64-byte aligned, no
power-of-two rounding), equal to the live states and sharing no memory with them, held only until its write is
done: released by the writer (the manager holds none between saves), and the run's checkpoints still equal a
synchronous save's. On CPU nothing is page-locked; on CUDA the same block is registered with ``cudaHostRegister``
(``checkpoint.sharded.Staging``)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from hftrain.checkpoint.sharded import Chunked, Snapshot, Staging
from tests.tiny import run_tiny_training


def _snapshot() -> Snapshot:
    weights = torch.randn(1000)  # 4,000 bytes: 4,032 staged (a power of two would be 4,096)
    flat = torch.randn(3, 7, dtype=torch.float64)
    state = {
        "model.w": Chunked.whole(weights),
        "model.flat": Chunked.flat_range((5, 7), 14, flat.reshape(-1)[:21]),  # a flat range: several boxes
        "model.half": Chunked.whole(torch.randn(17).to(torch.bfloat16)),
        "optim.w.step": Chunked.whole(torch.tensor(3.0)),
        "model.empty": Chunked.whole(torch.empty(0)),
    }
    return Snapshot(state=state, param_groups=[])


def test_a_staged_copy_takes_one_block_of_its_own_bytes_and_releases_it():
    live = _snapshot()
    staged = live.staged()
    block = staged.staging.block
    boxes = [t for value in live.state.values() for _, t in value.boxes]
    exact = sum(-(-t.nbytes // Staging.ALIGN) * Staging.ALIGN for t in boxes)
    assert staged.staging.nbytes == exact and exact < live.nbytes + Staging.ALIGN * len(boxes)
    assert not staged.staging.registered and staged.copied is None  # a CPU: nothing page-locked, nothing to wait
    for key, value in live.state.items():
        for (offsets, tensor), (got_offsets, copy) in zip(value.boxes, staged.state[key].boxes, strict=True):
            assert got_offsets == offsets and copy.dtype == tensor.dtype and torch.equal(copy, tensor), key
            assert copy.untyped_storage().data_ptr() == block.data_ptr()  # a slice of the one block
            if tensor.numel():
                assert copy.data_ptr() % Staging.ALIGN == 0 and copy.data_ptr() != tensor.data_ptr()
    live.state["model.w"].boxes[0][1].add_(1.0)  # training goes on: the copy does not change
    assert not torch.equal(staged.state["model.w"].boxes[0][1], live.state["model.w"].boxes[0][1])
    # released: the boxes and the block are gone (no reference left: the memory is freed)
    gone = weakref.ref(block)
    del block
    staged.release()
    gc.collect()
    assert gone() is None and staged.staging.nbytes == 0 and staged.state == {}
    staged.release()  # idempotent
    live.release()  # live states: nothing to release
    assert live.state


def test_background_saves_release_their_staging_and_write_what_a_synchronous_save_writes(tmp_path):
    """A run saving in the background every 2 steps (the staged saves) against the same run saving synchronously:
    the same checkpoints, byte for byte in their tensors; no staging block is held once ``fit`` returns."""
    from hftrain.checkpoint.sharded import read_model_tensors

    def inspect(trainer):
        manager = trainer.checkpoints
        return {"staged": manager.staged_saves, "pending": manager._pending is None, "root": str(manager.root)}

    background = run_tiny_training(
        output_dir=str(tmp_path / "bg"), steps=6, save_steps=2, async_save=True, inspect=inspect
    )["inspected"]
    foreground = run_tiny_training(output_dir=str(tmp_path / "fg"), steps=6, save_steps=2, inspect=inspect)
    foreground = foreground["inspected"]
    assert background["staged"] == 2 and background["pending"]  # steps 2 and 4; step 6 writes the live states
    for step in (2, 4, 6):
        name = f"step_{step:08d}"
        got = read_model_tensors(Path(background["root"], name, "state"))
        want = read_model_tensors(Path(foreground["root"], name, "state"))
        assert got.keys() == want.keys() and len(got) > 10
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), (step, key)
