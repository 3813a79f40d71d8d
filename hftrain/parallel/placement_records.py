"""Where each parameter lives on the mesh: the :class:`Placement` records, one per parameter, and their
:class:`Split` (how a slice is cut).

A parameter is either whole on every rank of an axis, or cut into slices along one axis that cuts parameters (tp by
a family's plan, ep along the experts: ``hftrain.parallel.axes``' ``cuts_parameters``), described by a
:class:`Split`; its gradient on a rank is either complete or one term of a sum over an axis (``partial``); a weight
several pipeline stages read is held as a copy by each of their ranks (``copies``), one of which is the
``primary``. The axis's ``apply_*`` call records this (:func:`place`); what is written over the records (gradient
completion, clipping, full tensors) is ``hftrain.parallel.placement``'s, which re-exports this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PLACEMENTS = "hftrain_placements"  # module attribute: its own parameter name -> Placement
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / Accelerate / DeepSpeed wrappers, torch.compile


@dataclass(frozen=True)
class Split:
    """How one parameter is cut into slices over the ranks of one mesh axis (tp: by a plan; ep: along the experts).

    The full tensor's dimension ``dim`` is viewed as ``parts`` equal blocks (GPT-2's ``c_attn``: 3 blocks,
    query, key and value, each ``hidden`` wide), or as blocks of the given ``blocks`` lengths (Phi-3's fused
    ``qkv_proj``: ``h·d`` query rows, then ``kv·d`` key and ``kv·d`` value rows; its ``gate_up_proj``: 2 equal
    blocks); every block is cut into ``size / replicas`` slices and rank ``r`` holds slice ``r // replicas`` of every
    block, concatenated in block order (so its q, k and v are its own heads'). Slices are equal unless ``counts``
    gives their lengths.

    ``replicas > 1``: consecutive groups of ``replicas`` ranks hold the same slice (grouped-query attention with
    fewer key/value heads than tp: each rank holds one key/value head, shared by ``tp / kv`` ranks, as Megatron and
    vLLM replicate them); :meth:`assemble` takes one copy of each slice.

    ``padded``: the length ``dim`` is zero-padded to before it is cut (a vocabulary padded to a multiple of tp,
    Megatron's ``make-vocab-size-divisible-by``): :meth:`local` pads then slices, :meth:`assemble` trims back to
    ``full_shape``, so the padding never leaves the shards (checkpoints and exports hold the logical tensor).

    Args:
        dim: the split dimension of the full (HF-layout) tensor.
        rank: this rank's position on the axis.
        size: the axis's size.
        full_shape: shape of the unsharded (logical) tensor.
        parts: packed equal blocks along ``dim`` that are split separately (1 for a plain split).
        counts: length of each slice of a block, by slice (``None``: equal slices).
        padded: the padded length of ``dim`` (``None``: no padding; only with ``parts = 1``).
        replicas: ranks holding each slice (a divisor of ``size``).
        blocks: lengths of unequal packed blocks along ``dim`` (they sum to its length; each cut into equal
            slices), instead of ``parts`` equal ones; ``None``: ``parts`` equal blocks.
    """

    dim: int
    rank: int
    size: int
    full_shape: tuple[int, ...]
    parts: int = 1
    counts: tuple[int, ...] | None = None
    padded: int | None = None
    replicas: int = 1
    blocks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size % self.replicas:
            raise ValueError(f"replicas={self.replicas} does not divide the tensor-parallel size {self.size}")
        if self.padded is not None and (self.parts != 1 or self.padded < self.full_shape[self.dim]):
            raise ValueError(f"padded={self.padded} needs parts=1 and at least {self.full_shape[self.dim]} rows")
        if self.blocks is not None:
            if self.counts is not None or self.padded is not None or sum(self.blocks) != self.full_shape[self.dim]:
                raise ValueError(
                    f"blocks={self.blocks} must sum to {self.full_shape[self.dim]}, without counts or padding"
                )
            if any(block % self.slices for block in self.blocks):
                raise ValueError(f"{self.slices} slices do not divide every block of {self.blocks}")
            object.__setattr__(self, "parts", len(self.blocks))

    @property
    def slices(self) -> int:
        """Distinct slices of a block (``size / replicas``)."""
        return self.size // self.replicas

    @property
    def first_replica(self) -> bool:
        """Whether this rank holds the first copy of its slice (the copy counted once in norms)."""
        return self.rank % self.replicas == 0

    def slice_lengths(self) -> tuple[int, ...]:
        """Every slice's length within one block of ``parts`` equal ones (slice i is held by ranks
        i·replicas … (i+1)·replicas − 1)."""
        block = (self.padded or self.full_shape[self.dim]) // self.parts
        return self.counts or (block // self.slices,) * self.slices

    def _pieces(self, rank: int | None = None) -> list[tuple[int, int]]:
        """``(start, length)`` along ``dim`` of the (padded) full tensor of each block's slice a rank holds."""
        index = (self.rank if rank is None else rank) // self.replicas
        if self.blocks is not None:
            starts = [sum(self.blocks[:part]) for part in range(self.parts)]
            return [(start + index * block // self.slices, block // self.slices)
                    for start, block in zip(starts, self.blocks, strict=True)]  # fmt: skip
        lengths = self.slice_lengths()
        block = (self.padded or self.full_shape[self.dim]) // self.parts
        return [(part * block + sum(lengths[:index]), lengths[index]) for part in range(self.parts)]

    def local_shape(self, rank: int | None = None) -> tuple[int, ...]:
        """Shape of a rank's shard (this rank's by default).

        Args:
            rank: a tensor-parallel rank.
        """
        shape = list(self.full_shape)
        shape[self.dim] = sum(length for _, length in self._pieces(rank))
        return tuple(shape)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` (a copy; rows of the padding are zero).

        Args:
            full: a tensor of ``full_shape`` (a weight, its gradient or its optimizer state).
        """
        if tuple(full.shape) != tuple(self.full_shape):
            raise ValueError(f"expected a full tensor of shape {tuple(self.full_shape)}, got {tuple(full.shape)}")
        if self.padded is not None:
            full = F.pad(full.movedim(self.dim, -1), (0, self.padded - full.shape[self.dim])).movedim(-1, self.dim)
        return torch.cat([full.narrow(self.dim, start, length) for start, length in self._pieces()], self.dim)

    def boxes(self, local: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """Where this rank's slice lies in the full tensor: ``(offsets, view of local)`` per block, the padding's
        rows left out (they belong to no logical tensor). A sharded checkpoint writes and reads these in place.

        Args:
            local: this rank's shard (a weight or optimizer state shaped like it).
        """
        found, at = [], 0
        for start, length in self._pieces():
            keep = min(length, self.full_shape[self.dim] - start)
            if keep > 0:
                offsets = [0] * len(self.full_shape)
                offsets[self.dim] = start
                found.append((tuple(offsets), local.narrow(self.dim, at, keep)))
            at += length
        return found

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full (logical) tensor from every rank's slice (in tp-rank order): one copy of each replicated slice,
        the padding trimmed.

        Args:
            shards: ``size`` tensors, one per tensor-parallel rank.
        """
        # pieces[r][b]: block b's slice held by the r-th distinct slice holder
        pieces = [
            shard.split([length for _, length in self._pieces(rank)], self.dim)
            for rank, shard in list(enumerate(shards))[:: self.replicas]
        ]
        full = torch.cat([held[part] for part in range(self.parts) for held in pieces], self.dim)
        return full.narrow(self.dim, 0, self.full_shape[self.dim]).contiguous()


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives on the mesh.

    Args:
        axis: the mesh axis whose ranks hold different slices (``"tp"``, ``"ep"``); None: whole on every rank.
        split: how the logical tensor is cut along ``axis`` (None when it is not).
        partial: axes over which this rank's gradient is one term of a sum (``"tp"``).
        copies: the group (``ParallelGroups.axis_group``) whose ranks each hold a copy of this weight for a different
            pipeline stage and take their own uses' gradient: ``"embedding"`` (tied input/output embeddings on the
            first and last stage), ``"pp"`` (a weight every chunk reads, DeBERTa's relative embeddings); None: one
            holder per stage. Every copy applies the sum of their gradients, so all stay one weight.
        primary: whether this rank's copy is the one counted in the gradient norm and written to checkpoints (the
            copy on the rank holding the first chunk).
    """

    axis: str | None = None
    split: Split | None = None
    partial: tuple[str, ...] = ()
    copies: str | None = None
    primary: bool = True

    @property
    def counted(self) -> bool:
        """Whether this rank's copy of its slice is the one counted in norms (the first of its holders, on the
        primary stage)."""
        return self.primary and (self.split is None or self.split.first_replica)


WHOLE = Placement()


def place(
    module: nn.Module,
    name: str,
    *,
    axis: str | None = None,
    split: Split | None = None,
    partial=(),
    copies: str | None = None,
    primary: bool | None = None,
) -> None:
    """Record where ``module``'s own parameter ``name`` lives (merged into what an earlier axis recorded).

    Args:
        module: the module owning the parameter.
        name: the parameter's name in ``module``.
        axis: the axis that cuts it, with ``split``.
        split: how it is cut.
        partial: axes over which its gradient is partial.
        copies: the group whose ranks hold pipeline copies of it (``Placement.copies``).
        primary: whether this rank's copy is counted and written (``Placement.primary``); None: unchanged.
    """
    records = dict(getattr(module, PLACEMENTS, {}))
    old = records.get(name, WHOLE)
    records[name] = Placement(
        axis=axis or old.axis,
        split=split or old.split,
        partial=tuple(dict.fromkeys((*old.partial, *partial))),
        copies=copies or old.copies,
        primary=old.primary if primary is None else primary,
    )
    setattr(module, PLACEMENTS, records)


def placed(module: nn.Module) -> dict[str, Placement]:
    """``module``'s own records (its parameter name -> placement); unrecorded parameters are whole.

    Args:
        module: any module.
    """
    return getattr(module, PLACEMENTS, {})


def logical(name: str) -> str:
    """``name`` without the wrappers' prefixes (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``)."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def placements(model: nn.Module) -> dict[str, Placement]:
    """Logical HF names of the recorded parameters -> their placements (unrecorded ones are whole).

    Args:
        model: a model after its axes' ``apply_*`` calls, possibly wrapped (DDP, Accelerate, compile).
    """
    return {
        logical(f"{prefix}.{name}" if prefix else name): record
        for prefix, module in model.named_modules()
        for name, record in placed(module).items()
    }


def split_over(model: nn.Module, axis: str | None = None) -> dict[str, Split]:
    """Logical names of the parameters cut along ``axis`` (any axis: None) -> how each is cut.

    Args:
        model: the parallelized model.
        axis: a mesh axis, or None for every cut parameter.
    """
    return {
        name: record.split
        for name, record in placements(model).items()
        if record.split is not None and (axis is None or record.axis == axis)
    }


def _live_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(logical name, parameter)`` of the parameters this rank holds (not another stage's, left on ``meta``)."""
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            yield logical(name), param
