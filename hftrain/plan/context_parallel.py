"""Context parallelism in the planner's megatron rows: the term of ``cp`` (``hftrain.parallel.context_parallel``).

Context parallelism splits every sequence over c ranks (Megatron's rank order ``tp-cp-dp-pp``: c is a factor of
t·c·p·dp, not searched: 1 unless ``--cp`` fixes it):

- activations: each GPU's are those of s/c positions (the plan's per-layer formula at s/c:
  :meth:`ContextTerm.local_work`);
- communication per step, on the intra-node link: each layer exchanges keys and values (:func:`_context_bytes`, ring
  or all-to-all, :func:`_context_comm`), and a classifier's head gathers the whole sequences' hidden states once
  (:func:`_context_gather_bytes`); a causal LM gathers nothing (its logits stay per rank);
- gradients are averaged over dp × c (``dp_cp``): the generic data-parallel all-reduce over ``Frame.replicas``;
- no sequence parallelism at c > 1 (tp's sequence split and cp's would cut the same positions).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hftrain.plan.axis_term import AxisTerm, Frame
from hftrain.plan.model import ModelSpec
from hftrain.plan.rows import Row, Workload


def _kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """Key/value heads one tensor-parallel GPU holds: kv/t, or one (replicated) when t exceeds them."""
    return max(model.kv_heads // tp, 1)


def _context_comm(model: ModelSpec, tp: int, cp: int) -> str:
    """All-to-all where each GPU's heads and key/value heads divide by c (cheaper), else the ring."""
    return "all_to_all" if (model.heads // tp) % cp == 0 and _kv_heads_per_gpu(model, tp) % cp == 0 else "ring"


def _context_bytes(model: ModelSpec, tp: int, cp: int, work: Workload, *, comm: str | None = None) -> float:
    """Bytes one GPU sends per step for context parallelism (``hftrain.parallel.context_parallel``), per layer and
    micro-batch, with ``kv = b·(s/c)·h_kv·d/t`` elements of keys (as many of values) and ``q = b·(s/c)·h·d/t``:

    - ring: forward (c−1) blocks of keys and values, 2·kv each; backward (c−1) of them plus c of their fp32
      gradients: (c−1)·2·kv·e + (c−1)·2·kv·e + c·2·kv·4;
    - all-to-all: (c−1)/c of q, k, v and the output forward, and of their gradients backward: 2·(c−1)/c·(2q + 2kv)·e.
    """
    e = work.element
    head_dim = model.hidden // model.heads
    positions = work.micro_batch * -(-work.seq // cp)
    kv = positions * _kv_heads_per_gpu(model, tp) * head_dim
    q = positions * model.heads * head_dim / tp
    if (comm or _context_comm(model, tp, cp)) == "all_to_all":
        per_layer = 2 * (cp - 1) / cp * (2 * q + 2 * kv) * e
    else:
        per_layer = (cp - 1) * 2 * kv * e * 2 + cp * 2 * kv * 4
    return work.accumulation * model.layers * per_layer


def _context_gather_bytes(model: ModelSpec, cp: int, work: Workload) -> float:
    """Bytes one GPU sends per step to give a classifier's head the whole sequences under context parallelism
    (``hftrain.parallel.context_parallel``'s gather after the trunk's last layer): per micro-batch, an all-gather
    of the hidden states ``[b, s, h]`` forward, (c−1)/c·b·s·h·e, and the all-reduce of their gradient backward,
    2·(c−1)/c·b·s·h·e. A causal LM gathers nothing (its logits stay per rank)."""
    hidden = work.micro_batch * work.seq * model.hidden * work.element
    return work.accumulation * 3 * (cp - 1) / cp * hidden


@dataclasses.dataclass(frozen=True)
class ContextTerm(AxisTerm):
    """cp's term: s/c positions per GPU, the key/value exchange and the head's gather (the module docstring)."""

    def local_work(self, work: Workload, size: int) -> Workload:
        """The positions one GPU holds: ⌈s/c⌉ of every sequence."""
        return dataclasses.replace(work, seq=-(-work.seq // size))

    def keeps_sequence_parallel(self, size: int) -> bool:
        """hftrain's megatron strategy runs no sequence parallelism with c > 1."""
        return size == 1

    def strategy(self, model: ModelSpec, tp: int, size: int) -> dict[str, Any]:
        """``cp`` and its exchange ``cp_comm`` (all-to-all where the heads divide, else the ring)."""
        return {self.axis: size, "cp_comm": _context_comm(model, tp, size)} if size > 1 else {}

    def add_terms(self, row: Row, frame: Frame) -> None:
        """The key/value exchange of every layer and a classifier's gather, on the intra-node link."""
        cp = frame.size(self.axis)
        if cp > 1:
            model, work = frame.model, frame.work
            gather = 0.0 if model.causal_lm else _context_gather_bytes(model, cp, work)
            row.comm["intra"] = row.comm.get("intra", 0.0) + _context_bytes(model, frame.tp, cp, work) + gather


TERM = ContextTerm("cp")
