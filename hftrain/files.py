"""The paths hftrain writes and deletes are its own: no write follows a planted link, no delete enters one, nothing
blocks on a FIFO, and one command at a time holds a folder.

Every write is a new file in the same folder, filled, flushed and then renamed over the target with ``os.replace``
(:func:`write_file`). A rename replaces a symbolic link itself instead of the file it points to, and gives the path a
new inode, so a hard link to a file outside the run keeps its old bytes. Every delete (:func:`remove`) reads the
entry with ``lstat`` first and refuses a link or a special file in one line: ``shutil.rmtree`` refuses a link with a
traceback, and opens a FIFO (blocking forever) before it checks what it holds. Inside a folder it deletes,
``rmtree``'s descriptor-based walk (Linux) unlinks links and FIFOs without following or opening them.

:class:`FolderLock` gives a folder to one command: an exclusive ``flock`` on a lock file, held for the command's
life and released by the kernel when the process dies (no stale lock after SIGKILL). A second command is refused in
one line naming the holder (host, pid, run id, command) that the lock file records. The file is opened with
``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` to be a regular file, and after taking the lock its inode is
compared with the path's (a holder that released and removed it meanwhile makes the taker retry), so the file can
be removed on release.

Pitfall "writes through planted links", docs/pitfalls.md. Written by hand: the standard library's helpers
(``Path.write_text``, ``shutil.rmtree``) follow links or block, and the ``filelock`` package records no holder and
follows a planted link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hftrain.errors import HFTrainError

LOCK_FILENAME = ".hftrain.lock"


class UnsafePathError(HFTrainError):
    """A path hftrain would write or delete is a link or a special file, or a folder another command holds."""


def kind_of(mode: int) -> str:
    """What a ``st_mode`` is, in words (``a symbolic link``, ``a FIFO``, ...)."""
    for test, word in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a file"),
    ):
        if test(mode):
            return word
    return "a special file"


def check_own(path: str | os.PathLike[str], what: str, *, folder: bool | None = None) -> bool:
    """Refuse ``path`` when it is a link or a special file (or not the ``folder``/file asked); True if it exists.

    Args:
        path: an entry hftrain will write, replace or delete.
        what: what it is, for the message (``the export folder``, ``trainer_state.json``).
        folder: True: it must be a folder; False: a regular file; None: either.
    """
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # under a file: the caller's writability check names it
        return False
    regular = stat.S_ISREG(mode) or stat.S_ISDIR(mode)
    wrong = not regular or (folder is True and not stat.S_ISDIR(mode)) or (folder is False and stat.S_ISDIR(mode))
    if wrong:
        target = f" (to '{os.readlink(path)}')" if stat.S_ISLNK(mode) else ""
        raise UnsafePathError(
            f"{what} '{path}' is {kind_of(mode)}{target}, which hftrain does not write through or delete; remove or "
            "rename it yourself, or choose another path"
        )
    return True


def write_file(path: str | os.PathLike[str], data: bytes | str, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` as a new file renamed over it: a link at ``path`` is replaced, not followed, a hard
    link is broken, a FIFO is replaced without being opened, and a reader never sees half a file.

    Args:
        path: the file to write.
        data: its bytes, or text (UTF-8).
        durable: fsync the file and its folder (a checkpoint's marker).
    """
    path = Path(path)
    if os.path.isdir(path) and not os.path.islink(path):
        raise UnsafePathError(f"'{path}' is a folder where hftrain writes a file; remove or rename it")
    payload = data.encode() if isinstance(data, str) else data
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.chmod(staging, 0o644 & ~_umask())
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int = 2, durable: bool = False) -> None:
    """:func:`write_file` of ``data`` as JSON and a final newline."""
    write_file(path, json.dumps(data, indent=indent) + "\n", durable=durable)


def remove(path: str | os.PathLike[str], what: str) -> bool:
    """Delete a folder (with everything in it) or a file that hftrain wrote; True if something was removed.

    A link or a special file at ``path`` is refused in one line (:func:`check_own`), never followed or opened.

    Args:
        path: the entry.
        what: what it is, for the message.
    """
    import shutil

    if not check_own(path, what):
        return False
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return True


def remove_quietly(path: str | os.PathLike[str]) -> None:
    """Delete a staging leftover if it is hftrain's (a folder or a regular file); leave anything else as it is.

    For cleanup on a failure path, where a second error would hide the first.
    """
    with contextlib.suppress(OSError, UnsafePathError):
        remove(path, "a staging leftover")


def make_folder(path: str | os.PathLike[str], what: str) -> None:
    """Create a new folder at ``path`` (its parents as needed): refuse a link or a special file there, or an
    existing entry.

    Args:
        path: the folder.
        what: what it is, for the message.
    """
    if check_own(path, what):
        raise UnsafePathError(f"{what} '{path}' exists already; hftrain creates it anew: remove it, or choose another")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(path)


def fresh_folder(path: str | os.PathLike[str], what: str) -> Path:
    """A new, empty folder at ``path`` for hftrain to fill (a staging folder): a leftover of a killed command there
    (a folder or a file) is removed first; a link or a special file is refused in one line, never written through.

    Args:
        path: the folder.
        what: what it is, for the message.
    """
    remove(path, what)
    make_folder(path, what)
    return Path(path)


def open_regular(path: str | os.PathLike[str], what: str, mode: str = "wb") -> Any:
    """A binary file object on a regular file, opened without following a link and without waiting on a FIFO, for
    a file of a folder hftrain created (a staging folder): a hard link there is refused, not written through (a
    file hftrain rewrites in a folder it shares with the user is :func:`write_file`'s).

    Args:
        path: the file.
        what: what it is, for the message.
        mode: ``wb`` (created, or truncated) or ``r+b`` (an existing file, read and written in place).
    """
    flags = {"wb": os.O_WRONLY | os.O_CREAT, "r+b": os.O_RDWR}[mode]  # truncated below, once checked
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO without reader, a folder
            check_own(path, what, folder=False)
        raise
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:
        os.close(fd)
        kind = kind_of(status.st_mode) if not stat.S_ISREG(status.st_mode) else "a file with other hard links"
        raise UnsafePathError(f"{what} '{path}' is {kind}, which hftrain does not write through; remove it yourself")
    os.set_blocking(fd, True)
    if mode == "wb":
        os.ftruncate(fd, 0)
    return os.fdopen(fd, mode)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_regular(
    path: str | os.PathLike[str], what: str, *, too_large: tuple[int, Callable[[int], HFTrainError]] | None = None
) -> bytes:
    """The bytes of a regular file, read through one descriptor opened without following a link and checked with
    ``fstat`` (a FIFO is never waited on, a file swapped after the check is not the one read).

    Args:
        path: the file.
        what: what it is, for the message.
        too_large: ``(limit, error)``: a file of more than ``limit`` bytes is refused unread with ``error(size)``
            (a sparse terabyte file would otherwise be read into memory).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafePathError(f"{what} '{path}' is a symbolic link; hftrain reads none through a link") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"{what} '{path}' is {kind_of(mode)}, not a file")
        size = os.fstat(fd).st_size
        if too_large is not None and size > too_large[0]:
            raise too_large[1](size)
        return handle.read()


@contextlib.contextmanager
def reading_folder(folder: str | os.PathLike[str]) -> Iterator[None]:
    """Hold a shared ``flock`` on ``folder`` while a command reads it: a run's checkpoint rotation
    (:func:`remove_unless_read`) keeps a folder that an export or a conversion is reading.

    Best effort: a folder that cannot be opened (missing, a link: the reader's own checks name it) or locked (a file
    system without ``flock`` on folders) is read without the lock, as before.

    Args:
        folder: the folder read (a ``step_<N>`` checkpoint).
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a rotation deletes it (then the reader names it)
        yield
    finally:
        os.close(fd)


def remove_unless_read(folder: str | os.PathLike[str], what: str) -> bool:
    """:func:`remove` a folder unless a reader holds it (:func:`reading_folder`); False when it was kept.

    Args:
        folder: the folder to delete.
        what: what it is, for the message.
    """
    if not check_own(folder, what, folder=True):
        return False
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:  # no flock on folders here (some network file systems): removed, as before
            pass
        return remove(folder, what)
    finally:
        os.close(fd)


def read_input(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of a file a user names (a config, a DeepSpeed JSON): links are followed, as the user may keep
    configs anywhere, but a FIFO, socket or device is refused in one line instead of blocking the command forever.

    Args:
        path: the file.
        what: the field or flag that named it, for the message.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, and is then refused
    with os.fdopen(fd, "rb") as handle:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafePathError(f"{what} '{path}' is {kind_of(mode)}, not a file; give a regular file")
        return handle.read()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class FolderLock:
    """An exclusive lock on a folder for one command's life (see the module docstring).

    Args:
        lock_file: the lock file (``<folder>/.hftrain.lock`` for a run folder, ``<parent>/.<name>.hftrain.lock``
            for a folder that is published by a rename).
        field: the config field or argument naming the folder, for the message.
        holder: what the lock records besides host and pid (``run_id``, ``command``).
    """

    def __init__(self, lock_file: str | os.PathLike[str], field: str, **holder: Any) -> None:
        self.path = Path(lock_file)
        self.field = field
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), **holder}
        self._fd: int | None = None

    @classmethod
    def for_folder(cls, folder: str | os.PathLike[str], field: str, **holder: Any) -> FolderLock:
        """The lock of a folder that hftrain publishes by renaming a staging folder over it (an export): beside it,
        so that the rename does not drop it."""
        folder = Path(folder)
        return cls(folder.parent / f".{folder.name}.hftrain.lock", field, **holder)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> FolderLock:
        """Take the lock, or raise naming its holder; creates the lock file's folder if needed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):  # a holder removing the file between our open and our flock: open the new one
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise self._held_by(holder) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(self.holder) + "\n").encode(), 0)
                self._fd = fd
                return self
            os.close(fd)
        raise UnsafePathError(f"{self.field}: the lock file '{self.path}' keeps changing; is another tool removing it?")

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.lstat(self.path).st_ino:
                os.unlink(self.path)
        os.close(fd)

    def check_free(self) -> None:
        """Refuse now if another command holds the lock; take nothing (a probe before a long setup)."""
        if self.held or not os.path.lexists(self.path):
            return
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._held_by(_read_holder(fd)) from None
        finally:
            os.close(fd)  # closing releases a lock this probe took

    def check_held_by(self, **expected: Any) -> None:
        """On a rank that does not take the lock: refuse unless another process holds it for ``expected`` (the
        run id the main process took it for).

        Args:
            expected: holder fields that must match (``run_id=...``).
        """
        if not os.path.lexists(self.path):
            raise UnsafePathError(
                f"{self.field}: the main process holds no lock on '{self.path.parent}' ({self.path.name} is missing); "
                "do all ranks write into the same folder (a shared file system)?"
            )
        fd = self._open()
        try:
            holder = _read_holder(fd)
        finally:
            os.close(fd)
        wrong = {key: holder.get(key) for key, value in expected.items() if holder.get(key) != value}
        if wrong:
            raise UnsafePathError(
                f"{self.field} '{self.path.parent}' is held by another command ({_describe(holder)}), not by this "
                "run's main process; wait for it to end, or choose another folder"
            )

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _open(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                check_own(self.path, f"{self.field}: the lock file", folder=False)
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise UnsafePathError(
                f"{self.field}: the lock file '{self.path}' is {kind_of(mode)}, not a file; remove it yourself"
            )
        return fd

    def _held_by(self, holder: dict[str, Any]) -> UnsafePathError:
        return UnsafePathError(
            f"{self.field} '{self.path.parent}' is in use by another hftrain command ({_describe(holder)}); wait for "
            "it to end, or choose another folder"
        )


def _read_holder(fd: int, *, wait_s: float = 1.0) -> dict[str, Any]:
    """The holder a lock file records; a holder that took the lock a moment ago writes it right after: waited for,
    up to ``wait_s``, so that the refusal names it."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, OSError):
            holder = {}
        if (isinstance(holder, dict) and holder) or time.monotonic() >= deadline:
            return holder if isinstance(holder, dict) else {}
        time.sleep(0.02)


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder not recorded yet"
    names = ("command", "host", "pid", "run_id")
    return ", ".join(f"{key} {holder[key]}" for key in names if key in holder)
