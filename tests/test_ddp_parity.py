"""DDP on 2 gloo processes x micro-batch b equals 1 process x 2b (same seed, same global batch)."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

pytestmark = pytest.mark.distributed

CASES = [  # (kind, gradient_accumulation_steps)
    ("bert", 1),
    ("bert", 2),
    ("gpt2", 2),
]


def _runs(micro: int) -> dict:
    return {(kind, gas): run_tiny_training(kind=kind, micro=micro, gas=gas, steps=10) for kind, gas in CASES}


@pytest.fixture(scope="module")
def reference() -> dict:
    (runs,) = run_distributed(_runs, nprocs=1, micro=8)
    return runs


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    return run_distributed(_runs, nprocs=2, micro=4)


@pytest.mark.parametrize("case", CASES, ids=[f"{k}-gas{g}" for k, g in CASES])
def test_loss_trajectory_matches_single_process(reference, ddp, case):
    ref, rank0, rank1 = reference[case], ddp[0][case], ddp[1][case]
    assert rank0["distributed_type"] == "DistributedType.MULTI_CPU" and rank0["num_processes"] == 2
    assert len(ref["losses"]) == len(rank0["losses"]) == 10
    assert rank0["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert rank1["losses"] == rank0["losses"]  # every rank logs the process-averaged loss
    assert rank0["lrs"] == pytest.approx(ref["lrs"], rel=1e-9)
    # the loss moved: a run without gradient sync or without steps could not match this
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)


def test_both_ranks_see_the_global_batch(reference, ddp):
    case = ("bert", 2)
    assert ddp[0][case]["samples_seen"] == reference[case]["samples_seen"] == 10 * 2 * 8


def test_eval_counts_every_example_once(reference, ddp):
    # 25 validation examples over 2 processes with batch 5: Accelerate pads the last batch with duplicates
    for runs in (reference, ddp[0], ddp[1]):
        metrics = runs[("bert", 1)]["metrics"]
        assert metrics["eval_samples"] == 25
    assert ddp[0][("bert", 1)]["metrics"]["eval_accuracy"] == pytest.approx(
        reference[("bert", 1)]["metrics"]["eval_accuracy"]
    )


def test_cores_are_divided_among_local_processes(ddp):
    assert ddp[0][("bert", 1)]["threads"] == max(1, __import__("os").cpu_count() // 2)
