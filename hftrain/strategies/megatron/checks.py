"""The ``megatron`` strategy's checks of the pipeline against the batch, run before any process group or file exists.

The fields alone are checked by ``ParallelismConfig.validate``, what each axis can split by ``hftrain.parallel``
(``check_layout``, ``check_model``); what needs the batch geometry is checked here, each refusal one line naming
the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hftrain.errors import ConfigError

if TYPE_CHECKING:
    from hftrain.config import ParallelismConfig, TrainingConfig


def num_microbatches(parallelism: ParallelismConfig) -> int:
    """The micro-batches per per-device batch: the configured number, or ``pp`` when null.

    Args:
        parallelism: the ``parallelism`` section.
    """
    return parallelism.num_microbatches or parallelism.pp


def check_pipeline_training(parallelism: ParallelismConfig, training: TrainingConfig) -> None:
    """Refuse a micro-batch count that does not split the per-device batch or cannot fill the schedule, and sequence
    parallelism, which the stages do not support yet.

    A short last batch is not refused: the schedule runs it in fewer or uneven micro-batches, weighted by their
    examples (``hftrain.parallel.schedules``).

    Args:
        parallelism: the ``parallelism`` section (any ``pp``: an interleaved schedule at ``pp = 1`` is refused too).
        training: the ``training`` section (``per_device_train_batch_size``).
    """
    micro, batch = num_microbatches(parallelism), training.per_device_train_batch_size
    if batch % micro:
        raise ConfigError(
            f"parallelism.num_microbatches={micro} does not divide training.per_device_train_batch_size={batch}; "
            "choose a divisor of the per-device batch (each optimizer step's batch is split into equal micro-batches)"
        )
    from hftrain.parallel.schedules import check_schedule

    check_schedule(
        parallelism.schedule, pp=parallelism.pp, virtual_stages=parallelism.virtual_stages, num_microbatches=micro
    )
    # What the pipeline stages do not implement yet: the stages rebuild full-length attention masks around
    # sequence-sharded hidden states.
    if parallelism.sequence_parallel and parallelism.pp > 1:
        raise ConfigError(
            "parallelism.sequence_parallel with parallelism.pp > 1 is not supported yet; use sequence_parallel: false"
        )
