"""The ``zero1``/``zero2``/``zero3`` strategies' home: DeepSpeed ZeRO through Accelerate.

=================  ==============================================================================================
``strategy.py``    ``ZeroStrategy`` (stages 1-3): config -> the DeepSpeed JSON (batch settings, model-sized
                   buffers, offload), the ``Accelerator`` and which runtime runs; CPU Adam's build check
``runtime.py``     ``ZeroRuntime``: ZeRO's partitions in the sharded checkpoint format and the streamed export
=================  ==============================================================================================
"""

from hftrain.strategies.deepspeed.runtime import ZeroRuntime
from hftrain.strategies.deepspeed.strategy import (
    MODEL_SIZED,
    Zero1Strategy,
    Zero2Strategy,
    Zero3Strategy,
    ZeroStrategy,
    check_cpu_adam,
    cpu_adam_status,
    default_ds_config,
    fill_batch_settings,
    fill_model_sized,
)

__all__ = [
    "MODEL_SIZED",
    "Zero1Strategy",
    "Zero2Strategy",
    "Zero3Strategy",
    "ZeroRuntime",
    "ZeroStrategy",
    "check_cpu_adam",
    "cpu_adam_status",
    "default_ds_config",
    "fill_batch_settings",
    "fill_model_sized",
]
