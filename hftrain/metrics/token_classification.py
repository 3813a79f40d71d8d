"""Token classification metrics: seqeval's entity-level precision, recall and F1, and per-word accuracy.

Each word counts once: only the positions whose label is not ``-100`` (a word's first sub-token,
``hftrain.data.word_labels``) are read. An entity is a run of tags ``B-X I-X ...`` (seqeval's default, CoNLL's
``conlleval`` rules: an ``I-X`` after ``O`` starts an entity too); label names without such a prefix (``O``, or ids
named by their number) are no entity, so data without IOB tags scores its entities 0 and only ``accuracy`` says
anything. ``precision = tp / (tp + fp)``, ``recall = tp / (tp + fn)``, ``f1 = 2pr / (p + r)`` over every entity of the
evaluation set (micro average); ``accuracy`` = correct words / words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

METRICS_LINE = (
    "metrics: entity-level precision, recall and F1 (seqeval, IOB tags such as B-PER/I-PER) and per-word accuracy"
)
"""What the token classifier's evaluation reports, said once at startup."""


def check_seqeval() -> None:
    """Refuse a run whose evaluation could not compute its metrics (seqeval missing), before training, in one line."""
    import importlib.util

    if importlib.util.find_spec("seqeval") is None:
        from hftrain.errors import ConfigError

        raise ConfigError(
            "model.task token_classification reports seqeval's entity F1, and seqeval is not installed; "
            "pip install seqeval==1.2.2 (constraints.txt)"
        )


def compute_token_metrics(
    predictions: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], id2label: Mapping[int, str]
) -> dict[str, float]:
    """``precision``, ``recall``, ``f1`` (entities, seqeval) and ``accuracy`` (words) over an evaluation set.

    Args:
        predictions: each example's predicted label id per position.
        labels: each example's label id per position, ``-100`` where no word starts.
        id2label: the label names (the model config's ``id2label``).
    """
    from seqeval.metrics import f1_score, precision_score, recall_score

    true, predicted, correct, words = [], [], 0, 0
    for guess, truth in zip(predictions, labels, strict=True):
        pairs = [(int(p), int(t)) for p, t in zip(guess, truth, strict=True) if t != -100]
        true.append([id2label[t] for _, t in pairs])
        predicted.append([id2label.get(p, "O") for p, _ in pairs])
        correct += sum(p == t for p, t in pairs)
        words += len(pairs)
    return {
        "precision": float(precision_score(true, predicted, zero_division=0)),
        "recall": float(recall_score(true, predicted, zero_division=0)),
        "f1": float(f1_score(true, predicted, zero_division=0)),
        "accuracy": correct / max(words, 1),
    }
