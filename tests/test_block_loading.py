"""A pretrained model loaded without a whole copy per rank (``hftrain.strategies.loading``) equals the whole load.

One process: the blocks read with ``pread`` (``ReadLoading``) equal ``from_pretrained``'s on every tensor and leave
the random stream where it leaves it (the new head is initialised from it), for BERT, GPT-2 (``Conv1D``) and Llama
checkpoints saved as task models, as base models (without the base-model prefix) and in bf16; a folder whose weights
are not safetensors is loaded whole, said in one line; a damaged header is one line naming the folder.

Two gloo processes, one launch: DDP and ZeRO-2 (rank 1's blocks left to the broadcast), ZeRO-3 (partitioned by
``zero.Init(module=block)`` as read), FSDP1 (left on ``meta``, read by its ``param_init_fn`` as ``prepare`` wraps
each block), FSDP2 (``fully_shard`` per block as read) and ZeRO-3 with LoRA train from a Llama and a GPT-2 folder
with losses equal to one process's (fp32), and say how the blocks were loaded. FSDP1 is stopped at step 2, resumed
from its checkpoint and exported (the export reopened and its logits compared by ``export_pretrained``); the
resumed losses and the exported weights are one process's.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from hftrain.errors import ConfigError
from tests.distributed import run_distributed
from tests.tiny import tiny_config

STEPS, STOP_AT = 3, 2


def _save(folder, kind: str, *, saved_as: str = "task model", dtype: torch.dtype = torch.float32) -> str:
    from transformers import AutoModel, AutoModelForSequenceClassification

    from tests.tiny import tiny_tokenizer

    torch.manual_seed(0)
    config = tiny_config(kind, num_layers=3)
    auto = AutoModel if saved_as == "base model" else AutoModelForSequenceClassification
    auto.from_config(config).to(dtype).save_pretrained(folder)
    tokenizer = tiny_tokenizer(kind)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    return str(folder)


def _builder(folder, **lora):
    from hftrain.config import LoraConfig, ModelConfig
    from hftrain.models import PretrainedBuilder

    config = LoraConfig(use_lora=True, **lora) if lora else None
    return PretrainedBuilder(ModelConfig(model_name_or_path=str(folder), num_labels=2), pad_token_id=0, lora=config)


def _lines(capsys) -> list[str]:
    """The ``model:`` lines hftrain's logger printed (it writes to stdout and does not propagate)."""
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("model: ")]


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("saved_as", ["task model", "base model", "bf16"])
def test_read_blocks_equal_the_whole_load(tmp_path, capsys, kind, saved_as):
    from hftrain.strategies.loading import ReadLoading

    dtype = torch.bfloat16 if saved_as == "bf16" else torch.float32
    folder = _save(tmp_path, kind, saved_as="base model" if saved_as == "base model" else "task model", dtype=dtype)
    torch.manual_seed(7)
    whole = _builder(folder)()
    after_whole = torch.get_rng_state()
    torch.manual_seed(7)
    capsys.readouterr()
    read = _builder(folder).build(loading=ReadLoading("test"))
    assert torch.equal(torch.get_rng_state(), after_whole)  # the new head drew the same numbers
    lines = _lines(capsys)
    assert any("3 transformer blocks read" in line for line in lines), lines
    assert type(read) is type(whole)
    mine = dict(read.state_dict())
    for name, tensor in whole.state_dict().items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name
    # the blocks are the process's own memory, not a copy-on-write map of the file (the first step would copy it)
    layer = next(p for n, p in read.named_parameters() if ".0." in n and n.endswith("weight"))
    assert layer.untyped_storage().resizable()


def test_fsdp1_blocks_wait_on_meta_and_are_read_in_place_by_its_init_function(tmp_path, capsys):
    """FSDP1's loading without FSDP: the blocks stay on ``meta``; ``param_init_fn``, called per module as FSDP1's
    constructor calls it, reads them into the same parameter objects (an optimizer built before ``prepare`` holds
    them) and gives the whole load's tensors; LoRA loads whole, said in one line."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hftrain.strategies.fsdp import FSDP1Loading

    folder = _save(tmp_path, "llama")
    torch.manual_seed(7)
    whole = _builder(folder)()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=False)
    torch.manual_seed(7)
    model = _builder(folder).build(loading=FSDP1Loading(plugin))
    classes = set(model._no_split_modules)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    assert len(blocks) == 3 and all(p.is_meta for b in blocks for p in b.parameters())
    held = list(model.parameters())
    for module in model.modules():  # FSDP1 asks for each module of a unit on meta; loaded ones are left alone
        assert plugin.param_init_fn(module) is module
    assert all(a is b for a, b in zip(model.parameters(), held, strict=True))
    mine = dict(model.state_dict())
    for name, tensor in whole.state_dict().items():
        assert torch.equal(mine[name], tensor), name
    capsys.readouterr()
    _builder(folder, lora_r=4).build(loading=FSDP1Loading(plugin))
    assert any("every rank loads the whole model (LoRA adapters under FSDP1" in x for x in _lines(capsys))


def test_weights_that_are_not_safetensors_load_whole_and_say_so(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from hftrain.strategies.loading import ReadLoading

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("llama"))
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # transformers 5 writes safetensors only: a pickled checkpoint by hand
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    torch.manual_seed(7)
    whole = _builder(tmp_path)()
    torch.manual_seed(7)
    capsys.readouterr()
    model = _builder(tmp_path).build(loading=ReadLoading("test"))
    assert any("every rank loads the whole model (its weights are not safetensors files" in x for x in _lines(capsys))
    for name, tensor in whole.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_damaged_header_is_one_line_naming_the_folder(tmp_path):
    from hftrain.strategies.loading import ReadLoading

    folder = _save(tmp_path, "llama")
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(ConfigError, match=str(tmp_path)) as error:
        _builder(folder).build(loading=ReadLoading("test"))
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------- two processes
CASES = {
    "ddp": ("ddp", None, {}),
    "zero2": ("zero2", None, {}),
    "zero3": ("zero3", None, {}),
    "fsdp1": ("fsdp", {"fsdp_version": 1}, {}),
    "fsdp2": ("fsdp", {"fsdp_version": 2}, {}),
    "zero3+lora": ("zero3", None, {"lora_r": 4}),
}
RESUMED = {"fsdp1"}  # stopped at STOP_AT, resumed from the checkpoint and exported (exactness of both)
REFERENCE = {"ddp": ("ddp", None, {}), "ddp+lora": ("ddp", None, {"lora_r": 4})}  # one process
EXPECTED = {  # the line rank 0 logs
    "ddp": "read from the safetensors files into this process's memory (DDP)",
    "zero2": "read from the safetensors files into this process's memory (ZeRO-2)",
    "zero3": "one at a time and sharded (ZeRO-3)",
    "fsdp1": "one at a time and sharded (FSDP1: left on meta, each read as prepare wraps it)",
    "fsdp2": "one at a time and sharded (FSDP2)",
    "zero3+lora": "one at a time and sharded (ZeRO-3)",
}


def _train(
    folder: str,
    strategy: str,
    options: dict | None,
    lora: dict,
    micro: int,
    *,
    output_dir: str | None = None,
    stop_at: int | None = None,
    resume: bool = False,
    export: bool = False,
) -> dict:
    """``STEPS`` fp32 steps from ``folder`` under ``strategy``: losses, the ``model:`` lines logged and the final
    weights of one process (of an export: rank 0's). ``stop_at``: stop there with a checkpoint; ``resume``: from
    ``output_dir``'s latest; ``export``: ``export_pretrained`` (which reopens what it wrote and compares logits),
    and the weights are read back from it."""
    from transformers import AutoTokenizer

    from hftrain.cli import launch_info_from_environ
    from hftrain.config import TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.log import get_logger
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, reset_accelerate_state, tiny_splits

    reset_accelerate_state()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = get_logger()  # its own stdout handler and level first
    logger.addHandler(handler)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    splits = tokenize_splits(tiny_splits(48, 10), tokenizer, max_seq_length=32)
    args = TrainingConfig(
        output_dir=output_dir or _fresh_output_dir(), per_device_train_batch_size=micro, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, log_with="none", mixed_precision="no", save_steps=stop_at,
        resume_from_checkpoint="latest" if resume else None,
    )  # fmt: skip
    trainer = SequenceClassificationTrainer(
        args,
        strategy=strategy_from_options(strategy, options, launch=launch_info_from_environ()),
        model_init=_builder(folder, **lora),
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=None,
    )
    trainer.fit(stop_at_step=stop_at)
    logger.removeHandler(handler)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights: dict[str, torch.Tensor] = {}
    if export:
        from safetensors.torch import load_file

        from hftrain.checkpoint.export import export_pretrained

        verify = dict(tokenizer(["w1 w2 w3", "w4 w5"], padding=True, return_tensors="pt"))
        directory = f"{args.output_dir}/export"
        export_pretrained(trainer.runtime, trainer.model, tokenizer, directory, verify_inputs=verify)
        weights = load_file(f"{directory}/model.safetensors") if trainer.accelerator.is_main_process else {}
    elif trainer.accelerator.num_processes == 1:  # the reference's
        weights = {k: v.detach().clone() for k, v in trainer.runtime.get_state_dict(trainer.model).items()}
    built = _built(trainer, folder)
    return {
        "losses": losses,
        "lines": [x for x in lines if x.startswith("model: ")],
        "built": built,
        "weights": weights,
    }


def _stopped_resumed_exported(folder: str, *case: Any) -> dict:
    """:func:`_train` stopped at ``STOP_AT`` with a checkpoint, then resumed from it to ``STEPS`` and exported."""
    from tests.tiny import _fresh_output_dir

    output_dir = _fresh_output_dir()
    _train(folder, *case, output_dir=output_dir, stop_at=STOP_AT)
    return _train(folder, *case, output_dir=output_dir, resume=True, export=True)


def _built(trainer, folder: str) -> dict[str, bool]:
    """The model as this runtime builds it, before ``prepare``: whether every block is partitioned (ZeRO-3: DeepSpeed
    then moves no whole model to the device, pitfall "whole model on every GPU before the split") or sharded (FSDP2)
    already."""
    from torch.distributed.fsdp import FSDPModule

    model = trainer.runtime.build_model(_builder(folder))
    classes = set(model._no_split_modules)
    blocks = [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in classes]
    return {
        "partitioned": bool(blocks) and all(hasattr(p, "ds_id") for b in blocks for p in b.parameters()),
        "sharded": bool(blocks) and all(isinstance(b, FSDPModule) for b in blocks),
        "on meta": bool(blocks) and all(p.is_meta for b in blocks for p in b.parameters()),
    }


def _runs(folders: dict[str, str], cases: dict[str, tuple], micro: int) -> dict:
    return {
        (kind, label): (_stopped_resumed_exported if label in RESUMED else _train)(folder, *case, micro)
        for kind, folder in folders.items()
        for label, case in cases.items()
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return {kind: _save(tmp_path_factory.mktemp(kind), kind) for kind in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def reference(folders) -> dict:
    return run_distributed(_runs, nprocs=1, folders=folders, cases=REFERENCE, micro=8)[0]


@pytest.fixture(scope="module")
def distributed(folders) -> list[dict]:
    return run_distributed(_runs, nprocs=2, timeout=900, folders=folders, cases=CASES, micro=4)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("label", list(CASES))
def test_two_ranks_loading_blockwise_train_as_one_process(reference, distributed, kind, label):
    ref = reference[(kind, "ddp+lora" if "lora" in label else "ddp")]
    rank0, rank1 = distributed[0][(kind, label)], distributed[1][(kind, label)]
    assert len(ref["losses"]) == STEPS
    assert rank0["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert rank1["losses"] == rank0["losses"]
    assert any(EXPECTED[label] in line for line in rank0["lines"]), rank0["lines"]
    for rank in (rank0, rank1):
        expected = {"partitioned": label.startswith("zero3"), "sharded": label == "fsdp2", "on meta": label == "fsdp1"}
        assert rank["built"] == expected
    if label in RESUMED:  # the resumed run's losses (above) and its export's weights: one process's
        assert rank0["weights"].keys() == ref["weights"].keys()
        for name, tensor in ref["weights"].items():
            torch.testing.assert_close(rank0["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)
