"""A mixture of experts' router statistics and auxiliary loss, with or without expert parallelism.

**Auxiliary loss.** transformers' ``*ForSequenceClassification`` heads of these families return the
cross-entropy only; :func:`load_balancing_loss` is the family's ``load_balancing_loss_func`` (Switch Transformer's
``E · Σ_i f_i · P_i``, padding excluded by the attention mask), with ``f`` and ``P`` summed over the examples' data
parallel group, so that the loss of the global batch is the unsplit model's (:class:`RouterMonitor` collects the
router logits and the per-expert token counts). Under context parallelism a rank's routers see its positions of every
sequence: the same sums, cut by its positions of the mask, are all-reduced over dp × cp. hftrain writes its own
exchange because torch has no dropless MoE dispatch (``torch.distributed`` gives the all-to-all; torchtitan's and
Megatron's dispatchers are their own code).

Pipeline stages carry the loss's sums from stage to stage (:class:`StageRouting`, a ``ChunkExtra`` of
``hftrain.parallel.chunk``). The expert layer and its exchange are ``hftrain.parallel.expert_parallel``'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.errors import ConfigError
from hftrain.parallel.chunk import ChunkExtra
from hftrain.parallel.collectives import all_reduce_both_ways
from hftrain.parallel.families import expert_plan_for
from hftrain.parallel.plans import ExpertPlan


def moe_blocks(model: nn.Module, plan: ExpertPlan) -> Iterator[nn.Module]:
    """The sparse MoE blocks of ``model`` in layer order (dense layers, e.g. Qwen2-MoE's ``mlp_only_layers``,
    skipped)."""
    layers = model.get_submodule(plan.layers)
    for index in moe_layer_indices(model, plan):
        yield getattr(layers[index], plan.block)


def moe_layer_indices(model: nn.Module, plan: ExpertPlan) -> list[int]:
    """The indices of ``model``'s layers whose block is a sparse MoE block (it has experts and a router)."""
    found = []
    for index, layer in enumerate(model.get_submodule(plan.layers)):
        block = getattr(layer, plan.block, None)
        if block is not None and hasattr(block, plan.experts) and hasattr(block, plan.router):
            found.append(index)
    return found


# ----------------------------------------------------------------- router statistics and the auxiliary loss
class RouterMonitor:
    """Collects every MoE layer's router logits and top-k experts of the current forward, with forward hooks on the
    routers: the auxiliary loss, and the real tokens routed to each expert (the load-balance log and picture).

    Only forwards of the whole model are recorded (a pre-hook and a hook on the model open and close the window),
    so the routers' re-runs under activation recomputation, in the backward pass, are not counted twice.

    Args:
        model: an HF MoE model (split or not; wrappers allowed).
    """

    def __init__(self, model: nn.Module) -> None:
        from hftrain.parallel.lora import hf_model_of

        hf = hf_model_of(getattr(model, "module", model))
        self.plan = expert_plan_for(hf.config)
        if self.plan is None:
            raise ConfigError(f"{hf.config.model_type} is not a mixture-of-experts family hftrain routes")
        self.num_experts = getattr(hf.config, self.plan.num_experts)
        self.top_k = getattr(hf.config, self.plan.top_k)
        self.coefficient = float(getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.hf = hf  # its ``context_split`` under context parallelism: the routers see that rank's positions
        routers = [getattr(block, self.plan.router) for block in moe_blocks(hf, self.plan)]
        self.counts = torch.zeros(len(routers), self.num_experts, dtype=torch.float64)  # since the last take
        self.logits: list[torch.Tensor] = []
        self.selected: list[torch.Tensor] = []  # the top-k experts of each token, per layer
        self._open = False
        hf.register_forward_pre_hook(self._begin)
        hf.register_forward_hook(self._end)
        for router in routers:  # in layer order, as they run
            router.register_forward_hook(self._record)

    def _begin(self, *_: Any) -> None:
        self._open, self.logits, self.selected = True, [], []

    def _end(self, *_: Any) -> None:
        self._open = False

    def _record(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._open:
            logits, _weights, indices = output
            self.logits.append(logits)
            self.selected.append(indices.detach())

    def take_counts(self) -> torch.Tensor:
        """Tokens routed to each expert (layers × experts) on this rank since the last call, on the routers' device;
        resets them."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def aux_loss(self, attention_mask: torch.Tensor | None, group: Any = None) -> torch.Tensor:
        """``router_aux_loss_coef ×`` :func:`load_balancing_loss` of the last forward's router logits; its real
        (unpadded) tokens are added to the per-expert counts.

        Under context parallelism (the model's ``context_split``) the routers ran on this rank's positions of every
        sequence: the mask is cut to the same positions, and ``group`` (the examples' ranks, dp × cp) sums the
        ``f``/``P`` sums over the sequence's shards as over the batch's, so every cp rank computes the whole ``L``.

        Args:
            attention_mask: the batch's mask ``[b, S]`` (padding excluded), or None.
            group: the ranks the global batch's tokens are split over (dp × cp; None: this rank's batch is all of it).
        """
        split = getattr(self.hf, "context_split", None)
        if split is not None and attention_mask is not None:
            attention_mask = split.local(attention_mask)  # [b, S/cp]: the rows of this rank's router logits
        self.counts = count_routed(self.counts, list(enumerate(self.selected)), attention_mask, self.top_k)
        loss = load_balancing_loss(
            self.logits, num_experts=self.num_experts, top_k=self.top_k, attention_mask=attention_mask, group=group
        )
        self.logits, self.selected = [], []
        return self.coefficient * loss


@torch.no_grad()
def count_routed(
    counts: torch.Tensor, routed: list[tuple[int, torch.Tensor]], attention_mask: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """``counts`` (MoE layers × experts, moved to the routers' device: no host sync in the step) plus the real tokens
    each ``(layer, top-k expert indices [tokens × k])`` routed to each expert, padding weighted 0 by the mask."""
    if not routed:
        return counts
    selected = routed[0][1]
    counts = counts.to(selected.device)
    real = torch.ones(selected.shape[0], dtype=torch.float64, device=selected.device)
    if attention_mask is not None:  # the same tokens reach every MoE layer: one weight per assignment
        real = attention_mask.reshape(-1).to(selected.device, torch.float64)
    weights = real.repeat_interleave(top_k)
    for layer, indices in routed:
        counts[layer].scatter_add_(0, indices.reshape(-1), weights)
    return counts


@dataclass(frozen=True)
class RoutingSums:
    """The sums behind the load-balancing loss over some layers' (real) tokens: ``counted[i]``, the top-k
    assignments to expert ``i``; ``probability[i]``, its router probabilities (differentiable); ``rows``, the tokens
    counted (one per layer and real token). Sums over layers, micro-batch shards or pipeline stages add up."""

    counted: torch.Tensor
    probability: torch.Tensor
    rows: torch.Tensor

    @staticmethod
    def zeros(num_experts: int, device: Any = None) -> RoutingSums:
        """Nothing counted yet."""
        zeros = torch.zeros(num_experts, dtype=torch.float32, device=device)
        return RoutingSums(zeros, zeros.clone(), torch.zeros(1, dtype=torch.float32, device=device))

    def __add__(self, other: RoutingSums) -> RoutingSums:
        return RoutingSums(self.counted + other.counted, self.probability + other.probability, self.rows + other.rows)

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(counted, probability, rows)``: what a pipeline chunk passes on with its activations."""
        return self.counted, self.probability, self.rows


def routing_sums(
    router_logits: list[torch.Tensor], *, num_experts: int, top_k: int, attention_mask: torch.Tensor | None = None
) -> RoutingSums:
    """:class:`RoutingSums` of one forward's router logits (one ``tokens × E`` tensor per MoE layer), padding excluded
    by ``attention_mask`` (``batch × sequence``: tokens are its flattened positions), as transformers'
    ``load_balancing_loss_func`` counts them."""
    device = router_logits[0].device if router_logits else None
    sums = RoutingSums.zeros(num_experts, device)
    counted, probability, rows = sums.counted, sums.probability, sums.rows
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    for logits in router_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            counted = counted + torch.bincount(selected.reshape(-1), minlength=num_experts).float()
            probability = probability + weights.float().sum(0)
            rows = rows + weights.shape[0]
        else:
            routed = torch.zeros(num_experts, dtype=torch.float32, device=device)
            counted = counted + routed.scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(top_k))
            probability = probability + (weights.float() * mask[:, None]).sum(0)
            rows = rows + mask.sum()
    return RoutingSums(counted, probability, rows)


def balancing_loss(sums: RoutingSums, *, num_experts: int, group: Any = None) -> torch.Tensor:
    """``L = E · Σ_i f_i · P_i`` from the sums (``f = counted / rows``, ``P = probability / rows``), the sums first
    all-reduced over ``group`` (``probability`` both ways, so each rank's routers get the gradient of the global
    loss: :func:`~hftrain.parallel.collectives.all_reduce_both_ways`).

    Args:
        sums: the sums over this rank's tokens (and, in a pipeline, over every stage's layers).
        num_experts: ``E``.
        group: the examples' data-parallel group, or None.
    """
    counted, probability, rows = sums.counted, sums.probability, sums.rows.reshape(())
    if group is not None and dist.get_world_size(group) > 1:
        totals = torch.cat([counted, rows.reshape(1)]).detach()
        dist.all_reduce(totals, group=group)
        counted, rows = totals[:-1], totals[-1]
        probability = all_reduce_both_ways(probability, group)
    return num_experts * torch.sum((counted / rows) * (probability / rows))


def load_balancing_loss(
    router_logits: list[torch.Tensor],
    *,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    group: Any = None,
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE) over the global batch of ``group``.

    ``L = E · Σ_i f_i · P_i`` with ``f_i`` the fraction of (real) token assignments routed to expert ``i`` (top-k of
    the softmax, summed over layers) and ``P_i`` its mean router probability, both over every layer's tokens
    (:func:`routing_sums`, then :func:`balancing_loss` over ``group``).

    Args:
        router_logits: one ``(tokens × E)`` tensor per MoE layer, from this rank's batch.
        num_experts: ``E``.
        top_k: ``k``.
        attention_mask: ``batch × sequence`` (tokens = its flattened positions), or None.
        group: the examples' data-parallel group, or None.
    """
    if not router_logits:
        return torch.zeros((), device=attention_mask.device if attention_mask is not None else None)
    sums = routing_sums(router_logits, num_experts=num_experts, top_k=top_k, attention_mask=attention_mask)
    return balancing_loss(sums, num_experts=num_experts, group=group)


class StageRouting(ChunkExtra):
    """A pipeline chunk's share of the load-balancing loss, which spans every MoE layer (so every stage).

    ``L = E · Σ_i (C_i / R) · (P_i / R)`` is bilinear in sums over layers (:class:`RoutingSums`): each chunk adds its
    own layers' sums to the ones it received and passes them on with its activations, ``(…, C, P, R)``; the last
    chunk computes ``L`` from the totals (over the examples' dp group, :func:`balancing_loss`). ``P`` travels as an
    activation, so its gradient ``∂L/∂P = E · C / R²`` flows back through the pipeline's own backward to every
    stage's routers, exact without another pass. Per micro-batch: the pipeline's loss is the one gradient
    accumulation over its micro-batches gives (Megatron, too, balances each micro-batch).

    Args:
        layers: the chunk's layers by layer index (their MoE blocks' routers are recorded while :meth:`recording`).
        moe_layers: the indices of the model's MoE layers (dense ones, e.g. Qwen2-MoE's ``mlp_only_layers``, left
            out), in order: the rows of :attr:`counts`.
        plan: the family's expert plan.
        config: the model's config (``E``, ``k``, ``router_aux_loss_coef``).
        group: the examples' data-parallel group (None: this rank's micro-batch is all of it).
    """

    name = "routing"
    width = 3
    """Tensors it adds to the activation tuple."""

    def __init__(
        self, layers: dict[int, nn.Module], moe_layers: list[int], plan: ExpertPlan, config: Any, group: Any = None
    ) -> None:
        self.num_experts = getattr(config, plan.num_experts)
        self.top_k = getattr(config, plan.top_k)
        self.coefficient = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        self.group = group
        self.logits: list[torch.Tensor] = []
        self._recorded: list[int] = []  # the MoE index (among the model's MoE layers) of each recorded logits
        self._open = False
        self.aux_loss: torch.Tensor | None = None  # the last chunk's, of the micro-batch that just ran
        self.counting = False  # a training micro-batch runs (not torch's shape inference): count its tokens
        self.real = False  # a real micro-batch runs (training or evaluation), not torch's shape inference
        # The chunk's expert-parallel experts (``ExpertParallelExperts.exchanging``): they exchange tokens only in a
        # real micro-batch, so that every rank of an ep group runs the same all-to-alls (docs/expert-parallelism.md,
        # "Expert parallelism with pipeline parallelism").
        self.experts = [m for layer in layers.values() for m in layer.modules() if hasattr(m, "exchanging")]
        for experts in self.experts:
            experts.exchanging = False
        # real tokens routed to each expert, per MoE layer of the whole model (this chunk's rows), since last taken
        self.counts = torch.zeros(len(moe_layers), self.num_experts, dtype=torch.float64)
        for index, layer in layers.items():
            if index in moe_layers:
                router = getattr(getattr(layer, plan.block), plan.router)
                router.register_forward_hook(functools.partial(self._record, moe_layers.index(index)))

    def _record(self, moe_index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._open:  # not the re-runs of activation recomputation in the backward pass
            self.logits.append(output[0])
            self._recorded.append(moe_index)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the routers' logits of the chunk's forward."""
        self._open, self.logits = True, []
        try:
            yield
        finally:
            self._open = False

    def add(self, received: tuple[torch.Tensor, ...] | None, attention_mask: torch.Tensor | None, device) -> tuple:
        """The sums received (None: the first chunk) plus this chunk's recorded layers', as a tuple to pass on."""
        sums = RoutingSums.zeros(self.num_experts, device) if received is None else RoutingSums(*received)
        if self.logits:
            sums = sums + routing_sums(
                self.logits, num_experts=self.num_experts, top_k=self.top_k, attention_mask=attention_mask
            )
            if self.counting:
                selected = [logits.detach().topk(self.top_k, dim=-1).indices for logits in self.logits]
                routed = list(zip(self._recorded, selected, strict=True))
                self.counts = count_routed(self.counts, routed, attention_mask, self.top_k)
        self.logits, self._recorded = [], []
        return sums.as_tuple()

    @contextlib.contextmanager
    def microbatch(self) -> Iterator[None]:
        """A real micro-batch: its experts exchange tokens over ep, its router loss is reduced over the examples' dp
        group, and in training it counts its tokens per expert (:attr:`counts`). Outside (torch's shape inference,
        which each rank runs when its own batch's shape is new) nothing runs a collective."""
        self.counting, self.real = torch.is_grad_enabled(), True
        for experts in self.experts:
            experts.exchanging = True
        try:
            yield
        finally:
            self.counting = self.real = False
            for experts in self.experts:
                experts.exchanging = False

    def layers(self):  # the chunk's hooks (hftrain.parallel.chunk.ChunkExtra)
        return self.recording()

    def carry(self, received: tuple[torch.Tensor, ...] | None, attention_mask: torch.Tensor | None, device) -> tuple:
        return self.add(received, attention_mask, device)

    def take_counts(self) -> torch.Tensor:
        """Tokens routed to each expert (MoE layers × experts, this chunk's rows) since the last call; resets them."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def finish(self, totals: tuple[torch.Tensor, ...]) -> None:
        """The last chunk: ``router_aux_loss_coef × L`` of the micro-batch, kept for its loss (:meth:`take_loss`)."""
        group = self.group if self.real else None  # shape inference: this rank alone (see microbatch)
        loss = balancing_loss(RoutingSums(*totals), num_experts=self.num_experts, group=group)
        self.aux_loss = self.coefficient * loss

    def take_loss(self) -> torch.Tensor | None:
        """The last micro-batch's auxiliary loss (None before any); cleared."""
        loss, self.aux_loss = self.aux_loss, None
        return loss
