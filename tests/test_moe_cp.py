"""Mixtures of experts under context parallelism (``strategy: {name: megatron, cp: 2}``), against one process.

The routers of a cp rank see its zigzag positions of every sequence only; the load-balancing loss
``L = E · Σ_e f_e · P_e`` is a product of means over the whole batch's real tokens, so each rank's per-expert sums
(top-k counts, router probabilities, real tokens) are all-reduced over dp × cp, the probabilities both ways
(``hftrain.parallel.ep_routing``), and every cp rank computes the whole ``L``. fp32, the global batch 8, 10 steps,
``router_aux_loss_coef`` 0.02 (tests/tiny.py), texts of 20-60 words cut at 64 tokens (padded: real tokens and
padding on both cp ranks, the padding excluded from ``f`` and ``P`` by this rank's positions of the mask):
- 2 processes, cp=2: Mixtral (ring), Qwen3-MoE (all-to-all), Qwen2-MoE (ring: its shared expert and dense layer)
  sequence classifiers, and a Mixtral causal LM (ring, packed blocks of 32 tokens, 6 steps, micro 8): its logits
  are the rank's positions', the token sums added over cp, the router loss over dp × cp as the classifiers';
- 4 processes, pp2 × cp2: Mixtral (ring), 2 pipeline micro-batches of 4 rows: each stage adds its layer's routing
  sums of its positions, the last reduces them over dp × cp per pipeline micro-batch;
- 1 process: the references (DDP, the whole global batch; micro 4 × accumulation 2 for the pipeline's).
Every step's loss on both ranks, the evaluation and the final weights equal the reference's within 1e-5; the
router loss's share of the reference loss is far above that (checked: the reference without it differs).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import assert_parity, assert_same_weights
from tests.tiny import moe_lm_job, run_tiny_training, train_job

DATA = {"words": (20, 60), "max_seq_length": 64, "steps": 10, "return_weights": True}
CASES = {  # label -> (family, strategy options)
    "mixtral-ring": ("mixtral", {"cp": 2}),
    "qwen3_moe-all_to_all": ("qwen3_moe", {"cp": 2, "cp_comm": "all_to_all"}),
    "qwen2_moe-ring": ("qwen2_moe", {"cp": 2}),
}


def _lm(job: dict[str, str], run: str, **fields) -> dict:
    """The causal LM job trained as ``hftrain.job.run_training`` runs it: its losses, metrics and export."""
    from hftrain.api import make_config

    config = make_config(
        model_name_or_path=f"{job['root']}/lm", task="causal_lm", dataset_name=None, train_file=job["train"],
        validation_file=job["validation"], max_seq_length=32, cache_dir=f"{job['root']}/cache",
        output_dir=f"{job['root']}/{run}", max_steps=6, per_device_train_batch_size=8, per_device_eval_batch_size=3,
        learning_rate=3e-3, warmup_steps=1, logging_steps=1, log_with="none", mixed_precision="no", **fields,
    )  # fmt: skip
    return train_job(config)[1]


def _cp2(job: dict[str, str]) -> dict:
    runs = {
        label: run_tiny_training(kind=kind, micro=8, strategy="megatron", strategy_options=options, **DATA)
        for label, (kind, options) in CASES.items()
    }
    runs["lm"] = _lm(job, "lm-cp2", name="megatron", cp=2)
    return runs


PIPELINE = {"cp": 2, "pp": 2, "num_microbatches": 2}


def _four(root: str) -> dict:
    ep_cp = {"kind": "mixtral", "micro": 4, "strategy": "megatron", "strategy_options": {"ep": 2, "cp": 2}, **DATA}
    stopped = run_tiny_training(output_dir=f"{root}/ep2cp2", stop_at_step=6, save_steps=3, **ep_cp)
    resumed = run_tiny_training(output_dir=f"{root}/ep2cp2", resume_from_checkpoint="latest", save_steps=3, **ep_cp)
    return {
        "stopped": stopped,
        "resumed": resumed,
        "pp2cp2": run_tiny_training(kind="mixtral", micro=8, strategy="megatron", strategy_options=PIPELINE, **DATA),
        # dp 2 carved into ep 2 at each cp coordinate: micro 4 per replica, the global batch 8
        "ep2cp2": run_tiny_training(
            kind="mixtral", micro=4, strategy="megatron", strategy_options={"ep": 2, "cp": 2}, **DATA
        ),
    }


def _references(job: dict[str, str]) -> dict:
    runs = {kind: run_tiny_training(kind=kind, micro=8, strategy="ddp", **DATA) for kind, _ in CASES.values()}
    runs["gas2"] = run_tiny_training(kind="mixtral", micro=4, gas=2, strategy="ddp", **DATA)
    runs["lm"] = _lm(job, "lm-reference")
    # the router loss is on, and it matters at this tolerance: without it the first step's loss moves
    runs["no_aux"] = run_tiny_training(
        kind="mixtral", micro=8, strategy="ddp", config_overrides={"router_aux_loss_coef": 0.0}, **DATA
    )
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    job = moe_lm_job(tmp_path_factory.mktemp("moe_cp"))
    two = run_distributed(_cp2, nprocs=2, timeout=900, job=job)
    four = run_distributed(_four, nprocs=4, timeout=900, root=str(tmp_path_factory.mktemp("ep_cp")))
    (one,) = run_distributed(_references, nprocs=1, timeout=900, job=job)
    return {"two": two, "four": four, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(CASES))
def test_moe_under_cp_matches_one_process_with_its_router_loss(runs, label):
    kind = CASES[label][0]
    reference = runs["one"][kind]
    for rank in runs["two"]:
        assert_parity(rank[label], reference)
        assert rank[label]["losses"] == runs["two"][0][label]["losses"]  # every cp rank computes the whole loss
    assert_same_weights(runs["two"][0][label]["weights"], reference["weights"], atol=1e-5)  # the main process's
    assert runs["two"][0][label]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)


@pytest.mark.distributed
def test_moe_under_pp_and_cp_matches_one_process_accumulating_the_pipeline_micro_batches(runs):
    reference = runs["one"]["gas2"]
    for rank in runs["four"]:  # every rank logs the last stage's loss
        assert_parity(rank["pp2cp2"], reference)
    assert_same_weights(runs["four"][0]["pp2cp2"]["weights"], reference["weights"], atol=1e-5)
    assert runs["four"][0]["pp2cp2"]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)


@pytest.mark.distributed
def test_ep2_by_cp2_matches_one_process(runs):
    reference = runs["one"]["mixtral"]
    for rank in runs["four"]:
        assert_parity(rank["ep2cp2"], reference)
    assert_same_weights(runs["four"][0]["ep2cp2"]["weights"], reference["weights"], atol=1e-5)
    assert runs["four"][0]["ep2cp2"]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)
    # the experts' checkpoint boxes, held by the edp × cp ranks, written and read back: stopped at 6, resumed to 10
    for rank in runs["four"]:
        assert rank["stopped"]["global_step"] == 6 and rank["resumed"]["global_step"] == 10
        assert rank["resumed"]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert_same_weights(runs["four"][0]["resumed"]["weights"], reference["weights"], atol=1e-5)


@pytest.mark.distributed
def test_the_router_loss_is_on_and_above_the_tolerance(runs):
    with_aux, without = runs["one"]["mixtral"]["losses"], runs["one"]["no_aux"]["losses"]
    assert abs(with_aux[0] - without[0]) > 1e-3 * abs(without[0])


@pytest.mark.distributed
def test_a_moe_causal_lm_under_cp_matches_one_process(runs):
    """The causal LM's loss is the token mean (its sums over cp) plus the router loss over dp × cp."""
    import torch

    reference = runs["one"]["lm"]
    assert reference["losses"][-1] < reference["losses"][0] - 0.05  # the loss moved
    for rank in runs["two"]:
        assert rank["lm"]["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
        assert rank["lm"]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5, abs=1e-6)
    weights = runs["two"][0]["lm"]["weights"]
    assert weights is not None and weights.keys() == reference["weights"].keys()
    for name, tensor in reference["weights"].items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
