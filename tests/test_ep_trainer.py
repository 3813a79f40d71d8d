"""Expert parallelism through the Trainer: ep=2, ep2×dp2 and ep2×tp2 against one process (real gloo processes, fp32).

Two MoE families (Mixtral; Qwen2-MoE with a shared expert and a dense layer), dropless, 10 steps, the global batch
8 everywhere; every loss includes the routers' load-balancing loss (``router_aux_loss_coef`` 0.02), which the
Trainer computes over the global batch (under pipeline parallelism, pp2 and tp2×pp2, per micro-batch: against one
process accumulating 2 micro-batches). Each rank holds ``1/ep`` of the experts; an ep=2 run stopped at step 8 and
resumed equals the run of 12 steps in one go, and the same checkpoint resumes at ep=1 in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.megatron_runs import assert_parity, assert_same_weights, launch_on_two_four_one
from tests.tiny import run_tiny_training

KINDS = ("mixtral", "qwen2_moe")
EXPERTS = 4
# 96 examples, global batch 8: 12 steps per epoch; a checkpoint every 4 steps, the run stopped at 8 of 12
RESUME = {"kind": "mixtral", "steps": 12, "save_steps": 4, "return_weights": True, "strategy": "megatron"}


def _held_experts(trainer) -> dict:
    """This rank's expert parameters (elements, and experts per MoE block) and the logged load figures."""
    from hftrain.parallel.expert_parallel import ExpertParallelExperts

    blocks = [m for m in trainer.model.modules() if isinstance(m, ExpertParallelExperts)]
    held = sum(p.numel() for m in blocks for p in m.parameters())
    loads = [h["expert_load_max"] for h in trainer.state.log_history if "expert_load_max" in h]
    return {"blocks": len(blocks), "local_experts": [m.local_experts for m in blocks], "numel": held, "loads": loads}


def _parity(kind: str, micro: int, options: dict | None, strategy: str = "megatron", **overrides) -> dict:
    return run_tiny_training(
        kind=kind, micro=micro, steps=10, strategy=strategy, strategy_options=options, return_weights=True,
        inspect=_held_experts, **overrides,
    )  # fmt: skip


CLIPPED = {"max_grad_norm": 0.05}  # below every step's gradient norm: each step is clipped, by the global norm


def _two(root: str) -> dict:
    parity = {kind: _parity(kind, 4, {"ep": 2}) for kind in KINDS}
    parity["clipped"] = _parity("mixtral", 4, {"ep": 2}, **CLIPPED)
    parity["gas2"] = _parity("qwen2_moe", 2, {"ep": 2}, gas=2)  # expert gradients accumulated over 2 micro-steps
    # pipeline: the router loss's sums cross the stages (Qwen2-MoE's second stage has only its dense layer)
    parity["pp2"] = _parity("qwen2_moe", 8, {"pp": 2, "num_microbatches": 2})
    full = run_tiny_training(output_dir=f"{root}/full", micro=4, strategy_options={"ep": 2}, **RESUME)
    part = run_tiny_training(output_dir=f"{root}/part", micro=4, strategy_options={"ep": 2}, stop_at_step=8, **RESUME)
    resumed = run_tiny_training(
        output_dir=f"{root}/part", micro=4, strategy_options={"ep": 2}, resume_from_checkpoint="latest", **RESUME
    )
    capped = run_tiny_training(
        kind="mixtral", micro=4, steps=3, strategy="megatron", strategy_options={"ep": 2, "moe_capacity_factor": 0.5},
        inspect=lambda t: [h.get("dropped_token_assignments", 0) for h in t.state.log_history if "loss" in h],
    )  # fmt: skip
    picture = Path(root, "full", "expert_load.png")  # drawn by the main process at each checkpoint and at the end
    png = picture.read_bytes()[:8] if picture.is_file() else None
    return {"parity": parity, "full": full, "part": part, "resumed": resumed, "capped": capped, "png": png}


def _four(root: str) -> dict:
    runs = {
        kind: {"ep2xdp2": _parity(kind, 2, {"ep": 2}), "ep2xtp2": _parity(kind, 4, {"ep": 2, "tp": 2})}
        for kind in KINDS
    }
    runs["mixtral"]["tp2xpp2"] = _parity("mixtral", 8, {"tp": 2, "pp": 2, "num_microbatches": 2})
    return runs


def _one(root: str) -> dict:
    reference = {kind: _parity(kind, 8, None, strategy="ddp") for kind in KINDS}
    reference["clipped"] = _parity("mixtral", 8, None, strategy="ddp", **CLIPPED)
    reference["gas2"] = _parity("qwen2_moe", 4, None, strategy="ddp", gas=2)
    reference["mixtral_gas2"] = _parity("mixtral", 4, None, strategy="ddp", gas=2)
    # Last: the one-process megatron run starts a process group, which the DDP references above must not see.
    at_ep1 = run_tiny_training(
        output_dir=f"{root}/ep1", micro=8, strategy_options={"ep": 1},
        resume_from_checkpoint=f"{root}/part/checkpoints/step_00000008", trust_external_checkpoint=True, **RESUME,
    )  # fmt: skip
    # the load-balancing loss is in every logged loss: without it (coefficient 0) the first step's loss is lower
    no_aux = run_tiny_training(kind="mixtral", micro=8, steps=1, config_overrides={"router_aux_loss_coef": 0.0})
    return {"reference": reference, "ep1": at_ep1, "no_aux": no_aux}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return launch_on_two_four_one(str(tmp_path_factory.mktemp("ep")), _two, _four, _one)


def _check(run: dict, ref: dict, ep: int) -> None:
    assert_parity(run, ref)
    if run["weights"] is not None:  # the main process: the full weights, experts gathered over ep
        assert_same_weights(run["weights"], ref["weights"], atol=1e-5)
    held = run["inspected"]
    assert held["local_experts"] == [EXPERTS // ep] * held["blocks"] and held["blocks"] >= 1
    assert len(held["loads"]) == 10 and all(load >= 1.0 for load in held["loads"])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_ep2_equals_one_process(runs, kind):
    ref = runs["one"]["reference"][kind]
    for rank in runs["two"]:
        _check(rank["parity"][kind], ref, ep=2)
    # the load figures are summed over the ranks: every rank logs the same, and so does the 1-process run
    assert runs["two"][0]["parity"][kind]["inspected"]["loads"] == pytest.approx(ref["inspected"]["loads"])


@pytest.mark.distributed
def test_ep2_with_gradient_accumulation_equals_one_process(runs):
    # micro 2 × accumulation 2 × dp 2 against micro 4 × accumulation 2: the load-balancing loss per micro-batch
    for rank in runs["two"]:
        _check(rank["parity"]["gas2"], runs["one"]["reference"]["gas2"], ep=2)


@pytest.mark.distributed
@pytest.mark.parametrize(("launch", "kind", "layout", "reference"), [
    ("two", "qwen2_moe", "pp2", "gas2"), ("four", "mixtral", "tp2xpp2", "mixtral_gas2"),
])  # fmt: skip
def test_pipeline_stages_share_the_router_loss_as_accumulated_micro_batches(runs, launch, kind, layout, reference):
    # pp2 with 2 micro-batches against micro 4 × accumulation 2: the router loss per micro-batch, its sums over
    # both stages' layers; the expert load figures summed over the stages equal the 1-process ones
    ref = runs["one"]["reference"][reference]
    for rank in runs[launch]:
        run = rank["parity"]["pp2"] if launch == "two" else rank[kind][layout]
        assert_parity(run, ref)
        if run["weights"] is not None:
            assert_same_weights(run["weights"], ref["weights"], atol=1e-5)
        assert run["inspected"]["loads"] == pytest.approx(ref["inspected"]["loads"])
        assert len(run["inspected"]["loads"]) == 10


@pytest.mark.distributed
def test_clipping_counts_each_expert_once(runs):
    # every step clipped: a norm counting an expert twice, or missing the other rank's, would scale it differently
    for rank in runs["two"]:
        _check(rank["parity"]["clipped"], runs["one"]["reference"]["clipped"], ep=2)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ep2xdp2", "ep2xtp2"])
@pytest.mark.parametrize("kind", KINDS)
def test_ep2_with_dp2_or_tp2_equals_one_process(runs, kind, layout):
    for rank in runs["four"]:
        _check(rank[kind][layout], runs["one"]["reference"][kind], ep=2)


@pytest.mark.distributed
def test_the_loss_includes_the_routers_load_balancing_loss(runs):
    with_aux, without = runs["one"]["reference"]["mixtral"]["losses"][0], runs["one"]["no_aux"]["losses"][0]
    # 0.02 × E·Σ f_i·P_i, which is k = 2 for a perfectly balanced router and more otherwise
    assert 0.02 * 1.5 < with_aux - without < 0.02 * 4


@pytest.mark.distributed
def test_the_expert_load_is_drawn(runs):
    assert runs["two"][0]["png"] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.distributed
def test_a_capacity_factor_logs_the_dropped_assignments(runs):
    # 4 examples of up to 33 positions per rank, top-2 of 4 experts, a cap of half the even share: many dropped
    for rank in runs["two"]:
        dropped = rank["capped"]["inspected"]
        assert len(dropped) == 3 and all(count > 0 for count in dropped)
        assert dropped == runs["two"][0]["capped"]["inspected"]  # summed over the ranks: the same on each


@pytest.mark.distributed
def test_each_rank_holds_half_the_experts(runs):
    ref = runs["one"]["reference"]["mixtral"]["weights"]
    every_expert = sum(v.numel() for k, v in ref.items() if ".experts." in k)
    for rank in runs["two"]:
        assert rank["parity"]["mixtral"]["inspected"]["numel"] * 2 == every_expert


@pytest.mark.distributed
def test_resume_at_ep2_equals_uninterrupted_and_the_checkpoint_resumes_at_ep1(runs):
    for rank in runs["two"]:
        full, part, resumed = rank["full"], rank["part"], rank["resumed"]
        assert part["preempted"] == "stop_at_step" and part["global_step"] == 8
        assert resumed["losses"] == full["losses"] and resumed["lrs"] == full["lrs"]
    main = runs["two"][0]
    assert_same_weights(main["resumed"]["weights"], main["full"]["weights"], atol=1e-6)
    at_ep1 = runs["one"]["ep1"]  # steps 9-12 in one process, from the ep=2 checkpoint of step 8
    assert at_ep1["losses"][-4:] == pytest.approx(main["full"]["losses"][-4:], rel=1e-5)
    assert_same_weights(at_ep1["weights"], main["full"]["weights"], atol=1e-5)


# ----------------------------------------------------------------- bad input: one line, exit 2, nothing written
_LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _launched(world: int) -> dict[str, str]:
    return {**_LAUNCHED, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}


BAD_INPUT = {  # label -> (model, extra arguments, launcher environment, what the one line says)
    "ep-not-dividing-dp": ("mixtral", ["--ep", "2"], _launched(1), "parallelism.ep: ep=2 does not divide the"),
    "ep-not-dividing-experts": ("mixtral", ["--ep", "3"], _launched(3), "ep=3 does not divide the 4 experts"),
    "ep-on-dense-model": ("bert", ["--ep", "2"], _launched(2), "parallelism.ep: the model (bert) is not a"),
    "capacity-not-positive": (
        "mixtral", ["--parallelism.moe_capacity_factor", "0"], _launched(1), "moe_capacity_factor must be a number > 0"
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config, tiny_tokenizer

    path = tmp_path_factory.mktemp("mixtral") / "model"
    AutoModelForSequenceClassification.from_config(tiny_config("mixtral")).save_pretrained(path)
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("label", list(BAD_INPUT))
def test_bad_expert_parallel_input_is_one_line_exit_2_nothing_written(
    tiny_job, moe_folder, tmp_path, capsys, monkeypatch, label
):
    from hftrain.cli import main
    from tests.megatron_runs import assert_refused_before_writing, megatron_job_args

    model, extra, env, message = BAD_INPUT[label]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    output_dir = tmp_path / "out"
    folder = moe_folder if model == "mixtral" else tiny_job["bert"]
    code = main(["train", *megatron_job_args(folder, tiny_job["data"], output_dir, *extra)])
    assert_refused_before_writing(code, capsys, message, output_dir)


@pytest.mark.distributed
def test_the_ep2_export_loads_in_plain_transformers_and_equals_one_process(tiny_job, moe_folder, tmp_path):
    import sys

    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import assert_same_exports, run_ok, torchrun
    from tests.megatron_runs import megatron_job_args

    ep2 = torchrun(2, ["-m", "hftrain", "train", *megatron_job_args(moe_folder, tiny_job["data"], tmp_path / "ep2",
                                                                    "--parallelism.ep", "2")])  # fmt: skip
    one_args = megatron_job_args(moe_folder, tiny_job["data"], tmp_path / "one", "--per_device_train_batch_size", "8")
    run_ok([sys.executable, "-m", "hftrain", "train", *one_args])
    # the export, reloaded in plain transformers on rank 0, gives the trained (expert-parallel) model's logits
    assert "reloaded it: max logit difference 0.00e+00" in ep2.stdout + ep2.stderr
    # Against one process (1 vs 2 threads per matmul, other summation orders): 4 Adam steps at lr 1e-3 turn
    # 1e-7 gradient differences of near-zero gradients into up to ~2e-5 of the weights
    assert_same_exports(tmp_path / "ep2", tmp_path / "one", atol=1e-4)
    models = [AutoModelForSequenceClassification.from_pretrained(tmp_path / run / "model") for run in ("ep2", "one")]
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for model in models]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_frees_half_the_expert_state_from_each_ranks_resident_memory():
    """Resident memory, not a parameter count: ``benchmarks/moe.py``'s Mixtral (50 M expert parameters of 55 M) trained
    2 steps with AdamW at ep=1 and ep=2 on 2 processes; each rank's RSS after the first step must fall by at least
    80% of half the experts' weights, gradients and two Adam moments (16 bytes per parameter)."""
    from benchmarks.moe import _train
    from tests.distributed import run_distributed

    runs = {ep: run_distributed(_train, nprocs=2, timeout=900, ep=ep, steps=2) for ep in (1, 2)}
    for one, two in zip(runs[1], runs[2], strict=True):
        assert two["moe_params"] * 2 == one["moe_params"]
        freed_mib = one["rss_mib"] - two["rss_mib"]
        assert freed_mib >= 0.8 * two["moe_params"] * 16 / 2**20, (one["rss_mib"], two["rss_mib"])
