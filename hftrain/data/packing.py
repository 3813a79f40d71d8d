"""Packing documents into blocks of exactly ``block_size`` tokens: the rules, once, for every way data arrives.

The map-style pipeline (``hftrain.data.language.pack_splits``, cached by ``hftrain.data.cache``) and the stream
(``hftrain.data.streaming``) both feed documents, one at a time and in order, to a :class:`Packer` and take the blocks
it completes; so a block is the same whichever way its documents came. The rules:

1. A document is ``prompt + response + [eos]`` (token ids without the tokenizer's template special tokens). Plain text
   has no prompt. Labels are the ids, ``-100`` at the prompt; the loss is on the response and its eos.
2. A document of at most ``block_size`` tokens goes whole, in order, into the current block; one that does not fit in
   what is left of the block starts the next one, and the unused tail is padding (``pad``; label ``-100``; positions
   one more run from 0).
3. A longer document (``long_documents: "continue"``, transformers' ``group_texts`` without losing a token) starts a
   fresh block and fills consecutive blocks with chunks ``doc[k(B-1) : k(B-1) + B]``, ``B = block_size``: each chunk
   repeats the last token of the one before as its first input. In a block, position ``t`` is trained on
   ``labels[t + 1]``, so block position 0 is never a target; with the one-token overlap every token of the document
   but its first is the target of exactly one position, ``Σ_k (len_k - 1) = len - 1`` targets in all, as if the
   document had been read whole. A chunk's positions continue from its offset in the document
   (``k(B-1), k(B-1)+1, ...``), restarting at 0 only where they would reach ``max_position`` (the model's
   ``max_position_embeddings``: learned absolute positions end there). The last chunk may be short; the next documents
   follow it in its block. ``"truncate"``: the document is cut to its first ``B`` tokens (the rest is never seen).
4. ``-100`` labels also at padding and at each document's first token: nothing predicts the start of a document from
   the unrelated one before it.
5. Positions restart at 0 at every document (and at a padding tail); transformers reads the restarts of
   ``position_ids`` as packed sequences and masks attention block-diagonally (``LMCollator``), so no token attends to
   another document. A continued chunk opening a block need not start at 0: the mask only looks at where the
   positions stop counting by one.

``num_tokens`` of a block counts ``labels[1:] != -100``: exactly the targets the shifted causal-LM loss averages over.
The packer keeps its partial block and its counts in :meth:`Packer.state_dict`, so a stream's checkpoint resumes
packing mid-block. Written by hand because ``group_texts`` (transformers' examples) concatenates without document
boundaries, padding or prompt masks, and drops the tail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hftrain.errors import ConfigError

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""The label transformers' cross entropy skips."""

LONG_DOCUMENT_RULES = ("continue", "truncate")
"""``data.long_documents``: what happens to a document longer than a block."""


@dataclass(frozen=True)
class BlockRules:
    """How documents become blocks (the module's rules).

    Args:
        block_size: tokens per block, at least 2.
        eos: the id appended to every document.
        pad: the id of a block's padding tail.
        long_documents: ``"continue"`` (a longer document goes on in the next blocks) or ``"truncate"`` (cut).
        max_position: positions of a continued document stay below this (the model's ``max_position_embeddings``);
            None: no bound.
    """

    block_size: int
    eos: int
    pad: int
    long_documents: str = "continue"
    max_position: int | None = None

    def __post_init__(self) -> None:
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ConfigError(
                f"data.max_seq_length: the block length of a causal LM must be an integer of at least 2, got {size!r}"
            )
        if self.long_documents not in LONG_DOCUMENT_RULES:
            raise ConfigError(
                f"data.long_documents: {self.long_documents!r} is not one of {', '.join(LONG_DOCUMENT_RULES)}"
            )
        if self.max_position is not None and self.max_position < size:
            raise ConfigError(
                f"data.max_seq_length: blocks of {size} tokens do not fit the model's {self.max_position} positions; "
                f"give at most {self.max_position}"
            )

    @classmethod
    def of(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        block_size: int,
        *,
        long_documents: str = "continue",
        max_position: int | None = None,
    ) -> BlockRules:
        """The rules for ``tokenizer``: its eos (a BERT-style tokenizer without one: its sep, its end of a text) ends
        every document; its pad token fills block tails (the eos when it has none: padding is never attended to from
        a document nor trained on, so its id does not matter).

        Args:
            tokenizer: the model's tokenizer.
            block_size: ``data.max_seq_length``, as far as the model takes it.
            long_documents: ``data.long_documents``.
            max_position: the model's ``max_position_embeddings``, if it has learned positions or a bound.
        """
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        if eos is None:
            raise ConfigError(
                f"model.model_name_or_path: the tokenizer {tokenizer.name_or_path or type(tokenizer).__name__} has no "
                "eos token (nor sep), which ends every packed document; set eos_token in its tokenizer_config.json"
            )
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        return cls(block_size, int(eos), int(pad), long_documents, max_position)

    @property
    def tokenize_max_length(self) -> int | None:
        """The length to tokenize a document part to: whole when it continues, ``block_size`` when more is cut."""
        return None if self.long_documents == "continue" else self.block_size


def block_features() -> datasets.Features:
    """The columns of a packed block: ids, labels and positions (int32 × ``block_size``), ``length`` (the block size,
    for samplers) and ``num_tokens`` (its targets)."""
    import datasets

    ints = datasets.Sequence(datasets.Value("int32"))
    return datasets.Features(
        {
            "input_ids": ints,
            "labels": ints,
            "position_ids": ints,
            "length": datasets.Value("int64"),
            "num_tokens": datasets.Value("int64"),
        }
    )


@dataclass
class PackStats:
    """What packing did: ``documents`` in, ``continued`` over blocks or ``cut``, their ``tokens`` (eos included) and
    the ones ``kept`` in blocks, ``blocks`` out, their non-padding positions (``filled``) and ``targets``."""

    documents: int = 0
    continued: int = 0
    cut: int = 0
    tokens: int = 0
    kept: int = 0
    blocks: int = 0
    filled: int = 0
    targets: int = 0
    block_size: int = 0

    def add(self, other: PackStats) -> None:
        """Count ``other``'s figures in too (several streams or shards)."""
        for item in dataclasses.fields(self):
            if item.name != "block_size":
                setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))
        self.block_size = self.block_size or other.block_size

    def summary(self) -> str:
        """One log fragment, e.g. ``1000 documents in 250 blocks (fill 97.1%, 12 continued over blocks, kept 100.0%
        of 250,112 tokens)``."""
        fill = self.filled / (self.blocks * self.block_size) if self.blocks else 0.0
        kept = self.kept / self.tokens if self.tokens else 1.0
        long = f"{self.continued} continued over blocks" if not self.cut else f"{self.cut} truncated"
        return (
            f"{self.documents} documents in {self.blocks} blocks (fill {fill:.1%}, {long}, kept {kept:.1%} of "
            f"{self.tokens:,} tokens)"
        )


class Packer:
    """Documents in, in order; blocks out as they are completed (the module's rules).

    Args:
        rules: the block size, eos, padding and long-document rule.
    """

    def __init__(self, rules: BlockRules) -> None:
        self.rules = rules
        self.stats = PackStats(block_size=rules.block_size)
        size = rules.block_size
        self._ids = np.empty(size, dtype=np.int32)
        self._labels = np.empty(size, dtype=np.int32)
        self._positions = np.empty(size, dtype=np.int32)
        self._fill = 0

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> list[dict[str, Any]]:
        """Pack one document; returns the blocks it completed (often none).

        Args:
            prompt: the prompt's ids (not trained on); empty for plain text.
            response: the trained ids, without eos.
        """
        rules, size = self.rules, self.rules.block_size
        n_prompt = len(prompt)
        ids = np.empty(n_prompt + len(response) + 1, dtype=np.int32)
        ids[:n_prompt] = prompt
        ids[n_prompt:-1] = response
        ids[-1] = rules.eos
        labels = ids.copy()
        labels[:n_prompt] = IGNORE_INDEX
        labels[0] = IGNORE_INDEX  # nothing predicts a document's first token: it follows another document
        length = len(ids)
        self.stats.documents += 1
        self.stats.tokens += length
        done: list[dict[str, Any]] = []
        if length <= size:
            if self._fill + length > size:
                done.append(self._flush())
            self._place(ids, labels, np.arange(length, dtype=np.int32))
            self.stats.kept += length
            return done
        if self._fill:
            done.append(self._flush())
        if rules.long_documents == "truncate":
            self.stats.cut += 1
            self.stats.kept += size
            self._place(ids[:size], labels[:size], np.arange(size, dtype=np.int32))
            return done
        self.stats.continued += 1
        self.stats.kept += length
        step = size - 1
        start = 0
        while start + 1 < length:  # a chunk of only the repeated token would have no target
            end = min(start + size, length)
            chunk_labels = labels[start:end].copy()
            chunk_labels[0] = IGNORE_INDEX  # the repeated token: input only (its target was in the block before)
            first = start if rules.max_position is None or end <= rules.max_position else 0
            self._place(ids[start:end], chunk_labels, np.arange(first, first + end - start, dtype=np.int32))
            if end < length:
                done.append(self._flush())
            start += step
        return done

    def finish(self) -> list[dict[str, Any]]:
        """The partial last block, padded (``[]`` when there is none); the packer is then empty."""
        return [self._flush()] if self._fill else []

    def _place(self, ids: np.ndarray, labels: np.ndarray, positions: np.ndarray) -> None:
        start, end = self._fill, self._fill + len(ids)
        self._ids[start:end] = ids
        self._labels[start:end] = labels
        self._positions[start:end] = positions
        self._fill = end

    def _flush(self) -> dict[str, Any]:
        size, fill = self.rules.block_size, self._fill
        ids, labels, positions = self._ids.copy(), self._labels.copy(), self._positions.copy()
        ids[fill:] = self.rules.pad
        labels[fill:] = IGNORE_INDEX
        positions[fill:] = np.arange(size - fill, dtype=np.int32)
        targets = int(np.count_nonzero(labels[1:] != IGNORE_INDEX))
        self.stats.blocks += 1
        self.stats.filled += fill
        self.stats.targets += targets
        self._fill = 0
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "length": size, "num_tokens": targets}

    def state_dict(self) -> dict[str, Any]:
        """The partial block and the counts so far: plain lists and ints (a stream's checkpoint)."""
        fill = self._fill
        return {
            "block_size": self.rules.block_size,
            "input_ids": self._ids[:fill].tolist(),
            "labels": self._labels[:fill].tolist(),
            "position_ids": self._positions[:fill].tolist(),
            "stats": dataclasses.asdict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s partial block and counts.

        Args:
            state: what :meth:`state_dict` returned, for the same rules.
        """
        if state["block_size"] != self.rules.block_size:
            raise ConfigError(
                f"data.max_seq_length: the saved stream packs blocks of {state['block_size']} tokens, this run "
                f"{self.rules.block_size}; resume with data.max_seq_length={state['block_size']}"
            )
        self._fill = 0
        self._place(
            np.asarray(state["input_ids"], dtype=np.int32),
            np.asarray(state["labels"], dtype=np.int32),
            np.asarray(state["position_ids"], dtype=np.int32),
        )
        self.stats = PackStats(**state["stats"])


def pack_documents(documents: Iterable[tuple[Sequence[int], Sequence[int]]], rules: BlockRules) -> Iterator[dict]:
    """Every block of ``documents`` (``(prompt ids, trained ids)`` each, in order), the last one padded.

    Args:
        documents: the documents' ids, without eos; plain text has prompt ids ``[]``.
        rules: the packing rules.
    """
    packer = Packer(rules)
    for prompt, response in documents:
        yield from packer.add(prompt, response)
    yield from packer.finish()
