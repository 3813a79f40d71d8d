"""Accuracy metric, shipped with hftrain so it loads offline.

It follows the interface of the hub's `evaluate-metric/accuracy` module:
`compute(predictions=..., references=...)` returns `{"accuracy": float}`.
"""

from __future__ import annotations

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions:
(TP + TN) / (TP + TN + FP + FN).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): Predicted labels.
    references (`list` of `int`): Ground truth labels.
    normalize (`bool`): If False, return the number of correct predictions instead of the fraction. Defaults to True.
    sample_weight (`list` of `float`): Sample weights. Defaults to None.

Returns:
    accuracy (`float`): The fraction (or count, with normalize=False) of correct predictions.

Examples:
    >>> accuracy_metric = evaluate.load("hftrain/metrics/modules/accuracy")
    >>> accuracy_metric.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
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
class Accuracy(evaluate.Metric):
    """Fraction of predictions equal to the references (sklearn's accuracy_score)."""

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
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize: bool = True, sample_weight=None) -> dict[str, float]:
        """Compute accuracy with sklearn."""
        score = accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight)
        return {"accuracy": float(score)}
