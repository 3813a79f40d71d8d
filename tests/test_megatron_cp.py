"""Context parallelism (``strategy: {name: megatron, cp: 2}``) through the Trainer, against one process.

Texts of 150-300 words cut at 256 tokens, so every batch is padded and long: each of the 2·cp zigzag chunks holds
real tokens, the classified token (BERT's first, GPT-2's and Llama's last non-pad one) sits on different cp ranks
from example to example, and right padding masks keys on every rank. Three launches:
- 2 processes, cp=2: BERT (not causal) and Llama (causal, grouped-query) with ring attention, GPT-2 with all-to-all;
- 4 processes: cp=2 × tp=2 (Llama, ring) and cp=2 × dp=2 (BERT all-to-all, GPT-2 ring);
- 1 process: the references (DDP, the whole global batch).
Each equals the reference within 1e-5 relative loss over 10 steps, with the same learning rates, samples and
evaluation (25 examples once).
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.test_megatron import _assert_parity
from tests.tiny import run_tiny_training

LONG = {"words": (150, 300), "max_seq_length": 256, "steps": 10}
GLOBAL_MICRO = 8
# label -> (kind, strategy options); micro per replica = GLOBAL_MICRO / dp
TWO = {
    "bert-ring": ("bert", {"cp": 2}),
    "llama-ring": ("llama", {"cp": 2}),
    "gpt2-all_to_all": ("gpt2", {"cp": 2, "cp_comm": "all_to_all"}),
}
FOUR = {
    "llama-cp2tp2": ("llama", {"cp": 2, "tp": 2}),
    "bert-cp2dp2-all_to_all": ("bert", {"cp": 2, "cp_comm": "all_to_all"}),
    "gpt2-cp2dp2": ("gpt2", {"cp": 2}),
}


def _runs(cases: dict, world: int) -> dict:
    results = {}
    for label, (kind, options) in cases.items():
        dp = world // (options.get("cp", 1) * options.get("tp", 1))
        results[label] = run_tiny_training(
            kind=kind, micro=GLOBAL_MICRO // dp, strategy="megatron", strategy_options=options, **LONG
        )
    return results


def _references() -> dict:
    kinds = {kind for kind, _ in (*TWO.values(), *FOUR.values())}
    return {kind: run_tiny_training(kind=kind, micro=GLOBAL_MICRO, strategy="ddp", **LONG) for kind in kinds}


@pytest.fixture(scope="module")
def runs() -> dict:
    two = run_distributed(_runs, nprocs=2, timeout=900, cases=TWO, world=2)
    four = run_distributed(_runs, nprocs=4, timeout=900, cases=FOUR, world=4)
    (one,) = run_distributed(_references, nprocs=1, timeout=900)
    return {"two": two, "four": four, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("layout, label", [*(("two", label) for label in TWO), *(("four", label) for label in FOUR)])
def test_context_parallel_training_matches_single_process(runs, layout, label):
    kind = (TWO | FOUR)[label][0]
    reference = runs["one"][kind]
    for rank in runs[layout]:
        _assert_parity(rank[label], reference)
        assert rank[label]["losses"] == runs[layout][0][label]["losses"]  # every rank logs the same loss
    assert runs[layout][0][label]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)
