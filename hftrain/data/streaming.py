"""Streaming training data (``data.streaming: true``): a corpus read as a ``datasets`` IterableDataset, tokenized and
packed on the fly, split over the data-parallel ranks, resumed exactly.

**Sources.** ``data.train_file`` is one local file, a folder (its files of one format, in name order) or a glob
(matches in name order): JSON Lines / JSON (``.jsonl``, ``.json``), CSV, plain text (``.txt``: one document per
non-blank line) or Parquet; every file is one shard. Any other ``data.dataset_name`` than an embedded one is read as a
hub dataset (``load_dataset(name, split="train", streaming=True)``) where a hub is reachable. The columns rules are
the map-style loader's (``hftrain.data.language.load_text_splits``): ``prompt_column`` and ``response_column`` when
the first shard has both (trained on the responses only), else ``text_column``; a row with a missing or blank text is
dropped and counted; numbers are taken as their text; a list or an object is refused in one line naming the file and
its line (a row of a Parquet or an array-JSON file), as is a line that is not JSON, a shard that is gone when the
stream reaches it, or bytes that are not UTF-8.

**Split over ranks.** ``datasets.distributed.split_dataset_by_node``: by shard when the shard count is a multiple of
the data-parallel size (rank ``r`` reads shards ``r, r + dp, ...``), else by stride (every rank reads every shard and
keeps documents ``r, r + dp, ...``). Each rank tokenizes and packs its own documents (``hftrain.data.packing.Packer``)
and yields blocks; a rank never sees another's documents, so no rank waits for data.

**Epochs.** A stream has no known length: training runs ``training.max_steps``. A rank whose stream ends packs its last
partial block and starts the stream again (the next epoch; ``datasets`` reorders the shards by the epoch's seed), as
the HF Trainer restarts an exhausted IterableDataset until ``max_steps``; one line says so. A rank whose share holds
no document is refused in one line.

**Exact resume.** A block boundary is a position: :meth:`StreamingBlocks.state_dict` is the ``datasets`` state before
the current tokenizer batch of documents (``IterableDataset.state_dict``), how many rows of that batch were packed,
the packer's partial block (``Packer.state_dict``) and the blocks the last document completed that were not yet
yielded. Taken when the trainer has consumed every block it fetched (a window's micro-batches, read in this process:
no loader worker reads ahead), it names exactly the next block, and :meth:`load_state_dict` continues there: no
document is skipped or read twice (rows are read :data:`TOKENIZE_BATCH` at a time: a bad row is met, and reported,
up to that many rows before its blocks are due). The trainer stores it per rank in the checkpoint
(``state/rank_state_<r>.json``); a resume under another data-parallel size is refused (the shards would be dealt
anew). Resuming re-reads the current shard up to the position (``datasets`` restores a generator shard by skipping
its first examples).

**Validation.** ``data.validation_file`` is read whole (the same readers) and packed into a fixed, map-style split.
Without it, the first ``data.max_eval_samples`` documents (default :data:`DEFAULT_EVAL_DOCUMENTS`) of the stream, in
file order, are the validation set, and the training stream starts after them (one line says so);
``validation_split_percentage`` does not apply to a stream.

Written here, not with ``datasets``' json/csv/text builders, because those parse a shard in 10 MB chunks and report a
bad line without its file or line, turn a column of lists into a cast error, and keep blank lines; torchdata's
``StatefulDataLoader`` is not needed: the loader runs in the main process and the stream's own state is the position.
"""

from __future__ import annotations

import csv
import glob
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from hftrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from hftrain.data.packing import BlockRules

STREAM_FORMATS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".txt": "text",
    ".parquet": "parquet",
}
"""File suffix -> reader (every shard of a stream has one format)."""

DEFAULT_EVAL_DOCUMENTS = 1000
"""Validation documents taken from the stream's start when there is no ``data.validation_file``."""

TOKENIZE_BATCH = 64
"""Documents per tokenizer call (a fast tokenizer's batch runs in Rust; one call per document costs its overhead)."""

STATE_VERSION = 1

LM_COLUMNS = ("input_ids", "labels", "position_ids")


class DataSection(Protocol):
    """The fields of the ``data`` config section a stream reads (``hftrain.config.DataConfig``; this layer is below
    the config's)."""

    dataset_name: str | None
    train_file: str | None
    validation_file: str | None
    text_column: str
    prompt_column: str
    response_column: str
    max_eval_samples: int | None


@dataclass(frozen=True)
class Columns:
    """Which source columns a stream reads: ``text`` (plain text) or ``prompt`` and ``response``.

    Args:
        names: the source's column names, in the order of :attr:`outputs`.
        fields: the config fields that named them (for messages).
    """

    names: tuple[str, ...]
    fields: tuple[str, ...]

    @property
    def outputs(self) -> tuple[str, ...]:
        """The columns of a row: ``("text",)`` or ``("prompt", "response")``."""
        return ("text",) if len(self.names) == 1 else ("prompt", "response")


# ---------------------------------------------------------------------------
# Files and rows
# ---------------------------------------------------------------------------


def list_shards(spec: str, field: str) -> tuple[list[Path], str]:
    """The shards ``spec`` names (a file, a folder, a glob), in name order, and their format.

    Args:
        spec: ``data.train_file`` or ``data.validation_file``.
        field: that config field, for messages.
    """
    path = Path(spec)
    if any(char in spec for char in "*?["):
        files = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
        where = f"the pattern {spec}"
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _format_of(p) is not None)
        where = f"the folder {spec}"
    else:
        from hftrain.data.loading import check_regular_file

        check_regular_file(path, field)
        files, where = [path], spec
    if not files:
        raise DataError(
            f"{field}: {where} holds no data file ({', '.join(STREAM_FORMATS)}); fix the path or the pattern"
        )
    formats = {_format_of(f) for f in files}
    if None in formats:
        odd = next(f for f in files if _format_of(f) is None)
        raise DataError(f"{field}: unsupported file type for {odd}; a stream reads {', '.join(STREAM_FORMATS)} files")
    if len(formats) > 1:
        raise DataError(
            f"{field}: {where} mixes formats ({', '.join(sorted(f for f in formats if f))}); give shards of one format"
        )
    return files, formats.pop() or ""


def _format_of(path: Path) -> str | None:
    return STREAM_FORMATS.get(path.suffix.lower())


def detect_columns(file: Path, fmt: str, *, text_column: str, prompt_column: str, response_column: str) -> Columns:
    """The columns a stream reads, from its first shard's first row (or header): the map-style loader's rule.

    Args:
        file: the first shard.
        fmt: its format (:data:`STREAM_FORMATS`).
        text_column: ``data.text_column``.
        prompt_column: ``data.prompt_column``.
        response_column: ``data.response_column``.
    """
    if prompt_column == response_column:
        raise ConfigError(
            f"data.response_column: {response_column!r} is data.prompt_column too; the prompt and the response "
            "must be two different columns"
        )
    if fmt == "text":
        return Columns(("",), ("data.train_file",))
    available = _first_columns(file, fmt)
    shown = ", ".join(map(str, available)) or "(none)"
    if prompt_column in available and response_column in available:
        return Columns((prompt_column, response_column), ("data.prompt_column", "data.response_column"))
    if text_column in available:
        return Columns((text_column,), ("data.text_column",))
    pair = {prompt_column: "data.prompt_column", response_column: "data.response_column"}
    present = [column for column in pair if column in available]
    if present:
        have, lack = present[0], next(column for column in pair if column != present[0])
        raise DataError(
            f"{pair[lack]}: column {lack!r} not found in {file}, which has {have!r} ({pair[have]}); available "
            f"columns: {shown}. Set {pair[lack]} to one of them, or data.text_column for plain text"
        )
    raise DataError(
        f"data.text_column: column {text_column!r} not found in {file}; available columns: {shown}. Set "
        "data.text_column to one of them, or data.prompt_column and data.response_column for prompt/response data"
    )


def _first_columns(file: Path, fmt: str) -> list[str]:
    """The column names of ``file``'s header (CSV, Parquet) or first row (JSON)."""
    for _, record in _records(file, fmt, field="data.train_file", columns=None):
        return list(record) if isinstance(record, dict) else []
    raise DataError(f"data.train_file: {file} has no data rows; fill in the data or point to another file")


def _records(file: Path, fmt: str, *, field: str, columns: Sequence[str] | None) -> Iterator[tuple[int, Any]]:
    """``(line, record)`` of each row of ``file`` in order: a JSON value, a CSV/Parquet row as a dict, a text line.

    Args:
        file: the shard.
        fmt: its format.
        field: the config field that named it.
        columns: the columns a CSV or Parquet shard must have (None: any).
    """
    try:
        if fmt == "parquet":
            yield from _parquet_rows(file, field, columns)
            return
        with open(file, encoding="utf-8", newline="" if fmt == "csv" else None) as handle:
            if fmt == "csv":
                reader = csv.DictReader(handle)
                _check_header(reader.fieldnames or [], columns, file, field)
                for row in reader:
                    yield reader.line_num, row
            elif fmt == "text":
                for number, line in enumerate(handle, start=1):
                    yield number, line.rstrip("\r\n")
            else:
                yield from _json_rows(handle, file, field)
    except FileNotFoundError:
        raise DataError(
            f"{field}: {file} is gone (it was a shard of the stream when the run started); restore it and resume "
            "from the last checkpoint"
        ) from None
    except UnicodeDecodeError as error:
        raise DataError(f"{field}: {file} is not UTF-8 text ({error.reason}); save it as UTF-8") from None
    except OSError as error:
        raise DataError(f"{field}: cannot read {file} ({error.strerror}); fix the file or its permissions") from None


def _json_rows(handle: Any, file: Path, field: str) -> Iterator[tuple[int, Any]]:
    """JSON Lines (one object per non-blank line) or, when the file opens with ``[``, one JSON array of objects."""
    first = handle.read(1)
    while first and first.isspace():
        first = handle.read(1)
    if first == "[":
        try:
            rows = json.loads(first + handle.read())
        except json.JSONDecodeError as error:
            raise DataError(
                f"{field}: {file} is not valid JSON (line {error.lineno}: {error.msg}); fix that line"
            ) from None
        for number, row in enumerate(rows, start=1):
            yield number, _object(row, file, f"row {number}", field)
        return
    handle.seek(0)
    number = 0
    while True:
        try:
            line = handle.readline()
        except UnicodeDecodeError as error:
            raise DataError(
                f"{field}: {file} line {number + 1} is not UTF-8 text ({error.reason}); save the file as UTF-8"
            ) from None
        if not line:
            return
        number += 1
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{field}: {file} line {number} is not a JSON object ({error.msg} at column {error.colno}); fix or "
                "remove that line"
            ) from None
        yield number, _object(row, file, f"line {number}", field)


def _object(row: Any, file: Path, where: str, field: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(
            f"{field}: {file} {where} is {type(row).__name__}, not a JSON object of columns; write one object per row"
        )
    return row


def _parquet_rows(file: Path, field: str, columns: Sequence[str] | None) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except FileNotFoundError:
        raise
    except Exception as error:  # noqa: BLE001 - pyarrow's errors vary: one line naming the file
        raise DataError(f"{field}: could not read {file} as Parquet ({error}); fix or replace the file") from None
    _check_header(parquet.schema_arrow.names, columns, file, field)
    number = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=list(columns) if columns else None):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _check_header(names: Sequence[str], columns: Sequence[str] | None, file: Path, field: str) -> None:
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise DataError(
            f"{field}: {file} has no column {missing[0]!r} (its columns: {', '.join(names) or '(none)'}); every shard "
            "of a stream needs the columns of the first"
        )


def _text(value: Any, file: Path | str, where: str, column: str, field: str) -> str | None:
    """A row's text: a string, a number as its text, None when missing or blank; a list or an object is refused."""
    if value is None or isinstance(value, float) and value != value:
        return None
    if isinstance(value, (list, tuple, dict, np.ndarray)):
        kind = "an object" if isinstance(value, dict) else "a list"
        raise DataError(
            f"{field}: column {column!r} of {file} holds {kind} at {where}, not a text; write each text as one "
            "string in the file"
        )
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def read_rows(
    files: list[str], starts: list[int], *, fmt: str, names: tuple[str, ...], fields: tuple[str, ...], field: str
) -> Iterator[dict[str, str | None]]:
    """The generator of a local stream (``IterableDataset.from_generator``; ``files`` and ``starts`` are its shards):
    one row per record, ``{output column: text or None}`` (None: missing or blank, dropped by the packer's loop).

    Args:
        files: the shards, as paths.
        starts: per shard, the first line (or row) that belongs to the stream (the ones before are validation).
        fmt: the shards' format.
        names: the source columns (``[""]`` for a text file's lines).
        fields: their config fields.
        field: the config field that named the files.
    """
    outputs = ("text",) if len(names) == 1 else ("prompt", "response")
    needed = None if fmt == "text" else names
    for file, start in zip(files, starts, strict=True):
        path = Path(file)
        for number, record in _records(path, fmt, field=field, columns=needed if fmt in ("csv", "parquet") else None):
            if number < start:
                continue
            where = f"line {number}" if fmt in ("json", "csv", "text") else f"row {number}"
            if fmt == "text":
                yield {"text": record if record.strip() else None}
                continue
            yield {
                out: _text(record.get(name), path, where, name, column_field)
                for out, name, column_field in zip(outputs, names, fields, strict=True)
            }


# ---------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------


class StreamingBlocks(torch.utils.data.IterableDataset):
    """This rank's packed blocks of a streamed corpus, endlessly (epoch after epoch), with an exact position.

    Call :meth:`split` with the data-parallel coordinates before iterating. A block is ``Packer``'s dict (numpy
    ``input_ids``, ``labels``, ``position_ids``; ``length``, ``num_tokens``); :func:`collate_blocks` batches them.

    Args:
        dataset: the whole corpus as a ``datasets`` IterableDataset of rows (:meth:`Columns.outputs` columns, a
            missing or blank text None).
        tokenizer: the model's tokenizer.
        rules: the packing rules.
        columns: what a row holds.
        source: the corpus, for messages.
        field: the config field that named it.
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        tokenizer: PreTrainedTokenizerBase,
        rules: BlockRules,
        columns: Columns,
        *,
        source: str,
        field: str,
    ) -> None:
        from hftrain.data.packing import Packer

        super().__init__()
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.rules = rules
        self.columns = columns
        self.source = source
        self.field = field
        self.dp_rank, self.dp_size = 0, 1
        self.log: Callable[[str], None] = lambda _: None
        self._stream: datasets.IterableDataset | None = None
        self._packer = Packer(rules)
        self._reset_position(epoch=0)

    def _reset_position(self, *, epoch: int) -> None:
        self.epoch = epoch
        self._batch_state: dict[str, Any] | None = None  # the datasets state before the current tokenizer batch
        self._rows_done = 0  # rows of the current batch packed (blank ones included)
        self._pending: list[dict[str, Any]] = []  # blocks completed and not yet yielded
        self._epoch_documents = 0
        self._blank = 0

    # ----------------------------------------------------------------- set-up
    def split(self, *, dp_rank: int, dp_size: int, log: Callable[[str], None] | None = None) -> str:
        """Take this data-parallel rank's share of the corpus (``split_dataset_by_node``); returns a line to log.

        Args:
            dp_rank: this rank among the data-parallel replicas.
            dp_size: the replicas.
            log: where this rank's notes go (an epoch's end).
        """
        from datasets.distributed import split_dataset_by_node

        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.log = log or self.log
        self._stream = split_dataset_by_node(self.dataset, rank=dp_rank, world_size=dp_size)
        return f"data.streaming: {self.source} over {dp_size} data-parallel rank(s), {self.describe_split()}"

    @property
    def num_shards(self) -> int:
        return self.dataset.num_shards

    def describe_split(self) -> str:
        """How the corpus is dealt: ``by shard (2 of 4 each)`` or ``by stride (every 2nd document, 3 shards)``."""
        shards, size = self.num_shards, self.dp_size
        if size == 1:
            return f"{shards} shard(s) read in order"
        if shards % size == 0:
            return f"split by shard ({shards // size} of {shards} each)"
        return f"split by stride (each rank keeps 1 in {size} documents of the {shards} shard(s))"

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Blocks, from the current position on, forever (a finished stream starts its next epoch)."""
        if self._stream is None:
            raise RuntimeError("StreamingBlocks.split(dp_rank=..., dp_size=...) first")
        while True:
            yield from self._epoch_blocks()
            if self._epoch_documents == 0:
                raise DataError(
                    f"{self.field}: data-parallel rank {self.dp_rank} of {self.dp_size} found no document in its share "
                    f"of {self.source} ({self.describe_split()}); give more text or more shards, or run fewer processes"
                )
            stats = self._packer.stats
            self.log(
                f"data.streaming: rank {self.dp_rank} read its whole share of {self.source} (epoch {self.epoch}: "
                f"{self._epoch_documents} documents, {self._blank} blank rows dropped; so far {stats.summary()}); "
                "starting it again until training.max_steps"
            )
            self._reset_position(epoch=self.epoch + 1)

    def _epoch_blocks(self) -> Iterator[dict[str, Any]]:
        """The blocks of the current epoch, from the current position (the pending blocks first)."""
        stream = self._stream
        stream.set_epoch(self.epoch)
        position = self._batch_state  # where this epoch's reading starts (None: at its beginning)
        if position is not None:
            stream.load_state_dict(position)
        rows = iter(stream)  # datasets prepares (and restores) the iteration at the first row pulled
        pulled = False
        for _ in range(self._rows_done):  # rows of the batch packed before the position was taken
            if next(rows, None) is None:
                raise DataError(
                    f"{self.field}: {self.source} ends before the saved stream position (rank {self.dp_rank}, epoch "
                    f"{self.epoch}); its shards changed since the checkpoint: restore them, or start fresh"
                )
            pulled = True
        while self._pending:
            yield self._pending.pop(0)
        while True:
            # the state after the last row pulled: the datasets state before this batch
            self._batch_state = stream.state_dict() if pulled else position
            self._rows_done = 0
            batch = [row for _, row in zip(range(TOKENIZE_BATCH), rows, strict=False)]
            if not batch:
                break
            pulled = True
            for ids in self._tokenize(batch):
                self._rows_done += 1
                if ids is None:
                    self._blank += 1
                    continue
                self._epoch_documents += 1
                self._pending.extend(self._packer.add(*ids))
                while self._pending:
                    yield self._pending.pop(0)
        self._pending.extend(self._packer.finish())
        while self._pending:
            yield self._pending.pop(0)

    def _tokenize(self, rows: list[dict[str, str | None]]) -> list[tuple[list[int], list[int]] | None]:
        """Each row's ``(prompt ids, trained ids)``, None for a row with a missing or blank text."""
        outputs = self.columns.outputs
        kept = [i for i, row in enumerate(rows) if all(row[c] is not None for c in outputs)]
        documents: list[tuple[list[int], list[int]] | None] = [None] * len(rows)
        if not kept:
            return documents
        limit = self.rules.tokenize_max_length
        encoded = {
            c: self.tokenizer(
                [rows[i][c] for i in kept], add_special_tokens=False, truncation=limit is not None, max_length=limit
            )["input_ids"]
            for c in outputs
        }
        for k, i in enumerate(kept):
            documents[i] = (encoded["prompt"][k] if "prompt" in encoded else [], encoded[outputs[-1]][k])
        return documents

    # ----------------------------------------------------------------- position
    def state_dict(self) -> dict[str, Any]:
        """The position after the last block yielded: plain data (JSON), for this rank's checkpoint file."""

        def plain(block: dict[str, Any]) -> dict[str, Any]:
            return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in block.items()}

        return {
            "version": STATE_VERSION,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "num_shards": self.num_shards,
            "block_size": self.rules.block_size,
            "epoch": self.epoch,
            "dataset": self._batch_state,
            "rows_done": self._rows_done,
            "packer": self._packer.state_dict(),
            "pending": [plain(b) for b in self._pending],
            "epoch_documents": self._epoch_documents,
            "blank": self._blank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (before iterating): the next block is the one after the saved position.

        Args:
            state: a state of this rank, of a stream split the same way.
        """
        where = f"the stream position of data-parallel rank {self.dp_rank}"
        if state.get("version") != STATE_VERSION:
            raise DataError(f"{where} is of another format (version {state.get('version')!r}); start fresh")
        if state["dp_size"] != self.dp_size or state["dp_rank"] != self.dp_rank:
            raise DataError(
                f"{where} was saved by rank {state['dp_rank']} of {state['dp_size']}; a stream resumes on the same "
                f"number of data-parallel processes ({state['dp_size']}) or starts fresh"
            )
        if state["num_shards"] != self.num_shards:
            raise DataError(
                f"{where} was saved over {state['num_shards']} shards, {self.source} now has {self.num_shards}; "
                "resume with the shards the run started with, or start fresh"
            )
        self._packer.load_state_dict(state["packer"])
        self._reset_position(epoch=int(state["epoch"]))
        self._batch_state = state["dataset"]
        self._rows_done = int(state["rows_done"])
        self._pending = [
            {k: np.asarray(v, dtype=np.int32) if k in LM_COLUMNS else v for k, v in block.items()}
            for block in state["pending"]
        ]
        self._epoch_documents = int(state["epoch_documents"])
        self._blank = int(state["blank"])


def collate_blocks(blocks: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A micro-batch of blocks: ``input_ids``, ``labels``, ``position_ids`` as ``(batch, block_size)`` long tensors
    (``hftrain.data.language.LMCollator``'s batch, stacked from the numpy rows without a Python list per token)."""
    return {key: torch.from_numpy(np.stack([block[key] for block in blocks])).long() for key in LM_COLUMNS}


# ---------------------------------------------------------------------------
# The job's entry
# ---------------------------------------------------------------------------


def stream_train_split(
    data: DataSection, tokenizer: PreTrainedTokenizerBase, rules: BlockRules, *, log: Callable[[str], None]
) -> dict[str, Any]:
    """``{"train": StreamingBlocks, "validation": packed Dataset}`` for ``data.streaming: true``.

    The trainer deals the stream over its data-parallel ranks (:meth:`StreamingBlocks.split`): the job does not know
    them yet. Every rank builds the same validation blocks (a fixed, map-style split).

    Args:
        data: the validated ``data`` config section.
        tokenizer: the model's tokenizer.
        rules: the packing rules.
        log: receives one-line notes (main process).
    """
    import datasets

    eval_documents = data.max_eval_samples or DEFAULT_EVAL_DOCUMENTS
    if data.train_file is None:
        return _hub_stream(data, tokenizer, rules, eval_documents, log)
    field = "data.train_file"
    files, fmt = list_shards(data.train_file, field)
    columns = detect_columns(
        files[0],
        fmt,
        text_column=data.text_column,
        prompt_column=data.prompt_column,
        response_column=data.response_column,
    )
    starts = [1] * len(files)
    if data.validation_file is not None:
        val_files, val_fmt = list_shards(data.validation_file, "data.validation_file")
        val_columns = detect_columns(
            val_files[0],
            val_fmt,
            text_column=data.text_column,
            prompt_column=data.prompt_column,
            response_column=data.response_column,
        )
        if val_columns.outputs != columns.outputs:
            raise DataError(
                f"data.validation_file: {data.validation_file} is {_kind(val_columns)} data but data.train_file "
                f"{data.train_file} is {_kind(columns)} data; give both the same columns"
            )
        rows = read_rows(
            [str(f) for f in val_files],
            [1] * len(val_files),
            fmt=val_fmt,
            names=val_columns.names,
            fields=val_columns.fields,
            field="data.validation_file",
        )
        documents = _documents(rows, columns, limit=data.max_eval_samples)
        if not documents:
            raise DataError(f"data.validation_file: {data.validation_file} has no rows with a text; fill it in")
    else:
        documents, starts = _stream_head(files, fmt, columns, eval_documents)
        log(
            f"data.streaming: the first {len(documents)} documents of {data.train_file} are the validation set "
            "(data.max_eval_samples; no data.validation_file); training reads the stream after them"
        )
        kept = [i for i, (f, s) in enumerate(zip(files, starts, strict=True)) if s is not None]
        files, starts = [files[i] for i in kept], [starts[i] for i in kept]
        if not files:
            raise DataError(
                f"data.train_file: {data.train_file} holds only {len(documents)} documents, all taken as the "
                "validation set; set data.validation_file, or lower data.max_eval_samples"
            )
    gen_kwargs = {
        "files": [str(f) for f in files],
        "starts": starts,
        "fmt": fmt,
        "names": columns.names,  # tuples: datasets shards the lists only
        "fields": columns.fields,
        "field": field,
    }
    features = datasets.Features({c: datasets.Value("string") for c in columns.outputs})
    dataset = datasets.IterableDataset.from_generator(read_rows, gen_kwargs=gen_kwargs, features=features)
    stream = StreamingBlocks(dataset, tokenizer, rules, columns, source=str(data.train_file), field=field)
    log(f"data.streaming: {len(files)} {fmt} shard(s) of {data.train_file} ({_kind(columns)} text)")
    return {"train": stream, "validation": _pack_validation(documents, tokenizer, rules, log)}


def _kind(columns: Columns) -> str:
    return "prompt/response" if len(columns.names) == 2 else "plain"


def _documents(rows: Iterator[dict[str, str | None]], columns: Columns, *, limit: int | None) -> list[dict[str, str]]:
    """The rows with every text present, up to ``limit``."""
    kept: list[dict[str, str]] = []
    for row in rows:
        if all(row[c] is not None for c in columns.outputs):
            kept.append(row)  # type: ignore[arg-type]
            if limit is not None and len(kept) >= limit:
                break
    return kept


def _stream_head(
    files: list[Path], fmt: str, columns: Columns, count: int
) -> tuple[list[dict[str, str]], list[int | None]]:
    """The first ``count`` documents of the corpus in file order, and where training starts in each shard (None: the
    shard is all validation)."""
    documents: list[dict[str, str]] = []
    starts: list[int | None] = [1] * len(files)
    for index, file in enumerate(files):
        needed = list(columns.names) if fmt in ("csv", "parquet") else None
        for number, record in _records(file, fmt, field="data.train_file", columns=needed):
            if len(documents) >= count:
                starts[index] = number
                return documents, starts
            where = f"line {number}" if fmt != "parquet" else f"row {number}"
            if fmt == "text":
                row = {"text": record if record.strip() else None}
            else:
                row = {
                    out: _text(record.get(name), file, where, name, f)
                    for out, name, f in zip(columns.outputs, columns.names, columns.fields, strict=True)
                }
            if all(row[c] is not None for c in columns.outputs):
                documents.append(row)  # type: ignore[arg-type]
        starts[index] = None  # read whole into the validation set
    return documents, starts


def _pack_validation(
    documents: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, rules: BlockRules, log: Callable[[str], None]
) -> datasets.Dataset:
    """The validation documents packed into a map-style Dataset of blocks (``block_features``)."""
    import datasets

    from hftrain.data.packing import Packer, block_features

    packer = Packer(rules)
    blocks: list[dict[str, Any]] = []
    for start in range(0, len(documents), TOKENIZE_BATCH):
        rows = documents[start : start + TOKENIZE_BATCH]
        limit = rules.tokenize_max_length
        encoded = {
            c: tokenizer(
                [r[c] for r in rows], add_special_tokens=False, truncation=limit is not None, max_length=limit
            )["input_ids"]
            for c in rows[0]
        }
        for k in range(len(rows)):
            blocks += packer.add(encoded["prompt"][k] if "prompt" in encoded else [], encoded[list(rows[0])[-1]][k])
    blocks += packer.finish()
    if not sum(b["num_tokens"] for b in blocks):
        raise DataError(
            "data.max_seq_length: the validation documents have no token to evaluate on (every response is cut away); "
            "raise data.max_seq_length or shorten the prompts"
        )
    log(f"data.streaming: validation {packer.stats.summary()}")
    columns = {name: [b[name] for b in blocks] for name in block_features()}
    return datasets.Dataset.from_dict(columns, features=block_features())


def _hub_stream(
    data: DataSection,
    tokenizer: PreTrainedTokenizerBase,
    rules: BlockRules,
    eval_documents: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """A ``data.dataset_name`` stream: an embedded dataset (``hftrain.data.embedded``) or a hub dataset, where a hub
    is reachable; its first documents are the validation set (a hub dataset cannot be paired with a local file)."""
    import datasets

    name = str(data.dataset_name)
    if data.validation_file is not None:
        raise ConfigError(
            "data.validation_file needs data.train_file; with data.dataset_name the validation set is the stream's "
            "first data.max_eval_samples documents, so remove data.validation_file"
        )
    if name.startswith("embedded:"):
        from hftrain.data.embedded import load_embedded

        frame = load_embedded(name, log=log)[["text"]]
        source = datasets.Dataset.from_pandas(frame, preserve_index=False).to_iterable_dataset(num_shards=1)
    else:
        try:
            source = datasets.load_dataset(name, split="train", streaming=True)
        except Exception as error:  # noqa: BLE001 - the hub's errors vary (offline, unknown, gated): one line
            reason = " ".join(str(error).split())[:200]
            raise DataError(
                f"data.dataset_name: cannot stream {name!r} from the hub ({type(error).__name__}: {reason}); give a "
                "reachable hub dataset, or local shards as data.train_file"
            ) from None
    available = list(source.column_names or [])
    columns = detect_hub_columns(available, name, data.text_column, data.prompt_column, data.response_column)
    rows = source.select_columns(list(columns.names)).map(
        lambda row: {
            out: _text(row[n], name, "a row", n, f)
            for out, n, f in zip(columns.outputs, columns.names, columns.fields, strict=True)
        },
        remove_columns=list(columns.names),
        features=datasets.Features({c: datasets.Value("string") for c in columns.outputs}),
    )
    documents = _documents(iter(rows.take(eval_documents)), columns, limit=eval_documents)
    log(f"data.streaming: the first {eval_documents} rows of {name} are the validation set; training reads the rest")
    stream = StreamingBlocks(
        rows.skip(eval_documents), tokenizer, rules, columns, source=name, field="data.dataset_name"
    )
    return {"train": stream, "validation": _pack_validation(documents, tokenizer, rules, log)}


def detect_hub_columns(
    available: list[str], name: str, text_column: str, prompt_column: str, response_column: str
) -> Columns:
    """The columns of a dataset stream (the map-style rule), from its declared column names."""
    if prompt_column in available and response_column in available:
        return Columns((prompt_column, response_column), ("data.prompt_column", "data.response_column"))
    if text_column in available:
        return Columns((text_column,), ("data.text_column",))
    raise DataError(
        f"data.text_column: column {text_column!r} not found in {name}; available columns: "
        f"{', '.join(available) or '(unknown)'}. Set data.text_column, or data.prompt_column and data.response_column"
    )
