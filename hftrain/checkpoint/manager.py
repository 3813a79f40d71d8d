"""Atomic, rotating, verified checkpoints, written in the background or not.

Layout of ``output_dir/checkpoints``::

    step_00000040/
        state/            model and optimizer in the sharded format (``hftrain.checkpoint.sharded``: every rank
                          writes its own shards), scheduler, sampler and per-rank RNG through accelerate.save_state
                          (checkpoints of earlier versions: the libraries' own layouts, still loaded)
        checkpoint.json   written last: format version, trainer state, topology, config, file checksums
    .staging-step_00000050/   a checkpoint being written; never resolved, removed by the next save

A checkpoint becomes visible only by the rename of its finished staging folder, and it counts only if its
``checkpoint.json`` is present and every file matches its recorded checksum (XXH3-128; SHA-256 before 2026-11-24).
``latest`` is the complete checkpoint with the highest step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.checkpoint.reading import activated, check_regular_tree, open_regular
from hftrain.errors import CheckpointError, HFTrainError, WriteError, write_error
from hftrain.files import (
    check_own,
    fsync_dir,
    make_folder,
    read_regular,
    remove,
    remove_quietly,
    remove_unless_read,
    write_file,
    write_json,
)

if TYPE_CHECKING:
    from accelerate import Accelerator

FORMAT_VERSION = 1
MARKER = "checkpoint.json"
STATE_DIR = "state"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rank_state_file(state_dir: Path, rank: int | None = None) -> Path:
    """Where a rank's own state goes in a checkpoint's ``state/`` (``rank_state_<global rank>.json``).

    Args:
        state_dir: the checkpoint's ``state/`` folder.
        rank: the global rank (None: this process's).
    """
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    return state_dir / f"rank_state_{rank}.json"


class CheckpointManager:
    """Writes, rotates, finds and verifies the checkpoints of one run.

    Args:
        root: the run's ``output_dir/checkpoints``.
        keep: how many complete checkpoints to keep (None keeps all).
        run_id: the run these checkpoints belong to (``hftrain.checkpoint.run``): ``latest``/``auto`` refuse a
            checkpoint of another run found in ``root``. None (a run from before run ids) checks nothing.
        write_threads: each rank's DCP writer threads (one file each); None: by the state's size, up to
            ``min(4, CPUs)`` beside GPUs, 1 on a CPU-only host (``checkpoint.sharded.write_threads``).
    """

    def __init__(
        self, root: str | Path, *, keep: int | None = None, run_id: str | None = None, write_threads: int | None = None
    ) -> None:
        self.root = Path(root)
        self.write_threads = write_threads
        self.keep = keep
        self.run_id = run_id
        self._markers: dict[Path, bytes] = {}  # markers :meth:`_check_run` read, parsed again by :meth:`open`
        self._pending: _Pending | None = None
        self._group: Any = None
        self.staged_saves = 0  # background saves that staged a copy (the last one of a run writes the live states)

    # ----------------------------------------------------------------- writing (collective)
    def save(
        self,
        runtime: Any,
        *,
        step: int,
        meta: dict[str, Any],
        background: bool = False,
        live: bool = False,
        rank_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write a checkpoint of ``step``; every rank must call this.

        The save is collective (pitfall "save on rank 0 only hangs", docs/pitfalls.md). In the background, the
        call returns once this rank's state is copied to CPU memory; a thread writes the shards, and the main
        process publishes the checkpoint when every rank's shards are on disk. At most one save is in flight: the
        next save, :meth:`wait` and the end of the run wait for it. A crash before the publication leaves only a
        staging folder, which ``latest`` never takes.

        Args:
            runtime: the run's runtime (``hftrain.strategies.runtime``): its extras and its sharded snapshot.
            step: the optimizer step.
            meta: trainer state, topology and config to store in ``checkpoint.json``.
            background: return before the shards are written.
            live: nothing changes the model and optimizer states until :meth:`wait` (the run's last save): a
                background write reads them where they are, without the staged copy (at the end of the default job
                a copy of 273 MB less, in time and in resident memory).
            rank_state: this rank's own plain state (a training stream's position), written as
                ``state/rank_state_<rank>.json`` (:func:`rank_state_file`) by every rank that has one.
        """
        from hftrain.checkpoint.sharded import DCP_DIR, write, write_metadata

        self.wait()
        final = self.root / f"step_{step:08d}"
        staging = self.root / f".staging-{final.name}"
        state_dir = staging / STATE_DIR
        main = runtime.is_main_process
        # Each phase ends in an agreement instead of a barrier: a rank that cannot write (disk full, read-only)
        # makes every rank raise the same one-line error, and the previous checkpoints stay as they were.
        agreed = _AgreedWrite(runtime, f"checkpoint step {step} ({final})", staging, last=self.latest())
        agreed.phase(self._begin if main else None, staging)
        agreed.phase(runtime.save_extras, str(state_dir))
        if rank_state is not None:
            agreed.phase(write_json, rank_state_file(state_dir), rank_state, indent=None)
        snapshot = runtime.snapshot()
        agreed.phase(write_metadata if main else None, state_dir, snapshot)
        marker = {"step": step, **meta}
        if not background:
            agreed.phase(write, snapshot.state, state_dir / DCP_DIR, threads=self.write_threads)
            agreed.phase(self._publish, staging, final, marker, main=main, group=None)
            return final
        # The next optimizer step changes the live tensors; the write reads a copy (one block of exactly the rank's
        # state, sharded.Staging), released as soon as it is written. After the last step nothing changes them: the
        # write reads them as they are.
        staged = snapshot if live else snapshot.staged()
        self.staged_saves += staged.staging is not None
        group = self._background_group()
        device = _with_index(getattr(runtime, "device", None))

        def write_in_background() -> None:
            _bind_device(device)  # this rank's GPU, not cuda:0 (a new thread starts on device 0)
            try:
                staged.wait_copied()  # the staging copies run non-blocking into page-locked memory on a GPU
                write(staged.state, state_dir / DCP_DIR, process_group=group, threads=self.write_threads)
            finally:
                staged.release()  # the copy is on disk (or failed): its memory goes back now, not at the next save
            self._publish(staging, final, marker, main=main, group=group)

        self._pending = _Pending(agreed, final, _in_a_thread(write_in_background))
        return final

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any (collective: every rank calls it); returns its checkpoint.

        A failure of the background write is raised here on every rank, in one line, as a synchronous save's.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.agreed.phase(pending.future.result)
        return pending.final

    def settle(self, timeout: float = 300.0) -> None:
        """Before an error leaves this rank: let the save in flight finish (its writer thread publishes it), with no
        collective and without raising, so that the checkpoint an error message names is complete on disk.

        The other ranks' writer threads take part in the write whatever their main threads do; ``timeout`` bounds
        the wait if they are gone.

        Args:
            timeout: the longest wait, in seconds.
        """
        import contextlib

        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(BaseException):
                pending.future.result(timeout=timeout)

    def _background_group(self) -> Any:
        """A process group of its own for the background writes (None in one process): DCP's collectives run in
        the writing thread while the training step's run in the main one, and the two must not share a group."""
        import torch.distributed as dist

        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            from hftrain.parallel.host import COLLECTIVE_TIMEOUT

            self._group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        return self._group

    # What a save writes, replaces and deletes is checked with ``lstat`` first (``hftrain.files``): a link or a FIFO
    # where a checkpoint folder goes (``checkpoints/`` itself, a future step_<N>, a stale .staging-*, a step the
    # rotation deletes) is refused in one line before anything is published, never followed, opened or waited on.
    def _begin(self, staging: Path) -> None:
        check_own(self.root, "the checkpoints folder", folder=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self._clear_staging()
        make_folder(staging, "a checkpoint's staging folder")

    def _publish(self, staging: Path, final: Path, meta: dict[str, Any], *, main: bool, group: Any) -> None:
        """Every rank hashes the shards it wrote and the main process, given those digests, publishes the checkpoint
        (collective over ``group``'s host twin; None: the default group's).

        Each rank reads back only its own ``__<rank>_<i>.distcp`` files (from its page cache, just written): the
        main process hashes its own shards and the small files, never the other ranks' shards, so a save costs it
        O(its own state), not O(checkpoint) over a shared file system. A rank that cannot read its files sends the
        error instead, and every rank reaches the gather either way; the main process raises it.
        """
        digests = writers_digests(staging, group)
        if main:
            self._finish(staging, final, meta, digests)

    def _finish(self, staging: Path, final: Path, meta: dict[str, Any], digests: dict[str, str] | None = None) -> None:
        digests = digests or {}
        files = {
            name: digests.get(name) or file_checksum(p)
            for p in sorted(staging.rglob("*"))
            if p.is_file() and (name := str(p.relative_to(staging)))
        }
        _write_json_durably(staging / MARKER, {"format_version": FORMAT_VERSION, **meta, "files": files})
        rotated = self._to_rotate(final)
        for old in [final, *rotated]:
            check_own(old, "a checkpoint folder", folder=True)
        # a re-save of the same step (e.g. preempted right after a periodic save)
        remove(final, "a checkpoint folder")
        os.replace(staging, final)
        fsync_dir(self.root)
        for old in rotated:  # one an export or a conversion is reading stays, and goes at a later save
            if not remove_unless_read(old, "a rotated checkpoint folder"):
                from hftrain.log import get_logger

                get_logger().info(f"kept {old.name} for now: another command is reading it")

    def _clear_staging(self) -> None:
        if self.root.is_dir():
            for stale in sorted(self.root.glob(".staging-*")):
                remove(stale, "a stale checkpoint staging folder")

    def _to_rotate(self, final: Path) -> list[Path]:
        """The complete checkpoints that rotation deletes once ``final`` is published."""
        if self.keep is None:
            return []
        kept = [p for p in self.complete() if p != final] + [final]
        kept.sort(key=lambda p: int(_STEP_DIR.match(p.name).group(1)))
        return kept[: -self.keep] if len(kept) > self.keep else []

    # ----------------------------------------------------------------- finding and verifying
    def complete(self) -> list[Path]:
        """Checkpoint folders with a marker that is a regular file, oldest first (checksums are checked on load, not
        here; :meth:`resolve` names what this leaves out)."""
        return self._scan()[0]

    def _scan(self) -> tuple[list[Path], list[Path], list[tuple[Path, int]]]:
        """``(complete, unfinished, odd)``: step folders with a regular marker, without one, and with a marker that
        is something else (with its ``st_mode``), each oldest first. Markers are looked at with ``lstat``, never
        opened: a FIFO there would block a reader forever."""
        import stat

        complete: list[Path] = []
        unfinished: list[Path] = []
        odd: list[tuple[Path, int]] = []
        if not self.root.is_dir():
            return complete, unfinished, odd
        for _, path in sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))):
            try:
                mode = os.lstat(path / MARKER).st_mode
            except (FileNotFoundError, NotADirectoryError):
                unfinished.append(path)
                continue
            (complete.append(path) if stat.S_ISREG(mode) else odd.append((path, mode)))
        return complete, unfinished, odd

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        found = self.complete()
        return found[-1] if found else None

    def resolve(self, spec: str) -> Path | None:
        """The checkpoint ``spec`` names: ``latest``, ``auto`` (None when there is none yet) or a folder.

        A step folder whose marker is not a regular file (a link, a FIFO) is refused in one line naming it: hftrain
        writes none such, and skipping it would resume silently from an older step. A step folder newer than the
        latest complete one without a marker is a write that did not finish (killed before its rename): logged,
        and skipped.
        """
        if spec in ("latest", "auto"):
            found, unfinished, odd = self._scan()
            if odd:
                from hftrain.files import kind_of

                path, mode = odd[-1]
                raise CheckpointError(
                    f"checkpoint '{path}': {MARKER} is {kind_of(mode)}, not a file; hftrain writes none such and "
                    "reads none through it: remove that step folder, or resume from a step_<N> folder by name"
                )
            newest = found[-1].name if found else ""
            skipped = [p.name for p in unfinished if p.name > newest]
            if skipped:
                from hftrain.log import get_logger

                taken = f"resuming from {newest}" if found else "no complete checkpoint"
                get_logger().warning(
                    f"{self.root}: {', '.join(skipped)} has no {MARKER} (a checkpoint write that did not finish): "
                    f"skipped, {taken}"
                )
            self._check_run(found)
            if found:
                return found[-1]
            if spec == "auto":
                return None
            raise CheckpointError(
                f"training.resume_from_checkpoint is 'latest' but {self.root} holds no complete checkpoint; "
                "use 'auto' to start fresh when there is none"
            )
        return Path(spec)

    def open(self, spec: str, *, verify_files: bool = False) -> VerifiedCheckpoint | None:
        """The checkpoint ``spec`` names (:meth:`resolve`), opened and checked (:func:`open_checkpoint`), its marker
        read once: the bytes :meth:`resolve` read to check the run are the ones parsed. None: ``auto`` with none yet.

        Args:
            spec: ``latest``, ``auto`` or a checkpoint folder.
            verify_files: recompute every file's checksum now.
        """
        path = self.resolve(spec)
        return None if path is None else self.opened(path, verify_files=verify_files)

    def opened(self, path: Path, *, verify_files: bool = False) -> VerifiedCheckpoint:
        """``path`` (which :meth:`resolve` returned) opened and checked, parsing the marker bytes it read if it did."""
        return open_checkpoint(path, verify_files=verify_files, marker=self._markers.pop(path, None))

    def _check_run(self, found: list[Path]) -> None:
        """Refuse checkpoints of another run among ``found`` (an overwritten run's, or copied in)."""
        from hftrain.files import UnsafePathError

        self._markers = {}
        if self.run_id is None:
            return
        for path in found:
            try:  # one descriptor that follows no link and never waits on a FIFO
                self._markers[path] = data = read_small(path / MARKER, MARKER)
                meta = json.loads(data)
            except (ValueError, RecursionError, OSError, UnsafePathError, CheckpointError):
                continue  # damaged: reported by read_checkpoint if it is the one taken
            if not isinstance(meta, dict):
                continue  # damaged: reported by read_checkpoint if it is the one taken
            other = meta.get("run_id")
            if other != self.run_id:
                raise CheckpointError(
                    f"checkpoint '{path}' belongs to another run (run id {other}; this output_dir's run is "
                    f"{self.run_id}); move it out of {self.root}, or set overwrite_output_dir: true to start over"
                )


@dataclass(frozen=True)
class _Pending:
    """A background save: its agreement, its checkpoint and the thread's future."""

    agreed: _AgreedWrite
    final: Path
    future: Future


def _with_index(device: Any) -> Any:
    """``device`` with its index: a bare ``cuda`` (Accelerate's device of a 1-process run) names the calling thread's
    current GPU, which the writer thread, starting on GPU 0, must be told by number."""
    import torch

    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _bind_device(device: Any) -> None:
    """Make ``device`` (indexed, :func:`_with_index`) the current CUDA device of the calling thread (nothing for a CPU
    run).

    CUDA's current device is per thread and a new thread's is 0: the writer thread of rank 3 would otherwise open a
    context on GPU 0 and run its copies on GPU 0's current stream (pitfall "checkpoint writer on the wrong GPU",
    docs/pitfalls.md).
    """
    import torch

    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def _in_a_thread(work: Callable[[], None]) -> Future:
    """Run ``work`` in a thread of its own; its future holds the outcome.

    A new thread per save, not a pool kept in the module: a process forked after a save (Accelerate's
    ``notebook_launcher`` forks the notebook's kernel) would inherit a pool whose worker thread did not survive the
    fork, and its first background save would wait forever. Not a daemon: an exiting interpreter finishes the write.
    """
    future: Future = Future()

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - raised to the caller at wait()
            future.set_exception(error)
        else:
            future.set_result(None)

    threading.Thread(target=run, name="hftrain-checkpoint").start()
    return future


class _AgreedWrite:
    """Runs the phases of a collective write and makes every rank raise when any rank could not write.

    Args:
        accelerator: the run's accelerator (its processes agree through one all-reduce per phase).
        what: what is written, for the message.
        staging: removed on failure, so no half-written folder remains.
        last: the last complete checkpoint, named in the message.
    """

    def __init__(self, accelerator: Accelerator, what: str, staging: Path, *, last: Path | None) -> None:
        self.accelerator = accelerator
        self.what = what
        self.staging = staging
        self.last = last

    def phase(self, action: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> None:
        """Run ``action`` on this rank, then agree with the other ranks on whether every rank succeeded.

        Args:
            action: what this rank writes in this phase (None: nothing, it only takes part in the agreement).
            args: positional arguments of ``action``.
            kwargs: keyword arguments of ``action``.
        """
        error: Exception | None = None
        if action is not None:
            try:
                action(*args, **kwargs)
            except HFTrainError as raised:
                error = raised
            except Exception as raised:  # torch/safetensors report a full disk as RuntimeError/SafetensorError
                error = write_error(raised, self.what, self.staging, lambda: self.last)
        from hftrain.parallel.host import any_rank  # torch: imported when a save runs

        if not any_rank(error is not None):
            return
        if self.accelerator.is_main_process:
            remove_quietly(self.staging)
        if error is None:
            error = WriteError(f"another process could not write {self.what}; see its error")
        raise error


def read_checkpoint(path: str | Path, *, verify_files: bool = True) -> dict[str, Any]:
    """The metadata of a complete checkpoint, after checking its marker, version, listing and file checksums.

    Args:
        path: a ``step_<N>`` folder.
        verify_files: recompute every file's checksum (the main process does; others trust it after a barrier).
    """
    return open_checkpoint(path, verify_files=verify_files).meta


def open_checkpoint(path: str | Path, *, verify_files: bool = True, marker: bytes | None = None) -> VerifiedCheckpoint:
    """A complete checkpoint, checked: its marker (read once, through one descriptor that follows no link and never
    waits on a FIFO), version and keys, every file under it listed (an unlisted one is refused) and, with
    ``verify_files``, every file's checksum computed on the bytes of one descriptor whose file is recorded (pitfall
    "checked file swapped before it is loaded", docs/pitfalls.md).

    Loaders then read through the returned :class:`VerifiedCheckpoint` (:meth:`~VerifiedCheckpoint.read`): each file
    once, its checksum checked on those bytes, and those bytes parsed.

    Args:
        path: a ``step_<N>`` folder.
        verify_files: recompute every file's checksum now (the main process does; others check what they read).
        marker: the bytes of its ``checkpoint.json`` when they were read already (:meth:`CheckpointManager.open`).
    """
    from hftrain.files import UnsafePathError

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint '{path}' does not exist; give a step_<N> folder under output_dir/checkpoints"
        )
    check_regular_tree(path)  # before any byte of it is read
    if not os.path.lexists(path / MARKER):
        raise CheckpointError(
            f"'{path}' is not a complete hftrain checkpoint (no {MARKER}); it may be a partial write: "
            "resume from 'latest' or another step_<N> folder"
        )
    try:
        meta = json.loads(marker if marker is not None else read_small(path / MARKER, f"checkpoint '{path}': {MARKER}"))
    except UnsafePathError as error:
        raise CheckpointError(f"{error}; resume from another checkpoint") from None
    except (ValueError, RecursionError, OSError):  # RecursionError: JSON nested deeper than Python's stack
        raise CheckpointError(f"checkpoint '{path}': {MARKER} is corrupted; resume from another checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"checkpoint '{path}': {MARKER} is corrupted (not a JSON object); resume from another checkpoint"
        )
    if meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version")
        raise CheckpointError(
            f"checkpoint '{path}' has format version {version}, this hftrain reads {FORMAT_VERSION}; "
            "resume it with the hftrain that wrote it, or from another checkpoint"
        )
    _check_keys(path, meta)
    _check_step(path, meta)
    _check_listed(path, meta["files"])
    verified = VerifiedCheckpoint(path, meta)
    if verify_files:
        verified.verify()
    return verified


class VerifiedCheckpoint:
    """A checkpoint whose ``checkpoint.json`` was read and checked once: every later read of one of its files goes
    through :meth:`read` (or :meth:`open`), so that what is loaded is what was verified.

    Checking a file and then handing its path to a library leaves a window: a writer that swaps the file between the
    two (a rename every few hundred microseconds) gets its own bytes loaded, checksum and restricted unpickler
    notwithstanding (issue 52). Here a file is read once, through one descriptor (``O_NOFOLLOW``, checked with
    ``fstat`` to be a regular file), its checksum is checked on those bytes, and those bytes are what the caller
    parses (and what a library is handed: ``checkpoint.safety.verified_copy``). A large tensor file (a ``.distcp``) is
    not held in memory: :meth:`open` gives a descriptor on the very file whose checksum the main process computed
    (same device, inode, size and change time), so a file renamed over it since is refused.

    Every rank compares: the main process records each file's identity while it verifies, and the other ranks
    :meth:`adopt` that record (``CheckpointSession`` broadcasts it). A rank on the main process's machine compares the
    whole identity; a rank on another machine sees the shared file system through another mount, whose device (and,
    on some file systems, inode) numbers differ, and compares what the file system keeps: size and modification time.
    A rank that has no record at all checks the checksum on the descriptor it reads through, once per file.

    Args:
        path: the ``step_<N>`` folder.
        meta: its ``checkpoint.json``, checked.
    """

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.identities: dict[str, tuple[int, int, int, int, int]] = {}
        """``(st_dev, st_ino, st_size, st_ctime_ns, st_mtime_ns)`` of each file whose checksum was computed (by the
        main process; the other ranks :meth:`adopt` them)."""
        self.machine: str | None = None
        """The machine the identities were recorded on (:func:`machine_id`)."""
        self._checked: set[tuple[int, int, int, int, int]] = set()  # files whose checksum this process computed

    def verify(self) -> None:
        """Compute every listed file's checksum against ``checkpoint.json`` and record each file's identity (the
        main process does, once, before anything is loaded)."""
        self.identities = _verify_files(self.path, self.meta["files"])
        self.machine = machine_id()

    def adopt(self, identities: dict[str, tuple[int, int, int, int, int]], machine: str | None) -> None:
        """Take the main process's record of the files it verified, which :meth:`open` then compares.

        Args:
            identities: its :attr:`identities`.
            machine: its :attr:`machine`.
        """
        self.identities = {name: tuple(value) for name, value in identities.items()}  # type: ignore[misc]
        self.machine = machine

    @property
    def step(self) -> int:
        return self.meta["step"]

    def name_of(self, file: str | Path) -> str:
        """``file``'s name in ``checkpoint.json``'s ``files`` (its path relative to the checkpoint)."""
        try:
            return str(Path(file).relative_to(self.path))
        except ValueError:
            return str(Path(os.path.abspath(file)).relative_to(os.path.abspath(self.path)))

    def read(self, file: str | Path) -> bytes:
        """The bytes of ``file`` (a path under the checkpoint), read once, after checking them against its
        checksum; a file not listed in ``checkpoint.json`` is refused.

        Args:
            file: the file's path.
        """
        name = self.name_of(file)
        recorded = self._recorded(name)
        fd = self._open(name)
        with os.fdopen(fd, "rb") as handle:
            _check_small(self.path, name, os.fstat(fd).st_size)  # this file, not the one listed before a swap
            data = handle.read()
        if bytes_checksum(data, recorded) != recorded:
            raise _mismatch(self.path, name)
        return data

    def open(self, file: str | Path) -> Any:
        """A binary file object on ``file``, the very file whose checksum the main process verified: its identity
        compared with the one recorded then (a file renamed over it since is refused), or, where none was recorded,
        its checksum computed on this descriptor (once per file and process).

        Args:
            file: the file's path.
        """
        name = self.name_of(file)
        recorded = self._recorded(name)
        fd = self._open(name)
        status = _identity(os.fstat(fd))
        seen = self.identities.get(name)
        if seen is None:
            if status not in self._checked:
                with os.fdopen(os.dup(fd), "rb") as handle:
                    digest = _checksum_of(handle, recorded, self.path / name)
                if digest != recorded:
                    os.close(fd)
                    raise _mismatch(self.path, name)
                self._checked.add(status)
            os.lseek(fd, 0, os.SEEK_SET)
        elif _moved(status, seen, same_machine=self.machine == machine_id()):
            os.close(fd)
            raise CheckpointError(
                f"checkpoint '{self.path}': {name} was replaced after its checksum was verified (another process is "
                "writing into the checkpoint); resume from another checkpoint, and let nothing else write there"
            )
        return os.fdopen(fd, "rb")

    def _recorded(self, name: str) -> str:
        files = self.meta["files"]
        if name not in files:
            if not os.path.lexists(self.path / name):
                raise CheckpointError(
                    f"checkpoint '{self.path}' is incomplete: {name} is missing; resume from another checkpoint"
                )
            raise _unlisted(self.path, name)
        return files[name]

    def _open(self, name: str) -> int:
        return open_regular(self.path, name)

    def active(self) -> Any:
        """A context in which the checkpoint loaders (``checkpoint.sharded``, ``checkpoint.safety``) read through this
        checkpoint (``reading.active_checkpoint``), its folder kept from rotation meanwhile."""
        return activated(self)


def _identity(status: os.stat_result) -> tuple[int, int, int, int, int]:
    return (status.st_dev, status.st_ino, status.st_size, status.st_ctime_ns, status.st_mtime_ns)


def _moved(status: tuple[int, ...], seen: tuple[int, ...], *, same_machine: bool) -> bool:
    """Whether the file of identity ``status`` is not the one recorded as ``seen``: the whole identity (device, inode,
    size, change time) on the machine that recorded it; through another mount, whose device and inode numbers are its
    own, size and modification time (what the shared file system keeps)."""
    if same_machine:
        return status[:4] != seen[:4]
    return (status[2], status[4]) != (seen[2], seen[4])


def machine_id() -> str:
    """This machine's identity, for comparing file identities: the kernel's boot id (containers on one kernel share
    its device and inode numbers, and may share a host name with another machine's), else the host name."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return socket.gethostname()


def _unlisted(path: Path, name: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint '{path}': {name} is not listed in {MARKER} (no checksum of it is recorded); every file of a "
        "checkpoint is listed and checked: remove it if you put it there, or resume from another checkpoint"
    )


def _mismatch(path: Path, name: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint '{path}' is corrupted: {name} does not match its checksum (truncated or modified); "
        "resume from another checkpoint"
    )


def _check_listed(path: Path, files: dict[str, str]) -> None:
    """Every file under the checkpoint must be listed in ``files``: a file a loader reads but no checksum covers
    (an entry removed from ``checkpoint.json``, a ``random_states_1.pkl`` added beside it) would load unchecked.
    And every file but the tensor files (``.distcp``) is one that a loader reads whole into memory: one larger than
    :data:`SMALL_FILE_LIMIT` is refused before a byte of it is hashed (a sparse file of a terabyte costs its forger
    nothing, and its reader the memory it asks for)."""
    for folder, _, names in os.walk(path):
        for file in sorted(names):
            name = str((Path(folder) / file).relative_to(path))
            if name != MARKER and name not in files:
                raise _unlisted(path, name)
            if not file.endswith(".distcp"):
                _check_small(path, name, os.lstat(Path(folder) / file).st_size)


SMALL_FILE_LIMIT = 1 << 30
"""The largest checkpoint file that is read whole into memory (``checkpoint.json``, the JSON and pickled state files,
DCP's ``.metadata``): each is kilobytes to megabytes in a real checkpoint."""


def _check_small(path: Path, name: str, size: int) -> None:
    if size > SMALL_FILE_LIMIT:
        raise CheckpointError(
            f"checkpoint '{path}': {name} is {size} bytes, more than the {SMALL_FILE_LIMIT >> 20} MiB any checkpoint "
            "file read whole may hold; it is damaged or forged: resume from another checkpoint"
        )


def read_small(file: Path, what: str) -> bytes:
    """The bytes of a checkpoint file read whole: through one descriptor that follows no link and never waits on a
    FIFO (``fstat``: a regular file), and refused unread when larger than :data:`SMALL_FILE_LIMIT`.

    Args:
        file: the file.
        what: what it is, for messages.
    """

    def damaged(size: int) -> CheckpointError:
        return CheckpointError(
            f"{what} is {size} bytes, more than the {SMALL_FILE_LIMIT >> 20} MiB it may hold; it is damaged or "
            "forged: resume from another checkpoint"
        )

    return read_regular(file, what, too_large=(SMALL_FILE_LIMIT, damaged))


def _check_step(path: Path, meta: dict[str, Any]) -> None:
    """The folder name, ``step`` and ``trainer_state.global_step`` must name the same step (a checkpoint whose
    counters were edited would retrain from another position on these weights, and write over other steps)."""
    step, global_step = meta["step"], meta["trainer_state"]["global_step"]
    named = _STEP_DIR.match(path.name)
    if step != global_step or (named is not None and int(named.group(1)) != step):
        raise CheckpointError(
            f"checkpoint '{path}': its folder name, {MARKER}'s step ({step}) and trainer_state.global_step "
            f"({global_step}) disagree; it is damaged or edited: resume from another checkpoint"
        )


# What checkpoint.json must hold, per section: a missing key is a damaged or foreign file, not a KeyError later.
REQUIRED_KEYS = {
    "": ("step", "trainer_state", "topology", "config", "files"),
    "trainer_state": ("epoch", "global_step", "micro_step", "samples_seen"),
    "topology": ("strategy", "world_size", "micro_batch", "global_batch"),
}


# The integer fields of checkpoint.json and their least value: a string or a negative count is a damaged file,
# not a run that trains on from a nonsense position.
INTEGER_FIELDS = {
    "step": 0,
    "trainer_state.epoch": 0,
    "trainer_state.global_step": 0,
    "trainer_state.micro_step": 0,
    "trainer_state.samples_seen": 0,
    "trainer_state.last_eval_step": -1,
    "topology.world_size": 1,
    "topology.micro_batch": 1,
    "topology.global_batch": 1,
    "topology.dp_size": 1,
    "topology.tp": 1,
    "topology.pp": 1,
}


def _check_keys(path: Path, meta: dict[str, Any]) -> None:
    for section, keys in REQUIRED_KEYS.items():
        values = meta.get(section) if section else meta
        where = f"{section}." if section else ""
        missing = [k for k in keys if not isinstance(values, dict) or k not in values]
        if missing:
            raise CheckpointError(
                f"checkpoint '{path}': {MARKER} lacks '{where}{missing[0]}'; it is damaged or not hftrain's: "
                "resume from another checkpoint"
            )
    for key, least in INTEGER_FIELDS.items():
        section, _, name = key.rpartition(".")
        values = meta[section] if section else meta
        if name not in values:
            continue
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise _damaged_field(path, key, f"{value!r} is not an integer >= {least}")
    files = meta["files"]
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise _damaged_field(path, "files", "it is not a mapping of file names to checksums")
    if not files:
        raise _damaged_field(path, "files", "it lists no file")
    outside = next((name for name in files if not _inside_name(name)), None)
    if outside is not None:
        raise _damaged_field(path, "files", f"'{outside}' is not a path inside the checkpoint")
    for section in ("config", "topology"):
        if not isinstance(meta[section], dict):
            raise _damaged_field(path, section, f"{type(meta[section]).__name__} is not a mapping")
    if not isinstance(meta["topology"]["strategy"], str):
        raise _damaged_field(path, "topology.strategy", f"{meta['topology']['strategy']!r} is not a strategy name")
    history = meta["trainer_state"].get("log_history", [])
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        raise _damaged_field(path, "trainer_state.log_history", "it is not a list of records")
    for entry in history:
        bad = next((k for k, v in entry.items() if not _is_number(v) or k == "step" and not isinstance(v, int)), None)
        if bad is not None:
            raise _damaged_field(path, "trainer_state.log_history", f"'{bad}': {entry[bad]!r} is not a number")
    for name in ("run_id",):
        if meta.get(name) is not None and not isinstance(meta[name], str):
            raise _damaged_field(path, name, f"{meta[name]!r} is not a string")


def _inside_name(name: str) -> bool:
    """A relative path that stays below the folder it is relative to (no ``..``, not absolute)."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _damaged_field(path: Path, key: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint '{path}': {MARKER} has a damaged '{key}' ({what}); resume from another checkpoint"
    )


def _verify_files(path: Path, files: dict[str, str]) -> dict[str, tuple[int, int, int, int, int]]:
    """Check every listed file's checksum, each through one descriptor (no link followed, no FIFO waited on); returns
    each file's identity, which a later :meth:`VerifiedCheckpoint.open` compares."""
    identities = {}
    for name, digest in files.items():
        fd = open_regular(path, name)
        with os.fdopen(fd, "rb") as handle:
            if _checksum_of(handle, digest, path / name) != digest:
                raise _mismatch(path, name)
            identities[name] = _identity(os.fstat(handle.fileno()))
    return identities


CHECKSUM = "xxh3_128"
"""The checksum ``checkpoint.json`` records for each file, as ``xxh3_128:<hex>``."""


def writers_digests(staging: Path, group: Any = None) -> dict[str, str]:
    """The checksums of every rank's own DCP shards (``state/dcp/__<rank>_<i>.distcp``), each computed by the rank
    that wrote it, by relative path (collective over ``group``'s host twin when a process group runs; else this
    process's own). A rank's read error travels instead of its digests and is raised on every rank.

    Args:
        staging: the checkpoint's staging folder.
        group: the process group the shards were written over (DCP's ranks are its ranks); None: the default group.
    """
    import torch.distributed as dist

    from hftrain.checkpoint.sharded import DCP_DIR

    running = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if running else 0
    folder = staging / STATE_DIR / DCP_DIR
    try:
        own = sorted(folder.glob(f"__{rank}_*.distcp")) if folder.is_dir() else []
        mine: tuple[dict[str, str], str | None] = ({str(p.relative_to(staging)): file_checksum(p) for p in own}, None)
    except OSError as error:
        mine = ({}, f"process {rank} could not read the shards it wrote: {error}")
    if not running:
        gathered = [mine]
    else:
        from hftrain.parallel.host import host_group

        twin = host_group(group)
        gathered = [None] * dist.get_world_size(twin)
        dist.all_gather_object(gathered, mine, group=twin)
    errors = [error for _, error in gathered if error]
    if errors:
        raise WriteError(errors[0])
    return {name: digest for digests, _ in gathered for name, digest in digests.items()}


def file_checksum(path: Path) -> str:
    """``xxh3_128:<hex>`` of a file's bytes: what ``checkpoint.json`` records for each file of a checkpoint.

    XXH3-128 (``xxhash``) runs at the speed the file is read: 0.05 s for the default job's 273 MB against SHA-256's
    0.17 s, which for a checkpoint of many GB is seconds against a minute, in every save's background write and
    every resume's verification. A checksum finds a truncated or damaged file; it is no signature (whoever can
    rewrite a file can rewrite ``checkpoint.json`` too), and trust comes from elsewhere (``checkpoint.safety``,
    ``resume.check_trusted``). Checkpoints written before 2026-11-24 record bare SHA-256 hex digests, which
    :func:`read_checkpoint` still verifies.
    """
    return _checksum(path, f"{CHECKSUM}:")


def _checksum(path: Path, recorded: str) -> str:
    """The checksum of ``path`` of the kind ``recorded`` is (a bare hex digest: SHA-256, as written before)."""
    with path.open("rb") as handle:
        return _checksum_of(handle, recorded, path)


def bytes_checksum(data: bytes, recorded: str) -> str:
    """The checksum of ``data`` of the kind ``recorded`` is (what :func:`file_checksum` gives for a file of them)."""
    digest, prefix = _hasher(recorded, "checkpoint file")
    digest.update(data)
    return prefix + digest.hexdigest()


def _checksum_of(handle: Any, recorded: str, path: Path) -> str:
    digest, prefix = _hasher(recorded, f"checkpoint file '{path}'")
    for block in iter(lambda: handle.read(1 << 20), b""):
        digest.update(block)
    return prefix + digest.hexdigest()


def _hasher(recorded: str, what: str) -> tuple[Any, str]:
    kind, _, _ = recorded.rpartition(":")
    if kind == CHECKSUM:
        import xxhash

        return xxhash.xxh3_128(), f"{CHECKSUM}:"
    if not kind:
        return hashlib.sha256(), ""
    raise CheckpointError(
        f"{what} is recorded with a checksum of kind '{kind}', which this hftrain does not "
        f"know ({CHECKSUM} or SHA-256); read it with the hftrain version that wrote it"
    )


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    write_file(path, json.dumps(data, indent=1), durable=True)
