"""Atomic, rotating, verified checkpoints through ``accelerator.save_state`` / ``load_state``.

Layout of ``output_dir/checkpoints``::

    step_00000040/
        state/            what accelerator.save_state wrote: model, optimizer, scheduler, per-rank RNG
                          (DeepSpeed and FSDP write their own sharded layouts here)
        checkpoint.json   written last: format version, trainer state, topology, config, file checksums
    .staging-step_00000050/   a checkpoint being written; never resolved, removed by the next save

A checkpoint becomes visible only by the rename of its finished staging folder, and it counts only if its
``checkpoint.json`` is present and every file matches its recorded SHA-256. ``latest`` is the complete
checkpoint with the highest step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import HFTrainError

if TYPE_CHECKING:
    from accelerate import Accelerator

FORMAT_VERSION = 1
MARKER = "checkpoint.json"
STATE_DIR = "state"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(HFTrainError):
    """A checkpoint is missing, incomplete, corrupted or incompatible with this run."""


class CheckpointManager:
    """Writes, rotates, finds and verifies the checkpoints of one run.

    Args:
        root: the run's ``output_dir/checkpoints``.
        keep: how many complete checkpoints to keep (None keeps all).
    """

    def __init__(self, root: str | Path, *, keep: int | None = None) -> None:
        self.root = Path(root)
        self.keep = keep

    # ----------------------------------------------------------------- writing (collective)
    def save(self, accelerator: Accelerator, *, step: int, meta: dict[str, Any]) -> Path:
        """Write a checkpoint of ``step``; every rank must call this (the save is collective, pitfall #9).

        Args:
            accelerator: the run's accelerator (its registered objects are saved too).
            step: the optimizer step.
            meta: trainer state, topology and config to store in ``checkpoint.json``.
        """
        final = self.root / f"step_{step:08d}"
        staging = self.root / f".staging-{final.name}"
        if accelerator.is_main_process:
            self._clear_staging()
            staging.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(staging / STATE_DIR), safe_serialization=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            files = {str(p.relative_to(staging)): _sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()}
            _write_json_durably(
                staging / MARKER, {"format_version": FORMAT_VERSION, "step": step, **meta, "files": files}
            )
            if final.exists():  # a re-save of the same step (e.g. preempted right after a periodic save)
                shutil.rmtree(final)
            os.replace(staging, final)
            _fsync_dir(self.root)
            self._rotate()
        accelerator.wait_for_everyone()
        return final

    def _clear_staging(self) -> None:
        if self.root.is_dir():
            for stale in self.root.glob(".staging-*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _rotate(self) -> None:
        if self.keep is None:
            return
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old)

    # ----------------------------------------------------------------- finding and verifying
    def complete(self) -> list[Path]:
        """Checkpoint folders with a marker, oldest first (checksums are checked on load, not here)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found) if (p / MARKER).is_file()]

    def resolve(self, spec: str) -> Path | None:
        """The checkpoint ``spec`` names: ``latest``, ``auto`` (None when there is none yet) or a folder."""
        if spec in ("latest", "auto"):
            found = self.complete()
            if found:
                return found[-1]
            if spec == "auto":
                return None
            raise CheckpointError(
                f"training.resume_from_checkpoint is 'latest' but {self.root} holds no complete checkpoint; "
                "use 'auto' to start fresh when there is none"
            )
        return Path(spec)


def read_checkpoint(path: str | Path, *, verify_files: bool = True) -> dict[str, Any]:
    """The metadata of a complete checkpoint, after checking its marker, version and file checksums.

    Args:
        path: a ``step_<N>`` folder.
        verify_files: recompute every file's SHA-256 (the main process does; others trust it after a barrier).
    """
    path = Path(path)
    marker = path / MARKER
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint '{path}' does not exist; give a step_<N> folder under output_dir/checkpoints"
        )
    if not marker.is_file():
        raise CheckpointError(
            f"'{path}' is not a complete hftrain checkpoint (no {MARKER}); it may be a partial write: "
            "resume from 'latest' or another step_<N> folder"
        )
    try:
        meta = json.loads(marker.read_text())
    except ValueError:
        raise CheckpointError(f"checkpoint '{path}': {MARKER} is corrupted; resume from another checkpoint") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {meta.get('format_version')}, this hftrain reads {FORMAT_VERSION}"
        )
    if verify_files:
        _verify_files(path, meta["files"])
    return meta


def _verify_files(path: Path, files: dict[str, str]) -> None:
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint '{path}' is incomplete: {name} is missing; resume from another checkpoint"
            )
        if _sha256(file) != digest:
            raise CheckpointError(
                f"checkpoint '{path}' is corrupted: {name} does not match its checksum (truncated or modified); "
                "resume from another checkpoint"
            )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    with path.open("w") as handle:
        json.dump(data, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
