"""ZeRO-1 (``strategy.shard_optimizer``) under expert parallelism: ep=2 in 4 processes (dp4, edp2) through the Trainer.

One 4-process gloo launch (a tiny Mixtral sequence classifier, 4 experts, dropless, fp32, micro 2) and the 1-process
reference (DDP strategy, the whole global batch of 8) in its own launch:
- ZeRO-1 stopped at step 8 and resumed to step 12: every step's loss, the learning rates, the evaluation, the final
  weights (experts gathered over ep) and the exported ``save_pretrained`` folder equal the reference's within 1e-5;
- the ZeRO-1 checkpoint of step 8 resumed at ep2 × dp4 *without* ``shard_optimizer`` (each rank then loads every
  moment of its parameters: the dense ones written once by their dp owner, its experts' by their edp owner) equals
  the reference the same way;
- ep=4 (one expert per rank, no edp replica: the experts' state whole, the dense state still sharded over dp4) equals
  the reference too;
- each rank's optimizer state under ZeRO-1: the dense parameters' about 1/4 of the same rank's without it (sharded
  over dp4), the experts' about 1/2 (over their edp2 replicas); the owners together hold exactly the unsharded state.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import assert_resumed_without_zero1, assert_same_weights, assert_stopped_resumed_and_exported
from tests.tiny import run_tiny_training

EP = {"ep": 2}
ZERO1 = {**EP, "shard_optimizer": True}
# 96 examples, global batch 8 (micro 2 × dp 4): 12 steps per epoch; a checkpoint every 4, the run stopped at 8 of 12
COMMON = {"kind": "mixtral", "steps": 12, "return_weights": True}
STEP8 = "checkpoints/step_00000008"


def _optimizer_state(trainer) -> dict:
    """This rank's optimizer-state bytes (its local optimizers' tensors), the experts' apart, and its coordinates."""
    import torch

    from hftrain.strategies.megatron.state import local_optimizers

    optimizer = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    locals_, zero1 = local_optimizers(optimizer)
    names = {id(p): n for n, p in trainer.runtime.unwrap_model(trainer.model).named_parameters()}
    held = {"dense": 0, "experts": 0}
    for local in locals_:
        for param, values in local.state.items():
            part = "experts" if ".experts." in names[id(param)] else "dense"
            held[part] += sum(v.numel() * v.element_size() for v in values.values() if torch.is_tensor(v))
    groups = trainer.runtime.plugin.groups
    return {**held, "zero1": zero1, "parts": len(locals_), "ep_rank": groups.ep_rank, "dp_rank": groups.dp_rank}


def _exported(trainer, directory: str) -> dict:
    """Export the trained model (collective, streamed) and read the written weights back on the main process."""
    from safetensors.torch import load_file

    from hftrain.checkpoint.export import export_pretrained

    result = export_pretrained(trainer.runtime, trainer.model, trainer.tokenizer, directory)
    weights = load_file(f"{result.model_dir}/model.safetensors") if trainer.accelerator.is_main_process else None
    return {"optimizer": _optimizer_state(trainer), "weights": weights}


def _four(root: str) -> dict:
    common = {**COMMON, "strategy": "megatron", "micro": 2, "save_steps": 4}
    part = run_tiny_training(output_dir=f"{root}/zero1", strategy_options=ZERO1, stop_at_step=8, **common)
    resumed = run_tiny_training(
        output_dir=f"{root}/zero1", strategy_options=ZERO1, resume_from_checkpoint="latest",
        inspect=lambda trainer: _exported(trainer, f"{root}/export"), **common,
    )  # fmt: skip
    # the same checkpoint at the same layout without ZeRO-1: every rank loads all the moments of its parameters
    plain = run_tiny_training(
        output_dir=f"{root}/plain", strategy_options=EP, resume_from_checkpoint=f"{root}/zero1/{STEP8}",
        trust_external_checkpoint=True, inspect=_optimizer_state, **common,
    )  # fmt: skip
    # ep = dp = 4: one expert per rank, no replica to shard its state over (it stays whole, beside the dense ZeRO-1)
    ep4 = run_tiny_training(
        output_dir=f"{root}/ep4", strategy_options={"ep": 4, "shard_optimizer": True}, inspect=_optimizer_state,
        **common,
    )  # fmt: skip
    return {"part": part, "resumed": resumed, "plain": plain, "ep4": ep4}


def _reference(root: str) -> dict:
    return run_tiny_training(micro=8, **COMMON)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("ep_zero1"))
    four = run_distributed(_four, nprocs=4, timeout=900, root=root)
    (reference,) = run_distributed(_reference, nprocs=1, timeout=600, root=root)
    return {"four": four, "reference": reference}


@pytest.mark.distributed
def test_ep_zero1_stopped_resumed_and_exported_equals_one_process(runs):
    assert_stopped_resumed_and_exported(runs, "ep2 × dp4 ZeRO-1")
    for rank in runs["four"]:
        optimizer = rank["resumed"]["inspected"]["optimizer"]
        assert optimizer["zero1"] and optimizer["parts"] == 2  # dense over dp, experts over edp


@pytest.mark.distributed
def test_ep_zero1_checkpoint_resumes_without_shard_optimizer(runs):
    assert_resumed_without_zero1(runs)


@pytest.mark.distributed
def test_ep_zero1_shards_dense_state_over_dp_and_experts_over_edp(runs):
    zero = [rank["resumed"]["inspected"]["optimizer"] for rank in runs["four"]]
    plain = [rank["plain"]["inspected"] for rank in runs["four"]]
    (dense,) = {p["dense"] for p in plain}  # every rank holds every dense parameter's state without ZeRO-1
    assert sum(z["dense"] for z in zero) == dense  # each dense parameter's moments on exactly one of the dp4 ranks
    for z in zero:
        assert 0.15 < z["dense"] / dense < 0.35, ([z["dense"] for z in zero], dense)
    for ep_rank in (0, 1):  # the edp2 replicas holding this ep rank's experts
        experts = {p["experts"] for p in plain if p["ep_rank"] == ep_rank}
        sharded = [z["experts"] for z in zero if z["ep_rank"] == ep_rank]
        assert len(experts) == 1 and len(sharded) == 2
        (whole,) = experts
        assert sum(sharded) == whole  # each expert's moments on exactly one of its two replicas
        for part in sharded:
            assert 0.35 < part / whole < 0.65, (ep_rank, sharded, whole)
    print(
        f"\nep2 × dp4 ZeRO-1 optimizer state per rank: dense {[z['dense'] for z in zero]} of {dense} bytes, "
        f"experts {[z['experts'] for z in zero]} of {plain[0]['experts']} bytes"
    )


@pytest.mark.distributed
def test_ep_zero1_at_ep_equal_to_dp_keeps_each_ranks_experts_whole(runs):
    ref = runs["reference"]
    for rank in runs["four"]:
        run = rank["ep4"]
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)
        held = run["inspected"]
        assert held["zero1"] and held["parts"] == 2
        plain = runs["four"][0]["plain"]["inspected"]
        # its one expert's whole state: half of ep2's two experts' (Adam's step scalars, one per tensor, do not halve)
        assert held["experts"] == pytest.approx(plain["experts"] / 2, rel=1e-3)
        assert 0.15 < held["dense"] / plain["dense"] < 0.35
    assert_same_weights(runs["four"][0]["ep4"]["weights"], ref["weights"], atol=1e-5)
