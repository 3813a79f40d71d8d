"""Megatron-style TP × PP × DP layouts: which the hardware and model admit, and one estimator.

Ranks are laid out like ``hftrain.parallel.ParallelDims`` (Megatron-LM's order): tensor-parallel ranks
adjacent (inside a node: t divides the GPUs per node), then data parallel, pipeline outermost. Per GPU of the
most loaded pipeline stage (model states: the first or the last; activations: stage 0):

- parameters: (L/p)·Ψ_layer/t + V'·h/t (vocabulary-parallel embedding, V padded up to a multiple V' of t) + the
  rest of the embeddings (replicated)
  on the first stage, (L/p)·Ψ_layer/t + the head (pooler, final norm, classifier) on the last, the larger of
  the two (p = 1: all of it); gradients the same; Adam state the same, or /dp with ``shard_optimizer``
  (ZeRO-1, which hftrain runs at p = 1 only);
- working memory: with m > 1 micro-batches per step, one micro-batch's gradient of the largest tensor is live
  beside the accumulated one while autograd adds it in (``grad += g``): V·h/t on a stage holding the embedding
  (measured: a 108 MiB embedding peaks at 222 MiB of gradient over 4 micro-batches; the layers' matrices are
  small beside a stage);
- activations: Korthikanti et al. 2022 per layer over t (with sequence parallelism; hftrain's column-parallel
  layers keep their all-gathered input, 2e·s·b·h, whole), × L/p layers × the
  micro-batches 1F1B keeps in flight on stage 0 (min(p, m)); a language model (``model.task: causal_lm``) adds its
  logits and loss buffer s·b·V'·(e + 4)/t (:func:`hftrain.plan.formulas.logits_activation_bytes`: the output
  projection split over the vocabulary, the vocabulary-parallel loss), on the last stage under a pipeline (pp with
  cp is formula-only for a language model: ``ModelSpec.refused_layouts``), ÷ cp under context parallelism; its
  untied lm_head is split over t like the embedding (V'·h/t);
- communication per step: TP 2 all-reduces forward + 2 backward of s·b·h per layer and micro-batch (the same
  volume as all-gather + reduce-scatter under sequence parallelism); DP one all-reduce of the GPU's gradients;
  PP one s·b·h send forward and one backward per micro-batch and stage boundary; the bubble (p−1)/(m+p−1).

Mixture of experts (``ModelSpec.moe``), with expert parallelism e (``ep``: e consecutive dp ranks split the routed
experts of every MoE layer, Megatron's rule, so e divides dp and the experts E; ``hftrain.parallel.ParallelDims``):

- parameters: a layer's routed experts ``Ψ_experts/L`` are divided by e (not by t), the rest of its ``mlp``
  (router, shared expert, Qwen2-MoE's dense MLPs) is whole on every GPU (hftrain's tp plans replicate the MoE
  block over tp), its attention is split over t as above; gradients the same; Adam's state the same, its dense part
  /dp and its expert part /(dp/e) (the expert-data-parallel ranks holding the same experts) under
  ``shard_optimizer``;
- communication: the dense gradients all-reduced over dp, the experts' over dp/e; and the token all-to-all per MoE
  layer and micro-batch (:func:`hftrain.plan.formulas.all_to_all_bytes`): dispatch and combine each send
  ``T·k·h·e_b·(e−1)/e`` per GPU forward and the same again backward (T = b·s/c tokens of the GPU, k = top-k,
  e_b bytes per element), over the intra-node link when the e group's t·c·e consecutive ranks fit in a node;
- no sequence parallelism: the MoE block needs the whole sequence (``hftrain.parallel.plans``); no ZeRO-1 with
  e > 1; rows with e > 1 and p > 1 or c > 1 are not listed, and formula only where asked for (hftrain's megatron
  strategy composes ep with tp and dp), and MoE rows with c > 1 are formula only (rows whose axes the model's
  family does not take are formula-only: ``hftrain.parallel.families``); p > 1 at e = 1 runs (each stage adds its
  layers' router-loss sums).

Every row is hftrain's ``megatron`` strategy; with p > 1 the plan's m micro-batches of b become the
pipeline's ``num_microbatches`` = m over a per-device batch of m·b (1F1B, or GPipe when m < p, which 1F1B
refuses; both keep min(p, m) micro-batches on stage 0).
"""

from __future__ import annotations

import dataclasses

import hftrain.plan.formulas as formulas
from hftrain.errors import ConfigError
from hftrain.plan.common import activation_bytes, finish
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec, divisors
from hftrain.plan.rows import Row, Workload


def layouts(
    model: ModelSpec, hw: Hardware, *, tp: int | None = None, pp: int | None = None, cp: int = 1, unsplit: bool = False
) -> list[tuple[int, int]]:
    """(t, p) pairs other than (1, 1): t divides the GPUs per node and the model's sizes, p divides the layers,
    and t·p (·cp) divides the world. ``tp``/``pp`` fix one (checked against the model: a size that does not divide
    is an error). With ``cp > 1`` (context parallelism) t and p may both be 1.

    Args:
        model: the model.
        hw: the hardware.
        tp: only this tensor-parallel size.
        pp: only this pipeline-parallel size.
        cp: the context-parallel size of every layout.
        unsplit: include (1, 1) too (expert parallelism may split the experts alone).
    """
    if tp is not None or pp is not None:
        model.check_parallel(tp or 1, pp or 1)
    tps = [tp] if tp else divisors(hw.gpus_per_node)
    pps = [pp] if pp else divisors(model.layers)
    return [
        (t, p)
        for t in tps
        for p in pps
        if ((t, p) != (1, 1) or cp > 1 or unsplit) and hw.world % (t * p * cp) == 0 and model.admits(t, p)
    ]


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
    import math

    return divisors(math.gcd(dp, model.experts)) if model.moe else [1]


def expert_layouts(
    model: ModelSpec,
    hw: Hardware,
    *,
    tp: int | None = None,
    pp: int | None = None,
    cp: int = 1,
    ep: int | None = None,
) -> list[tuple[int, int, int]]:
    """(t, p, e) triples other than (1, 1, 1) at cp = 1: the :func:`layouts`, each with every expert-parallel size e
    that divides its dp and the experts (:func:`expert_sizes`), or only ``ep``, kept where training takes the layout
    (``ParallelDims.validate_trainable``: ep > 1 composes with tp and dp only). An ``ep`` the model cannot split
    (a dense model, or not dividing the experts), or that divides the data-parallel size of no layout, is refused in
    one line naming ``--ep``.

    Args:
        model: the model.
        hw: the hardware.
        tp: only this tensor-parallel size.
        pp: only this pipeline-parallel size.
        cp: the context-parallel size of every layout.
        ep: only this expert-parallel size.
    """
    from hftrain.errors import AxisError
    from hftrain.parallel.dims import ParallelDims

    if ep is not None:
        check_experts(model, ep)
    if ep is not None and ep > 1 and ((pp or 1) > 1 or cp > 1):
        raise ConfigError(
            f"--ep {ep} with --pp {pp or 1} / --cp {cp}: training composes expert parallelism with tp and dp only; "
            "drop --pp/--cp or --ep"
        )
    triples = []
    for t, p in layouts(model, hw, tp=tp, pp=pp, cp=cp, unsplit=model.moe):
        dp = hw.world // (t * p * cp)
        for e in [ep] if ep is not None else expert_sizes(model, dp):
            if dp % e or ((t, p, e) == (1, 1, 1) and cp == 1):
                continue
            try:  # only what training takes (the one layout check, ParallelDims.validate_trainable)
                ParallelDims(hw.world, tp=t, pp=p, cp=cp, ep=e).validate_trainable()
            except AxisError:
                continue
            triples.append((t, p, e))
    if ep is not None and ep > 1 and not triples:
        raise ConfigError(
            f"--ep {ep} divides the data-parallel size of no layout on {hw.world} GPUs (ep consecutive data-parallel "
            f"ranks split the experts); give an --ep dividing {hw.world} // (tp·pp·cp), or more GPUs"
        )
    return triples


def fixed_layouts(
    model: ModelSpec,
    hw: Hardware,
    *,
    tp: int | None = None,
    pp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
) -> list[dict[str, int]]:
    """The :func:`expert_layouts` as ``{"tp", "pp", "cp", "ep"}`` sizes (:func:`estimate`'s keywords), with the
    sizes a plan fixed (None: searched; cp, which is not searched, 1).

    Args:
        model: the model.
        hw: the hardware.
        tp: only this tensor-parallel size.
        pp: only this pipeline-parallel size.
        cp: the context-parallel size of every layout (None: 1).
        ep: only this expert-parallel size.
    """
    cp = cp or 1
    return [{"tp": t, "pp": p, "cp": cp, "ep": e} for t, p, e in expert_layouts(model, hw, tp=tp, pp=pp, cp=cp, ep=ep)]


def estimate(tp: int, pp: int, model: ModelSpec, work: Workload, hw: Hardware, *, cp: int = 1, ep: int = 1) -> Row:
    """One TP × CP × PP × DP (× EP) row (the most loaded stage's GPU); at p = 1 with sequence parallelism when t > 1
    (and c = 1, and the model has no experts) and ZeRO-1 when dp > 1.

    Context parallelism splits every sequence over c ranks: each GPU's activations are those of s/c positions
    (the plan's per-layer formula at s/c), and each layer exchanges keys and values (``_context_bytes``); a
    classifier's head gathers the whole sequences' hidden states once (``_context_gather_bytes``). Expert
    parallelism splits a MoE model's routed experts over e of the dp ranks (the module docstring).

    Args:
        tp: tensor-parallel size t.
        pp: pipeline-parallel size p.
        model: the model.
        work: the workload.
        hw: the hardware.
        cp: context-parallel size c.
        ep: expert-parallel size e (divides dp and the model's experts; 1 for a dense model).
    """
    dp = hw.world // (tp * pp * cp)
    sb = formulas.state_bytes(work.precision, deepspeed=False)
    stage = stage_parameters(model, tp, pp, ep)
    trained = stage * model.lora_parameters(work.lora_rank) / model.parameters if work.lora_rank else stage
    # the routed experts on this GPU (frozen under LoRA, which adapts the attention only)
    experts = stage_expert_parameters(model, pp, ep)
    trained_experts = 0.0 if work.lora_rank else experts
    # hftrain's pipeline stages do not split the sequence (nor run ZeRO-1): both at p = 1 only; a MoE model's tp plan
    # (and ALBERT's: model.sequence_parallel, from the registry) refuses sequence parallelism, and expert parallelism
    # composes with tp and dp only (no ZeRO-1, pp or cp yet)
    sequence_parallel = tp > 1 and pp == 1 and cp == 1 and not model.moe and model.sequence_parallel
    shard_optimizer = dp > 1 and pp == 1 and ep == 1
    in_flight = min(pp, work.accumulation)
    label = f"megatron tp{tp}·cp{cp}·pp{pp}·dp{dp}" if cp > 1 else f"megatron tp{tp}·pp{pp}·dp{dp}"
    label += f"·ep{ep}" if ep > 1 else ""
    local = dataclasses.replace(work, seq=-(-work.seq // cp))  # the positions one GPU holds
    strategy: dict[str, object] = {
        "name": "megatron",
        "tp": tp,
        "sequence_parallel": sequence_parallel,
        "shard_optimizer": shard_optimizer,
    }
    if cp > 1:
        strategy.update(cp=cp, cp_comm=_context_comm(model, tp, cp))
    if pp > 1:  # hftrain's 1F1B needs at least p micro-batches; GPipe runs fewer
        schedule = "1f1b" if work.accumulation >= pp else "gpipe"
        strategy.update(pp=pp, num_microbatches=work.accumulation, schedule=schedule)
    if ep > 1:
        strategy["ep"] = ep
    dense = trained - trained_experts
    row = Row(
        label,
        strategy,
        tp,
        pp,
        dp,
        params=stage * sb.params,
        grads=trained * sb.grads,
        # ZeRO-1 shards the dense state over dp, the experts' over the dp/e ranks holding the same experts
        optimizer=(dense / (dp if shard_optimizer else 1) + trained_experts / (dp // ep if shard_optimizer else 1))
        * sb.optimizer,
        activations=_activations(model, local, hw, tp=tp, pp=pp, in_flight=in_flight, sp=sequence_parallel),
    )
    row.cp = cp
    row.ep = ep
    sizes = (("tp", tp), ("pp", pp), ("cp", cp))
    refused = [axis for axis, size in sizes if size > 1 and axis not in model.axes]
    if refused:  # the family's registry entry (hftrain.parallel.families): what the trainer would refuse
        row.runnable = False
        row.notes.append(f"formula only: hftrain's trainer takes no {'/'.join(refused)} for this model family")
    split = {axis for axis, size in sizes if size > 1}
    unbuilt = [axes for axes in model.refused_layouts if split.issuperset(axes)]
    unbuilt += [("ep", axis) for axis, size in sizes if ep > 1 and axis in ("pp", "cp") and size > 1]
    if unbuilt and not refused:  # LANGUAGE_MODEL_LAYOUTS_NOT_BUILT (causal_lm); ParallelDims.validate_trainable (ep)
        row.runnable = False
        axes = " with ".join(unbuilt[0])
        row.notes.append(f"formula only: hftrain's trainer takes no {axes} for model.task {model.task} yet")
    row.experts = experts * sb.params + trained_experts * sb.grads
    row.experts += trained_experts * sb.optimizer / (dp // ep if shard_optimizer else 1)
    row.working = _accumulation_transient(model, tp, pp, work, trained < stage) * sb.grads
    row.bubble = formulas.pipeline_bubble(pp, work.accumulation)
    row.comm = _communication(model, tp, pp, dp * cp, dense * sb.grads, local, hw)
    if model.moe:
        # the experts' gradients over their dp·c/e replicas (c: context parallelism joins the dp all-reduce)
        link = "inter" if tp * dp * cp > hw.gpus_per_node else "intra"
        row.comm[link] = row.comm.get(link, 0.0) + formulas.all_reduce_bytes(trained_experts * sb.grads, dp * cp // ep)
        row.all_to_all = formulas.all_to_all_bytes(
            tokens=local.micro_batch * local.seq, top_k=model.top_k, hidden=model.hidden, element=work.element, ep=ep
        )
        if ep > 1:
            link = "inter" if tp * cp * ep > hw.gpus_per_node else "intra"
            moe_layers = -(-model.moe_layers // pp)  # the most loaded stage's
            row.comm[link] = row.comm.get(link, 0.0) + work.accumulation * moe_layers * row.all_to_all
        row.formulas["experts"] = (
            "routed experts Ψ_experts·(L/p)/L / e per GPU (not split by t: the MoE block is whole on every tp rank); "
            "Adam's expert state / (dp/e) under shard_optimizer; all-to-all per MoE layer and micro-batch: "
            + formulas.ALL_TO_ALL_FORMULA
        )
    if cp > 1:
        gather = 0.0 if model.causal_lm else _context_gather_bytes(model, cp, work)
        row.comm["intra"] = row.comm.get("intra", 0.0) + _context_bytes(model, tp, cp, work) + gather
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


def _accumulation_transient(model: ModelSpec, tp: int, pp: int, work: Workload, lora: bool) -> float:
    """Gradient elements live beside the accumulated gradient while one micro-batch's is added in: the
    embedding's V·h/t when the most loaded stage holds it and a step has m > 1 micro-batches (none under LoRA:
    the embedding is frozen)."""
    if work.accumulation == 1 or lora:
        return 0.0
    if pp > 1 and stage_parameters(model, tp, pp) != _first_stage_parameters(model, tp, pp):
        return _vocab_parameters(model, tp)[1] if model.lm_head_parameters else 0.0  # an untied lm_head: as large
    return _vocab_parameters(model, tp)[1]


def layer_parameters_per_gpu(model: ModelSpec, tp: int, ep: int = 1) -> float:
    """One transformer layer's parameters on a tensor-parallel GPU (every rank the same): ``Ψ_layer/t``, except
    that key/value heads fewer than ``t`` are replicated, one per rank, so each rank holds ``1/kv`` of the key and
    value projections rather than ``1/t`` (``hftrain.parallel.plans.grouped_query_split``).

    A MoE model's layer (its mean over the layers): ``(Ψ_layer − X − R)/t + R + X/e`` with ``X = Ψ_experts/L``
    (routed experts, split over e) and ``R`` the rest of its ``mlp`` (router, shared expert, dense MLPs: whole on
    every tp rank).

    Args:
        model: the model.
        tp: tensor-parallel size t.
        ep: expert-parallel size e.
    """
    experts = model.expert_parameters / model.layers
    whole = model.replicated_mlp_parameters / model.layers
    split = model.layer_parameters - experts - whole
    kv = model.kv_heads
    if kv % tp == 0:
        return split / tp + whole + experts / ep
    head_dim = model.hidden / model.heads
    keys_values = 2 * model.hidden * kv * head_dim  # k and v (no biases)
    return (split - keys_values) / tp + keys_values / kv + whole + experts / ep


def stage_expert_parameters(model: ModelSpec, pp: int, ep: int = 1) -> float:
    """The routed experts' parameters on one GPU of the most loaded stage: ``Ψ_experts · (L_stage/L) / e``.

    Args:
        model: the model.
        pp: pipeline-parallel size p.
        ep: expert-parallel size e.
    """
    return model.expert_parameters * stage_layers(model, pp)[1] / model.layers / ep


def stage_layers(model: ModelSpec, pp: int) -> tuple[int, int]:
    """Layers of the first and of the last pipeline stage: the extra layers of an uneven split go to the last
    stages (the first embeds), as ``hftrain.parallel.stage_layer_ranges`` cuts them."""
    return model.layers // pp, -(-model.layers // pp)


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


def _first_stage_parameters(model: ModelSpec, tp: int, pp: int, ep: int = 1) -> float:
    vocab, vocab_per_gpu = _vocab_parameters(model, tp)
    layers = _held(model, stage_layers(model, pp)[0]) * layer_parameters_per_gpu(model, tp, ep)
    return layers + vocab_per_gpu + model.embedding_parameters - vocab - model.head_parameters


def stage_parameters(model: ModelSpec, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters one GPU of the most loaded pipeline stage holds (the first, with the embeddings, or the last,
    with the head), its layers split over ``tp`` (:func:`layer_parameters_per_gpu`; a MoE model's experts over
    ``ep``) and the vocabulary-parallel embedding too.

    Args:
        model: the model.
        tp: tensor-parallel size t.
        pp: pipeline-parallel size p.
        ep: expert-parallel size e.
    """
    vocab, vocab_per_gpu = _vocab_parameters(model, tp)
    # replicated: positions, norms, pooler, classifier (a language model's untied lm_head is split: _head_per_gpu)
    outside = model.embedding_parameters - vocab - model.lm_head_parameters
    if pp == 1:
        head = _head_per_gpu(model, tp) if model.lm_head_parameters else 0.0
        return model.held_layers * layer_parameters_per_gpu(model, tp, ep) + vocab_per_gpu + outside + head
    last = _held(model, stage_layers(model, pp)[1]) * layer_parameters_per_gpu(model, tp, ep) + _head_per_gpu(model, tp)
    return max(_first_stage_parameters(model, tp, pp, ep), last)


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
