"""The arithmetic of the planner: model-state, activation and communication bytes, each formula stated.

Every function returns bytes (or a fraction) and has a ``FORMULA`` text next to it that the table, the JSON
and the README print, so that a figure can always be traced to its source:

- model states: the ZeRO paper (Rajbhandari et al. 2020), Adam with Ψ parameters over N data-parallel ranks;
- activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
  generalised from fp16 with dropout to any element size and to dropout off (see ``layer_activation_bytes``);
- communication: ring collectives (an all-reduce sends 2(N−1)/N of the buffer per rank, an all-gather or a
  reduce-scatter (N−1)/N) and point-to-point sends between pipeline stages;
- the pipeline bubble of 1F1B (p−1)/(m+p−1) and of the interleaved schedule (p−1)/(v·m+p−1).
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per parameter of each model state, per precision and optimizer owner (Adam)
#   mixed precision, DeepSpeed (the ZeRO paper's K = 12): bf16 params 2, bf16 grads 2, fp32 master+m+v 12
#   mixed precision under Accelerate autocast (DDP, FSDP, megatron): fp32 params 4, fp32 grads 4, m+v 8
#   fp32: params 4, grads 4, m+v 8; DeepSpeed 0.19.8 keeps a fp32 master copy of its partition at stages 1-2 (+4);
#   at stage 3 hftrain makes the master the partition itself (strategies.deepspeed.runtime.alias_fp32_master)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of parameters, gradients and optimizer state (master weights included).

    Args:
        params: bytes of one parameter as the model holds it.
        grads: bytes of one gradient element.
        optimizer: bytes of optimizer state per parameter (Adam's two moments, plus the fp32 master copy).
        grad_accumulation: bytes per element of the unsharded gradients FSDP keeps between micro-batches.
    """

    params: int
    grads: int
    optimizer: int
    grad_accumulation: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(precision: str, *, deepspeed: bool, shared_master: bool = False) -> StateBytes:
    """Bytes per parameter for ``precision`` (``bf16``, ``fp16`` or ``fp32``) and the optimizer's owner.

    Args:
        precision: the training precision.
        deepspeed: True for DeepSpeed's ZeRO optimizer, which keeps bf16 params/grads and a fp32 master copy.
        shared_master: in fp32, the master copy is the (partitioned) parameter itself (ZeRO-3 under hftrain).
    """
    if precision == "fp32":
        return StateBytes(4, 4, 12 if deepspeed and not shared_master else 8, 4)
    if deepspeed:
        return StateBytes(2, 2, 12, 2)
    return StateBytes(4, 4, 8, 2)  # autocast keeps fp32 states; its accumulated grads are in the compute dtype


ACTIVATION_FORMULA = (
    "per layer s·b·h·(16e + 2m) + a·s²·b·(e + m + e·[dropout]) [+ gated MLP 2e·s·b·i] (e bytes per activation, "
    "m per dropout mask); fp16 with dropout (e=2, m=1): s·b·h·(34 + 5·a·s/h) (Korthikanti et al. 2022); "
    "tensor parallel t: s·b·h·(4e+2m) + (12e·s·b·h + attention)/t (fp16: s·b·h·(10 + 24/t + 5·a·s/(h·t))), "
    "with sequence parallelism all of it /t; full recomputation: e·s·b·h per layer (2·s·b·h) plus one layer "
    "recomputed; selective recomputation and fused attention (flash/SDPA without dropout) save no a·s² term; "
    "validated: hftrain's saved tensors per layer (BERT-base, SmolLM2; off, full, selective) within 7% "
    "(tests/test_recompute.py)"
)


def layer_activation_bytes(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    intermediate: int,
    element: int,
    mask: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    fused_attention: bool = False,
    gated_mlp: bool = False,
    gathered_inputs: bool = False,
) -> float:
    """Bytes one transformer layer saves for backward (Korthikanti et al. 2022, §4), per tensor-parallel rank.

    The paper's terms (fp16, dropout on) with the element size ``e`` and the dropout-mask size ``m`` made
    explicit: attention: QKV input e, Q and K 2e, V e, output-projection input e, dropout mask m (× s·b·h),
    the softmax output e, its dropout mask m and the dropout output e (× a·s²·b); MLP: input e, activation
    input e·i/h, second linear's input e·i/h, dropout mask m (× s·b·h); two LayerNorm inputs 2e. With i = 4h:
    s·b·h·(16e + 2m) + a·s²·b·(2e + m), the paper's 34·s·b·h + 5·a·s²·b at e=2, m=1. Under tensor
    parallelism the LayerNorm, QKV and MLP inputs and the two dropout masks (4e + 2m) stay whole unless
    sequence parallelism splits them too; the rest is split over t.

    Args:
        seq: sequence length s.
        micro_batch: micro-batch size b.
        hidden: hidden size h.
        heads: attention heads a.
        intermediate: MLP width i (4h in the paper).
        element: bytes per saved activation element e (2 for bf16/fp16, 4 for fp32).
        mask: bytes per dropout-mask element m: 0 without dropout, 1 on GPUs (bool masks), 4 on CPU (torch's
            CPU dropout saves a float mask).
        tp: tensor-parallel size t.
        sequence_parallel: Megatron sequence parallelism.
        fused_attention: a fused attention kernel (flash, SDPA without dropout) that saves no a·s² scores.
        gated_mlp: a gated MLP (SwiGLU: the gate and up outputs and the activation's output are saved too).
        gathered_inputs: under sequence parallelism, the column-parallel layers save their all-gathered input
            (2e·s·b·h whole: hftrain's layers, measured) rather than the 1/t chunk (Megatron-LM re-gathers it
            in backward).
    """
    e = element
    sbh = seq * micro_batch * hidden
    mlp_inner = e * intermediate / hidden * (4 if gated_mlp else 2)  # activation input + second linear's input
    whole = (4 * e + 2 * mask) * sbh  # LayerNorm inputs, QKV input, MLP input, the two dropout masks
    split = (4 * e + mlp_inner) * sbh  # Q, K, V, output-projection input, the MLP's inner activations
    per_score = e + (mask + e if mask else 0)  # softmax output, and with dropout its mask and output
    scores = 0 if fused_attention else heads * seq * seq * micro_batch * per_score
    if sequence_parallel and gathered_inputs:
        whole = whole / tp + 2 * e * sbh * (1 - 1 / tp)  # the QKV and MLP inputs are kept all-gathered
    elif sequence_parallel:
        whole = whole / tp
    return whole + (split + scores) / tp


def embedding_activation_bytes(*, seq: int, micro_batch: int, hidden: int, element: int, mask: int) -> float:
    """Bytes saved outside the layers: the embedding LayerNorm's (or final norm's) input and a dropout mask.

    Args:
        seq: sequence length s.
        micro_batch: micro-batch size b.
        hidden: hidden size h.
        element: bytes per activation element.
        mask: bytes per dropout-mask element (0 without dropout).
    """
    return (element + mask) * seq * micro_batch * hidden


LOGITS_FORMULA = (
    "causal LM: + s·b·V'·(e + 4)/t per micro-batch (the logits in e bytes and the fp32 loss buffer, alive together "
    "when the loss is computed at the end of the forward: data-parallel "
    "rows t = 1, V' = V, F.cross_entropy's fp32 log-softmax; megatron tp each rank's vocabulary slice V'/t, V' = V "
    "padded to a multiple of t, the vocabulary-parallel loss's one fp32 buffer), on the last pipeline stage; not "
    "recomputed"
)


def logits_activation_bytes(*, seq: int, micro_batch: int, vocab: int, element: int, tp: int = 1) -> float:
    """Bytes a language model's logits and loss hold from the forward to the backward, per micro-batch and GPU:
    ``s·b·V'·(e + 4)/t``.

    The output projection's logits, ``[b, s, V'/t]`` in the activation dtype (``e`` bytes; alive while the training
    step computes the loss from them, at the end of the forward, where the saved activations peak), and the loss's
    fp32 buffer of the same shape (4 bytes) kept for the backward:
    ``F.cross_entropy(logits.float())``'s log-softmax on the data-parallel rows (``t = 1``, ``V' = V``;
    ``hftrain.parallel.cross_entropy.cross_entropy_per_token``), the vocabulary-parallel loss's softmax of the rank's
    slice under megatron tp (``V'`` = ``V`` padded to a multiple of ``t``; no rank holds full-vocabulary logits).
    The loss is over ``s − 1`` positions of each sequence; the formula counts ``s`` (the logits are ``s``).

    Args:
        seq: sequence length s (the positions this GPU holds).
        micro_batch: micro-batch size b.
        vocab: the vocabulary V' the logits span over all tp ranks (padded to a multiple of ``tp``).
        element: bytes per logit e (2 for bf16/fp16, 4 for fp32).
        tp: tensor-parallel size t (the vocabulary split).
    """
    return seq * micro_batch * vocab * (element + 4) / tp


def recomputed_layer_bytes(
    *, seq: int, micro_batch: int, hidden: int, element: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Bytes a layer keeps under full activation recomputation: its input, e·s·b·h (the paper's 2·s·b·h).

    Args:
        seq: sequence length s.
        micro_batch: micro-batch size b.
        hidden: hidden size h.
        element: bytes per element.
        tp: tensor-parallel size (the input is split only under sequence parallelism).
        sequence_parallel: Megatron sequence parallelism.
    """
    return element * seq * micro_batch * hidden / (tp if sequence_parallel else 1)


RING_FORMULA = "ring all-reduce 2(N−1)/N × bytes; all-gather and reduce-scatter (N−1)/N × bytes, per rank"


def all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n−1)/n · nbytes.

    Args:
        nbytes: size of the buffer.
        n: ranks in the group.
    """
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def all_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-gather (or reduce-scatter) of a ``nbytes`` buffer: (n−1)/n · nbytes.

    Args:
        nbytes: size of the whole (gathered) buffer.
        n: ranks in the group.
    """
    return (n - 1) / n * nbytes if n > 1 else 0.0


BUBBLE_FORMULA = "1F1B: (p−1)/(m+p−1); interleaved with v chunks per stage: (p−1)/(v·m+p−1)"


def pipeline_bubble(pp: int, micro_batches: int, chunks: int = 1) -> float:
    """Fraction of a step the pipeline idles: (p−1)/(v·m+p−1) (v = 1: 1F1B / GPipe).

    Args:
        pp: pipeline stages p.
        micro_batches: micro-batches per step m (the gradient accumulation).
        chunks: model chunks per stage v (interleaved schedule).
    """
    return (pp - 1) / (chunks * micro_batches + pp - 1)
