"""``training.compile``: every transformer block compiled in place changes the speed, never the numbers.

A tiny Llama causal LM (fixed-length packed blocks, so one batch shape) trains 20 steps eager and compiled in the
same two gloo processes under DDP, FSDP2, megatron tp2 and ZeRO-3: losses and final weights agree within 1e-5
(fp32). Inductor (the default backend, C++ kernels on a CPU) compiles each block graph once: every block of a class
and batch shape shares one graph, so the graphs counted by dynamo equal the distinct (batch shape, grad mode) pairs
the model saw, with no graph break inside a block (under DDP and FSDP2; ``WHOLE_BLOCK_GRAPHS``). A compiled run's
checkpoint resumes in an eager run and an eager one in a compiled run, to the uninterrupted run's numbers;
``hftrain train --compile true`` exports a model (full, and a LoRA adapter) that plain transformers reloads with the
trained logits (the job's own reload check) and names without ``_orig_mod.``. What cannot run compiled is refused
in one line before anything is written.

Cost: inductor's C++ compile of one block graph takes ~40 s on 2 busy cores the first time, then its FX graph cache
(``$TMPDIR/torchinductor_$USER``, shared by every process and run) serves it in about a second; the same shapes recur
throughout this file, so each graph is compiled once per cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_causal_lm import BLOCK, _jsonl, _lm_folder, lm_model_init, lm_splits
from tests.tiny import reset_accelerate_state, tiny_tokenizer

STEPS = 20
TWO = {  # label -> (strategy, options)
    "ddp": ("ddp", None),
    "fsdp2": ("fsdp", {"fsdp_version": 2}),
    "megatron-tp2": ("megatron", {"tp": 2}),
    "zero3": ("zero3", None),
}
WHOLE_BLOCK_GRAPHS = {"ddp", "fsdp2"}
"""Where a block is one graph. Megatron's RNG tracker switches the default generator's state around the
tensor-parallel region (``torch.get_rng_state``/``set_rng_state``, which dynamo does not trace), and ZeRO-3 gathers
each submodule's parameters in hooks, so there a block is a few graphs (7 and 15 here), each compiled once per shape
and shared by the blocks."""


def run_lm(
    *,
    compile: bool,  # noqa: A002 - the config field's name
    strategy: str = "ddp",
    strategy_options: dict | None = None,
    micro: int = 2,
    steps: int = STEPS,
    evaluate: bool = False,
    save_steps: int | None = None,
    stop_at_step: int | None = None,
    output_dir: str | None = None,
    resume: bool = False,
    compile_mode: str = "default",
    gradient_checkpointing: bool | str = False,
) -> dict:
    """Train the tiny Llama causal LM in this process group: per-step losses, the final weights (main process), the
    graphs dynamo compiled and the distinct (input shape, grad mode) pairs the model saw."""
    from torch._dynamo.utils import counters

    from hftrain.cli import launch_info_from_environ
    from hftrain.config import TrainingConfig
    from hftrain.data.language import pack_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.language import CausalLMTrainer
    from tests.tiny import _fresh_output_dir

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    packed = pack_splits(lm_splits(), tokenizer, block_size=BLOCK, log=lambda _: None)
    args = TrainingConfig(
        output_dir=output_dir or _fresh_output_dir(),
        resume_from_checkpoint="latest" if resume else None,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro,
        max_steps=steps,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_steps=save_steps,
        async_save=False,
        log_with="none",
        mixed_precision="no",
        train_sampling_strategy="random",
        compile=compile,
        compile_mode=compile_mode,
        gradient_checkpointing=gradient_checkpointing,
    )
    seen: set[tuple] = set()

    def model_init():
        model = lm_model_init("llama")()
        # Eager, outside the compiled blocks: the shapes and grad modes the blocks are called with.
        model.register_forward_pre_hook(
            lambda _, args, kwargs: seen.add((tuple(kwargs["input_ids"].shape), torch.is_grad_enabled())),
            with_kwargs=True,
        )
        return model

    trainer = CausalLMTrainer(
        args,
        strategy=strategy_from_options(strategy, strategy_options, launch=launch_info_from_environ()),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=packed["train"],
        eval_dataset=packed["validation"] if evaluate else None,
    )
    counters.clear()
    trainer.fit(stop_at_step=stop_at_step)
    state = trainer.runtime.get_state_dict(trainer.model)  # collective
    main = trainer.accelerator.is_main_process
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": {k: v.detach().clone() for k, v in state.items()} if main else None,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "shapes": sorted(seen),
        "output_dir": args.output_dir,
    }


def _refusal(**kwargs) -> str:
    """The message ``run_lm`` is refused with, and whether the run folder stayed empty."""
    from hftrain.errors import ConfigError
    from tests.tiny import _fresh_output_dir

    output_dir = _fresh_output_dir()
    try:
        run_lm(compile=True, output_dir=output_dir, **kwargs)
    except ConfigError as error:
        written = [p.name for p in Path(output_dir).iterdir()] if Path(output_dir).exists() else []
        return f"{error} | written: {written}"
    return "not refused"


def _two() -> dict:
    out = {}
    for label, (strategy, options) in TWO.items():
        for compiled in (False, True):
            out[(label, compiled)] = run_lm(compile=compiled, strategy=strategy, strategy_options=options)
    out["refused"] = {
        "fsdp1": _refusal(strategy="fsdp", strategy_options={"fsdp_version": 1}),
        "pp2": _refusal(strategy="megatron", strategy_options={"pp": 2}),
        "cp2": _refusal(strategy="megatron", strategy_options={"cp": 2}),
    }
    return out


@pytest.fixture(scope="module")
def two() -> dict:
    return run_distributed(_two, 2)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(TWO))
def test_compiled_equals_eager_over_20_steps(two, label):
    eager, compiled = two[(label, False)], two[(label, True)]
    assert len(eager["losses"]) == STEPS and eager["graphs"] == 0
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=0, atol=1e-5)
    assert compiled["weights"].keys() == eager["weights"].keys()
    assert not any("_orig_mod" in name for name in compiled["weights"])
    for name, tensor in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)
    # The blocks did run compiled: one graph for both blocks and the one training shape.
    assert len(compiled["shapes"]) == 1 and compiled["graphs"] >= 1
    if label in WHOLE_BLOCK_GRAPHS:
        assert compiled["graphs"] == 1 and compiled["graph_breaks"] == 0, compiled["graphs"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp1", "pp2", "cp2"])
def test_what_cannot_run_compiled_is_refused_in_one_line(two, case):
    message = two["refused"][case]
    assert message.startswith("training.compile: ") and "\n" not in message, message
    assert message.endswith("| written: []"), message
    expected = {"fsdp1": "fsdp_version: 2", "pp2": "parallelism.pp=2", "cp2": "parallelism.cp=2"}[case]
    assert expected in message, message


def test_reduce_overhead_is_refused_on_a_cpu():
    message = _refusal(compile_mode="reduce-overhead")
    assert message.startswith("training.compile: compile_mode reduce-overhead replays CUDA graphs"), message
    assert message.endswith("| written: []") and "\n" not in message, message


def test_full_recomputation_is_refused_under_compile():
    message = _refusal(gradient_checkpointing="full")
    assert message.startswith("training.compile: gradient_checkpointing: full checkpoints"), message
    assert message.endswith("| written: []") and "\n" not in message, message


def test_one_graph_per_batch_shape_and_grad_mode():
    """Training blocks (one shape) and evaluation blocks (no grad; the last batch shorter): dynamo's graphs equal the
    distinct (shape, grad mode) pairs the model was called with, every block of the class sharing them."""
    run = run_lm(compile=True, micro=2, steps=6, evaluate=True)
    assert run["graph_breaks"] == 0
    assert len({grad for _, grad in run["shapes"]}) == 2  # training and evaluation both ran
    assert run["graphs"] == len(run["shapes"]), run


def run_classifier(*, steps: int = 6, words: tuple[int, int] = (4, 6)) -> dict:
    """Train the tiny BERT classifier compiled (batches padded to their longest text, lengths grouped): the graphs
    dynamo compiled and the distinct (input shape, grad mode, padding-free) triples the model saw."""
    from torch._dynamo.utils import counters

    from hftrain.cli import launch_info_from_environ
    from hftrain.data.batching import tokenize_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, fp32_args, tiny_model_init, tiny_splits

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("bert")
    splits = tokenize_splits(tiny_splits(48, 10, words=words), tokenizer, max_seq_length=32)
    seen: set[tuple] = set()

    def model_init():
        model = tiny_model_init("bert")()
        # transformers drops a mask without padding (SDPA then runs unmasked): a block input of its own
        model.register_forward_pre_hook(
            lambda _, args, kwargs: seen.add(
                (tuple(kwargs["input_ids"].shape), torch.is_grad_enabled(), bool(kwargs["attention_mask"].all()))
            ),
            with_kwargs=True,
        )
        return model

    args = fp32_args(_fresh_output_dir(), per_device_train_batch_size=4, max_steps=steps, compile=True)
    trainer = SequenceClassificationTrainer(
        args,
        strategy=strategy_from_options("ddp", None, launch=launch_info_from_environ()),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )
    counters.clear()
    trainer.fit()
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "shapes": sorted(seen)}  # fmt: skip


@pytest.mark.slow  # six BERT graphs compiled cold: ~2.5 min on 2 busy cores
def test_a_classifier_compiles_one_graph_per_padded_length():
    """BERT's blocks padded per batch: each distinct (batch, length, grad mode, with or without a padding mask) is
    one graph, no more (dynamo's recompile limit is 8 per block class: bucket the lengths to stay under it)."""
    run = run_classifier()
    assert run["graph_breaks"] == 0
    assert 2 < len(run["shapes"]) <= 8, run["shapes"]
    assert run["graphs"] == len(run["shapes"]), run


@pytest.mark.slow  # six runs: ~1.5 min on 2 busy cores
def test_checkpoints_resume_across_compile(tmp_path):
    """A compiled run's checkpoint (step 10) resumes eager, and an eager one compiled, to the numbers of the
    uninterrupted runs (within 1e-5: compiled kernels round differently)."""
    for first in (True, False):
        whole = run_lm(compile=first, save_steps=10, output_dir=str(tmp_path / f"whole-{first}"))
        folder = str(tmp_path / f"stopped-{first}")
        run_lm(compile=first, save_steps=10, stop_at_step=10, output_dir=folder)
        resumed = run_lm(compile=not first, save_steps=10, output_dir=folder, resume=True)
        assert len(resumed["losses"]) == STEPS  # the first 10 restored from the checkpoint
        torch.testing.assert_close(resumed["losses"], whole["losses"], rtol=0, atol=1e-5)
        for name, tensor in whole["weights"].items():
            torch.testing.assert_close(resumed["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_a_compiled_job_exports_what_transformers_reloads(tmp_path, capsys, lora):
    """``hftrain train --compile true``: the job's export reloads in plain transformers with the trained (compiled)
    model's logits (the job checks them and fails otherwise), under names without ``_orig_mod.``."""
    from safetensors.torch import load_file

    from hftrain.cli import main

    model = _lm_folder(tmp_path / "base")
    train = _jsonl(tmp_path / "train.jsonl", "train", 0)
    out = tmp_path / "out"
    args = ["train", "--task", "causal_lm", "--model_name_or_path", str(model), "--dataset_name", "null",
            "--train_file", str(train), "--max_seq_length", str(BLOCK), "--max_steps", "8",
            "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--output_dir", str(out),
            "--mixed_precision", "no", "--log_with", "none", "--compile", "true"]  # fmt: skip
    if lora:
        args += ["--use_lora", "true", "--lora_target_modules", "q_proj", "v_proj"]
    reset_accelerate_state()
    code, printed = main(args), capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    assert "compile: 2 blocks (LlamaDecoderLayer)" in printed.out + printed.err
    weights = out / "model" / ("adapter_model.safetensors" if lora else "model.safetensors")
    names = list(load_file(weights))
    assert names and not any("_orig_mod" in name for name in names)
    if lora:
        assert json.loads((out / "model" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
        assert any("lora_B" in name for name in names)
