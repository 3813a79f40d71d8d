"""Tests for hftrain.data.loading: local files, validation errors, splits and embedded datasets."""

from __future__ import annotations

import bz2
import json
from pathlib import Path
from typing import Any

import pytest

from hftrain.data import EMBEDDED_DATASETS, load_classification_splits
from hftrain.errors import ConfigError, DataError


def _rows(n: int) -> list[dict[str, Any]]:
    """Return n rows with distinct texts and alternating 0/1 labels."""
    return [{"text": f"example number {i}", "label": i % 2} for i in range(n)]


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...] = ("text", "label")) -> Path:
    """Write rows as CSV with a header; None becomes an empty cell."""
    import pandas as pd

    pd.DataFrame(rows, columns=list(columns)).to_csv(path, index=False)
    return path


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSON lines."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _load(
    train_file: Path | None = None,
    *,
    dataset_name: str | None = None,
    validation_file: Path | None = None,
    text_column: str = "text",
    label_column: str = "label",
    num_labels: int = 2,
    validation_split_percentage: float = 20,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    seed: int = 0,
    log: Any = None,
    problem_type: str | None = None,
):
    """Call load_classification_splits with test defaults."""
    return load_classification_splits(
        dataset_name=dataset_name,
        train_file=str(train_file) if train_file is not None else None,
        validation_file=str(validation_file) if validation_file is not None else None,
        text_column=text_column,
        label_column=label_column,
        num_labels=num_labels,
        validation_split_percentage=validation_split_percentage,
        max_train_samples=max_train_samples,
        max_eval_samples=max_eval_samples,
        seed=seed,
        log=log if log is not None else (lambda message: None),
        problem_type=problem_type,
    )


def _check_splits(splits, total: int) -> None:
    """Assert the splits have the expected schema and together hold `total` rows."""
    assert set(splits) == {"train", "validation"}
    for split in splits.values():
        assert split.column_names == ["text", "label"]
        assert split.features["text"].dtype == "string"
        assert split.features["label"].dtype == "int64"
    assert len(splits["train"]) + len(splits["validation"]) == total


# ---------------------------------------------------------------------------
# File formats
# ---------------------------------------------------------------------------


def test_csv(tmp_path: Path) -> None:
    splits = _load(_write_csv(tmp_path / "train.csv", _rows(20)))
    _check_splits(splits, 20)
    assert len(splits["validation"]) == 4


def test_csv_bz2(tmp_path: Path) -> None:
    plain = _write_csv(tmp_path / "plain.csv", _rows(10))
    packed = tmp_path / "train.csv.bz2"
    packed.write_bytes(bz2.compress(plain.read_bytes()))
    _check_splits(_load(packed), 10)


def test_json_array(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(_rows(10)), encoding="utf-8")
    _check_splits(_load(path), 10)


def test_jsonl(tmp_path: Path) -> None:
    _check_splits(_load(_write_jsonl(tmp_path / "train.jsonl", _rows(10))), 10)


def test_parquet(tmp_path: Path) -> None:
    import pandas as pd

    path = tmp_path / "train.parquet"
    pd.DataFrame(_rows(10)).to_parquet(path, index=False)
    _check_splits(_load(path), 10)


def test_custom_columns_are_renamed_and_extra_columns_dropped(tmp_path: Path) -> None:
    rows = [{"review": f"r{i}", "stars": i % 3, "id": i} for i in range(10)]
    path = _write_csv(tmp_path / "train.csv", rows, columns=("id", "review", "stars"))
    splits = _load(path, text_column="review", label_column="stars", num_labels=3)
    _check_splits(splits, 10)
    all_rows = splits["train"].to_list() + splits["validation"].to_list()
    assert sorted(row["text"] for row in all_rows) == sorted(f"r{i}" for i in range(10))


def test_numeric_text_and_whole_float_labels(tmp_path: Path) -> None:
    rows = [{"text": 100 + i, "label": float(i % 2)} for i in range(10)]
    splits = _load(_write_jsonl(tmp_path / "train.jsonl", rows))
    assert isinstance(splits["train"][0]["text"], str)
    assert set(splits["train"]["label"]) <= {0, 1}


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.train_file") as err:
        _load(tmp_path / "nope.csv")
    assert "nope.csv" in str(err.value)


def test_missing_validation_file(tmp_path: Path) -> None:
    train = _write_csv(tmp_path / "train.csv", _rows(10))
    with pytest.raises(DataError, match="data.validation_file") as err:
        _load(train, validation_file=tmp_path / "dev.csv")
    assert "dev.csv" in str(err.value)


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "train.txt"
    path.write_text("hello\n", encoding="utf-8")
    with pytest.raises(DataError, match="data.train_file") as err:
        _load(path)
    assert "train.txt" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "missing", "field"),
    [({"text_column": "review"}, "review", "data.text_column"), ({"label_column": "y"}, "y", "data.label_column")],
)
def test_missing_column(tmp_path: Path, kwargs: dict[str, str], missing: str, field: str) -> None:
    path = _write_csv(tmp_path / "train.csv", _rows(10))
    with pytest.raises(DataError) as err:
        _load(path, **kwargs)
    message = str(err.value)
    assert f"'{missing}'" in message and field in message
    assert "train.csv" in message and "text, label" in message


def test_dropped_rows_are_logged(tmp_path: Path) -> None:
    rows = _rows(10) + [
        {"text": None, "label": 1},
        {"text": "   ", "label": 0},
        {"text": "no label", "label": None},
    ]
    messages: list[str] = []
    splits = _load(_write_jsonl(tmp_path / "train.jsonl", rows), log=messages.append)
    _check_splits(splits, 10)
    assert any("dropped 3 of 13 rows" in m and "train.jsonl" in m for m in messages), messages


@pytest.mark.parametrize("bad", ["pos", 0.5])
def test_non_integer_labels(tmp_path: Path, bad: Any) -> None:
    rows = _rows(5) + [{"text": "bad", "label": bad}]
    with pytest.raises(DataError) as err:
        _load(_write_jsonl(tmp_path / "train.jsonl", rows))
    message = str(err.value)
    assert "train.jsonl" in message and "'label'" in message and repr(bad) in message


def test_string_labels_in_csv(tmp_path: Path) -> None:
    rows = [{"text": f"t{i}", "label": "pos" if i % 2 else "neg"} for i in range(6)]
    with pytest.raises(DataError, match="'neg'") as err:
        _load(_write_csv(tmp_path / "train.csv", rows))
    assert "train.csv" in str(err.value) and "data.label_column" in str(err.value)


@pytest.mark.parametrize("bad", [2, -1])
def test_out_of_range_labels(tmp_path: Path, bad: int) -> None:
    rows = _rows(5) + [{"text": "bad", "label": bad}]
    with pytest.raises(DataError) as err:
        _load(_write_csv(tmp_path / "train.csv", rows), num_labels=2)
    message = str(err.value)
    assert "model.num_labels" in message and f"label {bad} " in message and "train.csv" in message


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (["a", "b"], "holds a list at row 4 (['a', 'b'])"),
        ({"a": 1}, "holds an object at row 4 ({'a': 1})"),
    ],
)
@pytest.mark.parametrize("everywhere", [False, True], ids=["one-row", "every-row"])
def test_texts_that_are_lists_or_objects(tmp_path: Path, bad: Any, shown: str, everywhere: bool) -> None:
    """A JSON array or object is not a text: refused naming file, column and first row, never stringified."""
    rows = [{"review": bad if everywhere else f"text {i}", "label": i % 2} for i in range(3)]
    rows += [{"review": bad, "label": 1}, {"review": "after", "label": 0}]
    with pytest.raises(DataError) as err:
        _load(_write_jsonl(tmp_path / "train.jsonl", rows), text_column="review")
    message = str(err.value)
    expected_row = "row 1 " if everywhere else "row 4 "
    assert message.startswith("data.text_column: column 'review' of ") and "train.jsonl" in message
    assert shown.replace("row 4 ", expected_row) in message


@pytest.mark.parametrize("write", [_write_jsonl, _write_csv], ids=["jsonl", "csv"])
def test_boolean_labels_are_refused(tmp_path: Path, write: Any) -> None:
    rows = [{"text": f"t{i}", "label": bool(i % 2)} for i in range(6)]
    path = write(tmp_path / ("train.jsonl" if write is _write_jsonl else "train.csv"), rows)
    with pytest.raises(DataError) as err:
        _load(path)
    message = str(err.value)
    assert "data.label_column" in message and path.name in message
    assert "found False (a boolean) at row 1" in message and "write the classes as integers" in message


def test_a_label_too_large_for_int64_is_reported_as_itself(tmp_path: Path) -> None:
    rows = _rows(5) + [{"text": "huge", "label": 10**30}]
    with pytest.raises(DataError) as err:
        _load(_write_jsonl(tmp_path / "train.jsonl", rows))
    message = str(err.value)
    assert "label 1e+30 in column 'label'" in message and "-9223372036854775808" not in message
    rows = _rows(5) + [{"text": "large", "label": 2**62}]  # an int64: said exactly
    with pytest.raises(DataError, match=f"label {2**62} in column 'label'"):
        _load(_write_jsonl(tmp_path / "train.jsonl", rows))
    path = tmp_path / "train.csv"
    path.write_text(f"text,label\na,0\nb,{10**30}\n", encoding="utf-8")
    with pytest.raises(DataError, match="data.train_file: .*train.csv holds a number too large for a 64-bit integer"):
        _load(path)


def test_bad_value_rows_count_missing_rows_too(tmp_path: Path) -> None:
    """The row named is the row in the file, also after rows with missing values were dropped."""
    rows = _rows(4) + [{"text": None, "label": 1}, {"text": "bad", "label": 0.5}]
    with pytest.raises(DataError, match=r"found 0\.5 at row 6;"):
        _load(_write_jsonl(tmp_path / "train.jsonl", rows))


def test_empty_after_dropping(tmp_path: Path) -> None:
    rows = [{"text": None, "label": 1}, {"text": "x", "label": None}]
    with pytest.raises(DataError) as err:
        _load(_write_jsonl(tmp_path / "train.jsonl", rows))
    assert "train.jsonl" in str(err.value) and "data.train_file" in str(err.value)


@pytest.mark.parametrize("content", ["", "text,label\n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "train.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as err:
        _load(path)
    assert "data.train_file" in str(err.value) and "train.csv" in str(err.value)


def test_unparsable_file(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="could not read") as err:
        _load(path)
    assert "data.train_file" in str(err.value) and "train.parquet" in str(err.value)


def test_exactly_one_source(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "train.csv", _rows(10))
    for kwargs in ({}, {"train_file": path, "dataset_name": "embedded:rotten_tomatoes"}):
        with pytest.raises(ConfigError) as err:
            _load(**kwargs)
        assert "data.dataset_name" in str(err.value) and "data.train_file" in str(err.value)


def test_unknown_dataset_name() -> None:
    with pytest.raises(ConfigError, match="data.dataset_name") as err:
        _load(dataset_name="imdb")
    message = str(err.value)
    assert all(name in message for name in EMBEDDED_DATASETS) and "data.train_file" in message


def test_bad_split_percentage(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "train.csv", _rows(10))
    with pytest.raises(ConfigError, match="data.validation_split_percentage"):
        _load(path, validation_split_percentage=0)


def test_bad_max_samples(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "train.csv", _rows(10))
    with pytest.raises(ConfigError, match="data.max_train_samples"):
        _load(path, max_train_samples=0)


# ---------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------


def test_split_is_deterministic(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "train.csv", _rows(50))
    first, second = _load(path, seed=7), _load(path, seed=7)
    for name in ("train", "validation"):
        assert first[name].to_list() == second[name].to_list()
    texts = set(first["train"]["text"]) | set(first["validation"]["text"])
    assert len(texts) == 50 and not set(first["train"]["text"]) & set(first["validation"]["text"])
    assert list(_load(path, seed=8)["validation"]["text"]) != list(first["validation"]["text"])


def test_validation_file_is_used(tmp_path: Path) -> None:
    train = _write_csv(tmp_path / "train.csv", _rows(10))
    dev_rows = [{"text": f"dev {i}", "label": 1} for i in range(3)]
    dev = _write_jsonl(tmp_path / "dev.jsonl", dev_rows)
    splits = _load(train, validation_file=dev)
    assert len(splits["train"]) == 10
    assert splits["validation"].to_list() == dev_rows


def test_max_samples_take_first_rows(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "train.csv", _rows(50))
    full = _load(path)
    limited = _load(path, max_train_samples=5, max_eval_samples=3)
    assert limited["train"].to_list() == full["train"].to_list()[:5]
    assert limited["validation"].to_list() == full["validation"].to_list()[:3]
    assert len(_load(path, max_train_samples=1000)["train"]) == len(full["train"])


# ---------------------------------------------------------------------------
# Embedded datasets (read real files from installed packages)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "positives", "negatives"),
    [("embedded:rotten_tomatoes", 7368, 5384), ("embedded:chinese_reviews", 8332, 9031)],
)
def test_embedded_dataset(name: str, positives: int, negatives: int) -> None:
    splits = _load(dataset_name=name, text_column="ignored", label_column="ignored", validation_split_percentage=10)
    _check_splits(splits, positives + negatives)
    labels = list(splits["train"]["label"]) + list(splits["validation"]["label"])
    assert labels.count(1) == positives and labels.count(0) == negatives
    texts = list(splits["train"]["text"]) + list(splits["validation"]["text"])
    assert len(set(texts)) == len(texts) and all(text.strip() for text in texts)
    assert abs(len(splits["validation"]) - (positives + negatives) / 10) <= 1
    # Same seed, same order: every process of a distributed run sees the same split.
    again = _load(dataset_name=name, validation_split_percentage=10, max_eval_samples=20)
    assert list(again["validation"]["text"]) == list(splits["validation"]["text"])[:20]


def test_embedded_dataset_rejects_validation_file(tmp_path: Path) -> None:
    dev = _write_csv(tmp_path / "dev.csv", _rows(4))
    with pytest.raises(ConfigError, match="data.validation_file"):
        _load(dataset_name="embedded:chinese_reviews", validation_file=dev)


# ---------------------------------------------------------------------------
# Tasks: what each label column becomes (hftrain.data.labels)
# ---------------------------------------------------------------------------


def _labels(splits) -> list:
    return sorted(list(splits["train"]["label"][:]) + list(splits["validation"]["label"][:]), key=repr)


def test_lists_of_ids_are_multi_label_as_multi_hot(tmp_path: Path) -> None:
    from hftrain.data.labels import MULTI_LABEL, problem_type_of

    rows = [{"text": f"t{i}", "label": label} for i, label in enumerate([[0, 2], [1], 2, [], [0, 1, 2]])]
    splits = _load(_write_jsonl(tmp_path / "m.jsonl", rows), num_labels=3)
    assert problem_type_of(splits["train"].features) == MULTI_LABEL
    assert splits["train"].features["label"].feature.dtype == "float32"
    assert _labels(splits) == sorted([[1, 0, 1], [0, 1, 0], [0, 0, 1], [0, 0, 0], [1, 1, 1]], key=repr)


def test_multi_hot_rows_stay_as_written(tmp_path: Path) -> None:
    rows = [{"text": f"t{i}", "label": label} for i, label in enumerate([[1, 0, 1], [0, 0.5, 0], [0, 0, 0]] * 2)]
    splits = _load(_write_jsonl(tmp_path / "h.jsonl", rows), num_labels=3)
    assert sorted(map(tuple, _labels(splits))) == sorted([(1, 0, 1), (0, 0.5, 0), (0, 0, 0)] * 2)


def test_one_output_is_regression_on_float_labels(tmp_path: Path) -> None:
    from hftrain.data.labels import REGRESSION, problem_type_of

    rows = [{"text": f"t{i}", "label": value} for i, value in enumerate([0.25, -3, "1.5", 7.0, 2])]
    splits = _load(_write_csv(tmp_path / "r.csv", rows), num_labels=1)
    assert problem_type_of(splits["train"].features) == REGRESSION
    assert splits["train"].features["label"].dtype == "float32"
    assert sorted(_labels(splits)) == [-3.0, 0.25, 1.5, 2.0, 7.0]


def test_the_requested_task_converts_class_ids(tmp_path: Path) -> None:
    """A model folder whose config.json says multi-label, trained on single-label data: one-hot rows."""
    splits = _load(_write_csv(tmp_path / "s.csv", _rows(6)), problem_type="multi_label_classification")
    assert _labels(splits) == sorted([[1.0, 0.0], [0.0, 1.0]] * 3, key=repr)


def test_an_embedded_dataset_as_regression_targets() -> None:
    splits = _load(dataset_name="embedded:rotten_tomatoes", num_labels=1, max_train_samples=8, max_eval_samples=4)
    assert splits["train"].features["label"].dtype == "float32"
    assert set(splits["train"]["label"]) <= {0.0, 1.0}
