"""Pipeline schedules: small named objects over ``torch.distributed.pipelining``, in one registry.

Each schedule owns this rank's chunks (from :func:`hftrain.parallel.pipeline.build_stage_modules`, or any
modules that map the activation tuple on) and runs one optimizer step's micro-batches through them:

* ``train_step`` runs forward and backward of a batch of ``b`` examples and returns its loss on the rank that
  holds the last stage (``None`` elsewhere). The batch is cut into ``m' = min(m, b)`` micro-batches
  (``m = num_microbatches``) of ``n_i`` examples, sizes differing by at most one (``torch.tensor_split``'s:
  the first ``b mod m'`` one longer), and micro-batch ``i``'s mean loss ``ℓ_i`` is weighted before its backward::

      L = Σ_i (n_i / b) · ℓ_i        (= the mean over the batch's examples: what one process computes)

  Gradients *accumulate* into ``.grad``: the weights replace torch's ``scale_grads``, which would also divide
  gradients the caller accumulated over earlier steps (gradient accumulation).
* ``eval_step`` runs forward only and returns the logits on the last stage.

Torch's stages infer the shapes they send, and size their receive buffers, once per schedule object for one
micro-batch shape. Micro-batches of one size therefore run as one pass of a torch schedule, and a batch whose
micro-batches have two sizes (a short last batch, one the count does not divide) as two passes, the longer
micro-batches first. A pass with a micro-batch count the configured torch schedule cannot run (1F1B needs at least
``pp``) runs through the style's any-count schedule (GPipe for one chunk per rank, looped BFS for several; ZBV
runs any count): the same gradients in another order.

The schedules do not open the batch nor the output: the first chunk picks the columns it reads (its task head's
``first_args``), the target is split along the batch dimension with them, and the last chunk's output goes to the
loss as it is. The number, dtypes and shapes of the first chunk's inputs are broadcast from the first stage over the
pipeline group's host side each step (one tiny collective), and torch schedules are cached per ``(micro-batches,
rows per micro-batch, the inputs' dtypes and shapes after the batch dimension)``, a few per kind (training,
evaluation), least recently used dropped. ``PipelineSchedule.builds`` counts the schedules built:
each costs a metadata exchange and a forward and backward on placeholder tensors per stage. Dynamic padding
gives one length per batch; length buckets (the collator's ``pad_to_multiple_of``, ``parallelism.pad_to_multiple_of``
in the Trainer) keep the lengths, and so the builds, to a few.

Adding a schedule (e.g. zero-bubble ZBV) is one class naming its torch schedule and rules, and one
:data:`SCHEDULES` entry.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from hftrain.errors import AxisError, ConfigError
from hftrain.parallel.host import recv_object, send_object
from hftrain.parallel.pipeline import chunk_ids_of_rank
from hftrain.parallel.stage_timing import TimedStage, _largest_divisor_at_most, agree_on_spec, microbatch_passes
from hftrain.parallel.timeline import TimelineRecorder

_CACHED_SHAPES = 8  # torch schedules kept per kind (training, evaluation), least recently used dropped


class PipelineSchedule:
    """One pipeline schedule on this rank: its chunks, micro-batching, and the torch schedule per shape.

    Args:
        stages: this rank's chunks, in order (chunk ``k`` is global stage ``pp_rank + k · pp``).
        pp_group: the pipeline process group (ranks ordered by pipeline rank).
        pp_rank: this rank's index in ``pp_group``.
        pp: pipeline-parallel size.
        num_microbatches: micro-batches per ``train_step`` (fewer when the batch has fewer examples).
        loss_fn: ``loss_fn(output, target) -> mean loss`` of one micro-batch, ``target`` split with the inputs
            along the batch dimension; a ``train_step`` may pass its own instead.
        device: where the chunks live.
        recorder: records F/B events of ``train_step`` (not of ``eval_step``) when given.

    Attributes:
        builds: torch schedules built so far, by kind (``"train"``, ``"eval"``): one per cache miss.
    """

    name: ClassVar[str]
    torch_class: ClassVar[type]
    style: ClassVar[str] = "loop"  # which chunks a rank holds (pass to build_stage_modules)

    def __init__(
        self,
        stages: list[torch.nn.Module],
        *,
        pp_group: Any,
        pp_rank: int,
        pp: int,
        num_microbatches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
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
        self.chunk_ids = chunk_ids_of_rank(pp_rank, pp=pp, virtual_stages=len(stages), style=self.style)
        built_for = [getattr(chunk, "index", c) for chunk, c in zip(stages, self.chunk_ids, strict=True)]
        if built_for != self.chunk_ids:
            raise ConfigError(
                f"pipeline schedule {self.name!r} runs chunks {self.chunk_ids} on pp rank {pp_rank} but the stages "
                f"were built as chunks {built_for}; pass style={self.style!r} to build_stage_modules"
            )
        self.is_first = 0 in self.chunk_ids  # pipeline rank 0 in every style
        self.is_last = pp * len(stages) - 1 in self.chunk_ids  # the last rank ("loop") or rank 0 again ("v")
        self._schedules: dict[str, OrderedDict[tuple, tuple[Any, list[TimedStage]]]] = {
            "train": OrderedDict(),
            "eval": OrderedDict(),
        }
        self.builds: Counter[str] = Counter()
        self._step_loss: tuple[Callable[[Any, torch.Tensor], torch.Tensor], int | None, int] | None = None

    @classmethod
    def check(cls, *, pp: int, virtual_stages: int, num_microbatches: int) -> None:
        """Refuse settings this schedule cannot run (ConfigError naming the field), before any group exists.

        Args:
            pp: pipeline-parallel size.
            virtual_stages: chunks per rank.
            num_microbatches: micro-batches per step.
        """
        if num_microbatches < 1:
            raise AxisError("num_microbatches", f"num_microbatches must be >= 1, got {num_microbatches}")
        if virtual_stages != 1:
            raise AxisError(
                "virtual_stages",
                f"schedule {cls.name!r} runs one stage per rank; set virtual_stages: 1 or use "
                "schedule: interleaved_1f1b",
            )

    @classmethod
    def runs(cls, *, pp: int, num_microbatches: int) -> bool:
        """Whether the torch schedule runs a pass of ``num_microbatches`` (else the any-count schedule runs it).

        Args:
            pp: pipeline-parallel size.
            num_microbatches: micro-batches of the pass.
        """
        return True

    # -- the per-step interface -------------------------------------------------------------------------------

    def train_step(
        self,
        inputs: dict[str, torch.Tensor] | None,
        target: torch.Tensor | None,
        *,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        per_example_mean: bool = True,
        loss_divisor: int = 1,
    ) -> torch.Tensor | None:
        """Forward and backward of all micro-batches of one batch; gradients accumulate into ``.grad``.

        Any batch size runs: ``min(num_microbatches, batch)`` micro-batches of sizes differing by at most one
        (:func:`microbatch_passes`), each micro-batch's loss weighted by its share of the batch's examples when it is
        a mean over them (``per_example_mean``), else added as it is. This is the one place a pipeline's loss is
        scaled: micro-batch ``i``'s backward runs on ``ℓ_i / a · w_i`` (``a = loss_divisor``, ``w_i = n_i / b`` or 1).

        Args:
            inputs: the batch, unopened: the first chunk picks the columns it reads (its task head's
                ``first_args``); needed on the first pipeline rank, ignored elsewhere.
            target: what the loss compares the output with, one row per example (the labels, or row indices into
                the batch), split with the inputs; needed on the last pipeline rank, ignored elsewhere.
            loss_fn: this step's ``loss_fn(output, target_rows) -> mean loss`` of one micro-batch; default the
                schedule's. Torch also calls it once on placeholder outputs when it builds a schedule.
            per_example_mean: whether ``loss_fn`` is its micro-batch's mean over examples (weighted by ``n_i / b``);
                False: a loss its caller already scaled to the batch (a causal LM's sum over target tokens divided by
                the global batch's count), so the micro-batches' losses add up unweighted.
            loss_divisor: ``a``, what the losses are divided by before their backward (the gradient accumulation
                steps, as ``backward()`` under accumulation divides); the returned loss is not divided.

        Returns:
            The batch's loss ``Σ_i (n_i / b) · ℓ_i`` (``Σ_i ℓ_i`` when not ``per_example_mean``; detached) on the
            last pipeline rank, else ``None``.
        """
        args, (batch, *shape) = self._first_stage_args(inputs)
        if self.is_last:
            loss_fn = loss_fn or self.loss_fn
            if loss_fn is None:
                raise ValueError("the last pipeline stage needs a loss_fn (given to the schedule or to train_step)")
            self._step_loss = (loss_fn, batch if per_example_mean else None, loss_divisor)
        if self.recorder is not None:
            self.recorder.begin_step()
        losses: list[torch.Tensor] = []
        start = done = 0
        for size, count in microbatch_passes(batch, self.num_microbatches):
            rows = slice(start, start + size * count)
            schedule, stages = self._schedule("train", (count, size, *shape))
            for stage in stages:
                stage.first_microbatch = done
            pass_losses: list[torch.Tensor] = []  # torch clears the list it is given
            schedule.step(
                *(arg[rows] for arg in args), **self._last_stage_kwargs(target, rows, pass_losses), return_outputs=False
            )
            losses += pass_losses
            start, done = rows.stop, done + count
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() * loss_divisor  # each is ℓ_i / a · w_i

    def eval_step(self, inputs: dict[str, torch.Tensor] | None, labels: torch.Tensor | None = None) -> Any:
        """Forward only; any batch size (micro-batches: the largest divisor of it up to ``num_microbatches``).

        Args:
            inputs: the batch, needed on the first pipeline rank.
            labels: unused (accepted so evaluation calls mirror ``train_step``).

        Returns:
            The last chunk's output (a classifier's logits ``[batch, num_labels]``) on the last pipeline rank, else
            ``None``.
        """
        args, shape = self._first_stage_args(inputs)
        count = _largest_divisor_at_most(shape[0], self.num_microbatches)
        schedule, _ = self._schedule("eval", (count, shape[0] // count, *shape[1:]))
        with torch.no_grad():
            return schedule.step(*args)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def _first_stage_args(self, inputs: dict[str, torch.Tensor] | None) -> tuple[tuple, tuple]:
        """The first chunk's positional inputs, unopened, and their shapes ``(batch, *spec)`` agreed by all stages.

        The first chunk names the columns it reads (its ``first_args(inputs)``: the task head's); a plain module
        takes the batch's tensors in order. The first pipeline rank broadcasts their number, dtypes and shapes over
        the pp group's host side (:func:`~hftrain.parallel.stage_timing.agree_on_spec`: one collective), since later
        stages see no inputs: ``spec`` is ``(dtype code, ndim, *dims after the batch)`` per tensor, the key of the
        torch schedules built for it.
        """
        args: tuple = ()
        if self.is_first:
            chunk = self.stages[0]
            first_args = getattr(chunk, "first_args", None)
            if first_args is not None:
                args = tuple(first_args(inputs))
            else:
                args = tuple(v for v in (inputs or {}).values() if torch.is_tensor(v))
            if not args:
                raise ValueError("the first pipeline stage needs its inputs (the batch)")
            args = tuple(arg.to(self.device) for arg in args)
        return args, agree_on_spec(args if self.is_first else None, group=self.pp_group if self.pp > 1 else None)

    def _last_stage_kwargs(self, target: torch.Tensor | None, rows: slice, losses: list) -> dict:
        if not self.is_last:
            return {}
        if target is None:
            raise ValueError("the last pipeline stage needs the target (labels or row indices)")
        return {"target": target[rows].to(self.device), "losses": losses}

    def _schedule(self, kind: str, shape: tuple[int, ...]) -> tuple[Any, list[TimedStage]]:
        """The torch schedule of ``kind`` for ``shape = (micro-batches, rows each, *inputs' spec)`` and its
        stages, built on first use (torch infers the stage shapes once per object) and counted in ``builds``."""
        cache = self._schedules[kind]
        if shape in cache:
            cache.move_to_end(shape)
            return cache[shape]
        count, training = shape[0], kind == "train"
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
        if not training:
            schedule = self.build_eval_schedule(stages, count)
        elif self.runs(pp=self.pp, num_microbatches=count):
            schedule = self.build_torch_schedule(stages, count, self._weighted_loss)
        else:
            schedule = self.build_any_count_schedule(stages, count, self._weighted_loss)
        cache[shape] = (schedule, stages)
        self.builds[kind] += 1
        if len(cache) > _CACHED_SHAPES:
            cache.popitem(last=False)
        return schedule, stages

    def _weighted_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """``ℓ_i / a · (n_i / b)``: micro-batch ``i``'s loss divided by ``train_step``'s ``loss_divisor`` ``a`` and
        weighted by its share of the step's examples, before its backward (see the module doc); ``n_i`` is the rows of
        its target, split with the inputs. ``ℓ_i / a`` where the step's loss is not a per-example mean
        (``train_step``'s ``per_example_mean``)."""
        assert self._step_loss is not None  # set by train_step before any schedule runs
        loss_fn, examples, divisor = self._step_loss
        loss = loss_fn(output, target)
        if divisor != 1:
            loss = loss / divisor
        if examples is None:
            return loss
        return loss * (target.shape[0] / examples)

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
            num_microbatches: micro-batches of the pass.
            loss_fn: the (already weighted) micro-batch loss.
        """
        return self.torch_class(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)

    def build_any_count_schedule(self, stages: list[TimedStage], num_microbatches: int, loss_fn: Callable) -> Any:
        """A training schedule for a pass this schedule cannot run (too few micro-batches for its warm-up): all
        forwards, then all backwards (GPipe, or looped BFS over several chunks per rank in the loop style).

        Args:
            stages: this rank's ``TimedStage`` objects.
            num_microbatches: micro-batches of the pass.
            loss_fn: the (already weighted) micro-batch loss.
        """
        if len(stages) == 1:
            return ScheduleGPipe(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
        return ScheduleLoopedBFS(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)


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
            raise AxisError(
                "num_microbatches", f"schedule {cls.name!r} needs num_microbatches >= pp ({num_microbatches} < {pp})"
            )

    @classmethod
    def runs(cls, *, pp: int, num_microbatches: int) -> bool:
        """Torch's 1F1B warms up with one micro-batch per stage: at least ``pp``."""
        return num_microbatches >= pp


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
            raise AxisError("schedule", f"schedule {cls.name!r} needs pp >= 2; use schedule: gpipe or 1f1b")
        if virtual_stages < 1:
            raise AxisError("virtual_stages", f"virtual_stages must be >= 1, got {virtual_stages}")
        if num_microbatches < pp or num_microbatches % pp:
            raise AxisError(
                "num_microbatches",
                f"schedule {cls.name!r} needs num_microbatches to be a multiple of pp={pp}, got {num_microbatches}",
            )

    @classmethod
    def runs(cls, *, pp: int, num_microbatches: int) -> bool:
        """Torch's interleaved schedules run rounds of ``max(1, m // pp)`` micro-batches: they must divide ``m``."""
        return num_microbatches % max(1, num_microbatches // pp) == 0

    def build_torch_schedule(self, stages: list[TimedStage], num_microbatches: int, loss_fn: Callable) -> Any:
        """Torch's interleaved schedule takes all of this rank's stages."""
        return self.torch_class(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)


class InterleavedZeroBubbleSchedule(Interleaved1F1BSchedule):
    """Interleaved zero bubble (ZB1P): backward split into input (``B``) and weight (``W``) gradients, the ``W``
    passes moved into the bubbles. Same chunk style and rules as interleaved 1F1B."""

    name = "interleaved_zb"
    torch_class = ScheduleInterleavedZeroBubble


class ZBVSchedule(Interleaved1F1BSchedule):
    """Zero bubble V (ZBV): two chunks per rank in a V (rank ``r`` holds chunks ``r`` and ``2p-1-r``), backward
    split into input and weight passes that fill the bubbles."""

    name = "zbv"
    torch_class = ScheduleZBVZeroBubble
    style = "v"

    @classmethod
    def check(cls, *, pp: int, virtual_stages: int, num_microbatches: int) -> None:
        """As interleaved, and exactly 2 chunks per rank (the V)."""
        super().check(pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches)
        if virtual_stages != 2:
            raise AxisError("virtual_stages", f"schedule {cls.name!r} needs virtual_stages: 2, got {virtual_stages}")

    @classmethod
    def runs(cls, *, pp: int, num_microbatches: int) -> bool:
        """Torch's ZBV runs any count (it plans ``max(2·pp - 1, m)`` and drops the missing micro-batches); no
        other torch schedule runs the V style."""
        return True

    def eval_step(self, inputs: dict[str, torch.Tensor] | None, labels: torch.Tensor | None = None) -> Any:
        """Forward only, the whole batch chunk after chunk down and up the V.

        Torch's forward-only schedules assume the loop style and its V schedules need a backward, so this
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
            for c in chunk_ids_of_rank(r, pp=self.pp, virtual_stages=len(self.stages), style=self.style)
        }
        local = dict(zip(self.chunk_ids, self.stages, strict=True))
        with torch.no_grad():
            for c in range(num_chunks):
                if c not in local:
                    continue
                if c > 0 and owner[c - 1] != self.pp_rank:  # host objects: no pickled CUDA tensor
                    acts = recv_object(group=self.pp_group, group_src=owner[c - 1], device=self.device)
                out = local[c](*acts)
                acts = out if isinstance(out, tuple) else (out,)
                if c + 1 < num_chunks and owner[c + 1] != self.pp_rank:
                    send_object(acts, group=self.pp_group, group_dst=owner[c + 1])
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
        raise AxisError("schedule", f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
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
            ``num_microbatches``, ``device`` and optionally ``loss_fn`` and ``recorder``.
    """
    return schedule_class(name)(stages, **options)
