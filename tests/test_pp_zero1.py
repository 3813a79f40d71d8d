"""ZeRO-1 (``strategy.shard_optimizer``) under pipeline parallelism: pp=2 × dp=2 through the Trainer.

One 4-process gloo launch (tiny GPT-2 of 4 layers, fp32, 1F1B over 2 micro-batches of the per-device 4), and the
1-process reference (DDP strategy, the whole global batch of 8 × accumulation 2) in its own launch:
- ZeRO-1 stopped at step 8 and resumed to step 12: every step's loss, the learning rates, the evaluation, the final
  weights (merged over the stages) and the exported ``save_pretrained`` folder equal the reference's within 1e-5;
- the ZeRO-1 checkpoint of step 8 resumed at pp=2 × dp=2 *without* ``shard_optimizer`` (each rank then loads every
  moment of its stage, which the checkpoint holds once, written by its owner) equals the reference the same way;
- each rank's optimizer state (its tensors' bytes) under ZeRO-1 is about half of the same rank's without it, and
  the two dp ranks of a stage together hold exactly what one rank holds without it.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import assert_resumed_without_zero1, assert_stopped_resumed_and_exported
from tests.tiny import run_tiny_training

LAYERS = 4
PIPELINE = {"pp": 2, "num_microbatches": 2, "schedule": "1f1b"}
ZERO1 = {**PIPELINE, "shard_optimizer": True}
# 96 examples, global batch 16 (micro 4 × dp 2 × accumulation 2): 6 steps per epoch; step 8 is mid-epoch 1.
COMMON = {"kind": "gpt2", "gas": 2, "steps": 12, "num_layers": LAYERS, "return_weights": True}
STEP8 = "checkpoints/step_00000008"


def _optimizer_state(trainer) -> dict:
    """This rank's optimizer-state bytes (every tensor of its local optimizer: ZeRO-1's shard, else the whole
    stage's) and its coordinates."""
    import torch

    optimizer = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    tensors = [v for state in local.state.values() for v in state.values() if torch.is_tensor(v)]
    groups = trainer.runtime.plugin.groups
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "zero1": hasattr(optimizer, "optim"),
        "pp_rank": groups.pp_rank,
        "dp_rank": groups.dp_rank,
    }


def _exported(trainer, directory: str) -> dict:
    """Export the trained model (collective, streamed) and read the written weights back on the main process."""
    from safetensors.torch import load_file

    from hftrain.checkpoint.export import export_pretrained

    result = export_pretrained(trainer.runtime, trainer.model, trainer.tokenizer, directory)
    weights = load_file(f"{result.model_dir}/model.safetensors") if trainer.accelerator.is_main_process else None
    return {"optimizer": _optimizer_state(trainer), "weights": weights, "streamed": result.streamed}


def _four(root: str) -> dict:
    common = {**COMMON, "strategy": "megatron", "micro": 4}
    part = run_tiny_training(output_dir=f"{root}/zero1", strategy_options=ZERO1, stop_at_step=8, save_steps=5, **common)
    resumed = run_tiny_training(
        output_dir=f"{root}/zero1", strategy_options=ZERO1, resume_from_checkpoint="latest",
        inspect=lambda trainer: _exported(trainer, f"{root}/export"), **common,
    )  # fmt: skip
    # the same checkpoint at the same layout without ZeRO-1: every rank loads its whole stage's moments
    plain = run_tiny_training(
        output_dir=f"{root}/plain", strategy_options=PIPELINE, resume_from_checkpoint=f"{root}/zero1/{STEP8}",
        trust_external_checkpoint=True, inspect=_optimizer_state, **common,
    )  # fmt: skip
    return {"part": part, "resumed": resumed, "plain": plain}


def _reference(root: str) -> dict:
    return run_tiny_training(micro=8, **COMMON)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("pp_zero1"))
    four = run_distributed(_four, nprocs=4, timeout=900, root=root)
    (reference,) = run_distributed(_reference, nprocs=1, timeout=600, root=root)
    return {"four": four, "reference": reference}


@pytest.mark.distributed
def test_zero1_stopped_resumed_and_exported_equals_one_process(runs):
    assert_stopped_resumed_and_exported(runs, "pp2 × dp2 ZeRO-1")
    for rank in runs["four"]:
        assert rank["resumed"]["inspected"]["optimizer"]["zero1"]
        assert rank["resumed"]["inspected"]["streamed"]


@pytest.mark.distributed
def test_zero1_checkpoint_resumes_without_shard_optimizer(runs):
    assert_resumed_without_zero1(runs)


@pytest.mark.distributed
def test_zero1_halves_each_ranks_optimizer_state(runs):
    zero = [rank["resumed"]["inspected"]["optimizer"] for rank in runs["four"]]
    plain = [rank["plain"]["inspected"] for rank in runs["four"]]
    for stage in (0, 1):
        sharded = [z["bytes"] for z in zero if z["pp_rank"] == stage]
        whole = {p["bytes"] for p in plain if p["pp_rank"] == stage}
        assert len(sharded) == 2 and len(whole) == 1  # the stage's two dp replicas hold the same state without ZeRO-1
        (whole,) = whole
        assert sum(sharded) == whole  # each parameter's moments on exactly one dp rank
        for part in sharded:
            assert 0.4 < part / whole < 0.6, (stage, sharded, whole)
        print(f"\npp2×dp2 stage {stage}: optimizer state per rank {sharded} bytes with ZeRO-1, {whole} without")


def test_the_megatron_strategy_takes_zero1_with_stages_and_with_experts():
    from hftrain.strategies import LaunchInfo, strategy_from_options

    staged = strategy_from_options("megatron", ZERO1, launch=LaunchInfo(world_size=4))
    assert (staged.dims.pp, staged.dims.dp, staged.config.shard_optimizer) == (2, 2, True)
    experts = strategy_from_options("megatron", {"ep": 2, "shard_optimizer": True}, launch=LaunchInfo(world_size=4))
    assert (experts.dims.ep, experts.dims.dp, experts.config.shard_optimizer) == (2, 4, True)  # tests/test_ep_zero1.py
