"""The end-of-run export's peak memory per rank: streamed (``iter_full_state`` + the streamed writer) against gathered.

Two gloo processes train a GPT-2-shaped classifier (GPT-2's 50,257-row vocabulary, ``--width`` wide, ``--layers``
deep) one step under ``--strategy``, then each rank measures the VmHWM increase over its resident memory while
writing the model's ``save_pretrained`` folder (weights and config; no reload check, which loads the model once
more on the main process whichever way it was written):

- ``streamed``: ``export_pretrained`` without ``verify_inputs`` (the runtime yields each full tensor, the main
  process writes it and drops it);
- ``gathered``: ``runtime.get_state_dict`` on every rank, then ``save_pretrained(state_dict=...)`` on the main
  process (the export before the streamed writer).

    .venv/bin/python benchmarks/export_memory.py --strategy fsdp --fsdp_version 2
    .venv/bin/python benchmarks/export_memory.py --strategy megatron --tp 2
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _measure(trainer, side: str, directory: str) -> dict[str, int]:
    """One way of writing, on this rank, once, right after training: its peak, this rank's own parameter bytes and
    the largest full tensor."""
    from hftrain.checkpoint.export import export_pretrained
    from tests.memory import process_memory, reset_peak

    runtime, model = trainer.runtime, trainer.model
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # FSDP2: DTensor shards
    shard = sum(p.numel() * p.element_size() for p in local)
    # Training tuned glibc to keep freed blocks for reuse (Platform.tune_host_allocator): with that, the export's
    # tensors would land in memory the training steps left free and no peak would show. Lean thresholds and a trim
    # first, so that every large tensor is a mapping of its own, counted when made and returned when freed.
    from hftrain.strategies.platform import Platform

    platform = Platform("cpu", "gloo")
    platform.tune_host_allocator(lean=True)
    platform.release_freed_memory()
    runtime.wait_for_everyone()
    target = Path(directory) / side
    reset_peak()
    before = process_memory("VmRSS")
    if side == "streamed":
        result = export_pretrained(runtime, model, trainer.tokenizer, target)
        assert result.streamed, "the runtime did not stream"
    else:
        state = runtime.get_state_dict(model)
        if runtime.is_main_process:
            runtime.unwrap_model(model).save_pretrained(target, state_dict=state)
        del state
    runtime.wait_for_everyone()
    peak = process_memory("VmHWM") - before
    largest = 0
    if runtime.is_main_process:
        from safetensors import safe_open

        with safe_open(str(target / "model.safetensors"), framework="pt") as handle:
            largest = max(handle.get_slice(k).get_shape()[0] * _row_bytes(handle, k) for k in handle.keys())
        shutil.rmtree(target, ignore_errors=True)
    return {"peak": peak, "shard": shard, "largest": largest}


def _row_bytes(handle, key: str) -> int:
    shape = handle.get_slice(key).get_shape()
    count = 1
    for size in shape[1:]:
        count *= size
    return count * 4


def _body(strategy: str, options: dict, width: int, layers: int, side: str, directory: str) -> dict:
    from tests.tiny import run_tiny_training

    overrides = {"vocab_size": 50257, "n_embd": width, "n_layer": layers, "n_head": width // 64}
    return run_tiny_training(
        kind="gpt2",
        strategy=strategy,
        strategy_options=options,
        steps=1,
        n_train=16,
        n_eval=4,
        config_overrides=overrides,
        inspect=lambda trainer: _measure(trainer, side, directory),
    )["inspected"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--fsdp_version", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from tests.distributed import run_distributed

    options = {"fsdp": {"fsdp_version": args.fsdp_version}, "megatron": {"tp": args.tp}}.get(args.strategy)
    results = {}
    for side in ("streamed", "gathered"):  # each in a launch of its own: fresh processes, nothing reused
        with tempfile.TemporaryDirectory() as directory:
            results[side] = run_distributed(
                _body, nprocs=2, timeout=1800, strategy=args.strategy, options=options, width=args.width,
                layers=args.layers, side=side, directory=directory,
            )  # fmt: skip
    mib = 1 << 20
    label = args.strategy + (f"{args.fsdp_version}" if args.strategy == "fsdp" else f" tp={args.tp}")
    largest = results["streamed"][0]["largest"] / mib
    print("| strategy | rank | own parameters | largest tensor | streamed peak | gathered peak |")
    print("|---|---|---|---|---|---|")
    for rank in range(2):
        streamed, gathered = results["streamed"][rank], results["gathered"][rank]
        print(
            f"| {label} | {rank} | {streamed['shard'] / mib:.0f} MiB | {largest:.0f} MiB | "
            f"{streamed['peak'] / mib:.0f} MiB | {gathered['peak'] / mib:.0f} MiB |"
        )


if __name__ == "__main__":
    main()
