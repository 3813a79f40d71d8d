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

    Args:
        message: what is wrong, naming the field or file, and how to fix it.
    """

    exit_code = 2


class ConfigError(HFTrainError):
    """A config key, value or combination is invalid."""


class DataError(HFTrainError):
    """A data file, column or label is invalid."""


class UsageError(HFTrainError):
    """The command line itself is malformed (unknown subcommand, missing argument)."""


class WriteError(HFTrainError):
    """A file of the run could not be written (disk full, read-only, permission denied)."""


# errno values that mean "this location cannot take the write", not "hftrain has a bug".
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}
_BAD_PATH = {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG}
# A write that failed on a file system with less free space than this failed for want of space.
_FULL_BELOW_BYTES = 1 << 20


def one_line(error: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for embedding in a message.

    Args:
        error: the library exception.
    """
    if isinstance(error, KeyError) and error.args:  # str(KeyError) is only the quoted key
        return f"missing key {error.args[0]!r}"
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


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
        location: the file or folder being written (its file system is checked for free space).
        last_checkpoint: returns the last complete checkpoint (None when there is none), named in the message
            so the user knows what survived.
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

    Args:
        error: what the writer raised.
        what: what was being written and where.
        location: the file or folder being written.
        last_checkpoint: returns the last complete checkpoint, or None.
    """
    code = getattr(error, "errno", None)
    text = str(error)
    # torch.save reports ENOSPC as "unexpected pos ..." and safetensors as "(os error 28)": ask the disk itself.
    if code in _NO_SPACE or "os error 28" in text or "No space left" in text or _nearly_full(location):
        last = last_checkpoint() if last_checkpoint is not None else None
        survived = f"the last complete checkpoint is {last}" if last else "there is no complete checkpoint yet"
        return WriteError(f"no space left on device while writing {what}; {survived}; free space and rerun")
    if code in _NOT_WRITABLE:
        return WriteError(
            f"cannot write {what}: {error.strerror} ({error.filename}); choose a writable output_dir or fix "
            "its permissions"
        )
    if code in _BAD_PATH:
        return WriteError(f"cannot write {what}: {error.strerror} ({error.filename}); fix the path")
    return error


def _nearly_full(location: str | os.PathLike[str]) -> bool:
    path = Path(location)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < _FULL_BELOW_BYTES
