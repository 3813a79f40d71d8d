"""``output_dir/training_curves.png`` (``run.CURVES_PNG``): training loss, learning rate, evaluation metrics by step.

Drawn from the trainer's ``log_history`` (the same entries ``trainer_state.json`` holds) at every checkpoint and at
the end of a run, by the main process, with matplotlib's object-oriented Agg canvas (no ``pyplot``: it is not
thread-safe and costs ~0.3 s more to import). :class:`BackgroundPainter` draws in a background thread, so a picture
never holds up a training step, the final evaluation or the export: the first drawing imports matplotlib (~0.4 s)
and each takes ~0.2 s, which a short job used to pay on its critical path twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
    metrics = sorted({k for h in evals for k in h if k.startswith("eval_") and k not in ("eval_loss", "eval_samples")})
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


def save_figure(figure: Any, path: str | Path) -> Path:
    """``figure`` laid out and written to ``path`` as a PNG, atomically (a staging file renamed over it)."""
    import os

    figure.tight_layout()
    path = Path(path)
    staging = path.with_name(path.name + ".tmp.png")
    figure.savefig(staging, dpi=90)
    os.replace(staging, path)
    return path


class BackgroundPainter:
    """Draws a picture (``render(data, path)``) in a background thread, one drawing at a time, from the caller's copy
    of the data.

    A thread per drawing (not a pool that outlives it: a process forked later, as Accelerate's notebook launcher
    does, must not inherit a pool's lock). A picture that cannot be written (``OSError``) is a warning, never a
    stopped run; any other failure is raised by the next :meth:`draw` or :meth:`wait`.

    Args:
        render: draws ``data`` into ``path``.
        path: the PNG to write.
        warn: called with one line when the picture cannot be written.
    """

    def __init__(self, render: Callable[[Any, Path], Any], path: str | Path, warn: Callable[[str], None]) -> None:
        self.render = render
        self.path = Path(path)
        self._warn = warn
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.drawn_version: Any = None  # what the last drawing started from (nothing new: no drawing)

    def draw(self, data: Any, *, version: Any) -> None:
        """Start drawing ``data`` (a copy the caller no longer changes) after the drawing in flight, if any; the same
        ``version`` as the last drawing's: no-op."""
        if version == self.drawn_version:
            return
        self.wait()
        self.drawn_version = version
        self._thread = threading.Thread(target=self._render, args=(data,), name=f"hftrain-{self.path.stem}")
        self._thread.start()

    def _render(self, data: Any) -> None:
        try:
            self.render(data, self.path)
        except OSError as error:  # a picture is not worth stopping the run for (and only this rank would)
            self._warn(f"warning: {self.path.name} not drawn ({error.strerror or error})")
        except BaseException as error:  # raised in the training thread by wait()
            self._error = error

    def wait(self) -> None:
        """Wait for the drawing in flight, if any; raise what it failed with (other than a file error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def curves_painter(path: str | Path, warn: Callable[[str], None]) -> BackgroundPainter:
    """The painter of ``training_curves.png``: ``draw([dict(h) for h in log_history], version=len(log_history))``."""
    return BackgroundPainter(render_curves, path, warn)
