"""Tokenized once per node, cached, memory-mapped (``hftrain.data.cache``, issue 53).

A causal-LM job's packed splits (and a classifier's tokenized ones) are built once into a cache entry keyed by the
data's bytes, the tokenizer and the rules; a second run and an export open it without tokenizing (the tokenizer's
calls are counted), and a change of any input builds another entry. A half-built entry is rebuilt, a damaged one is
one line. Under two gloo processes only the first process tokenizes, both train as one process does, and a malformed
line in the middle of the data stops every rank with one line naming the file and the line, leaving no entry.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import logged_losses
from tests.tiny import WORDS, reset_accelerate_state, tiny_config, tiny_tokenizer

BLOCK = 32


def _model(path: Path) -> Path:
    """A tiny random Llama causal LM saved with its (word-level, GPT-style) tokenizer."""
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return path
    tokenizer = tiny_tokenizer("gpt2")
    config = tiny_config("llama", max_positions=128)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _documents(n: int, seed: int = 0) -> list[str]:
    """Counting documents of 2 to 60 words: some longer than a block, so they continue over blocks."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start, length = rng.randrange(len(WORDS)), rng.randint(2, 60)
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)))
    return docs


def _jsonl(path: Path, n: int = 120, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in _documents(n, seed)), encoding="utf-8")
    return path


@pytest.fixture
def job(tmp_path: Path) -> dict[str, Path]:
    return {"model": _model(tmp_path / "model"), "data": _jsonl(tmp_path / "train.jsonl"), "cache": tmp_path / "cache"}


def _argv(job: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["train", "--task", "causal_lm", "--model_name_or_path", str(job["model"]), "--dataset_name", "null",
            "--train_file", str(job["data"]), "--max_seq_length", str(BLOCK), "--max_steps", "3",
            "--learning_rate", "3e-3", "--per_device_train_batch_size", "4", "--mixed_precision", "no",
            "--log_with", "none", "--logging_steps", "1", "--output_dir", str(out), "--cache_dir", str(job["cache"]),
            *extra]  # fmt: skip


class _TokenizerCalls:
    """Counts the texts every tokenizer of this process is called on (``PreTrainedTokenizerBase.__call__``)."""

    def __enter__(self) -> _TokenizerCalls:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        self.texts = 0
        self._original = original = PreTrainedTokenizerBase.__call__
        counter = self

        def counted(tokenizer: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
            counter.texts += len(text) if isinstance(text, list) else 1
            return original(tokenizer, text, *args, **kwargs)

        PreTrainedTokenizerBase.__call__ = counted
        return self

    def __exit__(self, *exc: object) -> None:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        PreTrainedTokenizerBase.__call__ = self._original


def _cli(argv: list[str]) -> tuple[int, str, int]:
    """``hftrain`` in this process: exit code, stderr, and the texts the tokenizer was called on."""
    from tests.conftest import cli_in_process

    reset_accelerate_state()
    with _TokenizerCalls() as calls:
        code, stderr = cli_in_process(argv)
    return code, stderr, calls.texts


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def _packed_line(printed: str) -> str:
    lines = [line for line in printed.splitlines() if "packed into blocks of" in line]
    assert len(lines) == 1, printed[-3000:]
    return lines[0].split("packed into blocks of", 1)[1]


# ---------------------------------------------------------------------------
# Reuse
# ---------------------------------------------------------------------------


def test_a_second_run_and_an_export_open_the_entry_without_tokenizing(job, tmp_path, capsys):
    code, first_err, first_calls = _cli(_argv(job, tmp_path / "a"))
    first = capsys.readouterr().out + first_err
    assert code == 0, first[-3000:]
    assert first_calls >= 120 and "data: cached the tokenized splits in" in first
    assert _entries(job["cache"]) and len([e for e in _entries(job["cache"]) if not e.startswith(".")]) == 1
    assert "continued over blocks" in _packed_line(first)  # documents longer than a block continue

    code, second_err, second_calls = _cli(_argv(job, tmp_path / "b"))
    second = capsys.readouterr().out + second_err
    assert code == 0, second[-3000:]
    assert second_calls == 0  # opened, not tokenized
    assert "data: opened the tokenized splits cached in" in second
    assert _packed_line(second) == _packed_line(first)  # the build's facts logged again
    assert logged_losses(tmp_path / "b") == logged_losses(tmp_path / "a")  # the same blocks

    code, export_err, export_calls = _cli(["export", str(tmp_path / "a"), str(tmp_path / "exported")])
    assert code == 0, export_err[-3000:]
    assert export_calls == 0 and (tmp_path / "exported" / "config.json").is_file()


def _prepare(job: dict[str, Path], tokenizer: Any = None, **fields: Any) -> tuple[Any, list[str], int]:
    """``hftrain.job.prepare_data`` for a causal-LM config of ``job`` (one process): the splits, the log and the texts
    tokenized."""
    from hftrain.api import make_config
    from hftrain.job import prepare_data
    from hftrain.models import build_tokenizer
    from hftrain.models.checks import check_model_folder

    options = {"task": "causal_lm", "model_name_or_path": str(job["model"]), "dataset_name": None,
               "train_file": str(job["data"]), "max_seq_length": BLOCK, "cache_dir": str(job["cache"])}  # fmt: skip
    options.update(fields)
    config = make_config(**options)
    tokenizer = tokenizer or build_tokenizer(config.model)
    lines: list[str] = []
    with _TokenizerCalls() as calls:
        splits, _ = prepare_data(
            config, check_model_folder(config.model), tokenizer, options["max_seq_length"], lines.append
        )
    return splits, lines, calls.texts


def _built(lines: list[str]) -> bool:
    assert any(line.startswith("data: ") for line in lines), lines
    return any(line.startswith("data: cached the tokenized splits") for line in lines)


def test_every_input_of_the_key_rebuilds_and_nothing_else_does(job):
    """Content (same size and mtime), a special token, the block length, the long-document rule and
    ``overwrite_cache`` each build again; the same inputs open the entry."""
    from hftrain.models import build_tokenizer

    base, lines, texts = _prepare(job)
    assert _built(lines) and texts >= 120
    assert base["train"].cache_files  # memory-mapped from the entry, not held in memory
    assert all(Path(f["filename"]).is_relative_to(job["cache"]) for f in base["train"].cache_files)
    again, lines, texts = _prepare(job)
    assert not _built(lines) and texts == 0
    assert again["train"]["input_ids"][:] == base["train"]["input_ids"][:]

    # The same bytes count, size and modification time, another word: another key.
    data = job["data"]
    stat, text = data.stat(), data.read_text(encoding="utf-8")
    changed = text.replace("w1 ", "w2 ", 1)
    assert changed != text and len(changed) == len(text)
    data.write_text(changed, encoding="utf-8")
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    _, lines, texts = _prepare(job)
    assert _built(lines) and texts >= 120
    data.write_text(text, encoding="utf-8")
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert not _built(_prepare(job)[1])

    from hftrain.api import make_config

    tokenizer = build_tokenizer(make_config(model_name_or_path=str(job["model"]), task="causal_lm").model)
    tokenizer.pad_token = "<unk>"  # a special token set in code: another padding id
    _, lines, _ = _prepare(job, tokenizer)
    assert _built(lines)
    assert _built(_prepare(job, max_seq_length=BLOCK // 2)[1])
    assert _built(_prepare(job, long_documents="truncate")[1])
    assert "(long documents: truncate)" in " ".join(_prepare(job, long_documents="truncate")[1])
    assert _built(_prepare(job, overwrite_cache=True)[1])
    assert len([e for e in _entries(job["cache"]) if not e.startswith(".")]) == 5  # base, bytes, pad, 16, truncate


def test_a_half_built_entry_is_rebuilt_and_a_damaged_one_is_one_line(job):
    from hftrain.data.cache import MANIFEST
    from hftrain.errors import DataError

    _prepare(job)
    (entry,) = [job["cache"] / name for name in _entries(job["cache"]) if not name.startswith(".")]
    # killed midway: a staging folder is left beside it, and the entry has no manifest
    (job["cache"] / f".{entry.name}.staging" / "work").mkdir(parents=True)
    (entry / MANIFEST).unlink()
    _, lines, texts = _prepare(job)
    assert _built(lines) and texts >= 120
    assert (entry / MANIFEST).is_file() and not (job["cache"] / f".{entry.name}.staging").exists()

    arrow = next((entry / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-100])  # cut short
    with pytest.raises(DataError) as refused:
        _prepare(job)
    message = str(refused.value)
    assert "\n" not in message and str(entry) in message and "data.overwrite_cache: true" in message
    assert _built(_prepare(job, overwrite_cache=True)[1])


def test_classification_splits_are_cached_too(tmp_path):
    from hftrain.api import make_config
    from hftrain.job import prepare_data
    from hftrain.models import build_tokenizer
    from hftrain.models.checks import check_model_folder
    from tests.tiny import synthetic_texts

    texts, labels = synthetic_texts(60, seed=1)
    data = tmp_path / "train.csv"
    data.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels, strict=True)))
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_config(tiny_config("bert")).save_pretrained(tmp_path / "bert")
    tiny_tokenizer("bert").save_pretrained(tmp_path / "bert")
    config = make_config(model_name_or_path=str(tmp_path / "bert"), dataset_name=None, train_file=str(data),
                         cache_dir=str(tmp_path / "cache"))  # fmt: skip
    facts, tokenizer = check_model_folder(config.model), build_tokenizer(config.model)
    runs = []
    for _ in range(2):
        lines: list[str] = []
        with _TokenizerCalls() as calls:
            splits, problem_type = prepare_data(config, facts, tokenizer, 32, lines.append)
        runs.append((splits, problem_type, calls.texts, lines))
    (first, kind, texts_1, _), (second, kind_2, texts_2, lines) = runs
    assert texts_1 >= 60 and texts_2 == 0 and not _built(lines)
    assert kind == kind_2 == {"problem_type": "single_label_classification"}  # the model-config fields the data decides
    assert first["train"].to_list() == second["train"].to_list()
    assert set(second["train"].column_names) >= {"input_ids", "labels", "length"}


# ---------------------------------------------------------------------------
# Two processes
# ---------------------------------------------------------------------------


@pytest.mark.distributed
def test_only_the_first_process_tokenizes_and_two_processes_train_as_one(job, tmp_path):
    from tests.distributed import run_distributed

    ranks = run_distributed(
        _cli, nprocs=2, timeout=600, argv=_argv(job, tmp_path / "ddp", "--per_device_train_batch_size", "2")
    )
    (code_0, err_0, texts_0), (code_1, err_1, texts_1) = ranks
    assert code_0 == code_1 == 0, err_0[-2000:] + err_1[-2000:]
    assert texts_0 >= 120 and texts_1 == 0  # the second rank opened what the first built
    reference = _cli(_argv(job, tmp_path / "one"))  # 1 process × 4 = 2 processes × 2: the same global batch
    assert reference[0] == 0 and reference[2] == 0  # and it found the entry too
    assert logged_losses(tmp_path / "ddp") == pytest.approx(logged_losses(tmp_path / "one"), abs=1e-5)


@pytest.mark.distributed
def test_a_malformed_line_stops_every_rank_with_one_line_and_leaves_no_entry(job, tmp_path):
    from tests.distributed import run_distributed

    lines = job["data"].read_text(encoding="utf-8").splitlines(keepends=True)
    lines[57] = '{"text": "w1 w2", oops}\n'
    job["data"].write_text("".join(lines), encoding="utf-8")
    ranks = run_distributed(_cli, nprocs=2, timeout=600, argv=_argv(job, tmp_path / "bad"))
    assert [code for code, _, _ in ranks] == [2, 2]
    errors = [line for _, err, _ in ranks for line in err.splitlines() if line.startswith("hftrain: error:")]
    assert len(errors) == 1, [err[-2000:] for _, err, _ in ranks]
    assert "data.train_file: line 58 of" in errors[0] and str(job["data"]) in errors[0]
    assert all("Traceback" not in err for _, err, _ in ranks)
    assert _entries(job["cache"]) == []  # nothing half-written: no entry, no staging folder, no lock
    assert not (tmp_path / "bad").exists()
