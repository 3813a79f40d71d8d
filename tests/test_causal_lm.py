"""Causal language modelling (``model.task: causal_lm``): the same trainer under every data-parallel strategy.

Three launches: one process for the references, two for DDP, ZeRO-3, FSDP2 and megatron's tp, cp and ep (micro-batches
of the reference's global batch split over the replicas), four for megatron's pipelines (pp2 × dp2, tp2 × pp2) and
tp2 × cp2. Each equals its 1-process run within 1e-5 (fp32): the loss of every step (the mean over the global batch's
target tokens, however unevenly they fall on micro-batches and processes) and the final evaluation (loss and
perplexity). Llama
(untied, grouped-query) trains on plain text; GPT-2 (tied input/output embeddings) on prompt/response pairs with
gradient accumulation, where the loss is on the responses only: the first step's loss is recomputed by hand from the
initial model, with the prompts' positions left out and one mean over the global batch.
Then ``hftrain train`` end to end: a model folder and a JSONL of prompt/response pairs, exported as a
``*ForCausalLM`` folder (full, and a PEFT ``CAUSAL_LM`` adapter) that plain transformers reloads and ``generate()``s
from, with a held-out perplexity below the base model's; and a pp=2 job (tied GPT-2) that checkpoints, resumes at one
process and exports.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import WORDS, reset_accelerate_state, tiny_config, tiny_tokenizer

BLOCK = 32
STEPS = 5


def lm_splits(n_train: int = 80, n_eval: int = 20, *, prompt_response: bool = False, seed: int = 0):
    """Learnable text: each document counts up through ``WORDS`` from a random start (a prompt/response pair: the
    first words, then the rest), 2 to 14 words long, so the blocks hold uneven numbers of targets."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(seed)

    def document() -> list[str]:
        start, length = rng.randrange(len(WORDS)), rng.randint(2, 14)
        return [WORDS[(start + i) % len(WORDS)] for i in range(length)]

    docs = [document() for _ in range(n_train + n_eval)]
    if prompt_response:
        cut = [max(1, len(d) // 2) for d in docs]
        rows = {"prompt": [" ".join(d[:c]) for d, c in zip(docs, cut, strict=True)],
                "response": [" ".join(d[c:]) for d, c in zip(docs, cut, strict=True)]}  # fmt: skip
    else:
        rows = {"text": [" ".join(d) for d in docs]}
    return DatasetDict(
        train=Dataset.from_dict({k: v[:n_train] for k, v in rows.items()}),
        validation=Dataset.from_dict({k: v[n_train:] for k, v in rows.items()}),
    )


def lm_model_init(kind: str):
    def build():
        from transformers import AutoModelForCausalLM

        config = tiny_config(kind, max_positions=BLOCK * 2)
        return AutoModelForCausalLM.from_config(config)

    return build


LOSS_CHUNK = 7
"""Positions per chunk of the loss (``training.loss_chunk_tokens``): several chunks per micro-batch, the last one short,
in every run here; the first step's loss is checked against the whole logits' by hand."""


def run_lm(*, kind: str, strategy: str = "ddp", micro: int, gas: int = 1, prompt_response: bool = False,
           first_batch: bool = False, strategy_options: dict | None = None, weights: bool = False,
           stop_at_step: int | None = None, output_dir: str | None = None, resume: bool = False,
           loss_chunk_tokens: int | None = LOSS_CHUNK) -> dict:  # fmt: skip
    """Train a tiny causal LM in this process group; losses, final metrics and (``first_batch``) the first global
    batch's blocks and the initial model's loss on them computed by hand."""
    import torch

    from hftrain.cli import launch_info_from_environ
    from hftrain.config import TrainingConfig
    from hftrain.data.language import pack_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.language import CausalLMTrainer
    from tests.tiny import _fresh_output_dir

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    packed = pack_splits(lm_splits(prompt_response=prompt_response), tokenizer, block_size=BLOCK, log=lambda _: None)
    args = TrainingConfig(
        output_dir=output_dir or _fresh_output_dir(),
        resume_from_checkpoint="latest" if resume else None,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=gas,
        max_steps=STEPS,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        log_with="none",
        mixed_precision="no",
        train_sampling_strategy="random",
        loss_chunk_tokens=loss_chunk_tokens,
    )
    trainer = CausalLMTrainer(
        args,
        strategy=strategy_from_options(strategy, strategy_options, launch=launch_info_from_environ()),  # fmt: skip
        model_init=lm_model_init(kind),
        tokenizer=tokenizer,
        train_dataset=packed["train"],
        eval_dataset=packed["validation"],
    )
    expected_first = None
    if first_batch:  # the initial model (same seed) on the first global batch, by hand
        from accelerate.utils import set_seed

        set_seed(args.seed)
        model = lm_model_init(kind)().eval()
        trainer.train_sampler.set_epoch(0)
        rows = packed["train"].select(list(trainer.train_sampler)[: micro * gas])
        ids, labels = torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"])
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=torch.tensor(rows["position_ids"]), use_cache=False).logits
        targets = labels[:, 1:]
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none", ignore_index=-100
        )
        expected_first = {
            "global_mean": (losses.sum() / (targets != -100).sum()).item(),
            "all_positions": torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
            ).item(),
        }
    result = trainer.fit(stop_at_step=stop_at_step)
    history = trainer.state.log_history
    state = trainer.runtime.get_state_dict(trainer.model) if weights else None  # collective
    return {
        "weights": {k: v.detach().clone() for k, v in state.items()}
        if state and trainer.accelerator.is_main_process
        else None,
        "losses": [h["loss"] for h in history if "loss" in h],
        "metrics": result.metrics,
        "expected_first": expected_first,
        "num_processes": trainer.accelerator.num_processes,
        "output_dir": args.output_dir,
        "head": (type(trainer._head()).__name__, tuple(trainer._head().weight.shape)),
        # True: the loss ran chunk by chunk; False: the family's logits are not its head's (whole logits)
        "chunked": trainer._chunked_head.checked if trainer._chunked_head is not None else None,
    }


CASES = {
    # name: (kind, prompt/response, the reference's micro-batch and accumulation)
    "llama-text": ("llama", False, 8, 1),
    "gpt2-prompt-response": ("gpt2", True, 4, 2),
    "mixtral-text": ("mixtral", False, 8, 1),
    "qwen2-text": ("qwen2", False, 8, 1),  # q/k/v biases, a sliding-window layer
    "gemma2-text": ("gemma2", False, 8, 1),  # √hidden-scaled tied embeddings, soft-capped attention and logits
}
DATA_PARALLEL = ("llama-text", "gpt2-prompt-response")
# megatron on 2 processes: (case, options, data-parallel replicas)
MEGATRON = {
    "tp2": ("llama-text", {"tp": 2}, 1),
    "tp2-sp": ("llama-text", {"tp": 2, "sequence_parallel": True}, 1),
    # tied embeddings; the vocabulary (64) padded to 66 rows (vocab_multiple 3): padding rows never enter the loss
    "tp2-tied-padded": ("gpt2-prompt-response", {"tp": 2, "vocab_multiple": 3}, 1),
    "ep2": ("mixtral-text", {"ep": 2}, 2),
    "tp2-qwen2": ("qwen2-text", {"tp": 2}, 1),
    "tp2-gemma2": ("gemma2-text", {"tp": 2}, 1),
    # context parallelism: each rank's zigzag positions of the targets, one sum over cp; packed documents stay apart
    # in the ring's blocks (and the all-to-all's gathered sequence), tied embeddings
    "cp2": ("llama-text", {"cp": 2}, 1),
    "cp2-all-to-all-tied": ("gpt2-prompt-response", {"cp": 2, "cp_comm": "all_to_all"}, 1),
}


def _references() -> dict:
    return {
        # the first step's loss by hand where it is the cross entropy alone (a mixture of experts adds its routers')
        name: run_lm(
            kind=kind, micro=micro, gas=gas, prompt_response=pr, first_batch=name in DATA_PARALLEL, weights=True
        )  # fmt: skip
        for name, (kind, pr, micro, gas) in CASES.items()
    } | {"llama-text-whole-logits": run_lm(kind="llama", micro=8, weights=True, loss_chunk_tokens=None)}


def _two_processes() -> dict:
    runs = {}
    for strategy in ("ddp", "zero3", "fsdp"):
        for name in DATA_PARALLEL:
            kind, pr, micro, gas = CASES[name]
            runs[(name, strategy)] = run_lm(kind=kind, strategy=strategy, micro=micro // 2, gas=gas, prompt_response=pr)
    # stopped after step 2 (a checkpoint), resumed: the global batches' token counts are found again mid-epoch
    kind, pr, micro, gas = CASES["gpt2-prompt-response"]
    stopped = run_lm(kind=kind, micro=micro // 2, gas=gas, prompt_response=pr, stop_at_step=2)
    runs["resumed"] = run_lm(kind=kind, micro=micro // 2, gas=gas, prompt_response=pr,
                             output_dir=stopped["output_dir"], resume=True)  # fmt: skip
    return {**runs, **_megatron_runs(MEGATRON)}


def _megatron_runs(layouts: dict) -> dict:
    """Each megatron layout of ``layouts`` (``name: (case, strategy options, data-parallel replicas)``) trained on the
    case's global batch, its weights gathered."""
    runs = {}
    for layout, (name, options, dp) in layouts.items():
        kind, pr, micro, gas = CASES[name]
        runs[layout] = run_lm(
            kind=kind, strategy="megatron", micro=micro // dp, gas=gas, prompt_response=pr, strategy_options=options,
            weights=True,
        )  # fmt: skip
    return runs


# megatron on 4 processes, pipelines (and tp with cp): (case, options, data-parallel replicas); each micro-batch's loss
# is a token sum over the global batch's count, added unweighted (a classifier's mean would count by its rows)
PIPELINE = {
    "pp2": ("llama-text", {"pp": 2, "num_microbatches": 2}, 2),
    "tp2-pp2": ("llama-text", {"tp": 2, "pp": 2, "num_microbatches": 4}, 1),
    # tied embeddings: the first stage's embedding and the last stage's head, one weight
    "pp2-tied": ("gpt2-prompt-response", {"pp": 2, "num_microbatches": 2}, 2),
    "tp2-pp2-tied": ("gpt2-prompt-response", {"tp": 2, "pp": 2, "num_microbatches": 2}, 1),
    # the vocabulary-parallel loss of each cp rank's positions
    "tp2-cp2": ("llama-text", {"tp": 2, "cp": 2}, 1),
}


def _four_processes() -> dict:
    return _megatron_runs(PIPELINE)


@pytest.fixture(scope="module")
def references() -> dict:
    (reference,) = run_distributed(_references, nprocs=1, timeout=900)
    return reference


@pytest.fixture(scope="module")
def runs(references) -> dict:
    return {"reference": references, "two": run_distributed(_two_processes, nprocs=2, timeout=1200)}


@pytest.fixture(scope="module")
def pipeline_runs() -> list[dict]:
    return run_distributed(_four_processes, nprocs=4, timeout=900)


@pytest.mark.distributed
def test_first_loss_is_the_mean_over_the_global_batch_targets(runs):
    """The first logged loss is the initial model's: the prompts, padding and document starts carry no target, and
    the mean is over the global batch's targets (not a mean of micro-batch means)."""
    for name in DATA_PARALLEL:
        run = runs["reference"][name]
        expected = run["expected_first"]
        assert run["losses"][0] == pytest.approx(expected["global_mean"], abs=1e-5), name
        # a loss over every position would differ: the check can fail
        assert abs(expected["all_positions"] - expected["global_mean"]) > 1e-3, name


@pytest.mark.distributed
def test_the_loss_in_chunks_equals_the_whole_logits_loss(references):
    """``training.loss_chunk_tokens``: the head and the cross entropy over 7 positions at a time, each chunk recomputed
    in the backward, train as the whole logits do (every step's loss, the evaluation, the weights, within fp32
    rounding); Gemma-2, whose forward soft-caps the logits after the head, is found at the first step (it does not
    return the head's output tensor) and builds its whole logits."""
    chunked, whole = references["llama-text"], references["llama-text-whole-logits"]
    assert chunked["chunked"] is True and whole["chunked"] is None
    torch.testing.assert_close(chunked["losses"], whole["losses"], rtol=0, atol=1e-5)
    assert chunked["metrics"]["eval_loss"] == pytest.approx(whole["metrics"]["eval_loss"], abs=1e-5)
    for name, tensor in whole["weights"].items():
        torch.testing.assert_close(chunked["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)
    assert {name: references[name]["chunked"] for name in CASES} == {
        "llama-text": True, "gpt2-prompt-response": True, "mixtral-text": True, "qwen2-text": True,
        "gemma2-text": False,
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp"])
@pytest.mark.parametrize("case", DATA_PARALLEL)
def test_two_processes_equal_one(runs, case, strategy):
    reference, (rank0, rank1) = runs["reference"][case], runs["two"]
    run = rank0[(case, strategy)]
    assert run["num_processes"] == 2
    assert len(run["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], reference["losses"], strict=True)):
        assert got == pytest.approx(want, abs=1e-5), (case, strategy, step)
    assert rank1[(case, strategy)]["losses"] == run["losses"]
    for key in ("eval_loss", "eval_perplexity", "eval_tokens"):
        assert run["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-5, rel=1e-5), key
    assert run["metrics"]["eval_perplexity"] == pytest.approx(math.exp(run["metrics"]["eval_loss"]), rel=1e-9)
    assert reference["losses"][-1] < reference["losses"][0]  # it learns


@pytest.mark.distributed
def test_a_stopped_run_resumes_exactly(runs):
    """Stopped after step 2 with a checkpoint, then resumed on 2 processes: every step (the third ends the first
    epoch, the rest are the next one's) equals the uninterrupted 1-process run's (the resumed run finds each global
    batch's target count from its position in the epoch)."""
    resumed, straight = runs["two"][0]["resumed"], runs["reference"]["gpt2-prompt-response"]
    assert len(resumed["losses"]) == STEPS  # the first two from the checkpoint's history, the rest trained again
    for step, (got, want) in enumerate(zip(resumed["losses"], straight["losses"], strict=True)):
        assert got == pytest.approx(want, abs=1e-5), step + 1
    assert resumed["metrics"]["eval_loss"] == pytest.approx(straight["metrics"]["eval_loss"], abs=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(MEGATRON))
def test_megatron_equals_one_process(runs, layout):
    """Vocabulary-parallel cross entropy (no rank holds a full-vocabulary row), sequence parallelism, tied embeddings
    kept tied across the split, and expert parallelism with the router loss: losses, evaluation and trained weights
    equal the 1-process run's."""
    name = MEGATRON[layout][0]
    reference, run = runs["reference"][name], runs["two"][0][layout]
    for step, (got, want) in enumerate(zip(run["losses"], reference["losses"], strict=True)):
        assert got == pytest.approx(want, abs=1e-5), (layout, step)
    assert run["metrics"]["eval_loss"] == pytest.approx(reference["metrics"]["eval_loss"], abs=1e-5)
    assert run["weights"].keys() == reference["weights"].keys()
    for key, want in reference["weights"].items():
        assert (run["weights"][key] - want).abs().max().item() < 1e-5, (layout, key)
    if layout.startswith("tp"):  # each rank holds its slice of the padded vocabulary (64, or 66), never a full row
        rows = 33 if "padded" in layout else 32
        assert run["head"] == ("VocabParallelHead", (rows, 32)), run["head"]
    if name.startswith("gpt2"):  # tied: one tensor under both names
        assert torch.equal(run["weights"]["lm_head.weight"], run["weights"]["transformer.wte.weight"])
    if name.startswith("gemma2"):
        assert torch.equal(run["weights"]["lm_head.weight"], run["weights"]["model.embed_tokens.weight"])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(PIPELINE))
def test_pipeline_equals_one_process(references, pipeline_runs, layout):
    """Pipeline stages (with tp and dp): the last stage's vocabulary-parallel head and the task's loss, unweighted
    micro-batch losses, packed-document masks built from the positions on every stage, tied embeddings kept one weight
    across the first and last stage, and evaluation from per-block sums on the last stage: losses, evaluation and
    trained weights equal the 1-process run's, on every rank."""
    name = PIPELINE[layout][0]
    reference, run = references[name], pipeline_runs[0][layout]
    assert run["num_processes"] == 4
    for step, (got, want) in enumerate(zip(run["losses"], reference["losses"], strict=True)):
        assert got == pytest.approx(want, abs=1e-5), (layout, step)
    for rank in pipeline_runs[1:]:  # every stage logs the last stage's loss
        assert rank[layout]["losses"] == run["losses"]
        assert rank[layout]["metrics"]["eval_loss"] == run["metrics"]["eval_loss"]
    for key in ("eval_loss", "eval_perplexity", "eval_tokens"):
        assert run["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-5, rel=1e-5), key
    assert run["weights"].keys() == reference["weights"].keys()
    for key, want in reference["weights"].items():
        assert (run["weights"][key] - want).abs().max().item() < 1e-5, (layout, key)
    if name.startswith("gpt2"):  # tied: one tensor under both names
        assert torch.equal(run["weights"]["lm_head.weight"], run["weights"]["transformer.wte.weight"])


# ----------------------------------------------------------------------------- hftrain train, end to end
def _lm_folder(path: Path, kind: str = "llama") -> Path:
    """A tiny random causal LM of ``kind`` (Llama; GPT-2: tied embeddings) saved with its tokenizer, as a user's model
    folder, its EOS the padding."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer("gpt2")
    config = tiny_config(kind, max_positions=128)
    config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _jsonl(path: Path, split: str, seed: int) -> Path:
    rows = lm_splits(n_train=160, n_eval=0, prompt_response=True, seed=seed)["train"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows.to_list()))
    return path


def _token_loss(model, tokenizer, data: Path) -> float:
    """The mean next-token loss of ``model`` on the responses of ``data``, in plain transformers."""
    import torch

    from hftrain.data.language import lm_collator, load_text_splits, pack_splits

    splits = load_text_splits(dataset_name=None, train_file=str(data), validation_file=str(data), text_column="text",
                              prompt_column="prompt", response_column="response", validation_split_percentage=10,
                              max_train_samples=None, max_eval_samples=None, seed=0, log=lambda _: None)  # fmt: skip
    batch = lm_collator(pack_splits(splits, tokenizer, block_size=BLOCK, log=lambda _: None)["validation"].to_list())
    with torch.no_grad():
        labels = batch.pop("labels")
        logits = model(**batch, use_cache=False).logits
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1)).item()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_exports_a_causal_lm_that_generates(tmp_path, capsys, lora):
    """``hftrain train --task causal_lm`` on prompt/response JSONL: the export reloads in plain transformers (a
    ``*ForCausalLM`` folder, or a PEFT ``CAUSAL_LM`` adapter on the base), ``generate()`` runs on it, and its
    held-out loss is below the base model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.cli import main

    model = _lm_folder(tmp_path / "base")
    train, held_out = _jsonl(tmp_path / "train.jsonl", "train", 0), _jsonl(tmp_path / "held_out.jsonl", "eval", 1)
    out = tmp_path / "out"
    args = ["train", "--task", "causal_lm", "--model_name_or_path", str(model), "--dataset_name", "null",
            "--train_file", str(train), "--max_seq_length", str(BLOCK), "--max_steps", "25", "--learning_rate",
            "1e-2" if lora else "3e-3", "--per_device_train_batch_size", "8", "--output_dir", str(out),
            "--mixed_precision", "no", "--log_with", "none"]  # fmt: skip
    if lora:
        args += ["--use_lora", "true", "--lora_target_modules", "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    reset_accelerate_state()
    code, printed = main(args), capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert "validation loss" in printed.out + printed.err and "perplexity" in printed.out + printed.err
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    if lora:
        from peft import PeftModel

        assert (out / "model" / "adapter_config.json").is_file()
        assert json.loads((out / "model" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
        trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), out / "model").eval()
    else:
        assert json.loads((out / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        # the base's generation settings travel with the weights, as save_pretrained writes them
        written = json.loads((out / "model" / "generation_config.json").read_text())
        assert written["eos_token_id"] == base.generation_config.eos_token_id
        trained = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    prompt = tokenizer("w3 w4 w5", return_tensors="pt")
    generated = trained.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape[0] == 1 and 4 <= generated.shape[1] <= 7  # at least one new token (EOS may end it)
    assert _token_loss(trained, tokenizer, held_out) < _token_loss(base, tokenizer, held_out) - 0.1


@pytest.mark.distributed
def test_pipeline_job_checkpoints_resumes_and_exports_tied_embeddings(tmp_path):
    """``hftrain train --task causal_lm`` at pp=2 on GPT-2 (tied embeddings; the last stage builds only its layers,
    its head and the embedding the head shares): its pp=2 checkpoint resumes at one process to the same validation
    loss, and both export a folder plain transformers reloads with the trained logits (checked by the job) and one
    tied tensor."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import launch_env, torchrun

    _lm_folder(tmp_path / "base", "gpt2")
    train = _jsonl(tmp_path / "train.jsonl", "train", 0)
    args = ["train", "--task", "causal_lm", "--model_name_or_path", str(tmp_path / "base"), "--dataset_name", "null",
            "--train_file", str(train), "--max_seq_length", str(BLOCK), "--max_steps", "6", "--save_steps", "3",
            "--learning_rate", "3e-3", "--per_device_train_batch_size", "8", "--mixed_precision", "no",
            "--log_with", "none"]  # fmt: skip
    out = tmp_path / "pp2"
    done = torchrun(2, ["-m", "hftrain", *args, "--output_dir", str(out), "--strategy.name", "megatron", "--pp", "2",
                        "--num_microbatches", "2"])  # fmt: skip
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("step_00000006", "model"))
    again = subprocess.run([sys.executable, "-m", "hftrain", *args, "--output_dir", str(resumed),
                            "--resume_from_checkpoint", "latest"], env=launch_env(), capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]

    def validation_loss(printed: str) -> str:
        assert "validation loss " in printed, printed[-3000:]
        return printed.split("validation loss ")[-1].split()[0]

    assert validation_loss(done.stdout + done.stderr) == validation_loss(again.stdout + again.stderr)
    for folder in (out, resumed):
        weights = load_file(next((folder / "model").glob("*.safetensors")))
        assert "transformer.wte.weight" in weights and "lm_head.weight" not in weights  # one tensor: tied on reload
        reloaded = AutoModelForCausalLM.from_pretrained(folder / "model")
        assert reloaded.lm_head.weight is reloaded.transformer.wte.weight


def test_pipeline_with_context_parallelism_takes_language_models():
    """megatron pp with cp takes ``model.task: causal_lm`` (refused in one line before it was built, issue 57; trained
    against one process in ``tests/test_pp_cp_per_token.py``)."""
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    strategy = strategy_from_options(
        "megatron",
        {"pp": 2, "cp": 2, "num_microbatches": 2},
        launch=LaunchInfo(world_size=4, local_world_size=4),
        platform=Platform("cpu", "gloo"),
    )
    config = tiny_config("llama")
    strategy.check_model(config, use_lora=False)  # a classifier takes the layout
    strategy.check_model(config, use_lora=False, task="causal_lm")  # and so does a language model


@pytest.mark.parametrize("axis", ["pp", "cp"])
def test_pipeline_and_context_parallelism_each_take_language_models(axis):
    """``parallelism.pp`` and ``parallelism.cp`` each run ``model.task: causal_lm`` (refused before they were built for
    it)."""
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from hftrain.strategies.platform import Platform

    options = {axis: 2, **({"num_microbatches": 2} if axis == "pp" else {})}
    strategy = strategy_from_options(
        "megatron",
        options,
        launch=LaunchInfo(world_size=2, local_world_size=2),
        platform=Platform("cpu", "gloo"),
    )
    strategy.check_model(tiny_config("llama"), use_lora=False, task="causal_lm")


def test_context_parallel_job_exports_the_model_it_trained(tmp_path):
    """``hftrain train --task causal_lm`` at cp=2: the export's reload check compares whole-sequence logits, so the
    trained model's per-token logits of each rank's positions are gathered over cp first (the job stopped at that
    check, its shapes apart by cp, before)."""

    from tests.conftest import torchrun

    _lm_folder(tmp_path / "base", "gpt2")
    train = _jsonl(tmp_path / "train.jsonl", "train", 0)
    out = tmp_path / "cp2"
    done = torchrun(2, ["-m", "hftrain", "train", "--task", "causal_lm", "--model_name_or_path", str(tmp_path / "base"),
                        "--dataset_name", "null", "--train_file", str(train), "--max_seq_length", str(BLOCK),
                        "--max_steps", "2", "--per_device_train_batch_size", "8", "--mixed_precision", "no",
                        "--log_with", "none", "--output_dir", str(out), "--strategy.name", "megatron",
                        "--cp", "2"])  # fmt: skip
    assert "reloaded it: max logit difference" in done.stdout + done.stderr
    assert (out / "model" / "model.safetensors").is_file()
