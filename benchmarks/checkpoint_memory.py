"""Per-rank memory and time of a checkpoint save and of the streamed export, read from the process.

SmolLM2-135M's shape (``benchmarks/pipeline_memory.py``'s random-weight folder: 513 MiB of fp32 weights) is
trained for one fp32 AdamW step (so Adam's moments exist) under each layout, in its own set of gloo processes.
Then every rank measures, against its **own state**: the bytes of the boxes it holds in the sharded format
(``runtime.snapshot().nbytes``: its shards of the weights and of both Adam moments, plus the replicated tensors it
holds whole):

- ``sync save``: ``/proc/self/status`` VmHWM is reset (``clear_refs`` 5), a synchronous checkpoint is written,
  and the peak's increase over VmRSS before the save is read, with the save's wall time;
- ``background save``: the same, written in the background: ``blocked`` is the time until training could go on
  (the save call's return: extras, snapshot and the CPU staging copy), ``total`` until the write is published;
  ``next save``: the blocked time of a second background save (the steady state of a run: the first save's
  staging block was released once written, ``checkpoint.sharded.Staging``, and the second one's comes from the
  heap again), and the parts of the blocked time: the extras (scheduler, RNG, a pipeline's timeline) and a
  staging copy;
- ``export``: the full weights streamed one tensor at a time (``runtime.iter_full_state``), the peak's increase
  on each rank (the main process receives each whole tensor; the writer is measured by ``hftrain convert``'s
  benchmark).

The issue's bound is ``peak ≤ 1.2 × own + 64 MiB`` per rank; the ratio ``blocked / sync`` should be ≤ 0.2.
SmolLM2's 9 query heads split over tp = 3, not 2, so the tensor-parallel layout here is tp = 3.

``--writer`` measures instead, in one process, the writer and the staging block alone (issue 55): SmolLM2-135M's
fp32 weights and both Adam moments as boxes of random values (1.5 GB), staged once (``Snapshot.staged``: the
block's bytes against the state's, and against what torch's pinned allocator would hold for one buffer per box,
each rounded up to a power of two), then written by ``sharded.write`` with 1, 2 and 4 threads, each twice, in
turn (median seconds, files per rank).

Usage (about 5 minutes on 2 shared cores, ~6 GB of memory):
    python benchmarks/checkpoint_memory.py [--layouts tp3,pp2,zero3,fsdp2,ddp2]
    python benchmarks/checkpoint_memory.py --writer [--threads 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests`, `benchmarks` and an uninstalled hftrain

from benchmarks.pipeline_memory import saved_model  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.memory import process_memory, reset_peak  # noqa: E402

# layout -> (strategy, options, processes)
LAYOUTS = {
    "tp3": ("megatron", {"tp": 3}, 3),
    "pp2": ("megatron", {"pp": 2, "num_microbatches": 2}, 2),
    "zero3": ("zero3", {}, 2),
    "fsdp2": ("fsdp", {"fsdp_version": 2}, 2),
    "ddp2": ("ddp", {}, 2),
}
MIB = 1 << 20


def _measured(action) -> tuple[int, float]:
    """(peak RSS increase in bytes, seconds) of ``action()``."""
    import gc

    gc.collect()
    reset_peak()
    before = process_memory("VmRSS")
    start = time.perf_counter()
    action()
    return process_memory("VmHWM") - before, time.perf_counter() - start


def _measure(strategy_name: str, options: dict, folder: str) -> dict:
    from hftrain.cli import launch_info_from_environ
    from hftrain.config import ModelConfig, TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.models import PretrainedBuilder
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, reset_accelerate_state, tiny_splits, tiny_tokenizer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("llama")
    tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(16, 4), tokenizer, max_seq_length=16)
    args = TrainingConfig(
        output_dir=_fresh_output_dir(),
        per_device_train_batch_size=4,
        max_steps=1,
        log_with="none",
        mixed_precision="no",
        eval_steps=1000,
    )
    strategy = strategy_from_options(strategy_name, options, launch=launch_info_from_environ())
    trainer = SequenceClassificationTrainer(
        args,
        strategy=strategy,
        model_init=PretrainedBuilder(ModelConfig(model_name_or_path=folder), tokenizer.pad_token_id),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=None,
    )
    trainer.fit()
    runtime, manager = trainer.runtime, trainer.checkpoints
    own = runtime.snapshot().nbytes
    meta = {"trainer_state": trainer.state_dict(), "topology": trainer.strategy_summary, "config": trainer.run_config}

    def save(background: bool):
        return lambda: manager.save(runtime, step=trainer.state.global_step, meta=meta, background=background)

    runtime.wait_for_everyone()
    sync_peak, sync_time = _measured(save(False))
    runtime.wait_for_everyone()
    blocked: list[float] = []

    def background() -> None:
        start = time.perf_counter()
        save(True)()
        blocked.append(time.perf_counter() - start)
        manager.wait()

    background_peak, background_time = _measured(background)
    runtime.wait_for_everyone()
    background()  # again: the steady state (the first save's block went back to the heap once written)
    runtime.wait_for_everyone()
    start = time.perf_counter()
    runtime.save_extras(str(Path(args.output_dir) / "extras"))  # what the loop waits for besides the copy
    extras = time.perf_counter() - start
    start = time.perf_counter()
    runtime.snapshot().staged().release()  # one staging block, from the heap, released
    staging = time.perf_counter() - start
    runtime.wait_for_everyone()

    def export() -> None:
        for _, tensor in runtime.iter_full_state(trainer.model):
            del tensor

    export_peak, export_time = _measured(export)
    runtime.wait_for_everyone()
    if runtime.is_main_process:  # its checkpoints: ~4 GB per layout, left in the temporary folder otherwise
        shutil.rmtree(args.output_dir, ignore_errors=True)
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "own": own,
        "sync_peak": sync_peak,
        "sync_time": sync_time,
        "background_peak": background_peak,
        "blocked": blocked[0],
        "blocked_again": blocked[1],
        "extras": extras,
        "staging": staging,
        "background_time": background_time,
        "export_peak": export_peak,
        "export_time": export_time,
    }


def _writer(threads: list[int]) -> None:
    """The ``--writer`` figures (module docstring)."""
    import statistics
    import tempfile

    import torch
    from transformers import AutoModelForSequenceClassification

    from benchmarks.pipeline_memory import smollm2_config
    from hftrain.checkpoint.sharded import Chunked, Snapshot, write

    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(smollm2_config())
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state = {
        f"{prefix}{name}": Chunked.whole(torch.randn(shape))
        for name, shape in shapes.items()
        for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq.")
    }
    live = Snapshot(state=state, param_groups=[])
    start = time.perf_counter()
    staged = live.staged()
    staging_s = time.perf_counter() - start
    block = staged.staging.nbytes
    rounded = sum(1 << (t.nbytes - 1).bit_length() for v in state.values() for _, t in v.boxes)
    print(
        f"state {live.nbytes / MIB:,.0f} MiB in {sum(len(v.boxes) for v in state.values())} boxes; staging block "
        f"{block / MIB:,.1f} MiB ({block / live.nbytes:.4f} × the state), staged in {staging_s:.2f} s; a pinned "
        f"buffer per box rounded to a power of two: {rounded / MIB:,.0f} MiB ({rounded / live.nbytes:.2f} ×)"
    )
    staged.release()
    print(f"after release: the block holds {staged.staging.nbytes} bytes\n")
    times: dict[int, list[float]] = {n: [] for n in threads}
    files: dict[int, int] = {}
    for _ in range(2):
        for n in threads:
            with tempfile.TemporaryDirectory(dir=os.environ.get("HFTRAIN_BENCH_DIR")) as folder:
                start = time.perf_counter()
                write(state, folder, threads=n)
                times[n].append(time.perf_counter() - start)
                files[n] = len(list(Path(folder).glob("*.distcp")))
    print("| writer threads | files per rank | median write (s) | / 1 thread |")
    print("|---|---|---|---|")
    one = statistics.median(times[threads[0]])
    for n in threads:
        median = statistics.median(times[n])
        print(f"| {n} | {files[n]} | {median:.2f} | {median / one:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    parser.add_argument("--writer", action="store_true", help="the writer's threads and the staging block alone")
    parser.add_argument("--threads", default="1,2,4", help="--writer: comma-separated thread counts")
    args = parser.parse_args()
    if args.writer:
        _writer([int(n) for n in args.threads.split(",")])
        return
    folder = saved_model("smollm2")
    print(
        "| layout | rank | own state (MiB) | sync save: peak (MiB) | bound 1.2·own+64 | time (s) |"
        " background: peak (MiB) | blocked (s) | blocked / sync | total (s) | next save: blocked / sync |"
        " of which extras, a fresh staging copy (s) | export stream: peak (MiB) | time (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts.split(","):
        strategy, options, processes = LAYOUTS[name]
        runs = run_distributed(
            _measure, nprocs=processes, timeout=1800, strategy_name=strategy, options=options, folder=folder
        )
        for r in sorted(runs, key=lambda r: r["rank"]):
            bound = 1.2 * r["own"] + 64 * MIB
            print(
                f"| {name} | {r['rank']} | {r['own'] / MIB:,.0f} | {r['sync_peak'] / MIB:,.0f} | "
                f"{'≤' if r['sync_peak'] <= bound else '>'} {bound / MIB:,.0f} | {r['sync_time']:.2f} | "
                f"{r['background_peak'] / MIB:,.0f} | {r['blocked']:.2f} | {r['blocked'] / r['sync_time']:.2f} | "
                f"{r['background_time']:.2f} | {r['blocked_again'] / r['sync_time']:.2f} | "
                f"{r['extras']:.2f}, {r['staging']:.2f} | {r['export_peak'] / MIB:,.0f} | {r['export_time']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
