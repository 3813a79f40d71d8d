"""The pictures a run draws into ``output_dir``, and the painter that draws them in a child process.

- ``training_curves.png`` (``run.CURVES_PNG``): training loss, learning rate and evaluation metrics by step, from the
  trainer's ``log_history`` (the entries ``trainer_state.json`` holds), at every checkpoint and at the end of a run;
- ``expert_load.png`` (``trainers.experts.EXPERT_LOAD_PNG``): each expert's share of its MoE layer's tokens.

Drawn with matplotlib's object-oriented Agg canvas (no ``pyplot``: it keeps global state and costs ~0.3 s more to
import). :class:`BackgroundPainter` runs the drawing in a child process (``python -m hftrain.pictures KIND PATH``,
the data as JSON on its stdin), not in a thread of the training process: matplotlib's import and a drawing are
~0.4 s of Python, which a thread runs under the training process's GIL, so whatever the main thread did meanwhile
(the export after the final evaluation, a training step after a checkpoint) waited for it (the export of the
1,000-row default job took 0.46 s longer beside a drawing thread). A child process shares no lock, and this module
imports nothing heavy at the top, so the child starts in ~50 ms. A drawing during training runs at the lowest
priority (it takes idle CPU time only), the run's last one at normal priority (the run waits for it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CANNOT_WRITE_EXIT = 3
"""The child's exit code when the picture cannot be written (its stderr's last line says why)."""
LOWEST_PRIORITY = 19
"""The niceness of a drawing nobody waits for yet."""


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
    """``figure`` laid out and written to ``path`` as a PNG, atomically (a staging file renamed over it)."""
    figure.tight_layout()
    path = Path(path)
    staging = path.with_name(path.name + ".tmp.png")
    figure.savefig(staging, dpi=90)
    os.replace(staging, path)
    return path


RENDERERS: dict[str, Callable[[Any, Path], Path | None]] = {
    "curves": render_curves,
    "expert_load": render_expert_load,
}


class BackgroundPainter:
    """Draws a picture (``RENDERERS[kind](data, path)``) in a child process, one drawing at a time.

    A picture that cannot be written (an ``OSError`` in the child) is a warning, never a stopped run; any other
    failure of the drawing is raised by the next :meth:`draw` or :meth:`wait`, with the child's error line, and data
    JSON cannot carry by :meth:`draw` itself.

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
        self._child: subprocess.Popen[bytes] | None = None
        self.drawn_version: Any = None  # what the last drawing started from (nothing new: no drawing)

    def draw(self, data: Any, *, version: Any, awaited: bool = False) -> None:
        """Start drawing ``data`` after the drawing in flight, if any; the same ``version`` as the last drawing's:
        no-op.

        Args:
            data: what the renderer draws (JSON-able).
            version: what the data is of (a drawing of the same version is not repeated).
            awaited: the caller waits for this drawing next (the end of a run): drawn at normal priority. Otherwise at
                the lowest (``nice 19``), so that a drawing during training takes only idle CPU time: on a CPU,
                torch's threads take every core, and one of them preempted by the drawing holds up every parallel
                region of the step.
        """
        if version == self.drawn_version:
            return
        self.wait()
        payload = json.dumps(data).encode()  # before the child starts: a value JSON cannot carry is the caller's
        self.drawn_version = version
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, self.kind, str(self.path), "0" if awaited else str(LOWEST_PRIORITY)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=_child_environment(),
            )
        except OSError as error:  # no process to draw in (no interpreter path, no memory to start one): as a file error
            self._warn(f"warning: {self.path.name} not drawn ({error.strerror or error})")
            return
        try:
            self._child.stdin.write(payload)  # the child reads it all first thing: a long history never blocks long
            self._child.stdin.close()
        except BrokenPipeError:  # the child ended early: wait() reports why
            pass

    def wait(self) -> None:
        """Wait for the drawing in flight, if any; raise what it failed with (other than a file error)."""
        child, self._child = self._child, None
        if child is None:
            return
        errors = child.stderr.read().decode(errors="replace").strip().splitlines()
        child.stderr.close()
        code = child.wait()
        why = errors[-1] if errors else f"exit code {code}"
        if code == CANNOT_WRITE_EXIT:  # a picture is not worth stopping the run for (and only this rank would)
            self._warn(f"warning: {self.path.name} not drawn ({why})")
        elif code != 0:
            raise RuntimeError(f"drawing {self.path.name} failed: {why}")


def _child_environment() -> dict[str, str]:
    """This environment, with this hftrain first on the child's path (a checkout used without installing it)."""
    package_root = str(Path(__file__).resolve().parents[1])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _main(argv: list[str]) -> int:
    """The child: ``KIND PATH NICE``, the data as JSON on stdin; exit 0 drawn, 3 cannot write, else the traceback."""
    kind, path, nice = argv
    data = json.loads(sys.stdin.buffer.read())
    if int(nice) and hasattr(os, "nice"):
        os.nice(int(nice))
    try:
        RENDERERS[kind](data, Path(path))
    except OSError as error:
        print(error.strerror or error, file=sys.stderr)
        return CANNOT_WRITE_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
