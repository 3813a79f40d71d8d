"""Each rank really holds 1/N of what its strategy shards: bytes read from the live training objects.

One 2-process gloo launch builds a trainer per strategy (DDP, ZeRO-1/2/3, FSDP1/2) on the same model, takes one
optimizer step (so Adam's state exists), then reads this rank's storage at two points of the next accumulation
window (gradient_accumulation_steps=2):

- ``accumulating``: after the window's first backward, before the boundary (what is kept between micro-batches);
- ``at_step``: after the window's last backward and its gradient reduction, just before the optimizer step.

What is read, by walking the real objects (never the metadata that says what they should be):

- parameters: the model's parameters; DeepSpeed ZeRO-1/2's flat bit16 groups (``bit16_groups_flat``, whose views
  the model's parameters are), ZeRO-3's partitions (``param.ds_tensor``); FSDP1's flat parameters (``_local_shard``,
  ``_full_param_padded``), FSDP2's sharded DTensors and unsharded parameters (``_sharded_param_data``,
  ``_unsharded_param``);
- master weights: the ZeRO optimizer's fp32 partitions (``single_partition_of_fp32_groups`` for stage 1/2,
  ``fp32_partitioned_groups_flat`` for stage 3);
- gradients: ``param.grad`` (and ``grad_accum``), ZeRO-1/2's ``grads_in_partition`` / ``averaged_gradients`` /
  ``all_grad_tensors``, ZeRO-3's ``grad_partitions_flat_buffer``, the fp32 partitions' ``.grad``; FSDP1's
  ``flat_param.grad`` / ``_saved_grad_shard``, FSDP2's ``unsharded_accumulated_grad``;
- optimizer state: the tensors in the (inner) torch optimizer's ``state`` (exp_avg, exp_avg_sq, step);
- communication buffers (not model state, reported apart): DeepSpeed's gradient-reduction buckets.

A tensor's bytes are those of its whole storage, each storage counted once, in the first category above that
reaches it. As a cross-check, every tensor storage reachable from the model and optimizer objects is enumerated;
what no category claims must be small, so a reader that misses a buffer fails.

Found while writing this (DeepSpeed 0.19.8, fp32 on CPU): ZeRO-1/2/3 all keep a separate fp32 master copy of their
partition although the parameters are already fp32 (ZeRO-3 means to reuse the partition, but compares a
``torch.device`` with a string, which is never equal); DeepSpeed's default ``reduce_bucket_size`` (5e8 elements,
2 GB in fp32; hftrain's default config does not set it) is allocated as a gradient-reduction bucket by ZeRO-1
(between micro-batches) and ZeRO-3 (always).

The model is a BERT whose every matrix has >= 1e5 elements and the same size (hidden 320, intermediate 320, 8
layers): DeepSpeed's default ``stage3_param_persistence_threshold`` (1e5 elements, also left by hftrain's default
config) keeps smaller parameters gathered on every rank, and ZeRO-1/2 keep the whole gradient of every parameter
that reaches into a rank's partition (so the one straddling two partitions is held by both); with many equal
matrices both effects stay at 1-2 % of the model.

``benchmarks/memory.py`` uses the same reader for the per-rank memory table against the ZeRO paper's formulas.
"""

from __future__ import annotations

import collections
import gc
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

NPROCS = 2
# label -> (hftrain strategy name, strategy options)
STRATEGIES: dict[str, tuple[str, dict | None]] = {
    "ddp": ("ddp", None),
    "zero1": ("zero1", None),
    "zero2": ("zero2", None),
    "zero3": ("zero3", None),
    "fsdp1": ("fsdp", {"fsdp_version": 1}),
    "fsdp2": ("fsdp", {"fsdp_version": 2}),
}
CATEGORIES = ("params", "master", "grads", "optimizer", "comm_buffers")
TEST_MODEL = {"hidden_size": 320, "intermediate_size": 320, "num_hidden_layers": 8, "vocab_size": 320}


# ---------------------------------------------------------------------------------------------- the reader
def _tensors(obj: Any) -> Iterator[Any]:
    """The tensors in ``obj``: a tensor, None, or nested lists/tuples/dicts (values) of them."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _storage(tensor: Any) -> tuple[int, int]:
    """(address, bytes) of the storage under ``tensor`` (a DTensor's local shard); freed storages have 0 bytes."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def model_state_tensors(trainer: Any) -> dict[str, list]:
    """This rank's tensors by category, read from the prepared model and optimizer of an hftrain ``Trainer``."""
    import torch
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    model = trainer.model
    params = list(model.parameters())
    found: dict[str, list] = {c: [] for c in CATEGORIES}
    found["params"] += params
    found["grads"] += [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
    engine_type = type(model).__name__
    if engine_type == "DeepSpeedEngine":
        zero = model.optimizer
        if model.zero_optimization_stage() == 3:
            found["params"] += [p.ds_tensor for p in params]
            found["master"] += list(zero.fp32_partitioned_groups_flat)
            found["grads"] += [zero.grad_partitions_flat_buffer, zero.averaged_gradients]
            found["grads"] += [t.grad for t in zero.fp32_partitioned_groups_flat]
        else:
            found["params"] += list(zero.bit16_groups_flat)
            found["master"] += list(zero.single_partition_of_fp32_groups)
            found["grads"] += [zero.grads_in_partition, zero.averaged_gradients, zero.all_grad_tensors]
            found["grads"] += [t.grad for t in zero.single_partition_of_fp32_groups]
        for bucket in getattr(zero, "ipg_buckets", {}).values():
            found["comm_buffers"].append(bucket.buffer)
        optimizer_state = zero.optimizer.state
    else:
        optimizer_state = trainer.optimizer.optimizer.state
        if isinstance(model, FullyShardedDataParallel):
            for unit in FullyShardedDataParallel.fsdp_modules(model):
                flat = unit._handle.flat_param if unit._handle is not None else None
                if flat is None:
                    continue
                found["params"] += [flat] + [getattr(flat, a, None) for a in ("_local_shard", "_full_param_padded")]
                found["grads"] += [flat.grad] + [getattr(flat, a, None) for a in ("_saved_grad_shard", "_cpu_grad")]
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        unsharded = getattr(fsdp_param, "_unsharded_param", None)
                        found["params"] += [fsdp_param._sharded_param_data, unsharded]
                        found["grads"] += [fsdp_param.unsharded_accumulated_grad]
                        found["grads"] += [unsharded.grad if unsharded is not None else None]
    found["optimizer"] += [v for s in optimizer_state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return found


def reachable_storages(roots: Iterable[Any]) -> dict[int, int]:
    """Every tensor storage reachable from ``roots`` through attributes, containers and tensor attributes.

    Only objects of torch/deepspeed/accelerate/transformers/hftrain types are entered (not data sets, loggers...).
    """
    import torch

    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [(root, 0) for root in roots]
    while stack:
        obj, depth = stack.pop()
        if depth > 16 or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            try:
                address, size = _storage(obj)
            except (RuntimeError, NotImplementedError):  # meta or otherwise storage-less tensors
                address, size = 0, 0
            if address:
                storages[address] = size
            children = [obj.grad if obj.is_leaf else None] + list(getattr(obj, "__dict__", {}).values())
        elif isinstance(obj, dict):
            children = list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            children = list(obj)
        elif (type(obj).__module__ or "").startswith(("torch", "deepspeed", "accelerate", "transformers", "hftrain")):
            children = list(getattr(obj, "__dict__", {}).values())
            if isinstance(obj, torch.nn.Module):
                children += list(obj._parameters.values()) + list(obj._buffers.values()) + list(obj._modules.values())
        else:
            continue
        stack.extend((child, depth + 1) for child in children if child is not None)
    return storages


def measure(trainer: Any) -> dict[str, int]:
    """Bytes this rank holds per category (each storage once, first category wins), plus unclassified bytes."""
    found = model_state_tensors(trainer)
    counted: set[int] = set()
    result = {}
    for category in CATEGORIES:
        total = 0
        for tensor in _tensors(found[category]):
            address, size = _storage(tensor)
            if address and address not in counted:
                counted.add(address)
                total += size
        result[category] = total
    roots = [trainer.model, trainer.optimizer, getattr(trainer.model, "optimizer", None)]
    result["unclassified"] = sum(
        size for a, size in reachable_storages(r for r in roots if r is not None).items() if a not in counted
    )
    return result


# ---------------------------------------------------------------------------------------------- the runs
def bert_model_init(**config: Any):
    """A ``model_init`` building a randomly initialised BERT classifier (``config`` overrides BertConfig)."""

    def build():
        from transformers import AutoModelForSequenceClassification, BertConfig

        settings = {"num_attention_heads": 4, "max_position_embeddings": 64, "num_labels": 2, **config}
        return AutoModelForSequenceClassification.from_config(BertConfig(**settings))

    return build


def model_init_for(model: dict[str, Any] | str):
    """A ``model_init`` for ``model``: BertConfig overrides (a dict), or a saved model folder / ``embedded:<name>``."""
    if isinstance(model, dict):
        return bert_model_init(**model)

    def build():
        from transformers import AutoModelForSequenceClassification

        from hftrain.models import resolve_model_path

        loaded = AutoModelForSequenceClassification.from_pretrained(resolve_model_path(model), num_labels=2)
        if loaded.config.pad_token_id is None:  # GPT-style models pool the last non-pad token
            loaded.config.pad_token_id = 0
        return loaded

    return build


def build_trainer(
    strategy: str,
    options: dict | None,
    model_init: Any,
    *,
    micro: int = 4,
    mixed_precision: str = "no",
    output_dir: str = "/tmp/hftrain-sharding",
) -> Any:
    """An hftrain ``SequenceClassificationTrainer`` for ``strategy`` on tiny synthetic data, gradient accumulation 2."""
    from accelerate.state import AcceleratorState
    from transformers.integrations import unset_hf_deepspeed_config

    from hftrain.cli import launch_info_from_environ
    from hftrain.config import StrategyConfig, TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import build_strategy
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import reset_accelerate_state, tiny_splits, tiny_tokenizer

    # Several strategies run one after another in this process; forget all that the previous one left behind:
    # Accelerate's process-level state too (not the process group, which Accelerate and DeepSpeed reuse when it is
    # up; it keeps the previous strategy's distributed type and device, so FSDP after DDP or DeepSpeed fails), and
    # transformers' ZeRO-3 flag (set by a ZeRO-3 run, it makes the next model build inside deepspeed.zero.Init).
    reset_accelerate_state()
    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    tokenizer = tiny_tokenizer()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    train = tokenize_splits(tiny_splits(n_train=4 * micro * world, n_eval=1), tokenizer, max_seq_length=32)["train"]
    args = TrainingConfig(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=1e-3,
        warmup_steps=0,
        log_with="none",
        mixed_precision=mixed_precision,
    )
    launch = launch_info_from_environ()
    return SequenceClassificationTrainer(
        args,
        strategy=build_strategy(StrategyConfig(name=strategy, **(options or {})), launch=launch),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=train,
    )


def measure_training(trainer: Any, phase: list[str] | None = None) -> dict[str, Any]:
    """One optimizer step through ``train_step``, then this rank's bytes inside the next accumulation window.

    Args:
        trainer: a trainer from ``build_trainer``.
        phase: appended "train" / "measure" as it goes, so that a caller can tell hftrain's failures from the reader's.
    """
    phase = [] if phase is None else phase
    acc, model = trainer.accelerator, trainer.model
    deepspeed = type(model).__name__ == "DeepSpeedEngine"
    batches = iter(trainer.train_loader)
    phase.append("train")
    trainer.train_step(next(batches))
    trainer.train_step(next(batches))  # closes the first window: the optimizer has stepped, Adam state exists
    with acc.accumulate(model):
        acc.backward(trainer.compute_loss(model, next(batches)))
        phase.append("measure")
        assert not acc.sync_gradients
        accumulating = measure(trainer)
    with acc.accumulate(model):
        assert acc.sync_gradients
        phase.append("train")
        loss = trainer.compute_loss(model, next(batches))
        if deepspeed:  # Accelerate's backward would also run engine.step(), which frees the gradients
            model.set_gradient_accumulation_boundary(is_boundary=True)
            model.backward(loss)
            phase.append("measure")
            at_step = measure(trainer)
            phase.append("train")
            model.step()
        else:
            acc.backward(loss)
            phase.append("measure")
            at_step = measure(trainer)
            phase.append("train")
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
    return {
        "accumulating": accumulating,
        "at_step": at_step,
        "distributed_type": acc.distributed_type.name,
        "model_type": type(model).__name__,
    }


def measure_strategies(
    labels: list[str], model: dict[str, Any] | str, micro: int = 4, mixed_precision: str = "no"
) -> dict:
    """In each rank: every strategy's measurements (or the error that stopped it), and Ψ of the model.

    Args:
        labels: keys of ``STRATEGIES``, run one after another in this process group.
        model: see ``model_init_for``.
        micro: micro-batch size per process.
        mixed_precision: ``"no"`` or ``"bf16"``.
    """
    import torch

    model_init = model_init_for(model)
    runs: dict[str, Any] = {"psi": sum(p.numel() for p in model_init().parameters())}
    for label in labels:
        strategy, options = STRATEGIES[label]
        start, phase = time.perf_counter(), ["build"]
        try:
            trainer = build_trainer(strategy, options, model_init, micro=micro, mixed_precision=mixed_precision)
            runs[label] = measure_training(trainer, phase)
        except Exception as error:  # reported per strategy, with where it happened
            runs[label] = {"error": f"{type(error).__name__}: {str(error).strip()[:300]}", "phase": phase[-1]}
        trainer = None
        gc.collect()
        runs[label]["seconds"] = time.perf_counter() - start
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    return runs


# ---------------------------------------------------------------------------------------------- the tests
# label -> what it shards; gradients apart: (kept between micro-batches, held at the optimizer step)
SHARDS = {
    "ddp": {"params": False, "optimizer": False, "grads": (False, False)},
    # ZeRO-1 keeps the whole local gradients until the boundary; there DeepSpeed reduces them into this rank's
    # partition and frees the rest before the step.
    "zero1": {"params": False, "optimizer": True, "grads": (False, True)},
    "zero2": {"params": False, "optimizer": True, "grads": (True, True)},
    "zero3": {"params": True, "optimizer": True, "grads": (True, True)},
    # Accelerate accumulates under FSDP's no_sync: unsharded gradients between micro-batches, sharded at the step.
    "fsdp1": {"params": True, "optimizer": True, "grads": (False, True)},
    "fsdp2": {"params": True, "optimizer": True, "grads": (False, True)},
}
SHARD_TOLERANCE = 0.03  # |per-rank fraction - 1/N| for a sharded state
SUM_TOLERANCE = 0.05  # the ranks' fractions of a sharded state add up to 1 within this
FULL_TOLERANCE = 0.03  # |per-rank fraction - 1| for a replicated state


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(measure_strategies, nprocs=NPROCS, timeout=300, labels=list(STRATEGIES), model=TEST_MODEL)


def _skip_or_fail(runs: list[dict], label: str) -> None:
    """Skip an FSDP case whose construction or training failed (hftrain's fsdp strategy is being written); fail
    on any other error, and on any error of the reader."""
    failed = [r[label] for r in runs if "error" in r[label]]
    if not failed:
        return
    error, phase = failed[0]["error"], failed[0]["phase"]
    if label.startswith("fsdp") and phase in ("build", "train"):
        pytest.skip(f"hftrain's fsdp strategy does not {phase} here: {error}")
    pytest.fail(f"{label} failed to {phase}: {error}")


def _full_bytes(psi: int) -> dict[str, int]:
    """What one rank holds without sharding, in fp32 with AdamW: 4Ψ params, 4Ψ grads, 8Ψ exp_avg + exp_avg_sq."""
    return {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi, "master": 4 * psi}


def _check(fractions: list[float], sharded: bool, what: str) -> None:
    shown = ", ".join(f"{f:.3f}" for f in fractions)
    if sharded:
        assert all(abs(f - 1 / NPROCS) <= SHARD_TOLERANCE for f in fractions), f"{what}: per-rank fractions {shown}"
        assert abs(sum(fractions) - 1) <= SUM_TOLERANCE, f"{what}: fractions {shown} do not add up to the full size"
    else:
        assert all(abs(f - 1) <= FULL_TOLERANCE for f in fractions), f"{what}: per-rank fractions {shown}, not full"


def _fractions(runs: list[dict], label: str, point: str, category: str) -> list[float]:
    full = _full_bytes(runs[0]["psi"])[category]
    return [r[label][point][category] / full for r in runs]


def test_every_strategy_ran_distributed(runs):
    expected = {
        "ddp": "MULTI_CPU",
        "zero1": "DEEPSPEED",
        "zero2": "DEEPSPEED",
        "zero3": "DEEPSPEED",
        "fsdp1": "FSDP",
        "fsdp2": "FSDP",
    }
    for label, distributed_type in expected.items():
        if label.startswith("fsdp") and any("error" in r[label] for r in runs):
            continue  # reported by its own tests
        _skip_or_fail(runs, label)
        assert [r[label]["distributed_type"] for r in runs] == [distributed_type] * NPROCS, label
    print({label: round(runs[0][label]["seconds"], 1) for label in STRATEGIES})


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_parameters_and_optimizer_state(runs, label):
    _skip_or_fail(runs, label)
    for category in ("params", "optimizer"):
        for point in ("accumulating", "at_step"):
            fractions = _fractions(runs, label, point, category)
            print(f"{label} {category} ({point}): {[round(f, 3) for f in fractions]}")
            _check(fractions, SHARDS[label][category], f"{label} {category} ({point})")


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_gradients(runs, label):
    _skip_or_fail(runs, label)
    for point, sharded in zip(("accumulating", "at_step"), SHARDS[label]["grads"], strict=False):
        fractions = _fractions(runs, label, point, "grads")
        print(f"{label} grads ({point}): {[round(f, 3) for f in fractions]}")
        _check(fractions, sharded, f"{label} grads ({point})")


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_master_weights(runs, label):
    """ZeRO keeps an fp32 master copy of its partition even when training in fp32; DDP and FSDP keep none."""
    _skip_or_fail(runs, label)
    fractions = _fractions(runs, label, "accumulating", "master")
    if label.startswith("zero"):
        _check(fractions, True, f"{label} master")
    else:
        assert fractions == [0.0] * NPROCS, f"{label}: unexpected separate master weights {fractions}"


def test_sharding_halves_the_per_rank_model_states(runs):
    """ZeRO-1 optimizer state, ZeRO-2 also gradients, ZeRO-3 also parameters: each about half of DDP's."""
    _skip_or_fail(runs, "ddp")
    ran = [label for label in STRATEGIES if not any("error" in r[label] for r in runs)]
    for rank in runs:
        ddp = rank["ddp"]["accumulating"]
        for label in ran:
            mine = rank[label]["accumulating"]
            for category in ("params", "optimizer"):
                ratio = mine[category] / ddp[category]
                expected = 1 / NPROCS if SHARDS[label][category] else 1.0
                assert ratio == pytest.approx(expected, abs=SHARD_TOLERANCE), (label, category, ratio)
            ratio = mine["grads"] / ddp["grads"]
            expected = 1 / NPROCS if SHARDS[label]["grads"][0] else 1.0
            assert ratio == pytest.approx(expected, abs=SHARD_TOLERANCE), (label, "grads", ratio)


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_the_reader_misses_no_large_buffer(runs, label):
    """Storages reachable from the model and optimizer that no category claims stay small (position ids, norms)."""
    _skip_or_fail(runs, label)
    full = 4 * runs[0]["psi"]
    for rank in runs:
        for point in ("accumulating", "at_step"):
            assert rank[label][point]["unclassified"] < 0.02 * full, (point, rank[label][point]["unclassified"])
