"""The ``megatron`` strategy's pipeline input checks, run before any process group or file exists.

The fields alone are checked by ``ParallelismConfig.validate``; what needs the batch geometry or the model's layer
count is checked here, each refusal one line naming the field and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    """Refuse a micro-batch count that does not split the per-device batch or cannot fill the schedule, length
    buckets that sequence parallelism cannot split, and sequence parallelism, which the stages do not support yet.

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
    check_length_buckets(parallelism)
    from hftrain.parallel.schedules import check_schedule

    check_schedule(
        parallelism.schedule, pp=parallelism.pp, virtual_stages=parallelism.virtual_stages, num_microbatches=micro
    )
    # What the pipeline stages do not implement yet: the stages rebuild full-length attention masks around
    # sequence-sharded hidden states (ZeRO-1 with stages is the strategy's refusal).
    if parallelism.sequence_parallel and parallelism.pp > 1:
        raise ConfigError(
            "parallelism.sequence_parallel with parallelism.pp > 1 is not supported yet; use sequence_parallel: false"
        )


def check_length_buckets(parallelism: ParallelismConfig) -> None:
    """Refuse length buckets (``pad_to_multiple_of``) that are not a multiple of ``tp`` under sequence parallelism,
    which cuts every sequence into ``tp`` equal parts.

    Args:
        parallelism: the ``parallelism`` section.
    """
    import math

    buckets, tp = parallelism.pad_to_multiple_of, parallelism.tp
    if buckets and parallelism.sequence_parallel and tp > 1 and buckets % tp:
        raise ConfigError(
            f"parallelism.pad_to_multiple_of={buckets} is not a multiple of parallelism.tp={tp}, and sequence "
            f"parallelism cuts every sequence into tp equal parts; use a multiple of {tp} (e.g. "
            f"{math.lcm(buckets, tp)})"
        )


def check_context_parallel(parallelism: ParallelismConfig) -> None:
    """Refuse what context parallelism does not compose with yet (pipeline stages, sequence parallelism) and
    length buckets that the zigzag split (``2·cp`` equal chunks) cannot cut.

    Args:
        parallelism: the ``parallelism`` section.
    """
    import math

    cp = parallelism.cp
    if cp == 1:
        return
    if parallelism.sequence_parallel:
        raise ConfigError(
            f"parallelism.cp={cp} with parallelism.sequence_parallel is not supported yet; use sequence_parallel: false"
        )
    buckets = parallelism.pad_to_multiple_of
    if buckets and buckets % (2 * cp):
        raise ConfigError(
            f"parallelism.pad_to_multiple_of={buckets} is not a multiple of 2·cp = {2 * cp}, and context parallelism "
            f"cuts every sequence into 2·cp equal chunks; use a multiple of {2 * cp} (e.g. {math.lcm(buckets, 2 * cp)})"
        )


ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")


def check_context_parallel_model(parallelism: ParallelismConfig, model_config: Any) -> None:
    """Refuse a model context parallelism cannot split: another family, attention dropout (the attention
    probabilities never exist whole), heads the all-to-all cannot divide.

    Args:
        parallelism: the ``parallelism`` section (``cp > 1``).
        model_config: the model's ``transformers`` config.
    """
    from hftrain.errors import AxisError
    from hftrain.parallel.families import check_family

    check_family(model_config, axis="cp")
    for field in ATTENTION_DROPOUT_FIELDS:
        if getattr(model_config, field, 0) or 0:
            raise ConfigError(
                f"parallelism.cp={parallelism.cp}: context parallelism needs attention dropout 0, and the model's "
                f"{field} is {getattr(model_config, field)}; save the model with {field}: 0.0 in its config.json"
            )
    if parallelism.cp_comm == "all_to_all":
        from hftrain.parallel.plans import grouped_query_split

        heads = model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        # each tp rank's own heads (checked by check_tensor_parallel first); key/value heads fewer than tp are
        # replicated, one per rank, which no cp > 1 divides
        split = grouped_query_split(heads, kv_heads, parallelism.tp)
        heads, kv = split.heads, split.kv_heads
        if heads % parallelism.cp or kv % parallelism.cp:
            raise AxisError(
                "cp",
                f"cp_comm all_to_all splits heads over cp, and each tp rank's {heads} heads / {kv} key/value heads "
                f"do not divide by cp={parallelism.cp}; use cp_comm: ring or a cp dividing both",
            )


def check_pipeline_model(parallelism: ParallelismConfig, model_config: Any) -> None:
    """Refuse more stages than layers, and virtual stages that do not split the layers evenly.

    Args:
        parallelism: the ``parallelism`` section (``pp > 1``).
        model_config: the model's ``transformers`` config.
    """
    from hftrain.parallel.pipeline import stage_layer_ranges

    # The same split the stages will use; balance "layers" needs no parameter sizes and applies the same checks.
    stage_layer_ranges(model_config.num_hidden_layers, pp=parallelism.pp, virtual_stages=parallelism.virtual_stages)
