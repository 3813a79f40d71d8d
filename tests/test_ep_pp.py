"""Expert parallelism inside pipeline stages: a Mixtral classifier at pp2 × ep2 (4 gloo processes, fp32) against one.

Megatron-LM's rank order: each stage's dp 2 ranks form its ep group (ranks {0, 1} hold stage 0, {2, 3} stage 1), so
each stage splits its layer's 4 experts over 2 ranks that see different examples. Each rank builds torch's pipeline
schedule when *its* batch's shape is new, and torch infers a stage's shapes by a forward and backward of its own:
those placeholder passes must run no all-to-all and no router-loss reduction, or the ep ranks of a stage call
different collectives (gloo: "Received data size doesn't match expected size"). ONE 4-process launch, one
1-process reference:

- one micro-batch per stage (GPipe): the router loss over the global batch, as one process computes it; every step's
  loss, the eval and the trained weights equal one process within 1e-5;
- 2 micro-batches (1F1B), load-balancing loss off: the pipeline's micro-batches do not change the rest;
- stopped at step 8 and resumed equals 12 steps in one go; the export, written by all 4 ranks, reloads in plain
  transformers with one process's weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron_runs import assert_parity, assert_same_weights
from tests.tiny import run_tiny_training

LAYOUT = {"pp": 2, "ep": 2}
RESUME = {"kind": "mixtral", "steps": 12, "save_steps": 4, "return_weights": True, "strategy": "megatron", "micro": 4}
NO_AUX = {"router_aux_loss_coef": 0.0}


def _export(root: str):
    """``inspect``: export the trained pipeline (collective) and report the experts this rank holds."""

    def inspect(trainer) -> dict:
        from hftrain.checkpoint.export import export_pretrained
        from hftrain.parallel.expert_parallel import ExpertParallelExperts

        export_pretrained(trainer.runtime, trainer.model, trainer.tokenizer, Path(root, "export"))
        blocks = [m for m in trainer.model.modules() if isinstance(m, ExpertParallelExperts)]
        return {"local_experts": [m.local_experts for m in blocks]}

    return inspect


def _four(root: str) -> dict:
    common = {"kind": "mixtral", "steps": 10, "strategy": "megatron", "return_weights": True, "micro": 4}
    one_micro = run_tiny_training(
        strategy_options={**LAYOUT, "num_microbatches": 1, "schedule": "gpipe"}, inspect=_export(root), **common
    )  # fmt: skip
    two_micro = run_tiny_training(
        strategy_options={**LAYOUT, "num_microbatches": 2}, config_overrides=NO_AUX, **common
    )  # fmt: skip
    options = {**LAYOUT, "num_microbatches": 2}
    full = run_tiny_training(output_dir=f"{root}/full", strategy_options=options, **RESUME)
    part = run_tiny_training(output_dir=f"{root}/part", strategy_options=options, stop_at_step=8, **RESUME)
    resumed = run_tiny_training(
        output_dir=f"{root}/part", strategy_options=options, resume_from_checkpoint="latest", **RESUME
    )
    return {"one_micro": one_micro, "two_micro": two_micro, "full": full, "part": part, "resumed": resumed}


def _one(root: str) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    reference = run_tiny_training(kind="mixtral", micro=8, steps=10, return_weights=True)
    no_aux = run_tiny_training(kind="mixtral", micro=8, steps=10, return_weights=True, config_overrides=NO_AUX)
    exported = AutoModelForSequenceClassification.from_pretrained(Path(root, "export"), dtype=torch.float32)
    return {"reference": reference, "no_aux": no_aux, "exported": exported.state_dict()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from tests.distributed import run_distributed

    root = str(tmp_path_factory.mktemp("ep_pp"))
    four = run_distributed(_four, nprocs=4, timeout=900, root=root)
    (one,) = run_distributed(_one, nprocs=1, timeout=900, root=root)
    return {"four": four, "one": one}


def _max_loss_diff(run: dict, ref: dict) -> float:
    return max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True))


@pytest.mark.distributed
def test_pp2_ep2_equals_one_process(runs):
    ref = runs["one"]["reference"]
    for rank in runs["four"]:
        run = rank["one_micro"]
        assert_parity(run, ref)
        assert run["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], rel=1e-5)
        assert run["inspected"]["local_experts"] == [2]  # one MoE layer per stage, half of its 4 experts
        print(f"pp2 × ep2: largest loss difference {_max_loss_diff(run, ref):.2e}")
    assert_same_weights(runs["four"][0]["one_micro"]["weights"], ref["weights"], atol=1e-5)


@pytest.mark.distributed
def test_pp2_ep2_with_two_micro_batches_equals_one_process(runs):
    ref = runs["one"]["no_aux"]
    for rank in runs["four"]:
        assert_parity(rank["two_micro"], ref)
        assert rank["two_micro"]["metrics"]["eval_loss"] == pytest.approx(ref["metrics"]["eval_loss"], rel=1e-5)
    assert_same_weights(runs["four"][0]["two_micro"]["weights"], ref["weights"], atol=1e-5)


@pytest.mark.distributed
def test_pp2_ep2_resumed_equals_uninterrupted(runs):
    for rank in runs["four"]:
        full, part, resumed = rank["full"], rank["part"], rank["resumed"]
        assert part["preempted"] == "stop_at_step" and part["global_step"] == 8
        assert resumed["global_step"] == full["global_step"] == 12
        assert resumed["losses"] == full["losses"] and resumed["lrs"] == full["lrs"]
        assert resumed["metrics"] == pytest.approx(full["metrics"])
    main = runs["four"][0]
    assert_same_weights(main["resumed"]["weights"], main["full"]["weights"], atol=1e-6)


@pytest.mark.distributed
def test_pp2_ep2_export_reloads_with_one_process_weights(runs):
    # written by all 4 ranks (experts gathered over ep, layers over pp), reloaded by plain transformers
    assert_same_weights(runs["one"]["exported"], runs["one"]["reference"]["weights"], atol=1e-5)
