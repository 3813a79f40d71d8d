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

import contextlib
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


class PipelineChunk(torch.nn.Module):
    """One pipeline chunk: optional embedding, a run of HF layers, optional final norm and task head.

    It moves the activation tuple ``(hidden, trunk_input, *carries)`` on without opening it: what the first chunk
    reads, what travels beside the hidden states and what the last chunk computes are the task head's
    (:class:`StageHead`); the layers are the family trunk's.

    Args:
        stages: the model's adapter (:class:`ModelStages`: the family's trunk and the task's head).
        config: the HF model config (mask creation reads it).
        embed: the embedding modules (first chunk only), by short name.
        layers: the HF layers of this chunk, by their layer index.
        head: the final norm and the head's modules (last chunk only), by short name.
        aux: parameter-free helpers every chunk needs (e.g. Llama's rotary embedding).
    """

    def __init__(
        self,
        stages: ModelStages,
        config: Any,
        *,
        embed: Modules | None,
        layers: Modules,
        head: Modules | None,
        aux: Modules,
    ) -> None:
        super().__init__()
        self.stages = stages
        self.config = config
        self.embed = torch.nn.ModuleDict(embed) if embed is not None else None
        self.layers = torch.nn.ModuleDict(layers)
        self.head = torch.nn.ModuleDict(head) if head is not None else None
        self.aux = torch.nn.ModuleDict(aux)
        self._hf_names: dict[str, str] = {}
        self.index: int | None = None  # global stage index, set by build_stage_modules
        # context parallelism (hftrain.parallel.context_parallel.ContextSplit): this rank's part of each sequence
        self.context_split: Any = None
        # a mixture of experts (hftrain.parallel.expert_parallel.StageRouting): the router loss's sums, passed on
        self.routing: Any = None

    @contextlib.contextmanager
    def microbatch(self):
        """A real micro-batch's forward (the schedule's stage enters it; torch's shape inference on placeholder
        tensors does not): a mixture of experts' chunk counts its tokens per expert then, in training."""
        if self.routing is None:
            yield
            return
        self.routing.counting = torch.is_grad_enabled()
        try:
            yield
        finally:
            self.routing.counting = False

    @property
    def is_first(self) -> bool:
        """Whether this chunk embeds (takes the batch's columns instead of activations)."""
        return self.embed is not None

    @property
    def task_head(self) -> StageHead:
        """The task's head (:class:`StageHead`)."""
        return self.stages.head

    def first_args(self, inputs: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """The first chunk's positional inputs, the batch's columns the task head names (:meth:`StageHead.first_args`).

        Args:
            inputs: the batch.
        """
        return self.task_head.first_args(inputs or {})

    @property
    def is_last(self) -> bool:
        """Whether this chunk ends in the task head (returns its output)."""
        return self.head is not None

    def attach_hf_names(self, hf_names: dict[int, str]) -> None:
        """Record the HF name of each parameter.

        Args:
            hf_names: ``{id(p): name for name, p in model.named_parameters()}``.
        """
        self._hf_names = {name: hf_names[id(p)] for name, p in self.named_parameters()}

    def hf_name(self, name: str) -> str:
        """The HF model's name of this chunk's parameter ``name``.

        Args:
            name: a name from this chunk's ``named_parameters()``.
        """
        return self._hf_names[name]

    def hf_named_parameters(self):
        """``(hf_name, parameter)`` pairs of this chunk, in ``named_parameters()`` order."""
        for name, param in self.named_parameters():
            yield self._hf_names[name], param

    def forward(self, *acts: torch.Tensor) -> Any:
        """First chunk: the batch columns the task head names (:meth:`first_args`); others: the activation tuple
        ``(hidden, trunk_input, *carries)``.

        Returns the next activation tuple, or the last chunk's output: the head's on the trunk's final-normed hidden
        states (a classifier's logits ``[b, num_labels]``, a causal LM's ``[b, s, vocabulary]``). A mixture of
        experts' chunk adds its layers' router-loss sums to the ones it received, at the tuple's end (``routing``);
        the last chunk turns them into the micro-batch's router loss.
        """
        trunk, task = self.stages.trunk, self.stages.head
        split, routing = self.context_split, self.routing
        received = None
        if routing is not None and not self.is_first:
            acts, received = acts[: -routing.width], acts[-routing.width :]
        if self.is_first:
            acts = task.embed(trunk, self.embed, self.config, *acts, split=split)
        hidden, carried = acts[0], acts[1:]  # carried[0]: the attention mask, or a packed block's position ids
        if len(self.layers):
            if task.packed:
                context = trunk.layer_context(self.aux, self.config, hidden, None, carried[0])
            else:
                positions = None if split is None else split.attend(carried[0])
                context = trunk.layer_context(self.aux, self.config, hidden, carried[0], positions)
            with contextlib.nullcontext() if routing is None else routing.recording():
                for index, layer in self.layers.items():
                    hidden = trunk.run_layer(layer, hidden, context, int(index))
        elif split is not None and not task.packed:
            split.attend(carried[0])
        routed = ()
        if routing is not None:  # padding excluded by the mask (a packed block has none)
            routed = routing.add(received, None if task.packed else carried[0], hidden.device)
        if self.is_last:
            if routing is not None and torch.is_grad_enabled():  # training: its loss takes the router loss
                routing.finish(routed)
            if "norm" in self.head:  # the trunk's final norm
                hidden = self.head["norm"](hidden)
            return task.forward(self.head, hidden, *carried, reduce=None if split is None else split.sum)
        return (hidden, *carried, *routed)
