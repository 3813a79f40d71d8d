"""The ranks of ``benchmarks/data_scale.py``: one job run to its first optimizer step, measured from inside the rank.

Two entry points, each launched as ``python benchmarks/data_scale_worker.py KIND RECORD_DIR -- ARGS`` (one process)
or under ``python -m torch.distributed.run --standalone --nproc_per_node N`` (N ranks):

- ``hftrain``: the ``hftrain train`` command itself, ``hftrain.cli.entry(["train", *ARGS])`` in this process, with
  wrappers around ``hftrain.trainers.base.Trainer.fit`` (the training loop begins) and ``Trainer._on_step_end``
  (which the loop calls after every optimizer step, every rank alike);
- ``standard``: the data pipeline of transformers' ``run_clm_no_trainer.py``: ``datasets.load_dataset("json")``
  with its held-out split (``train[:P%]`` / ``train[P%:]``), ``map(tokenize, batched=True, num_proc=...)`` and
  ``map(group_texts, batched=True, num_proc=...)``, each under ``Accelerator.main_process_first()`` (the main
  process maps, the others then read its cache files), then the tiny model's first step in a plain Accelerate loop
  (``prepare``, ``backward``, ``AdamW.step``).

At the end of its first optimizer step each rank writes ``RECORD_DIR/rank<R>.json``: the wall clock (``time.time()``,
which the launching parent compares with its own clock taken just before it started the launcher), ``VmHWM`` and
``VmRSS`` from ``/proc/self/status`` (and ``VmHWM`` as the training loop began: ``hftrain.trainers.base.Trainer.fit``
wrapped likewise, or just before the standard loop), the rank's CPU seconds (``os.times``: its own, and its reaped
children's: the ``num_proc`` map workers), the largest reaped child's peak RSS (``RUSAGE_CHILDREN``'s ``ru_maxrss``;
not additive: a forked child's peak counts the pages it shares with the rank, and a child that only forks to exec a
command reports the rank's RSS at the fork) and the number of training blocks where the dataset has a length. It
then waits for the other ranks (a barrier) and ends with ``os._exit(0)``: nothing after the first step (checkpoint,
evaluation, export, teardown) runs or counts.

Why a hook inside the rank rather than polling ``/proc/<pid>/status`` from outside while watching the progress bar
(``benchmarks/memory_timeline.py``'s way): ``VmHWM`` is a high-water mark, so one read at the exact moment the step
ends is the peak up to then, with no sampling gap; a poller sees the bar's "1/N" only after tqdm flushes, by which
time the rank may be into its second step or its first checkpoint, and its reads race the rank's exit. The price is
two methods wrapped by name (one private); if one is renamed this module fails with a line saying so.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any


def status_bytes() -> dict[str, int]:
    """This process's ``VmHWM`` and ``VmRSS`` from ``/proc/self/status``, in bytes."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith(("VmHWM", "VmRSS")))
    return {name: int(value.split()[0]) * 1024 for name, value in fields.items()}


LOOP_START: dict[str, float] = {}
"""``loop_start_time`` and ``vm_hwm_before_step``: the clock and ``VmHWM`` when the training loop begins (data and
model ready, before the first batch is read)."""


def record_loop_start() -> None:
    """Note the clock and this process's ``VmHWM`` as the training loop begins (the peak before the first step)."""
    LOOP_START.update(loop_start_time=time.time(), vm_hwm_before_step=status_bytes()["VmHWM"])


def record_first_step(record_dir: Path, train_blocks: int | None, extra: dict[str, Any] | None = None) -> None:
    """Write this rank's measurements at the end of its first optimizer step, wait for the other ranks, and end.

    Args:
        record_dir: where ``rank<R>.json`` goes.
        train_blocks: training blocks (rows of the packed training set) where known.
        extra: more fields for the record.
    """
    now = time.time()
    memory = status_bytes()
    times = os.times()
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        **LOOP_START,
        "first_step_time": now,
        "vm_hwm": memory["VmHWM"],
        "vm_rss": memory["VmRSS"],
        "cpu_s": times.user + times.system,
        "children_cpu_s": times.children_user + times.children_system,
        "children_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "train_blocks": train_blocks,
        **(extra or {}),
    }
    partial = record_dir / f".rank{rank}.json.partial"
    partial.write_text(json.dumps(record))
    partial.rename(record_dir / f"rank{rank}.json")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # no rank closes its sockets while another still finishes the step's collectives
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- hftrain
def run_hftrain(record_dir: Path, argv: list[str]) -> int:
    """``hftrain train ARGV`` in this process, ended at its first optimizer step by :func:`record_first_step`."""
    from hftrain.cli import entry
    from hftrain.trainers.base import Trainer

    for name in ("fit", "_on_step_end"):  # the loop's start and its after-step call
        if not callable(getattr(Trainer, name, None)):
            raise SystemExit(
                f"data_scale_worker: hftrain.trainers.base.Trainer has no {name} in this checkout; update the hooks "
                "in benchmarks/data_scale_worker.py"
            )
    on_step_end: Callable[..., Any] = Trainer._on_step_end
    fit: Callable[..., Any] = Trainer.fit

    def first_step_then_exit(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        if self.state.global_step == 1:
            record_first_step(record_dir, _length(getattr(self.train_loader, "dataset", None)), _streamed(self))
        return on_step_end(self, *args, **kwargs)

    def noted_fit(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        record_loop_start()
        return fit(self, *args, **kwargs)

    Trainer._on_step_end = first_step_then_exit  # type: ignore[method-assign]
    Trainer.fit = noted_fit  # type: ignore[method-assign]
    return entry(["train", *argv])


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an iterable dataset: a stream has no length
        return None


def _streamed(trainer: Any) -> dict[str, Any]:
    """Whether the trainer's loader reads an iterable (streamed) dataset, and its class: the streaming row's proof."""
    import torch

    dataset = getattr(trainer.train_loader, "dataset", None)
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    try:
        import datasets

        iterable = iterable or isinstance(dataset, datasets.IterableDataset)
    except ImportError:
        pass
    return {"dataset_class": type(dataset).__name__, "iterable": iterable}


# ----------------------------------------------------------------------------- the standard pipeline
def run_standard(record_dir: Path, argv: list[str]) -> int:
    """run_clm_no_trainer's data pipeline and one step of its loop (argv: ``key=value`` pairs, see below).

    Keys: ``train_file``, ``model`` (a model folder with its tokenizer), ``cache_dir`` (datasets' cache for this
    run), ``block_size``, ``batch_size``, ``num_proc``, ``validation_split_percentage``, ``seed``.
    """
    options = dict(arg.split("=", 1) for arg in argv)
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

    accelerator = Accelerator(cpu=True)  # MULTI_CPU (gloo) under torchrun; a plain Accelerator() would be NO
    set_seed(int(options["seed"]))
    files, cache = {"train": options["train_file"]}, options["cache_dir"]
    percent = options["validation_split_percentage"]
    raw = {
        "validation": load_dataset("json", data_files=files, split=f"train[:{percent}%]", cache_dir=cache),
        "train": load_dataset("json", data_files=files, split=f"train[{percent}%:]", cache_dir=cache),
    }
    tokenizer = AutoTokenizer.from_pretrained(options["model"])
    num_proc = int(options["num_proc"]) or None
    block_size = int(options["block_size"])

    def tokenize_function(examples: dict[str, list]) -> dict[str, list]:
        return tokenizer(examples["text"])

    def group_texts(examples: dict[str, list]) -> dict[str, list]:
        # run_clm's: concatenate the batch, drop the remainder below one block, cut into blocks; labels = inputs
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated[next(iter(examples))]) // block_size) * block_size
        result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    grouped = {}
    for split, dataset in raw.items():
        with accelerator.main_process_first():
            tokenized = dataset.map(
                tokenize_function, batched=True, num_proc=num_proc, remove_columns=dataset.column_names
            )
        with accelerator.main_process_first():
            grouped[split] = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    train = grouped["train"]
    loader = torch.utils.data.DataLoader(
        train, shuffle=True, collate_fn=default_data_collator, batch_size=int(options["batch_size"])
    )
    model = AutoModelForCausalLM.from_pretrained(options["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    record_loop_start()
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record_first_step(record_dir, len(train))
    raise SystemExit("data_scale_worker: the standard pipeline made no training block (a corpus under one block?)")


KINDS: dict[str, Callable[[Path, list[str]], int]] = {"hftrain": run_hftrain, "standard": run_standard}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in KINDS or (len(argv) > 2 and argv[2] != "--"):
        raise SystemExit(f"usage: data_scale_worker.py {{{','.join(KINDS)}}} RECORD_DIR [-- ARGS]")
    return KINDS[argv[0]](Path(argv[1]), argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
