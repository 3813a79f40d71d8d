"""LoRA on tensor-parallel layers: PEFT's ``lora.Linear`` whose base and adapters follow the split.

A LoRA layer computes ``y = x Wᵀ + b + s · B A x`` (``A``: r × in, ``B``: out × r, ``s = alpha / r``). The tensor-
parallel styles (``hftrain.parallel.tensor_parallel``) find PEFT's ``lora.Linear`` at a plan path and split it in
place, as Megatron and PEFT's ``LoraParallelLinear`` do:

- **column-parallel base** (outputs split, ``W = [W_1; ...; W_p]`` by output rows): ``A`` replicated, ``B`` split on
  its outputs like the base (per q/k/v block for GPT-2's packed ``c_attn``, ``parts=3``; by the same unequal widths
  for grouped-query heads). Rank i: ``y_i = x W_iᵀ + b_i + s · B_i A x``. No collective of its own: forward, ``x``
  entered the region through f (or the sequence all-gather); backward, the partial input gradients
  ``W_iᵀ dy_i + s · Aᵀ B_iᵀ dy_i`` are summed by the region's f all-reduce (reduce-scatter under sequence
  parallelism). ``A``'s gradient ``s · B_iᵀ dy_i xᵀ`` is partial (rank i's share of the outputs): ``A``'s placement
  record says so (partial over tp), and ``placement.complete_grads`` all-reduces it over tp.
- **row-parallel base** (inputs split, ``x = [x_1 ... x_p]``): ``A`` split on its inputs (``A_i``: r × in_i), its
  partial products summed like the base's, by Megatron's g (all-reduce forward, identity backward; reduce-scatter to
  sequence chunks forward, all-gather backward under sequence parallelism); ``B`` replicated:
  ``y = g(x_i W_iᵀ) + b + s · B g(A_i x_i)``. One more all-reduce (or reduce-scatter) per layer, of ``r`` features.
  Under sequence parallelism ``B`` sees only this rank's sequence chunk, so its gradient is partial and its record
  says so too.

The split modules are hftrain's ``ColumnParallelLinear`` / ``RowParallelLinear`` (bias None) put in the places of
``base_layer``, ``lora_A[adapter]`` and ``lora_B[adapter]``, so every parameter keeps its PEFT name
(``...query.base_layer.weight``, ``...query.lora_A.default.weight``) and its placement record
(``hftrain.parallel.placement``): ``split_over``, ``gather_full_tensors``, the logical checkpoints and the export
(PEFT's ``save_pretrained`` over the gathered full state) need nothing LoRA-specific, and a tp=2 LoRA checkpoint
loads at tp=1. PEFT's own ``lora.Linear.forward`` still runs (``base_layer(x) + lora_B(lora_A(dropout(x))) *
scaling``); the split modules make it the equation above.

Why not PEFT's own path (``peft.tuners.lora.tp_layer.LoraParallelLinear``, peft 0.21.2): it is dispatched only when
``LoraConfig.megatron_core`` names an importable ``megatron.*`` module and the target is an instance of that
module's ``tensor_parallel.ColumnParallelLinear`` / ``RowParallelLinear``; it builds its adapters with Megatron-core
constructors (``input_size=..., config=TransformerConfig``) and expects every parallel layer to return an
``(output, bias)`` pair. hftrain's layers are none of these and Megatron-core is not installed; using it would mean
faking Megatron-core's classes. It also refuses Conv1D targets (GPT-2) and knows no packed q/k/v split, and it
creates the adapters on already-split layers (each rank initialising its own ``B`` slice), where hftrain splits the
adapters PEFT created on the full model, identical on every rank.

Not supported under tensor parallelism, refused by :func:`check_lora_layers`: LoRA variants (DoRA...), LoRA biases,
and LoRA on anything but a linear layer (e.g. the vocabulary-parallel embedding).

Under pipeline parallelism nothing here changes: the stages are cut from the PEFT model's HF model
(:func:`hf_model_of`, ``hftrain.parallel.pipeline``), each keeping its layers' (split) adapters.

Dropout (``lora_dropout``) draws from the RNG tracker's streams (``hftrain.parallel.random``) as Megatron would:
under a column-parallel base it drops the replicated input every tp rank holds whole (the shared ``default``
stream, also inside a region), under a row-parallel base it drops this rank's own input features (its ``tensor``
stream).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from torch import nn

from hftrain.errors import ConfigError
from hftrain.parallel.layers import ColumnParallelLinear, RowParallelLinear
from hftrain.parallel.placement import place
from hftrain.parallel.random import RNGTracker, run_in_stream


def hf_model_of(model: nn.Module) -> nn.Module:
    """The transformers model a tensor-parallel plan names paths in: inside a ``peft.PeftModel``, its base model.

    Args:
        model: an HF model, or a PEFT model wrapping one.
    """
    peft = sys.modules.get("peft")  # a PEFT model exists only once peft is imported; do not import it for others
    return model.get_base_model() if peft is not None and isinstance(model, peft.PeftModel) else model


def is_lora_layer(module: nn.Module) -> bool:
    """True for any PEFT LoRA layer (``lora.Linear``, ``lora.Embedding``...), without importing peft."""
    lora = sys.modules.get("peft.tuners.lora.layer")
    return lora is not None and isinstance(module, lora.LoraLayer)


def check_lora_layers(model: nn.Module) -> None:
    """Refuse the LoRA layers tensor parallelism does not split correctly, naming the field to change.

    Args:
        model: the model about to be split (an HF model or a PEFT model).
    """
    for name, module in model.named_modules():
        if not is_lora_layer(module):
            continue
        from peft.tuners.lora.layer import Linear

        if type(module) is not Linear:
            raise ConfigError(
                f"lora.lora_target_modules: LoRA on '{name}' ({type(module).__name__}) is not supported with tensor "
                "parallelism; target linear layers only (e.g. query value, q_proj v_proj, c_attn)"
            )
        if module.lora_variant:
            raise ConfigError(
                f"LoRA variant {sorted(type(v).__name__ for v in module.lora_variant.values())} on '{name}' is not "
                "supported with tensor parallelism; build the adapters with peft LoraConfig(use_dora=False)"
            )
        if any(module.lora_bias.values()):
            raise ConfigError(
                f"LoRA bias on '{name}' is not supported with tensor parallelism; build the adapters with peft "
                "LoraConfig(lora_bias=False)"
            )


def split_linear(
    parent: nn.Module,
    name: str,
    module: nn.Module,
    split: Callable[[nn.Module], ColumnParallelLinear | RowParallelLinear],
    rng: RNGTracker | None = None,
) -> None:
    """Replace ``parent.name`` by ``split(module)``; a PEFT ``lora.Linear`` stays and has its parts split instead.

    For a LoRA layer the base is split by ``split``, and so is the adapter factor on the split side (``B`` under a
    column-parallel base, with the base's ``parts`` and per-rank widths; ``A`` under a row-parallel base, summed by
    its own g); the other factor stays replicated and is recorded as partial over tp where its gradient is
    partial (see the module docstring).

    Args:
        parent: the module holding ``module`` as attribute ``name``.
        name: the attribute name.
        module: an ``nn.Linear`` / ``Conv1D``, or a PEFT ``lora.Linear`` wrapping one.
        split: builds the parallel layer from a full linear module (``ColumnParallelLinear`` or
            ``RowParallelLinear`` with the plan's options).
        rng: the RNG tracker the adapters' dropout draws from (None: the default generator).
    """
    if not is_lora_layer(module):
        setattr(parent, name, split(module))
        return
    base = split(module.base_layer)
    module.base_layer = base
    for adapter in list(module.lora_A):
        if isinstance(base, ColumnParallelLinear):
            module.lora_B[adapter] = split(module.lora_B[adapter])
            _mark_partial(module.lora_A[adapter])  # each rank's A gradient covers only its B_i's outputs
        else:
            module.lora_A[adapter] = split(module.lora_A[adapter])
            if base.sequence_parallel:
                _mark_partial(module.lora_B[adapter])  # B ran on this rank's sequence chunk only
        if rng is not None:  # the input is replicated (column) or this rank's own features (row)
            stream = "default" if isinstance(base, ColumnParallelLinear) else "tensor"
            run_in_stream(module.lora_dropout[adapter], rng, stream)


def _mark_partial(linear: nn.Module) -> None:
    place(linear, "weight", partial=("tp",))
