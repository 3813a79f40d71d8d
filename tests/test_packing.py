"""The packing rules (hftrain.data.packing): long documents continue over blocks with every token trained once, no
attention crosses a document, truncation stays an option, and a packer's state resumes mid-block."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from hftrain.data.packing import IGNORE_INDEX, BlockRules, Packer, pack_documents
from hftrain.errors import ConfigError
from tests.tiny import tiny_config

EOS, PAD = 2, 0


def _documents(count: int, longest: int, seed: int = 0, prompts: bool = False) -> list[tuple[list[int], list[int]]]:
    """Documents whose every token is unique over the set (document d, index i -> 1000·(d+1) + i), so a target
    names the document and the index it came from; with ``prompts``, a random head of each is its prompt."""
    rng = random.Random(seed)
    documents = []
    for d in range(count):
        n = rng.randint(1, longest)
        tokens = [1000 * (d + 1) + i for i in range(n)]
        cut = rng.randint(0, n - 1) if prompts else 0
        documents.append((tokens[:cut], tokens[cut:]))
    return documents


@pytest.mark.parametrize("prompts", [False, True])
@pytest.mark.parametrize("block_size", [2, 3, 8, 33])
def test_every_token_but_a_documents_first_is_a_target_exactly_once(block_size: int, prompts: bool) -> None:
    """Counting the targets of every block: each trained token of each document (its response tokens and its eos, but
    not its first token) is the target of exactly one position, however many blocks it spans; num_tokens counts them."""
    rules = BlockRules(block_size, EOS, PAD)
    documents = _documents(60, 5 * block_size, seed=block_size, prompts=prompts)
    blocks = list(pack_documents(documents, rules))
    seen: dict[tuple[int, int], int] = {}
    for block in blocks:
        assert all(len(block[key]) == block_size for key in ("input_ids", "labels", "position_ids"))
        ids, labels = block["input_ids"], block["labels"]
        targets = labels[1:] != IGNORE_INDEX
        assert block["num_tokens"] == int(targets.sum())
        for t in np.flatnonzero(targets) + 1:
            # a target at t is predicted from position t - 1; the eos is named by the id of the token before it
            key = (int(labels[t]), int(ids[t - 1])) if labels[t] == EOS else (int(labels[t]), -1)
            seen[key] = seen.get(key, 0) + 1
    expected: dict[tuple[int, int], int] = {}
    for prompt, response in documents:
        whole = [*prompt, *response]
        for i, token in enumerate(whole):
            if i >= len(prompt) and i > 0:
                expected[(token, -1)] = 1
        expected[(EOS, whole[-1])] = 1  # the eos follows the last token (a one-token document: itself)
    assert seen == expected
    assert sum(b["num_tokens"] for b in blocks) == sum(len(r) + 1 - (0 if p else 1) for p, r in documents)


def test_a_continued_document_fills_blocks_with_a_one_token_overlap_and_continuing_positions() -> None:
    rules = BlockRules(4, EOS, PAD)
    blocks = list(pack_documents([([], [10, 11]), ([], [20, 21, 22, 23, 24, 25]), ([], [30])], rules))
    assert [b["input_ids"].tolist() for b in blocks] == [
        [10, 11, EOS, PAD],  # the long document starts a fresh block
        [20, 21, 22, 23],
        [23, 24, 25, EOS],  # 23 again, as input: its target was in the block before
        [30, EOS, PAD, PAD],  # nothing is left of the long document but a full block: the next starts anew
    ]
    assert [b["position_ids"].tolist() for b in blocks] == [[0, 1, 2, 0], [0, 1, 2, 3], [3, 4, 5, 6], [0, 1, 0, 1]]
    assert [b["labels"].tolist() for b in blocks] == [
        [-100, 11, EOS, -100],
        [-100, 21, 22, 23],
        [-100, 24, 25, EOS],
        [-100, EOS, -100, -100],
    ]


def test_the_last_chunk_of_a_long_document_is_followed_by_the_next_documents() -> None:
    blocks = list(pack_documents([([], [20, 21, 22, 23, 24]), ([], [30])], BlockRules(5, EOS, PAD)))
    assert [b["input_ids"].tolist() for b in blocks] == [[20, 21, 22, 23, 24], [24, EOS, 30, EOS, PAD]]
    assert [b["position_ids"].tolist() for b in blocks] == [[0, 1, 2, 3, 4], [4, 5, 0, 1, 0]]


def test_positions_restart_where_they_would_reach_the_models_last_position() -> None:
    """Learned absolute positions (GPT-2) end at max_position_embeddings: a chunk that would reach it starts at 0."""
    blocks = list(pack_documents([([], list(range(10, 21)))], BlockRules(4, EOS, PAD, max_position=8)))
    assert [b["position_ids"].tolist() for b in blocks] == [[0, 1, 2, 3], [3, 4, 5, 6], [0, 1, 2, 3], [0, 1, 2, 0]]


def test_truncate_keeps_the_first_block_and_counts_the_cut() -> None:
    rules = BlockRules(4, EOS, PAD, long_documents="truncate")
    packer = Packer(rules)
    blocks = [*packer.add([], [10, 11]), *packer.add([], [20, 21, 22, 23, 24, 25]), *packer.finish()]
    assert [b["input_ids"].tolist() for b in blocks] == [[10, 11, EOS, PAD], [20, 21, 22, 23]]
    stats = packer.stats
    assert (stats.documents, stats.cut, stats.continued, stats.tokens, stats.kept) == (2, 1, 0, 10, 7)
    assert "1 truncated" in stats.summary() and "kept 70.0% of 10 tokens" in stats.summary()
    continued = Packer(BlockRules(4, EOS, PAD))
    [*continued.add([], [10, 11]), *continued.add([], [20, 21, 22, 23, 24, 25]), *continued.finish()]
    assert "1 continued over blocks" in continued.stats.summary() and "kept 100.0%" in continued.stats.summary()


def test_a_packers_state_resumes_mid_block_exactly() -> None:
    rules = BlockRules(16, EOS, PAD)
    documents = _documents(80, 40, seed=3, prompts=True)
    whole = list(pack_documents(documents, rules))
    first = Packer(rules)
    blocks = [block for document in documents[:37] for block in first.add(*document)]
    assert first.state_dict()["input_ids"]  # a partial block is carried over
    state = pickle.loads(pickle.dumps(first.state_dict()))
    second = Packer(rules)
    second.load_state_dict(state)
    blocks += [block for document in documents[37:] for block in second.add(*document)] + second.finish()
    assert len(blocks) == len(whole)
    for a, b in zip(blocks, whole, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids"))
        assert a["num_tokens"] == b["num_tokens"]
    reference = Packer(rules)
    [block for document in documents for block in reference.add(*document)] + reference.finish()
    assert second.stats == reference.stats
    with pytest.raises(ConfigError, match="data.max_seq_length"):
        Packer(BlockRules(8, EOS, PAD)).load_state_dict(state)


def test_bad_rules_are_one_line() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        BlockRules(1, EOS, PAD)
    with pytest.raises(ConfigError, match="data.long_documents"):
        BlockRules(8, EOS, PAD, long_documents="split")
    with pytest.raises(ConfigError, match="model's 4 positions"):
        BlockRules(8, EOS, PAD, max_position=4)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "mixtral"])
def test_a_continued_chunk_sees_only_its_own_document_and_the_blocks_loss_adds_up(kind: str) -> None:
    """Exactness against a model fed each piece alone: in a block that opens with a continued chunk (positions not from
    0) and goes on with whole documents, every position's logits equal those of its chunk or document run alone with
    the same positions; so the block's summed loss is the sum of the pieces' own losses."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(kind)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().float()
    vocab = config.vocab_size
    rng = random.Random(1)
    long_document = [rng.randrange(3, vocab) for _ in range(27)]
    short = [[rng.randrange(3, vocab) for _ in range(n)] for n in (2, 1)]
    rules = BlockRules(12, EOS, PAD, max_position=config.max_position_embeddings)
    blocks = list(pack_documents([([], long_document), *(([], s) for s in short)], rules))
    last = blocks[2]  # the long document's last chunk, then both short documents
    ids = torch.tensor(last["input_ids"], dtype=torch.long)[None]
    positions = torch.tensor(last["position_ids"], dtype=torch.long)[None]
    assert positions[0, 0] == 22  # the chunk continues at its offset in the document
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        pieces = []
        start = 0
        for end in [*(np.flatnonzero(np.diff(last["position_ids"]) != 1) + 1).tolist(), 12]:
            alone = model(input_ids=ids[:, start:end], position_ids=positions[:, start:end], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:end], alone, atol=1e-5, rtol=0)
            pieces.append((start, end))
            start = end
    assert len(pieces) == 4  # the chunk, two documents, the padding tail


def test_continued_blocks_train_like_the_document_read_in_overlapping_windows() -> None:
    """The targets of a continued document's blocks are its tokens 1..n-1 in order, each once: the loss a model gives
    the blocks sums to the loss of those windows, so nothing of a long document is thrown away."""
    document = list(range(100, 151))
    blocks = list(pack_documents([([], document)], BlockRules(8, EOS, PAD)))
    targets = [int(t) for b in blocks for t in b["labels"][1:] if t != IGNORE_INDEX]
    assert targets == [*document[1:], EOS]
