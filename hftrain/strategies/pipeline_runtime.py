"""The Trainer's operations for pipeline × tensor × data parallelism (``megatron`` with ``pp > 1``).

Each rank holds its pipeline stages (``hftrain.parallel.build_stage_modules``) of the tensor-parallel model;
``forward_backward`` runs the configured schedule (``hftrain.parallel.build_schedule``) over the loader's
per-device batch split into ``num_microbatches``. What differs from :class:`MegatronRuntime`:

- gradients are averaged over the dp group by hand at the window's end (no DDP around stages);
- the loss exists on the last stage only and is broadcast over the pp group, so every rank logs it;
- evaluation is a forward-only pass through the pipeline whose logits are broadcast over the pp group, then
  gathered over dp as under tensor parallelism (each example once);
- the gradient norm sums squares over tp (split parameters) and then over pp (each stage's own parameters);
- checkpoint state and the export are the same logical full tensors as at ``pp = 1``, merged over the stages
  (``hftrain.checkpoint.pipeline_state``), so a ``pp = 2`` checkpoint resumes at ``pp = 1`` and back;
- each checkpoint also renders the last optimizer step's timeline (``pipeline_timeline.png``/``.json``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hftrain.checkpoint.run import TIMELINE_JSON, TIMELINE_PNG
from hftrain.strategies.megatron import MegatronRuntime, _autocast_forward
from hftrain.strategies.pipeline_checks import num_microbatches

if TYPE_CHECKING:
    from accelerate import Accelerator

    from hftrain.parallel.dims import ParallelGroups
    from hftrain.parallel.plugin import MegatronPlugin
    from hftrain.strategies.megatron import MegatronStrategy
    from hftrain.strategies.runtime import Batch

LABELS = "labels"


class PipelineModel(nn.Module):
    """This rank's pipeline stages as the one model the Trainer holds.

    Calling it runs a forward-only pass through the whole pipeline (collective over the pp group) and returns
    the logits on every stage, so the task's ``prediction_step`` and the export's logit check work unchanged.

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
    def last_stage_rank(self) -> int:
        """The pipeline rank holding the last chunk (the head): ``pp - 1``, or 0 in the V layout (ZBV)."""
        from hftrain.parallel.pipeline import chunk_ids_of_rank

        pp, chunks = self.groups.pp_size, len(self.stages)
        last = pp * chunks - 1
        layout = self.schedule.layout
        return next(r for r in range(pp) if last in chunk_ids_of_rank(r, pp=pp, virtual_stages=chunks, layout=layout))

    def forward(self, **inputs: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        inputs.pop(LABELS, None)
        with torch.no_grad():
            logits = self.schedule.eval_step(inputs, None)
        shape = (_batch_size(inputs), self.config.num_labels)
        return SequenceClassifierOutput(logits=self.from_last_stage(logits, shape))

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
        return next(self.hf_model.parameters()).device


class PipelineRuntime(MegatronRuntime):
    """The Trainer's operations for tp × dp × pp, through the plugin's groups and the pipeline schedule.

    Args:
        accelerator: gives the process group, accumulation, autocast and trackers.
        strategy: the megatron strategy (its ``config`` holds the pipeline fields).
        plugin: the set-up plugin (its tp/dp/pp groups).
    """

    def __init__(self, accelerator: Accelerator, strategy: MegatronStrategy, plugin: MegatronPlugin) -> None:
        super().__init__(accelerator, strategy, plugin)
        self.pipeline = strategy.config
        self.num_microbatches = num_microbatches(strategy.config)
        self.recorder: Any = None
        self._params: dict[str, nn.Parameter] = {}  # HF name -> this rank's parameter (its stages only)

    # ----------------------------------------------------------------- setup
    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: torch.utils.data.DataLoader,
        eval_loader: torch.utils.data.DataLoader | None,
    ) -> tuple[nn.Module, Any, Any, Any]:
        from hftrain.parallel import TimelineRecorder, apply_tensor_parallel, build_schedule, build_stage_modules
        from hftrain.parallel.schedules import schedule_class

        plugin, layout, device = self.plugin, self.plugin.layout, self.accelerator.device
        names = {id(p): n for n, p in model.named_parameters()}
        model = model.to(device)
        # Split every layer over tp first (every rank holds the full model), then keep this rank's stages.
        model = apply_tensor_parallel(model, tp_group=layout.tp_group, sequence_parallel=plugin.sequence_parallel)
        stages = build_stage_modules(
            model,
            pp_rank=layout.pp_rank,
            pp=layout.pp_size,
            virtual_stages=self.pipeline.virtual_stages,
            balance=self.pipeline.balance,
            layout=schedule_class(self.pipeline.schedule).layout,  # which chunks a rank holds (loop or V)
        )
        if self.mixed_precision != "no":
            for stage in stages:
                _autocast_forward(stage, self.accelerator)
        stage_params = {id(p) for stage in stages for p in stage.parameters()}
        self._params = {n: p for n, p in model.named_parameters() if id(p) in stage_params}
        self.recorder = TimelineRecorder(layout.pp_rank)
        schedule = build_schedule(
            self.pipeline.schedule,
            stages,
            pp_group=layout.pp_group,
            pp_rank=layout.pp_rank,
            pp=layout.pp_size,
            num_microbatches=self.num_microbatches,
            loss_fn=_classification_loss(model.config.num_labels, self.accelerator.gradient_accumulation_steps),
            device=device,
            recorder=self.recorder,
        )
        pipeline = PipelineModel(model, stages, schedule, layout)
        rebuilt = _rebuilt_over_stages(optimizer, names, self._params)
        train_loader = plugin.prepare_data_loader(train_loader, device=device)
        eval_loader = plugin.prepare_data_loader(eval_loader, device=device) if eval_loader is not None else None
        prepared = plugin.prepare_optimizer(rebuilt)
        self._model, self._optimizer = model, prepared.optimizer
        return pipeline, prepared, train_loader, eval_loader

    # ----------------------------------------------------------------- one step
    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor]
    ) -> torch.Tensor:
        """Run the schedule over this batch's micro-batches; returns the batch's mean loss on every rank.

        The task's ``loss_fn`` is not called: the last stage computes the classification loss of the HF model
        (cross entropy over ``num_labels``) on each micro-batch.
        """
        inputs = {k: v for k, v in batch.items() if k != LABELS}
        loss = model.schedule.train_step(inputs, batch[LABELS])
        if loss is not None:  # the schedule's loss is divided by the accumulation steps, like backward()'s
            loss = loss.detach() * self.accelerator.gradient_accumulation_steps
        loss = model.from_last_stage(loss, ())
        if self.sync_gradients:
            self._finalize_grads()
        return loss

    def _finalize_grads(self) -> None:
        """Average gradients over dp (each stage's own replicas), then complete tp's sequence-parallel ones."""
        from hftrain.parallel import finalize_tp_grads
        from hftrain.parallel.collectives import all_reduce_coalesced

        layout = self.plugin.layout
        grads = [p.grad for p in self._params.values() if p.grad is not None]
        if layout.dp_size > 1 and grads:
            all_reduce_coalesced(grads, layout.dp_group)
            for grad in grads:
                grad.div_(layout.dp_size)
        finalize_tp_grads(self._model, tp_group=layout.tp_group)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to the global norm: split squares summed over tp, then every stage's squares over pp."""
        from hftrain.parallel import sharded_parameters

        layout = self.plugin.layout
        split = set(sharded_parameters(self._model))
        grads = {name: p.grad for name, p in self._params.items() if p.grad is not None}
        squares = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)  # (split, replicated)
        for name, grad in grads.items():
            squares[0 if name in split else 1] += grad.detach().double().pow(2).sum()
        split_sq = squares[:1].clone()
        if layout.tp_size > 1:
            dist.all_reduce(split_sq, group=layout.tp_group)
        total_sq = split_sq + squares[1:]
        dist.all_reduce(total_sq, group=layout.pp_group)
        total = total_sq.sqrt().float().squeeze(0)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s
        for grad in grads.values():
            grad.mul_(coefficient.to(grad.dtype))
        return total

    # ----------------------------------------------------------------- state
    def save_state(self, directory: str, *, safe_serialization: bool = True) -> None:
        from hftrain.checkpoint.pipeline_state import save_pipeline_state

        self.accelerator.save_state(directory, safe_serialization=safe_serialization)
        save_pipeline_state(
            directory, self._model, self._params, self._optimizer, groups=self.plugin.layout, layout=self.layout_facts()
        )
        self.write_timeline()

    def load_state(self, directory: str, *, model: nn.Module, optimizer: Any) -> None:
        from hftrain.checkpoint.pipeline_state import load_pipeline_state

        self.accelerator.load_state(directory)
        load_pipeline_state(directory, self._model, self._params, optimizer.optimizer, layout=self.layout_facts())

    def get_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights merged over tp and pp (collective; every rank of dp replica 0 gets them)."""
        from hftrain.checkpoint.pipeline_state import merged_weights

        return merged_weights(self._model, self._params, self.plugin.layout)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        return self._model if self._model is not None else model

    # ----------------------------------------------------------------- timeline
    def write_timeline(self) -> None:
        """Render the last recorded step of this pipeline into ``output_dir`` (collective over the pp group).

        The main process draws its own pipeline (dp and tp rank 0); the other replicas run the same schedule.
        """
        import json
        from pathlib import Path

        from hftrain.parallel import gather_events, measured_bubble, render_timeline, theoretical_bubble

        layout = self.plugin.layout
        events = gather_events(self.recorder, layout.pp_group)
        if not self.is_main_process or not events:
            return
        output = Path(self.accelerator.project_dir)
        facts = {
            "schedule": self.pipeline.schedule,
            "pp": layout.pp_size,
            "num_microbatches": self.num_microbatches,
            "virtual_stages": self.pipeline.virtual_stages,
        }
        render_timeline(events, output / TIMELINE_PNG, **facts)
        bubble = {
            **facts,
            "measured_bubble": measured_bubble(events),
            "theoretical_bubble": theoretical_bubble(
                layout.pp_size, self.num_microbatches, virtual_stages=self.pipeline.virtual_stages
            ),
        }
        last = max(e.step for e in events)
        steps = [e._asdict() for e in events if e.step == last]
        (output / TIMELINE_JSON).write_text(json.dumps({**bubble, "events": steps}, indent=1) + "\n")
        self.accelerator.print(
            f"pipeline timeline: {output / TIMELINE_PNG} (bubble measured {bubble['measured_bubble']:.3f}, "
            f"theoretical {bubble['theoretical_bubble']:.3f})"
        )


def _classification_loss(num_labels: int, accumulation: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The HF single-label classification loss of one micro-batch, divided by the accumulation steps."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(logits.float().view(-1, num_labels), labels.view(-1))
        return loss / accumulation

    return loss_fn


def _rebuilt_over_stages(
    optimizer: torch.optim.Optimizer, names: dict[int, str], params: dict[str, nn.Parameter]
) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, hyper-parameters) over this rank's stage parameters only.

    The Trainer builds the optimizer over the full model before the strategy splits it; every group is kept
    (possibly empty) so that the groups line up across stages when checkpoint state is merged.

    Args:
        optimizer: the optimizer over the unsplit model's parameters (no state yet).
        names: ``id(parameter) -> name`` of the unsplit model.
        params: HF name -> this rank's (tensor-parallel) stage parameter.
    """
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [params[names[id(p)]] for p in group["params"] if names[id(p)] in params],
        }
        for group in optimizer.param_groups
    ]
    return type(optimizer)(groups)


def _batch_size(inputs: dict[str, torch.Tensor]) -> int:
    return next(iter(inputs.values())).shape[0]
