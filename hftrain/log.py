"""A rank-aware logger: only the main process prints unless asked otherwise."""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = "hftrain"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is now (notebooks and test capture replace it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


class _RankFormatter(logging.Formatter):
    """``[rank R] message`` when more than one process runs, read from the environment at each line (not when the
    handler was made: a process whose launcher variables are set later, or a test that sets them, prints right)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return f"[rank {os.environ.get('RANK', '0')}] {line}"
        return line


def get_logger() -> logging.Logger:
    """hftrain's logger; lines are prefixed with the rank when more than one process runs."""
    logger = logging.getLogger(_LOGGER_NAME)
    # checked at every call, not only the first: a library's or a notebook's logging configuration (dictConfig,
    # handlers added to or taken from "hftrain") must not make hftrain's lines vanish or print twice
    if not any(isinstance(handler, _StdoutHandler) for handler in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(_RankFormatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def is_main_process() -> bool:
    """True on global rank 0 (or without a launcher)."""
    return os.environ.get("RANK", "0") == "0"


def log_main(message: str) -> None:
    """Log ``message`` on the main process only."""
    if is_main_process():
        get_logger().info(message)
