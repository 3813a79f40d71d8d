"""Causal language-model data (``model.task: causal_lm``): text or prompt/response splits, packed into blocks.

Loading (``load_text_splits``) reads the same sources as classification (``hftrain.data.loading``: local
CSV/JSON(L)/Parquet, embedded datasets) plus plain ``.txt`` files (one document per non-blank line), with the same
held-out split, sample limits and one-line errors. A source whose columns include both ``data.prompt_column`` and
``data.response_column`` is prompt/response data (columns ``prompt``, ``response``); anything else is plain text
from ``data.text_column`` (column ``text``).

Packing (``pack_splits``) turns each split into blocks of exactly ``block_size`` tokens, by these rules:

1. A document is its tokens without the special tokens of the tokenizer's template, then ``eos_token_id``
   (a BERT-style tokenizer without one: its ``sep_token_id``): the model learns where a document ends.
   Prompt/response: prompt ids + response ids + eos, tokenized separately, so the boundary is where the data says
   it is.
2. A document longer than ``block_size`` is cut to its first ``block_size`` tokens (counted in one log line): a
   document is never split across blocks, so no block starts mid-document without its beginning in view.
3. Documents go whole, in order, greedily into blocks: one that does not fit in what is left of the current block
   starts the next one, and the unused tail is padding (``pad_token_id``, else ``eos_token_id``). Whole documents
   cost some padding but keep every token's context inside its own document; the order is the data's, so every
   process builds the same blocks.
4. ``labels`` are the input ids with -100 at prompt tokens (the loss is on the response and its eos only), padding,
   and the first token of every document. transformers' causal-LM loss shifts inside (position t is scored on
   ``labels[t + 1]``), so a -100 at a document's first token means no token is trained to predict the start of
   the next, unrelated document. ``num_tokens`` is the count of ``labels[1:]`` that are not -100: exactly the
   targets that loss averages over.
5. ``position_ids`` restart at 0 at every document (and the padding tail is one more run from 0). With no
   ``attention_mask`` and no KV cache, transformers reads the restarts as packed sequences and builds a
   block-diagonal causal mask, so a token attends to its own document only (``lm_collator`` says when this holds).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.data.embedded import load_embedded
from hftrain.data.loading import (
    _FILE_FORMATS,
    _check_max_samples,
    _check_source,
    _head,
    _is_blank,
    _read_file,
    _split,
    check_regular_file,
    check_texts,
)
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
) -> datasets.DatasetDict:
    """Load language-model data as splits "train" and "validation", in a deterministic order.

    Each split has exactly the string columns "prompt" and "response" (a source with both ``prompt_column`` and
    ``response_column``) or "text" (any other source: ``text_column`` of a table, the lines of a .txt file, the
    texts of an embedded dataset with its labels dropped). Rows with a missing or blank text are dropped and
    counted in one log line; numbers are taken as their text, JSON lists and objects are refused.

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
        train = _to_dataset(_drop_blank(frame, dataset_name, "data.dataset_name", log))
    else:
        train = _to_dataset(_read_documents(train_file, "data.train_file", *columns, log))
    source = dataset_name or str(train_file)
    if validation_file is None:
        train, validation = _split(train, validation_split_percentage, seed, source)
    else:
        validation = _to_dataset(_read_documents(validation_file, "data.validation_file", *columns, log))
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
) -> pd.DataFrame:
    """Read a local file as documents: columns "text", or "prompt" and "response"; blank rows dropped.

    Args:
        path: the file to read.
        field: config field that named the file (data.train_file or data.validation_file).
        text_column: name of the text column of a table.
        prompt_column: name of the prompt column.
        response_column: name of the response column.
        log: receives the dropped-row count.
    """
    import pandas as pd

    name = Path(path).name.lower()
    if name.endswith(TEXT_FILE_SUFFIX):
        return pd.DataFrame({"text": _read_lines(path, field)})
    if not any(name.endswith(suffix) for suffix in _FILE_FORMATS):
        raise DataError(
            f"{field}: unsupported file type for {path}; use one of {', '.join([TEXT_FILE_SUFFIX, *_FILE_FORMATS])}"
        )
    frame = _read_file(path, field)
    source = str(path)
    available = ", ".join(map(str, frame.columns)) or "(none)"
    if prompt_column in frame.columns and response_column in frame.columns:
        selected = {
            "prompt": (prompt_column, "data.prompt_column"),
            "response": (response_column, "data.response_column"),
        }
    elif text_column in frame.columns:
        selected = {"text": (text_column, "data.text_column")}
    else:
        pair = {prompt_column: "data.prompt_column", response_column: "data.response_column"}
        present = [column for column in pair if column in frame.columns]
        if present:  # one of the pair is there: the user meant prompt/response data
            have, lack = present[0], next(column for column in pair if column != present[0])
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
        check_texts(frame[column], source, column, field_name)
    frame = frame[[column for column, _ in selected.values()]].set_axis(list(selected), axis=1)
    return _drop_blank(frame.reset_index(drop=True), source, field, log)


def _read_lines(path: str | os.PathLike[str], field: str) -> list[str]:
    """Read a UTF-8 .txt file: one document per non-blank line, in file order, line endings removed.

    Args:
        path: the .txt file.
        field: config field that named the file.
    """
    file = Path(path)
    if file.is_dir():
        raise DataError(f"{field}: {path} is a directory; give the data file itself (TXT, CSV, JSON/JSONL or Parquet)")
    check_regular_file(file, field)
    if file.stat().st_size == 0:
        raise DataError(f"{field}: {path} is empty; fill in the data or point to another file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{field}: {path} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8"
        ) from err
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise DataError(f"{field}: {path} has only blank lines; write one document per line")
    return lines


def _drop_blank(frame: pd.DataFrame, source: str, field: str, log: Callable[[str], None]) -> pd.DataFrame:
    """Drop rows with a missing or blank text (any column), log how many, fail if none are left; numbers to text.

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


def _to_dataset(frame: pd.DataFrame) -> datasets.Dataset:
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
) -> datasets.DatasetDict:
    """Tokenize each split's documents and pack them into blocks of exactly ``block_size`` tokens.

    The rules are the module's: eos after every document, documents cut to ``block_size``, packed whole and in
    order, padding at the end of a block; -100 labels at prompt tokens, padding and document starts. Each block
    has the columns ``input_ids``, ``labels``, ``position_ids`` (``block_size`` ints each), ``length``
    (``block_size``, for samplers) and ``num_tokens`` (the targets the shifted causal-LM loss counts). The result
    depends only on the data and the tokenizer: every process builds the same blocks.

    Args:
        splits: splits with a ``text`` column, or ``prompt`` and ``response`` columns (``load_text_splits``).
        tokenizer: the model's tokenizer; it must have an eos token. Its pad token fills block tails (the eos
            token when it has none: padding is never attended to from a document nor trained on, so its id
            does not matter).
        block_size: tokens per block (``data.max_seq_length``, as far as the model takes it); at least 2.
        log: receives one line of block counts and fill ratios, and one of truncated documents if any.
    """
    import datasets

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ConfigError(
            f"data.max_seq_length: the block length of a causal LM must be an integer of at least 2, got {block_size!r}"
        )
    # the end of a document: the eos token, else a BERT-style tokenizer's separator (its end of a text)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if eos is None:
        raise ConfigError(
            f"model.model_name_or_path: the tokenizer {tokenizer.name_or_path or type(tokenizer).__name__} has no eos "
            "token (nor sep), which ends every packed document; set eos_token in its tokenizer_config.json"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "labels": datasets.Sequence(datasets.Value("int32")),
            "position_ids": datasets.Sequence(datasets.Value("int32")),
            "length": datasets.Value("int64"),
            "num_tokens": datasets.Value("int64"),
        }
    )
    packed: dict[str, datasets.Dataset] = {}
    summary: list[str] = []
    truncated: list[str] = []
    for name, split in splits.items():
        documents = _tokenize_documents(split, tokenizer, block_size)
        blocks, filled, cut = _pack(documents, block_size, eos=eos, pad=pad)
        # from_dict builds the table in memory: no cache files, nothing for concurrent processes to race on, and
        # no map over a closure holding the tokenizer for datasets to hash with dill.
        packed[name] = datasets.Dataset.from_dict(blocks, features=features)
        _check_targets(name, blocks["num_tokens"], len(documents), block_size)
        n_blocks = len(blocks["input_ids"])
        fill = sum(filled) / (n_blocks * block_size) if n_blocks else 0.0
        summary.append(f"{name} {len(documents)} documents in {n_blocks} blocks (fill {fill:.1%})")
        if cut:
            truncated.append(f"{name} {cut} of {len(documents)}")
    if truncated:
        log(
            f"truncated documents longer than data.max_seq_length={block_size} tokens to their first "
            f"{block_size} tokens: {', '.join(truncated)}"
        )
    log(f"packed into blocks of {block_size} tokens: {'; '.join(summary)}")
    return datasets.DatasetDict(packed)


def _check_targets(split: str, num_tokens: Sequence[int], documents: int, block_size: int) -> None:
    """Refuse a split with no target token: training on it takes no step of learning (every loss is 0 over 0
    targets) and evaluating it reports perplexity 1.0, both without a word.

    Args:
        split: ``train`` or ``validation``.
        num_tokens: the targets of each of its blocks.
        documents: its documents, for the message.
        block_size: ``data.max_seq_length``.
    """
    if sum(num_tokens):
        return
    field = "data.train_file" if split == "train" else "data.validation_file"
    raise DataError(
        f"data.max_seq_length: the {split} split ({documents} documents) has no token to train on: every response "
        f"is cut away, its prompt being data.max_seq_length={block_size} tokens or longer (the loss is on the "
        f"responses only); raise data.max_seq_length, or shorten the prompts in {field}"
    )


def _tokenize_documents(
    split: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, block_size: int, chunk: int = 1000
) -> list[tuple[list[int], list[int]]]:
    """Tokenize a split's documents, without template special tokens, as (prompt ids, trained ids) pairs.

    Plain text has no prompt ids. Each part is cut at ``block_size`` tokens while tokenizing (more could never fit
    in a block), which also keeps the tokenizer from warning about texts longer than the model takes.

    Args:
        split: a split with a ``text`` column, or ``prompt`` and ``response`` columns.
        tokenizer: the model's tokenizer.
        block_size: tokens per block.
        chunk: documents per tokenizer call.
    """

    def encode(texts: list[str]) -> list[list[int]]:
        ids: list[list[int]] = []
        for start in range(0, len(texts), chunk):
            batch = texts[start : start + chunk]
            ids += tokenizer(batch, add_special_tokens=False, truncation=True, max_length=block_size)["input_ids"]
        return ids

    if "prompt" in split.column_names and "response" in split.column_names:
        prompts, responses = encode(list(split["prompt"][:])), encode(list(split["response"][:]))
        return list(zip(prompts, responses, strict=True))
    return [([], ids) for ids in encode(list(split["text"][:]))]


def _pack(
    documents: Sequence[tuple[list[int], list[int]]], block_size: int, *, eos: int, pad: int
) -> tuple[dict[str, list], list[int], int]:
    """Pack documents greedily, whole and in order, into blocks of ``block_size`` tokens.

    Returns the block columns, the non-padding tokens of each block, and the number of documents cut to
    ``block_size``.

    Args:
        documents: (prompt ids, trained ids) per document, without eos.
        block_size: tokens per block.
        eos: id appended to every document.
        pad: id of the padding tail.
    """
    columns: dict[str, list] = {name: [] for name in ("input_ids", "labels", "position_ids", "length", "num_tokens")}
    filled: list[int] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    cut = 0

    def flush() -> None:
        tail = block_size - len(ids)
        filled.append(len(ids))
        columns["input_ids"].append(ids + [pad] * tail)
        block_labels = labels + [IGNORE_INDEX] * tail
        columns["labels"].append(block_labels)
        columns["position_ids"].append(positions + list(range(tail)))
        columns["length"].append(block_size)
        columns["num_tokens"].append(sum(label != IGNORE_INDEX for label in block_labels[1:]))

    for prompt, response in documents:
        doc_ids = [*prompt, *response, eos]
        doc_labels = [IGNORE_INDEX] * len(prompt) + [*response, eos]
        if len(doc_ids) > block_size:
            cut += 1
            doc_ids, doc_labels = doc_ids[:block_size], doc_labels[:block_size]
        doc_labels[0] = IGNORE_INDEX  # nothing predicts a document's first token: it follows another document
        if len(ids) + len(doc_ids) > block_size:
            flush()
            ids, labels, positions = [], [], []
        ids += doc_ids
        labels += doc_labels
        positions += range(len(doc_ids))
    if ids:
        flush()
    return columns, filled, cut


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
