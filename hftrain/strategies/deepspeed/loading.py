"""ZeRO's model load (``hftrain.strategies.loading``): ZeRO-3 partitions each block as it is read; ZeRO-1/2 ranks but
0 leave theirs to the engine's broadcast.

ZeRO-3: each block, read whole into host memory, becomes ZeRO parameters at once through ``deepspeed.zero.Init(
module=block)`` (DeepSpeed's documented way to partition an already-built module: rank r keeps elements
``[r·P, (r+1)·P)`` of each flattened tensor, ``P = ceil(numel / N)``, in ``param.ds_tensor`` and frees the rest).
``zero.Init`` first broadcasts each tensor from rank 0 of the data-parallel group (``_zero_init_param``: one
broadcast per tensor, as ``prepare`` does for a whole model), so only rank 0 reads the files; the other ranks give
the block memory and take rank 0's bytes. ``deepspeed.initialize`` later converts the parameters that are still
whole (embeddings, final norm, the new head) the same way (``DeepSpeedZeRoOffload._convert_to_zero_parameters``),
so every parameter ends up partitioned exactly as when the engine partitions a whole model.

One thing the engine does differently for a model that has ZeRO parameters already: it no longer casts the
parameters to bf16/fp16 under mixed precision (``_cast_module_mixed_precision``: "ZeRO-Init params are already at
the configured dtype"). So the blocks are read in that dtype and the rest of the model is cast here, as the engine
would have cast it (``p.data = p.data.to(dtype)`` for every floating parameter; buffers are the engine's).

Why not transformers' own ``zero.Init`` load: it has rank 0 read every tensor from a memory map and broadcast it
(the whole file resident on rank 0), and its ``from_config`` path initialises new parameters on partitions,
unlike one process (pitfall "ZeRO-3 leaves the new head uninitialised").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hftrain.strategies.loading import ShardedLoading

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hftrain.models.weights import Weights

PRECISION = {"bf16": "bfloat16", "fp16": "float16"}


class Zero3Loading(ShardedLoading):
    """Blocks partitioned by ``deepspeed.zero.Init(module=block)`` as they are read.

    Args:
        zero: the run's DeepSpeed JSON ``zero_optimization`` section (``offload_param`` decides where the
            partitions live).
        mixed_precision: the accelerator's (``bf16``/``fp16`` cast the parameters as the engine would).
    """

    name = "ZeRO-3"

    def __init__(self, zero: dict[str, Any], mixed_precision: str) -> None:
        import torch
        import torch.distributed as dist

        offload = zero.get("offload_param") or {}
        self._config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, **({"offload_param": offload} if offload else {})},
        }
        self._reads = not dist.is_initialized() or dist.get_rank() == 0
        self._dtype: torch.dtype | None = getattr(torch, PRECISION[mixed_precision], None) if (
            mixed_precision in PRECISION
        ) else None  # fmt: skip

    def materialize(self, model: nn.Module, blocks: list[str], weights: Weights) -> None:
        super().materialize(model, blocks, weights)
        if self._dtype is not None:  # the engine casts no parameter of a model that has ZeRO parameters
            for param in model.parameters():
                if param.is_floating_point() and not hasattr(param, "ds_id"):
                    param.data = param.data.to(self._dtype)

    def place(self, path: str, block: nn.Module, weights: Weights) -> None:
        if self._dtype is not None:
            block.to(self._dtype)  # on meta: only the dtype the file's bytes are cast to
        if self._reads:
            super().place(path, block, weights)
        else:  # zero.Init broadcasts rank 0's values into every rank's copy before it partitions: nothing to read
            block.to_empty(device="cpu")
            self.shard(block)

    def shard(self, block: nn.Module) -> None:
        import deepspeed

        deepspeed.zero.Init(module=block, config_dict_or_path=self._config)
