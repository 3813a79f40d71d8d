"""Mixtures of experts under context parallelism (``strategy: {name: megatron, cp: 2}``), against one process.

The routers of a cp rank see its zigzag positions of every sequence only; the load-balancing loss
``L = E · Σ_e f_e · P_e`` is a product of means over the whole batch's real tokens, so each rank's per-expert sums
(top-k counts, router probabilities, real tokens) are all-reduced over dp × cp, the probabilities both ways
(``hftrain.parallel.ep_routing``), and every cp rank computes the whole ``L``. fp32, the global batch 8, 10 steps,
``router_aux_loss_coef`` 0.02 (tests/tiny.py), texts of 20-60 words cut at 64 tokens (padded: real tokens and
padding on both cp ranks, the padding excluded from ``f`` and ``P`` by this rank's positions of the mask):
- 2 processes, cp=2: Mixtral (ring), Qwen3-MoE (all-to-all), Qwen2-MoE (ring: its shared expert and dense layer);
- 1 process: the references (DDP, the whole global batch).
Every step's loss on both ranks, the evaluation and the final weights equal the reference's within 1e-5; the
router loss's share of the reference loss is far above that (checked: the reference without it differs).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import assert_parity, assert_same_weights
from tests.tiny import run_tiny_training

DATA = {"words": (20, 60), "max_seq_length": 64, "steps": 10, "return_weights": True}
CASES = {  # label -> (family, strategy options)
    "mixtral-ring": ("mixtral", {"cp": 2}),
    "qwen3_moe-all_to_all": ("qwen3_moe", {"cp": 2, "cp_comm": "all_to_all"}),
    "qwen2_moe-ring": ("qwen2_moe", {"cp": 2}),
}


def _cp2() -> dict:
    return {
        label: run_tiny_training(kind=kind, micro=8, strategy="megatron", strategy_options=options, **DATA)
        for label, (kind, options) in CASES.items()
    }


def _references() -> dict:
    runs = {kind: run_tiny_training(kind=kind, micro=8, strategy="ddp", **DATA) for kind, _ in CASES.values()}
    # the router loss is on, and it matters at this tolerance: without it the first step's loss moves
    runs["no_aux"] = run_tiny_training(
        kind="mixtral", micro=8, strategy="ddp", config_overrides={"router_aux_loss_coef": 0.0}, **DATA
    )
    return runs


@pytest.fixture(scope="module")
def runs() -> dict:
    two = run_distributed(_cp2, nprocs=2, timeout=900)
    (one,) = run_distributed(_references, nprocs=1, timeout=900)
    return {"two": two, "one": one}


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
def test_the_router_loss_is_on_and_above_the_tolerance(runs):
    with_aux, without = runs["one"]["mixtral"]["losses"], runs["one"]["no_aux"]["losses"]
    assert abs(with_aux[0] - without[0]) > 1e-3 * abs(without[0])
