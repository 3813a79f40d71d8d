"""The pipeline timeline: wall-clock F/B events per rank, the measured bubble, and a PNG of the schedule.

A :class:`TimelineRecorder` on each pipeline rank collects ``Event``s (the schedules' stages report each
micro-batch's forward ``F``, backward ``B`` and, for zero-bubble schedules, weight-gradient ``W``);
:func:`gather_events` brings them to every rank of the pipeline group; :func:`render_timeline` draws one
step (ranks as rows, boxes over time, idle gaps left blank) with the measured bubble next to the formula.
Times are ``time.time()`` so that ranks on one host share a clock; on several hosts the picture is only as
good as their clock sync (the bubble is computed per rank and is not affected by clock offsets of whole ranks
beyond the step span). On a GPU the host only launches kernels, so a span timed on the host is the launch, not
the work: there each pass is bracketed by CUDA events (:meth:`TimelineRecorder.record_device`), placed on the host
clock from an event recorded with the step's start, and resolved when the events are gathered (a sync then, not
per pass).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

KIND_COLORS = {"F": ("#9ecae1", "#4292c6"), "B": ("#fdae6b", "#e6550d"), "W": ("#a1d99b", "#31a354")}


class Event(NamedTuple):
    """One micro-batch's forward (``F``), backward (``B``) or weight pass (``W``) on one chunk."""

    step: int
    rank: int  # pipeline rank (the row of the picture)
    chunk: int  # global stage index: pp_rank + k · pp
    microbatch: int
    kind: str
    start: float  # seconds, time.time()
    end: float


class TimelineRecorder:
    """Collects this pipeline rank's events; schedules call :meth:`begin_step` and :meth:`record`.

    Args:
        pp_rank: this rank's index in the pipeline group (the row it is drawn in).
        max_steps: keep the events of at most this many recent steps (a long run must not grow without bound).
    """

    def __init__(self, pp_rank: int, *, max_steps: int = 8) -> None:
        self.pp_rank = pp_rank
        self.max_steps = max_steps
        self.step = -1
        self.events: list[Event] = []
        self._pending: list[tuple] = []  # device-timed passes (step, chunk, micro-batch, kind, events, anchor)
        self._anchor: tuple[float, Any] | None = None  # (host time, CUDA event) of the current step's start

    def begin_step(self) -> None:
        """Start a new training step; events of steps older than ``max_steps`` are dropped."""
        self.step += 1
        self._anchor = None
        oldest = self.step - self.max_steps + 1
        if self.events and self.events[0].step < oldest:
            self.events = [e for e in self.events if e.step >= oldest]
        if self._pending and self._pending[0][0] < oldest:
            self._pending = [p for p in self._pending if p[0] >= oldest]

    def record_device(self, chunk: int, microbatch: int, kind: str, start: Any, end: Any) -> None:
        """Record one pass timed by two CUDA events (``enable_timing=True``), resolved in :meth:`resolve`.

        Args:
            chunk: global stage index of the chunk.
            microbatch: micro-batch index within the step.
            kind: ``"F"``, ``"B"`` or ``"W"``.
            start: the event recorded before the pass's kernels.
            end: the event recorded after them.
        """
        if self._anchor is None:  # the step's first pass: its start event ties the device clock to the host's
            self._anchor = (time.time(), start)
        self._pending.append((max(self.step, 0), chunk, microbatch, kind, start, end, self._anchor))

    def resolve(self) -> None:
        """Turn the device-timed passes into events on the host clock (waits for their kernels)."""
        for step, chunk, microbatch, kind, start, end, (wall, anchor) in self._pending:
            end.synchronize()
            begin = wall + anchor.elapsed_time(start) / 1000
            finish = begin + start.elapsed_time(end) / 1000
            self.events.append(Event(step, self.pp_rank, chunk, microbatch, kind, begin, finish))
        self._pending = []

    def record(self, chunk: int, microbatch: int, kind: str, start: float, end: float) -> None:
        """Record one event of the current step.

        Args:
            chunk: global stage index of the chunk.
            microbatch: micro-batch index within the step.
            kind: ``"F"``, ``"B"`` or ``"W"``.
            start: wall-clock start (``time.time()``).
            end: wall-clock end.
        """
        self.events.append(Event(max(self.step, 0), self.pp_rank, chunk, microbatch, kind, start, end))


def gather_events(recorder: TimelineRecorder, group: Any = None) -> list[Event]:
    """All pipeline ranks' events, on every rank of ``group`` (collective over it).

    Args:
        recorder: this rank's recorder.
        group: the pipeline process group.
    """
    import torch.distributed as dist

    recorder.resolve()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, recorder.events, group=group)
    return [Event(*e) for events in gathered for e in events]


def _one_step(events: list[Event], step: int | None) -> list[Event]:
    if not events:
        raise ValueError("no pipeline events were recorded")
    step = max(e.step for e in events) if step is None else step
    chosen = [e for e in events if e.step == step]
    if not chosen:
        raise ValueError(f"no pipeline events for step {step}")
    return chosen


def measured_bubble(events: list[Event], *, step: int | None = None) -> float:
    """Idle fraction of one step: ``1 - mean over ranks of busy time / step span``.

    The span runs from the first event's start to the last event's end over all ranks, so communication
    waits and stragglers count as bubble, as they do in practice.

    Args:
        events: events of all pipeline ranks (from :func:`gather_events`).
        step: the step to measure; the last recorded one by default.
    """
    chosen = _one_step(events, step)
    span = max(e.end for e in chosen) - min(e.start for e in chosen)
    ranks = sorted({e.rank for e in chosen})
    busy = [sum(e.end - e.start for e in chosen if e.rank == r) for r in ranks]
    return 1.0 - sum(busy) / (len(ranks) * span)


def theoretical_bubble(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The ideal idle fraction ``(p-1)/(v·m+p-1)`` (GPipe and 1F1B: ``v = 1``).

    Args:
        pp: pipeline-parallel size ``p``.
        num_microbatches: micro-batches per step ``m``.
        virtual_stages: chunks per rank ``v`` (interleaved schedules).
    """
    return (pp - 1) / (virtual_stages * num_microbatches + pp - 1)


def bubble_formula(virtual_stages: int = 1) -> str:
    """The formula :func:`theoretical_bubble` evaluates, as text for titles and tables.

    Args:
        virtual_stages: chunks per rank.
    """
    return "(p-1)/(v·m+p-1)" if virtual_stages > 1 else "(p-1)/(m+p-1)"


def render_timeline(
    events: list[Event],
    path: Any,
    *,
    schedule: str,
    pp: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    step: int | None = None,
) -> str:
    """Draw one step's schedule as a PNG: pipeline ranks as rows, F/B boxes over time, labelled by micro-batch.

    Args:
        events: events of all pipeline ranks.
        path: the PNG to write (parent folders are created).
        schedule: schedule name, for the title.
        pp: pipeline-parallel size.
        num_microbatches: micro-batches per step.
        virtual_stages: chunks per rank.
        step: the step to draw; the last recorded one by default.

    Returns:
        The path written, as a string.
    """
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training nodes
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    chosen = _one_step(events, step)
    t0 = min(e.start for e in chosen)
    span_ms = (max(e.end for e in chosen) - t0) * 1e3
    measured = measured_bubble(chosen)
    ideal = theoretical_bubble(pp, num_microbatches, virtual_stages)
    fig, ax = plt.subplots(figsize=(max(8.0, min(20.0, 0.45 * len(chosen) / pp + 6)), 1.0 + 0.7 * pp), dpi=110)
    for e in chosen:
        left, width = (e.start - t0) * 1e3, (e.end - e.start) * 1e3
        shade = KIND_COLORS[e.kind][(e.chunk // pp) % 2]  # a rank's second virtual chunk in the darker shade
        ax.barh(e.rank, width, left=left, height=0.8, color=shade, edgecolor="black", linewidth=0.5)
        if width > span_ms / 90:
            ax.text(left + width / 2, e.rank, f"{e.kind}{e.microbatch}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)  # rank 0 (the first stage) on top
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time in step (ms); blank = idle (bubble)")
    ax.set_title(
        f"{schedule}: p={pp}, m={num_microbatches}, v={virtual_stages} — measured bubble {measured:.1%}, "
        f"theory {bubble_formula(virtual_stages)} = {ideal:.1%}",
        fontsize=9,
    )
    names = {"F": "forward", "B": "backward", "W": "weight grad"}
    kinds = [k for k in names if any(e.kind == k for e in chosen)]
    legend = [Patch(color=KIND_COLORS[k][0], label=names[k]) for k in kinds]
    if virtual_stages > 1:
        legend.append(Patch(color=KIND_COLORS["F"][1], label="darker: 2nd chunk"))
    # outside the axes, so that it never hides a box
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return str(out)
