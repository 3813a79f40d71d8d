"""Classification metrics that load offline from evaluate modules shipped inside hftrain.

`evaluate.load("accuracy")` fetches a script from the Hugging Face Hub; loading the copies in
`hftrain/metrics/modules/` instead needs no network.
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
    predicted = _as_class_ids(predictions)
    expected = _as_class_ids(references)
    average = "binary" if num_labels == 2 else "macro"
    accuracy = load_metric("accuracy").compute(predictions=predicted, references=expected)
    f1 = load_metric("f1").compute(predictions=predicted, references=expected, average=average)
    return {"accuracy": float(accuracy["accuracy"]), "f1": float(f1["f1"])}


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
