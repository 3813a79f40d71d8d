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
  ``next save``: the blocked time of a second background save, whose staging copy goes into the first one's
  memory (the steady state of a run), and the parts of the blocked time: the extras (scheduler, RNG, a
  pipeline's timeline) and a staging copy into fresh memory;
- ``export``: the full weights streamed one tensor at a time (``runtime.iter_full_state``), the peak's increase
  on each rank (the main process receives each whole tensor; the writer is measured by ``hftrain convert``'s
  benchmark).

The issue's bound is ``peak ≤ 1.2 × own + 64 MiB`` per rank; the ratio ``blocked / sync`` should be ≤ 0.2.
SmolLM2's 9 query heads split over tp = 3, not 2, so the tensor-parallel layout here is tp = 3.

Usage (about 5 minutes on 2 shared cores, ~6 GB of memory):
    python benchmarks/checkpoint_memory.py [--layouts tp3,pp2,zero3,fsdp2,ddp2]
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
    background()  # again: the steady state (the staging copy reuses the first one's memory)
    runtime.wait_for_everyone()
    start = time.perf_counter()
    runtime.save_extras(str(Path(args.output_dir) / "extras"))  # what the loop waits for besides the copy
    extras = time.perf_counter() - start
    start = time.perf_counter()
    runtime.snapshot().staged({})  # into fresh memory
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
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
