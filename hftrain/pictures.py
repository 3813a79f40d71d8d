"""The pictures a run draws into ``output_dir``, and the painter that draws them in a child process.

- ``training_curves.png`` (``run.CURVES_PNG``): training loss, learning rate and evaluation metrics by step, from the
  trainer's ``log_history`` (the entries ``trainer_state.json`` holds), at every checkpoint and at the end of a run;
- ``expert_load.png`` (``trainers.experts.EXPERT_LOAD_PNG``): each expert's share of its MoE layer's tokens.

Drawn with matplotlib's object-oriented Agg canvas (no ``pyplot``: it keeps global state and costs ~0.3 s more to
import). :class:`BackgroundPainter` sends each drawing to a child process (``python -m hftrain.pictures serve``, one
JSON request per line on its stdin, one answer per line on its stdout), not to a thread of the training process:
matplotlib's import and a drawing are ~0.5 s of Python, which a thread runs under the training process's GIL, so
whatever the main thread did meanwhile (the export after the final evaluation, a training step after a checkpoint)
waited for it (the export of the 1,000-row default job took 0.46 s longer beside a drawing thread).

The child lives as long as its painter and imports matplotlib once, when it starts; :func:`prestart` starts one at
the beginning of a job, where the job's own imports keep one core busy and the other idle, and the first painter
takes it. A child started for each drawing cost the run's last drawing ~0.4 s of interpreter and import on top of
its 0.18 s, beside the final checkpoint's write and the export (the 1,000-row default job's end, from the final
evaluation to the saved model, took 0.94 s with it and 0.70 s without the drawing). The child runs at the lowest
priority (``nice 19``): it takes idle CPU time only. On a CPU, torch's threads take every core, and one of them
preempted by a drawing holds up every parallel region of a step; when the run waits for its last drawing (``close``),
the cores are idle and the drawing has them.

A picture is a by-product: a drawing that fails, for whatever reason, is one warning line and never stops the run or
decides its exit code. The child runs in a session of its own, so that a signal to the job's process group
(``kill -TERM -PGID``, ``timeout``, Slurm's signal to a job step; preemption, ``hftrain/checkpoint/preemption.py``)
reaches the training process only, which checkpoints and exits 75 while its drawing process draws on. Out of the
group, the child still ends with its parent: at the empty line :meth:`BackgroundPainter.close` sends, at the end of
its stdin, and on Linux at its parent's death whatever killed it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOWEST_PRIORITY = 19
"""The drawing process's niceness: it takes idle CPU time only."""


def render_curves(log_history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Draw the curves of ``log_history`` into ``path`` (written atomically); None when nothing was logged yet.

    Args:
        log_history: entries with ``step`` and ``loss``/``learning_rate`` (training) or ``eval_*`` (evaluation).
        path: the PNG to write.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train = [h for h in log_history if "loss" in h]
    evals = [h for h in log_history if "eval_loss" in h]
    if not train:
        return None
    # the counts of what was evaluated (examples, a language model's target tokens) are not metrics to plot
    counts = ("eval_loss", "eval_samples", "eval_tokens")
    metrics = sorted({k for h in evals for k in h if k.startswith("eval_") and k not in counts})
    figure = Figure(figsize=(13, 3.6))
    FigureCanvasAgg(figure)
    loss_axis, lr_axis, metric_axis = figure.subplots(1, 3)
    steps = [h["step"] for h in train]
    loss_axis.plot(steps, [h["loss"] for h in train], label="training loss", lw=1)
    if evals:
        loss_axis.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="evaluation loss")
    loss_axis.set(title="loss", xlabel="optimizer step")
    loss_axis.legend()
    lr_axis.plot(steps, [h["learning_rate"] for h in train], color="tab:green")
    lr_axis.set(title="learning rate", xlabel="optimizer step")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for name in metrics:
        metric_axis.plot([h["step"] for h in evals], [h[name] for h in evals], "o-", label=name.removeprefix("eval_"))
    metric_axis.set(title="evaluation metrics", xlabel="optimizer step")
    if metrics:
        metric_axis.legend()
    else:
        metric_axis.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=metric_axis.transAxes)
    return save_figure(figure, path)


def render_expert_load(counts: list[list[float]], path: str | Path) -> Path | None:
    """A heat map of each expert's share of its layer's tokens (layers × experts), numbers in the cells.

    Args:
        counts: tokens per (MoE layer, expert).
        path: the PNG to write (atomically).
    """
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tokens = np.asarray(counts, dtype=np.float64)
    if tokens.sum() <= 0:
        return None
    share = tokens / np.maximum(tokens.sum(axis=1, keepdims=True), 1)
    layers, experts = share.shape
    figure = Figure(figsize=(max(4.0, 0.7 * experts + 2), max(2.5, 0.45 * layers + 1.5)))
    FigureCanvasAgg(figure)
    axis = figure.subplots()
    image = axis.imshow(share, cmap="viridis", vmin=0, aspect="auto")
    axis.set(
        title=f"tokens per expert (ideal {1 / experts:.2f} each)",
        xlabel="expert",
        ylabel="MoE layer",
        xticks=range(experts),
        yticks=range(layers),
    )
    if layers * experts <= 256:
        for row in range(layers):
            for col in range(experts):
                axis.text(col, row, f"{share[row, col]:.2f}", ha="center", va="center", color="white", fontsize=7)
    figure.colorbar(image, ax=axis, label="share of the layer's tokens")
    return save_figure(figure, path)


def save_figure(figure: Any, path: str | Path) -> Path:
    """``figure`` laid out and written to ``path`` as a PNG, atomically: drawn into memory, then a new file renamed
    over ``path`` (``files.write_file``), so that a link planted at ``path`` (or at a staging name beside it) is
    replaced, never written through, and a FIFO there is never opened."""
    import io

    from hftrain.files import write_file

    figure.tight_layout()
    path = Path(path)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    write_file(path, buffer.getvalue())
    return path


RENDERERS: dict[str, Callable[[Any, Path], Path | None]] = {
    "curves": render_curves,
    "expert_load": render_expert_load,
}


class BackgroundPainter:
    """Draws a picture (``RENDERERS[kind](data, path)``) in a child process, one drawing at a time.

    A drawing that fails is one warning line from the next :meth:`draw` or :meth:`wait`, never a stopped run: a
    picture that cannot be written (an ``OSError`` in the child), a renderer's error (the child's error line), a
    child that ended (killed, out of memory; the next drawing starts another) or that cannot be started. Data JSON
    cannot carry is the caller's bug, raised by :meth:`draw` itself.

    Args:
        kind: a key of :data:`RENDERERS`.
        path: the PNG to write.
        warn: called with one line when the picture cannot be written.
    """

    def __init__(self, kind: str, path: str | Path, warn: Callable[[str], None]) -> None:
        if kind not in RENDERERS:
            raise ValueError(f"unknown picture {kind!r}; one of {', '.join(RENDERERS)}")
        self.kind = kind
        self.path = Path(path)
        self._warn = warn
        self._child: _Child | None = None
        self.drawing = False  # a drawing is in flight
        self.drawn_version: Any = None  # what the last drawing started from (nothing new: no drawing)

    def draw(self, data: Any, *, version: Any) -> None:
        """Start drawing ``data`` after the drawing in flight, if any; the same ``version`` as the last drawing's:
        no-op.

        Args:
            data: what the renderer draws (JSON-able).
            version: what the data is of (a drawing of the same version is not repeated).
        """
        if version == self.drawn_version:
            return
        self.wait()
        request = json.dumps({"kind": self.kind, "path": str(self.path), "data": data}).encode() + b"\n"
        self.drawn_version = version
        if self._child is None:
            try:
                self._child = _take_spare() or _Child()
            except OSError as error:  # no process to draw in (no interpreter path, no memory to start one)
                self._warn(f"warning: {self.path.name} not drawn ({error.strerror or error})")
                return
        self._child.send(request)
        self.drawing = True

    def wait(self) -> None:
        """Wait for the drawing in flight, if any; one warning line if it failed."""
        if not self.drawing:
            return
        self.drawing = False
        answer = self._child.receive()
        if answer is None:  # the child ended: its last error line says why; the next drawing starts another
            child, self._child = self._child, None
            self._warn(f"warning: {self.path.name} not drawn (the drawing process ended: {child.close()})")
        elif answer["status"] != "drawn":  # a file error or the renderer's: a picture never stops the run (and
            self._warn(f"warning: {self.path.name} not drawn ({answer['why']})")  # only the main process draws)

    def close(self) -> None:
        """Wait for the drawing in flight, then end the child."""
        try:
            self.wait()
        finally:
            if self._child is not None:
                self._child.close()
                self._child = None


class _Child:
    """A ``python -m hftrain.pictures serve`` process; its stderr goes to a temporary file (a pipe nobody reads could
    fill and stop it), read when it ends.

    It starts a session of its own (out of the job's process group: a signal to the group is the training process's
    to handle, not a kill of the drawing) and ends when this process does (:func:`_end_with_parent`).
    """

    def __init__(self) -> None:
        self._errors = tempfile.TemporaryFile()
        self.parent = os.getpid()
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, "serve", str(LOWEST_PRIORITY), str(self.parent)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env=_child_environment(),
            start_new_session=True,
        )

    def send(self, request: bytes) -> None:
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
        except BrokenPipeError:  # the child ended: receive() finds no answer, close() says why
            pass

    def receive(self) -> dict[str, str] | None:
        """The answer to the request sent last; None when the child ended without one."""
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def close(self) -> str:
        """End the child and return its last error line, or its exit code.

        An empty line tells it to exit: the end of its stdin alone would not come while a process forked from this
        one (a data loader's worker) still holds the pipe's other end.
        """
        with contextlib.suppress(OSError):
            self.process.stdin.write(b"\n")
            self.process.stdin.close()
        code = self.process.wait()
        self.process.stdout.close()
        self._errors.seek(0)
        errors = self._errors.read().decode(errors="replace").strip().splitlines()
        self._errors.close()
        return errors[-1] if errors else f"exit code {code}"


_spare: _Child | None = None


def prestart() -> None:
    """Start a drawing process now, for the first painter to take: a job calls this first thing, so that the child's
    interpreter and matplotlib import run beside the job's own imports, on a core those leave idle. A process that
    cannot start is left to the painter (which warns)."""
    global _spare
    if _spare is None:
        with contextlib.suppress(OSError):
            _spare = _Child()


def discard_spare() -> None:
    """End the prestarted process if no painter took it (a job that failed before its first drawing)."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None:
        spare.close()


def _take_spare() -> _Child | None:
    global _spare
    spare, _spare = _spare, None
    if spare is not None and spare.parent != os.getpid():  # inherited through a fork: its parent's, not ours
        return None
    if spare is not None and spare.process.poll() is not None:  # it ended meanwhile: start another
        spare.close()
        return None
    return spare


def _child_environment() -> dict[str, str]:
    """This environment, with this hftrain first on the child's path (a checkout used without installing it)."""
    package_root = str(Path(__file__).resolve().parents[1])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


PR_SET_PDEATHSIG = 1
"""Linux's ``prctl`` option: the signal this process gets when its parent ends (``<linux/prctl.h>``)."""


def _end_with_parent(parent: int) -> None:
    """End this process when ``parent`` ends, however it ends (a SIGKILL included), on Linux; elsewhere the end of
    stdin ends it, once every process forked from the parent (a data loader's worker) has let go of the pipe.

    The kernel sends the signal when the thread that started this process ends: painters are made in the training
    loop's (main) thread. A parent that ended before the signal was asked for is seen in ``getppid``.

    Args:
        parent: the process id of the painter's process.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _serve(nice: int, parent: int | None = None) -> None:
    """The child: matplotlib imported first, then each request line (``kind``, ``path``, ``data``) drawn and answered
    with one line: ``drawn``, ``cannot_write`` (an ``OSError``) or ``failed`` (the error's line); ends at an empty
    line, at EOF, or when ``parent`` (a process id) ends."""
    if parent is not None:
        _end_with_parent(parent)
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # the answers' own copy of stdout; anything a library
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints goes to stderr instead, never into an answer line
    import matplotlib.backends.backend_agg  # noqa: F401  (what every drawing needs, before the first request)
    import matplotlib.figure  # noqa: F401

    for line in sys.stdin.buffer:
        if not line.strip():  # the painter's close()
            break
        request = json.loads(line)
        try:
            RENDERERS[request["kind"]](request["data"], Path(request["path"]))
            answer = {"status": "drawn"}
        except OSError as error:
            answer = {"status": "cannot_write", "why": str(error.strerror or error)}
        except Exception as error:  # reported to the painter, which raises it; the next request is drawn as usual
            answer = {"status": "failed", "why": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    os._exit(0)  # every answer is written and flushed: the interpreter's teardown (~0.1 s) would only delay close()


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m hftrain.pictures serve NICE [PARENT_PID]  (requests as JSON lines on stdin)")
    _serve(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else None)
