"""A mixture of experts' causal LM under pipeline parallelism (pp2): its router loss under the LM's token scaling.

One 2-process gloo launch and one 1-process launch for the reference, fp32, a tiny Mixtral ``*ForCausalLM`` (4
experts, top-2, ``router_aux_loss_coef`` 0.02, one MoE layer per stage) on packed blocks of 32 tokens, the global
batch 8:
- pp2: micro-batch 4 × accumulation 2, two pipeline micro-batches of 2 rows each; every stage adds its layer's
  routing sums to the ones it received, the last computes each pipeline micro-batch's router loss, weighted by its
  share of the rows (``hftrain.trainers.token_mean.TokenMeanLoss.router_loss_share``) beside the token sums scaled by
  ``dp · accumulation / N``;
- one process: micro-batch 2 × accumulation 4, the same rows per router loss, the same token mean.
The pp2 job is stopped at step 4 (a checkpoint every 2), resumed to 6 and exported: every step's loss on both ranks,
the final evaluation and the exported weights equal the 1-process run's within 1e-5 (a router loss left out, or
added unweighted, moves a step's loss by about 0.04). In one process: the megatron strategy takes the MoE causal LM
at pp2, and ``hftrain plan``'s pp rows of it are runnable.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import moe_lm_job, tiny_config, train_job

STEPS, STOP = 6, 4
LAYOUT = {"pp": 2, "num_microbatches": 2}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, str]:
    """A tiny Mixtral causal LM (its EOS the padding) with a word-level tokenizer, and its data."""
    return moe_lm_job(tmp_path_factory.mktemp("moe_lm_pp"))


def _config(job: dict[str, str], run: str, *, micro: int, accumulation: int, **fields):
    from hftrain.api import make_config

    return make_config(
        model_name_or_path=f"{job['root']}/lm", task="causal_lm", dataset_name=None, train_file=job["train"],
        validation_file=job["validation"], max_seq_length=32, cache_dir=f"{job['root']}/cache",
        output_dir=f"{job['root']}/{run}", max_steps=STEPS, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, per_device_eval_batch_size=3, learning_rate=3e-3, warmup_steps=1,
        logging_steps=1, log_with="none", mixed_precision="no", save_steps=2, **fields,
    )  # fmt: skip


def _train(config, *, stop_at_step: int | None = None) -> dict:
    """The job trained as ``hftrain.job.run_training`` runs it (``tests.tiny.train_job``): its losses, final metrics,
    load figures and exported weights."""
    trainer, run = train_job(config, stop_at_step=stop_at_step)
    loads = [h["expert_load_max"] for h in trainer.state.log_history if "expert_load_max" in h]
    return {**run, "loads": loads, "pipeline": hasattr(trainer.model, "take_router_loss")}


def _one_process(job: dict[str, str]) -> dict:
    return _train(_config(job, "reference", micro=2, accumulation=4))


def _pp2(job: dict[str, str]) -> dict:
    """pp2, stopped at step 4 and resumed to 6 in the same folder."""
    fields = {"micro": 4, "accumulation": 2, "name": "megatron", **LAYOUT}
    part = _train(_config(job, "pp2", **fields), stop_at_step=STOP)
    resumed = _train(_config(job, "pp2", resume_from_checkpoint="latest", **fields))
    return {"part": part, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(job) -> dict:
    two = run_distributed(_pp2, nprocs=2, timeout=900, job=job)
    (one,) = run_distributed(_one_process, nprocs=1, timeout=600, job=job)
    return {"two": two, "one": one}


@pytest.mark.distributed
def test_moe_causal_lm_at_pp2_stopped_resumed_and_exported_equals_one_process(runs):
    ref = runs["one"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the loss moved
    assert not ref["pipeline"] and len(ref["loads"]) == STEPS
    worst = 0.0
    for rank in runs["two"]:  # every rank logs the last stage's loss and evaluates
        part, resumed = rank["part"], rank["resumed"]
        assert part["pipeline"] and resumed["pipeline"]
        assert part["global_step"] == STOP and resumed["global_step"] == STEPS
        assert part["losses"] == pytest.approx(ref["losses"][:STOP], rel=1e-5, abs=1e-6)
        assert len(resumed["losses"]) == STEPS  # the first four from the checkpoint's history
        assert resumed["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
        assert resumed["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
        # the tokens routed to each expert, counted by each stage's layers and summed over the stages
        assert part["loads"] == pytest.approx(ref["loads"][:STOP], rel=1e-6)
        worst = max(worst, *(abs(a - b) for a, b in zip(resumed["losses"], ref["losses"], strict=True)))
    weights = runs["two"][0]["resumed"]["weights"]
    assert weights is not None and weights.keys() == ref["weights"].keys()
    for name, tensor in ref["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
    moved = max((weights[n] - t).abs().max().item() for n, t in ref["weights"].items())
    print(f"\nMixtral causal LM pp2, stopped at {STOP} and resumed to {STEPS}: largest loss difference {worst:.1e}, "
          f"largest exported weight difference {moved:.1e}")  # fmt: skip


def test_the_strategy_takes_a_moe_causal_lm_at_pp_and_the_planner_offers_it(tmp_path):
    """The megatron strategy's model check takes a Mixtral causal LM at pp2 (refused before, issue 57), and ``hftrain
    plan``'s pp rows of it are runnable, not formula-only."""
    from hftrain.parallel.families import trainable_axes
    from hftrain.plan import Hardware, Workload, model_from_config, model_parallel
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    config = tiny_config("mixtral")
    assert "pp" in trainable_axes(config, head="causal_lm")
    config.save_pretrained(tmp_path / "mixtral")
    strategy = strategy_from_options(
        "megatron", LAYOUT, launch=LaunchInfo(world_size=2, local_world_size=2), platform=Platform("cpu", "gloo")
    )
    strategy.check_model(config, use_lora=False, task="causal_lm")
    model = model_from_config(str(tmp_path / "mixtral"), task="causal_lm")
    assert "pp" in model.axes
    row = model_parallel.estimate(1, 2, model, Workload(dropout=False), Hardware(gpus_per_node=2))
    assert row.runnable and not any("formula only" in note for note in row.notes), row.notes
