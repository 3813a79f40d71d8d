"""The tasks' metrics: the trainer's accuracy and F1, multi-label F1, regression errors and correlation, and
evaluate modules shipped inside hftrain.

`evaluate.load("accuracy")` fetches a script from the Hugging Face Hub; loading the copies in
`hftrain/metrics/modules/` (:func:`load_metric`) instead needs no network.

The trainer's own metrics (:func:`compute_classification_metrics`) are counted with NumPy instead: accuracy and
F1 are a few counts of the confusion matrix, and computing them through evaluate imports evaluate, scikit-learn and
SciPy, 1.4 s or more per process before the first evaluation, which a short run pays in full (issue 22). The
counts are scikit-learn's definitions (binary F1 of label 1; macro F1 over the labels present in either array;
multi-label: subset accuracy, micro F1 over every (example, label) pair, macro F1 over all labels), and
`tests/test_metrics.py` checks them against scikit-learn and SciPy (Pearson's r).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError

if TYPE_CHECKING:
    import evaluate

MODULES_DIR = Path(__file__).resolve().parent / "modules"
SHIPPED_METRICS: tuple[str, ...] = ("accuracy", "f1")


def load_metric(name: str) -> evaluate.EvaluationModule:
    """Load a metric shipped with hftrain, without network access.

    Args:
        name: "accuracy" or "f1".
    """
    if name not in SHIPPED_METRICS:
        raise ConfigError(
            f"unknown metric {name!r}; the metrics shipped with hftrain are: {', '.join(SHIPPED_METRICS)}"
        )
    # Read when evaluate is first imported; keeps it from ever asking the hub. setdefault lets
    # users override it.
    os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
    import evaluate

    # A fresh module per call (a reload takes milliseconds), so callers never share add_batch state.
    # keep_in_memory: no arrow cache files, so processes sharing a home directory never collide.
    return evaluate.load(str(MODULES_DIR / name), keep_in_memory=True)


def compute_classification_metrics(predictions: Any, references: Any, *, num_labels: int) -> dict[str, float]:
    """Compute accuracy and F1 (binary for 2 labels, else macro) of class predictions.

    Args:
        predictions: predicted class ids, shape (n,), or logits/probabilities, shape (n, num_labels).
        references: true class ids, shape (n,).
        num_labels: number of classes (model.num_labels).
    """
    if num_labels < 2:
        raise ConfigError(f"model.num_labels: classification metrics need at least 2 labels, got {num_labels}")
    import numpy as np

    predicted = np.asarray(_as_class_ids(predictions), dtype=np.int64)
    expected = np.asarray(_as_class_ids(references), dtype=np.int64)
    if predicted.shape != expected.shape or predicted.size == 0:
        raise ValueError(f"{predicted.size} predictions for {expected.size} references")
    accuracy = float((predicted == expected).mean())
    labels = [1] if num_labels == 2 else np.union1d(predicted, expected).tolist()
    f1 = float(np.mean([_f1(predicted == label, expected == label) for label in labels]))
    return {"accuracy": accuracy, "f1": f1}


def compute_multi_label_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """Subset accuracy and micro / macro F1 of multi-hot predictions (scikit-learn's ``accuracy_score`` and
    ``f1_score(average="micro" | "macro")`` on multi-label indicators).

    Args:
        predictions: 0/1 predictions, shape (n, num_labels).
        references: 0/1 true labels, shape (n, num_labels).
    """
    import numpy as np

    predicted = np.asarray(predictions, dtype=np.int64).astype(bool)
    expected = np.asarray(references, dtype=np.int64).astype(bool)
    if predicted.shape != expected.shape or predicted.ndim != 2 or predicted.size == 0:
        raise ValueError(f"predictions of shape {predicted.shape} for references of shape {expected.shape}")
    per_label = [_f1(predicted[:, label], expected[:, label]) for label in range(expected.shape[1])]
    return {
        "accuracy": float((predicted == expected).all(axis=1).mean()),
        "f1_micro": _f1(predicted, expected),
        "f1_macro": float(np.mean(per_label)),
    }


def compute_regression_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """Mean squared error, its root, mean absolute error and Pearson's r of predicted numbers (r is 0 where either
    side is constant: no correlation can be measured).

    Args:
        predictions: predicted values, shape (n,).
        references: true values, shape (n,).
    """
    import numpy as np

    predicted = np.asarray(predictions, dtype=np.float64).reshape(-1)
    expected = np.asarray(references, dtype=np.float64).reshape(-1)
    if predicted.shape != expected.shape or predicted.size == 0:
        raise ValueError(f"{predicted.size} predictions for {expected.size} references")
    error = predicted - expected
    mse = float(np.mean(error**2))
    centred_p, centred_e = predicted - predicted.mean(), expected - expected.mean()
    spread = float(np.sqrt((centred_p**2).sum() * (centred_e**2).sum()))
    pearson = float((centred_p * centred_e).sum() / spread) if spread > 0 else 0.0
    return {"mse": mse, "rmse": mse**0.5, "mae": float(np.mean(np.abs(error))), "pearson": pearson}


HEADLINE_METRICS: tuple[tuple[str, str], ...] = (
    ("accuracy", "f1"),
    ("f1_micro", "f1_macro"),
    ("rmse", "pearson"),
    ("loss", "perplexity"),
)
"""The two numbers a finished run reports, by task: the first pair whose keys its metrics hold."""


def headline(metrics: dict[str, float]) -> tuple[tuple[str, float], tuple[str, float]] | None:
    """The task's two headline metrics from ``eval_*`` metrics: ``(("accuracy", 0.8), ("f1", 0.7))``, or None.

    Args:
        metrics: a run's final metrics (``eval_accuracy``, ``eval_f1``, ...).
    """
    for first, second in HEADLINE_METRICS:
        if f"eval_{first}" in metrics and f"eval_{second}" in metrics:
            return (first, metrics[f"eval_{first}"]), (second, metrics[f"eval_{second}"])
    return None


def _f1(predicted: Any, expected: Any) -> float:
    """F1 of one label from boolean arrays: ``2·tp / (2·tp + fp + fn)``, 0 when the label is nowhere (as
    scikit-learn's ``zero_division``)."""
    true_positives = int((predicted & expected).sum())
    wrong = int((predicted ^ expected).sum())  # false positives + false negatives
    return 2 * true_positives / (2 * true_positives + wrong) if true_positives + wrong else 0.0


def _as_class_ids(values: Any) -> list[int]:
    """Turn a list, numpy array or tensor of ids (or 2-D logits) into a list of ints.

    Args:
        values: class ids, shape (n,), or scores, shape (n, num_labels).
    """
    import numpy as np

    if hasattr(values, "detach"):  # torch tensor, possibly on GPU
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim == 2:
        array = array.argmax(axis=-1)
    return array.astype(np.int64).tolist()
