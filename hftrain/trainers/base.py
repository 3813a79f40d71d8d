"""The strategy-agnostic training loop over ``accelerate.Accelerator``.

The trainer is given a ``Strategy``; it asks it for the ``Accelerator`` (trackers), the model-construction
context and the runtime, and never branches on which strategy it runs. Everything distributed (wrapping, data
sharding, forward/backward, gradient sync, accumulation, clipping, gathering, checkpoint state) goes through the
runtime (``hftrain.strategies.runtime``): Accelerate for DDP/FSDP/ZeRO, the strategy's own where Accelerate cannot.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hftrain.checkpoint.manager import CheckpointManager, VerifiedCheckpoint
from hftrain.checkpoint.preemption import PreemptionFlag
from hftrain.checkpoint.run import (
    CHECKPOINTS_DIR,
    CURVES_PNG,
    RUN_SUMMARY_FILENAME,
    STRATEGY_FILENAME,
    TIMELINE_PNG,
    TRACKER_DIR,
    TRAINER_STATE_FILENAME,
)
from hftrain.checkpoint.session import CheckpointSession
from hftrain.data.batching import EpochSampler, LengthBuckets, SortedSampler, build_dataloader, lengths_of
from hftrain.data.streaming import StreamingBlocks
from hftrain.errors import ConfigError, DataError, HFTrainError
from hftrain.files import check_own, write_json
from hftrain.log import get_logger
from hftrain.metrics.trackers import TrackerHub
from hftrain.models.dropout import use_bits_dropout
from hftrain.parallel.recompute import recompute_mode
from hftrain.pictures import BackgroundPainter
from hftrain.strategies.runtime import RuntimeTask
from hftrain.trainers.experts import EXPERT_LOAD_PNG, ExpertLoad
from hftrain.trainers.guards import StopVote, check_finite_loss
from hftrain.trainers.inputs import apply_unchecked_masks
from hftrain.trainers.throughput import FlopModel, Throughput, peak_flops

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from hftrain.config import TrainingConfig
    from hftrain.strategies import Strategy


@dataclass
class TrainerState:
    """Where training stands; optimizer steps and micro-batches are counted separately.

    Pitfall "resume with accumulation skips the wrong batches", docs/pitfalls.md.
    """

    epoch: int = 0
    global_step: int = 0
    """Optimizer steps taken."""
    micro_step: int = 0
    """Micro-batches consumed in the current epoch (per process)."""
    samples_seen: int = 0
    """Training examples consumed, over all processes."""
    last_eval_step: int = -1
    log_history: list[dict[str, float]] = field(default_factory=list)
    tracker_runs: dict[str, str] = field(default_factory=dict)
    """The tracker runs a resume continues (``TrackerHub.run_ids``: W&B's and MLflow's run ids, trackio's run name)."""


@dataclass
class TrainResult:
    """What ``fit`` returns."""

    global_step: int
    train_loss: float
    metrics: dict[str, float]
    train_runtime: float
    preempted: str | None = None
    """The signal that stopped the run after its checkpoint (None when it ran to ``max_steps``)."""
    checkpoint: str | None = None
    """The last checkpoint written."""
    throughput: dict[str, Any] = field(default_factory=dict)
    """The run's tokens/s, samples/s, FLOPs and MFU (``run_summary.json``)."""


class Trainer:
    """Fine-tunes a model with Accelerate; subclasses define the loss and predictions of a task.

    Args:
        args: the ``training`` config section.
        strategy: builds the ``Accelerator`` and the model-construction context.
        model_init: builds the model (the runtime calls it in the strategy's construction context; an
            ``hftrain.models.PretrainedBuilder`` also lets a pipeline rank leave other stages unbuilt).
        tokenizer: pads batches; saved with the model.
        train_dataset: tokenized examples with ``labels`` and ``length`` columns, or a stream of them
            (``hftrain.data.streaming.StreamingBlocks``: dealt over the data-parallel ranks here, no sampler, no epochs,
            ``max_steps`` steps, its position saved per rank in every checkpoint; :meth:`_next_window`).
        eval_dataset: as ``train_dataset``; None skips evaluation.
        run_config: the resolved job config, given to the trackers.
        run_id: the run's id (``hftrain.checkpoint.run``), stored in every checkpoint; ``latest``/``auto`` take
            only this run's checkpoints.
        pad_to_multiple_of: ``data.pad_to_multiple_of``: the length buckets of training and evaluation batches
            (``auto``: chosen per device; None: none), combined with the strategy's own multiple.
        checkpoint: the checkpoint ``args.resume_from_checkpoint`` names as the command's checks opened it
            (``hftrain.validate.RunPlan.checkpoint``: its ``checkpoint.json`` is read once per run); None: opened
            when resuming.
    """

    def __init__(
        self,
        args: TrainingConfig,
        *,
        strategy: Strategy,
        model_init: Callable[[], PreTrainedModel],
        tokenizer: PreTrainedTokenizerBase,
        train_dataset: Dataset,
        eval_dataset: Dataset | None = None,
        run_config: dict[str, Any] | None = None,
        run_id: str | None = None,
        pad_to_multiple_of: int | str | None = "auto",
        checkpoint: VerifiedCheckpoint | None = None,
    ) -> None:
        from accelerate.utils import set_seed

        args, choices = strategy.resolve_training(args)  # 'auto' precision and optimizer, for this machine
        self.args = args
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.log = get_logger()
        self.state = TrainerState()
        self.run_config = run_config or {}
        self.run_id = run_id
        self._skip_batches = 0
        self.stream = train_dataset if isinstance(train_dataset, StreamingBlocks) else None
        self._stream_batches: Any = None  # the stream loader's iterator, made at the first window (after a resume)
        self.window_count = 0.0
        """The current window's (global batch's) :meth:`count_examples` summed over the data-parallel replicas: agreed
        by one host all-reduce before the window's first backward when the data is a stream (:meth:`_next_window`)."""
        self._curves: BackgroundPainter | None = None  # draws training_curves.png in the background (main process)
        self.folder_lock: Any = None
        """``output_dir``'s lock (``hftrain.files.FolderLock``), held by the main process of a training run from its
        first write (``hftrain.job.take_run_folder``) until :meth:`close` or :meth:`release_folder`."""
        configure_threads(args.torch_num_threads, strategy.launch.local_world_size)
        choices.append(strategy.tune_host_allocator())
        # TensorBoard writes into output_dir/runs, which overwrite_output_dir removes with the run's other outputs
        self.accelerator = strategy.build_accelerator(
            args, project_dir=args.output_dir, logging_dir=str(Path(args.output_dir) / TRACKER_DIR)
        )
        self.trackers = TrackerHub(self.accelerator, Path(args.output_dir) / TRACKER_DIR)
        """Every figure of the run goes to the trackers through it (main process only)."""
        self.runtime = strategy.build_runtime(
            self.accelerator, RuntimeTask(head=self.stage_head, loss_is_example_mean=self.loss_is_example_mean)
        )
        # The loop's host reads (``_record_step``, ``_on_step_end``): none per step, one per logging window
        # (step, its loss on the device, its learning rate, its gradient norm on the device or None: not clipped)
        self._unread: list[tuple[int, torch.Tensor, float, torch.Tensor | None]] = []
        self._grad_norm: Any = None  # the last clip's norm, taken by _record_step
        self._logged_step = 0  # the last step whose loss went to the trackers
        self._stop_vote = StopVote(self.runtime.num_processes)
        self._progress: Any = None  # fit's progress bar
        self.strategy_summary = strategy.summary(args, self.accelerator)
        self._log("strategy: " + ", ".join(f"{k}={v}" for k, v in self.strategy_summary.items()))
        for choice in choices:
            self._log(choice)
        # SDPA's CUDA kernel order, for every forward and backward of this trainer (a global torch setting)
        self._sdpa = contextlib.ExitStack()
        self._log(self._sdpa.enter_context(strategy.platform.sdpa_priority(args.sdpa_backend)))
        # Same seed on every rank: identical head initialisation and identical data order.
        set_seed(args.seed)
        model = self.runtime.build_model(model_init)
        # The first step's gradients and AdamW's two moments, each the size of the trained parameters: their pages
        # are faulted in on an idle core while the setup goes on, and the block is freed for them in fit()
        trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._heap = strategy.warm_heap(3 * trained)
        if args.dropout_kernel == "bits":
            use_bits_dropout(model)
        recompute = recompute_mode(args.gradient_checkpointing)
        if recompute is not None:  # after the attention implementation is chosen: selective wraps it
            self._log(self.runtime.apply_recomputation(model, recompute))
        # over whatever attention is now chosen: padding masks are built without reading the device
        unchecked = apply_unchecked_masks(model)
        if unchecked:
            self._log(f"attention masks: built without a host check of the padding ({', '.join(unchecked)})")
        if args.compile:  # after recomputation (the compiled block calls the attention it wraps), before prepare
            self._log(self.runtime.apply_compile(model, args.compile_mode))
        # FLOPs are counted from the whole model's shapes, before any strategy splits it
        self.throughput = Throughput(FlopModel.of(model), recompute=recompute)
        self.buckets = self._length_buckets(pad_to_multiple_of, train_dataset, eval_dataset)
        self._log(self.buckets.describe())
        self.train_sampler: EpochSampler | None = None
        train_loader = None
        if self.stream is None:
            self.train_sampler = EpochSampler(
                lengths_of(train_dataset),
                order=args.train_sampling_strategy,
                # The global batch: the order is then the same however it is split across processes.
                group_size=self.strategy_summary["global_batch"],
                seed=args.seed,
                whole_groups=self.whole_global_batches,
            )
            train_loader = build_dataloader(
                train_dataset,
                tokenizer,
                batch_size=args.per_device_train_batch_size,
                sampler=self.train_sampler,
                num_workers=args.dataloader_num_workers,
                pin_memory=self.strategy.platform.pinned_batches,
                collate_fn=self.data_collator(),
                buckets=self.buckets,
            )
        eval_loader = self._eval_loader(eval_dataset)
        optimizer = self.create_optimizer(model)
        # A stream is dealt over the ranks by the stream itself, never by Accelerate's loader wrappers (which would
        # dispatch one rank's reads to all): only the map-style loader goes through prepare.
        self.model, self.optimizer, self.train_loader, self.eval_loader = self.runtime.prepare(
            model, optimizer, train_loader, eval_loader
        )
        if self.stream is not None:
            self.train_loader = self._stream_loader(self.stream)
        self.expert_load = ExpertLoad.for_model(self.model, self.runtime.example_group)  # None: not an MoE
        self._expert_picture: BackgroundPainter | None = None
        self.steps_per_epoch = (
            math.ceil(len(self.train_loader) / args.gradient_accumulation_steps) if self.stream is None else None
        )
        self.max_steps = self._total_steps()
        self.lr_scheduler = self.create_scheduler(self.optimizer)
        self.runtime.register_for_checkpointing(self.lr_scheduler)
        self.checkpoints = CheckpointManager(
            Path(args.output_dir) / CHECKPOINTS_DIR, keep=args.save_total_limit, run_id=run_id
        )
        from hftrain.strategies import available_strategies

        self.checkpointing = CheckpointSession(
            self.runtime,
            args,
            self.checkpoints,
            state_type=TrainerState,
            run_id=run_id,
            topology=self.strategy_summary,
            run_config=self.run_config,
            strategies=tuple(available_strategies()),
            versions=_versions,
            log=self._log,
        )
        if args.resume_from_checkpoint:
            self.resume(args.resume_from_checkpoint, opened=checkpoint)

    # ----------------------------------------------------------------- task hooks (override per task)
    loss_is_example_mean = True
    """:meth:`loss` is the mean over its micro-batch's examples (a classifier's): where the strategy cuts a
    micro-batch further (a pipeline's micro-batches), each part's loss counts by its share of the examples. False: the
    loss is already scaled to the global batch (a causal LM's token sum over the global target count), and the parts'
    losses add up as they are."""

    stage_head: Any = "sequence_classification"
    """The task's head on a pipeline's stages and under context parallelism: its kind (``Task.pipeline_head``, one of
    ``hftrain.parallel.heads.HEADS``, which the family builds), or a task's own ``hftrain.parallel.heads.StageHead``
    (the batch columns the first stage reads and what the last one returns, whose ``output`` :meth:`loss` takes)."""

    whole_global_batches = False
    """Train on whole global batches only (``EpochSampler``'s ``whole_groups``): a task whose loss is one mean over
    the global batch's tokens cannot count Accelerate's repeated examples."""

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        """Run the model on one batch; returns its output (an object with ``.logits``, and ``.loss`` where the model
        computes one). By default the whole batch, labels included, so a transformers head computes its own loss.
        A pipeline never calls this: its last stage hands the task head's ``output(...)`` to :meth:`loss` and
        :meth:`predictions` instead (``hftrain.parallel.heads.StageHead.output``, the same kind of object)."""
        return model(**batch)

    def loss(self, output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of ``output`` (the model's, or a pipeline's last stage's) against ``batch``'s targets: by default
        the model's own ``output.loss``, a mean over the micro-batch's examples; a mixture of experts adds its routers'
        load-balancing loss over the global batch (``router_aux_loss_coef ×``, as transformers' causal-LM heads do;
        ``hftrain.trainers.experts``)."""
        loss = output.loss
        if self.expert_load is not None:
            loss = loss + self.expert_load.aux_loss(batch)
        return loss

    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of one micro-batch, ``loss(forward(model, batch), batch)``: what a data-parallel runtime calls
        (override it to run the model otherwise; a pipeline calls :meth:`loss` on its last stage's output)."""
        return self.loss(self.forward(model, batch), batch)

    compute_loss.is_loss_of_forward = True  # type: ignore[attr-defined]  # a pipeline may call loss() instead

    def predictions(
        self, output: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-example loss, predictions, labels) of ``output`` against ``batch``'s targets."""
        raise NotImplementedError

    def prediction_step(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-example loss, predictions, labels) of one evaluation batch: ``predictions(forward(model, batch),
        batch)``."""
        return self.predictions(self.forward(model, batch), batch)

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Metrics over the whole evaluation set (each example counted once)."""
        return {}

    def evaluation_loss(self, losses: torch.Tensor, labels: torch.Tensor) -> float:
        """The evaluation loss from every example's ``prediction_step`` loss (each counted once): their mean."""
        return losses.mean().item()

    def data_collator(self) -> Any:
        """How examples become a batch: None pads each batch to its longest example (``build_dataloader``)."""
        return None

    # ----------------------------------------------------------------- construction
    def create_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW with no weight decay on biases and norms, as the HF Trainer does; one fused kernel per step
        (``optim: adamw_torch_fused``) instead of torch's per-tensor loop."""
        from hftrain.models.weights import logical_shape

        decay, no_decay = [], []
        for param in model.parameters():
            if param.requires_grad:
                (no_decay if len(logical_shape(param)) < 2 else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.args.learning_rate, fused=self.args.optim == "adamw_torch_fused")

    def create_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """transformers' schedule over this run's optimizer steps (the loop steps it once per step)."""
        from transformers import get_scheduler

        warmup = self.args.warmup_steps
        warmup_steps = int(warmup) if isinstance(warmup, int) else math.ceil(self.max_steps * warmup)
        return get_scheduler(
            self.args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=self.max_steps,
        )

    def _total_steps(self) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        if self.steps_per_epoch is None:
            raise ConfigError(
                "data.streaming: a stream has no known length, so training.num_train_epochs cannot end it; set "
                "training.max_steps"
            )
        return max(1, math.ceil(self.args.num_train_epochs * self.steps_per_epoch))

    def _eval_loader(self, dataset: Dataset | None) -> torch.utils.data.DataLoader | None:
        if dataset is None:
            return None
        return build_dataloader(
            dataset,
            self.tokenizer,
            batch_size=self.args.per_device_eval_batch_size,
            sampler=SortedSampler(lengths_of(dataset)),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.strategy.platform.pinned_batches,
            collate_fn=self.data_collator(),
            buckets=self.buckets,
        )

    def _length_buckets(self, setting: int | str | None, train: Any, evaluation: Any) -> LengthBuckets:
        """``data.pad_to_multiple_of`` for this device (``Platform.resolve_length_buckets``), combined with the
        runtime's own multiple; a task with its own collator (packed blocks, of one length) gets none."""
        required = self.runtime.pad_to_multiple_of
        if self.data_collator() is not None or self.stream is not None:
            return LengthBuckets(None, rule="packed blocks, all of one length")
        longest = max(lengths_of(train) + (lengths_of(evaluation) if evaluation is not None else []))
        multiple, rule = self.strategy.platform.resolve_length_buckets(
            setting, longest=longest, compiled=self.args.compile
        )
        buckets = LengthBuckets.combine(multiple, required, longest=longest, rule=rule)
        if self.args.compile:
            from hftrain.strategies.runtime import check_compiled_shapes

            check_compiled_shapes(buckets.lengths(), buckets.ceiling or longest)
        return buckets

    # ----------------------------------------------------------------- the loop
    def fit(self, *, stop_at_step: int | None = None, beside_last_save: Callable[[], Any] | None = None) -> TrainResult:
        """Train to ``max_steps`` optimizer steps, evaluating, logging and checkpointing on schedule.

        SIGTERM/SIGUSR1 (or reaching ``stop_at_step``, for time-sliced jobs) stop the run at the next step
        boundary after a checkpoint, which the same command resumes with ``resume_from_checkpoint: auto``. The
        last checkpoint is written in the background, while the final evaluation runs where the two do not compete
        for the cores (``Platform.writes_beside_compute``: a GPU) or right after it (a CPU), and is complete when
        ``fit`` returns.

        Args:
            stop_at_step: stop (with a checkpoint) after this step.
            beside_last_save: collective work for the end of a run that was not stopped, called while the last
                checkpoint is written in the background (the job's export, which waits for the write with
                :meth:`wait_for_checkpoint` before it replaces anything). If it fails with one of hftrain's errors
                (raised on every rank alike), the write is waited for first, and a failed checkpoint is what is raised.
        """
        from tqdm.auto import tqdm

        acc = self.accelerator
        self._save_run_info()
        self.trackers.start(
            config=self.run_config,
            topology=self.strategy_summary,
            resumed=self.state.tracker_runs,
            resumed_step=self.state.global_step if self.last_checkpoint is not None else -1,
        )
        self.state.tracker_runs = {**self.state.tracker_runs, **self.trackers.run_ids()}  # saved with each checkpoint
        progress = tqdm(
            total=self.max_steps, initial=self.state.global_step, disable=not acc.is_local_main_process, unit="step"
        )
        self._progress, self._logged_step = progress, self.state.global_step
        self._release_heap()  # before the first step's tensors, which then take the pages already faulted in
        self.throughput.peak = peak_flops(self.runtime.device, self.args.mixed_precision, self.args.peak_tflops)
        self._log(f"peak per process: {self.throughput.peak[0] / 1e12:.2f} TFLOP/s ({self.throughput.peak[1]})")
        self.throughput.restart_clock()
        # Installed until fit returns: a signal after the last step (the final evaluation, save or export) is a
        # preemption too, never the default action that kills the run mid-export with 143.
        with PreemptionFlag() as preemption:
            return self._fit(progress, preemption, time.perf_counter(), stop_at_step, beside_last_save)

    def _fit(
        self,
        progress: Any,
        preemption: PreemptionFlag,
        start: float,
        stop_at_step: int | None,
        beside_last_save: Callable[[], Any] | None,
    ) -> TrainResult:
        """:meth:`fit` from its first step on, with the preemption flag installed."""
        stopped = None
        run = self._run_epoch if self.stream is None else self._run_stream
        try:
            while self.state.global_step < self.max_steps and stopped is None:
                stopped = run(progress, preemption, stop_at_step)
        except BaseException:  # a non-finite loss, a failed step: the checkpoint being written is completed first
            self.checkpoints.settle()
            raise
        # The last checkpoint is written in the background while the final evaluation runs, where the two do not
        # compete for the cores (a GPU), else once the evaluation is done (a CPU).
        due = self.state.global_step > (self._checkpointed_step() or 0)
        beside = self.strategy.platform.writes_beside_compute
        if due and beside:
            self.save_checkpoint()
        metrics = self._final_evaluation(stopped)
        if due and not beside:
            self.save_checkpoint()
        self._draw_curves()  # in a child process, beside the checkpoint's write and the export
        progress.close()
        if beside_last_save is not None and stopped is None:
            if self._any_rank(preemption.requested):  # signalled after the last step: the export waits for a resume
                stopped = preemption.received or "signal on another rank"
                self._log(
                    f"stopping after the last step ({stopped}) before the export; checkpoint "
                    f"{self.last_checkpoint}: the resumed run exports"
                )
            else:
                self._beside_last_save(beside_last_save)
                if self._any_rank(preemption.requested):  # too late to stop: the run is complete, nothing to resume
                    self._log(
                        f"{preemption.received or 'a signal on another rank'} arrived during the export; the export "
                        "was finished and the run is complete (exit 0: nothing to resume)"
                    )
        # Before the main process's own files: a failed background write is raised here, on every rank alike.
        self.wait_for_checkpoint()
        self._save_trainer_state()
        summary = self.throughput.summary(self.runtime.num_processes)
        self._save_run_summary(summary)
        return TrainResult(
            global_step=self.state.global_step,
            train_loss=_mean([h["loss"] for h in self.state.log_history if "loss" in h]),
            metrics=metrics,
            train_runtime=time.perf_counter() - start,
            preempted=stopped,
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            throughput=summary,
        )

    def _run_epoch(self, progress: Any, preemption: PreemptionFlag, stop_at_step: int | None) -> str | None:
        """One pass over the (remaining) training data; returns why the run must stop, if it must."""
        runtime = self.runtime
        self.train_loader.set_epoch(self.state.epoch)
        loader = self.train_loader
        if self._skip_batches:
            # Resume mid-epoch: skip at the batch-sampler level, without loading the skipped data
            # (pitfall "slow batch skipping on resume", docs/pitfalls.md).
            loader = runtime.skip_first_batches(self.train_loader, self._skip_batches)
            self._skip_batches = 0
        self.model.train()
        window_losses: list[torch.Tensor] = []
        for batch in loader:
            window_losses.append(self.train_step(batch))
            self.state.micro_step += 1
            if not runtime.sync_gradients:
                continue
            # An optimizer step happened: the accumulation window closed here.
            self.state.global_step += 1
            self._record_step(torch.stack(window_losses).mean(), progress)
            window_losses = []
            stopped = self._on_step_end(preemption, stop_at_step)
            if stopped or self.state.global_step >= self.max_steps:
                return stopped
        if self.args.eval_steps is None:
            self.evaluate()
        self.state.epoch += 1
        self.state.micro_step = 0
        return None

    # ----------------------------------------------------------------- a stream (data.streaming)
    def count_examples(self, batch: dict[str, torch.Tensor]) -> float:
        """What one micro-batch adds to its window's :attr:`window_count`: its examples (a causal LM counts its target
        tokens instead, the ``N`` its loss divides by)."""
        return float(batch["labels"].shape[0])

    def _stream_loader(self, stream: StreamingBlocks) -> torch.utils.data.DataLoader:
        """Deal ``stream`` over the data-parallel ranks and batch it in this process.

        The loader runs no worker: a worker would read ahead of the blocks trained on, and the position a checkpoint
        saves (the stream's ``state_dict``) must be right after the last block the trainer consumed. Only a run whose
        every process is a data-parallel replica (the runtime's ``dp_size`` is its process count) takes a stream.
        """
        from hftrain.data.streaming import collate_blocks

        if self.runtime.dp_size != self.runtime.num_processes:
            raise ConfigError(
                f"data.streaming: this run splits the model over its processes ({self.runtime.num_processes} "
                f"processes, {self.runtime.dp_size} data-parallel replicas), and a stream is dealt over replicas "
                "that each hold the whole model; train without model parallelism (parallelism sizes 1), or set "
                "data.streaming: false"
            )
        self._log(
            stream.split(dp_rank=self.accelerator.process_index, dp_size=self.runtime.dp_size, log=self._log)
            + "; blocks train in the stream's order (training.train_sampling_strategy is for map-style data)"
        )
        if self.args.dataloader_num_workers:
            self._log(
                f"data.streaming: the stream is read in each training process (a loader worker would read ahead of the "
                f"saved position); training.dataloader_num_workers={self.args.dataloader_num_workers} serves the "
                "evaluation loader"
            )
        return torch.utils.data.DataLoader(
            stream,
            batch_size=self.args.per_device_train_batch_size,
            collate_fn=collate_blocks,
            num_workers=0,
            pin_memory=self.strategy.platform.pinned_batches,
        )

    def _run_stream(self, progress: Any, preemption: PreemptionFlag, stop_at_step: int | None) -> str | None:
        """Optimizer steps on the stream's windows until ``max_steps``; returns why the run must stop, if it must."""
        runtime = self.runtime
        if self._stream_batches is None:  # after a resume: the stream continues at its restored position
            self._stream_batches = iter(self.train_loader)
        self.model.train()
        while self.state.global_step < self.max_steps:
            window_losses = []
            for batch in self._next_window():
                window_losses.append(self.train_step(batch))
                self.state.micro_step += 1
            if not runtime.sync_gradients:  # Accelerate counts gradient_accumulation_steps micro-batches per step
                raise RuntimeError("a window of the stream ended without its optimizer step")
            self.state.global_step += 1
            self._record_step(torch.stack(window_losses).mean(), progress)
            stopped = self._on_step_end(preemption, stop_at_step)
            if stopped:
                return stopped
        return None

    def _next_window(self) -> list[dict[str, torch.Tensor]]:
        """The next window's ``gradient_accumulation_steps`` micro-batches of this rank's stream, read before its
        first backward, with :attr:`window_count` agreed over the ranks.

        Every rank reads its own blocks, so no rank knows the global batch's count: each sums
        :meth:`count_examples` over its micro-batches and one host all-reduce over all processes
        (``parallel.host.all_sum``) adds them, with a flag for a rank whose stream failed (a malformed line, a
        shard gone): every rank then raises, the failed one its own line, and none waits in a collective. The sum is
        divided by the processes of one replica (``num_processes / dp_size``, 1 under the strategies that take a
        stream), which read the same blocks.
        """
        from hftrain.parallel.host import all_sum

        runtime = self.runtime
        window: list[dict[str, torch.Tensor]] = []
        error: HFTrainError | None = None
        try:
            for _ in range(self.args.gradient_accumulation_steps):
                window.append(next(self._stream_batches))
        except HFTrainError as raised:
            error = raised
        except Exception as raised:  # a library's failure inside the stream, on this rank only: no rank may hang
            reason = " ".join(str(raised).split())[:300] or type(raised).__name__
            error = DataError(f"the training stream failed on this process ({type(raised).__name__}: {reason})")
        local = sum(self.count_examples(batch) for batch in window) if error is None else 0.0
        total, failed = all_sum([local, float(error is not None)])
        if failed:
            says = runtime.reports(error)
            if error is not None:
                error.every_rank = says
                raise error
            raise DataError("the training stream failed on another process; see its error")
        self.window_count = total / (runtime.num_processes // runtime.dp_size)
        device, pinned = runtime.device, self.strategy.platform.pinned_batches
        return [{k: v.to(device, non_blocking=pinned) for k, v in batch.items()} for batch in window]

    def _on_step_end(self, preemption: PreemptionFlag, stop_at_step: int | None) -> str | None:
        """Read the losses at the end of a logging window, evaluate and checkpoint on schedule; checkpoint and stop
        when all ranks agree to.

        A signal is agreed one step late (``StopVote``: no rank waits for the others at a step), so every rank stops
        at the same step boundary, one after the first signal; ``stop_at_step`` is the same on every rank and needs no
        vote; the last step's vote is settled at once.
        """
        step = self.state.global_step
        last = step >= self.max_steps
        reason = "stop_at_step" if step == stop_at_step else None
        if (self._stop_vote.settle if last else self._stop_vote.poll)(preemption.requested) and reason is None:
            reason = preemption.received or "signal on another rank"
        if last or reason is not None or step % self.args.logging_steps == 0:
            self._read_losses()
        if self._eval_due():
            self.evaluate()
        save_every = self.args.save_steps
        if save_every and step % save_every == 0:
            self.save_checkpoint()
        if reason is None:
            return None
        if self._checkpointed_step() != step:
            self.save_checkpoint()
        self._log(f"stopping at step {step} ({reason}); checkpoint {self.last_checkpoint}")
        return reason

    def _beside_last_save(self, work: Callable[[], Any]) -> None:
        try:
            work()
        except HFTrainError:  # every rank raises it: the collective wait is safe, and its error comes first
            self.wait_for_checkpoint()
            raise
        except BaseException:  # possibly on this rank only: complete the write without a collective
            self.checkpoints.settle()
            raise

    def _release_heap(self) -> None:
        """Free the block faulted in for the first step (``Strategy.warm_heap``) into the heap, once."""
        if self._heap is not None:
            self._heap.release()
            self._heap = None

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (one all-reduce; free in one process)."""
        return self.runtime.any_rank(flag)

    def _final_evaluation(self, stopped: str | None) -> dict[str, float]:
        if stopped is None and self.state.last_eval_step != self.state.global_step:
            self.evaluate()
        evals = [h for h in self.state.log_history if "eval_loss" in h]
        return {k: v for k, v in evals[-1].items() if k != "step"} if evals else {}

    # ----------------------------------------------------------------- checkpoints (``hftrain.checkpoint.session``)
    @property
    def last_checkpoint(self) -> Path | None:
        """The last checkpoint written or resumed from."""
        return self.checkpointing.last

    @last_checkpoint.setter
    def last_checkpoint(self, path: Path | None) -> None:
        self.checkpointing.last = path

    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step (collective: every rank calls it), and start drawing
        ``training_curves.png`` in the background, except at the run's last step: ``fit`` draws it once more after
        the final evaluation anyway."""
        self._read_losses()  # a non-finite loss stops the run before its checkpoint is written
        # A stream's position is right after the window just trained on (no loader reads ahead): each rank's own.
        position = self.stream.state_dict() if self.stream is not None else None
        path = self.checkpointing.save(
            self.state_dict(), step=self.state.global_step, max_steps=self.max_steps, rank_state=position
        )
        if self.state.global_step < self.max_steps:
            self._draw_curves()
        self.throughput.restart_clock()  # a step's rate counts the step, not the save after it
        return path

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background, if any, is complete (collective)."""
        self.checkpointing.wait()

    def _checkpointed_step(self) -> int | None:
        return self.checkpointing.checkpointed_step()

    def resume(self, spec: str, *, opened: VerifiedCheckpoint | None = None) -> None:
        """Restore model, optimizer, scheduler, RNG, trainer state and data position from a checkpoint (after
        ``prepare``; :meth:`CheckpointSession.resume <hftrain.checkpoint.session.CheckpointSession.resume>`).

        Args:
            spec: ``latest``, ``auto`` or a checkpoint folder.
            opened: that checkpoint as the command's checks opened it (its ``checkpoint.json`` is not read again).
        """
        self._release_heap()  # the loaded optimizer states take the pages faulted in for the first step
        resumed = self.checkpointing.resume(
            spec,
            model=self.model,
            optimizer=self.optimizer,
            micro_batches=len(self.train_loader) if self.stream is None else None,
            max_steps=self.max_steps,
            opened=opened,
        )
        if resumed is not None:
            self.state, self._skip_batches = resumed.state, resumed.skip
            if self.stream is not None:
                self._restore_stream(resumed.rank_state or {})

    def _restore_stream(self, position: dict[str, Any]) -> None:
        """Put this rank's stream at its saved position; a position that does not fit is refused on every rank."""
        error: HFTrainError | None = None
        try:
            self.stream.load_state_dict(position)
        except HFTrainError as raised:
            error = raised
        except (KeyError, TypeError, ValueError) as raised:
            error = DataError(f"{self.last_checkpoint}: this process's stream position is damaged ({raised!r})")
        if self.runtime.any_rank(error is not None):
            says = self.runtime.reports(error)
            if error is not None:
                error.every_rank = says
                raise error
            raise DataError("another process cannot continue its stream from the checkpoint; see its error")

    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward one micro-batch; step the optimizer when the window closes.

        Returns the micro-batch loss (detached, this process's mean).
        """
        runtime = self.runtime
        # accumulate() decides whether this micro-batch closes the window (sync_gradients) and skips the
        # data-parallel all-reduce otherwise; the backward divides the loss by gradient_accumulation_steps.
        with runtime.accumulate(self.model):
            loss = runtime.forward_backward(self.model, batch, self)
            if runtime.sync_gradients and self.args.max_grad_norm > 0:
                norm = runtime.clip_grad_norm_(self.model, self.args.max_grad_norm)
                self._grad_norm = norm if runtime.clip_returns_this_steps_norm else None
            self.optimizer.step()  # a no-op inside the window: the prepared optimizer skips it until sync_gradients
            # fp16's loss scaler skips the step of a window whose gradients overflowed: the schedule waits with it
            # (Accelerate's prepared scheduler does the same; this one is the Trainer's own).
            if runtime.sync_gradients and not getattr(self.optimizer, "step_was_skipped", False):
                self.lr_scheduler.step()
            self.optimizer.zero_grad()
        self.state.samples_seen += batch["labels"].shape[0] * runtime.dp_size
        self.throughput.count(batch)
        return loss

    def _record_step(self, local_loss: torch.Tensor, progress: Any) -> None:
        """Keep the step's loss (this process's mean over its window) on the device, unread: the host reads it with
        the rest of its logging window (:meth:`_read_losses`), so it can queue the next steps meanwhile."""
        norm, self._grad_norm = self._grad_norm, None
        if hasattr(norm, "full_tensor"):  # FSDP2's clip returns a DTensor: its value (every rank calls this alike)
            norm = norm.full_tensor()
        norm = norm.detach().float().reshape(1).to(local_loss.device) if isinstance(norm, torch.Tensor) else None
        self._unread.append(
            (self.state.global_step, local_loss.float().reshape(1), self.lr_scheduler.get_last_lr()[0], norm)
        )
        progress.update(1)

    def _read_losses(self) -> None:
        """The steps' one host read since the last: their losses and throughput counts, reduced together.

        Called at the end of every logging window, at a run's last step and stop, and before an evaluation or a
        checkpoint (whose ``log_history`` and non-finite check need them). One all-reduce (``reduce_mean``) of
        ``[loss_1 … loss_k, counts]`` and one read: each step's logged loss is the mean over its window and over
        processes, what one process with the whole global batch would report. A non-finite loss stops the run here
        (``check_finite_loss``), before any checkpoint of a later step is written. At a logging step the trackers and
        the progress bar get the mean loss of the steps since the last logging step, and the rates of the steps since
        the last read.
        """
        if not self._unread:
            return
        steps, losses = [s for s, _, _, _ in self._unread], [x for _, x, _, _ in self._unread]
        learning_rates = [lr for _, _, lr, _ in self._unread]
        # the clip's norm is the global one, the same on every rank: its mean over the ranks is itself
        norms = [n for _, _, _, n in self._unread]
        norms = norms if all(n is not None for n in norms) else []
        self._unread = []
        counts = self.throughput.local_window(losses[0].device)
        means = self.runtime.reduce_mean(torch.cat([*losses, *norms, counts])).tolist()  # the window's one host read
        rates = self.throughput.close_window(
            means[len(steps) + len(norms) :], self.runtime.dp_size, self.runtime.num_processes
        )
        norm_of = dict(zip(steps, means[len(steps) : len(steps) + len(norms)], strict=False))
        for step, loss, learning_rate in zip(steps, means, learning_rates, strict=False):
            check_finite_loss(loss, step=step, last_checkpoint=self.last_checkpoint, read_at=steps[-1])
            self.state.log_history.append({"step": step, "loss": loss, "learning_rate": learning_rate})
            if step in norm_of:
                self.state.log_history[-1]["grad_norm"] = norm_of[step]
        step = steps[-1]
        if step % self.args.logging_steps:
            return
        window = [h["loss"] for h in self.state.log_history if "loss" in h and h["step"] > self._logged_step]
        self._logged_step, loss, entry = step, _mean(window), self.state.log_history[-1]
        shares = {}
        if self.expert_load is not None:  # collective: every rank logs at the same steps
            figures, shares = self.expert_load.close_window()
            entry.update(figures)
        if self._progress is not None:
            self._progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rates['tokens_per_second']:.0f}")
        self.trackers.log(
            {
                "train/loss": loss,
                "train/learning_rate": entry["learning_rate"],
                **{f"train/{k}": v for k, v in rates.items()},
                **{f"train/{k}": v for k, v in entry.items() if k not in ("step", "loss", "learning_rate")},
                **{f"train/{k}": v for k, v in shares.items()},
            },
            step=step,
        )

    def _eval_due(self) -> bool:
        every = self.args.eval_steps
        return every is not None and self.state.global_step % every == 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and metrics on the evaluation set, every example counted exactly once across processes."""
        self._read_losses()  # the history in order, and a non-finite loss stops the run before it is evaluated
        if self.eval_loader is None:
            self.state.last_eval_step = self.state.global_step
            return {}
        self.model.eval()
        losses, predictions, labels = [], [], []
        with self.runtime.evaluation_context():
            for batch in self.eval_loader:
                # Gathered over the data-parallel ranks, each example once
                # (pitfall "eval skewed by padding duplicates", docs/pitfalls.md).
                loss, preds, refs = self.runtime.evaluation_step(self.model, batch, self)
                losses.append(loss)
                predictions.append(preds)
                labels.append(refs)
        self.model.train()
        predictions_all, labels_all = torch.cat(predictions), torch.cat(labels)
        metrics = {
            "eval_loss": self.evaluation_loss(torch.cat(losses), labels_all),
            "eval_samples": float(len(labels_all)),
        }
        metrics.update({f"eval_{k}": v for k, v in self.compute_metrics(predictions_all, labels_all).items()})
        self.state.log_history.append({"step": self.state.global_step, **metrics})
        self.trackers.log({k.replace("eval_", "eval/"): v for k, v in metrics.items()}, step=self.state.global_step)
        self.state.last_eval_step = self.state.global_step
        self._log(f"step {self.state.global_step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        self.throughput.restart_clock()
        return metrics

    def _log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            self.log.info(message)

    # The run's own files in output_dir are each a new file renamed over the old one (``files.write_json``): a link
    # or a hard link planted there is replaced, never written through, and a FIFO is never opened.
    def _save_run_info(self) -> None:
        if self.accelerator.is_main_process:
            directory = Path(self.args.output_dir)
            directory.mkdir(parents=True, exist_ok=True)  # a trainer built without a job (tests, notebooks)
            write_json(directory / STRATEGY_FILENAME, self.strategy_summary)
            # TensorBoard creates its folders following links: one planted since the job's check is refused here
            check_own(directory / TRACKER_DIR, f"training.output_dir: {TRACKER_DIR}", folder=True)
            check_own(directory / TRACKER_DIR / "hftrain", f"training.output_dir: {TRACKER_DIR}/hftrain", folder=True)

    def _draw_curves(self) -> None:
        """Start drawing ``training_curves.png`` (and a mixture of experts' ``expert_load.png``) in the background
        (main process); complete when ``close`` returns."""
        if not self.accelerator.is_main_process:
            return
        if self.expert_load is not None:
            if self._expert_picture is None:
                path = Path(self.args.output_dir) / EXPERT_LOAD_PNG
                self._expert_picture = BackgroundPainter("expert_load", path, warn=self._log)
            self._expert_picture.draw(self.expert_load.picture_data(), version=self.state.global_step)
        if self._curves is None:
            self._curves = BackgroundPainter("curves", Path(self.args.output_dir) / CURVES_PNG, warn=self._log)
        self._curves.draw(self.state.log_history, version=len(self.state.log_history))

    def _save_run_summary(self, summary: dict[str, Any]) -> None:
        """``run_summary.json`` (throughput, FLOPs, MFU), on the main process."""
        if self.accelerator.is_main_process:
            path = Path(self.args.output_dir) / RUN_SUMMARY_FILENAME
            write_json(path, {"global_step": self.state.global_step, **summary})

    def _save_trainer_state(self) -> None:
        if self.accelerator.is_main_process:
            write_json(Path(self.args.output_dir) / TRAINER_STATE_FILENAME, self.state_dict())

    def release_folder(self) -> None:
        """Release ``output_dir``'s lock, if this process holds it (idempotent): the run has ended."""
        lock, self.folder_lock = self.folder_lock, None
        if lock is not None:
            lock.release()

    def close(self) -> None:
        """End the run: release the wrapped model, then flush trackers and destroy the process group.

        The model goes first, while the process group and the interpreter are alive, so that a DDP reducer and
        the gloo work it holds are not left to interpreter teardown: a rank was seen aborting there once after a
        finished 2-process run ("terminate called without an active exception": gloo work still holding tensors
        when the interpreter is finalised, as pytorch PR #179291 describes). Accelerate's ``free_memory`` collects
        garbage before it drops its own references, so one more collection frees the model; a single process has no
        reducer and skips it (a full collection costs ~0.3 s with transformers loaded).
        """
        try:
            self._close()
        finally:
            self._sdpa.close()
            self.release_folder()

    def _close(self) -> None:
        import gc

        self._release_heap()
        self.wait_for_checkpoint()
        for painter in (self._curves, self._expert_picture):
            if painter is not None:
                painter.close()
        # the pictures as they stand at the end (drawn, waited for), then the tracker runs closed (main process)
        output = Path(self.args.output_dir)
        pictures = {"training_curves": CURVES_PNG, "expert_load": EXPERT_LOAD_PNG, "pipeline_timeline": TIMELINE_PNG}
        self.trackers.log_pictures({k: output / v for k, v in pictures.items()}, step=self.state.global_step)
        self.trackers.finish()
        # Every rank leaves together: the main process waits for its pictures, and a launcher (torchrun) stops the
        # ranks still running when one exits with a preempted run's code, before the main process says so.
        self.runtime.wait_for_everyone()
        several_processes = self.accelerator.num_processes > 1
        self.model = self.optimizer = self.train_loader = self.eval_loader = self.expert_load = None
        self.runtime = None
        self.checkpointing.detach()
        self.accelerator.free_memory()
        if several_processes:
            gc.collect()
        self.accelerator.end_training()

    def state_dict(self) -> dict[str, Any]:
        """The trainer state as plain data."""
        return asdict(self.state)


def configure_threads(requested: int | None, local_world_size: int) -> int:
    """Set torch's intra-op threads: the requested number, or the cores divided among local processes.

    Oversubscribed cores (2 processes x 2 threads on 2 cores) make every collective wait on a descheduled peer.
    """
    import os

    threads = requested or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def _versions() -> dict[str, str]:
    from hftrain.env import versions

    return versions()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
