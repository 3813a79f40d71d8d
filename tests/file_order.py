"""Longest files first: the order in which the two test workers take the suite's files.

``scripts/test.sh`` runs two pytest-xdist workers that each take whole files (``--dist loadfile``) in collection
order (``--no-loadscope-reorder``; xdist's own reorder puts the files with the most tests first, which left the
files with a few long multi-process fixtures, the suite's most expensive, to the end, where one worker ran them
alone while the other had nothing left). Here the files are sorted by the wall time each took in a recorded run
(``tests/durations.json``), longest first: the greedy longest-processing-time order, whose tail is the shortest
files. A file not in the record (a new one) is taken first, as if it were the longest, so it never becomes the tail
unseen.

Record the times again after adding or changing expensive tests (one full run; the figures are per file: setup,
call and teardown of all its tests, as the worker saw them)::

    HFTRAIN_RECORD_DURATIONS=tests/durations.json bash scripts/test.sh
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

RECORD = Path(__file__).with_name("durations.json")


def recorded(path: Path = RECORD) -> dict[str, float]:
    """``test file (relative to the repository) -> seconds`` from the last recorded run; empty without one."""
    return json.loads(path.read_text()) if path.is_file() else {}


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` grouped by file, the files in decreasing recorded time (unrecorded ones first), each file's tests
    in their own order (its module fixtures are built once, by its first test)."""
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(_file_of(item.nodeid), len(order))
    unseen = float("inf")
    rank = {f: (-seconds.get(f, unseen), position) for f, position in order.items()}
    return sorted(items, key=lambda item: rank[_file_of(item.nodeid)])


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class DurationRecorder:
    """Sums each file's setup, call and teardown times from the test reports (on the xdist controller, which
    receives every worker's reports) and writes them to ``HFTRAIN_RECORD_DURATIONS`` at the end of the session."""

    def __init__(self, target: str) -> None:
        self.target = Path(target)
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, report) -> None:
        self.seconds[_file_of(report.nodeid)] += report.duration

    def write(self) -> None:
        ordered = dict(sorted(((f, round(s, 1)) for f, s in self.seconds.items()), key=lambda kv: -kv[1]))
        self.target.write_text(json.dumps(ordered, indent=1) + "\n")


def recorder_from_environment() -> DurationRecorder | None:
    target = os.environ.get("HFTRAIN_RECORD_DURATIONS")
    return DurationRecorder(target) if target else None
