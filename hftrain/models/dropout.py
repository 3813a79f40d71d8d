"""Dropout whose masks are drawn 64 random bits at a time (``training.dropout_kernel: bits``).

torch's CPU dropout draws its Bernoulli mask one element at a time from the generator (its vectorised MKL path is
taken on Intel CPUs only), which was ~30 ms of a 170 ms bf16 MiniLM training step on this project's AMD CPUs.
Here each 64-bit random word is read as four uniform 16-bit integers, and an element is kept when its
integer is at or above the threshold ``-2^15 + round(p * 2^16)``:

    keep_i ~ Bernoulli(1 - round(p * 2^16) / 2^16),   y = x * keep / (1 - p)

the distribution of ``torch.nn.functional.dropout`` with the drop probability rounded to a multiple of 2^-16 (at
most 2^-17 away: 0.1 becomes 0.1000061). Reading 32-bit integers instead was exact to 2^-32 but drew twice the
bits: on the default job's step the masks took 8.4 ms with 32 bits and half that with 16. On CPU the 64-bit words
come from numpy's SFC64 generator (1.4 ns a word here against 2.5 ns for torch's Mersenne Twister), seeded for each
mask by one draw from torch's default generator; on other devices from that device's torch generator. Either way
``set_seed`` and the checkpointed torch RNG state make runs reproducible and resumable exactly as with torch's
dropout.

Two places draw dropout masks in a transformers classifier: the ``nn.Dropout`` modules (hidden states, embeddings,
classifier head), which are replaced by :class:`BitsDropout`, and the attention probabilities, which SDPA drops
inside its kernel. For those, :func:`bits_sdpa_attention` is registered as the attention implementation
``hftrain_sdpa``: with dropout it computes ``softmax(q k^T * scale + mask) @ v`` with the bit mask on the
probabilities, and without dropout (evaluation, or a model whose attention dropout is 0) it is transformers' SDPA
call, unchanged. The attention masks are SDPA's. No collectives.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ATTENTION = "hftrain_sdpa"
"""The ``attn_implementation`` name under which :func:`bits_sdpa_attention` is registered."""

_TORCH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The torch integer type of each float width in bytes: views a scale's bit pattern."""


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | None = None) -> torch.Tensor:
    """A boolean mask of ``shape`` whose elements are True with probability ``1 - round(p * 2^16) / 2^16``.

    Args:
        shape: the mask's shape.
        p: the drop probability, in [0, 1).
        device: where the mask is drawn (the default generator of that device).
    """
    numel = math.prod(shape)
    if _on_cpu(device):
        return torch.from_numpy(_cpu_uniform16(numel) >= _threshold(p)).view(shape)
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    return (words.view(torch.int16)[:numel] >= _threshold(p)).view(shape)


def scaled_keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """``keep_mask(shape, p) * s`` in ``dtype``, with ``s = 1 / (1 - p)`` rounded to ``dtype``: what inverted dropout
    multiplies by.

    On CPU the mask is built in numpy from the bit pattern of ``s``: one compare and one multiply of 16-bit
    integers instead of torch's compare, cast and scale (35 us against 100 us for a 32 x 28 x 384 bf16 mask; numpy's
    compare alone took 17 us against torch's 58 us here). The values are those of ``keep.to(dtype) * s``.
    """
    scale = torch.tensor(1.0 / (1.0 - p), dtype=dtype)
    if not _on_cpu(device):  # s rounded to dtype, as a Python number: no host-to-device copy per mask
        return keep_mask(shape, p, device).to(dtype).mul_(scale.item())
    import numpy as np

    integer = np.dtype(f"int{8 * scale.element_size()}")  # an integer type with the dtype's width
    bits = integer.type(scale.view(_TORCH_INT[scale.element_size()]).item())
    keep = _cpu_uniform16(math.prod(shape)) >= _threshold(p)
    return torch.from_numpy(keep.view(np.uint8) * bits).view(dtype).view(shape)


def _threshold(p: float) -> int:
    """Keep a uniform signed 16-bit integer when it is at or above this: probability 1 - round(p * 2^16) / 2^16."""
    return -(2**15) + round(p * 2**16)


def _on_cpu(device: torch.device | str | None) -> bool:
    return device is None or torch.device(device).type == "cpu"


def _cpu_uniform16(numel: int) -> Any:
    """``numel`` uniform int16 (numpy), four from each 64-bit SFC64 word, seeded by the default torch generator."""
    import numpy as np

    seed = int(torch.empty((), dtype=torch.int64).random_())  # one draw: the torch RNG state decides the mask
    return np.random.SFC64(seed).random_raw((numel + 3) // 4).view(np.int16)[:numel]


def bits_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x * keep / (1 - p)`` with ``keep = keep_mask(x.shape, p)``: inverted dropout, as ``F.dropout`` in training."""
    return x * scaled_keep_mask(x.shape, p, x.dtype, x.device)


class BitsDropout(nn.Dropout):
    """``nn.Dropout`` drawing its mask with :func:`keep_mask` (same ``p``, same train/eval behaviour)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or self.p == 1.0 or self.inplace:
            return super().forward(input)
        return bits_dropout(input, self.p)


def bits_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; the math path with bit-mask dropout when ``dropout > 0``.

    Shapes: query ``(b, h, s, d)``, key/value ``(b, h_kv, s_kv, d)`` (``h_kv`` divides ``h``); the mask is SDPA's
    (boolean, True = attend, or additive), or None for a causal or unmasked attention. Returns ``(b, s, h, d)``.
    Anything beyond plain attention (a position bias, a paged cache, a soft cap) goes to transformers' SDPA.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not dropout or any(kwargs.get(name) is not None for name in ("position_bias", "cache", "softcap")):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
    scores = _masked(scores, attention_mask, causal=causal and attention_mask is None)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(bits_dropout(probs, dropout), value)
    return output.transpose(1, 2).contiguous(), None


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, *, causal: bool) -> torch.Tensor:
    """Scores with SDPA's mask applied: a boolean mask keeps True, an additive one is added, causal is lower-left."""
    lowest = torch.finfo(scores.dtype).min
    if mask is not None and mask.dtype == torch.bool:
        return scores.masked_fill(~mask, lowest)
    if mask is not None:
        return scores + mask
    if causal and scores.shape[-2] > 1:
        q_len, kv_len = scores.shape[-2:]
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril(kv_len - q_len)
        return scores.masked_fill(~allowed, lowest)
    return scores


def use_bits_dropout(model: nn.Module) -> int:
    """Swap every ``nn.Dropout`` in ``model`` for :class:`BitsDropout` and route SDPA attention through
    :func:`bits_sdpa_attention`; returns the number of dropout modules swapped.

    Nothing saved changes: dropout has no weights, and the attention implementation is not written to config.json.
    A model on eager (or another) attention keeps it; only its dropout modules are swapped.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, BitsDropout(child.p, child.inplace))
                swapped += 1
    configs = _sdpa_configs(model)
    if configs:
        _register()
    for config in configs:
        config._attn_implementation = ATTENTION
    return swapped


def _sdpa_configs(model: nn.Module) -> list[Any]:
    """The distinct transformers configs in ``model`` that run SDPA attention."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            found[id(config)] = config
    return list(found.values())


def _register() -> None:
    """Register ``hftrain_sdpa`` with transformers: the attention function, and SDPA's mask for it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, bits_sdpa_attention)
    if ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
