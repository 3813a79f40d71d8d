"""One pipeline chunk (:class:`PipelineChunk`) and the extras a parallel axis registers on it (:class:`ChunkExtra`).

Moved out of ``hftrain.parallel.stages`` (which re-exports :class:`PipelineChunk`): the trunks and heads stay there.
A chunk runs an embedding, a run of HF layers and a head; an axis that needs more of it (context parallelism's
split of every sequence, a mixture of experts' router-loss sums carried from stage to stage) registers an extra,
whose hooks the chunk calls in order: :meth:`ChunkExtra.microbatch` around a real micro-batch, :meth:`ChunkExtra.layers`
around the layers, :meth:`ChunkExtra.carry` for the tensors it appends to the activation tuple (``width`` of them),
:meth:`ChunkExtra.finish` on the last chunk in training. The one extra that splits sequences
(``splits_sequence``) is what the task head embeds and reduces through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class ChunkExtra:
    """What a parallel axis adds to every pipeline chunk: no-op hooks, overridden by the extras.

    Attributes:
        name: the extra's name (one per chunk).
        width: how many tensors it appends to the activation tuple between stages.
        splits_sequence: whether it splits every sequence over ranks (the task head's ``split``: its ``attend``,
            ``local`` and ``sum``).
    """

    name = "extra"
    width = 0
    splits_sequence = False

    @contextlib.contextmanager
    def microbatch(self) -> Iterator[None]:
        """Around one real micro-batch's forward (not torch's shape inference on placeholders)."""
        yield

    @contextlib.contextmanager
    def layers(self) -> Iterator[None]:
        """Around the chunk's layers."""
        yield

    def carry(
        self, received: tuple[torch.Tensor, ...] | None, attention_mask: torch.Tensor | None, device: Any
    ) -> tuple[torch.Tensor, ...]:
        """The ``width`` tensors to pass on, from those received (None on the first chunk)."""
        return ()

    def finish(self, carried: tuple[torch.Tensor, ...]) -> None:
        """The last chunk, in training: what was carried through every stage."""


class PipelineChunk(torch.nn.Module):
    """One pipeline chunk: optional embedding, a run of HF layers, optional final norm and task head.

    It moves the activation tuple ``(hidden, trunk_input, *carries, *extras' tensors)`` on without opening it: what
    the first chunk reads, what travels beside the hidden states and what the last chunk computes are the task head's
    (``hftrain.parallel.stages.StageHead``); the layers are the family trunk's; what a parallel axis adds (context
    parallelism's split of every sequence, a mixture of experts' router-loss sums) are registered extras
    (:class:`ChunkExtra`), which the chunk calls without knowing them.

    Args:
        stages: the model's adapter (``hftrain.parallel.stages.ModelStages``: the family's trunk and the task's head).
        config: the HF model config (mask creation reads it).
        embed: the embedding modules (first chunk only), by short name.
        layers: the HF layers of this chunk, by their layer index.
        head: the final norm and the head's modules (last chunk only), by short name.
        aux: parameter-free helpers every chunk needs (e.g. Llama's rotary embedding).
    """

    def __init__(
        self,
        stages: Any,
        config: Any,
        *,
        embed: dict[str, torch.nn.Module] | None,
        layers: dict[str, torch.nn.Module],
        head: dict[str, torch.nn.Module] | None,
        aux: dict[str, torch.nn.Module],
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
        self.extras: list[ChunkExtra] = []  # registered extras (:meth:`register`), in the order they carry

    def register(self, extra: ChunkExtra) -> None:
        """Add an extra (:class:`ChunkExtra`) to this chunk, replacing one of the same :attr:`ChunkExtra.name`.

        Args:
            extra: e.g. context parallelism's ``ContextSplit``, a mixture of experts' ``StageRouting``.
        """
        self.extras = [e for e in self.extras if e.name != extra.name] + [extra]

    def extra(self, name: str) -> Any:
        """The registered extra named ``name``, or None."""
        return next((e for e in self.extras if e.name == name), None)

    def _set_extra(self, name: str, extra: ChunkExtra | None) -> None:
        if extra is None:
            self.extras = [e for e in self.extras if e.name != name]
        else:
            self.register(extra)

    # Compatibility: ``chunk.context_split = ...`` and ``chunk.routing = ...`` register (or drop) those extras.
    context_split = property(
        lambda self: self.extra("context_split"), lambda self, e: self._set_extra("context_split", e)
    )
    routing = property(lambda self: self.extra("routing"), lambda self, e: self._set_extra("routing", e))

    @property
    def sequence_split(self) -> Any:
        """The extra that splits every sequence over ranks (:attr:`ChunkExtra.splits_sequence`), or None: the task
        head embeds and reduces through it."""
        return next((e for e in self.extras if e.splits_sequence), None)

    @contextlib.contextmanager
    def microbatch(self):
        """A real micro-batch's forward (the schedule's stage enters it; torch's shape inference on placeholder
        tensors does not): every extra's :meth:`ChunkExtra.microbatch` (a mixture of experts' chunk counts its tokens
        per expert then, in training)."""
        with contextlib.ExitStack() as stack:
            for extra in self.extras:
                stack.enter_context(extra.microbatch())
            yield

    @property
    def is_first(self) -> bool:
        """Whether this chunk embeds (takes the batch's columns instead of activations)."""
        return self.embed is not None

    @property
    def task_head(self) -> Any:
        """The task's head (``StageHead``)."""
        return self.stages.head

    def first_args(self, inputs: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, ...]:
        """The first chunk's positional inputs, the batch's columns the task head names (``StageHead.first_args``).

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
        experts' chunk adds its layers' router-loss sums to the ones it received, at the tuple's end (each extra's
        :meth:`ChunkExtra.carry`); the last chunk turns them into the micro-batch's router loss
        (:meth:`ChunkExtra.finish`).
        """
        trunk, task = self.stages.trunk, self.stages.head
        split = self.sequence_split
        received: dict[int, tuple[torch.Tensor, ...]] = {}
        if not self.is_first:  # each extra's tensors at the tuple's end, in registration order
            for index in reversed(range(len(self.extras))):
                width = self.extras[index].width
                if width:
                    acts, received[index] = acts[:-width], acts[-width:]
        if self.is_first:
            acts = task.embed(trunk, self.embed, self.config, *acts, split=split)
        hidden, carried = acts[0], acts[1:]  # carried[0]: the attention mask, or a packed block's position ids
        if len(self.layers):
            if task.packed:  # carried[0]: the position ids (whole sequences' under a split: the documents)
                positions = carried[0] if split is None else split.attend_packed(carried[0])
                context = trunk.layer_context(self.aux, self.config, hidden, None, positions)
            else:
                positions = None if split is None else split.attend(carried[0])
                context = trunk.layer_context(self.aux, self.config, hidden, carried[0], positions)
            with contextlib.ExitStack() as stack:
                for extra in self.extras:
                    stack.enter_context(extra.layers())
                for index, layer in self.layers.items():
                    hidden = trunk.run_layer(layer, hidden, context, int(index))
        elif split is not None and not task.packed:
            split.attend(carried[0])
        mask = None if task.packed else carried[0]  # padding excluded by the mask (a packed block has none)
        passed = [extra.carry(received.get(i), mask, hidden.device) for i, extra in enumerate(self.extras)]
        if self.is_last:
            if torch.is_grad_enabled():  # training: its loss takes what the extras carried (the router loss)
                for extra, tensors in zip(self.extras, passed, strict=True):
                    extra.finish(tensors)
            if "norm" in self.head:  # the trunk's final norm
                hidden = self.head["norm"](hidden)
            return task.forward(self.head, hidden, *carried, reduce=None if split is None else split.sum)
        return (hidden, *carried, *(t for tensors in passed for t in tensors))
