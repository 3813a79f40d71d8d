"""Where a ZeRO-3 rank's memory goes: an ``hftrain train`` job with VmRSS printed around DeepSpeed's engine calls.

Run it as a job's entry point instead of ``-m hftrain``; it takes ``hftrain``'s own arguments::

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/zero3_storages.py train \\
        --model_name_or_path /tmp/hftrain-mt-big --dataset_name null --train_file /tmp/hftrain-mt-train.csv \\
        --max_steps 3 --per_device_train_batch_size 8 --max_seq_length 128 --mixed_precision no \\
        --log_with none --output_dir /tmp/zero3-storages --strategy.name zero3

(the model and data are the ones ``benchmarks/memory_timeline.py --model big`` builds). Each rank prints, before
and after each ``forward``, ``backward`` and ``step`` of DeepSpeed's engine, its VmRSS and VmHWM and glibc's heap
(in use, free, mmapped: whether memory is held by tensors or kept free by the allocator); after the second step
rank 0 lists every tensor storage the ZeRO optimizer and the model hold, grouped by what refers to it (the fp32
master, the working partition, the gradient buffer, Adam's moments). Issue 42's second pass found with it that the
fp32 master was a second copy of the partition and that the step flattened every gradient once more
(benchmarks/README.md, "Sharding that shards").
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def memory() -> str:
    """VmRSS and VmHWM of this process, and glibc's heap in use, free and mmapped (GB)."""
    status = {}
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                status[key] = int(value.split()[0]) / 1e6
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    heap = libc.mallinfo2()
    return (f"RSS {status['VmRSS']:.2f} HWM {status['VmHWM']:.2f} | heap used {heap.uordblks / 1e9:.2f} "
            f"free {heap.fordblks / 1e9:.2f} mmapped {heap.hblkhd / 1e9:.2f}")  # fmt: skip


def _print(text: str) -> None:
    print(f"[rank {os.environ.get('RANK', '0')}] {text}", flush=True)


def storages(engine: Any) -> None:
    """Every storage the ZeRO optimizer and the model hold, grouped by what refers to it, with its bytes."""
    import torch

    optimizer = engine.optimizer
    found: dict[int, list] = {}

    def add(label: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            found.setdefault(storage.data_ptr(), [storage.nbytes(), set()])[1].add(label)

    for attr in ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"):
        for tensor in getattr(optimizer, attr, None) or []:
            add(attr, tensor)
            add(attr + ".grad", getattr(tensor, "grad", None))
    add("grad_partitions_flat_buffer", getattr(optimizer, "grad_partitions_flat_buffer", None))
    for state in optimizer.optimizer.state.values():
        for key, value in state.items():
            add(f"adam {key}", value)
    for param in engine.module.parameters():
        add("param.data", param.data)
        add("ds_tensor", getattr(param, "ds_tensor", None))
        add("param.grad", param.grad)
    groups: dict[str, list[int]] = {}
    for nbytes, labels in found.values():
        entry = groups.setdefault(" + ".join(sorted(labels)), [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    for labels, (nbytes, count) in sorted(groups.items(), key=lambda item: -item[1][0]):
        _print(f"{nbytes / 1e9:.3f} GB in {count} storages: {labels}")
    _print(f"total {sum(n for n, _ in found.values()) / 1e9:.3f} GB; {memory()}")


def _instrument() -> None:
    import deepspeed.runtime.engine as engine_module

    steps = {"done": 0}
    for name in ("forward", "backward", "step"):
        original = getattr(engine_module.DeepSpeedEngine, name)

        def wrapped(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            _print(f"before {_name}: {memory()}")
            result = _original(self, *args, **kwargs)
            _print(f"after {_name}: {memory()}")
            if _name == "step":
                steps["done"] += 1
                if steps["done"] == 2 and os.environ.get("RANK", "0") == "0":
                    storages(self)
            return result

        setattr(engine_module.DeepSpeedEngine, name, functools.wraps(original)(wrapped))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    _instrument()
    from hftrain.cli import main

    code = main(sys.argv[1:])
    _print(f"exit: {memory()}")
    sys.exit(code)
