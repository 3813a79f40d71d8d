"""The ``megatron`` strategy (tensor × data parallelism) through the Trainer, checkpoints and export.

Three launches carry the multi-process checks (starting processes is the slow part):
- 2 processes, tp=2: every model (BERT, GPT-2, Llama with grouped-query attention) × accumulation 1 and 2,
  plus sequence parallelism and bf16;
- 4 processes, tp=2 × dp=2: the same cases, ZeRO-1 optimizer sharding, interrupted-then-resumed, the tp=2
  checkpoint resumed at tp=1 × dp=4, and a global-batch change refused;
- 1 process: the single-process references (DDP strategy, the whole global batch) and the tp=2 checkpoint
  resumed at tp=1 on one process.
Each is compared with the single-process run within 1e-5 relative loss over 10 steps. A real ``torchrun`` job
exports a tp=2 model that plain transformers reloads with the trained logits; bad input is one line, exit 2.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from hftrain.checkpoint.sharded import read_model_tensors
from tests.conftest import torchrun
from tests.megatron_runs import (
    assert_parity,
    assert_refused_before_writing,
    assert_resumed_equals_uninterrupted,
    assert_same_weights,
    launch_on_two_four_one,
    megatron_job_args,
)
from tests.tiny import run_tiny_training, tiny_config, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("bert", "gpt2", "llama")
CASES = [(kind, gas) for kind in KINDS for gas in (1, 2)]
GLOBAL_MICRO = 8  # examples per micro-step over all data-parallel replicas
TP2 = {"tp": 2}
SP = {"tp": 2, "sequence_parallel": True}
# label -> (kind, accumulation, strategy options, training overrides), run in addition to CASES
EXTRAS_TP2 = {
    "gpt2-sp": ("gpt2", 2, SP, {}),
    "llama-sp": ("llama", 1, SP, {}),
    "bert-bf16": ("bert", 1, TP2, {"mixed_precision": "bf16"}),
}
EXTRAS_TP2_DP2 = {
    "llama-zero1": ("llama", 2, {"tp": 2, "shard_optimizer": True}, {}),
    "bert-sp": ("bert", 2, SP, {}),
}
# 96 examples, global batch 16 (micro 4 × accumulation 2 × dp 2): 6 steps per epoch; step 8 is mid-epoch 1.
RESUME = {"kind": "gpt2", "gas": 2, "steps": 12, "save_steps": 5, "return_weights": True}


def _parity_runs(micro: int, strategy: str, options: dict | None, extras: dict) -> dict:
    runs = {
        case: run_tiny_training(kind=case[0], gas=case[1], micro=micro, steps=10, strategy=strategy,
                                strategy_options=options)
        for case in CASES
    }  # fmt: skip
    for label, (kind, gas, extra_options, overrides) in extras.items():
        options_here = extra_options if strategy == "megatron" else None
        runs[label] = run_tiny_training(
            kind=kind, gas=gas, micro=micro, steps=10, strategy=strategy, strategy_options=options_here, **overrides
        )
    return runs


def _hand_written_loop(tp: int | None, shard_optimizer: bool = False) -> dict:
    """The README's own-Accelerate-loop example on a tiny GPT-2; ``tp=None`` is the plain Accelerate loop.

    Returns the micro-batch losses and this rank's optimizer-state and parameter element counts.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

    from hftrain.config import ParallelismConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies.megatron.plugin import MegatronPlugin
    from tests.tiny import reset_accelerate_state, tiny_splits

    reset_accelerate_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    set_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("gpt2"))
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    data = tokenize_splits(tiny_splits(32, 1), tokenizer, max_seq_length=32)["train"].remove_columns(["length"])
    loader = DataLoader(data, batch_size=4, collate_fn=DataCollatorWithPadding(tokenizer))
    plugin = MegatronPlugin(ParallelismConfig(tp=tp), shard_optimizer=shard_optimizer).setup() if tp else None
    if plugin is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model = plugin.prepare_model(model)
        optimizer = plugin.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        loader = plugin.prepare_data_loader(loader)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and plugin is not None:
                plugin.finalize_grads(model)
                plugin.clip_grad_norm_(model, 1.0)
            elif accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    local = getattr(optimizer.optimizer, "optim", optimizer.optimizer)  # ZeroRedundancyOptimizer's own shard
    state = sum(v.numel() for s in local.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"losses": losses, "state_numel": state, "param_numel": sum(p.numel() for p in model.parameters())}


def _two(root: str) -> dict:
    return {"parity": _parity_runs(GLOBAL_MICRO, "megatron", TP2, EXTRAS_TP2), "plugin": _hand_written_loop(2)}


def _four(root: str) -> dict:
    parity = _parity_runs(GLOBAL_MICRO // 2, "megatron", TP2, EXTRAS_TP2_DP2)
    zero1_loop = _hand_written_loop(2, shard_optimizer=True)
    common = {**RESUME, "strategy": "megatron"}
    full = run_tiny_training(output_dir=f"{root}/full", micro=4, strategy_options=TP2, **common)
    part = run_tiny_training(output_dir=f"{root}/part", micro=4, strategy_options=TP2, stop_at_step=8, **common)
    step8 = f"{root}/part/checkpoints/step_00000008"
    # tp=1 × dp=4 (micro 2 keeps the global batch at 16), from the tp=2 × dp=2 checkpoint
    resharded = run_tiny_training(
        output_dir=f"{root}/tp1dp4", micro=2, strategy_options={"tp": 1}, resume_from_checkpoint=step8,
        trust_external_checkpoint=True, **common,
    )  # fmt: skip
    resumed = run_tiny_training(
        output_dir=f"{root}/part", micro=4, strategy_options=TP2, resume_from_checkpoint="latest", **common
    )
    # ZeRO-1: the optimizer state consolidated over dp for the save, re-partitioned on load
    zero = {**common, "micro": 4, "strategy_options": {"tp": 2, "shard_optimizer": True}}
    run_tiny_training(output_dir=f"{root}/zero1", stop_at_step=8, **zero)
    zero_resumed = run_tiny_training(output_dir=f"{root}/zero1", resume_from_checkpoint="latest", **zero)
    try:  # micro 4 at tp=1 × dp=4 would double the global batch
        run_tiny_training(
            output_dir=f"{root}/refused", micro=4, strategy_options={"tp": 1}, resume_from_checkpoint=step8,
            trust_external_checkpoint=True, **common,
        )  # fmt: skip
        refused = None
    except Exception as error:
        refused = f"{type(error).__name__}: {error}"
    layout = json.loads(Path(step8, "state", "sharded.json").read_text())
    return {"parity": parity, "full": full, "part": part, "resumed": resumed, "resharded": resharded,
            "refused": refused, "layout": layout, "zero1_resumed": zero_resumed, "zero1_loop": zero1_loop}  # fmt: skip


def _one(root: str) -> dict:
    reference = _parity_runs(GLOBAL_MICRO, "ddp", None, {**EXTRAS_TP2, **EXTRAS_TP2_DP2})
    plain_loop = _hand_written_loop(None)
    # Last: the one-process megatron run starts a process group, which the DDP references above must not see.
    on_one = run_tiny_training(
        output_dir=f"{root}/tp1dp1", micro=8, strategy="megatron", strategy_options={"tp": 1},
        resume_from_checkpoint=f"{root}/part/checkpoints/step_00000008", trust_external_checkpoint=True, **RESUME,
    )  # fmt: skip
    return {"reference": reference, "tp1dp1": on_one, "plugin": plain_loop}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return launch_on_two_four_one(str(tmp_path_factory.mktemp("megatron")), _two, _four, _one, timeout=1500)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["two", "four"], ids=["tp2", "tp2xdp2"])
@pytest.mark.parametrize("case", CASES, ids=[f"{k}-gas{g}" for k, g in CASES])
def test_loss_trajectory_matches_single_process(runs, layout, case):
    ranks = runs[layout]
    ref = runs["one"]["reference"][case]
    for rank in ranks:
        assert_parity(rank["parity"][case], ref)
        assert rank["parity"][case]["losses"] == ranks[0]["parity"][case]["losses"]  # every rank logs the same
    assert ranks[0]["parity"][case]["metrics"] == pytest.approx(ref["metrics"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout,label", [("two", "gpt2-sp"), ("two", "llama-sp"), ("four", "llama-zero1"), ("four", "bert-sp")]
)
def test_sequence_parallel_and_zero1_match_single_process(runs, layout, label):
    # Sequence parallelism pads every batch to a multiple of tp (masked positions: the loss does not change).
    assert_parity(runs[layout][0]["parity"][label], runs["one"]["reference"][label])


@pytest.mark.distributed
def test_bf16_autocast_trains_close_to_fp32(runs):
    run, ref = runs["two"][0]["parity"]["bert-bf16"], runs["one"]["reference"]["bert-bf16"]
    assert all(math.isfinite(x) for x in run["losses"])
    assert run["losses"] == pytest.approx(ref["losses"], rel=2e-2)  # bf16 rounding, not a different model


@pytest.mark.distributed
def test_resumed_equals_uninterrupted_under_tp2_dp2(runs):
    assert_resumed_equals_uninterrupted(runs["four"])
    assert runs["four"][0]["layout"] == {
        "format": "hftrain-dcp-v1", "tp": 2, "cp": 1, "pp": 1, "dp": 2, "world_size": 4
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(
    "label", ["resharded", "tp1dp1", "zero1_resumed"], ids=["tp1xdp4", "tp1-one-process", "zero1-resumed"]
)
def test_tp2_checkpoint_resumes_at_tp1_equal_to_continuing_at_tp2(runs, label):
    full = runs["four"][0]["full"]
    resumed = runs["one"][label] if label == "tp1dp1" else runs["four"][0][label]
    assert resumed["global_step"] == 12
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert resumed["lrs"] == pytest.approx(full["lrs"], rel=1e-9)
    assert_same_weights(resumed["weights"], full["weights"], atol=1e-5)


@pytest.mark.distributed
def test_a_resume_that_changes_the_global_batch_is_refused(runs):
    refused = runs["four"][0]["refused"]
    assert refused is not None and "CheckpointError" in refused
    assert "tp=2 × pp=1 × dp=2" in refused and "tp=1 × pp=1 × dp=4" in refused  # both layouts named
    assert "global batch from 16 to 32" in refused


@pytest.mark.distributed
def test_plugin_in_a_hand_written_accelerate_loop_matches_plain_accelerate(runs):
    # 8 micro-batches of 4, accumulation 2, clipping: the README's loop at tp=2 against Accelerate on one process
    reference = runs["one"]["plugin"]["losses"]
    assert len(reference) == 8
    for rank in runs["two"]:
        assert rank["plugin"]["losses"] == pytest.approx(reference, rel=1e-5)


@pytest.mark.distributed
def test_zero1_shards_the_optimizer_state_over_dp(runs):
    # tp=2 × dp=2: ranks 0 and 2 (tp rank 0) hold the same parameter shards and split their Adam state
    loops = [rank["zero1_loop"] for rank in runs["four"]]
    for tp_rank in (0, 1):
        first, second = loops[tp_rank], loops[tp_rank + 2]
        assert first["param_numel"] == second["param_numel"]
        assert first["state_numel"] + second["state_numel"] == 2 * first["param_numel"]  # exp_avg, exp_avg_sq
        assert max(first["state_numel"], second["state_numel"]) < 0.75 * 2 * first["param_numel"]


# ----------------------------------------------------------------- a real job: torchrun, export, bad input
@pytest.mark.distributed
def test_tp2_job_exports_a_model_plain_transformers_reloads(tiny_job, tmp_path):
    from transformers import AutoModelForSequenceClassification

    output_dir = tmp_path / "out"
    done = torchrun(
        2, ["scripts/train.py", *megatron_job_args(tiny_job["gpt2"], tiny_job["data"], output_dir, "--tp", "2")]
    )
    log = done.stdout + done.stderr
    # the export reloaded the folder with plain transformers and compared logits with the trained tp=2 model
    diff = float(re.search(r"reloaded it: max logit difference (\S+)", log).group(1))
    assert diff <= 1e-5
    strategy = json.loads((output_dir / "hftrain_strategy.json").read_text())
    assert strategy["tp"] == 2 and strategy["dp_size"] == 1 and strategy["global_batch"] == 8
    # the export is the merged full model: every tensor equals the final checkpoint's logical full weights
    exported = AutoModelForSequenceClassification.from_pretrained(output_dir / "model")
    final = read_model_tensors(output_dir / "checkpoints" / "step_00000004" / "state")
    state = exported.state_dict()
    assert set(final) == set(state)
    for name, tensor in final.items():
        assert torch.equal(state[name], tensor), name
    # a checkpoint exports the same way, launched like its run
    exported_dir = tmp_path / "exported"
    checkpoint = output_dir / "checkpoints" / "step_00000002"
    torchrun(2, ["-m", "hftrain", "export", str(checkpoint), str(exported_dir), "--output_dir", str(output_dir)])
    reloaded = AutoModelForSequenceClassification.from_pretrained(exported_dir)
    step2 = read_model_tensors(checkpoint / "state")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in step2.items())


_LAUNCHED_3 = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "3",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def _bad_input_cases(job: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """label -> (extra arguments, environment, expected message part)."""
    return {
        "tp-not-dividing-world": (["--tp", "2"], {"WORLD_SIZE": "1"}, "does not divide the world size 1"),
        # a complete launcher environment for 3 processes: the refusal comes before any process group exists
        "tp-not-dividing-heads": (
            ["--tp", "3"],
            {**_LAUNCHED_3, "WORLD_SIZE": "3"},
            "parallelism.tp: tp=3 does not divide",
        ),
        "foreign-option": (["--offload_optimizer", "true"], {"WORLD_SIZE": "1"}, "not a megatron option"),
        # refused by the strategy that does not split the model, once the launcher is known to have started it
        "tp-with-ddp": (
            ["--tp", "2", "--strategy.name", "ddp"],
            {**_LAUNCHED_3, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            "parallelism.tp is a megatron option but strategy.name is ddp",
        ),
        # the platform refuses fp16 on CPU first; on CUDA the megatron strategy refuses it (no gradient scaler)
        "fp16": (["--mixed_precision", "fp16"], {"WORLD_SIZE": "1"}, "fp16"),
        "unsupported-family": (
            ["--model_name_or_path", job["deberta"], "--cp", "2"],
            {**_LAUNCHED_3, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            "parallelism.cp: cp_comm ring cannot split this model's attention",
        ),
        # context parallelism: before any process group, one line naming parallelism.cp or the field to change
        "cp-not-dividing-world": (["--cp", "2"], {"WORLD_SIZE": "1"}, "parallelism.cp: tp=1 × cp=2 × pp=1 does not"),
        "cp-with-sequence-parallel": (
            ["--cp", "2", "--tp", "2", "--sequence_parallel", "true"],
            {**_LAUNCHED_3, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
            "parallelism.cp: cp=2 with sequence parallelism is not supported yet",
        ),
        "cp-all-to-all-heads": (
            ["--cp", "4", "--cp_comm", "all_to_all"],
            {**_LAUNCHED_3, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
            "do not divide by cp=4",
        ),
        "cp-attention-dropout": (
            ["--cp", "2", "--model_name_or_path", job["bert_dropout"]],
            {**_LAUNCHED_3, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            "needs attention dropout 0",
        ),
    }


BAD_INPUT = ["tp-not-dividing-world", "tp-not-dividing-heads", "foreign-option", "tp-with-ddp", "fp16",
             "unsupported-family", "cp-not-dividing-world", "cp-with-sequence-parallel",
             "cp-all-to-all-heads", "cp-attention-dropout"]  # fmt: skip


@pytest.mark.parametrize("label", BAD_INPUT)
def test_bad_input_is_one_line_exit_2_nothing_written(tiny_job, tmp_path, capsys, monkeypatch, label):
    from hftrain.cli import main

    extra, env, message = _bad_input_cases(tiny_job)[label]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    output_dir = tmp_path / "out"
    code = main(["train", *megatron_job_args(tiny_job["bert"], tiny_job["data"], output_dir, *extra)])
    assert_refused_before_writing(code, capsys, message, output_dir)


# ----------------------------------------------------------------- the embedded SmolLM2
SMOLLM2 = [
    "--config", "configs/smollm2_rotten_tomatoes.yaml", "--strategy.name", "megatron", "--max_steps", "6",
    "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_train_samples", "48",
    "--max_eval_samples", "32", "--max_seq_length", "64", "--logging_steps", "1", "--log_with", "none",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
def test_smollm2_fine_tunes_with_tp3(tmp_path):
    # SmolLM2-135M has 9 query and 3 key/value heads: tp=3 gives every rank 3 query heads and 1 key/value head
    # (tp=2 is refused: it would split them 6+3 / 2+1).
    output_dir = tmp_path / "smollm2"
    done = torchrun(3, ["scripts/train.py", *SMOLLM2, "--tp", "3", "--output_dir", str(output_dir)])
    log = done.stdout + done.stderr
    state = json.loads((output_dir / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    seconds = float(re.search(r"took (\S+) s", log).group(1))
    diff = float(re.search(r"reloaded it: max logit difference (\S+)", log).group(1))
    print(f"\nSmolLM2-135M tp=3: losses {[round(x, 4) for x in losses]}; {seconds:.1f} s; export diff {diff}")
    print(*[line for line in log.splitlines() if "validation accuracy" in line], sep="\n")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # the job exits non-zero unless the reload is within 1e-5 × max(1, largest logit) (export.verify_export)
    assert math.isfinite(diff)
