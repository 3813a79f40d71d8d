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
HOST_MADE = ("hftrain/data/batching.py", "hftrain/parallel/host.py")
"""Modules whose tensors are host memory by construction: the sampler's epoch order (a CPU generator's permutation,
drawn once per epoch when the causal LM counts its windows' targets) and the host group's flags (``parallel.host``:
gloo, never a device tensor). A read of them waits for no device, whatever the counter sees on a CPU run."""


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
            self.syncs[step] += [where for where in report.where if not any(m in where for m in HOST_MADE)]
            return result

        def train_step(self, batch):
            return self._counted(self.state.global_step + 1, lambda: super(Counting, self).train_step(batch))

        def _record_step(self, local_loss, progress):
            return self._counted(
                self.state.global_step, lambda: super(Counting, self)._record_step(local_loss, progress)
            )

        def _on_step_end(self, preemption, stop_at_step):
            return self._counted(
                self.state.global_step, lambda: super(Counting, self)._on_step_end(preemption, stop_at_step)
            )

    return Counting


def _lm_run(*, strategy: str = "ddp", logging_steps: int = LOGGING, kind: str = "llama", micro: int = 2) -> dict:
    """A tiny causal LM on packed blocks trained ``STEPS`` steps (accumulation 2) in this process group, each step's
    host reads counted."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.data.language import pack_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.language import CausalLMTrainer
    from tests.test_causal_lm import BLOCK, lm_model_init, lm_splits
    from tests.tiny import _fresh_output_dir, fp32_args, reset_accelerate_state, tiny_tokenizer

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    packed = pack_splits(lm_splits(n_train=160), tokenizer, block_size=BLOCK, log=lambda _: None)
    args = fp32_args(
        _fresh_output_dir(),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        logging_steps=logging_steps,
        learning_rate=3e-3,
        warmup_steps=1,
        save_steps=0,
        train_sampling_strategy="random",
    )
    trainer = _counting(CausalLMTrainer)(
        args,
        strategy=strategy_from_options(strategy, None, launch=launch_info_from_environ()),
        model_init=lm_model_init(kind),
        tokenizer=tokenizer,
        train_dataset=packed["train"],
        eval_dataset=packed["validation"],
    )
    return _fitted(trainer)


def _fitted(trainer) -> dict:
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.runtime.get_state_dict(trainer.model).items()}
    return {
        "syncs": dict(trainer.syncs),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": weights,
    }


def _classifier_run(*, strategy: str = "ddp", logging_steps: int = LOGGING, kind: str = "bert", micro: int = 4) -> dict:
    """A tiny classifier trained ``STEPS`` steps in this process group, each step's host reads counted."""
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, fp32_args, tiny_classifier_trainer

    args = fp32_args(
        _fresh_output_dir(),
        per_device_train_batch_size=micro,
        max_steps=STEPS,
        logging_steps=logging_steps,
        warmup_steps=2,
        max_grad_norm=1.0,
        save_steps=0,
        train_sampling_strategy="group_by_length",
        dataloader_num_workers=0,
    )
    trainer = tiny_classifier_trainer(
        args, strategy=strategy, kind=kind, trainer_class=_counting(SequenceClassificationTrainer)
    )
    return _fitted(trainer)


def _assert_one_read_per_window(syncs: dict[int, list[str]]) -> None:
    per_step = {step: syncs.get(step, []) for step in range(1, STEPS + 1)}
    for step, reads in per_step.items():
        allowed = 1 if step % LOGGING == 0 else 0  # the window's losses, read at its last step
        assert len(reads) <= allowed, (step, reads)
    assert sum(len(r) for r in per_step.values()) <= STEPS // LOGGING


def _assert_same_training(late: dict, every: dict) -> None:
    assert len(late["losses"]) == STEPS and late["losses"] == every["losses"]
    for name, value in every["weights"].items():
        torch.testing.assert_close(late["weights"][name], value, rtol=0, atol=0)


@pytest.mark.parametrize("run", [_classifier_run, _lm_run], ids=["classifier", "causal_lm"])
def test_one_process_reads_the_host_once_per_logging_window_and_trains_as_a_read_every_step(run):
    """The late read changes nothing: the same losses and weights, bit for bit, as a read at every step."""
    late, every = run(), run(logging_steps=1)
    _assert_one_read_per_window(late["syncs"])
    assert all(len(every["syncs"][step]) <= 1 for step in range(1, STEPS + 1))
    _assert_same_training(late, every)


def _two_processes() -> dict:
    return {"classifier": (_classifier_run(micro=2), _classifier_run(micro=2, logging_steps=1)),
            "causal_lm": (_lm_run(micro=1), _lm_run(micro=1, logging_steps=1))}  # fmt: skip


@pytest.mark.distributed
def test_ddp_on_two_processes_reads_the_host_once_per_logging_window():
    """ddp×2 (half the micro-batch per rank): the same bound on every rank, and the same losses and weights as a read
    at every step; the stop vote's all-reduce is a host collective (``StopVote``), not a device read."""
    for rank, runs in enumerate(run_distributed(_two_processes, nprocs=2, timeout=600)):
        for task, (late, every) in runs.items():
            assert rank in (0, 1) and task in ("classifier", "causal_lm")
            _assert_one_read_per_window(late["syncs"])
            _assert_same_training(late, every)


# ----------------------------------------------------------------------------------------------- the masks
@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_a_padded_batch_gets_transformers_own_mask_without_a_host_read(kind):
    """``apply_unchecked_masks``: the same logits and gradients (fp32, bit for bit) as transformers' checked masks,
    and no host read, for a padded batch, an unpadded one without a mask and one with an all-ones mask."""
    import copy

    from transformers import AutoModelForSequenceClassification

    from hftrain.trainers.inputs import apply_unchecked_masks
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    checked = AutoModelForSequenceClassification.from_config(tiny_config(kind))
    unchecked = copy.deepcopy(checked)
    assert apply_unchecked_masks(unchecked) == ["sdpa"]
    ids = torch.randint(3, 40, (4, 12))
    padded = torch.ones(4, 12, dtype=torch.long)
    padded[1, 8:], padded[2, 5:] = 0, 0
    for case, mask in enumerate((padded, None, torch.ones(4, 12, dtype=torch.long))):
        checked.zero_grad(), unchecked.zero_grad()
        expected = checked(input_ids=ids, attention_mask=mask).logits
        with count_host_syncs() as reads:
            got = unchecked(input_ids=ids, attention_mask=mask).logits
        if kind != "gpt2" or mask is not None:  # GPT-2 warns on a pad token without a mask: a read of its own
            assert reads.total == 0, reads.where
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        expected.square().sum().backward()
        got.square().sum().backward()
        for (name, a), b in zip(checked.named_parameters(), unchecked.parameters(), strict=True):
            # an all-ones mask: the masked kernel where transformers' check chose the unmasked one (rounding only)
            exact = {"rtol": 1e-6, "atol": 1e-7} if case == 2 else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(b.grad, a.grad, **exact, msg=lambda m, n=name, c=case: f"{n} ({c}): {m}")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_blocks_get_their_documents_mask_without_a_host_read(kind):
    """``packed_causal_mask``: the logits transformers computes from the restarting ``position_ids`` (fp32), with no
    host read, for rows of several documents and a row of one."""
    from transformers import AutoModelForCausalLM

    from hftrain.trainers.inputs import packed_causal_mask, takes_boolean_masks
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
    assert takes_boolean_masks(model)
    positions = torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], list(range(12)), [0, 1, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0]]
    )
    ids = torch.randint(3, 40, (3, 12))
    expected = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    with count_host_syncs() as reads:
        mask = packed_causal_mask(positions)
        got = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
    assert reads.total == 0, reads.where
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    alone = [model(input_ids=ids[:1, a:b], use_cache=False).logits for a, b in ((0, 4), (4, 7), (7, 12))]
    torch.testing.assert_close(got[:1], torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)  # no document sees another


# ----------------------------------------------------------------------------------------------- the stop vote
def _votes(flags: dict[int, list[int]]) -> list[bool]:
    """Each step's agreed stop on this rank, its own flag raised at the steps in ``flags[rank]``; the last step
    settles."""
    import os

    import torch.distributed as dist

    from hftrain.trainers.guards import StopVote

    dist.init_process_group("gloo")
    rank, vote, agreed = int(os.environ["RANK"]), StopVote(2), []
    for step in range(1, 7):
        flag = step in flags[rank]
        agreed.append(vote.settle(flag) if step == 6 else vote.poll(flag))
        if agreed[-1]:
            break
    dist.destroy_process_group()
    return agreed


@pytest.mark.distributed
def test_the_stop_vote_stops_every_rank_at_the_same_step_one_after_the_signal():
    """A flag raised on rank 1 at step 2 stops both ranks at step 3; one raised at the last step stops them there."""
    early = run_distributed(_votes, nprocs=2, flags={0: [], 1: [2]})
    assert early == [[False, False, True]] * 2
    last = run_distributed(_votes, nprocs=2, flags={0: [6], 1: []})
    assert last == [[False] * 5 + [True]] * 2


def test_models_with_local_attention_keep_transformers_own_packed_masks():
    """A sliding window (Qwen2's, Mistral's) or chunked attention needs a mask per layer kind: no 4-D mask for them."""
    from transformers import AutoModelForCausalLM

    from hftrain.trainers.inputs import takes_boolean_masks
    from tests.tiny import tiny_config

    for kind in ("qwen2", "mistral", "gemma2"):
        assert not takes_boolean_masks(AutoModelForCausalLM.from_config(tiny_config(kind))), kind
