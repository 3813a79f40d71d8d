"""Megatron-style TP × PP × DP layouts (and the other axes' terms): which the hardware and model admit, and one
estimator.

Ranks are laid out like ``hftrain.parallel.ParallelDims`` (Megatron-LM's order): tensor-parallel ranks
adjacent (inside a node: t divides the GPUs per node), then data parallel, pipeline outermost. Per GPU of the
most loaded pipeline stage (model states: the first or the last; activations: stage 0):

- parameters: (L/p)·Ψ_layer/t + V'·h/t (vocabulary-parallel embedding, V padded up to a multiple V' of t) + the
  rest of the embeddings (replicated)
  on the first stage, (L/p)·Ψ_layer/t + the head (pooler, final norm, classifier) on the last, the larger of
  the two (p = 1: all of it); gradients the same; Adam state the same, or /dp with ``shard_optimizer``
  (ZeRO-1: each stage's optimizer sharded over its own dp group, at any p);
- working memory: with m > 1 micro-batches per step, one micro-batch's gradient of the largest tensor is live
  beside the accumulated one while autograd adds it in (``grad += g``): V·h/t on a stage holding the embedding
  (measured: a 108 MiB embedding peaks at 222 MiB of gradient over 4 micro-batches; the layers' matrices are
  small beside a stage);
- activations: Korthikanti et al. 2022 per layer over t (with sequence parallelism; hftrain's column-parallel
  layers keep their all-gathered input, 2e·s·b·h, whole), × L/p layers × the
  micro-batches 1F1B keeps in flight on stage 0 (min(p, m)); a language model (``model.task: causal_lm``) adds its
  logits and loss buffer s·b·V'·(e + 4)/t (:func:`hftrain.plan.formulas.logits_activation_bytes`: the output
  projection split over the vocabulary, the vocabulary-parallel loss), on the last stage under a pipeline, at the
  positions one GPU holds (each term's ``local_work``); its untied lm_head is split over t like the embedding (V'·h/t);
- communication per step: TP 2 all-reduces forward + 2 backward of s·b·h per layer and micro-batch (the same
  volume as all-gather + reduce-scatter under sequence parallelism); DP one all-reduce of the GPU's gradients
  (over dp times the axes flattened with it, ``Frame.replicas``); PP one s·b·h send forward and one backward per
  micro-batch and stage boundary; the bubble (p−1)/(m+p−1).

Every other axis is a term (``hftrain.plan.axis_term.AxisTerm``, registered in ``hftrain.plan.terms.TERMS``), which
states its own equations: context parallelism (``hftrain.plan.context_parallel``: s/c positions per GPU, the
key/value exchange) and expert parallelism (``hftrain.plan.expert_parallel``: a MoE model's routed experts split
over e dp ranks, the token all-to-all). A layout is ``{"tp", "pp", <each term's axis>}`` sizes; the terms of axes
not carved out of dp multiply t·p (dp is what remains of the world), a carved one (ep) splits dp. A MoE model takes
no sequence parallelism (its tp plan replicates the MoE block: ``ModelSpec.moe``); rows whose axes the model's
family does not take are formula-only (``hftrain.parallel.families``), and so are the layouts its task does not
build (``ModelSpec.refused_layouts``) and those a term says it is not built with (:meth:`AxisTerm.unbuilt`).

Every row is hftrain's ``megatron`` strategy; with p > 1 the plan's m micro-batches of b become the
pipeline's ``num_microbatches`` = m over a per-device batch of m·b (1F1B, or GPipe when m < p, which 1F1B
refuses; both keep min(p, m) micro-batches on stage 0).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import hftrain.plan.formulas as formulas
from hftrain.errors import AxisError, ConfigError
from hftrain.parallel.dims import ParallelDims
from hftrain.plan.axis_term import Frame
from hftrain.plan.common import activation_bytes, finish, stage_layers
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec, divisors
from hftrain.plan.rows import Row, Workload
from hftrain.plan.terms import BY_AXIS, IN_AXIS_ORDER, TERMS


def layouts(
    model: ModelSpec,
    hw: Hardware,
    *,
    tp: int | None = None,
    pp: int | None = None,
    split: int = 1,
    unsplit: bool = False,
) -> list[tuple[int, int]]:
    """(t, p) pairs other than (1, 1): t divides the GPUs per node and the model's sizes, p divides the layers,
    and t·p·``split`` divides the world. ``tp``/``pp`` fix one (checked against the model: a size that does not
    divide is an error). With ``split > 1`` (another axis splits the model, e.g. context parallelism) t and p may
    both be 1.

    Args:
        model: the model.
        hw: the hardware.
        tp: only this tensor-parallel size.
        pp: only this pipeline-parallel size.
        split: the product of the terms' mesh-axis sizes every layout has (context parallelism's c).
        unsplit: include (1, 1) too (a carved axis, expert parallelism, may split the model alone).
    """
    if tp is not None or pp is not None:
        model.check_parallel(tp or 1, pp or 1)
    tps = [tp] if tp else divisors(hw.gpus_per_node)
    pps = [pp] if pp else divisors(model.layers)
    return [
        (t, p)
        for t in tps
        for p in pps
        if ((t, p) != (1, 1) or split > 1 or unsplit) and hw.world % (t * p * split) == 0 and model.admits(t, p)
    ]


def fixed_layouts(model: ModelSpec, hw: Hardware, **fixed: int | None) -> list[dict[str, int]]:
    """Every layout as ``{"tp", "pp", <each term's axis>}`` sizes (:func:`estimate`'s keywords), other than all 1,
    with the sizes a plan fixed (None or absent: searched). The :func:`layouts` (t, p), each with the terms' sizes:
    an axis not carved out of dp is not searched (1 unless fixed); a carved one (ep) takes every size its term
    searches in the layout's dp (:meth:`AxisTerm.searched`) that divides dp, or the fixed one; kept where training
    takes the layout (``ParallelDims.validate_trainable``). Each term first refuses, in one line naming its flag, a
    fixed size the model cannot take (:meth:`AxisTerm.check`), and one that is in no layout
    (:meth:`AxisTerm.no_layout`).

    Args:
        model: the model.
        hw: the hardware.
        **fixed: ``tp``, ``pp`` and each term's axis -> its only size (None: searched).
    """
    tp, pp = fixed.get("tp"), fixed.get("pp")
    for term in TERMS:
        term.check(model, fixed)
    mesh = {term.axis: fixed.get(term.axis) or 1 for term in IN_AXIS_ORDER if not term.carved}
    carved = [term for term in IN_AXIS_ORDER if term.carved]
    split = math.prod(mesh.values())
    unsplit = any(term.splits_alone(model) for term in carved)
    found = []
    for t, p in layouts(model, hw, tp=tp, pp=pp, split=split, unsplit=unsplit):
        dp = hw.world // (t * p * split)
        choices = [
            [size] if (size := fixed.get(term.axis)) is not None else term.searched(model, dp) for term in carved
        ]
        for chosen in itertools.product(*choices):
            sizes = {**mesh, **{term.axis: size for term, size in zip(carved, chosen, strict=True)}}
            if any(dp % size for size in chosen) or ((t, p) == (1, 1) and all(s == 1 for s in sizes.values())):
                continue
            try:  # only what training takes (the one layout check, ParallelDims.validate_trainable)
                ParallelDims(hw.world, tp=t, pp=p, **sizes).validate_trainable()
            except AxisError:
                continue
            found.append({"tp": t, "pp": p, **sizes})
    for term in carved:
        size = fixed.get(term.axis)
        if size is not None and size > 1 and not found:
            raise ConfigError(term.no_layout(size, hw))
    return found


def estimate(tp: int, pp: int, model: ModelSpec, work: Workload, hw: Hardware, **sizes: int) -> Row:
    """One TP × PP × DP row with the terms' axes (the most loaded stage's GPU); at p = 1 with sequence parallelism
    when t > 1 (where no term refuses it, and the model has no experts) and ZeRO-1 when dp > 1 (where no term
    refuses it).

    The generic row (the module docstring) at the positions one GPU holds (each term's ``local_work``), with the
    parameters a term splits apart (``held``: a MoE model's experts, their Adam state /ZeRO-1 over their own
    replicas) taken out of the dense state; then each term adds its figures and communication (``add_terms``).
    The label is ``megatron tp·<mesh terms>·pp·dp·<carved terms>``; the strategy options list the mesh terms'
    keys before the pipeline's, the carved ones' after.

    Args:
        tp: tensor-parallel size t.
        pp: pipeline-parallel size p.
        model: the model.
        work: the workload.
        hw: the hardware.
        **sizes: each term's axis -> its size (1 when not given): ``cp=2`` (context-parallel size c), ``ep=2``
            (expert-parallel size e, dividing dp and the model's experts).
    """
    unknown = sorted(set(sizes) - set(BY_AXIS))
    if unknown:
        raise TypeError(f"estimate: '{unknown[0]}' is not a term's axis; give sizes of {', '.join(BY_AXIS)}")
    sizes = {term.axis: sizes.get(term.axis, 1) for term in IN_AXIS_ORDER}
    mesh = [term for term in IN_AXIS_ORDER if not term.carved]
    carved = [term for term in IN_AXIS_ORDER if term.carved]
    dp = hw.world // (tp * pp * math.prod(sizes[term.axis] for term in mesh))
    sb = formulas.state_bytes(work.precision, deepspeed=False)
    stage = stage_parameters(model, tp, pp, sizes)
    trained = stage * model.lora_parameters(work.lora_rank) / model.parameters if work.lora_rank else stage
    local = work
    for term in TERMS:  # the positions one GPU holds
        local = term.local_work(local, sizes[term.axis])
    # hftrain's pipeline stages do not split the sequence: sequence parallelism at p = 1 only; a MoE model's tp plan
    # (and ALBERT's: model.sequence_parallel, from the registry) refuses it. ZeRO-1 shards each stage's optimizer over
    # that stage's dp group, at any p.
    sequence_parallel = (
        tp > 1
        and pp == 1
        and all(term.keeps_sequence_parallel(sizes[term.axis]) for term in TERMS)
        and not model.moe
        and model.sequence_parallel
    )
    shard_optimizer = dp > 1 and all(term.keeps_shard_optimizer(sizes[term.axis]) for term in TERMS)
    in_flight = min(pp, work.accumulation)
    frame = Frame(model, work, local, hw, tp, pp, dp, sizes, sb, shard_optimizer)
    parts = [f"tp{tp}", *(t.label(sizes[t.axis]) for t in mesh), f"pp{pp}", f"dp{dp}"]
    label = "megatron " + "·".join(part for part in parts + [t.label(sizes[t.axis]) for t in carved] if part)
    strategy: dict[str, object] = {
        "name": "megatron",
        "tp": tp,
        "sequence_parallel": sequence_parallel,
        "shard_optimizer": shard_optimizer,
    }
    for term in mesh:
        strategy.update(term.strategy(model, tp, sizes[term.axis]))
    if pp > 1:  # hftrain's 1F1B needs at least p micro-batches; GPipe runs fewer
        schedule = "1f1b" if work.accumulation >= pp else "gpipe"
        strategy.update(pp=pp, num_microbatches=work.accumulation, schedule=schedule)
    for term in carved:
        strategy.update(term.strategy(model, tp, sizes[term.axis]))
    # the parameters a term splits apart (a MoE model's routed experts): their own Adam sharding and all-reduce
    held = [states for term in TERMS if (states := term.held(frame)) is not None]
    dense = trained - sum(states.trained for states in held)
    apart = sum(states.trained / (states.optimizer_ranks if shard_optimizer else 1) for states in held)
    row = Row(
        label,
        strategy,
        tp,
        pp,
        dp,
        params=stage * sb.params,
        grads=trained * sb.grads,
        # ZeRO-1 shards the dense state over dp, a held part over its own replicas
        optimizer=(dense / (dp if shard_optimizer else 1) + apart) * sb.optimizer,
        activations=_activations(model, local, hw, tp=tp, pp=pp, in_flight=in_flight, sp=sequence_parallel),
        sizes=sizes,
    )
    given = {"tp": tp, "pp": pp, **sizes}  # every axis, carved ones too (a task's record may refuse ep)
    refused = [axis for axis, size in given.items() if size > 1 and axis not in model.axes]
    if refused:  # the family's registry entry (hftrain.parallel.families): what the trainer would refuse
        row.runnable = False
        row.notes.append(f"formula only: hftrain's trainer takes no {'/'.join(refused)} for this model family")
    split = {axis for axis, size in given.items() if size > 1}
    unbuilt = [axes for axes in model.refused_layouts if split.issuperset(axes)]
    unbuilt += [axes for term in TERMS for axes in term.unbuilt(frame)]
    if (
        unbuilt and not refused
    ):  # LANGUAGE_MODEL_LAYOUTS_NOT_BUILT (causal_lm); a term's (ParallelDims.validate_trainable)
        row.runnable = False
        axes = " with ".join(unbuilt[0])
        row.notes.append(f"formula only: hftrain's trainer takes no {axes} for model.task {model.task} yet")
    lora_unbuilt = _lora_not_built({"tp": tp, "pp": pp, **sizes}) if work.lora_rank else []
    if lora_unbuilt and row.runnable:  # each axis's AxisOps.not_built (none refuses LoRA today)
        row.runnable = False
        row.notes.append(f"formula only: hftrain's trainer takes no LoRA with {'/'.join(lora_unbuilt)} yet")
    row.working = _accumulation_transient(model, tp, pp, work, trained < stage) * sb.grads
    row.bubble = formulas.pipeline_bubble(pp, work.accumulation)
    row.comm = _communication(model, tp, pp, frame.replicas, dense * sb.grads, local, hw)
    for term in TERMS:
        term.add_terms(row, frame)
    row.formulas["model states"] = (
        "max(first stage (L/p)·Ψ_layer/t + V'·h/t (V padded to a multiple V' of t) + other embeddings, "
        "last stage (L/p)·Ψ_layer/t + head) × (params + grads) + Adam"
        + (" / dp (shard_optimizer)" if shard_optimizer else "")
        + f"; bytes per parameter {sb.params}+{sb.grads}+"
        f"{sb.optimizer}"
    )
    row.formulas["working"] = "m > 1 micro-batches on a stage with the embedding: V'·h/t of gradient being added in"
    row.formulas["communication"] = (
        "TP: 4 all-reduces of s·b·h per layer per micro-batch; DP: all-reduce 2(dp−1)/dp of the gradients; "
        "PP: s·b·h forward + backward per micro-batch per boundary"
    )
    row.formulas["pipeline"] = formulas.BUBBLE_FORMULA + "; 1F1B stage 0 keeps min(p, m) micro-batches"
    return finish(row, model, work, hw)


def _activations(
    model: ModelSpec, work: Workload, hw: Hardware, *, tp: int, pp: int, in_flight: int, sp: bool
) -> float:
    """Bytes saved for backward on the most loaded stage's GPU: stage 0's (min(p, m) micro-batches in flight) and, for a
    language model under a pipeline, the larger of it and the last stage's (its layers, one micro-batch, the logits)."""
    common = {"tp": tp, "sequence_parallel": sp, "gathered_inputs": True}
    first_layers, last_layers = stage_layers(model, pp)
    if pp == 1 or not model.causal_lm:
        return activation_bytes(model, work, hw, layers=first_layers, in_flight=in_flight, **common)
    first = activation_bytes(model, work, hw, layers=first_layers, in_flight=in_flight, logits=False, **common)
    return max(first, activation_bytes(model, work, hw, layers=last_layers, in_flight=1, **common))


def _lora_not_built(sizes: Mapping[str, int]) -> list[str]:
    """The axes in use (size > 1) that LoRA adapters do not compose with yet (each axis's ``AxisOps.not_built``, what
    the megatron strategy refuses ``lora.use_lora`` with)."""
    from hftrain.parallel.axis_ops import declared

    return [spec.name for spec, ops in declared() if sizes.get(spec.name, 1) > 1 and "lora" in ops.not_built]


def _accumulation_transient(model: ModelSpec, tp: int, pp: int, work: Workload, lora: bool) -> float:
    """Gradient elements live beside the accumulated gradient while one micro-batch's is added in: the
    embedding's V·h/t when the most loaded stage holds it and a step has m > 1 micro-batches (none under LoRA:
    the embedding is frozen)."""
    if work.accumulation == 1 or lora:
        return 0.0
    if pp > 1 and stage_parameters(model, tp, pp) != _first_stage_parameters(model, tp, pp):
        return _vocab_parameters(model, tp)[1] if model.lm_head_parameters else 0.0  # an untied lm_head: as large
    return _vocab_parameters(model, tp)[1]


def layer_parameters_per_gpu(model: ModelSpec, tp: int, sizes: Mapping[str, int] | None = None) -> float:
    """One transformer layer's parameters on a tensor-parallel GPU (every rank the same): ``Ψ_layer/t``, except
    that key/value heads fewer than ``t`` are replicated, one per rank, so each rank holds ``1/kv`` of the key and
    value projections rather than ``1/t`` (``hftrain.parallel.plans.grouped_query_split``).

    A MoE model's layer (its mean over the layers): ``(Ψ_layer − X − R)/t + R + X_gpu`` with ``R`` the rest of its
    ``mlp`` (router, shared expert, dense MLPs: whole on every tp rank) and ``(X, X_gpu)`` the parameters the terms
    split instead of tp and one GPU's share of them (:meth:`AxisTerm.layer_parameters`: the routed experts
    ``X = Ψ_experts/L``, ``X/e`` per GPU).

    Args:
        model: the model.
        tp: tensor-parallel size t.
        sizes: each term's axis -> its size (1 when absent).
    """
    shares = [term.layer_parameters(model, (sizes or {}).get(term.axis, 1)) for term in TERMS]
    apart, held = sum(x for x, _ in shares), sum(x_gpu for _, x_gpu in shares)
    whole = model.replicated_mlp_parameters / model.layers
    split = model.layer_parameters - apart - whole
    kv = model.kv_heads
    if kv % tp == 0:
        return split / tp + whole + held
    head_dim = model.hidden / model.heads
    keys_values = 2 * model.hidden * kv * head_dim  # k and v (no biases)
    return (split - keys_values) / tp + keys_values / kv + whole + held


def _vocab_parameters(model: ModelSpec, tp: int) -> tuple[float, float]:
    """The embedding's logical ``V·h`` and one GPU's ``V'·h/t`` (the vocabulary padded to a multiple of t)."""
    from hftrain.parallel.plans import padded_vocab_size

    return model.vocab * model.hidden, padded_vocab_size(model.vocab, tp) * model.hidden / tp


def _head_per_gpu(model: ModelSpec, tp: int) -> float:
    """The last stage's head on one GPU: a language model's lm_head split over the vocabulary like the embedding
    (``VocabParallelHead``: V'·h/t; a tied one is the last stage's copy of the embedding, which the pipeline keeps
    beside the first stage's, ``hftrain.parallel.pipeline.place_stage_copies``), a classifier's head whole
    (replicated)."""
    return _vocab_parameters(model, tp)[1] if model.causal_lm else model.head_parameters


def _held(model: ModelSpec, layers: int) -> int:
    """The layer modules a stage of ``layers`` layers holds: one each, or at most the model's shared ones (ALBERT's
    group: every stage holds a copy of it, ``hftrain.parallel.pipeline.place_stage_copies``)."""
    return min(layers, model.held_layers)


def _first_stage_parameters(model: ModelSpec, tp: int, pp: int, sizes: Mapping[str, int] | None = None) -> float:
    vocab, vocab_per_gpu = _vocab_parameters(model, tp)
    layers = _held(model, stage_layers(model, pp)[0]) * layer_parameters_per_gpu(model, tp, sizes)
    return layers + vocab_per_gpu + model.embedding_parameters - vocab - model.head_parameters


def stage_parameters(model: ModelSpec, tp: int, pp: int, sizes: Mapping[str, int] | None = None) -> float:
    """Parameters one GPU of the most loaded pipeline stage holds (the first, with the embeddings, or the last,
    with the head), its layers split over ``tp`` (:func:`layer_parameters_per_gpu`; what a term splits instead,
    a MoE model's experts, over its axis) and the vocabulary-parallel embedding too.

    Args:
        model: the model.
        tp: tensor-parallel size t.
        pp: pipeline-parallel size p.
        sizes: each term's axis -> its size (1 when absent).
    """
    vocab, vocab_per_gpu = _vocab_parameters(model, tp)
    # replicated: positions, norms, pooler, classifier (a language model's untied lm_head is split: _head_per_gpu)
    outside = model.embedding_parameters - vocab - model.lm_head_parameters
    if pp == 1:
        head = _head_per_gpu(model, tp) if model.lm_head_parameters else 0.0
        return model.held_layers * layer_parameters_per_gpu(model, tp, sizes) + vocab_per_gpu + outside + head
    last = _held(model, stage_layers(model, pp)[1]) * layer_parameters_per_gpu(model, tp, sizes) + _head_per_gpu(
        model, tp
    )
    return max(_first_stage_parameters(model, tp, pp, sizes), last)


def _communication(
    model: ModelSpec, tp: int, pp: int, dp: int, grad_bytes: float, work: Workload, hw: Hardware
) -> dict[str, float]:
    """Bytes one GPU sends per step, by link: TP inside a node; DP and PP across nodes where their groups span.

    DP ranks are t apart, so a DP group spans nodes when t·dp exceeds the GPUs per node; pipeline neighbours
    are t·dp apart, on another node when t·dp is at least the GPUs per node (and there is more than one node).
    """
    m = work.accumulation
    sbh = work.seq * work.micro_batch * model.hidden * work.element
    comm = {"intra": 0.0, "inter": 0.0}
    comm["intra"] += m * (model.layers // pp) * 4 * formulas.all_reduce_bytes(sbh, tp)
    comm["inter" if tp * dp > hw.gpus_per_node else "intra"] += formulas.all_reduce_bytes(grad_bytes, dp)
    if pp > 1:
        crosses = hw.nodes > 1 and tp * dp >= hw.gpus_per_node
        comm["inter" if crosses else "intra"] += 2 * m * sbh
    return {link: nbytes for link, nbytes in comm.items() if nbytes}
