"""Tokenization, samplers and data loaders: dynamic padding, length buckets and length-aware batching.

Every process builds the same index order from ``(seed, epoch)``; Accelerate then hands process ``r`` every
``r``-th micro-batch, so a global batch is the same examples whatever the number of processes.

Length buckets (:class:`LengthBuckets`, :class:`BucketCollator`) are hand-written because transformers'
``DataCollatorWithPadding`` pads to a multiple *or* to a fixed length, never "a multiple, but no further than the
longest text allowed": with a multiple that does not divide ``data.max_seq_length`` its last bucket would run past
the model's positions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Sampler

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict
    from transformers import PreTrainedTokenizerBase


def tokenize_splits(splits: DatasetDict, tokenizer: PreTrainedTokenizerBase, *, max_seq_length: int) -> DatasetDict:
    """Tokenize ``text`` without padding (padding happens per batch) and rename ``label`` to ``labels``.

    Args:
        splits: splits with ``text`` and ``label`` columns.
        tokenizer: the model's tokenizer.
        max_seq_length: truncation length in tokens.
    """

    from datasets import DatasetDict

    def encode(batch: dict) -> dict:
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_seq_length)
        encoded["length"] = [len(ids) for ids in encoded["input_ids"]]
        return encoded

    # keep_in_memory: no cache files, so concurrent processes never race on the datasets cache. A fingerprint of
    # our own: datasets would otherwise hash ``encode`` with dill, which pickles the tokenizer and its vocabulary
    # (0.1-0.15 s of a default job, for a cache that in-memory datasets never use).
    fingerprint = f"{type(tokenizer).__name__}|{tokenizer.name_or_path}|{len(tokenizer)}|{max_seq_length}"
    tokenized = DatasetDict(
        {
            name: split.map(
                encode,
                batched=True,
                keep_in_memory=True,
                remove_columns=["text"],
                new_fingerprint=hashlib.sha256(f"{split._fingerprint}|{fingerprint}".encode()).hexdigest()[:16],
            )
            for name, split in splits.items()
        }
    )
    return tokenized.rename_column("label", "labels")


def lengths_of(dataset: Dataset) -> list[int]:
    """The ``length`` column of a tokenized dataset, as a list, in one read.

    ``datasets`` returns a lazy column that reads row by row when it is iterated or indexed one element at a time:
    0.07 s to list 11,476 lengths that way, 0.09 s to sort 1,276 by them, against 0.3 ms for a slice.
    """
    return list(dataset["length"][:])


class EpochSampler(Sampler[int]):
    """Indices in an order fixed by ``(seed, epoch)``: sequential, random, or grouped by length.

    Args:
        lengths: token length of each example.
        order: ``"sequential"``, ``"random"`` or ``"group_by_length"``.
        group_size: examples per global batch; length groups are cut in multiples of it, so the order does
            not depend on how the global batch is split across processes.
        seed: base seed; epoch ``e`` shuffles with ``seed + e``.
        whole_groups: yield only whole global batches (the last ``n mod group_size`` indices of each epoch's order
            are left out), as Megatron's sampler does: the ranks then never see Accelerate's repeated examples that
            even out a short last batch, and every global batch is what one process would train on.
    """

    def __init__(
        self, lengths: Sequence[int], *, order: str, group_size: int, seed: int, whole_groups: bool = False
    ) -> None:
        self.lengths = list(lengths)
        self.order = order
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0
        self.whole_groups = whole_groups

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n - n % self.group_size if self.whole_groups else n

    def __iter__(self) -> Iterator[int]:
        from transformers.trainer_pt_utils import get_length_grouped_indices

        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.order == "sequential":
            order = list(range(len(self.lengths)))
        elif self.order == "random":
            order = torch.randperm(len(self.lengths), generator=generator).tolist()
        else:
            order = get_length_grouped_indices(self.lengths, self.group_size, generator=generator)
        return iter(order[: len(self)])


class SortedSampler(Sampler[int]):
    """Evaluation order: longest first, so batches pad little; metrics are order-independent."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.order = sorted(range(len(lengths)), key=lambda i: -lengths[i])

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)


@dataclass(frozen=True)
class LengthBuckets:
    """What every batch's sequence length is padded up to: the next multiple of ``multiple``, at most ``ceiling``.

    The padded length of a batch whose longest example has ``L`` tokens is ``min(⌈L / m⌉·m, C)`` with ``m =
    multiple`` and ``C = ceiling``; ``C`` is itself a multiple of ``required`` (what the strategy needs: ``tp`` under
    sequence parallelism, ``2·cp`` under context parallelism), and ``m`` is ``lcm(buckets, required)``. So a run
    sees at most ``⌈C / m⌉`` lengths, and every length is one the strategy can cut.

    Args:
        multiple: ``m``; None or 1: each batch is padded to its longest example (to ``required`` if set).
        ceiling: ``C``: the longest padded length (the longest example allowed, up to a multiple of ``required``).
        rule: how ``multiple`` was chosen, for the startup line.
    """

    multiple: int | None
    ceiling: int | None = None
    rule: str = "none"

    @classmethod
    def combine(cls, buckets: int | None, required: int | None, *, longest: int, rule: str) -> LengthBuckets:
        """The buckets from the configured multiple and the strategy's required one (their lcm).

        Args:
            buckets: ``data.pad_to_multiple_of`` resolved for the device (None: no bucketing).
            required: the multiple the strategy needs (``Runtime.pad_to_multiple_of``; None: any length).
            longest: the longest example allowed (``data.max_seq_length``, or the data's longest).
            rule: why ``buckets`` is what it is.
        """
        multiple = math.lcm(buckets or 1, required or 1)
        step = required or 1
        if step > 1 and multiple != (buckets or 1):
            rule = f"{rule}; lcm with the strategy's multiple {step}"
        ceiling = -(-longest // step) * step
        return cls(multiple if multiple > 1 else None, ceiling, rule)

    def describe(self) -> str:
        """The startup line: the rule and why."""
        if not self.multiple:
            return f"length buckets: none ({self.rule})"
        return f"length buckets: multiple of {self.multiple}, at most {self.ceiling} ({self.rule})"

    def lengths(self) -> int:
        """How many padded lengths a run can see: ``⌈C / m⌉`` (every length up to ``C`` without a multiple)."""
        ceiling = self.ceiling or 0
        return -(-ceiling // self.multiple) if self.multiple else ceiling

    def padded(self, length: int) -> int:
        """The padded length of a batch whose longest example has ``length`` tokens."""
        if not self.multiple:
            return length
        padded = -(-length // self.multiple) * self.multiple
        return max(length, min(padded, self.ceiling)) if self.ceiling else padded


@dataclass(frozen=True)
class BucketCollator:
    """Pads a batch of tokenized examples to :meth:`LengthBuckets.padded` of its longest (``tokenizer.pad``).

    ``pad_to_multiple_of`` is the bucket multiple under the name transformers' collators use, so the megatron plugin
    can check and raise it as it does theirs (``dataclasses.replace``).

    Args:
        tokenizer: supplies the pad token and side.
        pad_to_multiple_of: the bucket multiple (None: pad to the longest example).
        ceiling: the longest padded length (None: no bound).
    """

    tokenizer: Any
    pad_to_multiple_of: int | None = None
    ceiling: int | None = None

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        from transformers.data.data_collator import pad_without_fast_tokenizer_warning

        buckets = LengthBuckets(self.pad_to_multiple_of, self.ceiling)
        target = buckets.padded(max(len(f["input_ids"]) for f in features))
        batch = pad_without_fast_tokenizer_warning(
            self.tokenizer, list(features), padding="max_length", max_length=target, return_tensors="pt"
        )
        if "label" in batch:  # DataCollatorWithPadding's rename
            batch["labels"] = batch.pop("label")
        return dict(batch)


def build_dataloader(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    batch_size: int,
    sampler: Sampler,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Callable[[list[dict]], dict[str, torch.Tensor]] | None = None,
    buckets: LengthBuckets | None = None,
) -> DataLoader:
    """A loader that pads each batch to its bucket (or collates with the task's ``collate_fn``).

    Args:
        dataset: tokenized examples with a ``length`` column.
        tokenizer: supplies the pad token.
        batch_size: examples per process per micro-batch.
        sampler: the index order.
        num_workers: loader worker processes.
        pin_memory: collate into pinned host memory (a GPU run: its copies to the device then do not wait).
        collate_fn: the task's collator (packed language-model blocks); None pads with :class:`BucketCollator`.
        buckets: the length buckets of the padding collator (None: each batch to its longest example).
    """
    buckets = buckets or LengthBuckets(None)
    return DataLoader(
        dataset.remove_columns([c for c in dataset.column_names if c == "length"]),
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn or BucketCollator(tokenizer, buckets.multiple, buckets.ceiling),
        num_workers=num_workers,
        pin_memory=pin_memory,
        # A loader without its own generator draws worker seeds from the global torch RNG each time an
        # epoch starts, so a resumed run (which starts its iterator later) would see shifted dropout masks.
        generator=torch.Generator().manual_seed(0),
    )
