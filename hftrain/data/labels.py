"""The label column of each sequence-classification task: which task a run trains, and its labels checked and
converted to what transformers' loss for that task takes.

transformers' ``*ForSequenceClassification`` heads train three tasks, named by the config's ``problem_type``:

- ``single_label_classification``: one class id per text, 0..num_labels-1; the model sees ``int64``; cross
  entropy.
- ``multi_label_classification``: a list of class ids (``[0, 2]``), a multi-hot list of ``num_labels`` values in
  [0, 1] (``[1, 0, 1]``), or one class id; the model sees ``num_labels`` ``float32`` (multi-hot); BCE with logits,
  the mean over texts × labels.
- ``regression``: one number per text (``model.num_labels: 1``); the model sees ``float32``; MSE.

The task is ``model.problem_type`` when set, else the model folder's ``config.json`` ``problem_type``, else the
data's: a label column holding lists is multi-label, ``num_labels: 1`` is regression, anything else single-label
(transformers' own rule in ``ForSequenceClassificationLoss``, decided once before the run instead of at its first
loss). A list of exactly ``num_labels`` values, all in [0, 1], is multi-hot; any other list is class ids. Regression
trains one target: transformers' multi-target MSE would need float lists the multi-label column also is, so several
targets are refused rather than guessed.

Every bad label is one ``DataError`` line naming the column, the file, the first bad row and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets
    import pandas as pd

SINGLE_LABEL = "single_label_classification"
MULTI_LABEL = "multi_label_classification"
REGRESSION = "regression"
PROBLEM_TYPES: tuple[str, ...] = (SINGLE_LABEL, MULTI_LABEL, REGRESSION)


def decide_problem_type(requested: str | None, num_labels: int, labels: pd.Series, source: str) -> str:
    """The task a run trains: ``requested`` (the config's, or the model folder's), else the data's.

    Args:
        requested: ``model.problem_type`` or the model's ``config.json`` ``problem_type``; None lets the data decide.
        num_labels: ``model.num_labels``.
        labels: the training file's label column (missing values dropped).
        source: the file or dataset the labels come from, for messages.
    """
    if requested is None:
        if bool(labels.map(_is_list).any()):
            requested = MULTI_LABEL
        else:
            requested = REGRESSION if num_labels == 1 else SINGLE_LABEL
    check_problem_type(requested, num_labels, f"the labels of {source}")
    return requested


def check_problem_type(problem_type: str, num_labels: int, decided_by: str) -> None:
    """Refuse a task that ``num_labels`` cannot train.

    Args:
        problem_type: one of ``PROBLEM_TYPES``.
        num_labels: ``model.num_labels``.
        decided_by: what chose the task (the config field, the model's config.json, the data), for the message.
    """
    if problem_type not in PROBLEM_TYPES:
        raise ConfigError(
            f"model.problem_type: {problem_type!r} (from {decided_by}) is not a task hftrain trains; use one of "
            f"{', '.join(PROBLEM_TYPES)}"
        )
    if problem_type == REGRESSION and num_labels != 1:
        raise ConfigError(
            f"model.num_labels: regression (from {decided_by}) trains one target, but model.num_labels is "
            f"{num_labels}; set model.num_labels: 1, or model.problem_type: {SINGLE_LABEL} to train classes"
        )
    if problem_type == SINGLE_LABEL and num_labels < 2:
        raise ConfigError(
            f"model.num_labels: single-label classification (from {decided_by}) needs at least 2 classes, got "
            f"{num_labels}; set model.num_labels to the number of classes, or model.problem_type: {REGRESSION} "
            "for a numeric target"
        )


def model_labels(
    labels: pd.Series, problem_type: str, num_labels: int, source: str, label_column: str
) -> tuple[pd.Series, Any]:
    """The label column as the task's loss takes it, and its ``datasets`` feature.

    Args:
        labels: the label column with no missing values, indexed by row (0-based) in the file.
        problem_type: the run's task.
        num_labels: ``model.num_labels``.
        source: the file or dataset, for messages.
        label_column: the column's name in the file, for messages.
    """
    import datasets

    if problem_type == REGRESSION:
        return _numbers(labels, source, label_column), datasets.Value("float32")
    if problem_type == MULTI_LABEL:
        multi_hot = datasets.Sequence(datasets.Value("float32"), length=num_labels)
        return _multi_hot(labels, num_labels, source, label_column), multi_hot
    _refuse_lists(labels, f"data.label_column: labels in column {label_column!r} of {source} must be integer class ids")
    ids = class_ids(labels, source, label_column)
    check_label_range(ids, num_labels, source, label_column)
    return ids.astype("int64"), datasets.Value("int64")


def problem_type_of(features: datasets.Features) -> str:
    """The task a loaded split's ``labels`` (or ``label``) feature trains (see the table above)."""
    import datasets

    feature = features["labels"] if "labels" in features else features["label"]
    if isinstance(feature, (datasets.Sequence, datasets.List)):  # datasets 4+ builds a List for a Sequence
        return MULTI_LABEL
    return REGRESSION if str(feature.dtype).startswith("float") else SINGLE_LABEL


# ---------------------------------------------------------------------------
# Single-label: class ids
# ---------------------------------------------------------------------------


def class_ids(labels: pd.Series, source: str, label_column: str) -> pd.Series:
    """The labels as whole numbers, accepting ints and whole-number floats or strings.

    A column of signed integers stays as it is (exact); anything else becomes float64, so that a label too large
    for int64 (``1e30``) is still its own value in the range check.

    Args:
        labels: the label column with no missing values, indexed by row (0-based) in the file.
        source: file name for error messages.
        label_column: original column name for error messages.
    """
    import numpy as np
    import pandas as pd

    where = f"data.label_column: labels in column {label_column!r} of {source} must be integer class ids"
    _refuse_booleans(labels, f"{where} 0..num_labels-1", "which class true is cannot be guessed: write the classes "
                     "as integers (e.g. 0 and 1) in the file")  # fmt: skip
    if pd.api.types.is_signed_integer_dtype(labels):
        return labels.astype("int64")
    numbers = pd.to_numeric(labels, errors="coerce").astype("float64")
    # NaN here means "not a number at all" (e.g. "pos"); fractions like 0.5 are not class ids.
    bad = ~np.isfinite(numbers) | (numbers != np.round(numbers))
    if bad.any():
        row = bad.idxmax()
        numeric = np.isfinite(numbers[row])
        fix = (
            f"for a numeric target set model.num_labels: 1 (model.problem_type: {REGRESSION})"
            if numeric
            else "map label names to integers in the file"
        )
        raise DataError(f"{where} 0..num_labels-1, found {shown(labels[row])} at row {row + 1}; {fix}")
    return numbers


def check_label_range(labels: pd.Series, num_labels: int, source: str, label_column: str) -> None:
    """Require every label to lie in [0, num_labels).

    Args:
        labels: whole-number labels (int64, or float64 before the cast, so that a huge one keeps its value).
        num_labels: number of classes (model.num_labels).
        source: file name for error messages.
        label_column: original column name for error messages.
    """
    bad = labels[(labels < 0) | (labels >= num_labels)]
    if bad.empty:
        return
    first = bad.iloc[0].item()  # a Python int or float
    fix = "fix the labels"
    if first >= num_labels:
        largest = labels.max().item()
        fix = (
            f"set model.num_labels to at least {int(largest) + 1} or {fix}"
            if largest < 2**20
            else f"{fix} (class ids count from 0; model.num_labels is the number of classes)"
        )
    raise DataError(
        f"model.num_labels: label {_label_text(first)} in column {label_column!r} of {source} is outside "
        f"[0, {num_labels}) for model.num_labels={num_labels}; {fix}"
    )


# ---------------------------------------------------------------------------
# Regression: numbers
# ---------------------------------------------------------------------------


def _numbers(labels: pd.Series, source: str, label_column: str) -> pd.Series:
    """Finite numbers (ints, floats, numeric strings), as float32: regression's targets."""
    import numpy as np
    import pandas as pd

    where = f"data.label_column: regression labels in column {label_column!r} of {source} must be numbers"
    _refuse_lists(labels, where, "regression trains one target per text (model.num_labels: 1); ")
    _refuse_booleans(labels, where, "write the target as a number")
    numbers = pd.to_numeric(labels, errors="coerce").astype("float64")
    bad = ~np.isfinite(numbers)
    if bad.any():
        row = bad.idxmax()
        raise DataError(f"{where}, found {shown(labels[row])} at row {row + 1}; write a finite number there")
    # The model sees float32 targets: a finite float64 beyond float32's range (1e39) would train on inf.
    limit = float(np.finfo(np.float32).max)
    huge = numbers.abs() > limit
    if huge.any():
        row = huge.idxmax()
        raise DataError(
            f"{where} within float32's range (±{limit:.3g}, the dtype the model's loss takes), found "
            f"{shown(labels[row])} at row {row + 1}, which is inf in float32; scale the targets (e.g. to their "
            "standard score) or fix that row"
        )
    return numbers.astype("float32")


# ---------------------------------------------------------------------------
# Multi-label: multi-hot rows
# ---------------------------------------------------------------------------


def _multi_hot(labels: pd.Series, num_labels: int, source: str, label_column: str) -> pd.Series:
    """Each row as ``num_labels`` floats: a multi-hot list as it is, a list of class ids (or one id) as multi-hot."""
    import numpy as np

    where = f"data.label_column: multi-label labels in column {label_column!r} of {source}"
    rows = [_as_list(value) for value in labels]
    shaped = [_is_list(value) and _hot_shaped(row, num_labels) for value, row in zip(labels, rows, strict=True)]
    # Each row is read one way, checked row by row: a column is multi-hot when every row is, else class ids. A
    # multi-hot row among class-id rows (or one of the wrong length among multi-hot rows) would otherwise flip the
    # whole column to class ids, [1, 0, 1] becoming [1, 1, 0] without a word.
    multi_hot = all(shaped)
    if not multi_hot:
        hot_only = [i for i, (ok, row) in enumerate(zip(shaped, rows, strict=True)) if ok and not _distinct_ids(row)]
        if hot_only:
            first_hot = hot_only[0]
            other = next(i for i, ok in enumerate(shaped) if not ok)
            raise DataError(
                f"{where}: row {labels.index[first_hot] + 1} is a multi-hot row of {num_labels} values "
                f"({shown(labels.iloc[first_hot])}) but row {labels.index[other] + 1} is not "
                f"({shown(labels.iloc[other])}: {_not_hot(rows[other], num_labels)}); write every row the same "
                f"way: a multi-hot list of model.num_labels={num_labels} values in [0, 1], or a list of class ids"
            )
    converted = []
    for index, row in zip(labels.index, rows, strict=True):
        if multi_hot:
            converted.append(np.asarray(row, dtype=np.float32))
            continue
        hot = np.zeros(num_labels, dtype=np.float32)
        for value in row:
            if isinstance(value, (bool, np.bool_)) or not _whole(value) or not 0 <= value < num_labels:
                raise DataError(
                    f"{where} must be lists of class ids 0..{num_labels - 1} (or multi-hot lists of {num_labels} "
                    f"values in [0, 1]), found {shown(labels[index])} at row {index + 1}; fix that row, or set "
                    "model.num_labels to the number of labels"
                )
            if hot[int(value)]:
                raise DataError(
                    f"{where}: row {index + 1} ({shown(labels[index])}) lists class {int(value)} twice, which a list "
                    f"of class ids does not and a multi-hot row of model.num_labels={num_labels} values would not "
                    "either; fix that row"
                )
            hot[int(value)] = 1.0
        converted.append(hot)
    return labels.__class__(converted, index=labels.index, dtype=object)


def _hot_shaped(row: list, num_labels: int) -> bool:
    """A list that reads as a multi-hot row: ``num_labels`` values, each in [0, 1]."""
    return len(row) == num_labels and all(_in_unit(v) for v in row)


def _distinct_ids(row: list) -> bool:
    """A multi-hot-shaped row that is also a list of distinct class ids (``[0, 1]`` of 2 labels): either reading."""
    return all(_whole(v) for v in row) and len({int(v) for v in row}) == len(row)


def _not_hot(row: list, num_labels: int) -> str:
    """Why a row is not a multi-hot row, for the message."""
    if len(row) != num_labels:
        return f"{len(row)} value{'s' if len(row) != 1 else ''}, not {num_labels}"
    return "a value outside [0, 1]"


def _as_list(value: Any) -> list:
    if _is_list(value):
        return list(value.tolist() if hasattr(value, "tolist") else value)
    return [value]


def _in_unit(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def _whole(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and math.isfinite(value) and float(value).is_integer()


# ---------------------------------------------------------------------------
# Shared
# ---------------------------------------------------------------------------


def _is_list(value: Any) -> bool:
    import numpy as np

    return isinstance(value, (list, tuple, np.ndarray))


def _refuse_lists(labels: pd.Series, where: str, reason: str = "") -> None:
    """A list in a column of one value per text: one line naming its row and the multi-label setting."""
    lists = labels.map(_is_list)
    if lists.any():
        row = lists.idxmax()
        raise DataError(
            f"{where}, found the list {shown(labels[row])} at row {row + 1}; {reason}for several labels per text "
            f"set model.problem_type: {MULTI_LABEL}"
        )


def _refuse_booleans(labels: pd.Series, where: str, fix: str) -> None:
    import numpy as np
    import pandas as pd

    if not (pd.api.types.is_bool_dtype(labels) or labels.dtype == object):
        return
    boolean = labels.map(lambda value: isinstance(value, (bool, np.bool_)))
    if boolean.any():
        row = boolean.idxmax()
        raise DataError(f"{where}, found {shown(labels[row])} (a boolean) at row {row + 1}; {fix}")


def shown(value: object, limit: int = 60) -> str:
    """A value from the file as it may be echoed in a message: its repr, cut short."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars: as the plain Python values they hold
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _label_text(value: float | int) -> str:
    """A label as the user wrote it: ``7`` for an integer, ``1e+30`` for a float beyond the exact whole numbers."""
    if isinstance(value, float) and abs(value) >= 2**53:
        return f"{value:g}"
    return str(int(value))
