"""Errors that hftrain reports to users as one line and exit code 2."""

from __future__ import annotations


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
