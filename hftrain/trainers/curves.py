"""``output_dir/training_curves.png`` (``run.CURVES_PNG``): training loss, learning rate, evaluation metrics by step.

Drawn from the trainer's ``log_history`` (the same entries ``trainer_state.json`` holds) at every checkpoint and at
the end of a run, by the main process, with matplotlib's file-only Agg backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def render_curves(log_history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Draw the curves of ``log_history`` into ``path`` (written atomically); None when nothing was logged yet.

    Args:
        log_history: entries with ``step`` and ``loss``/``learning_rate`` (training) or ``eval_*`` (evaluation).
        path: the PNG to write.
    """
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in log_history if "loss" in h]
    evals = [h for h in log_history if "eval_loss" in h]
    if not train:
        return None
    metrics = sorted({k for h in evals for k in h if k.startswith("eval_") and k not in ("eval_loss", "eval_samples")})
    figure, (loss_axis, lr_axis, metric_axis) = plt.subplots(1, 3, figsize=(13, 3.6))
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
    figure.tight_layout()
    path = Path(path)
    staging = path.with_name(path.name + ".tmp.png")
    figure.savefig(staging, dpi=90)
    plt.close(figure)
    os.replace(staging, path)
    return path
