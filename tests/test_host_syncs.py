"""Host syncs (issue 54, part 3): the counter sees each kind of device-to-host read, and hftrain's training loop makes
at most one per logging window (the losses' read), under one process and ddp×2, for the classifier and the causal LM;
the late read changes no loss and no weight."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from hftrain.metrics.syncs import count_host_syncs
from tests.distributed import run_distributed

STEPS, LOGGING = 8, 4


# ----------------------------------------------------------------------------------------------- the counter
def test_the_counter_sees_item_nonzero_bool_masks_and_tolist():
    x = torch.arange(6.0) - 2
    with count_host_syncs() as item:
        x.sum().item()
    with count_host_syncs() as nonzero:
        torch.nonzero(x > 0)
    with count_host_syncs() as mask:
        x[x > 0]
    with count_host_syncs() as branch:
        if (x > 0).any():
            float(x[0])
    with count_host_syncs() as listed:
        x.tolist()
    with count_host_syncs() as sized:
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long))
        torch.masked_select(x, x > 0)
    with count_host_syncs() as none:  # device work only: nothing read back
        y = torch.where(x > 0, x, 0.0).sum() * 2
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)
        del y
    assert item.ops == {"aten._local_scalar_dense": 1} and item.where[0].startswith(__file__)
    assert nonzero.ops == {"aten.nonzero": 1}
    assert mask.total >= 1 and "aten.index" in mask.ops
    assert branch.ops == {"aten._local_scalar_dense": 2}
    assert listed.ops == {"tolist": 1}
    assert sized.ops == {"aten.repeat_interleave": 1, "aten.masked_select": 1}
    assert none.total == 0, none.where


# ----------------------------------------------------------------------------------------------- the loop
def _counting(trainer_class):
    """``trainer_class`` with the host reads of each optimizer step's own work counted (``train_step``,
    ``_record_step``, ``_on_step_end``: the forward, backward, optimizer, logging, vote, evaluation and saves)."""

    class Counting(trainer_class):
        def __init__(self, *args, **kwargs):
            self.syncs: dict[int, list[str]] = defaultdict(list)
            super().__init__(*args, **kwargs)

        def _counted(self, step: int, work):
            with count_host_syncs() as report:
                result = work()
            self.syncs[step] += [f"{op}" for op, n in report.ops.items() for _ in range(n)]
            return result

        def train_step(self, batch):
            return self._counted(self.state.global_step + 1, lambda: super(Counting, self).train_step(batch))

        def _record_step(self, local_loss, progress):
            return self._counted(self.state.global_step, lambda: super(Counting, self)._record_step(local_loss, progress))

        def _on_step_end(self, preemption, stop_at_step):
            return self._counted(
                self.state.global_step, lambda: super(Counting, self)._on_step_end(preemption, stop_at_step)
            )

    return Counting


def _classifier_run(*, strategy: str = "ddp", logging_steps: int = LOGGING, kind: str = "bert") -> dict:
    """A tiny classifier trained ``STEPS`` steps in this process group, each step's host reads counted."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, fp32_args, reset_accelerate_state, tiny_model_init, tiny_splits
    from tests.tiny import tiny_tokenizer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer(kind)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(96, 25), tokenizer, max_seq_length=32)
    args = fp32_args(
        _fresh_output_dir(),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=logging_steps,
        warmup_steps=2,
        max_grad_norm=1.0,
        save_steps=0,
        train_sampling_strategy="group_by_length",
        dataloader_num_workers=0,
    )
    trainer = _counting(SequenceClassificationTrainer)(
        args,
        strategy=strategy_from_options(strategy, None, launch=launch_info_from_environ()),
        model_init=tiny_model_init(kind),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.runtime.get_state_dict(trainer.model).items()}
    return {
        "syncs": dict(trainer.syncs),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": weights,
    }


def _assert_one_read_per_window(syncs: dict[int, list[str]]) -> None:
    per_step = {step: syncs.get(step, []) for step in range(1, STEPS + 1)}
    for step, reads in per_step.items():
        allowed = 1 if step % LOGGING == 0 else 0  # the window's losses, read at its last step
        assert len(reads) <= allowed, (step, reads)
    assert sum(len(r) for r in per_step.values()) <= STEPS // LOGGING


def test_one_process_reads_the_host_once_per_logging_window_and_trains_as_a_read_every_step():
    late, every = _classifier_run(), _classifier_run(logging_steps=1)
    _assert_one_read_per_window(late["syncs"])
    assert all(len(every["syncs"][step]) <= 1 for step in range(1, STEPS + 1))
    assert len(late["losses"]) == STEPS and late["losses"] == every["losses"]
    for name, value in every["weights"].items():
        torch.testing.assert_close(late["weights"][name], value, rtol=0, atol=0)
