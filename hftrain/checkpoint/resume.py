"""What a checkpoint must match to be resumed, and where in the data a resumed run continues."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hftrain.checkpoint.reading import check_regular_tree
from hftrain.errors import CheckpointError

# Config keys that define the model and task: a checkpoint of another model or task cannot be resumed.
IDENTITY_KEYS = (
    "model.model_name_or_path",
    "model.num_labels",
    "lora.use_lora",
    "lora.lora_r",
    "lora.lora_target_modules",
)
# Topology keys that together say how a checkpoint's state is laid out over processes.
LAYOUT_KEYS = ("world_size", "tp", "pp")


def check_resumable(
    meta: dict[str, Any],
    *,
    path: Path,
    run_config: dict[str, Any],
    topology: dict[str, Any],
    strategies: tuple[str, ...] = (),
) -> list[str]:
    """Refuse a checkpoint of another model or task, a damaged layout record, or a change of the global batch.

    The checkpoint is in the sharded format (``hftrain.checkpoint.sharded``; ``check_sharded`` refused the older
    ones): it loads under any strategy and process count, which a note then names.

    Args:
        meta: the checkpoint's metadata.
        path: the checkpoint folder, for messages.
        run_config: this run's flat config.
        topology: this run's strategy summary (strategy, world size, batch geometry).
        strategies: the strategy names this hftrain knows (a checkpoint naming another is damaged).

    Returns notes to log about accepted differences.
    """
    saved_config, saved = meta.get("config", {}), meta.get("topology", {})
    if strategies and saved.get("strategy") not in strategies:
        raise CheckpointError(
            f"checkpoint '{path}': checkpoint.json's topology.strategy {saved.get('strategy')!r} is not a strategy "
            f"({', '.join(strategies)}); it is damaged: resume from another checkpoint"
        )
    from hftrain.checkpoint.manager import STATE_DIR
    from hftrain.checkpoint.sharded import check_info

    check_info(path / STATE_DIR, saved)
    for key in IDENTITY_KEYS:
        if key in run_config and saved_config.get(key) != run_config[key]:
            raise CheckpointError(
                f"checkpoint '{path}' is of a different model or task ({key}: {saved_config.get(key)!r} there, "
                f"{run_config[key]!r} here); resume it with its own config or start fresh"
            )
    # The layout: process count and, for model-parallel strategies, how the processes split the model.
    same_layout = saved.get("strategy") == topology["strategy"] and all(
        saved.get(key) == topology.get(key) for key in LAYOUT_KEYS
    )
    # The global batch defines the run (its steps, its schedule); how it is split may change.
    if saved.get("global_batch") != topology["global_batch"]:
        raise CheckpointError(
            f"resuming '{path}' ({_layout(saved)}) on {_layout(topology)} would change the global batch from "
            f"{saved.get('global_batch')} to {topology['global_batch']}; set training.per_device_train_batch_size "
            "and gradient_accumulation_steps so that micro x accumulation x data-parallel size stays the same"
        )
    notes = [
        f"checkpoint trained with {key} {saved[key]}; this run continues with {topology[key]} (the config or 'auto' "
        "on this machine decides; set it to keep the checkpoint's)"
        for key in ("mixed_precision", "optim", "dropout_kernel")
        if key in saved and saved[key] != topology.get(key)
    ]
    if same_layout:
        return notes
    return [
        f"resharding checkpoint from {_layout(saved)} to {_layout(topology)}; "
        f"global batch kept at {topology['global_batch']}",
        *notes,
    ]


def _layout(topology: dict[str, Any]) -> str:
    """``ddp on 4 processes`` or, under tensor/pipeline parallelism, ``megatron on 4 processes (tp=2 × pp=1 ×
    dp=2)``."""
    processes = f"{topology.get('strategy')} on {topology.get('world_size')} processes"
    if "tp" not in topology:
        return processes
    return f"{processes} (tp={topology['tp']} × pp={topology.get('pp', 1)} × dp={topology.get('dp_size')})"


def check_position(
    meta: dict[str, Any], *, path: Path, skip: int, micro_batches: int, accumulation: int, max_steps: int
) -> None:
    """Refuse a trainer state that is not a position of this run: a step beyond ``max_steps``, a data position
    beyond the epoch, or an epoch, step and data position that do not fit together.

    A run at epoch ``e``, ``m`` micro-batches into it, has taken ``e · ⌈M / a⌉ + ⌈m / a⌉`` optimizer steps (``M``
    micro-batches per epoch, ``a`` of them per step; an epoch's last window may be short). An edited counter would
    otherwise resume silently: no training at a huge step (and a folder ``step_1000000000000000000``), or the
    weights of step 4 retrained from step 1 over the later checkpoints.

    Args:
        meta: the checkpoint's metadata.
        path: the checkpoint folder, for messages.
        skip: micro-batches of the current epoch already consumed, in this run's topology (:func:`batches_to_skip`).
        micro_batches: micro-batches per epoch on each process of this run.
        accumulation: micro-batches per optimizer step.
        max_steps: this run's last step.
    """
    state = meta["trainer_state"]
    step, epoch = state["global_step"], state["epoch"]
    if step > max_steps:
        raise CheckpointError(
            f"checkpoint '{path}' is at step {step}, beyond this run's {max_steps} steps; set training.max_steps to "
            f"at least {step} to continue it, or export it (hftrain export)"
        )
    if skip > micro_batches:
        raise CheckpointError(
            f"checkpoint '{path}': trainer_state.micro_step {state['micro_step']} lies beyond the end of an epoch "
            f"({micro_batches} micro-batches per process here); it is damaged or of other data: resume from another "
            "checkpoint"
        )
    per_epoch = -(-micro_batches // accumulation)
    expected = epoch * per_epoch + -(-skip // accumulation)
    if expected != step or state.get("last_eval_step", -1) > step:
        raise CheckpointError(
            f"checkpoint '{path}': trainer_state (step {step}, epoch {epoch}, {skip} micro-batches into it) is not a "
            f"position of this run, which reaches that point of the data at step {expected} ({per_epoch} steps per "
            "epoch); it is damaged, or of other data: resume from another checkpoint, or with its training data"
        )


def check_stream_position(meta: dict[str, Any], *, path: Path, topology: dict[str, Any], max_steps: int) -> None:
    """Refuse to resume a stream (``data.streaming``) from a checkpoint of another data-parallel size, or beyond
    ``max_steps``: each data-parallel rank saved the position of its own share of the stream, which another size would
    deal anew (documents skipped or read twice).

    Args:
        meta: the checkpoint's metadata.
        path: the checkpoint folder, for messages.
        topology: this run's strategy summary.
        max_steps: this run's last step.
    """
    saved, step = meta["topology"], meta["trainer_state"]["global_step"]
    if step > max_steps:
        raise CheckpointError(
            f"checkpoint '{path}' is at step {step}, beyond this run's {max_steps} steps; set training.max_steps to "
            f"at least {step} to continue it, or export it (hftrain export)"
        )
    dp = saved.get("dp_size", saved.get("world_size"))
    if dp != topology["dp_size"]:
        raise CheckpointError(
            f"checkpoint '{path}' streams its training data over {dp} data-parallel processes, this run over "
            f"{topology['dp_size']}: each saved the position of its own share of the stream; resume on {dp} "
            "data-parallel processes, or start fresh"
        )


def batches_to_skip(meta: dict[str, Any], topology: dict[str, Any]) -> int:
    """Micro-batches of the current epoch this process already consumed, in this run's topology."""
    saved = meta["topology"]
    # Data-parallel replicas consume different batches; tensor-parallel ranks of one replica share them.
    consumed = meta["trainer_state"]["micro_step"] * saved["micro_batch"] * saved.get("dp_size", saved["world_size"])
    per_batch = topology["micro_batch"] * topology["dp_size"]
    if consumed % per_batch:
        raise CheckpointError(
            f"the checkpoint's data position ({consumed} examples into the epoch) is not a whole number of "
            f"micro-batches of {per_batch}; resume with the original per_device_train_batch_size"
        )
    return consumed // per_batch


def check_trusted(path: Path, output_dir: Path, *, trusted: bool, export: bool = False) -> None:
    """Refuse a checkpoint from outside the run folder the command names, unless the user allows it.

    Args:
        path: the checkpoint folder.
        output_dir: the run folder the user's command names (never one read from the checkpoint itself).
        trusted: the user allowed external checkpoints.
        export: the command is ``hftrain export`` (the fix names its flags).
    """
    from hftrain.checkpoint.manager import STATE_DIR
    from hftrain.checkpoint.safety import pickled_files

    if path.is_dir():
        check_regular_tree(path)  # a link is refused, trusted or not; and the list of pickles below is then whole
    if trusted or path.resolve().is_relative_to(output_dir.resolve()):
        return
    state = path / STATE_DIR
    names = [str(p.relative_to(state)) for p in pickled_files(state)] if state.is_dir() else []
    fix = (
        "name the run it belongs to with --output_dir RUN, or pass --trust_external_checkpoint if you trust it"
        if export
        else "set trust_external_checkpoint: true if you trust it"
    )
    where = "the run folder this command names" if export else f"output_dir '{output_dir}'"
    raise CheckpointError(
        f"checkpoint '{path}' is outside {where}; its {', '.join(names[:6]) or 'state files'} are pickles, "
        f"unpickled on load (by a restricted unpickler that builds only tensors and plain data); {fix}"
    )
