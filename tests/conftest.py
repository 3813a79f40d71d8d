"""Fixtures shared by several test files."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Callable[[str, str], Path]]:
    """Mount small tmpfs file systems (root only); yields a function that mounts one at a path with given options.

    A real full or read-only disk, where the tests need one; skipped with the reason where it cannot be mounted.
    """
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode})")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):  # lazily: a failed writer's file may still be open in a kept traceback
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def assert_refused(stderr: str, code: int, fragment: str) -> None:
    """A bad input's refusal: exit code 2, exactly one ``hftrain: error:`` line holding ``fragment``, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("hftrain: error:")]
    assert code == 2, (code, stderr[-2000:])
    assert len(errors) == 1, lines
    assert "Traceback" not in stderr
    assert fragment in errors[0], errors[0]
