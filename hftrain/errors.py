"""Errors hftrain reports to users as one line and exit code 2, and the rule that decides which those are.

The rule (every subcommand inherits it; a new one needs nothing but to be registered in ``hftrain.cli``):

1. Bad input raises an ``HFTrainError`` subclass whose message is one line naming the field or file at fault
   and the fix for that fault. ``hftrain.cli.main``, the one wrapper every subcommand runs through, prints it
   as ``hftrain: error: <message>`` on stderr and returns exit code 2; command-line syntax errors too.
2. A library exception that bad input causes becomes an ``HFTrainError`` *where the input is read or written*:
   config, model folder, tokenizer, data, ``output_dir``, checkpoints, disk writes. ``reading`` and
   ``writing`` below are those boundaries; nothing else catches broadly. Anywhere else an exception is a bug
   and keeps its traceback (exit 1).
3. Everything that can be checked runs in one validation pass (``hftrain.validate``) before anything is
   written; a refused command leaves every file as it was, and creates no ``output_dir``.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class HFTrainError(Exception):
    """A user-facing error: one actionable line, reported by the CLI with exit code 2.

    Under a launcher every rank meets the same bad input and raises the same error; the CLI prints it from the
    main process of each machine only. ``every_rank`` marks the errors that can differ between ranks (a rank's
    own write), which every rank prints.

    Args:
        message: what is wrong, naming the field or file, and how to fix it.
    """

    exit_code = 2
    every_rank = False


class ConfigError(HFTrainError):
    """A config key, value or combination is invalid."""


class ProcessError(ConfigError):
    """An input only this process sees (its launcher environment and command line): it can differ between ranks,
    so every rank that meets it prints it, not only the main process of the machine."""

    every_rank = True


class AxisError(ConfigError):
    """A parallel-layout value that cannot work, named by its axis (``tp``, ``pp``, ``virtual_stages``,
    ``world_size``), not by a config key: ``hftrain.parallel`` knows no config. The layer that took the value from
    the user (the megatron strategy, ``hftrain groups``) re-raises it under its own name with :meth:`named_as`.

    Args:
        axis: the axis whose value is wrong.
        message: what is wrong and the fix, in the axis' terms.
    """

    def __init__(self, axis: str, message: str) -> None:
        super().__init__(message)
        self.axis = axis

    def named_as(self, field: str) -> ConfigError:
        """The same error naming ``field`` (``parallelism.tp``, ``--tp``) as the source of the value."""
        return ConfigError(f"{field}: {self}")


class DataError(HFTrainError):
    """A data file, column or label is invalid."""


class UsageError(HFTrainError):
    """The command line itself is malformed (unknown subcommand, missing argument)."""


class CheckpointError(HFTrainError):
    """A checkpoint is missing, incomplete, corrupted or incompatible with this run."""


class WriteError(HFTrainError):
    """A file of the run could not be written (disk full, read-only, permission denied).

    Each rank writes its own files: the rank that failed says why, the others that another process failed.
    """

    every_rank = True


# errno values that mean "this location cannot take the write", not "hftrain has a bug"; each with its fix.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_WRITE_FIXES = {
    errno.EROFS: "the file system is read-only: choose a location on a writable one",
    errno.EACCES: "choose a location you may write to, or fix its permissions",
    errno.EPERM: "choose a location you may write to, or fix its permissions",
    errno.ENOENT: "a folder on the path is missing (or was removed while writing): create it or fix the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: fix the path",
    errno.EISDIR: "a folder is where a file is written: fix the path",
    errno.EEXIST: "something already exists there: fix the path or remove it",
    errno.ENAMETOOLONG: "the name is too long for the file system: choose a shorter path",
    errno.ELOOP: "the path has a symbolic-link loop: fix the path",
    errno.EFBIG: "the file is larger than the file system allows: choose a location on another file system",
    errno.EIO: "the storage device reported an I/O error: check the disk or choose another location",
    errno.ESTALE: "the network file system lost the file: remount it or choose another location",
}
# Writers that report a full disk without an errno: safetensors says so ("(os error 28)"); torch.save only says
# that a stream write failed ("unexpected pos" after an iostream error), a full disk only where the disk is full.
_NO_SPACE_TEXT = ("No space left on device", "os error 28", "os error 122")
_STREAM_FAILURE_TEXT = ("unexpected pos", "iostream error", "file write failed", "PytorchStreamWriter failed")
# A write that failed that way on a file system with less free space than this failed for want of space.
_FULL_BELOW_BYTES = 1 << 20


def one_line(error: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for embedding in a message.

    Args:
        error: the library exception.
    """
    if isinstance(error, KeyError) and error.args:  # str(KeyError) is only the quoted key
        return f"missing key {error.args[0]!r}"
    lines = [line.strip() for line in str(error).strip().splitlines()]
    first = lines[0] if lines else type(error).__name__
    if first.endswith(":") and len(lines) > 1:  # a heading ("Validation error for field 'x':"): its detail too
        first = f"{first} {lines[1]}"
    return first[:300]


@contextlib.contextmanager
def reading(
    what: str,
    fix: str,
    *,
    catch: tuple[type[BaseException], ...] = (OSError, ValueError),
    error_class: type[HFTrainError] = ConfigError,
) -> Iterator[None]:
    """The boundary where a library reads user input: its exceptions become one ``HFTrainError`` line.

    Args:
        what: the field and file being read, e.g. ``"model.model_name_or_path: /m/config.json"``.
        fix: what the user should do about it.
        catch: the library exceptions that mean the input is bad (anything else stays a bug).
        error_class: the ``HFTrainError`` subclass to raise.
    """
    try:
        yield
    except HFTrainError:
        raise
    except catch as error:
        raise error_class(f"{what}: {one_line(error)}; {fix}") from error


@contextlib.contextmanager
def writing(
    what: str,
    *,
    location: str | os.PathLike[str],
    last_checkpoint: Callable[[], Any] | None = None,
    catch: tuple[type[Exception], ...] = (OSError,),
) -> Iterator[None]:
    """The boundary where hftrain writes the run's files: a full, read-only or misnamed target is one line.

    Anything that is not such a failure is re-raised unchanged: it is not the user's location at fault.

    Args:
        what: what was being written and where, e.g. ``"checkpoint step 40 (out/checkpoints/step_00000040)"``.
        location: the file or folder being written (its free space decides only for a writer that hides the
            errno: a failed torch.save stream on a nearly full file system).
        last_checkpoint: returns the last complete checkpoint (None when there is none), named in the message
            so the user knows what survived; leave it out for a write that is not a run's.
        catch: the exceptions the writers in the block raise on failure; torch and safetensors report a full
            disk as ``RuntimeError`` / ``SafetensorError``, so collective checkpoint writes pass ``(Exception,)``.
    """
    try:
        yield
    except HFTrainError:
        raise
    except catch as error:
        converted = write_error(error, what, location, last_checkpoint)
        if converted is error:
            raise
        raise converted from error


def write_error(
    error: Exception, what: str, location: str | os.PathLike[str], last_checkpoint: Callable[[], Any] | None = None
) -> Exception:
    """The ``WriteError`` for an exception raised while writing ``what``, or the exception itself when not ours.

    The cause is the error's errno (or the errno of an ``OSError`` it was raised from): "no space" only for
    ``ENOSPC``/``EDQUOT``, and a read-only file system, a permission, a missing folder... each as itself. An
    error without any errno is a full disk only when its writer says so, or when it is a stream-write failure
    (torch.save hides ``ENOSPC``) on a file system that is in fact nearly full; anything else stays a bug.

    Args:
        error: what the writer raised.
        what: what was being written and where.
        location: the file or folder being written.
        last_checkpoint: returns the last complete checkpoint, or None (left out: not a run's write).
    """
    cause = _os_error(error)
    code = cause.errno if cause is not None else None
    if code in _NO_SPACE or (code is None and _no_space_without_errno(error, location)):
        survived = ""
        if last_checkpoint is not None:  # a run's write: say what it still has
            last = last_checkpoint()
            survived = f"the last complete checkpoint is {last}; " if last else "there is no complete checkpoint yet; "
        return WriteError(f"no space left on device while writing {what}; {survived}free space and rerun")
    if cause is not None and code in _WRITE_FIXES:
        reason = cause.strerror or os.strerror(code)
        where = cause.filename if cause.filename is not None else location
        return WriteError(f"cannot write {what}: {reason} ({where}); {_WRITE_FIXES[code]}")
    return error


def _os_error(error: BaseException) -> OSError | None:
    """The ``OSError`` with an errno that ``error`` is, or was raised from (``raise ... from``: ``__cause__``).

    An exception merely raised while another was handled (``__context__``) is not caused by it: not followed.
    """
    current: BaseException | None = error
    for _ in range(8):
        if current is None:
            return None
        if isinstance(current, OSError) and current.errno is not None:
            return current
        current = current.__cause__
    return None


def _no_space_without_errno(error: BaseException, location: str | os.PathLike[str]) -> bool:
    """Whether an error that carries no errno is a full disk: its text says so, or a stream write failed on a
    nearly full file system."""
    texts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(texts) < 8:  # torch chains its iostream error as the context
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    text = " ".join(texts)
    if any(marker in text for marker in _NO_SPACE_TEXT):
        return True
    return any(marker in text for marker in _STREAM_FAILURE_TEXT) and _nearly_full(location)


def _nearly_full(location: str | os.PathLike[str]) -> bool:
    path = Path(location)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < _FULL_BELOW_BYTES
