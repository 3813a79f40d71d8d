"""A run's identity and the files it owns in its ``output_dir``.

Every run has a run id, written as the top-level ``run_id`` key of ``output_dir/hftrain_config.yaml`` when the
run starts and into every checkpoint's ``checkpoint.json``. ``latest``/``auto`` only take checkpoints of the run
the ``output_dir``'s config names (``CheckpointManager(run_id=...)``): a checkpoint of another run found there is an
error naming it, never a resume. A run resumed from an explicitly named checkpoint continues that checkpoint's run
and keeps its id, so a moved or copied run stays one run.

``overwrite_output_dir`` starting a new run over an earlier one removes the earlier run's outputs (``RUN_OUTPUTS``)
before anything of the new run is written; entries hftrain did not write are left where they are.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from hftrain.config import CONFIG_FILENAME, RUN_ID_KEY
from hftrain.errors import ConfigError

STRATEGY_FILENAME = "hftrain_strategy.json"
TRAINER_STATE_FILENAME = "trainer_state.json"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "model"
TRACKER_DIR = "runs"
TIMELINE_PNG = "pipeline_timeline.png"
TIMELINE_JSON = "pipeline_timeline.json"
CURVES_PNG = "training_curves.png"
RUN_SUMMARY_FILENAME = "run_summary.json"

# What a run writes into its output_dir (the export's ``_merged`` twin and staging folders included).
RUN_OUTPUTS = (
    CHECKPOINTS_DIR,
    EXPORT_DIR,
    f"{EXPORT_DIR}_merged",
    f".staging-{EXPORT_DIR}",
    f".staging-{EXPORT_DIR}_merged",
    TRACKER_DIR,
    STRATEGY_FILENAME,
    TRAINER_STATE_FILENAME,
    TIMELINE_PNG,
    TIMELINE_JSON,
    CURVES_PNG,
    RUN_SUMMARY_FILENAME,
    CONFIG_FILENAME,
)


def new_run_id() -> str:
    """A fresh run id (random, 12 hex digits)."""
    return uuid.uuid4().hex[:12]


def saved_run_id(output_dir: Path) -> str | None:
    """The run id in ``output_dir``'s config, or None (no config, or one written before run ids existed).

    Args:
        output_dir: the run's folder.
    """
    import yaml

    path = output_dir / CONFIG_FILENAME
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None  # the config check reports a damaged config, naming the fix
    value = raw.get(RUN_ID_KEY) if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def latest_of_run(run_dir: Path, command: str) -> Path:
    """The latest complete checkpoint of the run folder ``run_dir`` (one with ``checkpoints/``), for a command that
    reads one: ``hftrain export`` or ``hftrain convert`` given a run folder.

    Args:
        run_dir: the run's ``output_dir``.
        command: the command, for the message (``export``, ``convert``).
    """
    from hftrain.checkpoint.manager import CheckpointError, CheckpointManager

    latest = CheckpointManager(run_dir / CHECKPOINTS_DIR, run_id=saved_run_id(run_dir)).resolve("auto")
    if latest is None:  # resolve("latest") would say so in training's words (resume_from_checkpoint, 'auto')
        raise CheckpointError(
            f"run folder '{run_dir}' holds no complete checkpoint in {CHECKPOINTS_DIR}/ (the run stopped before its "
            f"first save): nothing to {command}; let the run save one first (every training.save_steps steps, and at "
            "its end), or give another checkpoint"
        )
    return latest


def run_outputs(output_dir: Path) -> list[Path]:
    """The entries of an earlier run present in ``output_dir``.

    Args:
        output_dir: the run's folder.
    """
    return [output_dir / name for name in RUN_OUTPUTS if (output_dir / name).exists()]


def remove_run_outputs(output_dir: Path) -> list[str]:
    """Remove an earlier run's outputs from ``output_dir`` (the config last); returns their names.

    Args:
        output_dir: the run's folder.
    """
    removed = []
    for entry in run_outputs(output_dir):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed


def check_writable_dir(path: Path, field: str) -> None:
    """Refuse a target folder that is a file, lies under a file, or cannot be created or written.

    Args:
        path: the folder a command will create or write into.
        field: the config field or argument that named it, for the message.
    """
    if path.is_file():
        raise ConfigError(f"{field} '{path}' is a file; choose a directory path")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{field} '{path}': '{existing}' is a file, not a directory; choose another path")
    # access() also reports a read-only file system (EROFS) to root, for whom permissions are no obstacle.
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{field} '{path}' is not writable ('{existing}' is read-only or not yours); choose a writable location"
        )


def check_outside_source(target: Path, source: Path, field: str) -> None:
    """Refuse a folder a command writes that lies inside the checkpoint, run folder or DeepSpeed folder it reads, or
    inside the ``checkpoints/`` folder holding that checkpoint.

    A checkpoint is only ever read: a model written into its ``state/`` changes what its checksums cover, one in the
    run folder becomes part of that run, and one in ``checkpoints/`` takes the names (``step_<N>``, ``.staging-*``)
    that the run's own saves write, rotate and replace.

    Args:
        target: the folder the command writes.
        source: what it reads, as the user gave it (a missing one is refused by the reader).
        field: the argument naming ``target``, for the message.
    """
    if not source.exists():
        return
    source = source.resolve()
    holders = [source, source.parent] if source.parent.name == CHECKPOINTS_DIR else [source]
    resolved = target.resolve()
    for holder in holders:
        if resolved.is_relative_to(holder):
            raise ConfigError(
                f"{field} '{target}' lies inside '{holder}', which holds the checkpoint it reads (a checkpoint is "
                "only read, never written into); give a folder outside it"
            )
