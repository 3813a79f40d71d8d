"""Activation recomputation (``training.gradient_checkpointing``): keep less, recompute it in the backward pass.

Two granularities, as Megatron-LM (``--recompute-granularity full | selective``) and the HF Trainer
(``gradient_checkpointing=True``) offer them:

- ``full`` (``true``): every transformer layer keeps only its input; the backward pass runs the layer's forward
  again before its backward. Per layer the activations drop from ``s·b·h·(34 + 5·a·s/h)`` bytes (fp16, Korthikanti
  et al. 2022) to ``2·s·b·h``, for one more forward (a third more compute).
- ``selective``: only the attention core, ``softmax(q·kᵀ·scale + mask)·v`` with its dropout, is recomputed; its
  ``a·s²·b`` score, probability and mask tensors are the part of a layer that grows with the square of the sequence,
  and the cheapest to recompute (no weights, no matmul with the hidden size).

Both run ``torch.utils.checkpoint`` non-reentrant (torch's recommendation: it supports keyword inputs, nested
autograd and inputs that do not require gradients, as LoRA's frozen base layers). torch saves and restores the
default generator around the recomputation, so a dropout mask recomputed is the mask first drawn. Under tensor
parallelism the dropout inside the tensor-parallel region draws from the RNG tracker's per-rank ``tensor`` stream
(``hftrain.parallel.random``), which torch does not know of: a full-layer checkpoint records that stream's state at
the forward and restores it for the recomputation (Megatron's ``CheckpointFunction`` with
``get_cuda_rng_tracker``), through ``checkpoint``'s ``context_fn``. The selective checkpoint needs nothing more: it
starts inside the region, where the stream torch saves is the tracker's own.

Full recomputation uses transformers' own layer hook (``GradientCheckpointingLayer``: it checkpoints ``forward``,
so module hooks such as FSDP2's unshard and DeepSpeed ZeRO-3's gather stay outside the checkpoint and run once,
and the recomputation happens inside each sharded unit, where its parameters are gathered), with one
checkpoint function per layer instead of ``gradient_checkpointing_enable``'s one for all, to bind the tracker.
Selective recomputation wraps the model's attention function (transformers' attention interface).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

MODES = ("full", "selective")
SELECTIVE_PREFIX = "hftrain_recompute_"  # + the attention implementation it recomputes


def recompute_mode(value: bool | str) -> str | None:
    """``training.gradient_checkpointing`` as ``"full"``, ``"selective"`` or None (off).

    Args:
        value: ``false``, ``true`` (= ``full``), ``"full"`` or ``"selective"``.
    """
    if value is False:
        return None
    return "full" if value is True else str(value)


def apply_activation_checkpointing(model: nn.Module, mode: str, *, rng_tracker: Any = None) -> int:
    """Recompute ``model``'s activations in the backward pass; returns the number of checkpointed blocks.

    Args:
        model: an HF ``*ForSequenceClassification`` (possibly in PEFT adapters, possibly tensor-parallel already).
        mode: ``"full"`` (every transformer layer) or ``"selective"`` (the attention core).
        rng_tracker: the RNG tracker whose ``tensor`` stream the layers' tensor-parallel regions draw from (None:
            the default generator only, which torch itself restores).
    """
    if mode == "full":
        return _checkpoint_layers(model, rng_tracker)
    if mode == "selective":
        return _checkpoint_attention(model)
    raise ValueError(f"unknown recomputation mode {mode!r}; modes: {', '.join(MODES)}")


def _checkpoint_layers(model: nn.Module, rng_tracker: Any) -> int:
    import torch.utils.checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ConfigError(
            f"training.gradient_checkpointing: {type(model).__name__} has no transformers GradientCheckpointingLayer "
            "to recompute; use gradient_checkpointing: selective or false"
        )
    context_fn = rng_tracker.checkpoint_contexts if rng_tracker is not None else _no_contexts
    function = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False, context_fn=context_fn)
    # As transformers' _set_gradient_checkpointing: the layers, and the modules that read the flag (GPT-2's model
    # then passes no key/value cache to its blocks, which a recomputation would extend a second time).
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = function
    return len(layers)


def _no_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    return nullcontext(), nullcontext()


def _checkpoint_attention(model: nn.Module) -> int:
    """Route every attention call through a checkpoint of the implementation it used (SDPA, ``hftrain_sdpa``,
    eager, context-parallel attention)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    wrapped = 0
    for config in configs.values():
        inner = getattr(config, "_attn_implementation", None)
        if inner is None or inner.startswith(SELECTIVE_PREFIX):
            continue
        name = SELECTIVE_PREFIX + inner
        AttentionInterface.register(name, _recomputed(inner))
        if name not in ALL_MASK_ATTENTION_FUNCTIONS:  # the masks the wrapped implementation expects
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
        config._attn_implementation = name
        wrapped += 1
    return wrapped


def _recomputed(inner: str) -> Callable[..., Any]:
    """An attention function that checkpoints the implementation named ``inner``."""

    def attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        import torch.utils.checkpoint

        function = _attention_function(inner, module)
        return torch.utils.checkpoint.checkpoint(
            function, module, query, key, value, attention_mask, use_reentrant=False, **kwargs
        )

    return attention


def _attention_function(name: str, module: nn.Module) -> Callable[..., Any]:
    from transformers import AttentionInterface

    interface = AttentionInterface()
    if name in interface:
        return interface[name]
    # "eager" is each modeling file's own function, not a registered one
    return sys.modules[type(module).__module__].eager_attention_forward
