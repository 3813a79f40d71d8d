"""The strategy-agnostic training loop over ``accelerate.Accelerator``.

The trainer is given a ``Strategy``; it asks it for the ``Accelerator`` and the model-construction context
and never branches on which strategy it runs. Everything distributed (DDP/FSDP/DeepSpeed wrapping, data
sharding, gradient sync, accumulation) goes through ``accelerator.prepare`` / ``accumulate`` / ``backward``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from hftrain.data.batching import EpochSampler, SortedSampler, build_dataloader
from hftrain.log import get_logger

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from hftrain.config import TrainingConfig
    from hftrain.strategies import Strategy


@dataclass
class TrainerState:
    """Where training stands; optimizer steps and micro-batches are counted separately (pitfall #10)."""

    epoch: int = 0
    global_step: int = 0
    """Optimizer steps taken."""
    micro_step: int = 0
    """Micro-batches consumed in the current epoch (per process)."""
    samples_seen: int = 0
    """Training examples consumed, over all processes."""
    log_history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainResult:
    """What ``fit`` returns."""

    global_step: int
    train_loss: float
    metrics: dict[str, float]
    train_runtime: float
    model_dir: str | None


class Trainer:
    """Fine-tunes a model with Accelerate; subclasses define the loss and predictions of a task.

    Args:
        args: the ``training`` config section.
        strategy: builds the ``Accelerator`` and the model-construction context.
        model_init: builds the model (called inside ``strategy.model_init_context()``).
        tokenizer: pads batches; saved with the model.
        train_dataset: tokenized examples with ``labels`` and ``length`` columns.
        eval_dataset: as ``train_dataset``; None skips evaluation.
        run_config: the resolved job config, given to the trackers.
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
    ) -> None:
        from accelerate.utils import set_seed

        self.args = args
        self.strategy = strategy
        self.tokenizer = tokenizer
        self.log = get_logger()
        self.state = TrainerState()
        self.run_config = run_config or {}
        self._last_eval_step = -1
        configure_threads(args.torch_num_threads, strategy.launch.local_world_size)
        self.accelerator = strategy.build_accelerator(args, project_dir=args.output_dir)
        self.strategy_summary = strategy.summary(args, self.accelerator)
        self._log("strategy: " + ", ".join(f"{k}={v}" for k, v in self.strategy_summary.items()))
        # Same seed on every rank: identical head initialisation and identical data order.
        set_seed(args.seed)
        with strategy.model_init_context():
            model = model_init()
        self.train_sampler = EpochSampler(
            train_dataset["length"],
            order=args.train_sampling_strategy,
            group_size=args.per_device_train_batch_size * self.accelerator.num_processes,
            seed=args.seed,
        )
        train_loader = build_dataloader(
            train_dataset,
            tokenizer,
            batch_size=args.per_device_train_batch_size,
            sampler=self.train_sampler,
            num_workers=args.dataloader_num_workers,
        )
        eval_loader = self._eval_loader(eval_dataset)
        optimizer = self.create_optimizer(model)
        self.model, self.optimizer, self.train_loader = self.accelerator.prepare(model, optimizer, train_loader)
        self.eval_loader = self.accelerator.prepare(eval_loader) if eval_loader is not None else None
        self.steps_per_epoch = math.ceil(len(self.train_loader) / args.gradient_accumulation_steps)
        self.max_steps = self._total_steps()
        self.lr_scheduler = self.create_scheduler(self.optimizer)
        self.accelerator.register_for_checkpointing(self.lr_scheduler)

    # ----------------------------------------------------------------- task hooks (override per task)
    def compute_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss of one micro-batch."""
        return model(**batch).loss

    def prediction_step(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-example loss, predictions, labels) of one evaluation batch."""
        raise NotImplementedError

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Metrics over the whole evaluation set (each example counted once)."""
        return {}

    # ----------------------------------------------------------------- construction
    def create_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW with no weight decay on biases and norms, as the HF Trainer does."""
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (no_decay if param.ndim < 2 else decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self.args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.args.learning_rate)

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
        return max(1, math.ceil(self.args.num_train_epochs * self.steps_per_epoch))

    def _eval_loader(self, dataset: Dataset | None) -> torch.utils.data.DataLoader | None:
        if dataset is None:
            return None
        return build_dataloader(
            dataset,
            self.tokenizer,
            batch_size=self.args.per_device_eval_batch_size,
            sampler=SortedSampler(dataset["length"]),
            num_workers=self.args.dataloader_num_workers,
        )

    # ----------------------------------------------------------------- the loop
    def fit(self) -> TrainResult:
        """Train for ``max_steps`` optimizer steps, evaluating and logging on schedule."""
        from tqdm.auto import tqdm

        acc = self.accelerator
        self._save_run_info()
        acc.init_trackers("hftrain", config=_scalars(self.run_config))
        progress = tqdm(total=self.max_steps, disable=not acc.is_local_main_process, desc="train", unit="step")
        start, metrics = time.perf_counter(), {}
        window_losses: list[torch.Tensor] = []
        epochs = math.ceil(self.max_steps / self.steps_per_epoch)
        for epoch in range(self.state.epoch, epochs):
            self.state.epoch = epoch
            self.train_loader.set_epoch(epoch)
            self.model.train()
            for batch in self.train_loader:
                window_losses.append(self.train_step(batch))
                self.state.micro_step += 1
                if not acc.sync_gradients:
                    continue
                # An optimizer step happened: the accumulation window closed here.
                self.state.global_step += 1
                self._record_step(torch.stack(window_losses).mean(), progress)
                window_losses = []
                if self._eval_due():
                    metrics = self.evaluate()
                if self.state.global_step >= self.max_steps:
                    break
            self.state.micro_step = 0
            if self.state.global_step >= self.max_steps:
                break
            if self.args.eval_steps is None:
                metrics = self.evaluate()
        if self._last_eval_step != self.state.global_step:
            metrics = self.evaluate()
        progress.close()
        runtime = time.perf_counter() - start
        for tracker in acc.trackers:  # not end_training(): that destroys the process group export still needs
            tracker.finish()
        self._save_trainer_state()
        return TrainResult(
            global_step=self.state.global_step,
            train_loss=_mean([h["loss"] for h in self.state.log_history if "loss" in h]),
            metrics=metrics,
            train_runtime=runtime,
            model_dir=None,
        )

    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and backward one micro-batch; step the optimizer when the window closes.

        Returns the micro-batch loss (detached, this process's mean).
        """
        acc = self.accelerator
        # accumulate() decides whether this micro-batch closes the window (sync_gradients) and skips
        # DDP's all-reduce otherwise; backward() divides the loss by gradient_accumulation_steps.
        with acc.accumulate(self.model):
            loss = self.compute_loss(self.model, batch)
            acc.backward(loss)
            if acc.sync_gradients and self.args.max_grad_norm > 0:
                acc.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
            self.optimizer.step()  # a no-op inside the window: Accelerate skips it until sync_gradients
            if acc.sync_gradients:
                self.lr_scheduler.step()
            self.optimizer.zero_grad()
        self.state.samples_seen += batch["labels"].shape[0] * acc.num_processes
        return loss.detach()

    def _record_step(self, local_loss: torch.Tensor, progress: Any) -> None:
        # The logged loss is the mean over the window and over processes: what one process with the
        # whole global batch would report.
        loss = self.accelerator.reduce(local_loss, reduction="mean").item()
        entry = {"step": self.state.global_step, "loss": loss, "learning_rate": self.lr_scheduler.get_last_lr()[0]}
        self.state.log_history.append(entry)
        progress.update(1)
        if self.state.global_step % self.args.logging_steps == 0:
            progress.set_postfix(loss=f"{loss:.4f}")
            self.accelerator.log({"train/loss": loss, "train/learning_rate": entry["learning_rate"]}, step=entry["step"])

    def _eval_due(self) -> bool:
        every = self.args.eval_steps
        return every is not None and self.state.global_step % every == 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and metrics on the evaluation set, every example counted exactly once across processes."""
        if self.eval_loader is None:
            self._last_eval_step = self.state.global_step
            return {}
        acc = self.accelerator
        self.model.eval()
        losses, predictions, labels = [], [], []
        for batch in self.eval_loader:
            loss, preds, refs = self.prediction_step(self.model, batch)
            # gather_for_metrics drops the duplicates Accelerate adds to even out the last batch (pitfall #16).
            loss, preds, refs = acc.gather_for_metrics((loss, preds, refs))
            losses.append(loss)
            predictions.append(preds)
            labels.append(refs)
        self.model.train()
        predictions_all, labels_all = torch.cat(predictions), torch.cat(labels)
        metrics = {"eval_loss": torch.cat(losses).mean().item(), "eval_samples": float(len(labels_all))}
        metrics.update({f"eval_{k}": v for k, v in self.compute_metrics(predictions_all, labels_all).items()})
        self.state.log_history.append({"step": self.state.global_step, **metrics})
        acc.log({k.replace("eval_", "eval/"): v for k, v in metrics.items()}, step=self.state.global_step)
        self._last_eval_step = self.state.global_step
        self._log(f"step {self.state.global_step}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def _log(self, message: str) -> None:
        if self.accelerator.is_main_process:
            self.log.info(message)

    def _save_run_info(self) -> None:
        import json
        from pathlib import Path

        if self.accelerator.is_main_process:
            directory = Path(self.args.output_dir)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hftrain_strategy.json").write_text(json.dumps(self.strategy_summary, indent=2) + "\n")

    def _save_trainer_state(self) -> None:
        import json
        from pathlib import Path

        if self.accelerator.is_main_process:
            path = Path(self.args.output_dir) / "trainer_state.json"
            path.write_text(json.dumps(self.state_dict(), indent=2) + "\n")

    def close(self) -> None:
        """End the run: flush trackers and destroy the process group (after any export)."""
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


def _scalars(config: dict[str, Any]) -> dict[str, Any]:
    # TensorBoard's hparams take only scalars.
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
