"""What every estimator shares: activations per GPU, compute time, and the step time and fit of a row."""

from __future__ import annotations

import hftrain.plan.formulas as formulas
from hftrain.plan.hardware import Hardware
from hftrain.plan.model import ModelSpec
from hftrain.plan.rows import Row, Workload

COMM_FORMULA = "not overlapped with compute; bytes / link bandwidth (" + formulas.RING_FORMULA + ")"


def activation_bytes(
    model: ModelSpec,
    work: Workload,
    hw: Hardware,
    *,
    layers: int,
    in_flight: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    gathered_inputs: bool = False,
    logits: bool = True,
) -> float:
    """Bytes a GPU saves for backward: ``layers`` layers × ``in_flight`` micro-batches, plus the embedding's, plus a
    language model's logits and loss buffer for one micro-batch (``formulas.logits_activation_bytes``: split over
    the vocabulary under tp; the last pipeline stage's, which keeps one micro-batch in flight).

    Under full recomputation each layer keeps only its input, and one layer is recomputed at a time; under
    selective recomputation a layer keeps everything but its attention scores (the fused-attention layer), and one
    layer's scores are recomputed at a time.

    Args:
        model: the model.
        work: the workload.
        hw: the hardware (its dropout-mask element size).
        layers: layers this GPU runs.
        in_flight: micro-batches whose activations are alive at once (1F1B stage 0: min(p, m)).
        tp: tensor-parallel size.
        sequence_parallel: Megatron sequence parallelism.
        gathered_inputs: see ``formulas.layer_activation_bytes`` (True for hftrain's tensor-parallel layers).
        logits: count a causal LM's logits here (False for a pipeline stage without the output projection).
    """
    mask = hw.dropout_mask_bytes if work.dropout else 0
    shape = {"seq": work.seq, "micro_batch": work.micro_batch, "hidden": model.hidden, "element": work.element}
    layer = {
        **shape,
        "heads": model.heads,
        "intermediate": model.activation_intermediate,  # a MoE layer: its top-k experts' widths
        "mask": mask,
        "tp": tp,
        "sequence_parallel": sequence_parallel,
        "gated_mlp": model.gated_mlp,
        "gathered_inputs": gathered_inputs,
    }
    full = formulas.layer_activation_bytes(**layer, fused_attention=work.fused_attention)
    if work.recompute == "full":
        kept = formulas.recomputed_layer_bytes(**shape, tp=tp, sequence_parallel=sequence_parallel)
    elif work.recompute == "selective":
        kept = formulas.layer_activation_bytes(**layer, fused_attention=True)
    else:
        kept = full
    # the layer being recomputed holds its activations again (full: beside its kept input; selective: its scores)
    extra = {"full": full, "selective": full - kept}.get(work.recompute or "", 0.0)
    embedding = formulas.embedding_activation_bytes(**shape, mask=mask)
    return layers * in_flight * kept + extra + embedding + (logits_bytes(model, work, tp=tp) if logits else 0.0)


def logits_bytes(model: ModelSpec, work: Workload, *, tp: int = 1) -> float:
    """A causal LM's logits and fp32 loss buffer per micro-batch on one GPU (0 for a classifier): ``s·b·V'·(e + 4)/t``,
    ``V'`` the vocabulary padded to a multiple of ``t`` (``hftrain.parallel.plans.padded_vocab_size``)."""
    from hftrain.parallel.plans import padded_vocab_size

    if not model.causal_lm:
        return 0.0
    vocab = padded_vocab_size(model.vocab, tp)
    return formulas.logits_activation_bytes(
        seq=work.seq, micro_batch=work.micro_batch, vocab=vocab, element=work.element, tp=tp
    )


def compute_seconds(model: ModelSpec, work: Workload, hw: Hardware, *, model_split: int) -> float:
    """Seconds of arithmetic per step on one GPU: k·Ψ·tokens / (split · TFLOP/s · efficiency).

    k = 6 (forward 2 + backward 4), 8 with recomputation (one more forward), 4 with LoRA (no weight gradients
    for the frozen weights). Tokens: micro-batch × sequence × accumulation. Ψ is a MoE model's active parameters,
    Ψ − (1 − k_e/E)·Ψ_experts.

    Args:
        model: the model.
        work: the workload.
        hw: the hardware.
        model_split: GPUs one copy of the model is split over (t·p).
    """
    k = (4 if work.lora_rank else 6) + (2 if work.recompute == "full" else 0)  # selective: a few percent
    tokens = work.micro_batch * work.seq * work.accumulation
    # a MoE model: each token runs through k of the E experts (ModelSpec.active_parameters)
    return k * model.active_parameters * tokens / (model_split * hw.tflops * 1e12 * hw.efficiency)


def finish(row: Row, model: ModelSpec, work: Workload, hw: Hardware) -> Row:
    """Fill in a row's times, throughput and fit from its bytes.

    Args:
        row: a row with its bytes and communication filled in.
        model: the model.
        work: the workload.
        hw: the hardware.
    """
    bandwidth = {"intra": hw.bandwidth(False), "inter": hw.bandwidth(True), "pcie": BANDWIDTH_PCIE}
    row.comm_seconds = sum(nbytes / bandwidth[link] for link, nbytes in row.comm.items())
    row.compute_seconds = compute_seconds(model, work, hw, model_split=row.model_split)
    row.step_seconds = row.compute_seconds / (1 - row.bubble) + row.comm_seconds
    tokens = work.micro_batch * work.seq * work.accumulation * row.dp
    row.tokens_per_second = tokens / row.step_seconds
    gpu_ok = row.total <= hw.usable_memory
    cpu_ok = row.cpu_per_node <= hw.cpu_memory
    row.fits = gpu_ok and cpu_ok
    if not gpu_ok:
        row.notes.append(f"needs {row.total / 1e9:.1f} GB per GPU, {hw.usable_memory / 1e9:.1f} GB usable")
    if not cpu_ok:
        row.notes.append(
            f"offload needs {row.cpu_per_node / 1e9:.1f} GB CPU memory per node, {hw.cpu_memory / 1e9:.1f} GB given"
        )
    row.formulas.setdefault(
        "activations", formulas.ACTIVATION_FORMULA + ("; " + formulas.LOGITS_FORMULA if model.causal_lm else "")
    )
    row.formulas.setdefault("time", f"compute k·Ψ·tokens/(t·p·TFLOP/s·efficiency), /(1 − bubble); comm {COMM_FORMULA}")
    return row


BANDWIDTH_PCIE = 12e9  # host <-> GPU copies of offload


def stage_layers(model: ModelSpec, pp: int) -> tuple[int, int]:
    """Layers of the first and of the last pipeline stage: the extra layers of an uneven split go to the last
    stages (the first embeds), as ``hftrain.parallel.stage_layer_ranges`` cuts them."""
    return model.layers // pp, -(-model.layers // pp)
