"""Expert parallelism for HF mixture-of-experts classifiers (Mixtral, Qwen2-MoE): experts split over ``ep`` ranks.

An MoE layer of ``E`` experts with top-``k`` routing, on a rank holding the ``T`` tokens of its own examples::

    router (replicated)   l = x W_rᵀ  (T × E);  p = softmax(l);  (w, e) = top-k(p)   (normalised as the family does)
    experts               y_t = Σ_j w_tj · FFN_{e_tj}(x_t),  FFN_i(x) = W_down,i (act(W_gate,i x) ⊙ W_up,i x)

With expert parallelism the ``ep`` ranks of an ``ep`` group (consecutive data-parallel ranks, ``ParallelDims``) each
hold ``E / ep`` consecutive experts, ``[r·E/ep, (r+1)·E/ep)`` on ep rank ``r``, and see different examples:

1. **dispatch**: this rank's ``T·k`` (token, expert) assignments, sorted by expert (stable: token order within an
   expert), are sent to the ranks holding their experts: the per-expert counts first (``all_to_all_single``, ``E/ep``
   integers per rank pair), then the hidden rows (``all_to_all_single`` with those uneven splits);
2. **experts**: every received row goes through its expert, one matmul pair per local expert over all its rows;
3. **combine**: the outputs go back by the inverse exchange, are weighted by ``w`` on the rank that owns the token
   and summed into its output row (``index_add`` in expert order, as transformers' own loop adds them).

The backward of each exchange is the inverse exchange of the gradient (``hftrain.parallel.collectives``). Bytes on
the wire per layer and rank, each way: ``T·k·h·(ep−1)/ep`` elements on average (dispatch and combine, forward and
backward: 4 exchanges). Dropless by default (every assignment reaches its expert, so the layer equals the unsplit
one); with ``capacity_factor`` each rank sends at most ``⌈factor·T·k/E⌉`` rows to each expert (the first by token
order), drops the rest (those assignments add nothing; the token keeps its residual) and counts them.

**Host reads.** A layer's routing depends on the previous layer's output, so the sizes of all layers cannot be
read together once per step: a forward pass must know layer ``N``'s split sizes before layer ``N+1`` routes. Two
exchanges, then:

- *exact sizes* (dropless, the default): the all-to-all's split sizes and the per-expert matmuls' row counts are
  host ints, read once per layer (forward and backward together) in one ``tolist`` of the rows sent and received
  per expert; ``repeat_interleave`` is given its output size. Bytes and FLOPs are the routed rows' only. This is
  what Megatron-core's dropless ``MoEAlltoAllTokenDispatcher`` does (its ``cuda_sync_point`` only moves the same
  per-layer read earlier) and torchtitan's EP (``input_splits`` copied to the host and the stream synchronised in
  its token dispatch), because torch's all-to-all and a CPU/generic grouped GEMM take host sizes;
- *fixed slots* (with a capacity factor: Megatron's drop-and-pad, ``moe_pad_expert_input_to_capacity``; or
  ``padded=True``): each expert takes ``S`` slots from each source rank, so every split size is known on the host
  before the step and **nothing is read**: ``S = ⌈f·T_max·k/E⌉`` (at most ``T_max``), ``T_max`` the most tokens on a
  rank of the ep group, agreed over its host twin (``parallel.host.all_max``: host ints, no device wait). Each
  source still keeps the first ``c = ⌈f·T·k/E⌉`` assignments of an expert by token order, exactly as the exact
  path keeps them, so the two give the same outputs and gradients (``tests/test_ep_layers.py``). The cost: the
  exchange and the experts' batched matmuls run over all ``E·S`` slots (empty slots are zero rows), ``f·T·k`` rows
  against the routed ``T·k``. A factor ``f ≥ E/k`` gives ``S = T``: no expert can overflow, so it is **dropless,
  exact and without a host read** at ``E/k`` times the expert FLOPs and exchanged bytes
  (``benchmarks/moe.py`` measures both; ``tests/test_ep_syncs.py`` counts ≤ 1 host read per training step, the
  logging window's losses, for two MoE layers under ep = 2). The dropped count is a device sum read when the log
  asks for it (``dropped_assignments``).

The router is replicated (it sees only this rank's tokens) and so are a family's shared experts; the expert weights
keep their HF names and 3-D layout (``experts.gate_up_proj`` ``[E/ep, 2I, h]``, ``experts.down_proj`` ``[E/ep, h,
I]``), each placed along ep (``hftrain.parallel.placement``: a ``Split`` along dimension 0 over the ep group):
checkpoints write the boxes ``[r·E/ep, (r+1)·E/ep)`` of the logical tensors and any ``ep`` reads them back. Their
gradients are summed over the expert-data-parallel group (the dp ranks holding the same experts, their data replicas)
and divided by ``dp`` (``placement.complete_grads``), like the dense gradients' mean over dp: a rank's expert
gradient already sums the contributions of the tokens of its whole ep group.

**Auxiliary loss.** transformers' ``*ForSequenceClassification`` heads of these families return the
cross-entropy only; :func:`load_balancing_loss` is the family's ``load_balancing_loss_func`` (Switch Transformer's
``E · Σ_i f_i · P_i``, padding excluded by the attention mask), with ``f`` and ``P`` summed over the examples' data
parallel group, so that the loss of the global batch is the unsplit model's (:class:`RouterMonitor` collects the
router logits and the per-expert token counts). hftrain writes its own exchange because torch has no dropless MoE
dispatch (``torch.distributed`` gives the all-to-all; torchtitan's and Megatron's dispatchers are their own code).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.errors import AxisError, ConfigError
from hftrain.parallel.chunk import ChunkExtra
from hftrain.parallel.collectives import all_reduce_both_ways, all_to_all_rows
from hftrain.parallel.families import expert_plan_for, moe_families
from hftrain.parallel.host import all_max
from hftrain.parallel.placement import Split, place
from hftrain.parallel.plans import ExpertPlan


def check_expert_parallel(config: Any, ep: int, dp: int, capacity_factor: float | None = None) -> None:
    """Refuse an expert-parallel layout the model cannot take, in one line naming the field (no processes needed):
    ``ep`` or a capacity factor on a dense model, ``ep`` not dividing the experts. (``ep`` dividing ``dp`` is
    ``ParallelDims``' rule, a capacity factor > 0 the config schema's.)

    Args:
        config: the model's ``PretrainedConfig``.
        ep: expert-parallel size.
        dp: data-parallel size (the valid ``ep`` values named must divide it too).
        capacity_factor: the per-expert cap's factor (None: dropless).
    """
    plan = expert_plan_for(config)
    if plan is None:
        if ep > 1 or capacity_factor is not None:
            raise AxisError(
                "ep" if ep > 1 else "moe_capacity_factor",
                f"the model ({getattr(config, 'model_type', '?')}) is not a mixture of experts hftrain can "
                f"route ({', '.join(moe_families())}); use ep: 1 and moe_capacity_factor: null for a dense model",
            )
        return
    experts = getattr(config, plan.num_experts)
    if experts % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0 and dp % d == 0]
        raise AxisError(
            "ep",
            f"ep={ep} does not divide the {experts} experts of this {config.model_type} model; "
            f"valid ep values with dp={dp}: {', '.join(map(str, valid))}",
        )


# ----------------------------------------------------------------- the layer
class ExpertParallelExperts(nn.Module):
    """A family's experts module with this rank's ``E / ep`` experts, tokens exchanged over the ep group.

    A drop-in for the HF module: ``forward(hidden_states (T × h), top_k_index (T × k), top_k_weights (T × k))``
    returns ``T × h``; the parameters keep their names (``gate_up_proj``, ``down_proj``), holding experts
    ``[first, first + E/ep)``. See the module docstring for the exchange and its bytes.

    Args:
        experts: the HF experts module (full weights; this rank's slice is copied, the rest freed with it).
        ep_group: the expert-parallel group (None: one rank holds every expert).
        capacity_factor: None for dropless routing, else the per-expert cap's factor.
        padded: exchange in fixed slots, no host read (None: with a capacity factor; module docstring).
    """

    def __init__(
        self,
        experts: nn.Module,
        *,
        ep_group: Any,
        capacity_factor: float | None = None,
        padded: bool | None = None,
    ) -> None:
        super().__init__()
        self.padded = capacity_factor is not None if padded is None else padded
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.num_experts = experts.num_experts
        self.local_experts = self.num_experts // self.ep
        self.first = rank * self.local_experts
        self.act_fn = experts.act_fn
        self.capacity_factor = capacity_factor
        self.dropped = 0  # assignments dropped by the capacity since the counter was last read
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.detach()[self.first : self.first + self.local_experts].clone()
            setattr(self, name, nn.Parameter(local, requires_grad=full.requires_grad))
            place(self, name, axis="ep", split=Split(dim=0, rank=rank, size=self.ep, full_shape=tuple(full.shape)))

    def extra_repr(self) -> str:
        cap = f", capacity_factor={self.capacity_factor}" if self.capacity_factor else ""
        mode = ", padded" if self.padded else ", split sizes read"
        held = f"experts {self.first}..{self.first + self.local_experts - 1} of {self.num_experts}"
        return f"{held}, ep={self.ep}{cap}{mode}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.padded:
            return self._forward_padded(hidden_states, top_k_index, top_k_weights)
        return self._forward_read(hidden_states, top_k_index, top_k_weights)

    def _forward_padded(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The exchange in fixed slots: no host read (module docstring, "Host reads").

        Each expert has ``S`` slots from each source rank (``S = T_max``, dropless, or ``min(T_max, ⌈f·T_max·k/E⌉)``
        with a capacity, ``T_max`` the most tokens on a rank of the ep group, agreed over its host twin). An
        assignment at position ``i`` of its expert's run (sorted by expert, token order within one) goes to slot
        ``expert·S + i``; with a capacity ``c = ⌈f·T·k/E⌉`` (this rank's ``T``, as the read path) the ones with
        ``i ≥ c`` go to a discarded slot. The send buffer ``[E·S, h]`` is ``ep`` equal blocks (rank ``r``'s experts
        are ``[r·E/ep, (r+1)·E/ep)``), so the all-to-all's splits are ``[E/ep·S] × ep``, known on the host; the
        received ``[ep, E/ep, S, h]`` becomes ``[E/ep, ep·S, h]`` and each expert's FFN is one batched matmul over
        its slots (empty slots are zero rows: ``FFN(0) = 0``, and they get no gradient). The outputs go back by the
        inverse exchange into the same slots; each assignment takes its slot's row (a dropped one a zero row).
        """
        tokens, k = top_k_index.shape
        experts, local, ep = self.num_experts, self.local_experts, self.ep
        most = tokens if ep == 1 else int(all_max([tokens], self.ep_group)[0])  # host ints: no device read
        slots = most
        if self.capacity_factor is not None:
            slots = min(most, math.ceil(self.capacity_factor * most * k / experts))
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # assignments by expert, token order within one
        counts = torch.bincount(flat_expert, minlength=experts)
        sorted_expert = flat_expert[order]
        position = torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[sorted_expert]
        slot = sorted_expert * slots + position
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * tokens * k / experts)
            slot = torch.where(position < capacity, slot, experts * slots)  # the discarded slot
            self.dropped = self.dropped + (counts - counts.clamp(max=capacity)).sum()
        token_of = torch.div(order, k, rounding_mode="floor")
        hidden = hidden_states.shape[-1]
        send = hidden_states.new_zeros(experts * slots + 1, hidden).index_copy(0, slot, hidden_states[token_of])
        rows = send[: experts * slots]
        if ep > 1:
            block = [local * slots] * ep
            rows = all_to_all_rows(rows, block, block, self.ep_group)  # [source rank, local expert, slot, h]
        grouped = rows.reshape(ep, local, slots, hidden).transpose(0, 1).reshape(local, ep * slots, hidden)
        gate, up = torch.bmm(grouped, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        outputs = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))
        outputs = outputs.reshape(local, ep, slots, hidden).transpose(0, 1).reshape(ep * local * slots, hidden)
        if ep > 1:
            outputs = all_to_all_rows(outputs, block, block, self.ep_group)  # back to this rank's slots
        outputs = torch.cat([outputs, outputs.new_zeros(1, hidden)])[slot]
        weights = top_k_weights.reshape(-1)[order]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, token_of, (outputs * weights[:, None]).to(final.dtype))

    def _forward_read(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The exchange in the exact split sizes, read on the host once per layer (module docstring)."""
        tokens, k = top_k_index.shape
        experts, local, ep = self.num_experts, self.local_experts, self.ep
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # assignments by expert, token order within one
        counts = torch.bincount(flat_expert, minlength=experts)  # assignments routed to each expert
        if self.capacity_factor is not None:
            order, counts = self._within_capacity(order, counts, tokens * k)
        received_counts = None
        if ep > 1:
            received_counts = torch.empty_like(counts)  # [source rank, local expert] rows this rank receives
            dist.all_to_all_single(received_counts, counts, group=self.ep_group)
        # The split sizes on the host, in one read per layer (the all-to-all and the per-expert matmuls need them):
        # with a capacity, the kept assignments' count comes with them, so the cut below waits for nothing more.
        host = (counts if received_counts is None else torch.stack([counts, received_counts])).tolist()
        sent_host = host if received_counts is None else host[0]
        order = order[: sum(sent_host)]  # with a capacity, the kept assignments come first (_within_capacity)
        token_of = torch.div(order, k, rounding_mode="floor")  # the token of each sorted assignment
        rows = hidden_states[token_of]
        if ep > 1:
            sent_by_rank = [sent_host[r * local : (r + 1) * local] for r in range(ep)]
            received_by_rank = [host[1][r * local : (r + 1) * local] for r in range(ep)]
            send = [sum(row) for row in sent_by_rank]
            receive = [sum(row) for row in received_by_rank]
            per_expert = [sum(column) for column in zip(*received_by_rank, strict=True)]
            rows = all_to_all_rows(rows, receive, send, self.ep_group)
            # received rows: by source rank, then by local expert; regroup them by expert for the matmuls
            expert_of_row = (
                torch.arange(local, device=rows.device)
                .repeat(ep)
                .repeat_interleave(received_counts, output_size=sum(receive))  # size known: no hidden sync
            )
            regroup = torch.argsort(expert_of_row, stable=True)
            outputs = self._run_experts(rows[regroup], per_expert)
            outputs = outputs[torch.argsort(regroup)]  # back to the received order
            outputs = all_to_all_rows(outputs, send, receive, self.ep_group)
        else:
            outputs = self._run_experts(rows, sent_host)
        weights = top_k_weights.reshape(-1)[order]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, token_of, (outputs * weights[:, None]).to(final.dtype))

    def _run_experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Each local expert's FFN over its (contiguous) rows."""
        outputs = []
        for index, part in enumerate(rows.split(per_expert)):
            if part.shape[0] == 0:
                continue
            gate, up = nn.functional.linear(part, self.gate_up_proj[index]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[index]))
        return torch.cat(outputs) if outputs else rows.new_zeros((0, rows.shape[-1]))

    def _within_capacity(
        self, order: torch.Tensor, counts: torch.Tensor, assignments: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The assignments each expert can take, the first ``c = ⌈factor · T·k / E⌉`` of each: ``order`` with the
        kept ones first (still by expert, token order within one) and each expert's kept count ``min(count, c)``.

        No host read: an assignment at position ``i`` of its expert's run is kept when ``i < c``; a stable sort on
        ``dropped`` moves the kept ones to the front, and the caller cuts at their sum, which it reads with the split
        sizes. The dropped count stays on the device until the log reads it (``dropped_assignments``).
        """
        capacity = math.ceil(self.capacity_factor * assignments / self.num_experts)
        sorted_expert = torch.repeat_interleave(
            torch.arange(self.num_experts, device=order.device), counts, output_size=order.numel()
        )
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[sorted_expert]
        dropped = position >= capacity
        kept = counts.clamp(max=capacity)
        self.dropped = self.dropped + (counts - kept).sum()
        return order[torch.argsort(dropped.to(torch.int8), stable=True)], kept


def apply_expert_parallel(
    model: nn.Module, *, ep_group: Any, capacity_factor: float | None = None, padded: bool | None = None
) -> nn.Module:
    """Replace every sparse MoE block's experts with :class:`ExpertParallelExperts` (in place).

    Args:
        model: an HF MoE ``*ForSequenceClassification`` model with the same full weights on every rank.
        ep_group: the expert-parallel group (None: ep = 1, for a capacity factor alone).
        capacity_factor: None for dropless routing.
        padded: exchange in fixed slots, no host read (None: with a capacity factor; False: the exact split sizes,
            one read per layer).
    """
    from hftrain.parallel.lora import hf_model_of

    plan = expert_plan_for(model.config)
    if plan is None:
        raise AxisError("ep", f"{model.config.model_type} is not a mixture-of-experts family hftrain routes")
    for block in moe_blocks(hf_model_of(model), plan):
        setattr(block, plan.experts, ExpertParallelExperts(
            getattr(block, plan.experts), ep_group=ep_group, capacity_factor=capacity_factor, padded=padded
        ))  # fmt: skip
    return model


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


def dropped_assignments(model: nn.Module) -> int:
    """Assignments the capacity dropped on this rank since the last call (and reset the counters)."""
    total = 0
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            total, module.dropped = total + module.dropped, 0
    return int(total)  # a device sum: read here, once per logging window


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

        Args:
            attention_mask: the batch's mask (padding excluded), or None.
            group: the ranks the global batch's examples are split over (None: this rank's batch is all of it).
        """
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
        """A real training micro-batch counts its tokens per expert (:attr:`counts`)."""
        self.counting = torch.is_grad_enabled()
        try:
            yield
        finally:
            self.counting = False

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
        loss = balancing_loss(RoutingSums(*totals), num_experts=self.num_experts, group=self.group)
        self.aux_loss = self.coefficient * loss

    def take_loss(self) -> torch.Tensor | None:
        """The last micro-batch's auxiliary loss (None before any); cleared."""
        loss, self.aux_loss = self.aux_loss, None
        return loss
