"""The reader of live model states per rank: parameters, fp32 masters, gradients, optimizer state and
communication buffers, read from DeepSpeed's and FSDP's own objects (not counted from the model), for every
data-parallel strategy at two points of a step. ``tests/test_sharding.py`` proves it (what each strategy shards);
``tests/test_plan.py``, ``benchmarks/memory.py`` and ``benchmarks/plan_validation.py`` use its figures.
"""

from __future__ import annotations

import collections
import gc
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

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
    output_dir: str | None = None,
) -> Any:
    """An hftrain ``SequenceClassificationTrainer`` for ``strategy`` on tiny synthetic data, gradient accumulation 2."""
    from accelerate.state import AcceleratorState
    from transformers.integrations import unset_hf_deepspeed_config

    from hftrain.cli import launch_info_from_environ
    from hftrain.config import TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import reset_accelerate_state, tiny_splits, tiny_tokenizer

    # Several strategies run one after another in this process; forget all that the previous one left behind:
    # Accelerate's process-level state too (not the process group, which Accelerate and DeepSpeed reuse when it is
    # up; it keeps the previous strategy's distributed type and device, so FSDP after DDP or DeepSpeed fails), and
    # transformers' ZeRO-3 flag (set by a ZeRO-3 run, it makes the next model build inside deepspeed.zero.Init).
    reset_accelerate_state()
    AcceleratorState._reset_state(reset_partial_state=True)
    # one folder per launch (its ranks share the port), apart from a launch running beside it (the suite's workers)
    output_dir = output_dir or f"/tmp/hftrain-sharding-{os.environ.get('MASTER_PORT', os.getpid())}"
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
        strategy=strategy_from_options(strategy, options, launch=launch),
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
