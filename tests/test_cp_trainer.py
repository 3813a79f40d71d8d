"""Context parallelism (``strategy: {name: megatron, cp: 2}``) through the Trainer, against one process.

Texts of 150-300 words cut at 256 tokens, so every batch is padded and long: each of the 2·cp zigzag chunks holds
real tokens, the classified token (BERT's first, GPT-2's and Llama's last non-pad one) sits on different cp ranks
from example to example, and right padding masks keys on every rank. Three launches:
- 2 processes, cp=2: BERT (not causal) and Llama (causal, grouped-query) with ring attention, GPT-2 with all-to-all;
- 4 processes: cp=2 × tp=2 (Llama, ring), cp=2 × pp=2 (Llama ring with 1F1B, BERT all-to-all with GPipe) and
  cp=2 × dp=2 (BERT all-to-all, GPT-2 ring);
- 1 process: the references (DDP, the whole global batch), and the cp=2 checkpoint resumed at cp=1.
Each equals the reference within 1e-5 relative loss over 10 steps, with the same learning rates, samples and
evaluation (25 examples once); cp=2 interrupted and resumed equals uninterrupted, on 2 processes and on one.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.megatron_runs import assert_parity
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
    "llama-cp2pp2": ("llama", {"cp": 2, "pp": 2, "num_microbatches": 2}),
    "bert-cp2pp2-all_to_all": ("bert", {"cp": 2, "pp": 2, "cp_comm": "all_to_all", "schedule": "gpipe"}),
    "bert-cp2dp2-all_to_all": ("bert", {"cp": 2, "cp_comm": "all_to_all"}),
    "gpt2-cp2dp2": ("gpt2", {"cp": 2}),
}


# 96 examples, global batch 8: 12 steps per epoch; stopped at step 8, resumed at cp=2 and (one process) at cp=1
RESUME = {"kind": "llama", "steps": 12, "save_steps": 4, "return_weights": True, "micro": GLOBAL_MICRO}
RESUME_LONG = {k: v for k, v in LONG.items() if k != "steps"}


def _resume_runs(root: str) -> dict:
    options = {"strategy": "megatron", "strategy_options": {"cp": 2}, **RESUME, **RESUME_LONG}
    full = run_tiny_training(output_dir=f"{root}/full", **options)
    part = run_tiny_training(output_dir=f"{root}/part", stop_at_step=8, **options)
    resumed = run_tiny_training(output_dir=f"{root}/part", resume_from_checkpoint="latest", **options)
    return {"full": full, "part": part, "resumed": resumed}


def _runs(cases: dict, world: int, root: str | None = None) -> dict:
    results = _resume_runs(root) if root else {}
    for label, (kind, options) in cases.items():
        dp = world // (options.get("cp", 1) * options.get("tp", 1) * options.get("pp", 1))
        results[label] = run_tiny_training(
            kind=kind, micro=GLOBAL_MICRO // dp, strategy="megatron", strategy_options=options, **LONG
        )
    return results


def _references(root: str) -> dict:
    kinds = {kind for kind, _ in (*TWO.values(), *FOUR.values())}
    runs = {kind: run_tiny_training(kind=kind, micro=GLOBAL_MICRO, strategy="ddp", **LONG) for kind in kinds}
    # Last: the one-process megatron run starts a process group, which the DDP references above must not see.
    runs["cp1"] = run_tiny_training(
        output_dir=f"{root}/cp1", strategy="megatron", strategy_options={"tp": 1},
        resume_from_checkpoint=f"{root}/part/checkpoints/step_00000008", trust_external_checkpoint=True,
        **RESUME, **RESUME_LONG,
    )  # fmt: skip
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("megatron_cp"))
    two = run_distributed(_runs, nprocs=2, timeout=900, cases=TWO, world=2, root=root)
    four = run_distributed(_runs, nprocs=4, timeout=900, cases=FOUR, world=4)
    (one,) = run_distributed(_references, nprocs=1, timeout=900, root=root)
    return {"two": two, "four": four, "one": one}


@pytest.mark.distributed
@pytest.mark.parametrize("layout, label", [*(("two", label) for label in TWO), *(("four", label) for label in FOUR)])
def test_context_parallel_training_matches_single_process(runs, layout, label):
    kind = (TWO | FOUR)[label][0]
    reference = runs["one"][kind]
    for rank in runs[layout]:
        assert_parity(rank[label], reference)
        assert rank[label]["losses"] == runs[layout][0][label]["losses"]  # every rank logs the same loss
    assert runs[layout][0][label]["metrics"] == pytest.approx(reference["metrics"], rel=1e-5)


@pytest.mark.distributed
def test_cp2_resumes_exactly_and_its_checkpoint_resumes_at_cp1(runs):
    """Checkpoints are unchanged by cp (no parameter is split): interrupted at step 8 and resumed at cp=2 equals
    uninterrupted, and the cp=2 checkpoint resumed on one process continues the same run."""
    from tests.megatron_runs import assert_resumed_equals_uninterrupted, assert_same_weights

    assert_resumed_equals_uninterrupted(runs["two"])
    full, on_one = runs["two"][0]["full"], runs["one"]["cp1"]
    assert on_one["global_step"] == 12
    assert on_one["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert_same_weights(on_one["weights"], full["weights"], atol=1e-5)


@pytest.mark.distributed
def test_cp2_job_exports_a_model_plain_transformers_reloads(tiny_job, tmp_path):
    """A real ``torchrun`` job at cp=2: trained, checkpointed and exported; the export reloads in plain
    transformers with the trained model's logits (the job compares them on every run)."""
    import json
    import re

    from tests.conftest import torchrun
    from tests.megatron_runs import megatron_job_args

    output_dir = tmp_path / "out"
    done = torchrun(
        2,
        [
            "scripts/train.py",
            *megatron_job_args(tiny_job["gpt2"], tiny_job["data"], output_dir, "--cp", "2"),
        ],
    )
    diff = float(re.search(r"reloaded it: max logit difference (\S+)", done.stdout + done.stderr).group(1))
    assert diff <= 1e-5
    strategy = json.loads((output_dir / "hftrain_strategy.json").read_text())
    assert strategy["cp"] == 2 and strategy["dp_size"] == 1 and strategy["global_batch"] == 8
