"""LoRA under pipeline parallelism (megatron ``pp > 1``) against LoRA on one process, on real gloo processes.

One 4-process launch and one 1-process launch for the references:

- tp=2 × pp=2, a Llama sequence classifier with adapters on column (q, v) and row (o, down) layers: every step's loss,
  the evaluation and the gathered weights equal one process within 1e-5; only the adapters and the head's
  ``modules_to_save`` copy move; the optimizer holds state for those alone and no frozen weight takes a gradient; a
  run stopped at step 8 and resumed equals the uninterrupted one; its export is a PEFT adapter folder that
  ``PeftModel.from_pretrained`` loads, equal to the 1-process run's export (keys, tensors, config, logits); its
  checkpoint of step 8 resumes on one process equal to continuing at tp=2 × pp=2;
- pp=2 × dp=2, a BERT sequence classifier (PEFT's default query/value adapters, gpipe) and a Llama causal LM with
  adapters (the pipeline's LM head on a PEFT model, no head to save), and a GPT-2 causal LM (tied embeddings, frozen,
  on the first and last stage) at tp=2 × pp=2, and the Llama causal LM at pp=2 × cp=2 (each chunk over its cp rank's
  positions): losses and evaluation equal one process.

No megatron axis refuses LoRA now (``tests/test_lora_cp_ep.py`` for cp and ep alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.megatron_runs import assert_resumed_equals_uninterrupted, assert_same_weights
from tests.tiny import WORDS, reset_accelerate_state, run_tiny_training, tiny_config, tiny_tokenizer

LAYERS = 4
LLAMA_LORA = {"lora_r": 4, "lora_target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}
BERT_LORA = {"lora_r": 4}  # PEFT's default targets: query, value
TP2_PP2 = {"tp": 2, "pp": 2, "num_microbatches": 4, "schedule": "1f1b"}
PP2_DP2 = {"pp": 2, "num_microbatches": 2, "schedule": "gpipe"}
PP2_CP2 = {"pp": 2, "cp": 2, "num_microbatches": 2}
# 96 examples, batch 8: 12 steps per epoch; the run stopped at step 8 resumes from its checkpoint of step 8
CLASSIFIER = {
    "kind": "llama",
    "micro": 8,
    "steps": 12,
    "save_steps": 4,
    "num_layers": LAYERS,
    "lora_options": LLAMA_LORA,
}


# ----------------------------------------------------------------- what each run reports besides its losses
def _export(trainer, directory: str, *, megatron: bool = True) -> dict:
    """Export the trained model (collective) with its reload check; what the optimizer and gradients held."""
    from hftrain.checkpoint.export import export_pretrained

    result = export_pretrained(
        trainer.runtime, trainer.model, trainer.tokenizer, directory, verify_inputs=_verification(trainer.tokenizer)
    )
    return {"is_adapter": result.is_adapter, "logit_diff": result.max_logit_diff,
            **(_trained_parameters(trainer) if megatron else {})}  # fmt: skip


def _verification(tokenizer) -> dict:
    from hftrain.checkpoint.export import verification_batch
    from hftrain.data.batching import tokenize_splits
    from tests.tiny import tiny_splits

    return verification_batch(tokenize_splits(tiny_splits(), tokenizer, max_seq_length=32)["validation"], tokenizer)


def _trained_parameters(trainer) -> dict:
    """The names this rank's optimizer holds state for, and the frozen parameters that hold a gradient."""
    runtime = trainer.runtime
    names = {id(p): n for n, p in runtime._params.items()}
    optimizer = runtime._optimizer
    return {
        "optimized": sorted(names[id(p)] for p in optimizer.state),
        "trainable": sorted(n for n, p in runtime._params.items() if p.requires_grad),
        "frozen_with_grad": sorted(n for n, p in runtime._params.items() if not p.requires_grad and p.grad is not None),
        "frozen": sum(not p.requires_grad for p in runtime._params.values()),
    }


# ----------------------------------------------------------------- a causal LM with adapters
BLOCK = 32


def _lm_splits():
    """Each document counts up through ``WORDS`` from a random start, 2 to 14 words."""
    import random

    from datasets import Dataset, DatasetDict

    rng = random.Random(0)
    docs = []
    for _ in range(80):
        start, length = rng.randrange(len(WORDS)), rng.randint(2, 14)
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)))
    return DatasetDict(train=Dataset.from_dict({"text": docs[:64]}), validation=Dataset.from_dict({"text": docs[64:]}))


def _run_lm(*, kind: str = "llama", micro: int, strategy: str = "ddp", options: dict | None = None) -> dict:
    """A tiny causal LM with PEFT's default adapters (Llama: q/v; GPT-2: ``c_attn``, its embeddings tied) under
    PEFT's CAUSAL_LM task (no head saved), 5 steps."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.config import LoraConfig, TrainingConfig
    from hftrain.data.language import pack_splits
    from hftrain.models.lora import apply_lora
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.language import CausalLMTrainer
    from tests.tiny import _fresh_output_dir

    def model_init():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(tiny_config(kind, num_layers=LAYERS, max_positions=2 * BLOCK))
        return apply_lora(model, LoraConfig(use_lora=True, lora_r=4), task="causal_lm")

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    packed = pack_splits(_lm_splits(), tokenizer, block_size=BLOCK, log=lambda _: None)
    args = TrainingConfig(
        output_dir=_fresh_output_dir(), per_device_train_batch_size=micro, per_device_eval_batch_size=3, max_steps=5,
        learning_rate=3e-3, warmup_steps=1, logging_steps=1, log_with="none", mixed_precision="no",
        train_sampling_strategy="random",
    )  # fmt: skip
    trainer = CausalLMTrainer(
        args,
        strategy=strategy_from_options(strategy, options, launch=launch_info_from_environ()),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=packed["train"],
        eval_dataset=packed["validation"],
    )
    result = trainer.fit()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "metrics": result.metrics,
        **(_trained_parameters(trainer) if strategy == "megatron" else {}),
    }


# ----------------------------------------------------------------- the launches
def _four(root: str) -> dict:
    common = {**CLASSIFIER, "strategy": "megatron", "strategy_options": TP2_PP2, "return_weights": True}
    full = run_tiny_training(output_dir=f"{root}/full", inspect=lambda t: _export(t, f"{root}/full/model"), **common)
    part = run_tiny_training(output_dir=f"{root}/part", stop_at_step=8, **common)
    resumed = run_tiny_training(output_dir=f"{root}/part", resume_from_checkpoint="latest", **common)
    bert = run_tiny_training(kind="bert", micro=4, steps=10, num_layers=LAYERS, lora_options=BERT_LORA,
                             strategy="megatron", strategy_options=PP2_DP2, inspect=_trained_parameters)  # fmt: skip
    lm = _run_lm(micro=4, strategy="megatron", options=PP2_DP2)
    # tied input/output embeddings, frozen: the first and last stage's copies take no gradient to sum
    tied = _run_lm(kind="gpt2", micro=8, strategy="megatron", options=TP2_PP2)
    # pp × cp: each chunk attends over its cp rank's positions of the packed blocks, the adapters in every stage
    lm_cp = _run_lm(micro=8, strategy="megatron", options=PP2_CP2)
    return {"full": full, "part": part, "resumed": resumed, "bert": bert, "lm": lm, "lm_tied": tied, "lm_cp": lm_cp}


def _one(root: str) -> dict:
    export = lambda t: _export(t, f"{root}/one/model", megatron=False)  # noqa: E731
    llama = run_tiny_training(output_dir=f"{root}/one", inspect=export, return_weights=True, **CLASSIFIER)
    bert = run_tiny_training(kind="bert", micro=8, steps=10, num_layers=LAYERS, lora_options=BERT_LORA)
    lm, tied = _run_lm(micro=8), _run_lm(kind="gpt2", micro=8)
    # Last: the one-process megatron run starts a process group, which the DDP references above must not see.
    at_one = run_tiny_training(
        output_dir=f"{root}/at_one", strategy="megatron", strategy_options={"tp": 1}, return_weights=True,
        resume_from_checkpoint=f"{root}/part/checkpoints/step_00000008", trust_external_checkpoint=True, **CLASSIFIER,
    )  # fmt: skip
    return {"llama": llama, "bert": bert, "lm": lm, "lm_tied": tied, "lm_cp": lm, "at_one": at_one}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("pp_lora"))
    four = run_distributed(_four, nprocs=4, timeout=900, root=root)
    (one,) = run_distributed(_one, nprocs=1, timeout=600, root=root)
    return {"four": four, "one": one, "root": root}


def _assert_equal_runs(run: dict, ref: dict, steps: int) -> None:
    assert len(run["losses"]) == len(ref["losses"]) == steps
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-3)  # the loss moved


# ----------------------------------------------------------------- tp=2 × pp=2: parity, optimizer, resume, export
@pytest.mark.distributed
def test_lora_at_tp2_pp2_matches_lora_on_one_process(runs):
    ref = runs["one"]["llama"]
    for rank in runs["four"]:  # the last stage's loss reached every rank
        _assert_equal_runs(rank["full"], ref, 12)
        assert rank["full"]["metrics"]["eval_samples"] == 25
    weights = runs["four"][0]["full"]["weights"]  # the adapters merged over tp and over the stages, PEFT's names
    assert_same_weights(weights, ref["weights"], atol=1e-5)
    initial = _initial_weights()
    moved = {name for name, tensor in weights.items() if not torch.equal(tensor, initial[name])}
    assert moved and all(".lora_" in n or ".modules_to_save." in n for n in moved), sorted(moved)
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)
    assert any(".score.modules_to_save." in n for n in moved)


@pytest.mark.distributed
def test_only_adapters_and_the_head_have_optimizer_state_and_gradients(runs):
    for run in [rank["full"]["inspected"] for rank in runs["four"]] + [rank["lm"] for rank in runs["four"]]:
        assert run["optimized"] == run["trainable"] and run["trainable"], run["optimized"]
        assert all(".lora_" in n or ".modules_to_save." in n for n in run["trainable"]), run["trainable"]
        assert run["frozen"] > len(run["trainable"]) and run["frozen_with_grad"] == []
    # each stage holds its own layers' adapters, and the last one the head's trainable copy (its tp=2 ranks)
    for rank in runs["four"]:
        trainable = rank["full"]["inspected"]["trainable"]
        last = any(".score." in n for n in trainable)
        assert any(".layers.3." in n for n in trainable) == last and any(".layers.0." in n for n in trainable) != last
    assert sum(any(".score." in n for n in rank["full"]["inspected"]["trainable"]) for rank in runs["four"]) == 2


@pytest.mark.distributed
def test_lora_at_tp2_pp2_resumed_equals_uninterrupted(runs):
    assert_resumed_equals_uninterrupted(runs["four"])


@pytest.mark.distributed
def test_lora_tp2_pp2_checkpoint_resumes_on_one_process(runs):
    """The tp=2 × pp=2 checkpoint of step 8 (adapters under PEFT's names, merged from the shards and stages) resumes on
    one process (tp = pp = 1) equal to continuing at tp=2 × pp=2."""
    full, at_one = runs["four"][0]["full"], runs["one"]["at_one"]
    assert at_one["global_step"] == 12
    assert at_one["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert_same_weights(at_one["weights"], full["weights"], atol=1e-5)


@pytest.mark.distributed
def test_lora_export_at_tp2_pp2_is_the_one_process_peft_adapter(runs):
    from peft import PeftModel
    from safetensors.torch import load_file

    for rank in runs["four"]:
        assert rank["full"]["inspected"]["is_adapter"] and rank["full"]["inspected"]["logit_diff"] <= 1e-5
    pp, one = Path(runs["root"], "full", "model"), Path(runs["root"], "one", "model")
    assert _adapter_config(pp) == _adapter_config(one)
    adapter, reference = load_file(pp / "adapter_model.safetensors"), load_file(one / "adapter_model.safetensors")
    assert adapter.keys() == reference.keys()
    assert any(k.endswith("score.weight") for k in adapter)  # the head, saved in full (modules_to_save)
    assert sum(".lora_B." in k for k in adapter) == 4 * LAYERS  # q, v, o, down in every layer, not one stage's
    for key, tensor in reference.items():
        torch.testing.assert_close(adapter[key], tensor, rtol=0, atol=1e-5, msg=key)
    batch = _verification(_tokenizer())
    logits = {}
    for name, folder in (("pp", pp), ("one", one)):
        model = PeftModel.from_pretrained(_base_model(), folder).eval()
        with torch.no_grad():
            logits[name] = model(**batch).logits
    torch.testing.assert_close(logits["pp"], logits["one"], rtol=0, atol=1e-5)
    with torch.no_grad():
        assert (logits["one"] - _base_model().eval()(**batch).logits).abs().max() > 1e-4  # the adapter matters


# ----------------------------------------------------------------- pp=2 × dp=2: BERT, a causal LM
@pytest.mark.distributed
def test_lora_bert_at_pp2_dp2_matches_lora_on_one_process(runs):
    for rank in runs["four"]:
        _assert_equal_runs(rank["bert"], runs["one"]["bert"], 10)
        inspected = rank["bert"]["inspected"]
        assert inspected["optimized"] == inspected["trainable"] and inspected["frozen_with_grad"] == []


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case", ["lm", "lm_tied", "lm_cp"], ids=["llama-pp2-dp2", "gpt2-tied-tp2-pp2", "llama-pp2-cp2"]
)
def test_lora_causal_lm_under_pp_matches_lora_on_one_process(runs, case):
    for rank in runs["four"]:
        _assert_equal_runs(rank[case], runs["one"][case], 5)
        assert all(".lora_" in n for n in rank[case]["trainable"])  # CAUSAL_LM: no head trained
        assert rank[case]["optimized"] == rank[case]["trainable"] and rank[case]["frozen_with_grad"] == []


# ----------------------------------------------------------------- helpers
def _adapter_config(folder: Path) -> dict:
    """``adapter_config.json``, its target modules as a set (PEFT writes a set, in no fixed order)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}


def _tokenizer():
    tokenizer = tiny_tokenizer("llama")
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _base_model() -> torch.nn.Module:
    """The frozen base the runs started from (built right after the trainer's seed)."""
    from transformers import AutoModelForSequenceClassification, set_seed

    set_seed(42)
    return AutoModelForSequenceClassification.from_config(tiny_config("llama", num_layers=LAYERS, max_positions=64))


def _initial_weights() -> dict[str, torch.Tensor]:
    from transformers import set_seed

    from tests.tiny import tiny_model_init

    set_seed(42)
    model = tiny_model_init("llama", lora_options=LLAMA_LORA, num_layers=LAYERS, max_positions=64)()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------- the planner offers what trains
def test_lora_plan_rows_are_runnable_exactly_when_the_trainer_takes_them(tmp_path):
    """A LoRA row (``--lora-rank``) is runnable exactly when the megatron strategy's model check with
    ``use_lora=True`` accepts its layout: every axis takes LoRA now (cp and pp × cp too), so every row is."""
    from hftrain.errors import ConfigError
    from hftrain.plan import Hardware, Workload, model_from_config, model_parallel
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    config = tiny_config("llama", num_layers=LAYERS)
    config.save_pretrained(tmp_path / "llama")
    model = model_from_config(str(tmp_path / "llama"))
    for tp, pp, cp in ((2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 2, 2)):
        row = model_parallel.estimate(tp, pp, model, Workload(lora_rank=4, dropout=False), Hardware(), cp=cp)
        options = {"tp": tp, "pp": pp, "cp": cp, **({"num_microbatches": 2} if pp > 1 else {})}
        launch = LaunchInfo(world_size=tp * pp * cp, local_world_size=tp * pp * cp)
        strategy = strategy_from_options("megatron", options, launch=launch, platform=Platform("cpu", "gloo"))
        try:
            strategy.check_model(config, use_lora=True)
            accepted = True
        except ConfigError:
            accepted = False
        assert row.runnable == accepted is True, (tp, pp, cp, row.notes)
        full = model_parallel.estimate(tp, pp, model, Workload(dropout=False), Hardware(), cp=cp)
        assert full.runnable  # the same layout without LoRA trains
