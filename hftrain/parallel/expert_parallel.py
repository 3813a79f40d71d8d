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

**With context parallelism** (ep × cp) an ep group is ``ep`` consecutive dp ranks of one cp coordinate: they hold
the same positions of different examples and exchange those tokens. An expert's gradient on cp rank ``c`` holds its
ep group's terms at ``c``'s positions only, so it is recorded partial over cp (``partial=("cp",)``) and completed as
``g = (1/(dp·cp)) Σ_edp Σ_cp g_r`` (``placement.complete_grads``: the edp all-reduce, then the partial sum over cp).

The router statistics, the auxiliary loss and the pipeline's router-loss sums are ``hftrain.parallel.ep_routing``'s
(re-exported here).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.errors import AxisError
from hftrain.parallel.axes import SEQUENCE_AXES
from hftrain.parallel.axis_ops import AxisOps
from hftrain.parallel.collectives import all_to_all_rows
from hftrain.parallel.ep_routing import (  # noqa: F401  (re-exported: their public path)
    RouterMonitor,
    RoutingSums,
    StageRouting,
    balancing_loss,
    count_routed,
    load_balancing_loss,
    moe_blocks,
    moe_layer_indices,
    routing_sums,
)
from hftrain.parallel.families import expert_plan_for, moe_families
from hftrain.parallel.host import all_max
from hftrain.parallel.placement import Split, place


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
        # False while a pipeline stage runs torch's shape inference (``ep_routing.StageRouting`` holds it so outside
        # a real micro-batch): the forward then gives a placeholder of the output's shape and runs no exchange.
        self.exchanging = True
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
        if not self.exchanging:
            # torch's pipeline infers a stage's shapes by a forward (and backward) of its own, which each dp rank of
            # a stage runs when *its* batch's shape is new: the ep ranks, which see different batches, would call
            # the all-to-alls a different number of times. Only the output's shape and dtype are read then.
            return torch.zeros_like(hidden_states)
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


def dropped_assignments(model: nn.Module) -> int:
    """Assignments the capacity dropped on this rank since the last call (and reset the counters)."""
    total = 0
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts):
            total, module.dropped = total + module.dropped, 0
    return int(total)  # a device sum: read here, once per logging window


# ----------------------------------------------------------------- the axis's interface (hftrain.parallel.axis_ops)
def _check_family(config: Any, head: str | None) -> None:
    if expert_plan_for(config) is None:
        raise AxisError("ep", f"{getattr(config, 'model_type', '?')} is a dense model (no experts to split)")


def _apply(model: nn.Module, groups: Any, options: Any, *, head: Any, rng_tracker: Any) -> nn.Module:
    """Split the experts over the ep group; at ep 1 too under a capacity factor (the cap applies on one rank); under
    an axis that splits the sequence (cp) the experts' gradients are partial over it (the module docstring)."""
    capacity_factor = options["moe_capacity_factor"]
    if groups.ep_size == 1 and capacity_factor is None:
        return model
    model = apply_expert_parallel(model, ep_group=groups.ep_group, capacity_factor=capacity_factor)
    # an axis that splits the sequence (cp): each of its ranks' experts saw its positions only (module docstring)
    partial = tuple(axis for axis in SEQUENCE_AXES if groups.axes[axis].size > 1)
    if partial:
        for module in model.modules():
            if isinstance(module, ExpertParallelExperts):
                for name in ("gate_up_proj", "down_proj"):
                    place(module, name, partial=partial)
    return model


AXIS = AxisOps(
    options={"moe_capacity_factor": None},
    check_model=lambda config, dims, options, head: check_expert_parallel(
        config, dims.ep, dims.dp, options["moe_capacity_factor"]
    ),
    check_family=_check_family,
    apply=_apply,
    not_built={
        "compile": "expert parallelism's all-to-all moves a data-dependent number of tokens (a new graph for every "
        "routing)",
        "block_loading": "the blockwise loading follows tensor parallelism's per-block split only, not the experts "
        "expert parallelism places",
    },
)
"""Expert parallelism behind the axes' one interface."""
