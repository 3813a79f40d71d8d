"""Context parallelism in the planner's megatron rows: the term of ``cp`` (``hftrain.parallel.context_parallel``).

Context parallelism splits every sequence over c ranks (Megatron's rank order ``tp-cp-dp-pp``: c is a factor of
t·c·p·dp, not searched: 1 unless ``--cp`` fixes it):

- activations: each GPU's are those of s/c positions (the plan's per-layer formula at s/c:
  :meth:`ContextTerm.local_work`);
- communication per step, on the intra-node link: each layer exchanges keys and values (:func:`_context_bytes`, ring
  or all-to-all, :func:`_context_comm`), and a classifier's head gathers the whole sequences' hidden states once
  (:func:`_context_gather_bytes`); a causal LM gathers nothing (its logits stay per rank);
- gradients are averaged over dp × c (``dp_cp``): the generic data-parallel all-reduce over ``Frame.replicas``;
- no sequence parallelism at c > 1 (tp's sequence split and cp's would cut the same positions);
- the exchange (``cp_comm``): all-to-all where each GPU's heads divide by c, else the ring, but a family whose
  attention one exchange alone splits (its trunk's ``cp_comm_only``: DeBERTa's, all-to-all) gets that one, and a
  row where it cannot divide the heads is formula only, as the trainer refuses it.
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


def _only_comm(model: ModelSpec) -> tuple[str, str] | None:
    """``(cp_comm, why)`` where the model's family splits its attention by one exchange only (its trunk adapter's
    ``cp_comm_only``, read by the trainer's check too), else None."""
    from hftrain.parallel.families import FAMILIES

    family = FAMILIES.get(model.model_type) if model.model_type else None
    return getattr(family.stages, "cp_comm_only", None) if family is not None else None


def _heads_divide(model: ModelSpec, tp: int, cp: int) -> bool:
    """Each tensor-parallel GPU's heads and key/value heads divide by c (what the all-to-all splits)."""
    return (model.heads // tp) % cp == 0 and _kv_heads_per_gpu(model, tp) % cp == 0


def _context_comm(model: ModelSpec, tp: int, cp: int) -> str:
    """The family's only exchange where it has one, else all-to-all where each GPU's heads and key/value heads
    divide by c (cheaper), else the ring."""
    only = _only_comm(model)
    if only is not None:
        return only[0]
    return "all_to_all" if _heads_divide(model, tp, cp) else "ring"


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
        only = _only_comm(frame.model) if cp > 1 and row.runnable else None
        if only is not None and not _heads_divide(frame.model, frame.tp, cp):
            row.runnable = False  # the trainer's check_context_parallel_model refuses it the same way
            row.notes.append(
                f"formula only: cp_comm {only[0]} (the only one that splits this "
                f"family's attention) needs each tp rank's {frame.model.heads // frame.tp} heads divisible by cp={cp}"
            )
        if cp > 1:
            model, work = frame.model, frame.work
            gather = 0.0 if model.causal_lm else _context_gather_bytes(model, cp, work)
            row.comm["intra"] = row.comm.get("intra", 0.0) + _context_bytes(model, frame.tp, cp, work) + gather


TERM = ContextTerm("cp")
