"""Attention over packed documents that computes each document alone (``training.packed_attention: varlen``).

A causal language model's packed block (``hftrain.data.language``) holds several documents, its position ids
restarting at each. The dense path (``hftrain.trainers.inputs.packed_causal_mask``) hands SDPA a block-diagonal causal
mask: every (query, key) pair of the block is computed, masked or not, and on CUDA a dense mask rules out the flash
kernel. Here the documents are cut apart instead. For each document ``d`` of the batch (its rows flattened into one
sequence of ``T = b · s`` tokens, a row's start always a new document)::

    O_d = softmax(Q_d K_dᵀ · scale + C_d) V_d,      C_d[i, j] = 0 if 0 ≤ i − j < w else −∞

``w`` the layer's sliding window (``∞`` without one; transformers' rule ``kv > q − w``, hence flash's left window
``w − 1``); key/value heads grouped as the model groups them (GQA).

**Once per forward, no host read.** :meth:`PackedDocuments.of` turns the position ids into ``cu_seqlens`` (int32,
``T + 1`` entries: each document's start, then ``T`` repeated: the unused tail is documents of length 0, so the size
never depends on the data and nothing is read back) on the device, once per batch; every layer reads the same
object, handed to the model as the keyword ``packed_documents`` (transformers passes a forward's keywords down to
each attention call; a call without them, such as the export's logit check, gets them from its ``position_ids``
by a forward pre-hook on the model, again once per forward). The longest document is bounded by the block's length
``s`` (a shape: a host int), which flash takes as ``max_q``/``max_k`` (its grid is sized for ``s``; the blocks past a
document's end do nothing).

**Kernels, one per device type** (:data:`KERNELS`):

- ``cuda``: torch's ``torch.nn.attention.varlen.varlen_attn`` (flash varlen; causal as ``window_size=(-1, 0)``, a
  sliding window as ``(w − 1, 0)``, ``enable_gqa`` for grouped heads). Written from torch 2.13's ``varlen.py``; this
  project's machines have no GPU, so this path has not run here: its tests are the CPU kernel's, which takes the
  same ``cu_seqlens``.
- ``cpu``: an exact reference of the same equation: each token's document found from ``cu_seqlens``
  (``searchsorted``), SDPA over each row with the mask "same document, causal, inside the window". It computes
  the row's every pair as the dense mask does (a loop over documents would read their bounds on the host in every
  layer); it is there so that the wiring (flattening, boundaries, windows, grouped heads, scale) is tested on CPU,
  and ``auto`` keeps the dense mask on a CPU (``benchmarks/README.md``).

**What it cannot take** (:func:`varlen_refusal`, checked once at startup; the trainer then keeps the dense mask and
says so in one line): attention dropout above 0 (flash varlen has none), soft-capped scores, a non-causal attention,
chunked attention, attention other than SDPA's (an eager or custom kernel the user chose). An attention mask in a
batch is refused per call (:func:`packed_attention`): packed blocks come without one.

No mask function is registered beside the attention: transformers then hands it no mask and, unlike with one, skips
its packed-sequence detection (``find_packed_sequence_indices``, a host read per forward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_NAME = "hftrain_packed_varlen"
"""The ``attn_implementation`` name under which :func:`packed_attention` is registered."""


@dataclass(frozen=True)
class PackedDocuments:
    """The documents of one packed batch, flattened to ``T = b · s`` tokens: what every layer's attention reads.

    Args:
        cu_seqlens: ``[T + 1]`` int32 on the device: each document's first token, then ``T`` (empty documents).
        max_length: an upper bound of a document's length (the block length ``s``, a host int).
        block: the block length ``s`` (rows are ``s`` tokens each).
    """

    cu_seqlens: torch.Tensor
    max_length: int
    block: int

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> PackedDocuments:
        """The documents of ``position_ids`` ``[b, s]``: one starts at each row's start and wherever a position is not
        the previous one plus 1 (transformers' ``find_packed_sequence_indices``). Device work only.

        Args:
            position_ids: ``[b, s]``, restarting at each document.
        """
        b, s = position_ids.shape
        total = b * s
        starts = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1) != 1  # [b, s]
        starts[:, 0] = True  # a row never continues the previous row's document
        document = starts.reshape(-1).cumsum(0) - 1  # [T]: each token's document
        ones = torch.ones(total, dtype=torch.int32, device=position_ids.device)
        lengths = torch.zeros(total, dtype=torch.int32, device=position_ids.device).scatter_add_(0, document, ones)
        cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))  # [T + 1]
        return cls(cu_seqlens=cu_seqlens, max_length=s, block=s)


Kernel = Callable[..., torch.Tensor]
"""``(q, k, v, documents, *, scale, window, grouped) -> o``: ``q`` ``[T, h, d]``, ``k``/``v`` ``[T, h_kv, d]``,
``o`` ``[T, h, d]``; ``window`` the sliding window ``w`` or None."""


def _varlen_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: PackedDocuments,
    *,
    scale: float | None,
    window: int | None,
    grouped: bool,
) -> torch.Tensor:
    """torch's flash varlen (``varlen_attn``): causal ``(-1, 0)``, or a causal window of ``w`` keys ``(w − 1, 0)``."""
    from torch.nn.attention.varlen import varlen_attn

    cu, longest = documents.cu_seqlens, documents.max_length
    window_size = (-1, 0) if window is None else (window - 1, 0)
    # flash takes 16-bit inputs only: under autocast a projection may still hand over an fp32 tensor (a rotary
    # embedding's upcast); fp32 runs never get here (KERNEL_PRECISIONS)
    dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.get_autocast_dtype("cuda")
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=window_size, enable_gqa=grouped)


def _reference_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: PackedDocuments,
    *,
    scale: float | None,
    window: int | None,
    grouped: bool,
) -> torch.Tensor:
    """The equation exactly, from ``cu_seqlens``: each row's SDPA with the mask "same document, ``0 ≤ i − j < w``"."""
    total, s = q.shape[0], documents.block
    token = torch.arange(total, device=q.device)
    document = torch.searchsorted(documents.cu_seqlens, token.to(torch.int32), right=True) - 1  # [T]
    document = document.view(total // s, s)
    offset = token[:s, None] - token[None, :s]  # [s, s]: i − j
    allowed = (offset >= 0) if window is None else (offset >= 0) & (offset < window)
    mask = (document[:, :, None] == document[:, None, :]) & allowed  # [b, s, s]
    rows = [x.view(total // s, s, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]  # [b, h, s, d]
    out = F.scaled_dot_product_attention(*rows, attn_mask=mask[:, None], scale=scale, enable_gqa=grouped)
    return out.transpose(1, 2).reshape(q.shape)


KERNELS: dict[str, Kernel] = {"cuda": _varlen_cuda, "cpu": _reference_cpu}
"""The kernel of each device type (a new device is one line here)."""

KERNEL_PRECISIONS: dict[str, tuple[str, ...]] = {"cuda": ("bf16", "fp16")}
"""The ``training.mixed_precision`` values each device's kernel runs under (absent: any): flash is 16-bit only."""


def kernel_refusal(device: str, mixed_precision: str) -> str | None:
    """Why ``device``'s kernel cannot run this job (None: it can): no kernel for the device, or a precision its
    kernel does not compute.

    Args:
        device: the platform's device type (``"cpu"``, ``"cuda"``).
        mixed_precision: the resolved ``training.mixed_precision``.
    """
    if device not in KERNELS:
        return f"no varlen kernel for {device!r} (KERNELS: {', '.join(KERNELS)})"
    precisions = KERNEL_PRECISIONS.get(device)
    if precisions is not None and mixed_precision not in precisions:
        wanted = " or ".join(precisions)
        return f"the {device} kernel (flash) computes {wanted} only, not mixed_precision {mixed_precision}"
    return None


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed_documents: PackedDocuments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function: ``query`` ``[b, h, s, d]``, ``key``/``value`` ``[b, h_kv, s, d]``
    flattened to ``[T, h, d]`` and attended document by document (module docstring); returns ``[b, s, h, d]``.

    Args:
        module: the attention module (its ``is_causal``).
        query: queries; key, value: keys and values (grouped heads allowed).
        attention_mask: must be None (packed blocks come without one).
        dropout: must be 0 (:func:`varlen_refusal` keeps such models on the dense mask).
        scaling: the score scale (None: ``1/√d``).
        sliding_window: the layer's window ``w`` (None: the whole causal past).
        packed_documents: the batch's documents (:meth:`PackedDocuments.of`), passed to the model's forward.
        kwargs: the rest of transformers' keywords (a soft-cap among them is refused).
    """
    if packed_documents is None:
        raise RuntimeError(
            f"{ATTENTION_NAME}: the model ran without packed_documents; call it with "
            "packed_documents=PackedDocuments.of(position_ids) (hftrain.trainers.language does)"
        )
    if attention_mask is not None or dropout or kwargs.get("softcap") or not getattr(module, "is_causal", True):
        raise RuntimeError(
            f"{ATTENTION_NAME}: a mask, attention dropout, soft-capping or a non-causal layer reached the varlen "
            "attention (varlen_refusal should have kept this model on the dense mask)"
        )
    b, h, s, d = query.shape
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value)]  # [T, h, d]
    kernel = KERNELS.get(query.device.type)
    if kernel is None:
        raise RuntimeError(
            f"{ATTENTION_NAME}: no kernel for device type {query.device.type!r} (KERNELS: {list(KERNELS)})"
        )
    out = kernel(*flat, packed_documents, scale=scaling, window=sliding_window, grouped=key.shape[1] != h)
    return out.view(b, s, h, d), None


ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
"""The config fields holding a family's attention dropout."""


def varlen_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s attention cannot run as :func:`packed_attention` (None: it can): attention other than
    SDPA's, attention dropout above 0, soft-capping, chunked or non-causal attention.

    Args:
        model: the built (unwrapped) model, its attention implementation chosen.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    function = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name) if isinstance(name, str) else None
    if function is not sdpa_mask and getattr(function, "__wrapped__", None) is not sdpa_mask:
        return f"its attention is {name!r}, not SDPA"
    dropout = {f: getattr(config, f) for f in ATTENTION_DROPOUT_FIELDS if getattr(config, f, None)}
    if dropout:
        return f"attention dropout {dropout} (flash varlen has none; set it to 0 to use varlen)"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention scores (attn_logit_softcapping)"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention (attention_chunk_size)"
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not layers <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layers)}"
    if any(getattr(m, "is_causal", True) is False for m in model.modules()):
        return "a non-causal attention layer"
    return None


def _documents_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Forward pre-hook: a call that brings no ``packed_documents`` (the export's logit check, a user's own forward)
    gets them from its ``position_ids`` (each row one document without them), once per forward, as transformers'
    own packed masking reads the positions; a 2-D attention mask is refused (the varlen attention applies none)."""
    if kwargs.get("packed_documents") is not None:
        return args, kwargs
    if kwargs.get("attention_mask") is not None:
        raise RuntimeError(
            f"{ATTENTION_NAME}: an attention mask was given, which the varlen attention does not apply; call the "
            "model without one (packed blocks), or set training.packed_attention: mask"
        )
    positions = kwargs.get("position_ids")
    if positions is None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        b, s = tokens.shape[:2]
        positions = torch.arange(s, device=tokens.device).expand(b, s)
    return args, {**kwargs, "packed_documents": PackedDocuments.of(positions)}


def apply_packed_attention(model: nn.Module) -> None:
    """Register :func:`packed_attention` (once) and switch every config in ``model`` to it (module docstring); a
    forward pre-hook on ``model`` supplies the documents to a call that brings none (:func:`_documents_hook`).

    Args:
        model: the built (unwrapped) model; :func:`varlen_refusal` must have found nothing.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    for config in {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}.values():
        config._attn_implementation = ATTENTION_NAME
    model.register_forward_pre_hook(_documents_hook, with_kwargs=True)
