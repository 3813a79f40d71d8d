"""Tests for hftrain.metrics: offline evaluate modules and classification metrics."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, f1_score

from hftrain.errors import ConfigError
from hftrain.metrics import compute_classification_metrics, load_metric

BINARY_PREDICTIONS = [0, 1, 1, 0, 1, 1, 0, 0]
BINARY_REFERENCES = [0, 1, 0, 0, 1, 0, 1, 0]
MULTI_PREDICTIONS = [0, 1, 2, 2, 1, 0, 2, 1]
MULTI_REFERENCES = [0, 2, 2, 1, 1, 0, 2, 0]


def test_load_metric_accuracy_matches_sklearn() -> None:
    result = load_metric("accuracy").compute(predictions=BINARY_PREDICTIONS, references=BINARY_REFERENCES)
    assert result == {"accuracy": pytest.approx(accuracy_score(BINARY_REFERENCES, BINARY_PREDICTIONS))}


@pytest.mark.parametrize("average", ["binary", "macro", "micro", "weighted"])
def test_load_metric_f1_matches_sklearn(average: str) -> None:
    predictions, references = (
        (BINARY_PREDICTIONS, BINARY_REFERENCES) if average == "binary" else (MULTI_PREDICTIONS, MULTI_REFERENCES)
    )
    result = load_metric("f1").compute(predictions=predictions, references=references, average=average)
    assert result["f1"] == pytest.approx(f1_score(references, predictions, average=average))


def test_f1_pos_label_and_per_class() -> None:
    f1 = load_metric("f1")
    result = f1.compute(predictions=BINARY_PREDICTIONS, references=BINARY_REFERENCES, pos_label=0)
    assert result["f1"] == pytest.approx(f1_score(BINARY_REFERENCES, BINARY_PREDICTIONS, pos_label=0))
    per_class = f1.compute(predictions=MULTI_PREDICTIONS, references=MULTI_REFERENCES, average=None)["f1"]
    assert per_class == pytest.approx(list(f1_score(MULTI_REFERENCES, MULTI_PREDICTIONS, average=None)))


def test_unknown_metric() -> None:
    with pytest.raises(ConfigError) as err:
        load_metric("bleu")
    message = str(err.value)
    assert "'bleu'" in message and "accuracy" in message and "f1" in message


def test_compute_binary() -> None:
    metrics = compute_classification_metrics(BINARY_PREDICTIONS, BINARY_REFERENCES, num_labels=2)
    assert metrics == {
        "accuracy": pytest.approx(accuracy_score(BINARY_REFERENCES, BINARY_PREDICTIONS)),
        "f1": pytest.approx(f1_score(BINARY_REFERENCES, BINARY_PREDICTIONS, average="binary")),
    }
    assert all(type(value) is float for value in metrics.values())


def test_compute_multiclass_uses_macro_f1() -> None:
    metrics = compute_classification_metrics(np.array(MULTI_PREDICTIONS), np.array(MULTI_REFERENCES), num_labels=3)
    assert metrics["accuracy"] == pytest.approx(accuracy_score(MULTI_REFERENCES, MULTI_PREDICTIONS))
    assert metrics["f1"] == pytest.approx(f1_score(MULTI_REFERENCES, MULTI_PREDICTIONS, average="macro"))


def test_compute_accepts_logits_and_tensors() -> None:
    torch = pytest.importorskip("torch")
    logits = torch.nn.functional.one_hot(torch.tensor(MULTI_PREDICTIONS), 3).float() * 5.0
    metrics = compute_classification_metrics(logits, torch.tensor(MULTI_REFERENCES), num_labels=3)
    assert metrics == compute_classification_metrics(MULTI_PREDICTIONS, MULTI_REFERENCES, num_labels=3)


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_compute_equals_sklearn_on_random_labels(num_labels: int) -> None:
    """The trainer's NumPy counts against scikit-learn's accuracy and F1 (binary / macro), edge cases included."""
    rng = np.random.default_rng(num_labels)
    cases = [(rng.integers(0, num_labels, 50), rng.integers(0, num_labels, 50)) for _ in range(20)]
    cases += [(np.zeros(7, dtype=int), np.zeros(7, dtype=int)), (np.ones(4, dtype=int), np.zeros(4, dtype=int))]
    for predictions, references in cases:
        metrics = compute_classification_metrics(predictions, references, num_labels=num_labels)
        average = "binary" if num_labels == 2 else "macro"
        assert metrics["accuracy"] == pytest.approx(accuracy_score(references, predictions))
        assert metrics["f1"] == pytest.approx(f1_score(references, predictions, average=average, zero_division=0))


@pytest.mark.parametrize("num_labels", [2, 3, 6])
def test_multi_label_metrics_equal_sklearn(num_labels: int) -> None:
    """Subset accuracy and micro / macro F1 of multi-hot rows against scikit-learn's, empty labels included."""
    from hftrain.metrics import compute_multi_label_metrics

    rng = np.random.default_rng(num_labels)
    cases = [(rng.integers(0, 2, (40, num_labels)), rng.integers(0, 2, (40, num_labels))) for _ in range(10)]
    cases.append((np.zeros((5, num_labels), dtype=int), np.zeros((5, num_labels), dtype=int)))  # no label anywhere
    for predictions, references in cases:
        metrics = compute_multi_label_metrics(predictions, references)
        assert metrics["accuracy"] == pytest.approx(accuracy_score(references, predictions))
        for average in ("micro", "macro"):
            expected = f1_score(references, predictions, average=average, zero_division=0)
            assert metrics[f"f1_{average}"] == pytest.approx(expected)


def test_regression_metrics_equal_numpy_and_scipy() -> None:
    from scipy.stats import pearsonr

    from hftrain.metrics import compute_regression_metrics

    rng = np.random.default_rng(0)
    references = rng.normal(size=50)
    predictions = references + rng.normal(scale=0.5, size=50)
    metrics = compute_regression_metrics(predictions.tolist(), references.tolist())
    assert metrics["mse"] == pytest.approx(np.mean((predictions - references) ** 2))
    assert metrics["rmse"] == pytest.approx(metrics["mse"] ** 0.5)
    assert metrics["mae"] == pytest.approx(np.mean(np.abs(predictions - references)))
    assert metrics["pearson"] == pytest.approx(pearsonr(predictions, references).statistic)
    # a constant prediction has no correlation to measure: 0, not NaN
    assert compute_regression_metrics([1.0] * 4, [0.0, 1.0, 2.0, 3.0])["pearson"] == 0.0
