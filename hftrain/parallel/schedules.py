"""Pipeline schedules: small named objects over ``torch.distributed.pipelining``, in one registry.

Each schedule owns this rank's chunks (from :func:`hftrain.parallel.pipeline.build_stage_modules`, or any
modules that map the activation tuple on) and runs one optimizer step's micro-batches through them:

* ``train_step`` runs forward and backward of ``num_microbatches`` micro-batches and returns the mean loss on
  the rank that holds the last stage (``None`` elsewhere). Gradients *accumulate* into ``.grad``: each
  micro-batch's loss is divided by ``num_microbatches`` before its backward instead of letting torch divide
  ``.grad`` afterwards (torch's ``scale_grads`` would also divide gradients the caller accumulated over
  earlier steps, breaking gradient accumulation).
* ``eval_step`` runs forward only and returns the logits on the last stage.

``torch.distributed.pipelining`` infers the shapes it sends once per schedule object. The batch shape is
therefore broadcast from the first stage over the pipeline group each step (one tiny collective) and one
torch schedule is kept per shape (a few, least recently used dropped): dynamic padding works, but every new
shape costs a metadata exchange, so pad to a fixed length under pp for speed.

Adding a schedule (e.g. zero-bubble ZBV) is one class naming its torch schedule and rules, and one
:data:`SCHEDULES` entry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from hftrain.errors import ConfigError
from hftrain.parallel.pipeline import chunk_ids_of_rank
from hftrain.parallel.timeline import TimelineRecorder

INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")  # the first chunk's positional inputs, in order
_CACHED_SHAPES = 4  # torch schedules kept per (batch, sequence) shape


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

    def _timed(self, kind: str, microbatch: int, run: Callable[[], Any]) -> Any:
        start = time.time()
        result = run()
        if self.recorder is not None:
            self.recorder.record(self.stage_index, microbatch, kind, start, time.time())
        return result

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """Torch's forward of one micro-batch, timed as an ``F`` event."""
        return self._timed(
            "F", fwd_chunk_id, lambda: super(TimedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        )

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


class PipelineSchedule:
    """One pipeline schedule on this rank: its chunks, micro-batching, and the torch schedule per shape.

    Args:
        stages: this rank's chunks, in order (chunk ``k`` is global stage ``pp_rank + k · pp``).
        pp_group: the pipeline process group (ranks ordered by pipeline rank).
        pp_rank: this rank's index in ``pp_group``.
        pp: pipeline-parallel size.
        num_microbatches: micro-batches per ``train_step``; must divide the batch.
        loss_fn: ``loss_fn(logits, labels) -> mean loss`` of one micro-batch.
        device: where the chunks live.
        recorder: records F/B events of ``train_step`` (not of ``eval_step``) when given.
    """

    name: ClassVar[str]
    torch_class: ClassVar[type]
    layout: ClassVar[str] = "loop"  # which chunks a rank holds (pass to build_stage_modules)

    def __init__(
        self,
        stages: list[torch.nn.Module],
        *,
        pp_group: Any,
        pp_rank: int,
        pp: int,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device | str,
        recorder: TimelineRecorder | None = None,
    ) -> None:
        self.check(pp=pp, virtual_stages=len(stages), num_microbatches=num_microbatches)
        self.stages = stages
        self.pp_group, self.pp_rank, self.pp = pp_group, pp_rank, pp
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.device = torch.device(device)
        self.recorder = recorder
        self.chunk_ids = chunk_ids_of_rank(pp_rank, pp=pp, virtual_stages=len(stages), layout=self.layout)
        built_for = [getattr(chunk, "index", c) for chunk, c in zip(stages, self.chunk_ids, strict=True)]
        if built_for != self.chunk_ids:
            raise ConfigError(
                f"pipeline schedule {self.name!r} runs chunks {self.chunk_ids} on pp rank {pp_rank} but the stages "
                f"were built as chunks {built_for}; pass layout={self.layout!r} to build_stage_modules"
            )
        self.is_first = 0 in self.chunk_ids  # pipeline rank 0 in every layout
        self.is_last = pp * len(stages) - 1 in self.chunk_ids  # the last rank ("loop") or rank 0 again ("v")
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()

    @classmethod
    def check(cls, *, pp: int, virtual_stages: int, num_microbatches: int) -> None:
        """Refuse settings this schedule cannot run (ConfigError naming the field), before any group exists.

        Args:
            pp: pipeline-parallel size.
            virtual_stages: chunks per rank.
            num_microbatches: micro-batches per step.
        """
        if num_microbatches < 1:
            raise ConfigError(f"strategy.num_microbatches must be >= 1, got {num_microbatches}")
        if virtual_stages != 1:
            raise ConfigError(
                f"strategy.schedule {cls.name!r} runs one stage per rank; set virtual_stages: 1 or use "
                "schedule: interleaved_1f1b"
            )

    # -- the per-step interface -------------------------------------------------------------------------------

    def train_step(self, inputs: dict[str, torch.Tensor] | None, labels: torch.Tensor | None) -> torch.Tensor | None:
        """Forward and backward of all micro-batches of one batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the batch (``input_ids``, ``attention_mask``, optional ``token_type_ids``); needed on the
                first pipeline rank, ignored elsewhere.
            labels: the batch's labels; needed on the last pipeline rank, ignored elsewhere.

        Returns:
            The mean loss over the micro-batches (detached) on the last pipeline rank, else ``None``.
        """
        args, shape = self._first_stage_args(inputs)
        if shape[0] % self.num_microbatches:
            raise ConfigError(
                f"strategy.num_microbatches={self.num_microbatches} does not divide the per-step batch of "
                f"{shape[0]} examples; choose a batch size that is a multiple of it"
            )
        schedule = self._schedule(("train", *shape), self.num_microbatches, training=True)
        if self.recorder is not None:
            self.recorder.begin_step()
        losses: list[torch.Tensor] = []
        schedule.step(*args, **self._last_stage_kwargs(labels, losses), return_outputs=False)
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()  # each is loss / num_microbatches

    def eval_step(self, inputs: dict[str, torch.Tensor] | None, labels: torch.Tensor | None = None) -> Any:
        """Forward only; any batch size (micro-batches: the largest divisor of it up to ``num_microbatches``).

        Args:
            inputs: the batch, needed on the first pipeline rank.
            labels: unused (accepted so evaluation calls mirror ``train_step``).

        Returns:
            The logits ``[batch, num_labels]`` on the last pipeline rank, else ``None``.
        """
        args, shape = self._first_stage_args(inputs)
        count = _largest_divisor_at_most(shape[0], self.num_microbatches)
        schedule = self._schedule(("eval", *shape), count, training=False)
        with torch.no_grad():
            return schedule.step(*args)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _first_stage_args(self, inputs: dict[str, torch.Tensor] | None) -> tuple[tuple, tuple[int, int, int]]:
        """Positional inputs of the first chunk, and ``(batch, seq, has_token_types)`` agreed by all stages."""
        args: tuple = ()
        shape = torch.zeros(3, dtype=torch.int64)
        if self.is_first:
            if inputs is None or "input_ids" not in inputs:
                raise ValueError("the first pipeline stage needs inputs with input_ids")
            ids = inputs["input_ids"].to(self.device)
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask.to(self.device)
            types = inputs.get("token_type_ids")
            args = (ids, mask) if types is None else (ids, mask, types.to(self.device))
            shape = torch.tensor([ids.shape[0], ids.shape[1], int(types is not None)])
        if self.pp > 1:  # later stages see no inputs: they learn the shape from the first
            dist.broadcast(shape, group=self.pp_group, group_src=0)
        return args, tuple(int(x) for x in shape)

    def _last_stage_kwargs(self, labels: torch.Tensor | None, losses: list) -> dict:
        if not self.is_last:
            return {}
        if labels is None:
            raise ValueError("the last pipeline stage needs the labels")
        return {"target": labels.to(self.device), "losses": losses}

    def _schedule(self, key: tuple, num_microbatches: int, *, training: bool) -> Any:
        """The torch schedule for ``key``, built on first use (torch infers the stage shapes once per object)."""
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        num_stages = self.pp * len(self.stages)
        stages = [
            TimedStage(
                chunk,
                index,
                num_stages,
                self.device,
                group=self.pp_group,
                recorder=self.recorder if training else None,
            )
            for index, chunk in zip(self.chunk_ids, self.stages, strict=True)
        ]
        if training:
            schedule = self.build_torch_schedule(stages, num_microbatches, self._scaled_loss(num_microbatches))
        else:
            schedule = self.build_eval_schedule(stages, num_microbatches)
        self._schedules[key] = schedule
        if len(self._schedules) > _CACHED_SHAPES:
            self._schedules.popitem(last=False)
        return schedule

    def _scaled_loss(self, num_microbatches: int) -> Callable:
        loss_fn = self.loss_fn

        def scaled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            # the step's loss is the mean over micro-batches: scale each before its backward (see module doc)
            return loss_fn(logits, labels) / num_microbatches

        return scaled

    def build_eval_schedule(self, stages: list[TimedStage], num_microbatches: int) -> Any:
        """A forward-only torch schedule: the order does not matter, so one with no micro-batch constraints.

        Args:
            stages: this rank's ``TimedStage`` objects.
            num_microbatches: micro-batches of this batch.
        """
        if len(stages) == 1:
            return ScheduleGPipe(stages[0], num_microbatches, loss_fn=None)
        return ScheduleLoopedBFS(stages, num_microbatches, loss_fn=None)

    def build_torch_schedule(self, stages: list[TimedStage], num_microbatches: int, loss_fn: Callable) -> Any:
        """The torch schedule object over this rank's stages.

        Args:
            stages: this rank's ``TimedStage`` objects.
            num_microbatches: micro-batches per step.
            loss_fn: the (already scaled) micro-batch loss.
        """
        return self.torch_class(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)


class GPipeSchedule(PipelineSchedule):
    """GPipe: all forwards, then all backwards; every micro-batch's activations live until its backward."""

    name = "gpipe"
    torch_class = ScheduleGPipe


class OneFOneBSchedule(PipelineSchedule):
    """1F1B: after a warm-up of ``pp - rank`` forwards, alternate one forward and one backward.

    Same bubble as GPipe, but at most ``pp`` micro-batches' activations are alive on a rank instead of all.
    """

    name = "1f1b"
    torch_class = Schedule1F1B

    @classmethod
    def check(cls, *, pp: int, virtual_stages: int, num_microbatches: int) -> None:
        """As the base, and ``num_microbatches >= pp`` (the warm-up needs one micro-batch per stage)."""
        super().check(pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches)
        if num_microbatches < pp:
            raise ConfigError(
                f"strategy.schedule {cls.name!r} needs num_microbatches >= pp ({num_microbatches} < {pp})"
            )


class Interleaved1F1BSchedule(PipelineSchedule):
    """Interleaved 1F1B (Megatron's virtual pipeline): ``virtual_stages`` chunks per rank, 1F1B across them.

    The bubble shrinks from ``(p-1)/(m+p-1)`` to ``(p-1)/(v·m+p-1)`` at the cost of ``v×`` more sends.
    """

    name = "interleaved_1f1b"
    torch_class = ScheduleInterleaved1F1B

    @classmethod
    def check(cls, *, pp: int, virtual_stages: int, num_microbatches: int) -> None:
        """``pp > 1``, ``virtual_stages >= 1``, ``num_microbatches`` a positive multiple of ``pp``."""
        if pp < 2:
            raise ConfigError(f"strategy.schedule {cls.name!r} needs pp >= 2; use schedule: gpipe or 1f1b")
        if virtual_stages < 1:
            raise ConfigError(f"strategy.virtual_stages must be >= 1, got {virtual_stages}")
        if num_microbatches < pp or num_microbatches % pp:
            raise ConfigError(
                f"strategy.schedule {cls.name!r} needs num_microbatches to be a multiple of pp={pp}, "
                f"got {num_microbatches}"
            )

    def build_torch_schedule(self, stages: list[TimedStage], num_microbatches: int, loss_fn: Callable) -> Any:
        """Torch's interleaved schedule takes all of this rank's stages."""
        return self.torch_class(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)


class InterleavedZeroBubbleSchedule(Interleaved1F1BSchedule):
    """Interleaved zero bubble (ZB1P): backward split into input (``B``) and weight (``W``) gradients, the ``W``
    passes moved into the bubbles. Same chunk layout and rules as interleaved 1F1B."""

    name = "interleaved_zb"
    torch_class = ScheduleInterleavedZeroBubble


class ZBVSchedule(Interleaved1F1BSchedule):
    """Zero bubble V (ZBV): two chunks per rank in a V (rank ``r`` holds chunks ``r`` and ``2p-1-r``), backward
    split into input and weight passes that fill the bubbles."""

    name = "zbv"
    torch_class = ScheduleZBVZeroBubble
    layout = "v"

    @classmethod
    def check(cls, *, pp: int, virtual_stages: int, num_microbatches: int) -> None:
        """As interleaved, and exactly 2 chunks per rank (the V)."""
        super().check(pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches)
        if virtual_stages != 2:
            raise ConfigError(f"strategy.schedule {cls.name!r} needs virtual_stages: 2, got {virtual_stages}")

    def eval_step(self, inputs: dict[str, torch.Tensor] | None, labels: torch.Tensor | None = None) -> Any:
        """Forward only, the whole batch chunk after chunk down and up the V.

        Torch's forward-only schedules assume the loop layout and its V schedules need a backward, so this
        hand-written pass sends each chunk's activation tuple to the next chunk's rank (tested against the
        same reference logits as the other schedules).

        Args:
            inputs: the batch, needed on the first pipeline rank.
            labels: unused.
        """
        acts, _ = self._first_stage_args(inputs)
        num_chunks = self.pp * len(self.stages)
        owner = {
            c: r
            for r in range(self.pp)
            for c in chunk_ids_of_rank(r, pp=self.pp, virtual_stages=len(self.stages), layout=self.layout)
        }
        local = dict(zip(self.chunk_ids, self.stages, strict=True))
        with torch.no_grad():
            for c in range(num_chunks):
                if c not in local:
                    continue
                if c > 0 and owner[c - 1] != self.pp_rank:
                    box: list[Any] = [None]
                    dist.recv_object_list(box, group=self.pp_group, group_src=owner[c - 1])
                    acts = box[0]
                out = local[c](*acts)
                acts = out if isinstance(out, tuple) else (out,)
                if c + 1 < num_chunks and owner[c + 1] != self.pp_rank:
                    dist.send_object_list([acts], group=self.pp_group, group_dst=owner[c + 1])
        return acts[0] if self.is_last else None


SCHEDULES: dict[str, type[PipelineSchedule]] = {
    cls.name: cls
    for cls in (GPipeSchedule, OneFOneBSchedule, Interleaved1F1BSchedule, InterleavedZeroBubbleSchedule, ZBVSchedule)
}


def schedule_class(name: str) -> type[PipelineSchedule]:
    """The registered schedule ``name``; ConfigError listing the choices otherwise.

    Args:
        name: a key of :data:`SCHEDULES`.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"strategy.schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]


def check_schedule(name: str, *, pp: int, virtual_stages: int = 1, num_microbatches: int) -> None:
    """Validate a schedule choice before any process group exists (ConfigError naming the field).

    Args:
        name: schedule name.
        pp: pipeline-parallel size.
        virtual_stages: chunks per rank.
        num_microbatches: micro-batches per step.
    """
    schedule_class(name).check(pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches)


def build_schedule(name: str, stages: list[torch.nn.Module], **options: Any) -> PipelineSchedule:
    """Build the registered schedule ``name`` over this rank's chunks.

    Args:
        name: a key of :data:`SCHEDULES`.
        stages: this rank's chunks, in order.
        options: the keyword arguments of :class:`PipelineSchedule`: ``pp_group``, ``pp_rank``, ``pp``,
            ``num_microbatches``, ``loss_fn``, ``device`` and optionally ``recorder``.
    """
    return schedule_class(name)(stages, **options)
