"""The model families hftrain splits: one registry entry per family, read by every axis and by ``hftrain plan``.

An entry (:class:`~hftrain.parallel.families.family.Family`) holds what hftrain knows of a family: its
tensor-parallel plan (``hftrain.parallel.plans`` styles), its pipeline trunk adapter and classifier heads (context
parallelism reads the trunk's layers and numbering of positions), its expert plan (mixtures of experts), why an
axis cannot run it (one line), and the planner's facts. Each family lives in its own module of this package
(``bert.py``, ``llama.py``, ``moe.py``, ...: its plan, trunk, own heads and refusals), which exports its entries as
``FAMILIES``; this module gathers them, one line per module, so a new family is one new file and one line here. The
axes look their family up here (:func:`plan_for`, :func:`stages_for`, :func:`stages_of`, :func:`expert_plan_for`,
:func:`check_family`), and so does ``hftrain plan``, so the planner never offers a layout the trainer refuses. A
caller names its task's head by kind (``hftrain.parallel.heads.HEADS``), never by the model's class.

Where transformers ships a family's own tensor-parallel plan (``config.base_model_tp_plan``, e.g.
``"layers.*.self_attn.q_proj": "colwise"``), the entry is derived from it (:func:`derived_plan`): ``colwise`` is a
column split (per key/value head for ``k_proj``/``v_proj`` of grouped-query attention), ``rowwise`` a row split,
``replicated_with_grad_allreduce`` (per-head q/k norms) a replicated module whose gradient is summed over tp; what
transformers' plan cannot say is written beside it: the norms that run on sequence chunks under sequence
parallelism. Where transformers' plan gathers (``colwise_gather_output``) the entry is written by hand: OLMo-2's
q/k norms over every head are split with their projections (``width_norm``); Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are split part by part (``column_fused_qkv``, ``column_gate_up``). Where transformers has no plan
the entry is written by hand too: BERT's architecture and its kin, DeBERTa-v2's disentangled relative attention (its
shared relative embeddings ``head_shared``: each rank projects them onto its own heads). A family transformers adds
later whose plan has exactly Llama's modules is found without an entry (:func:`family_of`), checked against the
model's modules when it is split (``llama.llama_architecture``).

| family | tp (+sp) | pp | cp | ep |
|---|---|---|---|---|
| BERT, ELECTRA, DistilBERT | yes | yes | yes | |
| RoBERTa, XLM-R | yes | yes | yes (positions numbered from the pads over the whole sequence, then split) | |
| GPT-2 | yes | yes | yes | |
| GPT-NeoX | yes (fused qkv, per head) | yes | yes | |
| Llama, Qwen2, Qwen3, Gemma, Mistral | yes | yes | yes (sliding windows too) | |
| Gemma-3 (text) | yes | yes | yes (local and global layers) | |
| Gemma-2 | yes | yes | yes (soft-capped logits: the score-modified kernel) | |
| OLMo-2 | yes (q/k norms over every head: their sum of squares all-reduced over tp) | yes | yes | |
| Phi-3 | yes (fused qkv and gate_up, part by part; tp divides kv heads) | yes | yes | |
| Mixtral, Qwen2-MoE, Qwen3-MoE | attention (MoE replicated, no sp) | yes (router loss summed over stages) | yes | yes |
| ModernBERT | yes (fused Wqkv and GLU Wi, part by part) | yes | yes (bidirectional local windows) | |
| DeBERTa-v2, DeBERTa-v3 | yes (relative embeddings' gradient summed over tp) | yes (... over pp) | yes (all_to_all) | |
| ALBERT | yes (the shared layer group split once) | yes (the shared group: a copy per rank) | yes (gathered once) | |
"""

from __future__ import annotations

from typing import Any

from hftrain.errors import AxisError, ConfigError
from hftrain.parallel.axis_ops import label
from hftrain.parallel.families import (
    albert,
    bert,
    deberta_v2,
    distilbert,
    gemma2,
    gpt2,
    gpt_neox,
    llama,
    modernbert,
    moe,
    olmo2,
    phi3,
)
from hftrain.parallel.families.family import Family
from hftrain.parallel.heads import StageHead, head_kind
from hftrain.parallel.plans import ExpertPlan, TensorParallelPlan, kv_heads_split
from hftrain.parallel.stages import ModelStages

__all__ = [
    "FAMILIES",
    "Family",
    "check_family",
    "check_tensor_parallel",
    "expert_plan_for",
    "family_of",
    "has_tp_plan",
    "is_gated_mlp",
    "is_moe",
    "moe_families",
    "plan_for",
    "stages_for",
    "stages_of",
    "takes_sequence_parallel",
    "trainable_axes",
]

# the registry: one line per family module (a new family is one new module and one line here)
FAMILIES: dict[str, Family] = {
    **bert.FAMILIES,
    **distilbert.FAMILIES,
    **gpt2.FAMILIES,
    **gpt_neox.FAMILIES,
    **llama.FAMILIES,
    **gemma2.FAMILIES,
    **phi3.FAMILIES,
    **olmo2.FAMILIES,
    **moe.FAMILIES,
    **albert.FAMILIES,
    **deberta_v2.FAMILIES,
    **modernbert.FAMILIES,
}


def family_of(config: Any) -> Family | None:
    """The registry entry of a model's family: by ``model_type``, else found by architecture (a config whose
    transformers tp plan names exactly Llama's modules, e.g. a family added to transformers later); None when
    neither.

    Args:
        config: the model's ``transformers.PretrainedConfig``.
    """
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return llama.llama_architecture(config)


def _supported(axis: str) -> str:
    if axis == "tp":
        return ", ".join(f.name for f in FAMILIES.values() if f.tp is not None)
    return ", ".join(f.name for f in FAMILIES.values() if f.stages is not None)


def _refusal(config: Any, axis: str, family: Family | None) -> str:
    model_type = getattr(config, "model_type", None)
    if family is not None and axis in family.refusals:
        return f"{label(axis)} cannot split this {family.name} model: {family.refusals[axis]}"
    return (
        f"{label(axis)} has no entry for model type {model_type!r} (supported: {_supported(axis)}); "
        f"use {axis} 1 (strategy ddp/fsdp/zero* for this model)"
    )


def plan_for(config: Any) -> TensorParallelPlan:
    """The tensor-parallel plan of a model's family, or a one-line refusal naming why (and the families that have one).

    Args:
        config: the model's ``transformers.PretrainedConfig``.
    """
    family = family_of(config)
    plan = family.tp_plan(config) if family is not None and family.tp is not None else None
    if plan is None:
        raise AxisError("tp", _refusal(config, "tp", family))
    return plan


def has_tp_plan(config: Any) -> bool:
    """Whether tensor parallelism can split the model (its family has a plan for it)."""
    try:
        plan_for(config)
    except ConfigError:
        return False
    return True


def stages_for(config: Any, *, head: str | None = "sequence_classification", axis: str = "pp") -> Any:
    """The trunk adapter of a model's family, checked (:func:`check_family`).

    Args:
        config: the model's config.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``), or None for a task's own head object.
        axis: ``"pp"`` or ``"cp"``.
    """
    check_family(config, head=head, axis=axis)
    family = family_of(config)
    assert family is not None
    return family.stages


def stages_of(model: Any, head: str | StageHead | None = "sequence_classification") -> ModelStages:
    """The pipeline adapter of ``model`` (``hftrain.parallel.stages.ModelStages``): its family's trunk with its
    task's head.

    Args:
        model: the model.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``: the family's classifier, per-token classifier
            or causal LM head), or a task's own ``StageHead`` (the Trainer's ``stage_head``); None: the default kind,
            ``"sequence_classification"``.
    """
    config = getattr(model, "config", None)
    if head is None:
        head = "sequence_classification"
    kind = head if isinstance(head, str) else None
    trunk = stages_for(config, head=kind)
    if kind is not None:
        family = family_of(config)
        head = head_kind(kind).make(config, family)
    return ModelStages(trunk, head)


def check_family(config: Any, *, head: str | None = "sequence_classification", axis: str = "pp") -> None:
    """Refuse a model ``axis`` cannot split (before any model is built, from its config), in one line naming why.

    The head kind's traits (``hftrain.parallel.heads.HeadKind``) decide what pipeline parallelism takes: a kind that
    needs a causal trunk on a family without one is refused, and so is a kind whose pipeline loss does not take a
    mixture of experts' router loss on a MoE family.

    Args:
        config: the model's ``transformers`` config.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``; ``ConfigError`` for another name), or None for
            a task's own head object (nothing of it is checked).
        axis: ``"pp"`` or ``"cp"``.
    """
    family = family_of(config)
    if family is None or family.stages is None or axis in family.refusals:
        raise AxisError(axis, _refusal(config, axis, family))
    kind = None if head is None else head_kind(head)
    if kind is not None and axis == "pp" and family.experts is not None and not kind.router_loss:
        raise AxisError(
            axis,
            f"{label(axis)} splits {family.name} sequence classifiers and causal LMs, not its {head} head (its "
            "router loss is not built "
            "into that head's pipeline loss yet); use pp 1 (tp, ep and dp split it)",
        )
    if kind is not None and axis == "pp" and kind.causal_trunk and not getattr(family.stages, "causal", False):
        raise AxisError(  # cp runs the model's own forward
            axis, f"{label(axis)} splits decoder causal LMs, not a {family.name} {head} model; use {axis} 1"
        )
    refusal = getattr(family.stages, "refusal", None)  # what a config of the family cannot cut into chunks
    reason = None if refusal is None else refusal(config)
    if reason is not None:
        raise AxisError(axis, f"{label(axis)} cannot split this {family.name} model: {reason}")
    reason = family.config_refusals[axis](config) if axis in family.config_refusals else None
    if reason is not None:
        raise AxisError(axis, f"{label(axis)} cannot split this {family.name} model exactly: {reason}")


def expert_plan_for(config: Any) -> ExpertPlan | None:
    """The family's expert plan, or None for a dense model."""
    family = family_of(config)
    return None if family is None else family.experts


def is_moe(config: Any) -> bool:
    """Whether the model is a mixture of experts hftrain can route (a family with an expert plan)."""
    return expert_plan_for(config) is not None


def moe_families() -> list[str]:
    """The model types hftrain routes experts for."""
    return sorted(t for t, f in FAMILIES.items() if f.experts is not None)


def is_gated_mlp(config: Any) -> bool:
    """Whether the family's MLP is gated (three matrices; the planner's FLOPs and sizes)."""
    family = family_of(config)
    return family is not None and family.gated_mlp


def _kv_heads(plan: TensorParallelPlan, config: Any) -> dict[str, int]:
    return {"num_key_value_heads": config.num_key_value_heads} if plan.grouped_query else {}


def _valid_tp(sizes: dict[str, int], kv_heads: dict[str, int]) -> list[int]:
    return [
        d
        for d in range(1, min(sizes.values()) + 1)
        if all(v % d == 0 for v in sizes.values()) and all(kv_heads_split(v, d) for v in kv_heads.values())
    ]


def check_tensor_parallel(config: Any, tp: int, *, sequence_parallel: bool = False) -> None:
    """Refuse a model that ``tp`` cannot split, naming the size and the valid tp values (no processes needed), and
    sequence parallelism (tp > 1) for a family with blocks replicated over tp (mixture of experts) or layers that
    cannot run on sequence chunks (the plan's ``sequence_refusal``: ALBERT's).

    Args:
        config: the model's ``transformers.PretrainedConfig``.
        tp: the tensor-parallel size.
        sequence_parallel: whether sequence parallelism is asked for.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise AxisError("tp", f"tp must be a positive integer, got {tp!r}")
    if tp == 1 and not has_tp_plan(config):
        return  # nothing to split: the family runs whole on each rank (under pp, cp or dp)
    plan = plan_for(config)
    if sequence_parallel and tp > 1 and plan.replicated:
        raise AxisError(
            "sequence_parallel",
            f"sequence parallelism is not supported for this {config.model_type} model: its mixture-of-experts "
            f"blocks ({', '.join(plan.replicated)}) run whole on every tp rank and need the full sequence, which "
            "sequence parallelism cuts into tp chunks; use sequence_parallel: false (tp still splits the attention)",
        )
    if sequence_parallel and tp > 1 and plan.sequence_refusal:
        raise AxisError(
            "sequence_parallel",
            f"sequence parallelism is not supported for this {config.model_type} model: {plan.sequence_refusal}; "
            "use sequence_parallel: false (tp still splits its layers)",
        )
    sizes, kv_heads = plan.sizes(config), _kv_heads(plan, config)
    indivisible = ", ".join(f"{name}={value}" for name, value in sizes.items() if value % tp)
    unsplittable = ", ".join(f"{name}={value}" for name, value in kv_heads.items() if not kv_heads_split(value, tp))
    problems = [f"does not divide {indivisible}"] if indivisible else []
    if unsplittable:
        problems.append(f"neither divides nor is a multiple of {unsplittable} (split evenly or replicated)")
    if problems:
        raise AxisError(
            "tp",
            f"tp={tp} {' and '.join(problems)} of this {config.model_type} model; "
            f"valid tp values for it: {', '.join(map(str, _valid_tp(sizes, kv_heads)))}",
        )


def takes_sequence_parallel(config: Any) -> bool:
    """Whether tensor parallelism may also cut the sequence for this model (its family has a plan with no replicated
    blocks and no ``sequence_refusal``)."""
    if not has_tp_plan(config):
        return False
    plan = plan_for(config)
    return not plan.replicated and plan.sequence_refusal is None


def trainable_axes(config: Any, head: str | None = "sequence_classification") -> frozenset[str]:
    """The model-parallel axes the trainer takes for ``config``, each checked as the trainer checks it (the planner
    asks here, so it never offers a layout ``train`` refuses).

    Args:
        config: the model's ``transformers`` config.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``), whose own limits count too.
    """
    from hftrain.parallel.axis_ops import declared

    axes = set()
    for spec, ops in declared():  # each axis's own family check (AxisOps.check_family; None: not model-parallel)
        if ops.check_family is None:
            continue
        try:
            ops.check_family(config, head)
        except ConfigError:
            continue
        axes.add(spec.name)
    return frozenset(axes)
