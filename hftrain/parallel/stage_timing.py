"""A pipeline stage that times its micro-batches (:class:`TimedStage`), the first stage's input spec broadcast to the
later stages, and how a batch is cut into micro-batches (:func:`microbatch_passes`): what the schedules of
``hftrain.parallel.schedules`` (which re-exports these names) run on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import (
    PipelineStage,
)

from hftrain.parallel.host import broadcast_ints
from hftrain.parallel.timeline import TimelineRecorder

_SPEC_INTS = 32  # integers broadcast for the first stage's tensors' shapes (a few tensors of a few dimensions)
_DTYPES = (torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.float64,
           torch.int16, torch.int8, torch.uint8)  # fmt: skip


def _encode_spec(args: tuple[torch.Tensor, ...]) -> list[int]:
    """``[batch, count, (dtype code, ndim, *dims[1:]) per tensor]`` padded with zeros to :data:`_SPEC_INTS`: what the
    later stages need of the first stage's inputs (every tensor is split along its first dimension, the batch's)."""
    batch = args[0].shape[0]
    ints = [batch, len(args)]
    for arg in args:
        if arg.dim() == 0 or arg.shape[0] != batch or arg.dtype not in _DTYPES:
            raise ValueError(
                f"the first pipeline stage's inputs must be tensors of one batch size ({batch}) and a plain dtype, got "
                f"{tuple(arg.shape)} {arg.dtype}"
            )
        ints += [_DTYPES.index(arg.dtype), arg.dim(), *arg.shape[1:]]
    if len(ints) > _SPEC_INTS:
        raise ValueError(f"the first pipeline stage's inputs take {len(ints)} shape integers, over {_SPEC_INTS}")
    return ints + [0] * (_SPEC_INTS - len(ints))


def _decode_spec(ints: list[int]) -> tuple[int, ...]:
    """``(batch, *spec)`` of :func:`_encode_spec`'s integers, the padding dropped."""
    batch, count = ints[0], ints[1]
    spec, at = [count], 2
    for _ in range(count):
        ndim = ints[at + 1]
        spec += ints[at : at + 1 + ndim]  # the dtype code, ndim, then ndim - 1 dimensions
        at += 1 + ndim
    return (batch, *spec)


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that records the wall-clock span of each micro-batch's forward and backward.

    Args:
        submodule: the chunk this stage runs.
        stage_index: global index of the chunk (``pp_rank + k · pp``).
        num_stages: ``pp · virtual_stages``.
        device: where the chunk lives.
        group: the pipeline process group.
        recorder: where events go; ``None`` records nothing.
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        group: Any,
        recorder: TimelineRecorder | None,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.recorder = recorder
        self.first_microbatch = 0  # the step's index of this pass's first micro-batch (a step may run two passes)

    def _timed(self, kind: str, microbatch: int, run: Callable[[], Any]) -> Any:
        if self.recorder is not None and self.device.type == "cuda":  # the kernels' span, not their launch
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            result = run()
            end_event.record()
            where = (self.stage_index, self.first_microbatch + microbatch, kind)
            self.recorder.record_device(*where, start_event, end_event)
            return result
        start = time.time()
        result = run()
        if self.recorder is not None:
            self.recorder.record(self.stage_index, self.first_microbatch + microbatch, kind, start, time.time())
        return result

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """Torch's forward of one micro-batch, timed as an ``F`` event. A chunk that keeps statistics of what it
        runs (``microbatch()``) counts it: torch's own forwards on placeholder tensors, when it infers the stage
        shapes, are not micro-batches."""
        run = lambda: super(TimedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs)  # noqa: E731
        with getattr(self.submod, "microbatch", contextlib.nullcontext)():
            return self._timed("F", fwd_chunk_id, run)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """Torch's backward of one micro-batch, timed as a ``B`` event."""
        return self._timed(
            "B", bwd_chunk_id, lambda: super(TimedStage, self).backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        )

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """Torch's weight-gradient pass (zero-bubble schedules), timed as a ``W`` event."""
        run = lambda: super(TimedStage, self).backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)  # noqa: E731
        return self._timed("W", bwd_chunk_id, run)


def _largest_divisor_at_most(n: int, bound: int) -> int:
    return max(d for d in range(1, min(n, bound) + 1) if n % d == 0)


def microbatch_passes(batch: int, num_microbatches: int) -> list[tuple[int, int]]:
    """How a batch of ``batch`` examples runs: ``[(rows per micro-batch, micro-batches), ...]``, one entry per pass.

    ``m' = min(num_microbatches, batch)`` micro-batches whose sizes differ by at most one, in
    ``torch.tensor_split``'s order (the ``batch mod m'`` longer ones first); each size is one pass of a torch
    schedule, which holds receive buffers of one micro-batch shape.

    Args:
        batch: examples in the step's batch (at least 1).
        num_microbatches: the configured micro-batches per step.
    """
    count = min(num_microbatches, batch)
    rows, longer = divmod(batch, count)
    passes = [(rows + 1, longer), (rows, count - longer)]
    return [(size, n) for size, n in passes if n > 0]


def agree_on_spec(args: tuple[torch.Tensor, ...] | None, *, group: Any = None) -> tuple[int, ...]:
    """The first stage's inputs' spec ``(batch, *spec)``, agreed by every stage of ``group``: the first stage (the
    one with ``args``) encodes it (:func:`_encode_spec`) and broadcasts :data:`_SPEC_INTS` integers over the group's
    host side (``hftrain.parallel.host.broadcast_ints``: one collective); the others receive it.

    Args:
        args: the first stage's inputs, None on the other stages.
        group: the pipeline group (None: one stage, nothing broadcast).
    """
    ints = _encode_spec(args) if args is not None else None
    if group is not None:  # later stages see no inputs: they learn the shapes from the first, over the host group
        ints = broadcast_ints(ints, _SPEC_INTS, group=group, group_src=0)
    assert ints is not None
    return _decode_spec(ints)
