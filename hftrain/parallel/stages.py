"""The pipeline's shared trunk pieces and its chunk: what every family's trunk adapter and task head build on.

A family's *trunk* adapter (its embedding, layers and final norm: ``EncoderStages`` in
``hftrain.parallel.families.bert``, ``DecoderStages`` in ``...families.llama``, one beside each family) and a task's
*head* (:class:`~hftrain.parallel.heads.StageHead`: what the first chunk reads, what travels beside the hidden states
and what the last chunk returns; ``hftrain.parallel.heads``) are joined by :class:`ModelStages`, and
:class:`PipelineChunk` runs them without knowing the task. Here live only the pieces they share: the layer types,
the position ids, and the decoders' common trunk (:class:`CausalTrunk`).

The adapters call the HF modules themselves and rebuild attention masks with transformers' own
``create_causal_mask``/``create_bidirectional_mask`` from the carried 2-D mask, so a chain of chunks computes
exactly what the unsharded model does. See :mod:`hftrain.parallel.pipeline` for the activation tuple.
"""

from __future__ import annotations

from typing import Any

import torch

from hftrain.parallel.heads import StageHead

Modules = dict[str, torch.nn.Module]
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types

__all__ = ["FULL", "SLIDING", "CausalTrunk", "ModelStages", "Modules", "PipelineChunk", "StageHead", "positions_of"]


def positions_of(hidden: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, s]`` position ids, as GPT-2 and Llama build them without a cache (or a context-parallel shard's own
    global positions); ``[b, s]`` ones (a causal LM's, restarting at every packed document) as given."""
    if positions is not None:  # [b, s]: a causal LM's packed documents' own positions
        return positions if positions.dim() == 2 else positions.unsqueeze(0)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class CausalTrunk:
    """Shared by the decoders' trunks: positions by index; a causal LM's head
    (:class:`~hftrain.parallel.heads.CausalLMHead`) can follow (``causal``: the ``causal_lm`` head kind's need)."""

    causal = True

    def position_ids(self, mods: Any, input_ids: torch.Tensor) -> None:
        """None: the decoders number positions by their index."""
        return None


class ModelStages:
    """A model's pipeline adapter: its family's trunk and its task's head (:class:`~hftrain.parallel.heads.StageHead`).

    The trunk holds the family's embedding, layers, final norm and parameter-free helpers; the head its task's modules.
    The last chunk holds the trunk's norm and the head's modules.

    Args:
        trunk: the family's trunk adapter (``hftrain.parallel.families``' ``stages``).
        head: the task's head.
    """

    def __init__(self, trunk: Any, head: StageHead) -> None:
        self.trunk, self.head = trunk, head

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The trunk's layers, in order."""
        return self.trunk.layers(model)

    def embed_modules(self, model: torch.nn.Module) -> Modules:
        """The first chunk's embedding modules."""
        return self.trunk.embed_modules(model)

    def head_modules(self, model: torch.nn.Module) -> Modules:
        """The last chunk's modules: the trunk's final norm (as ``"norm"``), then the head's."""
        return {**self.trunk.norm_modules(model), **self.head.modules(model)}

    def aux_modules(self, model: torch.nn.Module) -> Modules:
        """The trunk's helpers every chunk needs."""
        return self.trunk.aux_modules(model)


from hftrain.parallel.chunk import PipelineChunk  # noqa: E402, F401
