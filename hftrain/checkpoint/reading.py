"""How a checkpoint is read: the checkpoint a load reads through, and the check that it is a tree of regular files.

Below the manager, the sharded format and the safety checks, which all read through these: the manager opens and
verifies a checkpoint (``open_checkpoint``) and makes it the active one (:func:`activated`) while the strategies'
loaders run; the loaders (``checkpoint.sharded``, ``checkpoint.safety``) ask :func:`active_checkpoint` for it,
since they are handed a folder, not the checkpoint.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hftrain.errors import CheckpointError
from hftrain.files import kind_of, reading_folder

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("hftrain_checkpoint", default=None)


def active_checkpoint() -> Any:
    """The checkpoint being loaded (a ``manager.VerifiedCheckpoint``, made active by :func:`activated`), or None
    outside a load.

    A context rather than a parameter: the strategies' loaders (``runtime.load_state`` and the DCP reads under it)
    take a folder, and every one of them reads through the checkpoint of the resume that called them.
    """
    return _ACTIVE.get()


@contextlib.contextmanager
def activated(verified: Any) -> Iterator[Any]:
    """Make ``verified`` the checkpoint the loaders read through, holding a shared lock on its folder meanwhile (the
    run's rotation keeps a folder another command reads: ``files.remove_unless_read``).

    Args:
        verified: the opened, verified checkpoint (``manager.VerifiedCheckpoint``; its ``path`` is the folder).
    """
    token = _ACTIVE.set(verified)
    try:
        with reading_folder(verified.path):
            yield verified
    finally:
        _ACTIVE.reset(token)


def check_regular_tree(path: Path) -> None:
    """Refuse a checkpoint that is not a tree of regular files and folders, before any library reads a byte of it.

    A symbolic link anywhere in it (``state/dcp -> ../elsewhere``, which survives ``cp -a`` and tar) would let a
    file be read that no check ever looked at: ``Path.rglob`` does not enter a symlinked folder, while the loaders
    (torch's DCP reader unpickles ``.metadata``) follow the link. A FIFO or device would block or read forever. So
    every entry below ``path`` is listed without following links (``os.walk``), and the first that is a link, or
    neither a folder nor a regular file, is named in one line. ``path`` itself may be reached through links (a
    symlinked scratch file system); whether it lies inside the run is :func:`~hftrain.checkpoint.resume.
    check_trusted`'s question, asked of its real path. Pitfall "symlinked checkpoint runs code", docs/pitfalls.md.

    Args:
        path: a ``step_<N>`` folder (or a DeepSpeed checkpoint's tag folder).
    """

    def unreadable(error: OSError) -> None:
        raise CheckpointError(f"checkpoint '{path}': '{error.filename}' cannot be listed ({error.strerror}); "
                              "resume from another checkpoint")  # fmt: skip

    for folder, folders, files in os.walk(path, onerror=unreadable):
        for name in [*folders, *files]:
            entry = Path(folder) / name
            relative = entry.relative_to(path)
            if entry.is_symlink():
                raise CheckpointError(
                    f"checkpoint '{path}': {relative} is a symbolic link (to '{os.readlink(entry)}'); a checkpoint "
                    "is a tree of regular files, and hftrain reads none through a link: replace the link with a "
                    "copy of what it points to (cp -rL) if you trust it, or resume from another checkpoint"
                )
            if not (entry.is_dir() or entry.is_file()):
                raise CheckpointError(
                    f"checkpoint '{path}': {relative} is neither a file nor a folder (a FIFO, socket or device); "
                    "resume from another checkpoint"
                )


def open_regular(checkpoint: Path, name: str) -> int:
    """A descriptor on ``checkpoint/name`` opened without following a link or waiting on a FIFO, checked with
    ``fstat`` to be a regular file; anything else is a one-line :class:`CheckpointError`.

    Args:
        checkpoint: the ``step_<N>`` folder.
        name: the file's path inside it.
    """
    try:
        fd = os.open(checkpoint / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint '{checkpoint}' is incomplete: {name} is missing; resume from another checkpoint"
        ) from None
    except OSError as error:
        what = "a symbolic link" if error.errno == errno.ELOOP else error.strerror
        raise CheckpointError(
            f"checkpoint '{checkpoint}': {name} cannot be read ({what}); a checkpoint is a tree of regular files: "
            "resume from another checkpoint"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(
            f"checkpoint '{checkpoint}': {name} is {kind_of(mode)}, not a file; resume from another checkpoint"
        )
    return fd
