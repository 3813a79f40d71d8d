"""Expert parallelism's host reads per optimizer step (issue 55): a Mixtral of two MoE layers (4 experts, top-2)
trained under ep=2 (megatron strategy, real gloo processes) with ``moe_capacity_factor: 2`` (= E/k: fixed slots that
no expert can overflow) reads the host at most once per step for all its layers together, the logging window's
loss read included; dropless with the exact split sizes reads once per layer and micro-batch, and both train alike
(same losses and weights, fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_host_syncs import HOST_MADE, LOGGING, STEPS, _counting


def _ep_run(capacity_factor: float | None) -> dict:
    from hftrain.data.batching import tokenize_splits
    from hftrain.parallel import expert_parallel
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import (
        _fresh_output_dir,
        fit_in_rank,
        fp32_args,
        reset_accelerate_state,
        tiny_model_init,
        tiny_splits,
        tiny_tokenizer,
    )

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("mixtral")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(96, 25), tokenizer, max_seq_length=32)
    args = fp32_args(
        _fresh_output_dir(),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        logging_steps=LOGGING,
        warmup_steps=1,
        save_steps=0,
        train_sampling_strategy="group_by_length",  # ranks see different lengths: the slots' agreement is tested
        dataloader_num_workers=0,
    )
    options = {"ep": 2, "moe_capacity_factor": capacity_factor}
    trainer, _ = fit_in_rank(
        _counting(SequenceClassificationTrainer), args, "megatron", options, tiny_model_init("mixtral"), tokenizer,
        splits,
    )  # fmt: skip
    blocks = [m for m in trainer.model.modules() if isinstance(m, expert_parallel.ExpertParallelExperts)]
    syncs = {s: [w for w in r if not any(m in w for m in HOST_MADE)] for s, r in trainer.syncs.items()}
    weights = {k: v.detach().clone() for k, v in trainer.runtime.get_state_dict(trainer.model).items()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    dropped = sum(h.get("dropped_token_assignments", 0) for h in trainer.state.log_history)
    padded = [m.padded for m in blocks]
    return {"padded": padded, "syncs": syncs, "losses": losses, "weights": weights, "dropped": dropped}


def _both() -> dict:
    return {"padded": _ep_run(2.0), "read": _ep_run(None)}


CPU_ONLY = "hftrain/parallel/layers.py"
"""The vocabulary-parallel embedding's range check: a host ``if`` on CPU, ``torch._assert_async`` on CUDA (no read)."""
WINDOW = ("hftrain/trainers/experts.py", "dropped_assignments")
"""The load figures and dropped count of the logging window, read with its losses (``close_window``), not per
step."""


@pytest.mark.distributed
def test_expert_parallel_reads_the_host_at_most_once_per_step_for_all_its_layers():
    for runs in run_distributed(_both, nprocs=2, timeout=600):
        padded, read = runs["padded"], runs["read"]
        assert padded["padded"] == [True, True] and read["padded"] == [False, False]
        for step in range(1, STEPS + 1):
            reads = [w for w in padded["syncs"].get(step, []) if CPU_ONLY not in w and not any(m in w for m in WINDOW)]
            assert len(reads) <= (1 if step % LOGGING == 0 else 0), (step, reads)  # the window's losses only
            window = [w for w in padded["syncs"].get(step, []) if any(m in w for m in WINDOW)]
            assert not window or step % LOGGING == 0, (step, window)
        # the exact split sizes: one read per MoE layer and micro-batch (2 layers × 2 micro-batches per step)
        for step in range(1, STEPS + 1):
            assert sum("expert_parallel.py" in w for w in read["syncs"].get(step, [])) == 4, read["syncs"][step]
        assert len(padded["losses"]) == STEPS and padded["dropped"] == 0  # a factor of E/k drops nothing
        for a, b in zip(padded["losses"], read["losses"], strict=True):
            assert a == pytest.approx(b, rel=1e-5)
        for name, value in read["weights"].items():
            torch.testing.assert_close(padded["weights"][name], value, rtol=1e-5, atol=1e-6)
