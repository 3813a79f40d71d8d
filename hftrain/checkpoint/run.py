"""A run's identity and the files it owns in its ``output_dir``.

Every run has a run id, written as the top-level ``run_id`` key of ``output_dir/hftrain_config.yaml`` when the
run starts and into every checkpoint's ``checkpoint.json``. ``latest``/``auto`` only take checkpoints of the run
the ``output_dir``'s config names (``CheckpointManager(run_id=...)``): a checkpoint of another run found there is an
error naming it, never a resume. A run resumed from an explicitly named checkpoint continues that checkpoint's run
and keeps its id, so a moved or copied run stays one run.

``overwrite_output_dir`` starting a new run over an earlier one removes the earlier run's outputs (``RUN_OUTPUTS``)
before anything of the new run is written; entries hftrain did not write are left where they are.

The folder is the run's alone (``hftrain.files``): the main process holds ``output_dir/.hftrain.lock`` for the
run's life (:func:`run_folder_lock`), every file is written as a new file renamed over the old one, and an entry
hftrain replaces or deletes that is a link or a special file (a FIFO) is refused in one line before the run writes
anything (:func:`check_run_folder`).
"""

from __future__ import annotations

import os
import re
import stat
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.config import CONFIG_FILENAME, RUN_ID_KEY
from hftrain.errors import ConfigError
from hftrain.files import LOCK_FILENAME, FolderLock, check_own, remove

if TYPE_CHECKING:
    from hftrain.checkpoint.manager import VerifiedCheckpoint

STRATEGY_FILENAME = "hftrain_strategy.json"
TRAINER_STATE_FILENAME = "trainer_state.json"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "model"
TRACKER_DIR = "runs"
TIMELINE_PNG = "pipeline_timeline.png"
TIMELINE_JSON = "pipeline_timeline.json"
CURVES_PNG = "training_curves.png"
RUN_SUMMARY_FILENAME = "run_summary.json"
EXPERT_LOAD_PNG = "expert_load.png"  # trainers.experts.EXPERT_LOAD_PNG (a higher layer: named here again)

# The folders a run writes into its output_dir (the export's ``_merged`` twin, its staging and previous folders)...
RUN_FOLDERS = (
    CHECKPOINTS_DIR,
    EXPORT_DIR,
    f"{EXPORT_DIR}_merged",
    f".staging-{EXPORT_DIR}",
    f".staging-{EXPORT_DIR}_merged",
    f".previous-{EXPORT_DIR}",
    f".previous-{EXPORT_DIR}_merged",
    TRACKER_DIR,
)
# ... and its files (each written as a new file renamed over the old: a link there is replaced, not followed).
RUN_FILES = (
    STRATEGY_FILENAME,
    TRAINER_STATE_FILENAME,
    TIMELINE_PNG,
    TIMELINE_JSON,
    CURVES_PNG,
    EXPERT_LOAD_PNG,
    RUN_SUMMARY_FILENAME,
    CONFIG_FILENAME,
)
RUN_OUTPUTS = RUN_FOLDERS + RUN_FILES
"""What a run writes into its output_dir (the config last: ``remove_run_outputs`` removes it last)."""


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


def latest_of_run(run_dir: Path, command: str) -> VerifiedCheckpoint:
    """The latest complete checkpoint of the run folder ``run_dir`` (one with ``checkpoints/``), for a command that
    reads one: ``hftrain export`` or ``hftrain convert`` given a run folder; opened, its ``checkpoint.json`` read
    once and checked (:meth:`~hftrain.checkpoint.manager.CheckpointManager.open`; checksums not yet verified).

    Args:
        run_dir: the run's ``output_dir``.
        command: the command, for the message (``export``, ``convert``).
    """
    from hftrain.checkpoint.manager import CheckpointError, CheckpointManager

    latest = CheckpointManager(run_dir / CHECKPOINTS_DIR, run_id=saved_run_id(run_dir)).open("auto")
    if latest is None:  # resolve("latest") would say so in training's words (resume_from_checkpoint, 'auto')
        raise CheckpointError(
            f"run folder '{run_dir}' holds no complete checkpoint in {CHECKPOINTS_DIR}/ (the run stopped before its "
            f"first save): nothing to {command}; let the run save one first (every training.save_steps steps, and at "
            "its end), or give another checkpoint"
        )
    return latest


def run_folder_lock(output_dir: Path, *, run_id: str | None = None) -> FolderLock:
    """The lock the main process of a training run holds on ``output_dir`` for the run's life (``hftrain.files``).

    Args:
        output_dir: the run's folder.
        run_id: the run taking it, recorded for the message a second command gets.
    """
    return FolderLock(output_dir / LOCK_FILENAME, "training.output_dir", run_id=run_id, command="train")


def run_outputs(output_dir: Path) -> list[Path]:
    """The entries of an earlier run present in ``output_dir`` (a link or a FIFO among them too).

    Args:
        output_dir: the run's folder.
    """
    return [output_dir / name for name in RUN_OUTPUTS if os.path.lexists(output_dir / name)]


def remove_run_outputs(output_dir: Path) -> list[str]:
    """Remove an earlier run's outputs from ``output_dir`` (the config last); returns their names.

    Every entry is checked before the first is removed: a link or a special file among them is refused in one line
    with the earlier run still whole.

    Args:
        output_dir: the run's folder.
    """
    entries = run_outputs(output_dir)
    for entry in entries:
        check_own(entry, "overwrite_output_dir: the earlier run's output")
    for entry in entries:
        remove(entry, "overwrite_output_dir: the earlier run's output")
    return [entry.name for entry in entries]


def folder_state(output_dir: Path) -> tuple:
    """What a run's plan was decided from (``validate.plan_run``): the config, ``checkpoints/`` and ``model`` of
    ``output_dir``, as inode and modification time. Compared again once the run holds the folder's lock, so that a
    command that wrote into the folder meanwhile (a run started at the same moment, which held the lock first and
    ended) is noticed instead of mixed with.

    Args:
        output_dir: the run's folder.
    """
    state = []
    for name in (CONFIG_FILENAME, CHECKPOINTS_DIR, EXPORT_DIR):
        try:
            status = os.lstat(output_dir / name)
        except (FileNotFoundError, NotADirectoryError):
            state.append(None)
        else:
            state.append((status.st_ino, status.st_mtime_ns, status.st_size))
    return tuple(state)


_STEP_ENTRY = re.compile(r"^(\.staging-)?step_\d+$")


def check_run_folder(output_dir: Path, *, replaces: bool = False) -> None:
    """Refuse, before a run writes anything, an entry of ``output_dir`` that the run would write through, replace
    or delete and cannot: a link or a special file (a FIFO) where it writes or deletes a folder (``model``,
    ``checkpoints``, a checkpoint ``step_<N>``, the tracker's ``runs``), or a folder where it writes a file.

    A link or a FIFO where the run writes a file (``trainer_state.json``) is no obstacle: the write replaces it
    (``files.write_file``), unless the earlier run is removed (``replaces``: every entry is deleted, and a delete
    refuses both).

    Args:
        output_dir: the run's folder.
        replaces: ``overwrite_output_dir`` removes the earlier run's outputs.
    """
    if not os.path.isdir(output_dir):
        return
    for name in RUN_FOLDERS:
        check_own(output_dir / name, f"training.output_dir: {name}", folder=True)
    for name in RUN_FILES:
        if replaces:
            check_own(output_dir / name, f"training.output_dir: {name}", folder=False)
        elif _is_folder(output_dir / name):
            raise ConfigError(
                f"training.output_dir: '{output_dir / name}' is a folder where the run writes a file; remove or "
                "rename it, or choose another output_dir"
            )
    tracker = output_dir / TRACKER_DIR
    if os.path.isdir(tracker) and not replaces:  # TensorBoard writes into runs/hftrain
        check_own(tracker / "hftrain", f"training.output_dir: {TRACKER_DIR}/hftrain", folder=True)
    checkpoints = output_dir / CHECKPOINTS_DIR
    if os.path.isdir(checkpoints) and not replaces:  # the saves replace, rotate and delete step_<N> folders
        for entry in os.scandir(checkpoints):
            if _STEP_ENTRY.match(entry.name):
                check_own(entry.path, "training.output_dir: a checkpoint folder", folder=True)


def _is_folder(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


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
