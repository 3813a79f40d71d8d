"""F1 metric, shipped with hftrain so it loads offline.

It follows the interface of the hub's `evaluate-metric/f1` module:
`compute(predictions=..., references=..., average="binary", pos_label=1)` returns `{"f1": ...}`.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
from sklearn.metrics import f1_score

_DESCRIPTION = """
The F1 score is the harmonic mean of precision and recall:
F1 = 2 * (precision * recall) / (precision + recall).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted labels.
    references (`list` of `int`): Ground truth labels.
    labels (`list` of `int`): The labels to include when `average` is not "binary". Defaults to None (all labels).
    pos_label (`int`): The positive class when `average="binary"`. Defaults to 1.
    average (`str`): "binary" (default), "micro", "macro", "weighted", "samples", or None for per-class scores.
    sample_weight (`list` of `float`): Sample weights. Defaults to None.

Returns:
    f1 (`float` or `list` of `float`): The F1 score, or one score per class when `average=None`.

Examples:
    >>> f1_metric = evaluate.load("hftrain/metrics/modules/f1")
    >>> f1_metric.compute(predictions=[0, 1, 0, 1, 0], references=[0, 0, 1, 1, 0])
    {'f1': 0.5}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and others},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    """Harmonic mean of precision and recall (sklearn's f1_score)."""

    def _info(self) -> evaluate.MetricInfo:
        """Describe the metric and its input features."""
        # The "multilabel" config takes one 0/1 vector per example, as on the hub.
        if self.config_name == "multilabel":
            features = {
                "predictions": datasets.Sequence(datasets.Value("int32")),
                "references": datasets.Sequence(datasets.Value("int32")),
            }
        else:
            features = {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(features),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(
        self, predictions, references, labels=None, pos_label=1, average: str | None = "binary", sample_weight=None
    ) -> dict[str, float | list[float]]:
        """Compute F1 with sklearn."""
        score = f1_score(
            references, predictions, labels=labels, pos_label=pos_label, average=average, sample_weight=sample_weight
        )
        # average=None gives one score per class; keep it JSON-friendly.
        scores = np.asarray(score, dtype=float)
        return {"f1": float(scores) if scores.ndim == 0 else scores.tolist()}
