"""Causal language-model data (``model.task: causal_lm``): text or prompt/response splits, packed into blocks.

Loading (``load_text_splits``) reads the same sources as classification (``hftrain.data.loading``: local
CSV/JSON(L)/Parquet, embedded datasets) plus plain ``.txt`` files (one document per non-blank line), with the same
held-out split, sample limits and one-line errors. A source whose columns include both ``data.prompt_column`` and
``data.response_column`` is prompt/response data (columns ``prompt``, ``response``); anything else is plain text
from ``data.text_column`` (column ``text``).

Packing (``pack_splits``) turns each split into blocks of exactly ``block_size`` tokens by the rules of
``hftrain.data.packing`` (documents whole and in order, a longer one continued over blocks or cut by
``data.long_documents``, -100 labels at prompts, padding and document starts, positions restarting at every document),
tokenizing in batches with ``datasets.map`` and writing blocks a chunk at a time, so that neither the corpus nor its
tokens are ever held whole in memory. ``hftrain.data.cache`` keeps the result, keyed by the data, the tokenizer and
the rules.

With no ``attention_mask`` and no KV cache, transformers reads the restarts of ``position_ids`` as packed sequences
and builds a block-diagonal causal mask, so a token attends to its own document only (``lm_collator`` says when this
holds).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.data.embedded import load_embedded
from hftrain.data.labels import shown
from hftrain.data.loading import (
    _FILE_FORMATS,
    _check_max_samples,
    _check_source,
    _head,
    _is_blank,
    _split,
    check_regular_file,
    load_table,
)
from hftrain.data.packing import BlockRules, Packer, block_features
from hftrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets
    import pandas as pd
    import torch
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""The label transformers' cross entropy skips."""

TEXT_FILE_SUFFIX = ".txt"
"""Plain-text files: one document per non-blank line."""

LM_COLUMNS = ("input_ids", "labels", "position_ids")
"""The columns ``lm_collator`` stacks: what the model's forward takes."""


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def load_text_splits(
    *,
    dataset_name: str | None,
    train_file: str | None,
    validation_file: str | None,
    text_column: str,
    prompt_column: str,
    response_column: str,
    validation_split_percentage: float,
    max_train_samples: int | None,
    max_eval_samples: int | None,
    seed: int,
    log: Callable[[str], None] = print,
    work_dir: str | os.PathLike[str] | None = None,
) -> datasets.DatasetDict:
    """Load language-model data as splits "train" and "validation", in a deterministic order.

    Each split has exactly the string columns "prompt" and "response" (a source with both ``prompt_column`` and
    ``response_column``) or "text" (any other source: ``text_column`` of a table, the lines of a .txt file, the
    texts of an embedded dataset with its labels dropped). Rows with a missing or blank text are dropped and
    counted in one log line; numbers are taken as their text, JSON lists and objects are refused.

    A local file is read into Arrow and worked on in batches (``datasets``: ``load_dataset``, batched ``map`` and
    ``filter``), never as one Python or pandas table: memory stays bounded whatever the corpus' size.

    Args:
        dataset_name: an embedded dataset name (``hftrain.data.embedded.EMBEDDED_DATASETS``); exclusive with
            train_file.
        train_file: a local .txt (one document per non-blank line), .csv/.json/.jsonl/.parquet file
            (.csv.gz/.csv.bz2 too).
        validation_file: optional local file for validation, of the same kind (plain text or prompt/response)
            as train_file; without it the train data is split.
        text_column: name of the text column of a table.
        prompt_column: name of the prompt column of prompt/response data.
        response_column: name of the response column of prompt/response data.
        validation_split_percentage: percent of train rows held out when validation_file is None.
        max_train_samples: keep only the first N train rows (after splitting), if given.
        max_eval_samples: keep only the first N validation rows (after splitting), if given.
        seed: seed of the train/validation split.
        log: receives one-line progress messages (e.g. dropped-row counts).
        work_dir: where the Arrow files of the reading go (a cache build's scratch folder); None: ``datasets``' own
            cache for a table, memory for a .txt file.
    """
    import datasets

    _check_source(dataset_name, train_file, validation_file)
    _check_max_samples(max_train_samples, "data.max_train_samples")
    _check_max_samples(max_eval_samples, "data.max_eval_samples")
    if prompt_column == response_column:
        raise ConfigError(
            f"data.response_column: {response_column!r} is data.prompt_column too; the prompt and the response "
            "must be two different columns"
        )
    columns = (text_column, prompt_column, response_column)
    if dataset_name is not None:
        frame = load_embedded(dataset_name, log=log)[["text"]]
        train = _frame_to_dataset(_drop_blank_frame(frame, dataset_name, "data.dataset_name", log))
    else:
        train = _read_documents(train_file, "data.train_file", *columns, log, work_dir)
    source = dataset_name or str(train_file)
    if validation_file is None:
        train, validation = _split(train, validation_split_percentage, seed, source)
    else:
        validation = _read_documents(validation_file, "data.validation_file", *columns, log, work_dir)
        if validation.column_names != train.column_names:
            raise DataError(
                f"data.validation_file: {validation_file} is {_kind(validation.column_names)} data but "
                f"data.train_file {train_file} is {_kind(train.column_names)} data; give both files the same "
                f"columns ({prompt_column!r} and {response_column!r}, or {text_column!r})"
            )
    return datasets.DatasetDict(
        {"train": _head(train, max_train_samples), "validation": _head(validation, max_eval_samples)}
    )


def _kind(columns: Sequence[str]) -> str:
    """Name the kind of a split from its columns: "prompt/response" or "plain-text".

    Args:
        columns: the split's column names.
    """
    return "prompt/response" if "prompt" in columns else "plain-text"


def _read_documents(
    path: str | os.PathLike[str],
    field: str,
    text_column: str,
    prompt_column: str,
    response_column: str,
    log: Callable[[str], None],
    work_dir: str | os.PathLike[str] | None = None,
) -> datasets.Dataset:
    """Read a local file as documents: columns "text", or "prompt" and "response"; blank rows dropped.

    Args:
        path: the file to read.
        field: config field that named the file (data.train_file or data.validation_file).
        text_column: name of the text column of a table.
        prompt_column: name of the prompt column.
        response_column: name of the response column.
        log: receives the dropped-row count.
        work_dir: where the Arrow files go (None: ``datasets``' cache, or memory for a .txt file).
    """
    name = Path(path).name.lower()
    if name.endswith(TEXT_FILE_SUFFIX):
        return _read_lines(path, field, work_dir)
    if not any(name.endswith(suffix) for suffix in _FILE_FORMATS):
        raise DataError(
            f"{field}: unsupported file type for {path}; use one of {', '.join([TEXT_FILE_SUFFIX, *_FILE_FORMATS])}"
        )
    table = load_table(path, field, Path(work_dir) / "tables" if work_dir is not None else None)
    source = str(path)
    present = table.column_names
    available = ", ".join(map(str, present)) or "(none)"
    if prompt_column in present and response_column in present:
        selected = {
            "prompt": (prompt_column, "data.prompt_column"),
            "response": (response_column, "data.response_column"),
        }
    elif text_column in present:
        selected = {"text": (text_column, "data.text_column")}
    else:
        pair = {prompt_column: "data.prompt_column", response_column: "data.response_column"}
        found = [column for column in pair if column in present]
        if found:  # one of the pair is there: the user meant prompt/response data
            have, lack = found[0], next(column for column in pair if column != found[0])
            raise DataError(
                f"{pair[lack]}: column {lack!r} not found in {source}, which has {have!r} ({pair[have]}); "
                f"available columns: {available}. Set {pair[lack]} to one of them, or data.text_column for plain text"
            )
        raise DataError(
            f"data.text_column: column {text_column!r} not found in {source}; available columns: {available}. "
            "Set data.text_column to one of them, or data.prompt_column and data.response_column "
            "for prompt/response data"
        )
    for column, field_name in selected.values():
        _check_column_texts(table, column, source, field_name)
    return _as_documents(table, selected, source, field, log)


_BATCH = 10_000
"""Rows per batch when a file's rows are checked, converted or written."""


def _check_column_texts(table: datasets.Dataset, column: str, source: str, field: str) -> None:
    """Refuse a column holding a JSON list or object in some row (``check_texts``' rule and line), batch by batch.

    A column of strings, numbers or booleans (an Arrow scalar type) holds none and is not read.

    Args:
        table: the file's rows.
        column: the column's name in the file.
        source: file name for messages.
        field: the config field that named the column.
    """
    import datasets

    if isinstance(table.features[column], datasets.Value):
        return
    offset = 0
    for batch in table.select_columns([column]).iter(batch_size=_BATCH):
        for index, value in enumerate(batch[column]):
            if isinstance(value, (list, tuple, dict)):
                kind = "an object" if isinstance(value, dict) else "a list"
                raise DataError(
                    f"{field}: column {column!r} of {source} holds {kind} at row {offset + index + 1} "
                    f"({shown(value)}), not a text; write each text as one string in the file"
                )
        offset += len(batch[column])


def _as_documents(
    table: datasets.Dataset,
    selected: Mapping[str, tuple[str, str]],
    source: str,
    field: str,
    log: Callable[[str], None],
) -> datasets.Dataset:
    """The selected columns as strings under their new names, rows with a missing or blank text dropped (logged),
    in batches (``map`` and ``filter`` write next to ``table``'s own Arrow files).

    Args:
        table: the file's rows, texts checked.
        selected: new name -> (the column in the file, its config field).
        source: file name for messages.
        field: config field that named the file.
        log: receives the dropped-row count.
    """
    import datasets

    names = {new: old for new, (old, _) in selected.items()}

    def as_text(batch: dict[str, list]) -> dict[str, list]:
        return {new: [None if _blank(value) else str(value) for value in batch[old]] for new, old in names.items()}

    def complete(batch: dict[str, list]) -> list[bool]:
        return [all(value is not None for value in row) for row in zip(*(batch[new] for new in names), strict=True)]

    features = datasets.Features({new: datasets.Value("string") for new in names})
    texts = table.map(as_text, batched=True, batch_size=_BATCH, remove_columns=table.column_names, features=features)
    kept = texts.filter(complete, batched=True, batch_size=_BATCH)
    dropped = len(texts) - len(kept)
    if dropped:
        log(f"dropped {dropped} of {len(texts)} rows with missing {' or '.join(names)} in {source}")
    if not len(kept):
        raise DataError(
            f"{field}: {source} has no rows with {' and '.join(names)} ({len(texts)} rows read); "
            "fill in the data or point to another file"
        )
    return kept


def _blank(value: object) -> bool:
    """A missing text: None, NaN, or an empty or whitespace-only string (``_is_blank``'s rule for one value)."""
    return (
        value is None
        or (isinstance(value, float) and math.isnan(value))
        or (isinstance(value, str) and not value.strip())
    )


def _read_lines(
    path: str | os.PathLike[str], field: str, work_dir: str | os.PathLike[str] | None = None
) -> datasets.Dataset:
    """Read a UTF-8 .txt file: one document per non-blank line, in file order, line endings removed (``str.
    splitlines``' line boundaries); column "text".

    Read and written in batches: with ``work_dir``, the lines go to an Arrow file there (memory-mapped), else into
    memory.

    Args:
        path: the .txt file.
        field: config field that named the file.
        work_dir: the folder of the Arrow file (None: in memory).
    """
    import datasets

    file = Path(path)
    if file.is_dir():
        raise DataError(f"{field}: {path} is a directory; give the data file itself (TXT, CSV, JSON/JSONL or Parquet)")
    check_regular_file(file, field)
    if file.stat().st_size == 0:
        raise DataError(f"{field}: {path} is empty; fill in the data or point to another file")
    features = datasets.Features({"text": datasets.Value("string")})
    batches = _line_batches(file, field)
    if work_dir is None:
        lines = [line for batch in batches for line in batch]
        dataset = datasets.Dataset.from_dict({"text": lines}, features=features)
    else:
        from datasets.arrow_writer import ArrowWriter

        Path(work_dir).mkdir(parents=True, exist_ok=True)
        target = Path(work_dir) / f"{field.split('.')[-1]}.lines.arrow"
        with ArrowWriter(features=features, path=str(target)) as writer:
            for batch in batches:
                writer.write_batch({"text": batch})
            writer.finalize()
        dataset = datasets.Dataset.from_file(str(target))
    if not len(dataset):
        raise DataError(f"{field}: {path} has only blank lines; write one document per line")
    return dataset


def _line_batches(file: Path, field: str) -> Iterator[list[str]]:
    """The non-blank lines of a UTF-8 file in batches, split where ``str.splitlines`` splits; a byte that is not
    UTF-8 is one line naming its offset in the file.

    Args:
        file: the .txt file.
        field: config field that named the file.
    """
    batch: list[str] = []
    offset = 0
    with file.open("rb") as handle:
        for raw in handle:  # split at b"\n": no UTF-8 sequence holds that byte
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{field}: {file} is not UTF-8 text (byte {offset + err.start}: {err.reason}); save it as UTF-8"
                ) from err
            offset += len(raw)
            batch += [line for line in text.splitlines() if line.strip()]
            if len(batch) >= _BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _drop_blank_frame(frame: pd.DataFrame, source: str, field: str, log: Callable[[str], None]) -> pd.DataFrame:
    """Drop rows with a missing or blank text (any column), log how many, fail if none are left; numbers to text.

    For the embedded datasets (small tables in memory).

    Args:
        frame: columns "text", or "prompt" and "response".
        source: file or dataset name for messages.
        field: config field that named the source.
        log: receives the dropped-row count.
    """
    missing = _is_blank(frame[frame.columns[0]])
    for column in frame.columns[1:]:
        missing |= _is_blank(frame[column])
    what = " or ".join(frame.columns)
    dropped = int(missing.sum())
    if dropped:
        log(f"dropped {dropped} of {len(frame)} rows with missing {what} in {source}")
    kept = frame[~missing].copy()
    if kept.empty:
        raise DataError(
            f"{field}: {source} has no rows with {' and '.join(frame.columns)} ({len(frame)} rows read); "
            "fill in the data or point to another file"
        )
    for column in kept.columns:
        kept[column] = kept[column].map(str)
    return kept.reset_index(drop=True)


def _frame_to_dataset(frame: pd.DataFrame) -> datasets.Dataset:
    """Build a Dataset of string columns from a checked frame.

    Args:
        frame: columns "text", or "prompt" and "response", all strings.
    """
    import datasets

    features = datasets.Features({column: datasets.Value("string") for column in frame.columns})
    return datasets.Dataset.from_pandas(frame, features=features, preserve_index=False)


# ---------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------


def pack_splits(
    splits: datasets.DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    *,
    block_size: int,
    log: Callable[[str], None] = print,
    long_documents: str = "continue",
    max_position: int | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    num_proc: int = 1,
) -> datasets.DatasetDict:
    """Tokenize each split's documents and pack them into blocks of exactly ``block_size`` tokens.

    The rules are ``hftrain.data.packing``'s (eos after every document, a longer one continued over blocks or cut,
    -100 labels at prompt tokens, padding and document starts). Each block has the columns ``input_ids``,
    ``labels``, ``position_ids`` (``block_size`` ints each), ``length`` (``block_size``, for samplers) and
    ``num_tokens`` (the targets the shifted causal-LM loss counts).

    Split by split, in batches: ``datasets.map`` tokenizes (in ``num_proc`` processes), then the documents go in
    order through one :class:`~hftrain.data.packing.Packer` and its blocks are written a chunk at a time: memory
    holds one batch of documents and one chunk of blocks, whatever the corpus' size. With ``work_dir`` the tokens and
    blocks are Arrow files there (memory-mapped); without, in memory (small inputs, tests). The result depends only
    on the data, the tokenizer and the rules.

    Args:
        splits: splits with a ``text`` column, or ``prompt`` and ``response`` columns (``load_text_splits``).
        tokenizer: the model's tokenizer; it must have an eos token (or a sep token). Its pad token fills block tails
            (the eos token when it has none).
        block_size: tokens per block (``data.max_seq_length``, as far as the model takes it); at least 2.
        log: receives one line: the long-document rule, and per split its documents, blocks, fill and tokens kept.
        long_documents: ``data.long_documents``: ``continue`` or ``truncate``.
        max_position: the model's ``max_position_embeddings`` (continued positions restart below it), if any.
        work_dir: the folder for the Arrow files of the tokens and blocks (None: in memory).
        num_proc: processes that tokenize.
    """
    import datasets

    rules = BlockRules.of(tokenizer, block_size, long_documents=long_documents, max_position=max_position)
    packed: dict[str, datasets.Dataset] = {}
    summary: list[str] = []
    for name, split in splits.items():
        documents = _tokenize(split, tokenizer, name=name, work_dir=work_dir, num_proc=num_proc)
        packer = Packer(rules)
        target = Path(work_dir) / f"blocks-{name}.arrow" if work_dir is not None else None
        packed[name] = _write_blocks(_blocks(documents, packer), target)
        _check_targets(name, packer.stats.targets, packer.stats.documents, block_size)
        summary.append(f"{name} {packer.stats.summary()}")
    log(f"packed into blocks of {block_size} tokens (long documents: {long_documents}): {'; '.join(summary)}")
    return datasets.DatasetDict(packed)


def _check_targets(split: str, targets: int, documents: int, block_size: int) -> None:
    """Refuse a split with no target token: training on it takes no step of learning (every loss is 0 over 0
    targets) and evaluating it reports perplexity 1.0, both without a word.

    Args:
        split: ``train`` or ``validation``.
        targets: the targets of all its blocks.
        documents: its documents, for the message.
        block_size: ``data.max_seq_length``.
    """
    if targets:
        return
    field = "data.train_file" if split == "train" else "data.validation_file"
    raise DataError(
        f"data.max_seq_length: the {split} split ({documents} documents) has no token to train on: every response "
        f"is cut away, its prompt being data.max_seq_length={block_size} tokens or longer (the loss is on the "
        f"responses only); raise data.max_seq_length, or shorten the prompts in {field}"
    )


TOKENIZE_BATCH = 1000
"""Documents per tokenizer call."""


def _tokenize(
    split: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    name: str,
    work_dir: str | os.PathLike[str] | None,
    num_proc: int,
) -> datasets.Dataset:
    """A split's documents as token ids, without the template's special tokens: column ``ids`` (plain text), or
    ``prompt_ids`` and ``ids`` (prompt/response), int32, in the split's order.

    Each part is tokenized whole, also under ``truncate`` (where only the block is kept): the packer then counts
    every document's true length, and the log says how many tokens the rule kept. ``datasets.map`` in batches of
    :data:`TOKENIZE_BATCH`, in ``num_proc`` processes, into an Arrow file in ``work_dir`` (else in memory); its
    fingerprint is given, so ``datasets`` does not pickle the tokenizer with dill to make one.

    Args:
        split: a split with a ``text`` column, or ``prompt`` and ``response`` columns.
        tokenizer: the model's tokenizer.
        name: the split's name (its file's name).
        work_dir: the folder of the Arrow file (None: in memory).
        num_proc: processes that tokenize.
    """
    import datasets

    parts = {"prompt": "prompt_ids", "response": "ids"} if "prompt" in split.column_names else {"text": "ids"}

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {column: tokenizer(batch[text], add_special_tokens=False)["input_ids"] for text, column in parts.items()}

    ints = datasets.Sequence(datasets.Value("int32"))
    processes = max(1, min(num_proc, len(split) // TOKENIZE_BATCH))
    fingerprint = hashlib.sha256(
        f"{split._fingerprint}|{type(tokenizer).__name__}|{tokenizer.name_or_path}|{len(tokenizer)}".encode()
    ).hexdigest()[:16]
    files = {"cache_file_name": str(Path(work_dir) / f"tokens-{name}.arrow")} if work_dir is not None else {}
    return split.map(
        encode,
        batched=True,
        batch_size=TOKENIZE_BATCH,
        remove_columns=split.column_names,
        features=datasets.Features(dict.fromkeys(parts.values(), ints)),
        num_proc=processes if processes > 1 else None,
        keep_in_memory=work_dir is None,
        new_fingerprint=fingerprint,
        **files,
    )


def _blocks(documents: datasets.Dataset, packer: Packer) -> Iterator[dict[str, Any]]:
    """The blocks of ``documents`` (tokenized: ``ids``, maybe ``prompt_ids``), in order, read a batch at a time."""
    prompts = "prompt_ids" in documents.column_names
    for batch in documents.with_format("numpy").iter(batch_size=TOKENIZE_BATCH):
        for index, ids in enumerate(batch["ids"]):
            yield from packer.add(batch["prompt_ids"][index] if prompts else (), ids)
    yield from packer.finish()


BLOCK_CHUNK = 1000
"""Blocks written to the Arrow file at a time."""


def _write_blocks(blocks: Iterator[dict[str, Any]], target: Path | None) -> datasets.Dataset:
    """The blocks as a Dataset of ``block_features()``: written :data:`BLOCK_CHUNK` at a time to the Arrow file
    ``target`` and memory-mapped from it, or, without a target, gathered in memory.

    Args:
        blocks: the packer's blocks, in order.
        target: the Arrow file (None: in memory).
    """
    import datasets
    from datasets.arrow_writer import ArrowWriter

    features = block_features()
    if target is None:
        rows = list(blocks)
        columns = {key: [row[key] for row in rows] for key in features}
        return datasets.Dataset.from_dict(columns, features=features)
    with ArrowWriter(features=features, path=str(target)) as writer:
        chunk: list[dict[str, Any]] = []
        for block in blocks:
            chunk.append(block)
            if len(chunk) == BLOCK_CHUNK:
                writer.write_batch({key: [row[key] for row in chunk] for key in features})
                chunk = []
        if chunk:
            writer.write_batch({key: [row[key] for row in chunk] for key in features})
        writer.finalize()
    return datasets.Dataset.from_file(str(target))


# ---------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LMCollator:
    """Stacks packed blocks into a batch: ``input_ids``, ``labels`` and ``position_ids`` as long tensors.

    Every other column (``length``, ``num_tokens``) is dropped, and no ``attention_mask`` is made: in transformers
    5.x, ``masking_utils.create_causal_mask`` (and ``create_sliding_window_causal_mask``) then finds the packed
    documents from the restarts of ``position_ids`` (``find_packed_sequence_indices``) and builds a block-diagonal
    causal mask, for ``sdpa`` and ``eager`` attention alike (both are mask interfaces that take the packed mask
    function; the packed mask also turns off sdpa's ``is_causal`` shortcut). That holds only when, in the model's
    forward:

    - ``attention_mask`` is None: any 2D mask, even all ones, turns the detection off (and lets documents see
      each other);
    - there is no KV cache: ``past_key_values`` is None *and* ``use_cache`` is False. A config's default
      ``use_cache=True`` makes the model build an empty ``DynamicCache`` in its forward, in training mode too
      (unless gradient checkpointing turned the cache off), and then every document attends to the ones before it
      in its block. Call the model with ``use_cache=False`` (or set ``model.config.use_cache = False``);
    - the model builds its mask with ``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask``
      from ``position_ids`` (checked in ``tests/test_lm_data.py`` for Llama, GPT-2, Qwen2 and Mixtral).

    ``pad_to_multiple_of`` (sequence or context parallelism cut the sequence into equal chunks): the blocks are
    padded up to a multiple of it with one more run of padding (id 0, label -100, positions from 0), which no real
    token attends to and no loss counts.

    Args:
        pad_to_multiple_of: the multiple the block length is padded up to (None: as packed).
    """

    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, torch.Tensor]:
        """The batch of ``features``: packed blocks (``pack_splits``), all of the same length."""
        import torch

        batch = {key: torch.tensor([feature[key] for feature in features], dtype=torch.long) for key in LM_COLUMNS}
        multiple = self.pad_to_multiple_of or 1
        missing = -batch["input_ids"].shape[1] % multiple
        if missing:
            rows = batch["input_ids"].shape[0]
            tail = {
                "input_ids": torch.zeros(rows, missing, dtype=torch.long),
                "labels": torch.full((rows, missing), IGNORE_INDEX, dtype=torch.long),
                "position_ids": torch.arange(missing).expand(rows, missing),
            }
            batch = {key: torch.cat([batch[key], tail[key]], dim=1) for key in LM_COLUMNS}
        return batch


lm_collator = LMCollator()
"""The collator of packed blocks as they are (:class:`LMCollator`)."""
