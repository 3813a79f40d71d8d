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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hftrain.parallel.collectives import copy_to_tp, reduce_from_tp, reduce_scatter_to_sequence
from hftrain.parallel.deferred import local_slice
from hftrain.parallel.placement import Split, place, placed
from hftrain.parallel.plans import padded_vocab_size


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
) -> tuple[nn.Parameter, Split]:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    shard = Split(dim, rank, size, tuple(tensor.shape), parts, counts, padded, replicas, blocks)
    # a loader's deferred parameter (hftrain.parallel.deferred) reads only this slice from the checkpoint
    return nn.Parameter(local_slice(tensor, shard), requires_grad=tensor.requires_grad), shard


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
        place(self, "weight", axis="tp", split=weight_shard)
        if module.bias is None:
            self.bias = None
        elif split == "out":
            self.bias, bias_shard = _split_parameter(
                module.bias, 0, tp_group, parts, counts, replicas=replicas, blocks=blocks
            )
            place(self, "bias", axis="tp", split=bias_shard)
        else:  # the input dimension is split: every rank adds the full bias once, after the reduction
            self.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transposed else self.weight, bias)

    def extra_repr(self) -> str:
        full = placed(self)["weight"].split.full_shape
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
        counts: output features per rank when they are not equal (see :class:`Split`).
        blocks: lengths of unequal packed blocks in the output (Phi-3's ``qkv_proj``: q, k and v widths), each
            split per head, instead of ``parts`` equal ones.
        replicas: ranks sharing each slice of the output (key/value heads fewer than tp: rank i holds slice
            ``i // replicas``). Each replica's weight gradient is then partial (it saw only its own query heads)
            and ``placement.complete_grads`` sums it over the ranks sharing the slice; the input gradient needs nothing
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
    ``placement.complete_grads``), in the reduced output's dtype: under autocast ``Y`` is bf16 as ``nn.Linear``'s output
    (which adds the bias inside the matmul), not promoted to the fp32 bias's dtype.

    Args:
        module: the ``nn.Linear`` or ``Conv1D`` to split.
        tp_group: the tensor-parallel group.
        sequence_parallel: reduce-scatter along the sequence instead of all-reduce.
        counts: input features per rank when they are not equal (see :class:`Split`).
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
            place(self, "bias", partial=("tp",))

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
        place(self, "weight", axis="tp", split=shard)
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
    weight is split as the projection's output (``Split``, the same slices), so each rank's gradient is whole.

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
        place(self, "weight", axis="tp", split=shard)

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
            self.weight, shard = tied.weight, placed(tied)["weight"].split
        else:
            self.weight, shard = _split_parameter(module.weight, 0, tp_group, padded=self.padded_vocab_size)
        place(self, "weight", axis="tp", split=shard)
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
