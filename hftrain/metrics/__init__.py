"""Classification metrics: the trainer's accuracy and F1, and evaluate modules shipped inside hftrain.

`evaluate.load("accuracy")` fetches a script from the Hugging Face Hub; loading the copies in
`hftrain/metrics/modules/` (:func:`load_metric`) instead needs no network.

The trainer's own metrics (:func:`compute_classification_metrics`) are counted with NumPy instead: accuracy and
F1 are a few counts of the confusion matrix, and computing them through evaluate imports evaluate, scikit-learn and
SciPy, 1.4 s or more per process before the first evaluation, which a short run pays in full (issue 22). The
counts are scikit-learn's definitions (binary F1 of label 1; macro F1 over the labels present in either array),
and `tests/test_metrics.py` checks them against scikit-learn.
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
