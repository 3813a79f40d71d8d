"""Context parallelism: attention over a sequence split across the ``cp`` ranks (ring, or all-to-all): the wiring.

Each of the ``cp`` ranks holds ``S / cp`` positions of every sequence: its queries ``Q_r``, keys ``K_r`` and values
``V_r`` ``[b, h, S/cp, d]``, a key-keep mask ``[b, S/cp]`` (padding) and the global position of each of its
tokens. The positions are what make a split exact whatever its order: causal masking compares positions, never
indices, so the load-balancing **zigzag** layout (:func:`zigzag_positions`: rank ``r`` holds chunks ``r`` and
``2·cp − 1 − r`` of ``2·cp``, so every rank has as many early as late queries and causal work is even) needs
nothing else. Packed sequences (a language model's blocks, whose position ids restart at every document) also carry
each token's document (:func:`packed_segments`), and a key is visible only in its query's document, as transformers'
packed mask has it on one process.

The math is in three modules (picotron's algorithm/communications split): ``hftrain.parallel.cp_kernels`` (the zigzag
layout, the masks, the fused attention of one block and the online-softmax merge), ``hftrain.parallel.cp_scored``
(the kernels of a block whose scores pass through a modification before the softmax: Gemma-2's soft-capping
``S' = c · tanh(S / c)``, by the block's math on a CPU and torch's ``flex_attention`` on CUDA) and
``hftrain.parallel.cp_attention`` (the ring and all-to-all algorithms: their forward, backward and messages). The
masks are a key's padding, causality, packed documents and sliding windows: causal (``0 ≤ p_q − p_k < w``) or
bidirectional (ModernBERT's local layers, ``|p_q − p_k| < w``, ``w`` as transformers passes ``sliding_window``). This
module holds what cp can split (the checks), the HF attention registration, :class:`ContextSplit` and
:func:`apply_context_parallel`; it re-exports the others' public names.

**The model** (:func:`apply_context_parallel`) keeps its own ``forward``, head, pooling and loss: context parallelism
touches only the inputs, the positions and the attention. A forward pre-hook on the base model numbers the whole
sequences' positions as the family does, sets the attention's padding, and hands the base model rank ``r``'s
positions ``p_r`` of every per-token input. A classifier's hidden states are gathered back after the trunk's last
layer, by one all-gather and the inverse zigzag permutation ``π⁻¹`` (an index: exact)::

    H = [H_0; …; H_{cp−1}][:, π⁻¹],       ∂L/∂H_r = (Σ_c ∂L_c/∂H)[:, p_r]   (backward: one all-reduce, a slice)

so the final norm or pooler, the head and transformers' loss see the whole sequences, as on one process. A causal
LM gathers nothing: its logits are this rank's positions', and its task sums the loss over cp.

**A pipeline's chunks** (pp × cp) take the same split: :class:`ContextSplit` is their registered extra
(``hftrain.parallel.chunk``). The first chunk embeds this rank's positions; every chunk sets the attention's padding
(:meth:`ContextSplit.attend`) or, for a causal LM's packed blocks, whose whole position ids travel beside the hidden
states, each local token's document (:meth:`ContextSplit.attend_packed`); the last chunk returns this rank's rows: a
classifier's pooled token summed over cp, a per-token head's logits of its positions, whose loss on the last stage
reads the same positions of the labels and sums over cp, as at cp alone.

Why hand-written: torch's ``torch.distributed.tensor.experimental.context_parallel`` runs ring attention only
inside SDPA on CUDA DTensors, without key-padding masks (its load balancer assumes causal LM batches); BERT-style
padded, non-causal classification on gloo is outside it, as it is outside Megatron's and Accelerate's CP.
Dropout inside attention is not supported here (the probabilities never exist whole); attention dropout must be
0 under ``cp`` (the caller checks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hftrain.parallel.axis_ops import AxisOps
from hftrain.parallel.chunk import ChunkExtra
from hftrain.parallel.cp_attention import (  # noqa: F401  (re-exported: the public path of cp's attention)
    ATTENTIONS,
    Shard,
    _AllToAll,
    _GatherContext,
    _RingAttention,
    _SumOverContext,
    all_to_all_attention,
    ring_attention,
)
from hftrain.parallel.cp_kernels import (  # noqa: F401  (re-exported: the public path of cp's kernels)
    BLOCK_KERNELS,
    NEG_INF,
    BlockKernel,
    _Block,
    _chunks,
    _visible_pairs,
    block_kernel,
    packed_segments,
    unzigzag_order,
    zigzag_positions,
    zigzag_runs,
)
from hftrain.parallel.cp_scored import SCORED_KERNELS, ScoredKernel, SoftCap, scored_kernel  # noqa: F401

# ----------------------------------------------------------------- what cp can split
ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
"""The config fields that hold a family's attention dropout, which must be 0 under cp."""


def check_context_parallel(cp: int, *, sequence_parallel: bool = False, pad_to_multiple_of: int | None = None) -> None:
    """Refuse, before any model or process group, what ``cp`` does not compose with yet (sequence parallelism) and
    length buckets the zigzag split (``2·cp`` equal chunks) cannot cut; ``AxisError`` naming ``cp``.

    Args:
        cp: context-parallel size.
        sequence_parallel: Megatron sequence parallelism in the tp regions.
        pad_to_multiple_of: the length buckets (None: none).
    """
    import math

    from hftrain.errors import AxisError

    if cp == 1:
        return
    if sequence_parallel:
        raise AxisError("cp", f"cp={cp} with sequence parallelism is not supported yet; use sequence_parallel: false")
    if pad_to_multiple_of and pad_to_multiple_of % (2 * cp):
        raise AxisError(
            "cp",
            f"length buckets of {pad_to_multiple_of} (pad_to_multiple_of) are not a multiple of 2·cp = {2 * cp}, and "
            f"context parallelism cuts every sequence into 2·cp equal chunks; use a multiple of {2 * cp} (e.g. "
            f"{math.lcm(pad_to_multiple_of, 2 * cp)})",
        )


def check_context_parallel_model(
    config: Any, cp: int, *, tp: int = 1, comm: str = "ring", head: str | None = "sequence_classification"
) -> None:
    """Refuse a model ``cp`` cannot split (no processes needed): another family, attention dropout (the attention
    probabilities never exist whole), heads the all-to-all cannot divide; ``AxisError`` naming ``cp``.

    Args:
        config: the model's ``PretrainedConfig``.
        cp: context-parallel size (nothing is checked at 1).
        tp: tensor-parallel size (the all-to-all splits each tp rank's heads).
        comm: ``"ring"`` or ``"all_to_all"``.
        head: the task's head kind (``hftrain.parallel.heads.HEADS``), checked with the family.
    """
    from hftrain.errors import AxisError
    from hftrain.parallel.families import stages_for
    from hftrain.parallel.plans import grouped_query_split

    if cp == 1:
        return
    only = getattr(stages_for(config, head=head, axis="cp"), "cp_comm_only", None)  # checked for cp
    if only is not None and comm != only[0]:  # (comm, why): a family whose attention one cp comm alone splits
        raise AxisError("cp", f"cp_comm {comm} cannot split this model's attention: {only[1]}; use cp_comm: {only[0]}")
    for name in ATTENTION_DROPOUT_FIELDS:
        if getattr(config, name, 0) or 0:
            raise AxisError(
                "cp",
                f"cp={cp}: context parallelism needs attention dropout 0, and the model's {name} is "
                f"{getattr(config, name)}; save the model with {name}: 0.0 in its config.json",
            )
    if comm == "all_to_all":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # each tp rank's own heads (checked by check_tensor_parallel first); key/value heads fewer than tp are
        # replicated, one per rank, which no cp > 1 divides
        split = grouped_query_split(heads, kv_heads, tp)
        if split.heads % cp or split.kv_heads % cp:
            raise AxisError(
                "cp",
                f"cp_comm all_to_all splits heads over cp, and each tp rank's {split.heads} heads / {split.kv_heads} "
                f"key/value heads do not divide by cp={cp}; use cp_comm: ring or a cp dividing both",
            )


# ----------------------------------------------------------------------------- a model over cp ranks
ATTENTION_NAME = "hftrain_context_parallel"


class _Batch:
    """What every attention call of one forward needs besides q, k, v: set by the model's forward, read by the
    attention function through the module it is called with (one per model: no module global)."""

    def __init__(self, group: Any, comm: str) -> None:
        self.group, self.comm = group, comm
        self.keep: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.runs: tuple | None = None  # every cp rank's runs of positions, on the host (zigzag_runs)
        self.segments: torch.Tensor | None = None  # packed sequences: the document of each local token
        self.padded = True  # keep may hold padding (False: the batch came without an attention mask)
        self.memo: dict = {}  # what every layer of this forward shares (Shard.memo), new at each forward


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-interface entry: ``[b, h, s, d]`` in, ``([b, s, h, d], None)`` out; the local
    4-D mask transformers built is ignored: padding and causality come from the batch's keep mask and positions."""
    batch: _Batch = module.context_parallel_batch
    if dropout:
        raise ValueError("context parallelism needs attention dropout 0 (the attention probabilities are never whole)")
    softcap = kwargs.get("softcap")  # Gemma-2's: its blocks go through the score-modified kernels
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    causal = bool(getattr(module, "is_causal", False))
    window = kwargs.get("sliding_window")  # the layer's (None: full attention), as transformers passes it
    shard = Shard(
        batch.keep, batch.positions, causal, scale, batch.group, batch.runs, batch.segments, window, batch.memo,
        batch.padded, None if softcap is None else SoftCap(softcap),
    )  # fmt: skip
    out = ATTENTIONS[batch.comm](query, key, value, shard)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """The mask function registered beside :func:`_attention`: it builds its own masks from the positions."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _no_mask)


class ContextSplit(ChunkExtra):
    """This rank's part of every sequence: what the model's hooks (:func:`apply_context_parallel`), pipeline chunks
    and a language model's loss use to split, gather and sum over the cp ranks.

    Args:
        batch: the per-forward state the model's attention modules read.
    """

    name = "context_split"
    splits_sequence = True  # a pipeline chunk's task head embeds and reduces through it

    def __init__(self, batch: _Batch) -> None:
        self.batch = batch
        self.cp, self.rank = dist.get_world_size(batch.group), dist.get_rank(batch.group)

    def positions(self, seq: int, device: Any = None) -> torch.Tensor:
        """The zigzag positions this rank keeps of a whole sequence of ``seq`` tokens."""
        if seq % (2 * self.cp):
            raise ValueError(f"sequence length {seq} must be a multiple of 2·cp = {2 * self.cp} (pad_to_multiple_of)")
        return zigzag_positions(seq, self.cp, self.rank, device=device)

    def attend(self, keep: torch.Tensor, segments: torch.Tensor | None = None, *, padded: bool = True) -> torch.Tensor:
        """Set the attention's padding mask to this rank's ``keep`` ``[b, s/cp]`` (and, for packed sequences, the
        document of each of its tokens, ``segments`` ``[b, s/cp]``; ``padded``: False where the batch came without
        an attention mask, so ``keep`` is all True); returns its global positions."""
        seq = keep.shape[1] * self.cp
        positions = self.positions(seq, keep.device)
        self.batch.keep, self.batch.positions, self.batch.runs = keep.bool(), positions, zigzag_runs(seq, self.cp)
        self.batch.segments, self.batch.padded = segments, padded
        self.batch.memo = {}  # this forward's gathers and masks, shared by its layers
        return positions

    def attend_packed(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Set the attention for packed blocks (a causal LM's pipeline chunk): no padding, and each of this rank's
        tokens' document, numbered on the whole sequences ``position_ids`` ``[b, S]`` (:func:`packed_segments`: a new
        document wherever a position does not follow the one before, so a document split between ranks keeps one
        number); returns this rank's position ids ``[b, S/cp]`` (the rotary embedding's), as
        :func:`apply_context_parallel`'s hook hands the base model at cp alone."""
        b, seq = position_ids.shape
        local = self.positions(seq, position_ids.device)
        keep = torch.ones((b, seq // self.cp), dtype=torch.bool, device=position_ids.device)
        self.attend(keep, segments=packed_segments(position_ids)[:, local], padded=False)
        return position_ids[:, local]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a per-token tensor of the whole sequences ``[b, s, ...]`` (e.g. the targets)."""
        return x[:, self.positions(x.shape[1], x.device)]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequences ``[b, s, ...]``, in token order, of a per-token tensor of this rank's positions
        ``[b, s/cp, ...]``: an all-gather over the cp group whose backward is an all-reduce and this rank's slice
        (:class:`_GatherContext`)."""
        seq = x.shape[1] * self.cp
        order = unzigzag_order(seq, self.cp).to(x.device)
        return _GatherContext.apply(x, self.batch.group, self.positions(seq, x.device), order)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``Σ`` over the cp ranks, whose backward is the same sum (:class:`_SumOverContext`)."""
        return _SumOverContext.apply(x, self.batch.group)


def apply_context_parallel(
    model: torch.nn.Module,
    *,
    trunk: Any,
    per_token: bool,
    cp_group: Any,
    comm: str = "ring",
) -> torch.nn.Module:
    """Make an HF model of a family context parallelism takes (``hftrain.parallel.families``: BERT, GPT-2, GPT-NeoX,
    the rotary decoders with sliding windows and Gemma-2's soft-capping, ModernBERT, ALBERT, the mixtures of experts,
    whose router loss the trainer reduces over dp × cp: ``hftrain.parallel.ep_routing``) run split over the
    sequence, in place. Context parallelism touches the inputs, the positions and the attention only; the model's own
    ``forward``, head, pooling and loss run unchanged on every cp rank, which takes the *same* whole batch (padded to
    a multiple of ``2·cp``):

    - the attention becomes context-parallel (:func:`_attention`: ring or all-to-all);
    - a forward pre-hook on the base model (``model.base_model``: BertModel, GPT2Model, LlamaModel, …;
      :class:`_SplitInputs`) numbers the whole sequences' positions as the family does (by index, or RoBERTa's
      count of non-pad tokens: the trunk adapter's ``position_ids``), sets the attention's padding (and, for a causal
      LM, packed documents), and hands the base model this rank's zigzag positions of ``input_ids``,
      ``attention_mask``, ``token_type_ids``, ``position_ids`` (and ``inputs_embeds``);
    - a ``*ForSequenceClassification``: a forward hook on the trunk's last layer (the family's trunk adapter's
      ``layers``; or the module its ``output_module(model)`` names, where the layers are one module run several times:
      ALBERT's encoder) gathers every rank's hidden states back into the whole sequences in token order
      (:class:`_GatherContext`: all-gather forward, all-reduce and this rank's slice backward), so the base model's
      final norm or pooler (BERT's sits inside the base model, after the layers), the model's head, its pooling of
      the classified token (BERT's first, GPT-2's and Llama's last non-pad one, found on the whole ``input_ids``) and
      transformers' loss run as on one process: the head needs to know nothing of the split. A base model that views
      its output to its (local) input's shape (GPT-2's ``view(output_shape)``) is viewed back to the whole batch's;
    - a ``*ForCausalLM`` gathers nothing: it returns the logits of this rank's positions only; the task takes the
      same positions of its targets (``model.context_split.local``) and sums its loss over the cp group
      (``model.context_split.sum``). Packed documents (positions restarting) stay apart: the attention masks by
      document as well as by position.

    Every cp rank computes the whole loss, so parameter gradients are ``cp`` × one rank's share below the gather
    (the whole gradient above it); averaging them over the cp (and dp) group, as Megatron does, gives the gradient.
    The hooks stay outside transformers' layer checkpoints (``GradientCheckpointingLayer`` checkpoints ``forward``,
    not ``__call__``): recomputation runs no collective of theirs again. The model's ``context_split``
    (:class:`ContextSplit`) also serves code that runs its modules itself: pipeline chunks take it
    (``hftrain.parallel.stages.PipelineChunk``), and there the hooks stay idle (the base model is never called).

    It reads neither the family registry nor the model's class: the caller passes the family's trunk adapter (whose
    ``context_parallel_attention(model, batch)``, where it has one, splits an attention of the family's own) and the
    task head's per-token trait.

    Args:
        model: the model (possibly tensor-parallel already: attention sees this rank's heads), or a ``PeftModel``
            wrapping one (LoRA: the hooks go on the transformers model inside; the adapters are replicated over cp).
        trunk: the family's trunk adapter (``embed_modules``, ``layers``, ``position_ids``): what the hooks attach to.
        per_token: the task head's output is per token (a causal LM's logits: nothing is gathered, the loss sums over
            cp) rather than per sequence (a classifier's: the hidden states are gathered after the last layer).
        cp_group: the context-parallel process group.
        comm: ``"ring"`` or ``"all_to_all"``.
    """
    from hftrain.parallel.lora import hf_model_of

    _register()
    batch = _Batch(cp_group, comm)
    for module in model.modules():
        module.context_parallel_batch = batch
    # inside a PeftModel (LoRA), the transformers model: its ``base_model`` is the trunk (the PeftModel's is PEFT's
    # LoraModel), and the trunk adapter's paths name its modules; LoRA's layers stay inside the split attention
    hf_model = hf_model_of(model)
    hf_model.set_attn_implementation(ATTENTION_NAME)
    if hasattr(trunk, "context_parallel_attention"):  # a family's own attention module, outside the interface
        trunk.context_parallel_attention(hf_model, batch)
    split = model.context_split = ContextSplit(batch)
    if hf_model is not model:  # also on the transformers model: whichever of the two the caller unwraps to
        hf_model.context_split = split
    base = hf_model.base_model
    inputs = _SplitInputs(split, trunk, trunk.embed_modules(hf_model), base, packed=per_token)
    base.register_forward_pre_hook(inputs, with_kwargs=True)
    if not per_token:  # a classifier: the whole sequences again after the last layer
        # a trunk whose layers are one module run L times (ALBERT's) names the module whose output is the trunk's,
        # run once per forward: a hook on the shared layer would gather after its first run
        output_module = getattr(trunk, "output_module", None)
        last = output_module(hf_model) if output_module is not None else trunk.layers(hf_model)[-1]
        last.register_forward_hook(inputs.gather)
        base.register_forward_hook(inputs.whole, always_call=True)
    return model


def _first(output: Any, function: Any) -> Any:
    """``output`` (a tensor, a tuple whose first item is the hidden states, or a ``ModelOutput``) with its hidden
    states replaced by ``function`` of them."""
    if isinstance(output, torch.Tensor):
        return function(output)
    if isinstance(output, tuple):
        return (function(output[0]), *output[1:])
    output.last_hidden_state = function(output.last_hidden_state)
    return output


class _SplitInputs:
    """The base model's forward pre-hook (this rank's positions of its inputs) and a classifier's gather.

    Args:
        split: this rank's part of the sequences.
        trunk: the family's trunk adapter (``position_ids``: RoBERTa's numbering from the padding index).
        embeddings: the trunk's embedding modules (``trunk.embed_modules``).
        base: the base model (its ``forward``'s positional parameters, to name positional arguments).
        packed: a causal LM's: each token's document (:func:`packed_segments`) from the positions.
    """

    def __init__(self, split: ContextSplit, trunk: Any, embeddings: Any, base: torch.nn.Module, *, packed: bool):
        import inspect

        self.split, self.trunk, self.embeddings, self.packed = split, trunk, embeddings, packed
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = inspect.signature(base.forward).parameters.values()
        self.names = [p.name for p in parameters if p.kind in kinds]
        self.whole_shape: tuple[int, int] | None = None  # (b, S) while a classifier's base model runs

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs) → ((), kwargs)`` with this rank's positions of every per-token input: position ids
        numbered on the whole sequences first (given, the family's, or the index), the attention's padding mask
        (and documents) set."""
        kwargs = {**dict(zip(self.names, args, strict=False)), **kwargs}
        input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        whole = input_ids if input_ids is not None else embeds
        b, seq, device = whole.shape[0], whole.shape[1], whole.device
        local = self.split.positions(seq, device)
        position_ids = kwargs.get("position_ids")
        # documents only where positions were given (a causal LM's packed blocks restart them); numbered here they
        # run 0..S−1 in every row: one document, so the ring need not mask by document
        documents = self.packed and position_ids is not None
        if position_ids is None:
            position_ids = self._numbered(input_ids, b, seq, device)
        mask = kwargs.get("attention_mask")
        keep = torch.ones((b, seq), dtype=torch.bool, device=device) if mask is None else mask.bool()
        segments = packed_segments(position_ids.expand(b, -1))[:, local] if documents else None
        self.split.attend(keep[:, local], segments=segments, padded=mask is not None)
        kwargs["position_ids"] = position_ids[:, local]
        for key in ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids"):
            if kwargs.get(key) is not None:
                kwargs[key] = kwargs[key][:, local]
        self.whole_shape = None if self.packed else (b, seq)
        return (), kwargs

    def _numbered(self, input_ids: torch.Tensor | None, b: int, seq: int, device: Any) -> torch.Tensor:
        """The family's position ids of the whole sequences ``[b | 1, S]``: RoBERTa's count of non-pad tokens from
        the padding index (the trunk's ``position_ids``), else the index."""
        if input_ids is not None:
            numbered = self.trunk.position_ids(self.embeddings, input_ids)
            if numbered is not None:
                return numbered
        elif getattr(self.trunk, "pad_numbered", False):
            raise ValueError("context parallelism numbers this family's positions from input_ids; pass input_ids")
        return torch.arange(seq, device=device).expand(b, -1)

    def gather(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """The trunk's last layer's forward hook: the whole sequences of its hidden states (:meth:`ContextSplit.gather`)
        while the base model runs on this rank's positions (idle in a pipeline chunk, which calls the layer itself)."""
        if self.whole_shape is None:
            return output
        return _first(output, self.split.gather)

    def whole(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        """The base model's forward hook: its output's hidden states ``[b, S, h]`` (a base model that viewed them to
        its local input's shape ``(-1, S/cp, h)``, GPT-2's, viewed back: the same memory); the gather goes idle."""
        shape, self.whole_shape = self.whole_shape, None
        if shape is None or output is None:
            return output
        return _first(output, lambda hidden: hidden.reshape(*shape, *hidden.shape[2:]))


# ----------------------------------------------------------------- the axis's interface (hftrain.parallel.axis_ops)
def _check_family(config: Any, head: str | None) -> None:
    from hftrain.parallel.families import check_family

    check_family(config, head=head, axis="cp")


def _apply(model: torch.nn.Module, groups: Any, options: Any, *, head: Any, rng_tracker: Any) -> torch.nn.Module:
    """Split every sequence over the cp group: the family's trunk, checked for cp with the head kind (a task's own
    head object: the family alone), gathering the whole sequences back for a head that is not per token."""
    from hftrain.parallel.families import stages_for
    from hftrain.parallel.heads import per_token_head

    if groups.cp_size == 1:
        return model
    trunk = stages_for(model.config, head=head if isinstance(head, str) else None, axis="cp")
    return apply_context_parallel(
        model, trunk=trunk, per_token=per_token_head(head), cp_group=groups.cp_group, comm=options["cp_comm"]
    )


AXIS = AxisOps(
    options={"cp_comm": "ring"},
    check_layout=lambda dims, options, buckets: check_context_parallel(
        dims.cp, sequence_parallel=options["sequence_parallel"], pad_to_multiple_of=buckets
    ),
    check_model=lambda config, dims, options, head: check_context_parallel_model(
        config, dims.cp, tp=dims.tp, comm=options["cp_comm"], head=head
    ),
    check_family=_check_family,
    padding_multiple=lambda dims, options: 2 * dims.cp if dims.cp > 1 else 1,  # 2·cp equal zigzag chunks
    apply=_apply,
    not_built={
        "compile": "context parallelism's ring attention exchanges key/value blocks by point-to-point sends inside "
        "each block's attention, which dynamo cannot trace",
        "block_loading": "the blockwise loading follows tensor parallelism's per-block split only, not the attention "
        "context parallelism installs",
    },
)
"""Context parallelism behind the axes' one interface."""
