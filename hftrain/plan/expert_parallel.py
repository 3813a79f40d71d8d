"""Expert parallelism in the planner's megatron rows: the term of ``ep`` (``hftrain.parallel.expert_parallel``).

A mixture of experts (``ModelSpec.moe``) with expert parallelism e: e consecutive dp ranks split the routed experts of
every MoE layer (Megatron's rule, so e divides dp and the experts E; ``hftrain.parallel.ParallelDims``), searched
over the divisors of both (:func:`expert_sizes`) unless ``--ep`` fixes it (:func:`check_experts`):

- parameters: a layer's routed experts ``Ψ_experts/L`` are divided by e (not by t), the rest of its ``mlp``
  (router, shared expert, Qwen2-MoE's dense MLPs) is whole on every GPU (hftrain's tp plans replicate the MoE
  block over tp), its attention is split over t (:meth:`ExpertTerm.layer_parameters`); gradients the same; Adam's
  state the same, its dense part /dp and its expert part /(dp/e) (the expert-data-parallel ranks holding the same
  experts) under ``shard_optimizer`` (:func:`stage_expert_parameters`, :meth:`ExpertTerm.held`);
- communication: the dense gradients all-reduced over dp (× c), the experts' over dp·c/e; and the token all-to-all
  per MoE layer and micro-batch (:func:`all_to_all_bytes`): dispatch and combine each send ``T·k·h·e_b·(e−1)/e`` per
  GPU forward and the same again backward (T = b·s/c tokens of the GPU, k = top-k, e_b bytes per element), over
  the intra-node link when the e group's t·c·e consecutive ranks fit in a node;
- no sequence parallelism for a MoE model (the MoE block needs the whole sequence, ``hftrain.parallel.plans``: the
  model's own trait, ``ModelSpec.moe``); no ZeRO-1 with e > 1; training composes e > 1 with tp, dp, pp (e carved
  out of dp within each stage; each stage adds its layers' router-loss sums) and cp (e carved out of dp at each cp
  coordinate; the experts' gradients summed over dp·c/e) (``ParallelDims.validate_trainable``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import hftrain.plan.formulas as formulas
from hftrain.errors import ConfigError
from hftrain.parallel.axes import AXIS_SPECS, SPEC
from hftrain.plan.axis_term import AxisTerm, Frame, HeldStates
from hftrain.plan.common import stage_layers
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec, divisors
from hftrain.plan.rows import Row

ALL_TO_ALL_FORMULA = (
    "dispatch + combine each T·k·h·e·(ep−1)/ep per GPU forward, the same again backward: 4·T·k·h·e·(ep−1)/ep "
    "(T tokens of the GPU's micro-batch, k experts per token, e bytes per element)"
)


def all_to_all_bytes(*, tokens: int, top_k: int, hidden: int, element: int, ep: int) -> float:
    """Bytes one GPU sends by all-to-all in one MoE layer for one micro-batch, forward and backward, under expert
    parallelism ``ep``.

    Each of the GPU's ``T`` tokens goes to ``k`` experts, as a hidden vector of ``h`` elements of ``e`` bytes:
    dispatch sends ``T·k·h·e`` bytes of which the share ``(ep−1)/ep`` leaves the GPU (uniform routing: the
    experts of the other ``ep − 1`` ranks), and combine sends the experts' outputs back, as many. Backward runs
    both again on the gradients (combine's gradient dispatched, dispatch's combined)::

        bytes = 2 (forward + backward) · 2 (dispatch + combine) · T·k·h·e·(ep−1)/ep

    Args:
        tokens: T, the tokens of one micro-batch on the GPU (b·s, or b·s/c under context parallelism).
        top_k: k, the experts each token is routed to.
        hidden: h, the hidden size.
        element: e, bytes per activation element.
        ep: expert-parallel size (1: nothing leaves the GPU).
    """
    return 4 * tokens * top_k * hidden * element * (ep - 1) / ep


def check_experts(model: ModelSpec, ep: int) -> None:
    """Refuse an expert-parallel size the model cannot split (one line naming ``--ep``): a dense model takes only
    1, a MoE model a divisor of its experts.

    Args:
        model: the model.
        ep: expert-parallel size.
    """
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"--ep {ep}: must be a positive integer")
    if ep == 1:
        return
    if not model.moe:
        raise ConfigError(
            f"--ep {ep}: {model.name} is a dense model (no experts to split); drop --ep, or plan a mixture-of-"
            "experts model (e.g. Mixtral, Qwen2-MoE)"
        )
    if model.experts % ep:
        raise ConfigError(
            f"--ep {ep} does not divide the {model.experts} experts of {model.name}; valid --ep: "
            f"{', '.join(str(d) for d in divisors(model.experts))}"
        )


def expert_sizes(model: ModelSpec, dp: int) -> list[int]:
    """The expert-parallel sizes e a layout with ``dp`` data-parallel ranks admits: the divisors of both dp and the
    experts E (1 only for a dense model)."""
    return divisors(math.gcd(dp, model.experts)) if model.moe else [1]


def stage_expert_parameters(model: ModelSpec, pp: int, ep: int = 1) -> float:
    """The routed experts' parameters on one GPU of the most loaded stage: ``Ψ_experts · (L_stage/L) / e``.

    Args:
        model: the model.
        pp: pipeline-parallel size p.
        ep: expert-parallel size e.
    """
    return model.expert_parameters * stage_layers(model, pp)[1] / model.layers / ep


def _not_composed(axis: str) -> tuple[list[str], list[str]]:
    """``(refused, allowed)``: the mesh axes a carved axis is not trained with, and those it is
    (``ParallelDims.validate_trainable``'s rule: its parent, the axes that cut parameters, the pipeline's stages and
    the axes that split sequences)."""
    parent = SPEC[axis].carved_from
    mesh = [s for s in AXIS_SPECS if s.stride is not None]
    allowed = [s.name for s in mesh if s.name == parent or s.cuts_parameters or s.pipelined or s.splits_sequence]
    return [s.name for s in mesh if s.meaning and s.name not in allowed], allowed


@dataclasses.dataclass(frozen=True)
class ExpertTerm(AxisTerm):
    """ep's term: the routed experts split over e dp ranks, their gradients and Adam state over dp/e, the token
    all-to-all (the module docstring)."""

    def check(self, model: ModelSpec, fixed: Mapping[str, int | None]) -> None:
        """Refuse an ``--ep`` the model cannot split (:func:`check_experts`), or given with axes training does not
        compose it with (``--cp`` above 1)."""
        ep = fixed.get(self.axis)
        if ep is None:
            return
        check_experts(model, ep)
        refused, allowed = _not_composed(self.axis)
        if ep > 1 and any((fixed.get(axis) or 1) > 1 for axis in refused):
            given = " / ".join(f"--{axis} {fixed.get(axis) or 1}" for axis in refused)
            raise ConfigError(
                f"--{self.axis} {ep} with {given}: training composes {SPEC[self.axis].label}ism with "
                f"{', '.join(allowed[:-1])} and {allowed[-1]} only; "
                f"drop {'/'.join('--' + axis for axis in refused)} or --{self.axis}"
            )

    def searched(self, model: ModelSpec, dp: int) -> list[int]:
        """The divisors of both dp and the experts (:func:`expert_sizes`)."""
        return expert_sizes(model, dp)

    def splits_alone(self, model: ModelSpec) -> bool:
        """A MoE model's experts may be split with neither tp nor pp."""
        return model.moe

    def no_layout(self, size: int, hw: Hardware) -> str:
        return (
            f"--ep {size} divides the data-parallel size of no layout on {hw.world} GPUs (ep consecutive data-parallel "
            f"ranks split the experts); give an --ep dividing {hw.world} // (tp·pp·cp), or more GPUs"
        )

    def layer_parameters(self, model: ModelSpec, size: int) -> tuple[float, float]:
        """A layer's routed experts ``X = Ψ_experts/L`` (the mean over the layers), ``X/e`` per GPU."""
        experts = model.expert_parameters / model.layers
        return experts, experts / size

    def held(self, frame: Frame) -> HeldStates:
        """The routed experts on this GPU (frozen under LoRA, which adapts the attention only); their Adam state
        sharded over the dp/e ranks holding the same experts, their gradients all-reduced over dp·c/e."""
        ep = frame.size(self.axis)
        experts = stage_expert_parameters(frame.model, frame.pp, ep)
        trained = 0.0 if frame.work.lora_rank else experts
        return HeldStates(experts, trained, frame.dp // ep, frame.replicas // ep)

    def unbuilt(self, frame: Frame) -> list[tuple[str, ...]]:
        """The axes above 1 that training does not compose e > 1 with (``ParallelDims.validate_trainable``)."""
        if frame.size(self.axis) == 1:
            return []
        refused, _ = _not_composed(self.axis)
        return [(self.axis, axis) for axis in refused if frame.size(axis) > 1]

    def add_terms(self, row: Row, frame: Frame) -> None:
        """The experts' bytes (``row.figures["experts"]``), their gradients' all-reduce, the token all-to-all
        (``row.figures["all_to_all"]`` per MoE layer and micro-batch; × m × the stage's MoE layers in ``row.comm``)
        and the formula."""
        model, sb, hw = frame.model, frame.state_bytes, frame.hw
        ep, held = frame.size(self.axis), self.held(frame)
        row.figures["experts"] = held.parameters * sb.params + held.trained * sb.grads
        row.figures["experts"] += held.trained * sb.optimizer / (held.optimizer_ranks if frame.shard_optimizer else 1)
        if not model.moe:
            return
        parent = SPEC[self.axis].carved_from or ""
        # the experts' gradients over their dp·c/e replicas (c: context parallelism joins the dp all-reduce)
        link = "inter" if frame.inner_ranks(parent) * frame.dp > hw.gpus_per_node else "intra"
        row.comm[link] = row.comm.get(link, 0.0) + formulas.all_reduce_bytes(
            held.trained * sb.grads, held.gradient_ranks
        )
        local = frame.local
        row.figures["all_to_all"] = all_to_all_bytes(
            tokens=local.micro_batch * local.seq, top_k=model.top_k, hidden=model.hidden, element=local.element, ep=ep
        )
        if ep > 1:
            link = "inter" if frame.inner_ranks(parent) * ep > hw.gpus_per_node else "intra"
            moe_layers = -(-model.moe_layers // frame.pp)  # the most loaded stage's
            row.comm[link] = row.comm.get(link, 0.0) + frame.work.accumulation * moe_layers * row.figures["all_to_all"]
        row.formulas["experts"] = (
            "routed experts Ψ_experts·(L/p)/L / e per GPU (not split by t: the MoE block is whole on every tp rank); "
            "Adam's expert state / (dp/e) under shard_optimizer; all-to-all per MoE layer and micro-batch: "
            + ALL_TO_ALL_FORMULA
        )

    def table_formulas(self, model: ModelSpec) -> list[str]:
        if not model.moe:
            return []
        return [f"experts (per GPU /ep; all-to-all per MoE layer and micro-batch): {ALL_TO_ALL_FORMULA}"]


TERM = ExpertTerm("ep", figures=("experts", "all_to_all"), formulas={"all_to_all": ALL_TO_ALL_FORMULA})
