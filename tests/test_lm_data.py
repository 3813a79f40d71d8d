"""Tests for hftrain.data.language: causal-LM data loading, packing rules, the collator, and that packed documents
cannot attend to each other in the model families we train (transformers' position-id packing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hftrain.data.language import lm_collator, load_text_splits, pack_splits
from hftrain.errors import ConfigError, DataError
from tests.tiny import synthetic_texts, tiny_config, tiny_tokenizer

# tiny_tokenizer("gpt2"): "<eos>" is 0, "<unk>" is 1, "w{i}" is i + 2.
EOS = 0


def _ids(text: str) -> list[int]:
    """The tiny GPT-2 tokenizer's ids of a text of w-words."""
    return [int(word[1:]) + 2 for word in text.split()]


def _tokenizer(pad: str | None = "<unk>"):
    """The tiny GPT-style tokenizer (eos 0); with ``pad``, a pad token distinct from eos, so padding is visible."""
    tokenizer = tiny_tokenizer("gpt2")
    if pad is not None:
        tokenizer.pad_token = pad
    return tokenizer


def _splits(train: dict[str, list[str]], validation: dict[str, list[str]] | None = None):
    from datasets import Dataset, DatasetDict

    return DatasetDict(
        train=Dataset.from_dict(train), validation=Dataset.from_dict(validation or {k: v[:1] for k, v in train.items()})
    )


def _load(train_file: Path | None = None, *, log: Any = None, **kwargs: Any):
    """Call load_text_splits with test defaults."""
    options: dict[str, Any] = {
        "dataset_name": None,
        "train_file": str(train_file) if train_file is not None else None,
        "validation_file": None,
        "text_column": "text",
        "prompt_column": "prompt",
        "response_column": "response",
        "validation_split_percentage": 20,
        "max_train_samples": None,
        "max_eval_samples": None,
        "seed": 0,
        "log": log if log is not None else (lambda message: None),
    }
    options.update(kwargs)
    return load_text_splits(**options)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _all_rows(splits) -> list[dict]:
    return splits["train"].to_list() + splits["validation"].to_list()


# ---------------------------------------------------------------------------
# Packing rules
# ---------------------------------------------------------------------------


def test_blocks_pack_whole_documents_in_order_with_masked_starts_and_padding() -> None:
    messages: list[str] = []
    texts = ["w0 w1 w2", "w3 w4", "w5 w6 w7 w8 w9", "w10"]
    packed = pack_splits(_splits({"text": texts}), _tokenizer(), block_size=8, log=messages.append)
    train = packed["train"].to_list()
    pad = 1
    # [w0 w1 w2 eos][w3 w4 eos] fill 7 of 8; [w5..w9 eos] (6) does not fit in the 1 left: a new block; [w10 eos] fits.
    assert [block["input_ids"] for block in train] == [
        [2, 3, 4, EOS, 5, 6, EOS, pad],
        [7, 8, 9, 10, 11, EOS, 12, EOS],
    ]
    assert [block["labels"] for block in train] == [
        [-100, 3, 4, EOS, -100, 6, EOS, -100],
        [-100, 8, 9, 10, 11, EOS, -100, EOS],
    ]
    assert [block["position_ids"] for block in train] == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 1]]
    assert [block["length"] for block in train] == [8, 8]
    assert [block["num_tokens"] for block in train] == [5, 6]
    assert packed["train"].column_names == ["input_ids", "labels", "position_ids", "length", "num_tokens"]
    assert messages == [
        "packed into blocks of 8 tokens (long documents: continue): train 4 documents in 2 blocks (fill 93.8%, "
        "0 continued over blocks, kept 100.0% of 15 tokens); validation 1 documents in 1 blocks (fill 50.0%, "
        "0 continued over blocks, kept 100.0% of 4 tokens)"
    ]


def test_padding_tail_is_its_own_position_run_and_eos_pads_without_a_pad_token() -> None:
    packed = pack_splits(_splits({"text": ["w0 w1"]}), _tokenizer(pad=None), block_size=6, log=lambda m: None)
    block = packed["train"][0]
    assert block["input_ids"] == [2, 3, EOS, EOS, EOS, EOS]
    assert block["labels"] == [-100, 3, EOS, -100, -100, -100]
    assert block["position_ids"] == [0, 1, 2, 0, 1, 2]
    assert block["num_tokens"] == 2


def test_prompt_tokens_are_masked_and_the_response_and_eos_trained() -> None:
    data = {"prompt": ["w0 w1 w2", "w9"], "response": ["w3 w4", "w8 w7"]}
    block = pack_splits(_splits(data), _tokenizer(), block_size=12, log=lambda m: None)["train"][0]
    assert block["input_ids"] == [2, 3, 4, 5, 6, EOS, 11, 10, 9, EOS, 1, 1]
    assert block["labels"] == [-100, -100, -100, 5, 6, EOS, -100, 10, 9, EOS, -100, -100]
    assert block["position_ids"] == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1]
    assert block["num_tokens"] == 6


def test_long_documents_are_cut_to_the_block_and_counted() -> None:
    """``data.long_documents: truncate`` (continuation is tests/test_packing.py's)."""
    messages: list[str] = []
    data = {"text": ["w0 w1 w2 w3 w4 w5 w6 w7 w8 w9", "w10 w11", "w12 w13 w14 w15 w16"]}  # 11, 3 and 6 with eos
    packed = pack_splits(_splits(data), _tokenizer(), block_size=5, log=messages.append, long_documents="truncate")
    train = packed["train"].to_list()
    assert [block["input_ids"] for block in train] == [[2, 3, 4, 5, 6], [12, 13, EOS, 1, 1], [14, 15, 16, 17, 18]]
    assert [block["labels"] for block in train] == [
        [-100, 3, 4, 5, 6],
        [-100, 13, EOS, -100, -100],
        [-100, 15, 16, 17, 18],
    ]
    assert [block["num_tokens"] for block in train] == [4, 2, 4]
    assert messages[0] == (
        "packed into blocks of 5 tokens (long documents: truncate): train 3 documents in 3 blocks (fill 86.7%, "
        "2 truncated, kept 65.0% of 20 tokens); validation 1 documents in 1 blocks (fill 100.0%, 1 truncated, kept "
        "45.5% of 11 tokens)"
    )
    # A prompt as long as the block leaves nothing to train on, and it is counted as cut (another document has
    # targets: a split with none is refused, tests/test_untrusted_inputs.py).
    prompt = {"prompt": ["w0 w1 w2 w3 w4 w5", "w7"], "response": ["w6", "w8"]}
    block = pack_splits(_splits(prompt, {"prompt": ["w7"], "response": ["w8"]}), _tokenizer(), block_size=4,
                        log=lambda m: None, long_documents="truncate")["train"][0]  # fmt: skip
    assert block["input_ids"] == [2, 3, 4, 5] and block["num_tokens"] == 0 and set(block["labels"]) == {-100}


def test_random_documents_round_trip_and_num_tokens_is_the_shifted_target_count() -> None:
    """Many documents of varied lengths: every block is full-length, the documents come back whole (or cut) in
    order from the position-id runs, and num_tokens counts labels[1:] that are not -100 (``truncate``; continued
    documents are tests/test_packing.py's)."""
    texts, _ = synthetic_texts(300, seed=3, words=(1, 30))
    block_size = 24
    tokenizer = _tokenizer()
    packed = pack_splits(
        _splits({"text": texts}), tokenizer, block_size=block_size, log=lambda m: None, long_documents="truncate"
    )["train"]
    documents: list[list[int]] = []
    for block in packed.to_list():
        ids, labels, positions = block["input_ids"], block["labels"], block["position_ids"]
        assert len(ids) == len(labels) == len(positions) == block_size == block["length"]
        assert block["num_tokens"] == sum(label != -100 for label in labels[1:])
        starts = [i for i, p in enumerate(positions) if p == 0] + [block_size]
        runs = [(a, b) for a, b in zip(starts, starts[1:], strict=False)]
        for a, b in runs:
            assert positions[a:b] == list(range(b - a))
            assert labels[a] == -100
            if ids[a] == 1:  # the padding run (pad id 1; no document holds it): last, all padding, never trained
                assert (a, b) == runs[-1]
                assert ids[a:b] == [1] * (b - a) and labels[a:b] == [-100] * (b - a)
                continue
            documents.append(ids[a:b])
            assert labels[a + 1 : b] == ids[a + 1 : b]
    expected = [(_ids(text) + [EOS])[:block_size] for text in texts]
    assert documents == expected


def test_the_tokenizers_template_tokens_are_not_added() -> None:
    """A tokenizer whose template wraps texts in special tokens (here "<unk> ... <unk>") adds none to a document:
    only the eos packing appends."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = _tokenizer(pad=None)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<unk> $A <unk>", special_tokens=[("<unk>", 1)]
    )
    assert tokenizer("w0 w1")["input_ids"] == [1, 2, 3, 1]
    data = {"prompt": ["w0"], "response": ["w1"]}
    for splits in (_splits({"text": ["w0 w1"]}), _splits(data)):
        block = pack_splits(splits, tokenizer, block_size=4, log=lambda m: None)["train"][0]
        assert block["input_ids"] == [2, 3, EOS, EOS]


def test_pack_refuses_a_short_block_and_a_tokenizer_without_eos() -> None:
    with pytest.raises(ConfigError, match="data.max_seq_length"):
        pack_splits(_splits({"text": ["w1"]}), _tokenizer(), block_size=1, log=lambda m: None)
    with pytest.raises(ConfigError, match="eos token"):
        pack_splits(_splits({"text": ["w1"]}), tiny_tokenizer("bert"), block_size=8, log=lambda m: None)


def test_collator_stacks_long_tensors_and_drops_the_rest() -> None:
    import torch

    packed = pack_splits(_splits({"text": ["w0 w1 w2", "w3 w4 w5 w6 w7"]}), _tokenizer(), block_size=6, log=print)
    batch = lm_collator(packed["train"].to_list())
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.dtype == torch.long and t.shape == (2, 6) for t in batch.values())
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]


def test_packed_loss_is_the_sum_of_each_documents_own_loss() -> None:
    """The model's shifted loss over a packed block, times num_tokens, equals the sum of every document's loss run
    alone: num_tokens is exactly what the loss counts, and no target crosses a document boundary."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    data = {"prompt": ["w0 w1 w2", "w5", "w7 w8"], "response": ["w3 w4", "w6 w1 w2", "w9"]}
    packed = pack_splits(_splits(data), _tokenizer(), block_size=20, log=lambda m: None)["train"]
    assert len(packed) == 1
    batch = lm_collator(packed.to_list())
    with torch.no_grad():
        loss = model(**batch, use_cache=False).loss.item() * packed[0]["num_tokens"]
        alone = 0.0
        for prompt, response in zip(data["prompt"], data["response"], strict=True):
            ids = torch.tensor([_ids(prompt) + _ids(response) + [EOS]])
            labels = ids.clone()
            labels[0, : len(_ids(prompt))] = -100
            alone += model(input_ids=ids, labels=labels).loss.item() * (len(_ids(response)) + 1)
    assert loss == pytest.approx(alone, rel=1e-5)


# ---------------------------------------------------------------------------
# Attention isolation: transformers' position-id packing, per model family
# ---------------------------------------------------------------------------

DOC_A = "w3 w1 w4 w1 w5 w9 w2 w6"
DOC_B = "w5 w3 w5 w8 w9"


def _packed_pair(block_size: int = 20):
    """Documents A and B packed into one block, collated: (batch, tokens of A with eos, tokens of B with eos)."""
    packed = pack_splits(_splits({"text": [DOC_A, DOC_B]}), _tokenizer(), block_size=block_size, log=lambda m: None)
    assert len(packed["train"]) == 1
    return lm_collator(packed["train"].to_list()), len(_ids(DOC_A)) + 1, len(_ids(DOC_B)) + 1


def _causal_lm(kind: str, attn_implementation: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(kind)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval().float()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "mixtral"])
def test_packing_never_lets_a_token_see_another_document(kind: str, attn_implementation: str) -> None:
    """Without attention_mask and without a cache, A's and B's logits in one block equal each run alone.

    (qwen2's tiny config has a 4-token sliding window on its first layer: the sliding mask is packed too.)
    """
    import torch

    model = _causal_lm(kind, attn_implementation)
    batch, len_a, len_b = _packed_pair()
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]  # the collator's batch as the trainer passes it
        alone_a = model(input_ids=batch["input_ids"][:, :len_a], use_cache=False).logits[0]
        alone_b = model(input_ids=batch["input_ids"][:, len_a : len_a + len_b], use_cache=False).logits[0]
    torch.testing.assert_close(packed[:len_a], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[len_a : len_a + len_b], alone_b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("broken_by", ["config_use_cache", "attention_mask"])
def test_packing_is_lost_with_a_cache_or_an_attention_mask(kind: str, broken_by: str) -> None:
    """What the trainer must avoid: the config's default use_cache=True (a DynamicCache is built in the forward,
    also in training mode) or any 2D attention_mask turns the position-id detection off, and B then sees A."""
    import torch

    model = _causal_lm(kind, "sdpa").train()  # training mode: the cache is still built (dropout is 0)
    assert model.config.use_cache
    batch, len_a, len_b = _packed_pair()
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if broken_by == "attention_mask":
        inputs |= {"attention_mask": torch.ones_like(batch["input_ids"]), "use_cache": False}
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        safe = model(**batch, use_cache=False).logits[0]
        alone_b = model(input_ids=batch["input_ids"][:, len_a : len_a + len_b], use_cache=False).logits[0]
    b = slice(len_a, len_a + len_b)
    torch.testing.assert_close(safe[b], alone_b, atol=1e-5, rtol=0)
    assert (packed[b] - alone_b).abs().max() > 1e-3  # B attended to A
    torch.testing.assert_close(packed[:len_a], safe[:len_a], atol=1e-5, rtol=0)  # A comes first: unaffected


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def test_txt_is_one_document_per_non_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    lines = [f"line {i}, with, commas" for i in range(10)]
    path.write_text("\n".join(lines[:4]) + "\n\n   \n" + "\r\n".join(lines[4:]) + "\n", encoding="utf-8")
    splits = _load(path)
    assert splits["train"].column_names == ["text"] and len(splits["validation"]) == 2
    assert sorted(row["text"] for row in _all_rows(splits)) == sorted(lines)


def test_csv_text_column_and_numbers_as_text(tmp_path: Path) -> None:
    path = tmp_path / "train.csv"
    path.write_text("id,body\n" + "".join(f"{i},{'doc ' + str(i) if i % 3 else 100 + i}\n" for i in range(10)))
    splits = _load(path, text_column="body", validation_split_percentage=10)
    assert splits["train"].column_names == ["text"] and splits["train"].features["text"].dtype == "string"
    texts = sorted(row["text"] for row in _all_rows(splits))
    assert texts == sorted(f"doc {i}" if i % 3 else str(100 + i) for i in range(10))


def test_jsonl_with_prompt_and_response_columns_is_prompt_response_data(tmp_path: Path) -> None:
    rows = [{"text": "ignored", "q": f"question {i}", "a": f"answer {i}"} for i in range(10)]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    splits = _load(path, prompt_column="q", response_column="a", max_train_samples=3, max_eval_samples=1)
    assert splits["train"].column_names == ["prompt", "response"]
    assert len(splits["train"]) == 3 and len(splits["validation"]) == 1
    for row in _all_rows(splits):
        assert row["response"] == row["prompt"].replace("question", "answer")


def test_split_is_seeded_and_validation_file_is_used(tmp_path: Path) -> None:
    train = tmp_path / "train.txt"
    train.write_text("".join(f"doc {i}\n" for i in range(50)), encoding="utf-8")
    first, again, other = _load(train, seed=7), _load(train, seed=7), _load(train, seed=8)
    assert first["validation"]["text"][:] == again["validation"]["text"][:] != other["validation"]["text"][:]
    dev = _write_jsonl(tmp_path / "dev.jsonl", [{"text": f"dev {i}"} for i in range(3)])
    splits = _load(train, validation_file=str(dev))
    assert len(splits["train"]) == 50 and splits["validation"]["text"][:] == ["dev 0", "dev 1", "dev 2"]


def test_embedded_dataset_is_its_texts_without_labels() -> None:
    splits = _load(dataset_name="embedded:rotten_tomatoes", max_train_samples=5, max_eval_samples=3)
    assert splits["train"].column_names == ["text"] and len(splits["train"]) == 5 and len(splits["validation"]) == 3


def test_blank_rows_are_dropped_and_logged(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(8)]
    rows += [{"prompt": "p", "response": "  "}, {"prompt": None, "response": "r"}]
    messages: list[str] = []
    splits = _load(_write_jsonl(tmp_path / "train.jsonl", rows), log=messages.append)
    assert len(splits["train"]) + len(splits["validation"]) == 8
    assert messages == [f"dropped 2 of 10 rows with missing prompt or response in {tmp_path / 'train.jsonl'}"]


# ---------------------------------------------------------------------------
# Loading errors: one line naming the field and the file
# ---------------------------------------------------------------------------


def _one_line_error(kind: type[Exception], call) -> str:
    with pytest.raises(kind) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_text_column(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [{"body": "x", "id": 1}] * 4)
    message = _one_line_error(DataError, lambda: _load(path))
    assert message.startswith("data.text_column: column 'text' not found in ")
    assert "train.jsonl" in message and "available columns: body, id" in message


def test_half_a_prompt_response_pair_names_the_missing_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "x", "answer": "y"}] * 4)
    message = _one_line_error(DataError, lambda: _load(path))
    assert message.startswith("data.response_column: column 'response' not found in ")
    assert "'prompt' (data.prompt_column)" in message and "available columns: prompt, answer" in message


@pytest.mark.parametrize("name", ["train.txt", "train.csv", "train.jsonl"])
@pytest.mark.parametrize("content", ["", "blank"])
def test_empty_files(tmp_path: Path, name: str, content: str) -> None:
    path = tmp_path / name
    blank = {"train.txt": "\n  \n\n", "train.csv": "text\n", "train.jsonl": "\n"}[name]
    path.write_text("" if content == "" else blank, encoding="utf-8")
    message = _one_line_error(DataError, lambda: _load(path))
    assert message.startswith("data.train_file: ") and name in message


def test_file_errors_name_their_field(tmp_path: Path) -> None:
    train = tmp_path / "train.txt"
    train.write_text("a\nb\nc\n", encoding="utf-8")
    message = _one_line_error(DataError, lambda: _load(train, validation_file=str(tmp_path / "dev.txt")))
    assert message.startswith("data.validation_file: file not found: ") and "dev.txt" in message
    doc = tmp_path / "train.docx"
    doc.write_text("x", encoding="utf-8")
    message = _one_line_error(DataError, lambda: _load(doc))
    assert message.startswith("data.train_file: unsupported file type") and ".txt" in message
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    assert "not UTF-8" in _one_line_error(DataError, lambda: _load(latin))


def test_lists_are_not_texts(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "response": "r"}, {"prompt": ["a", "b"], "response": "r"}]
    message = _one_line_error(DataError, lambda: _load(_write_jsonl(tmp_path / "train.jsonl", rows)))
    assert message.startswith("data.prompt_column: column 'prompt' of ") and "a list at row 2" in message


def test_train_and_validation_files_of_different_kinds(tmp_path: Path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "response": "r"}] * 3)
    dev = tmp_path / "dev.txt"
    dev.write_text("a\n", encoding="utf-8")
    message = _one_line_error(DataError, lambda: _load(train, validation_file=str(dev)))
    assert message.startswith("data.validation_file: ") and "plain-text" in message and "prompt/response" in message


def test_config_errors() -> None:
    assert "data.dataset_name" in _one_line_error(ConfigError, lambda: _load())
    message = _one_line_error(
        ConfigError, lambda: _load(dataset_name="embedded:rotten_tomatoes", prompt_column="x", response_column="x")
    )
    assert message.startswith("data.response_column: ")
    assert "data.max_eval_samples" in _one_line_error(
        ConfigError, lambda: _load(dataset_name="embedded:rotten_tomatoes", max_eval_samples=0)
    )
