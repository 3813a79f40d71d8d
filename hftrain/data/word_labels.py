"""Token classification data (``model.task: token_classification``): words with one label each, aligned to sub-tokens.

A data file is JSON Lines, one example a line: ``{"tokens": ["EU", "rejects", "German", "call"], "tags": ["B-ORG",
"O", "B-MISC", "O"]}`` (``tags`` as label names, or as label ids 0..n-1; one per word). The label names are the
sorted set of names over the train and validation files (ids: ``0..max``, named by their number), kept in the
splits' ``tags`` feature (a ``ClassLabel`` sequence) and from there in the exported model's
``config.json`` (``id2label``/``label2id``); ``model.num_labels`` left at its default takes their count.

The words are tokenized with ``is_split_into_words=True`` and each word's label goes to its first sub-token; its
other sub-tokens and the special tokens get ``-100`` (transformers' ``run_ner.py``, ``label_all_tokens=False``), so
the loss and the metrics count each word once. A file is checked line by line as it is read (each bad line is one
error naming the file and the line) and then read by ``datasets`` into Arrow files (``work_dir``: the data cache's
scratch folder), never held as Python lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.data.batching import BucketCollator
from hftrain.errors import ConfigError, DataError

IGNORE_INDEX = -100
"""The label of positions that are not a word's first sub-token (transformers' cross entropy skips them)."""


def load_word_label_splits(config: Any, facts: Any, sources: dict[str, Any]) -> Any:
    """The ``train`` and ``validation`` splits (columns ``tokens``: words, ``tags``: their label ids, a
    ``Sequence(ClassLabel(names))``), in a deterministic order (``Task.load``).

    Args:
        config: the job config (unused beyond ``sources``: the data section's common fields).
        facts: what the model-folder check read (unused).
        sources: ``train_file``, ``validation_file``, ``validation_split_percentage``, ``max_train_samples``,
            ``max_eval_samples``, ``seed``, ``log``, ``work_dir``.
    """
    import datasets

    if sources.get("dataset_name") is not None or sources.get("train_file") is None:
        raise ConfigError(
            'data.train_file: model.task token_classification reads a JSON Lines file of {"tokens": [...], '
            '"tags": [...]} rows; give one (and data.dataset_name: null)'
        )
    files = {"data.train_file": Path(sources["train_file"])}
    if sources.get("validation_file") is not None:
        files["data.validation_file"] = Path(sources["validation_file"])
    names, numbered = _label_names(files)
    features = datasets.Features(
        {
            "tokens": datasets.Sequence(datasets.Value("string")),
            "tags": datasets.Sequence(datasets.ClassLabel(names=names)),
        }
    )
    index = {name: i for i, name in enumerate(names)}
    work_dir = sources.get("work_dir")

    def read(path: Path) -> Any:
        raw = datasets.load_dataset(
            "json", data_files=str(path), split="train", cache_dir=str(work_dir) if work_dir else None
        )
        to_ids = (lambda tags: [int(t) for t in tags]) if numbered else (lambda tags: [index[t] for t in tags])
        return raw.map(
            lambda batch: {"tokens": batch["tokens"], "tags": [to_ids(tags) for tags in batch["tags"]]},
            batched=True,
            remove_columns=raw.column_names,
            features=features,
        )

    train = read(files["data.train_file"])
    if "data.validation_file" in files:
        validation = read(files["data.validation_file"])
    else:
        share = sources["validation_split_percentage"] / 100
        parts = train.train_test_split(test_size=share, seed=sources["seed"], shuffle=True)
        train, validation = parts["train"], parts["test"]
    if sources.get("max_train_samples") is not None:
        train = train.select(range(min(len(train), sources["max_train_samples"])))
    if sources.get("max_eval_samples") is not None:
        validation = validation.select(range(min(len(validation), sources["max_eval_samples"])))
    if len(train) == 0 or len(validation) == 0:
        raise DataError(
            f"data: {len(train)} training and {len(validation)} validation examples; both splits need at least one"
        )
    log = sources.get("log") or (lambda _: None)
    log(f"data: {len(train)} training and {len(validation)} validation examples, {len(names)} labels")
    return datasets.DatasetDict({"train": train, "validation": validation})


def _label_names(files: Mapping[str, Path]) -> tuple[list[str], bool]:
    """The label names over every file (sorted; ids: ``"0".."max"``) and whether the tags are ids, each line checked:
    a JSON object whose ``tokens`` is a non-empty list of strings and ``tags`` a list of as many names (strings) or
    ids (non-negative integers), one kind over all files."""
    names: set[str] = set()
    largest, kinds = -1, set()
    for field, path in files.items():
        if not path.is_file():
            raise DataError(f"{field} '{path}' is not a file; give the path of a JSON Lines file")
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{field} '{path}' line {number}"
                tags = _checked_tags(line, where)
                kind = "ids" if tags and isinstance(tags[0], int) else "names"
                if tags:
                    kinds.add(kind)
                if len(kinds) > 1:
                    raise DataError(f"{where}: tags mixes label names and label ids over the data; use one of them")
                if kind == "ids":
                    largest = max(largest, *tags)
                else:
                    names.update(tags)
    if "ids" in kinds:
        return [str(i) for i in range(largest + 1)], True
    if not names:
        raise DataError(f"data.train_file '{files['data.train_file']}': no labelled word; add rows with tags")
    return sorted(names), False


def _checked_tags(line: str, where: str) -> list[Any]:
    """The ``tags`` of one JSON line, after checking the line (one :class:`DataError` naming ``where``)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not JSON ({error.msg}); each line must be one JSON object") from None
    if not isinstance(row, dict) or "tokens" not in row or "tags" not in row:
        raise DataError(f'{where}: each line must be an object with "tokens" and "tags" lists')
    tokens, tags = row["tokens"], row["tags"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise DataError(f"{where}: tokens must be a non-empty list of words (strings)")
    names = all(isinstance(t, str) and t for t in tags) if isinstance(tags, list) else False
    ids = (
        all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tags)
        if isinstance(tags, list)
        else False
    )
    if not isinstance(tags, list) or not (names or ids):
        raise DataError(f"{where}: tags must be a list of label names (strings) or label ids (integers ≥ 0)")
    if len(tags) != len(tokens):
        raise DataError(f"{where}: {len(tokens)} tokens and {len(tags)} tags; give one tag per word")
    return tags


def prepare_word_label_inputs(splits: Any, tokenizer: Any, inputs: Any, log: Callable[[str], None]) -> tuple:
    """The splits tokenized (``input_ids``, ``attention_mask``..., ``labels`` aligned to the sub-tokens, ``length``,
    ``num_tokens``: the labelled positions) and the head the data decides: ``num_labels``, ``id2label``,
    ``label2id`` (``Task.prepare``).

    Args:
        splits: :func:`load_word_label_splits`'s splits.
        tokenizer: the model's tokenizer (a fast one: its ``word_ids`` align the labels).
        inputs: ``max_length`` (truncation), ``num_labels`` (``model.num_labels`` when set, else None).
        log: receives one-line notes.
    """
    import hashlib

    from datasets import DatasetDict

    names = list(splits["train"].features["tags"].feature.names)
    if inputs.num_labels is not None and inputs.num_labels != len(names):
        raise ConfigError(
            f"model.num_labels is {inputs.num_labels} and the data has {len(names)} labels ({', '.join(names[:8])}"
            f"{', ...' if len(names) > 8 else ''}); remove model.num_labels (the data decides) or set it to "
            f"{len(names)}"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            "model.model_name_or_path: token classification aligns labels with a fast tokenizer's word_ids, and this "
            "model's tokenizer is a slow one; save a fast tokenizer (tokenizer.json) in the model folder"
        )
    max_length = inputs.max_length

    def encode(batch: dict) -> dict:
        encoded = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=max_length)
        labels = [align_labels(encoded.word_ids(i), tags) for i, tags in enumerate(batch["tags"])]
        encoded["labels"] = labels
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        encoded["num_tokens"] = [sum(label != IGNORE_INDEX for label in row) for row in labels]
        return encoded

    fingerprint = f"{type(tokenizer).__name__}|{tokenizer.name_or_path}|{len(tokenizer)}|{max_length}|words"
    tokenized = DatasetDict(
        {
            name: split.map(
                encode,
                batched=True,
                keep_in_memory=inputs.work_dir is None,
                cache_file_name=str(Path(inputs.work_dir) / f"words-{name}.arrow") if inputs.work_dir else None,
                remove_columns=["tokens", "tags"],
                num_proc=None,
                new_fingerprint=hashlib.sha256(f"{split._fingerprint}|{fingerprint}".encode()).hexdigest()[:16],
            )
            for name, split in splits.items()
        }
    )
    head = {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {n: i for i, n in enumerate(names)},
    }
    return tokenized, head


def align_labels(word_ids: Sequence[int | None], tags: Sequence[int]) -> list[int]:
    """Each sub-token's label: its word's tag on the word's first sub-token, ``-100`` on the others and on the special
    tokens (transformers' ``run_ner.py``).

    Args:
        word_ids: the word each sub-token belongs to (None: a special token), the tokenizer's ``word_ids``.
        tags: each word's label id.
    """
    labels, previous = [], None
    for word in word_ids:
        labels.append(IGNORE_INDEX if word is None or word == previous else int(tags[word]))
        previous = word
    return labels


@dataclass(frozen=True)
class WordLabelCollator(BucketCollator):
    """Pads a batch as :class:`hftrain.data.batching.BucketCollator` does (its fields) and its ``labels`` to the same
    length with ``-100`` (on the tokenizer's padding side); drops ``num_tokens`` (the trainer reads it from the
    dataset)."""

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        rows = [{k: v for k, v in f.items() if k not in ("labels", "num_tokens")} for f in features]
        batch = super().__call__(rows)
        width = batch["input_ids"].shape[1]
        left = self.tokenizer.padding_side == "left"
        padded = [
            ([IGNORE_INDEX] * (width - len(f["labels"])) + list(f["labels"]))
            if left
            else (list(f["labels"]) + [IGNORE_INDEX] * (width - len(f["labels"])))
            for f in features
        ]
        batch["labels"] = torch.tensor(padded, dtype=torch.long)
        return batch
