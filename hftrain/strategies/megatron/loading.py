"""Megatron's way to load a pretrained model (``hftrain.strategies.loading``): each rank reads its pipeline stage's
blocks only, and of each tensor that tensor parallelism splits, only its own slice.

Pipeline parallelism (``pp > 1``): the pipeline runtime leaves the other stages' layers (and the embedding or head
it does not hold) out of ``from_pretrained`` (``PipelineRuntime.build_model``); they stay on ``meta`` until
``prepare`` drops them, never given memory, never read. This rank's own blocks are left out too and given to
:class:`MegatronLoading`.

Tensor parallelism (``tp > 1``): in each block the parameters that the family's plan splits through a parallel layer
(``hftrain.parallel.plans``: the ``column*`` styles' weight and bias, ``row``'s weight, the ``width_norm*`` weight)
stay on ``meta`` with a reader of the checkpoint (``hftrain.parallel.deferred``). ``prepare`` splits the model as
before (``MegatronPlugin.parallelize``), and each such parameter, as it is split, reads this rank's slice only: a
split along the first dimension (the rows of an ``nn.Linear``'s ``(out, in)`` weight: column-parallel layers, the
width norms) is contiguous in the row-major file, so its rows are read by byte range with ``pread`` straight into the
shard (``hftrain.models.weights``); a split along another dimension (a row-parallel weight's input columns, GPT-2's
transposed ``Conv1D``) reads that one tensor whole, slices it and frees it. The block's other parameters (norms, a
row-parallel layer's bias, a mixture of experts' replicated experts) are read whole here, as the split keeps them
whole. A rank peaks at its shards plus one tensor, never a whole block, let alone the whole model. No collective.

Exactness: every value is the file's, cast as ``from_pretrained`` casts it, and a slice of a cast is the cast of
the slice, so the split model is bit-identical to the split of a ``from_pretrained`` model; the new head, the
embeddings and the final norm are ``from_pretrained``'s (``hftrain.models.partial``: the same random stream). The
checkpoint and the export read the split model, so resume and export are unchanged.

Where it does not apply, every rank loads its stages' part (pp) or the whole model (tp), said in the ``model:`` line:
LoRA adapters (added after the load, they would wrap ``meta`` layers), weights that are not safetensors, and the
layouts whose split is not only tp's per-block one (an axis that declares so, :func:`refusal`: context and
expert parallelism).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from hftrain.strategies.loading import BlockLoading

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hftrain.models.weights import Entry, Weights
    from hftrain.parallel.dims import ParallelDims
    from hftrain.parallel.placement_records import Split

SPLIT_WITH_BIAS = frozenset({"column", "column_qkv", "column_kv", "column_gate_up", "column_fused_qkv"})
"""Plan styles whose layer splits its weight and its bias (``hftrain.parallel.layers``' ``_split_parameter``)."""
SPLIT_WEIGHT = frozenset({"row", "width_norm", "width_norm_kv"})
"""Plan styles whose layer splits its weight only (a row-parallel layer keeps its bias whole)."""


def refusal(dims: ParallelDims) -> str | None:
    """Why :class:`MegatronLoading` does not apply to this layout (None: it does): an axis in use that does not
    compose with it yet, by its own declaration (``AxisOps.not_built["block_loading"]``: context and expert
    parallelism change the attention and the experts in ways this loading does not follow)."""
    from hftrain.parallel.axis_ops import not_built

    for axis, size, why in not_built(dims, "block_loading"):
        return f"parallelism.{axis}={size}: {why}"
    return None


class MegatronLoading(BlockLoading):
    """This rank's blocks given their weights (``tp = 1``) or left on ``meta`` with a reader of their slice
    (``tp > 1``), as the module docstring says.

    Args:
        tp: the tensor-parallel size.
        pp: the pipeline-parallel size (for the log line: the blocks given are this rank's stages' only).
    """

    name = "megatron"
    supports_lora = False

    def __init__(self, *, tp: int, pp: int) -> None:
        self.tp, self.pp = tp, pp
        self.deferred = 0  # parameters left on meta for the split
        self.whole = 0  # blocks read whole here: not layers of the tp plan

    def materialize(self, model: nn.Module, blocks: list[str], weights: Weights) -> None:
        split = self._split_parameters(model) if self.tp > 1 else {}
        for path in blocks:
            layer_plan = split.get(path.rpartition(".")[0])
            deferred = set()
            if layer_plan is None:
                self.whole += 1
            else:
                block = model.get_submodule(path)
                for sub, names in layer_plan:
                    module = block.get_submodule(sub)
                    deferred |= {f"{sub}.{name}" for name in names if getattr(module, name, None) is not None}
            self._place(path, model.get_submodule(path), weights, deferred)

    @staticmethod
    def _split_parameters(model: nn.Module) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
        """``{path of the plan's layer list: [(module in a layer, its parameters the split reads)]}``."""
        from hftrain.parallel.families import plan_for

        plan = plan_for(model.config)
        entries = []
        for sub, style in plan.layer:
            if style in SPLIT_WITH_BIAS:
                entries.append((sub, ("weight", "bias")))
            elif style in SPLIT_WEIGHT:
                entries.append((sub, ("weight",)))
        return {plan.layers: entries}

    def _place(self, path: str, block: nn.Module, weights: Weights, deferred: set[str]) -> None:
        """Read ``block``'s parameters in place, except those in ``deferred`` (left on ``meta`` with a reader)."""
        import torch

        from hftrain.parallel.deferred import defer

        for name, param in block.named_parameters():
            if not param.is_meta:  # tied to a parameter read already
                continue
            entry = weights.find(f"{path}.{name}", tuple(param.shape))
            assert entry is not None, f"{path}.{name}: blocks_in chose a block whose tensor is not stored"
            read = _reader(weights, entry, param.dtype)
            if name in deferred:
                defer(param, read)
                self.deferred += 1
                continue
            host = torch.nn.Parameter(read(None), requires_grad=param.requires_grad)
            host.__dict__.update(param.__dict__)  # swap_tensors swaps the attributes too: keep the parameter's own
            torch.utils.swap_tensors(param, host)

    def describe(self, count: int) -> str:
        stages = f"of this rank's pipeline stages (the other stages' are never read; pp={self.pp}) " * (self.pp > 1)
        if self.tp == 1:
            return (
                f"{count} transformer blocks {stages}read from the safetensors files into this process's memory "
                f"({self.name})"
            )
        whole = f"; {self.whole} of them whole (not layers of the tensor-parallel plan)" * bool(self.whole)
        return (
            f"{count} transformer blocks {stages}loaded for tp={self.tp}: their {self.deferred} split tensors stay on "
            "meta until prepare splits them, each then reading this rank's slice only (output rows by byte range; a "
            f"row-parallel weight whole, then sliced), the rest read whole here{whole} ({self.name})"
        )


def _reader(weights: Weights, entry: Entry, dtype: torch.dtype) -> Any:
    """``read(split)``: ``split.local`` of ``entry``'s tensor as ``dtype`` (``split`` None: the whole tensor)."""
    import torch

    def read(split: Split | None) -> torch.Tensor:
        if split is None or split.dim != 0:
            whole = torch.empty(entry.shape, dtype=dtype)
            weights.read_into(entry, whole)
            return whole if split is None else split.local(whole)
        local = torch.empty(split.local_shape(), dtype=dtype)
        if split.padded is not None:  # the padding rows are zero, as split.local pads
            local.zero_()
        row = entry.numel // entry.shape[0] * torch.empty((), dtype=entry.dtype).element_size()
        for offsets, view in split.boxes(local):  # contiguous rows of the file into contiguous rows of the shard
            rows = (view.shape[0], *entry.shape[1:])
            weights.read_into(dataclasses.replace(entry, shape=rows, offset=entry.offset + offsets[0] * row), view)
        return local

    return read
