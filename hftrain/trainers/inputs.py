"""The model's attention masks, built without reading the device on the host (issue 54, pitfall 37).

transformers decides on the host whether a mask is needed at all, by reading tensor values in every forward:

- a 2-D padding mask: ``_ignore_bidirectional_mask_sdpa`` (``padding_mask.all()``) and ``_ignore_causal_mask_sdpa``
  (``fast_all``), so that a batch without padding can skip the mask and reach a flash kernel;
- packed documents without a mask: ``find_packed_sequence_indices`` (``(packed[:, -1] == 0).all()``), so that one
  document per row can use ``is_causal`` instead of a block-diagonal mask.

Each is one device-to-host read per forward, and the host then cannot queue the step ahead of the device. Here:

- :func:`apply_unchecked_masks` registers, beside every attention implementation whose mask is transformers'
  ``sdpa_mask``, the same attention with a mask function that never asks: a 2-D mask given means padding (the mask
  is built as transformers builds it when the check fails), no mask means none (the skip needs no read). A batch
  without padding should then come without a mask (the collator knows it from the lengths on the host); one that
  comes with an all-ones mask gets an all-True mask: the same result through the masked kernel.
- :func:`packed_causal_mask` builds the packed blocks' block-diagonal causal mask from ``position_ids`` on the device,
  with transformers' own rule (a document starts where the position does not follow the previous one), as the 4-D
  boolean mask the model takes as it is (``_preprocess_mask_arguments``' early exit).

Hand-written because transformers has no switch for either check: its ``allow_is_*_skip`` arguments are fixed by each
model's forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

UNCHECKED_SUFFIX = "_unchecked_mask"
"""Appended to an attention implementation's name for its twin whose mask function reads nothing on the host."""


def _unchecked(mask_function: Any) -> Any:
    """``mask_function`` (transformers' ``sdpa_mask`` signature) with its host checks turned off when a padding mask
    is given: the mask is then always built; without one, the skip reads nothing and stays."""

    @functools.wraps(mask_function)
    def mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if attention_mask is not None:
            kwargs["allow_is_causal_skip"] = kwargs["allow_is_bidirectional_skip"] = False
        return mask_function(*args, attention_mask=attention_mask, **kwargs)

    return mask


def apply_unchecked_masks(model: nn.Module) -> list[str]:
    """Route each config in ``model`` whose attention takes transformers' ``sdpa_mask`` (``sdpa``, hftrain's bit-mask
    dropout, a recomputed sdpa) to its twin whose mask reads nothing on the host (module docstring); returns the
    implementations switched. Other implementations (eager, flash, flex, context-parallel rings) are left as they are.

    Args:
        model: the built model, its attention implementation already chosen.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    switched = []
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    for config in configs.values():
        name = getattr(config, "_attn_implementation", None)
        if not isinstance(name, str) or name.endswith(UNCHECKED_SUFFIX):
            continue
        if ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name) is not sdpa_mask:
            continue
        if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
            continue
        twin = name + UNCHECKED_SUFFIX
        AttentionInterface.register(twin, ALL_ATTENTION_FUNCTIONS._global_mapping[name])
        AttentionMaskInterface.register(twin, _unchecked(sdpa_mask))
        config._attn_implementation = twin
        switched.append(name)
    return switched


def takes_boolean_masks(model: nn.Module) -> bool:
    """Whether :func:`packed_causal_mask` may be handed to ``model``: its attention takes SDPA's boolean 4-D mask
    (its mask function is ``sdpa_mask`` or its unchecked twin), and every layer attends over the whole causal past
    (a 4-D mask goes to every layer as it is: a sliding window or chunked attention needs transformers' own masks)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    function = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name) if isinstance(name, str) else None
    if function is not sdpa_mask and getattr(function, "__wrapped__", None) is not sdpa_mask:
        return False
    local = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    return not local and layers == {"full_attention"}


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The causal mask of packed documents, ``(batch, 1, seq, seq)`` boolean, True where query ``i`` may attend to
    key ``j``: ``j ≤ i`` and both in the same document, a document starting wherever a position is not the previous
    one plus 1 (transformers' ``find_packed_sequence_indices``). Device work only, nothing read back.

    Args:
        position_ids: ``(batch, seq)``, restarting at every document.
    """
    first = position_ids[:, :1] - 1
    documents = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)  # (batch, seq): document index
    seq = position_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    return (documents[:, :, None] == documents[:, None, :]).logical_and(causal)[:, None]
