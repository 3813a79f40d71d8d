"""The Trainer's operations for pipeline × tensor × data parallelism (``megatron`` with ``pp > 1``).

Each rank holds its pipeline stages (``hftrain.parallel.build_stage_modules``) of the tensor-parallel model, and
only their weights: ``build_model`` leaves the other stages' layers and embedding on ``meta``, never read nor
materialized (``hftrain.models.PretrainedBuilder.build``), so a rank's peak is its stage, not the whole model;
what a plain ``model_init`` callable builds whole is released as soon as the stages are cut
(``hftrain.parallel.release_other_stages``). ``forward_backward`` runs the configured schedule
(``hftrain.parallel.build_schedule``) over the loader's per-device batch of ``b`` examples split into
``min(num_microbatches, b)`` micro-batches, sizes differing by at most one. What differs from
:class:`~hftrain.strategies.megatron.runtime.MegatronRuntime`, which provides everything else (clipping summed
over tp then pp, checkpoint state and export merged over the stages, the evaluation gather):

- the task decides the loss: on the last stage the task head's ``output`` of the stages' output (what the model
  would return: a classifier's logits and HF's sequence-classification loss, regression, single- or multi-label by
  the config's ``problem_type``; a per-token head's logits) goes to the Trainer's ``loss(output, micro_batch)``, and
  the schedule alone scales it: micro-batch ``i`` of ``n_i`` examples counts
  ``n_i / b`` and the accumulation steps divide it, so the step's loss ``Σ_i (n_i / b) · ℓ_i`` is the batch mean one
  process computes;
- gradients are averaged over the dp group by hand at the window's end (no DDP around stages);
- the loss exists on the last stage only and is broadcast over the pp group, so every rank logs it;
- evaluation is a forward-only pass through the pipeline whose logits are broadcast over the pp group, then
  gathered over dp as under tensor parallelism (each example once);
- each checkpoint also renders the last optimizer step's timeline (``pipeline_timeline.png``/``.json``).

A LoRA model (a ``peft.PeftModel``) runs unchanged: its stages are cut from the HF model inside it, each with its
layers' adapters (``hftrain.parallel.pipeline``); the optimizer is rebuilt over this rank's trainable parameters only
(the adapters, and the head's ``modules_to_save`` copy on the last stage: what the Trainer's optimizer held), so the
frozen base weights carry no Adam state and no gradient all-reduce; the checkpoint boxes and the export gather keep
PEFT's names, so the export is a standard adapter folder. The model is built whole on every rank before the cut under
LoRA (``hftrain.models.PretrainedBuilder``: the adapters' random initialisation must be the whole model's), then the
other stages are released.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.checkpoint.run import TIMELINE_JSON, TIMELINE_PNG
from hftrain.strategies.megatron.plugin import to_device
from hftrain.strategies.megatron.runtime import MegatronRuntime, OptimizerPlan, autocast_forward

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hftrain.models.weights import BlockLoading
    from hftrain.parallel.dims import ParallelGroups
    from hftrain.strategies.megatron.plugin import MegatronPlugin
    from hftrain.strategies.runtime import Batch, RuntimeTask


@dataclass(frozen=True)
class PipelineOptions:
    """How the stages are cut and scheduled (from the ``strategy`` section, resolved by the strategy)."""

    schedule: str
    num_microbatches: int
    virtual_stages: int
    balance: str


LABELS = "labels"


class PipelineModel(nn.Module):
    """This rank's pipeline stages as the one model the Trainer holds.

    Calling it runs a forward-only pass through the whole pipeline (collective over the pp group) and returns
    the head's output on every stage, so the task's ``prediction_step`` (a classifier's) and the export's logit check
    work unchanged.

    Args:
        hf_model: the tensor-parallel HF model (not registered: its layers outside the stages are not this rank's).
        stages: this rank's stage modules.
        schedule: the built pipeline schedule over ``stages``.
        groups: the run's process groups.
    """

    def __init__(self, hf_model: nn.Module, stages: list[nn.Module], schedule: Any, groups: ParallelGroups) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        object.__setattr__(self, "hf_model", hf_model)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "groups", groups)
        self.config = hf_model.config

    @property
    def task_head(self) -> Any:
        """The task's head on the stages (``hftrain.parallel.stages.StageHead``)."""
        return self.stages[0].task_head

    @property
    def per_position(self) -> bool:
        """Whether the last stage's output has a row per position (a causal LM's logits), not one per example."""
        return bool(self.task_head.per_position)

    @property
    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last chunk (the head): ``pp - 1``, or 0 in the V style (ZBV)."""
        from hftrain.parallel.pipeline import chunk_ids_of_rank

        pp, chunks = self.groups.pp_size, len(self.stages)
        last = pp * chunks - 1
        style = self.schedule.style
        return next(r for r in range(pp) if last in chunk_ids_of_rank(r, pp=pp, virtual_stages=chunks, style=style))

    def forward(self, **inputs: torch.Tensor) -> Any:
        """The model's output for ``inputs`` on every stage: the task head's ``output`` of the last stage's (a
        classifier's logits and HF's loss when ``labels`` are given; a causal LM's logits ``[b, s, vocabulary
        (slice)]`` only, its loss being the task's; the export's check). The output's shape is broadcast from the last
        stage over the pp group's host side (its rank count, then its dimensions), the output itself over the group."""
        from hftrain.parallel.host import broadcast_ints

        labels = inputs.pop(LABELS, None)
        with torch.no_grad():
            output = self.schedule.eval_step(inputs, None)
        pp_group, last = self.groups.pp_group, self.last_stage_rank
        shape = None if output is None else list(output.shape)
        (ndim,) = broadcast_ints(None if shape is None else [len(shape)], 1, group=pp_group, group_src=last)
        shape = broadcast_ints(shape, ndim, group=pp_group, group_src=last)
        return self.task_head.output(self.from_last_stage(output, tuple(shape)), labels, self.config)

    # ---------------------------------------------------------------- a mixture of experts' routers
    def take_router_loss(self) -> torch.Tensor | None:
        """The router loss of the micro-batch the last stage just ran (its chunk's; None on other ranks)."""
        routing = self.stages[-1].routing if self.stages[-1].is_last else None
        return None if routing is None else routing.take_loss()

    def take_router_counts(self) -> torch.Tensor:
        """Real tokens routed to each expert (MoE layers × experts) since the last call, by this rank's chunks (the
        rows of their layers); reset."""
        return torch.stack([stage.routing.take_counts().to(self.device) for stage in self.stages]).sum(0)

    def sum_over_stages(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the pipeline group (each stage's share of a statistic): collective."""
        dist.all_reduce(tensor, group=self.groups.pp_group)
        return tensor

    def from_last_stage(self, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """``tensor`` of the last stage on every stage of this pipeline (a broadcast over the pp group), as fp32.

        Args:
            tensor: the last stage's tensor (None elsewhere): a loss or ``(batch, num_labels)`` logits.
            shape: its shape (the other stages allocate the buffer from it).
        """
        if tensor is None:
            tensor = torch.empty(shape, device=self.device)
        tensor = tensor.detach().float().contiguous()
        dist.broadcast(tensor, group=self.groups.pp_group, group_src=self.last_stage_rank)
        return tensor

    @property
    def device(self) -> torch.device:
        return next(self.stages.parameters()).device


class PipelineRuntime(MegatronRuntime):
    """The Trainer's operations for tp × dp × pp: the stages and the schedule; the rest is MegatronRuntime's.

    Args:
        accelerator: gives the process group, accumulation, autocast and trackers.
        plugin: the set-up plugin (its tp/dp/pp groups).
        options: how the stages are cut and scheduled.
        release_freed_memory: returns memory freed in bulk to the system (the platform's).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        plugin: MegatronPlugin,
        options: PipelineOptions,
        *,
        task: RuntimeTask,
        release_freed_memory: Callable[[], None] = lambda: None,
        block_loading: Callable[[Accelerator], BlockLoading | None] | None = None,
    ) -> None:
        super().__init__(accelerator, plugin, task=task, block_loading=block_loading)
        self.release_freed_memory = release_freed_memory
        self.pipeline = options
        self.num_microbatches = options.num_microbatches
        self.recorder: Any = None
        self._ranges: list[range] | None = None  # the stages' layer ranges, decided on the whole model

    # ----------------------------------------------------------------- setup
    def build_model(self, model_init: Callable[[], Any]) -> Any:
        """The model with only this rank's stages materialized when ``model_init`` can leave modules out
        (``hftrain.models.PretrainedBuilder``), their blocks loaded by the strategy's loading where it has one
        (``MegatronLoading``: under tp, each split tensor's slice read as ``prepare`` splits it); a plain callable
        builds the whole model, cut in ``prepare``."""
        from hftrain.parallel import other_stages_modules, stage_ranges
        from hftrain.parallel.schedules import schedule_class

        groups, options = self.plugin.groups, self.pipeline

        def leave_out(model: nn.Module) -> list[str]:
            self._ranges = stage_ranges(
                model,
                pp=groups.pp_size,
                virtual_stages=options.virtual_stages,
                balance=options.balance,
                head=self.stage_head,
            )
            return other_stages_modules(
                model,
                self._ranges,
                pp_rank=groups.pp_rank,
                pp=groups.pp_size,
                virtual_stages=options.virtual_stages,
                style=schedule_class(options.schedule).style,
                head=self.stage_head,
            )

        with self.plain_model_context():
            build = getattr(model_init, "build", None)
            # this rank's own blocks too, where the strategy has a way (hftrain.strategies.megatron.loading)
            loading = self._block_loading(self.accelerator) if build is not None and self._block_loading else None
            model = build(leave_out=leave_out, loading=loading) if build is not None else model_init()
        if self._ranges is None:  # built whole: split by the whole model's logical sizes, as a built-out one
            self._ranges = stage_ranges(
                model,
                pp=groups.pp_size,
                virtual_stages=options.virtual_stages,
                balance=options.balance,
                head=self.stage_head,
            )
        return model

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: torch.utils.data.DataLoader,
        eval_loader: torch.utils.data.DataLoader | None,
    ) -> tuple[nn.Module, Any, Any, Any]:
        from hftrain.parallel import TimelineRecorder, build_schedule, build_stage_modules, release_other_stages
        from hftrain.parallel.schedules import schedule_class

        groups, device = self.plugin.groups, self.accelerator.device
        plan = OptimizerPlan.take(optimizer, model)  # the optimizer lets go of the full model's parameters
        # Split every layer over tp on the host (the plugin's one preparation), keep this rank's stages and move
        # only those to the device; the rest is freed below, never having reached it.
        model = self.plugin.parallelize(model, device=device, move=False, head=self.stage_head)
        stages = build_stage_modules(
            model,
            example_group=self.example_group,  # a mixture of experts' router loss is over them
            pp_rank=groups.pp_rank,
            pp=groups.pp_size,
            virtual_stages=self.pipeline.virtual_stages,
            balance=self.pipeline.balance,
            style=schedule_class(self.pipeline.schedule).style,  # which chunks a rank holds (loop or V)
            ranges=self._ranges,
            head=self.stage_head,  # the task's, when it names one
        )
        for stage in stages:
            to_device(stage, device)
        if self.mixed_precision != "no":
            for stage in stages:
                autocast_forward(stage, self.accelerator)
        stage_params = {id(p) for stage in stages for p in stage.parameters()}
        self._model = model
        self._params = {n: p for n, p in model.named_parameters() if id(p) in stage_params}
        self.recorder = TimelineRecorder(groups.pp_rank)
        schedule = build_schedule(
            self.pipeline.schedule,
            stages,
            pp_group=groups.pp_group,
            pp_rank=groups.pp_rank,
            pp=groups.pp_size,
            num_microbatches=self.num_microbatches,
            device=device,
            recorder=self.recorder,
        )
        pipeline = PipelineModel(model, stages, schedule, groups)
        prepared = self._prepare_rest(plan, train_loader, eval_loader)
        release_other_stages(model, stages)
        to_device(model, device)  # what this rank keeps outside its stages (buffers); the rest is on meta now
        self.release_freed_memory()  # resident memory drops now, not only when later allocations reuse it
        return pipeline, *prepared

    # ----------------------------------------------------------------- one step
    def forward_backward(self, model: nn.Module, batch: Batch, task: Any) -> torch.Tensor:
        """Run the schedule over this batch's micro-batches; returns the batch's loss on every rank.

        The batch goes to the schedule unopened (the first chunk picks its columns); for each micro-batch the last
        stage hands the task head's ``output(stage_output, labels, config)`` to ``task.loss(output, micro_batch)``
        (the schedule's target is the micro-batch's row indices into ``batch``). The schedule alone scales it:
        divided by the accumulation steps as ``backward()`` divides, weighted by the micro-batch's share of the
        batch's examples when the task's loss is an example mean (``train_step``).

        Args:
            model: the pipeline model.
            batch: this replica's batch (every stage receives it; the first reads the inputs, the last the rest).
            task: the Trainer: its ``loss(output, batch) -> scalar``. A Trainer whose ``compute_loss`` is not
                ``loss(forward(model, batch), batch)`` (an override not marked ``is_loss_of_forward``) is refused in
                one line: its loss would silently not be the one trained.
        """
        if not getattr(type(task).compute_loss, "is_loss_of_forward", False):
            from hftrain.errors import ConfigError

            raise ConfigError(
                f"{type(task).__name__} overrides compute_loss(model, batch), which a pipeline (parallelism.pp > 1) "
                "cannot call: its last stage holds the output, not the model; override loss(output, batch) instead"
            )
        schedule, examples = model.schedule, _batch_size(batch)
        inputs = {k: v for k, v in batch.items() if k != LABELS}
        rows = torch.arange(examples, device=self.accelerator.device)
        loss = schedule.train_step(
            inputs,
            rows,
            loss_fn=self._micro_batch_loss(batch, task.loss, model),
            per_example_mean=self.loss_is_example_mean,  # the task's: a causal LM's loss is already scaled
            loss_divisor=self.accelerator.gradient_accumulation_steps,
        )
        loss = model.from_last_stage(loss, ())
        if self.sync_gradients:
            self._finalize_grads()
        return loss

    def _micro_batch_loss(
        self, batch: Batch, loss_of: Callable[[Any, Batch], torch.Tensor], model: PipelineModel
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The schedule's ``loss(output, rows)``: the task's loss of the head's output against ``batch``'s rows
        ``rows`` (unscaled: the schedule scales it).

        Args:
            batch: the step's batch.
            loss_of: the task's ``loss(output, batch)``.
            model: the pipeline model (its config and task head).
        """
        config, head = model.config, model.task_head

        def loss(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            micro_batch = {k: v[rows.to(v.device)] if torch.is_tensor(v) else v for k, v in batch.items()}
            return loss_of(head.output(output, micro_batch.get(LABELS), config), micro_batch)

        return loss

    def _finalize_grads(self) -> None:
        """Complete the gradients over the placement records (``hftrain.parallel.complete_grads``): the mean over each
        parameter's data replicas, dp × cp, as no DDP wraps the stages; tp's partial ones; the sum over a weight's
        copies on several pipeline ranks (a tied embedding's over Megatron's embedding group, shared aux weights' over
        pp)."""
        from hftrain.parallel import complete_grads

        complete_grads(self._model, self.plugin.groups, data_mean=True)

    def evaluation_step(self, model: nn.Module, batch: Batch, task: Any) -> tuple[torch.Tensor, ...]:
        """One evaluation batch. A last stage with a row per position (a causal LM's logits, vocabulary-parallel under
        tp; a token classifier's) hands the head's ``output`` to the task's ``predictions(output, batch)`` there and
        broadcasts its per-example outputs over the pp group: no per-position logits travel. Otherwise the pipeline
        model's logits reach every stage and the task predicts from them on each (MegatronRuntime's)."""
        if not model.per_position:
            return super().evaluation_step(model, batch, task)
        from hftrain.parallel.host import broadcast_object

        inputs = {k: v for k, v in batch.items() if k != LABELS}
        with torch.no_grad():
            logits = model.schedule.eval_step(inputs, None)
            outputs = (
                None
                if logits is None
                else task.predictions(model.task_head.output(logits, batch.get(LABELS), model.config), batch)
            )
        if self.plugin.groups.pp_size > 1:  # a few numbers per example, as host objects
            outputs = broadcast_object(
                None if outputs is None else tuple(t.detach().cpu() for t in outputs),
                group=self.plugin.groups.pp_group,
                group_src=model.last_stage_rank,
            )
        device = self.accelerator.device
        return self.plugin.gather_for_metrics(tuple(t.to(device) for t in outputs))

    # ----------------------------------------------------------------- state
    def save_extras(self, directory: str) -> None:
        super().save_extras(directory)
        self.write_timeline()

    # ----------------------------------------------------------------- timeline
    def write_timeline(self) -> None:
        """Render the last recorded step of this pipeline into ``output_dir`` (collective over the pp group).

        The main process draws its own pipeline (dp and tp rank 0); the other replicas run the same schedule.
        """
        import json
        import tempfile
        from pathlib import Path

        from hftrain.files import write_file
        from hftrain.parallel import gather_events, measured_bubble, render_timeline, theoretical_bubble

        groups = self.plugin.groups
        events = gather_events(self.recorder, groups.pp_group)
        if not self.is_main_process or not events:
            return
        output = Path(self.accelerator.project_dir)
        facts = {
            "schedule": self.pipeline.schedule,
            "pp": groups.pp_size,
            "num_microbatches": self.num_microbatches,
            "virtual_stages": self.pipeline.virtual_stages,
        }
        # drawn in a folder of its own, then renamed into output_dir as a new file (``files.write_file``): matplotlib
        # would write through a link planted at the PNG's path, or wait on a FIFO there
        with tempfile.TemporaryDirectory(prefix="hftrain-timeline-") as drawn:
            picture = Path(render_timeline(events, Path(drawn) / TIMELINE_PNG, **facts))
            write_file(output / TIMELINE_PNG, picture.read_bytes())
        bubble = {
            **facts,
            "measured_bubble": measured_bubble(events),
            "theoretical_bubble": theoretical_bubble(
                groups.pp_size, self.num_microbatches, virtual_stages=self.pipeline.virtual_stages
            ),
        }
        last = max(e.step for e in events)
        steps = [e._asdict() for e in events if e.step == last]
        write_file(output / TIMELINE_JSON, json.dumps({**bubble, "events": steps}, indent=1) + "\n")
        self.accelerator.print(
            f"pipeline timeline: {output / TIMELINE_PNG} (bubble measured {bubble['measured_bubble']:.3f}, "
            f"theoretical {bubble['theoretical_bubble']:.3f})"
        )


def _batch_size(inputs: dict[str, torch.Tensor]) -> int:
    return next(iter(inputs.values())).shape[0]
