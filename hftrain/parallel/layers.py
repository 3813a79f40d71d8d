"""Megatron tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding and output head.

Hand-written rather than DTensor (``parallelize_module``), because: (1) GPT-2's ``Conv1D`` (transposed
weight) and its packed q/k/v are not handled by DTensor's Colwise/RowwiseParallel styles; (2) the parameters
stay plain tensors with the HF names, so optimizers, clipping, ``state_dict`` and checkpoints need no DTensor
awareness; (3) on the small layers of CPU fine-tuning they ran faster than DTensor, whose per-op dispatch
dominates there, and equal within noise at d=1024 (``benchmarks/tensor_parallel.py``; figures in
benchmarks/README.md).

The layers split the weight of the module they replace and keep its layout (``nn.Linear``: ``(out, in)``;
``Conv1D``: ``(in, out)``) and its parameter names, so a plan only changes *which slice* a rank holds.
A column-parallel layer does not enter the tensor-parallel region itself: the region (Megatron's f, or the
sequence all-gather) is entered once per block whose projections share an input (q, k, v; gate and up), so
a transformer layer runs exactly 2 collectives forward and 2 backward, as Megatron's fused layers do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hftrain.parallel.collectives import copy_to_tp, reduce_from_tp, reduce_scatter_to_sequence
from hftrain.parallel.plans import padded_vocab_size

# Name of the attribute listing a module's own parameters that are replicated over tp but receive only a partial
# gradient on each rank: they saw sequence-sharded activations under sequence parallelism (LayerNorms, row-parallel
# biases), or only this rank's share of a split product (LoRA's A under a column-parallel layer). finalize_tp_grads
# all-reduces them over tp.
PARTIAL_GRAD_PARAMS = "hftrain_partial_grad_params"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / Accelerate / DeepSpeed wrappers, torch.compile


@dataclass(frozen=True)
class TPShard:
    """How one parameter is split over the tensor-parallel ranks.

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
        rank: this rank's tensor-parallel rank.
        size: tensor-parallel size.
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


def _split_parameter(
    tensor: torch.Tensor,
    dim: int,
    group: Any,
    parts: int = 1,
    counts: tuple[int, ...] | None = None,
    *,
    padded: int | None = None,
    replicas: int = 1,
    blocks: tuple[int, ...] | None = None,
) -> tuple[nn.Parameter, TPShard]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    shard = TPShard(dim, rank, size, tuple(tensor.shape), parts, counts, padded, replicas, blocks)
    return nn.Parameter(shard.local(tensor.detach()), requires_grad=tensor.requires_grad), shard


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


class _ShardedLinear(nn.Module):
    """A linear map on a weight slice, in the replaced module's layout (``transposed``: Conv1D's ``(in, out)``)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        tp_group: Any,
        split: str,
        parts: int = 1,
        counts: tuple[int, ...] | None = None,
        replicas: int = 1,
        blocks: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Linear) and not _is_conv1d(module):
            raise TypeError(f"tensor parallelism splits nn.Linear or transformers Conv1D, not {type(module).__name__}")
        self.tp_group = tp_group
        self.transposed = _is_conv1d(module)
        out_dim = 1 if self.transposed else 0
        weight_dim = out_dim if split == "out" else 1 - out_dim
        self.weight, weight_shard = _split_parameter(
            module.weight, weight_dim, tp_group, parts, counts, replicas=replicas, blocks=blocks
        )
        self.shards: dict[str, TPShard] = {"weight": weight_shard}
        if module.bias is None:
            self.bias = None
        elif split == "out":
            self.bias, self.shards["bias"] = _split_parameter(
                module.bias, 0, tp_group, parts, counts, replicas=replicas, blocks=blocks
            )
        else:  # the input dimension is split: every rank adds the full bias once, after the reduction
            self.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transposed else self.weight, bias)

    def extra_repr(self) -> str:
        full = self.shards["weight"].full_shape
        return f"local weight {tuple(self.weight.shape)}, full {full}, conv1d={self.transposed}"


class ColumnParallelLinear(_ShardedLinear):
    """``Y = XA + b`` with ``A = [A_1 ... A_p]`` split by columns (output features): rank i has ``Y_i = XA_i + b_i``.

    Forward: no collective (``X`` has entered the region through f / the sequence all-gather upstream, and
    ``Y_i`` stays split for the row-parallel layer that follows). Backward: none in the layer; the partial input
    gradients ``dY_i A_i^T`` are summed by the region's f (all-reduce) or reduce-scatter (sequence parallel).

    Args:
        module: the ``nn.Linear`` or ``Conv1D`` to split (its full weights, identical on every rank).
        tp_group: the tensor-parallel group.
        parts: packed blocks in the output (3 for GPT-2's ``c_attn``: each of q, k, v is split per head).
        counts: output features per rank when they are not equal (see :class:`TPShard`).
        blocks: lengths of unequal packed blocks in the output (Phi-3's ``qkv_proj``: q, k and v widths), each
            split per head, instead of ``parts`` equal ones.
        replicas: ranks sharing each slice of the output (key/value heads fewer than tp: rank i holds slice
            ``i // replicas``). Each replica's weight gradient is then partial (it saw only its own query heads)
            and ``finalize_tp_grads`` sums it over the ranks sharing the slice; the input gradient needs nothing
            more (the region's f sums every rank's ``dY_i A_i^T``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        tp_group: Any,
        parts: int = 1,
        counts: tuple[int, ...] | None = None,
        replicas: int = 1,
        blocks: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(
            module, tp_group=tp_group, split="out", parts=parts, counts=counts, replicas=replicas, blocks=blocks
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)  # the bias is split like the output: fused into the matmul


class RowParallelLinear(_ShardedLinear):
    """``Y = XA + b`` with ``A = [A_1; ...; A_p]`` split by rows (input features) and ``X = [X_1 ... X_p]``.

    Rank i computes the partial product ``X_i A_i``; the sum over ranks is Megatron's g: all-reduce forward,
    identity backward. Under sequence parallelism the sum is a reduce-scatter along the sequence forward and
    an all-gather backward. The bias is replicated and added once after the reduction (under sequence
    parallelism it sees only this rank's sequence chunk, so its gradient is all-reduced by
    ``finalize_tp_grads``), in the reduced output's dtype: under autocast ``Y`` is bf16 as ``nn.Linear``'s output
    (which adds the bias inside the matmul), not promoted to the fp32 bias's dtype.

    Args:
        module: the ``nn.Linear`` or ``Conv1D`` to split.
        tp_group: the tensor-parallel group.
        sequence_parallel: reduce-scatter along the sequence instead of all-reduce.
        counts: input features per rank when they are not equal (see :class:`TPShard`).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        tp_group: Any,
        sequence_parallel: bool = False,
        counts: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(module, tp_group=tp_group, split="in", counts=counts)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel and self.bias is not None:
            setattr(self, PARTIAL_GRAD_PARAMS, ("bias",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self._matmul(x)
        reduce = reduce_scatter_to_sequence if self.sequence_parallel else reduce_from_tp
        y = reduce(partial, self.tp_group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """``Y = onehot(ids) E`` with ``E = [E_1; ...; E_p]`` split by vocabulary rows.

    The ``V`` rows are zero-padded to ``V' = ⌈V / (p·m)⌉·p·m`` (``m``: ``vocab_multiple``, Megatron's
    ``make-vocab-size-divisible-by``), so any vocabulary splits (GPT-2's 50,257 at p = 8: ``V'`` = 50,264), and rank
    i holds rows ``[i·V'/p, (i+1)·V'/p)``. It looks up the ids in its range, zeroes the rows of the others, and the
    partial results are summed by Megatron's g: all-reduce forward, identity backward (so each rank's gradient
    reaches only its own rows). Ids outside ``[0, V)`` raise ``IndexError`` as ``nn.Embedding`` does (one check of
    the batch, before the lookup), so the padding rows are never looked up: they stay zero, get no gradient, and
    the shard's ``padded`` length trims them from every gathered tensor (checkpoints, exports). Under sequence
    parallelism the scatter to sequence chunks happens after the model's embedding block (HF adds position
    embeddings after the lookup), not here. A scaled embedding (Gemma's ``*TextScaledWordEmbedding``,
    ``Y = onehot(ids) E · √hidden``) keeps its ``embed_scale``: the summed lookup is multiplied by it, as the module
    multiplies its own lookup.

    Args:
        module: the ``nn.Embedding`` to split.
        tp_group: the tensor-parallel group.
        vocab_multiple: pad the vocabulary to a multiple of ``tp × vocab_multiple`` rows (1: of tp only).
    """

    def __init__(self, module: nn.Embedding, *, tp_group: Any, vocab_multiple: int = 1) -> None:
        super().__init__()
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"a vocabulary-parallel embedding splits nn.Embedding, not {type(module).__name__}")
        self.tp_group = tp_group
        self.num_embeddings = module.num_embeddings
        self.padded_vocab_size = padded_vocab_size(self.num_embeddings, dist.get_world_size(tp_group), vocab_multiple)
        self.weight, shard = _split_parameter(module.weight, 0, tp_group, padded=self.padded_vocab_size)
        self.shards = {"weight": shard}
        rows = self.weight.shape[0]
        self.vocab_start, self.vocab_end = shard.rank * rows, (shard.rank + 1) * rows
        pad = module.padding_idx
        self.local_padding_idx = (
            pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        )
        scale = getattr(module, "embed_scale", None)  # a non-persistent buffer: never in a state dict
        self.embed_scale: torch.Tensor | None
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = ((ids >= 0) & (ids < self.num_embeddings)).all()
        if ids.is_cuda:  # checked on the device, no host sync per forward (a failure surfaces at the next sync)
            torch._assert_async(inside, "index out of range in self")
        elif not inside:
            raise IndexError("index out of range in self")  # nn.Embedding's message; padding rows included
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight, self.local_padding_idx)
        embedded = reduce_from_tp(partial.masked_fill(outside.unsqueeze(-1), 0.0), self.tp_group)
        return embedded if self.embed_scale is None else embedded * self.embed_scale.to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (
            f"vocab [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings} "
            f"(padded to {self.padded_vocab_size}), dim {self.weight.shape[1]}"
        )


class WidthParallelRMSNorm(nn.Module):
    """An RMSNorm over a column-parallel projection's whole output width, each rank holding its slice (OLMo-2's
    q/k norms normalise ``q = x W_qᵀ`` over every head at once; transformers' own plan gathers q and k for them):

        ``y_r = w_r ⊙ x_r / √(v + ε)``,  ``v = (1/W) Σ_r' Σ_j x_r'j²``  (W: the full width)

    The sum of squares is one all-reduce over tp whose backward is an all-reduce too (every rank's output depends on
    ``v``; ``collectives.all_reduce_both_ways``). A slice that ``replicas`` ranks hold (a key/value head replicated
    because tp exceeds the key/value heads) is counted once: the all-reduced sum is divided by ``replicas``. The
    weight is split as the projection's output (``TPShard``, the same slices), so each rank's gradient is whole.

    Args:
        module: the RMSNorm (``weight [W]`` and ``variance_epsilon``), as transformers computes it: in fp32, the
            weight applied after the normalisation, cast back to the input's dtype.
        tp_group: the tensor-parallel group.
        replicas: ranks holding each slice (1: split evenly).
    """

    def __init__(self, module: nn.Module, *, tp_group: Any, replicas: int = 1) -> None:
        super().__init__()
        self.tp_group, self.replicas = tp_group, replicas
        self.eps = module.variance_epsilon
        self.width = module.weight.shape[0]
        self.weight, shard = _split_parameter(module.weight, 0, tp_group, replicas=replicas)
        self.shards = {"weight": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from hftrain.parallel.collectives import all_reduce_both_ways

        dtype = x.dtype
        x = x.float()
        squares = all_reduce_both_ways(x.pow(2).sum(-1, keepdim=True), self.tp_group) / self.replicas
        return (self.weight * (x * torch.rsqrt(squares / self.width + self.eps))).to(dtype)

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)} of width {self.width}, eps={self.eps}"


class VocabParallelHead(nn.Module):
    """A language model's output projection ``z = h Wᵀ`` split by vocabulary rows, ``W = [W_1; ...; W_p]``, as
    :class:`VocabParallelEmbedding` splits the embedding (the same padded rows ``[i·V'/p, (i+1)·V'/p)`` on rank i).

    Rank i computes its logits ``z_i = f(h) W_iᵀ`` and keeps them: no rank holds a full-vocabulary row. ``f`` is
    Megatron's region entry (identity forward, all-reduce of ``∂h`` backward: every rank's ``dz_i W_i`` summed); the
    loss is computed across the slices by :meth:`token_losses` (``hftrain.parallel.cross_entropy``: three all-reduces
    of one number per token). Tied input/output embeddings (GPT-2, SmolLM2) stay tied: the head takes the
    vocabulary-parallel embedding's own parameter, which then collects both gradients on its rows. ``gather_output``
    (the export's check, which compares whole logits) all-gathers the slices along the vocabulary and trims the
    padding.

    Args:
        module: the ``nn.Linear`` output projection (``get_output_embeddings()``).
        tp_group: the tensor-parallel group.
        vocab_multiple: pad the vocabulary to a multiple of ``tp × vocab_multiple`` rows.
        tied: the model's vocabulary-parallel input embedding, when the projection shares its weight.
    """

    def __init__(
        self,
        module: nn.Linear,
        *,
        tp_group: Any,
        vocab_multiple: int = 1,
        tied: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Linear) or module.bias is not None:
            raise TypeError(f"a vocabulary-parallel head splits a bias-free nn.Linear, not {module!r}")
        self.tp_group = tp_group
        self.vocab_size = module.out_features
        self.padded_vocab_size = padded_vocab_size(self.vocab_size, dist.get_world_size(tp_group), vocab_multiple)
        if tied is not None:
            self.weight, shard = tied.weight, tied.shards["weight"]
        else:
            self.weight, shard = _split_parameter(module.weight, 0, tp_group, padded=self.padded_vocab_size)
        self.shards = {"weight": shard}
        self.vocab_start = shard.rank * self.weight.shape[0]
        self.gather_output = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(copy_to_tp(hidden, self.tp_group), self.weight)
        if not self.gather_output:
            return logits
        pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
        dist.all_gather(pieces, logits.contiguous(), group=self.tp_group)
        return torch.cat(pieces, dim=-1)[..., : self.vocab_size]

    def token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy of this rank's logits slice against ``labels`` (-100: none), equal on every rank."""
        from hftrain.parallel.cross_entropy import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(
            logits, labels, tp_group=self.tp_group, vocab_start=self.vocab_start, vocab_size=self.vocab_size
        )

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return (
            f"vocab [{self.vocab_start}, {self.vocab_start + rows}) of {self.vocab_size} "
            f"(padded to {self.padded_vocab_size}), dim {self.weight.shape[1]}"
        )


@contextlib.contextmanager
def whole_logits(model: nn.Module) -> Iterator[None]:
    """Within it, every vocabulary-parallel head of ``model`` returns whole-vocabulary logits (collective over tp)."""
    heads = [m for m in model.modules() if isinstance(m, VocabParallelHead)]
    for head in heads:
        head.gather_output = True
    try:
        yield
    finally:
        for head in heads:
            head.gather_output = False
