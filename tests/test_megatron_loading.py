"""Megatron loads a pretrained model without a whole copy per rank (``hftrain.strategies.megatron.loading``), and the
result is today's whole load, bit for bit.

One process: the slice reader equals ``Split.local`` of the whole tensor for every kind of split (rows by byte range,
packed blocks, replicated key/value heads, padding, a split of the input dimension, a bf16 file into fp32); a pipeline
rank's own blocks are read and the other stages' left on ``meta``; LoRA under megatron loads the whole model, said in
one line; cp and ep are refused by the loading in one line.

Two gloo processes, one launch, Llama (grouped-query), BERT and GPT-2 (``Conv1D``: transposed weights) folders: tp2
and pp2 each train 3 fp32 steps with megatron's loading and with today's load (``from_pretrained`` of the whole model
under tp, of the rank's stages under pp): the weights right after ``prepare``, every loss and the exported folder are
equal, bit for bit; the startup line says how the blocks were loaded; the bytes each rank read from the file are its
own stage's blocks (pp), and half of every tensor split along its rows, the rest whole (tp). Llama under tp2 is also
stopped at step 2 and resumed: the resumed loss is the uninterrupted one. Phi-3 (fused q/k/v and gate/up), OLMo-2
(width norms) and ModernBERT (packed ``Wqkv``, GLU ``Wi``) at tp2: weights after ``prepare`` and losses equal. Four
processes: Llama under tp2 × pp2, the same comparisons.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_block_loading import _builder, _lines, _save
from tests.tiny import tiny_config

STEPS, STOP_AT = 3, 2


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize(
    "split",
    [
        {"dim": 0},  # q_proj / gate_proj rows
        {"dim": 0, "parts": 3},  # GPT-2's packed q, k, v (as rows here)
        {"dim": 0, "replicas": 2},  # a key/value head shared by two ranks
        {"dim": 0, "blocks": (8, 4, 4)},  # Phi-3's fused q, k, v of unequal widths
        {"dim": 0, "padded": 20},  # a padded vocabulary
        {"dim": 1},  # a row-parallel weight's input columns
    ],
)
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_the_slice_reader_is_split_local_of_the_file(tmp_path, split, stored):
    from safetensors.torch import save_file

    from hftrain.models.weights import Weights
    from hftrain.parallel.placement_records import Split
    from hftrain.strategies.megatron.loading import _reader

    torch.manual_seed(0)
    full = torch.randn(16, 6).to(stored)
    save_file({"w": full, "before": torch.randn(3)}, str(tmp_path / "model.safetensors"))
    weights = Weights(tmp_path)
    read = _reader(weights, weights.entries["w"], torch.float32)
    assert torch.equal(read(None), full.float())
    for rank in range(4 if "replicas" in split or "blocks" in split else 2):
        size = 4 if "replicas" in split or "blocks" in split else 2
        shard = Split(rank=rank, size=size, full_shape=(16, 6), **split)
        assert torch.equal(read(shard), shard.local(full.float())), (split, rank)


def _stage_leave_out(model) -> list[str]:
    return ["model.layers.2"]  # a second stage's layer: never read, left on meta


def test_a_stage_reads_its_own_blocks_and_leaves_the_others_on_meta(tmp_path, capsys):
    from hftrain.strategies.megatron.loading import MegatronLoading

    folder = _save(tmp_path, "llama")
    torch.manual_seed(7)
    whole = _builder(folder)()
    torch.manual_seed(7)
    capsys.readouterr()
    staged = _builder(folder).build(leave_out=_stage_leave_out, loading=MegatronLoading(tp=1, pp=2))
    lines = _lines(capsys)
    assert any("2 transformer blocks of this rank's pipeline stages" in line for line in lines), lines
    assert all(p.is_meta for p in staged.model.layers[2].parameters())
    for name, tensor in whole.state_dict().items():
        if not name.startswith("model.layers.2."):
            assert torch.equal(staged.state_dict()[name], tensor), name


def test_lora_under_megatron_loads_the_whole_model_and_says_so(tmp_path, capsys):
    from hftrain.strategies.megatron.loading import MegatronLoading

    folder = _save(tmp_path, "llama")
    capsys.readouterr()
    model = _builder(folder, lora_r=4).build(leave_out=_stage_leave_out, loading=MegatronLoading(tp=2, pp=2))
    lines = _lines(capsys)
    assert any("every rank loads the whole model (LoRA adapters under megatron" in line for line in lines), lines
    assert not any(p.is_meta for p in model.parameters())  # as today: LoRA builds the whole model before the cut


def test_context_and_expert_parallelism_load_whole_and_say_why():
    from hftrain.parallel.dims import ParallelDims
    from hftrain.strategies.megatron.loading import refusal

    assert refusal(ParallelDims(4, tp=2, pp=2)) is None
    assert "parallelism.cp=2" in refusal(ParallelDims(4, tp=2, cp=2))
    assert "parallelism.ep=2" in refusal(ParallelDims(2, ep=2))


# ---------------------------------------------------------------------------------------------- two processes
class TodaysBuilder:
    """The builder as megatron used it before its loading: ``build`` without ``loading`` (the whole model under tp,
    the rank's stages by ``from_pretrained`` under pp)."""

    def __init__(self, builder: Any) -> None:
        self.builder = builder

    def __call__(self) -> Any:
        return self.builder()

    def build(self, leave_out: Any = None, *, loading: Any = None) -> Any:
        return self.builder.build(leave_out)


class ReadCounter:
    """Bytes read from each stored tensor through ``Weights.read_into`` (megatron's loading reads nothing else)."""

    def __init__(self) -> None:
        from hftrain.models.weights import Weights

        self.bytes: dict[int, int] = {}  # the tensor's first byte in the file -> bytes read from it
        original = Weights.read_into

        def read_into(weights: Any, entry: Any, out: torch.Tensor) -> None:
            owner = max((e.offset for e in weights.entries.values() if e.offset <= entry.offset), default=0)
            self.bytes[owner] = self.bytes.get(owner, 0) + entry.numel * entry.dtype.itemsize
            original(weights, entry, out)

        self.restore = lambda: setattr(Weights, "read_into", original)
        Weights.read_into = read_into  # type: ignore[method-assign]

    def by_name(self, folder: str) -> dict[str, float]:
        """Fraction of each stored tensor read."""
        from hftrain.models.weights import Weights

        stored = Weights(folder).entries
        return {name: self.bytes.get(e.offset, 0) / (e.numel * e.dtype.itemsize) for name, e in stored.items()}


def _train(folder: str, layout: dict, todays: bool, *, output_dir: str | None = None, stop_at: int | None = None,
           resume: bool = False) -> dict:  # fmt: skip
    """``STEPS`` fp32 steps from ``folder`` under megatron ``layout``: this rank's weights right after ``prepare``,
    the losses, the ``model:`` lines, the fraction of each stored tensor read, and (uninterrupted runs) the exported
    weights on the main process."""
    from transformers import AutoTokenizer

    from hftrain.checkpoint.export import export_pretrained
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
    logger = get_logger()
    logger.addHandler(handler)
    counter = ReadCounter()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    splits = tokenize_splits(tiny_splits(48, 10), tokenizer, max_seq_length=32)
    args = TrainingConfig(
        output_dir=output_dir or _fresh_output_dir(), per_device_train_batch_size=8, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, log_with="none", mixed_precision="no", save_steps=stop_at,
        resume_from_checkpoint="latest" if resume else None,
    )  # fmt: skip
    builder = _builder(folder)
    try:
        trainer = SequenceClassificationTrainer(
            args,
            strategy=strategy_from_options("megatron", layout, launch=launch_info_from_environ()),
            model_init=TodaysBuilder(builder) if todays else builder,
            tokenizer=tokenizer,
            train_dataset=splits["train"],
            eval_dataset=None,
        )
    finally:
        counter.restore()
    prepared = {name: p.detach().clone() for name, p in trainer.runtime._params.items()}
    trainer.fit(stop_at_step=stop_at)
    logger.removeHandler(handler)
    exported: dict[str, torch.Tensor] = {}
    if stop_at is None and not resume:
        from safetensors.torch import load_file

        verify = dict(tokenizer(["w1 w2 w3", "w4 w5"], padding=True, return_tensors="pt"))
        directory = f"{args.output_dir}/export"
        export_pretrained(trainer.runtime, trainer.model, tokenizer, directory, verify_inputs=verify)
        exported = load_file(f"{directory}/model.safetensors") if trainer.accelerator.is_main_process else {}
    return {
        "prepared": prepared,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "lines": [x for x in lines if x.startswith("model: ")],
        "read": counter.by_name(folder),
        "exported": exported,
    }


LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2, "num_microbatches": 2}}


def _runs(folders: dict[str, str]) -> dict:
    from tests.tiny import _fresh_output_dir

    runs = {}
    for kind, folder in folders.items():
        for label, layout in LAYOUTS.items():
            for todays in (False, True):
                runs[(kind, label, todays)] = _train(folder, layout, todays)
    output_dir = _fresh_output_dir()  # llama at tp2, stopped at STOP_AT and resumed with megatron's loading
    _train(folders["llama"], LAYOUTS["tp2"], False, output_dir=output_dir, stop_at=STOP_AT)
    runs["resumed"] = _train(folders["llama"], LAYOUTS["tp2"], False, output_dir=output_dir, resume=True)
    return runs


def _save_layers(folder, kind: str, layers: int) -> str:
    """``_save``'s task-model folder with ``layers`` layers (two per stage at pp2)."""
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_tokenizer

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(tiny_config(kind, num_layers=layers)).save_pretrained(folder)
    tokenizer = tiny_tokenizer(kind)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> list[dict]:
    folders = {kind: _save_layers(tmp_path_factory.mktemp(kind), kind, 4) for kind in ("llama", "bert", "gpt2")}
    return run_distributed(_runs, nprocs=2, timeout=900, folders=folders)


def _block(name: str) -> int | None:
    """The layer index of a stored tensor's name, None outside the layers."""
    parts = name.split(".")
    for key in ("layers", "layer", "h"):
        if key in parts and parts.index(key) + 1 < len(parts):
            return int(parts[parts.index(key) + 1])
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama", "bert", "gpt2"])
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_megatron_loading_equals_todays_load(distributed, kind, label):
    for rank, runs in enumerate(distributed):
        new, old = runs[(kind, label, False)], runs[(kind, label, True)]
        assert new["prepared"].keys() == old["prepared"].keys()
        for name, tensor in old["prepared"].items():
            assert not new["prepared"][name].is_meta, name
            assert new["prepared"][name].dtype == tensor.dtype, name
            assert torch.equal(new["prepared"][name], tensor), (rank, name)
        assert len(old["losses"]) == STEPS
        assert new["losses"] == old["losses"]
        assert new["exported"].keys() == old["exported"].keys()
        for name, tensor in old["exported"].items():
            assert torch.equal(new["exported"][name], tensor), name
        assert old["read"] == {name: 0 for name in old["read"]}  # today's load is from_pretrained's
        read = {name: share for name, share in new["read"].items() if _block(name) is not None}
        if label == "pp2":  # this rank's stage's layers read whole, once; the other stage's never
            own = {_block(name) for name in new["prepared"]} - {None}
            assert own and len(own) < 4, own
            assert read == {name: 1.0 if _block(name) in own else 0.0 for name in read}, rank
        else:  # every layer: the column-split tensors' half by byte range, the rest whole (a row split's too)
            assert all(share > 0 for share in read.values())
            split = [share for name, share in read.items() if share < 1]
            assert len(split) >= 3 * 4 and all(share == 0.5 for share in split), read
    lines = distributed[0][(kind, label, False)]["lines"]
    expected = "of this rank's pipeline stages (the other stages' are never read; pp=2) read from" if label == "pp2" \
        else "loaded for tp=2: their"  # fmt: skip
    assert any(expected in line for line in lines), lines


@pytest.mark.distributed
def test_a_run_loaded_blockwise_resumes_as_it_ran(distributed):
    for runs in distributed:
        assert runs["resumed"]["losses"][-1] == runs[("llama", "tp2", True)]["losses"][-1]


def _tp_pp_runs(folder: str) -> dict:
    layout = {"tp": 2, "pp": 2, "num_microbatches": 2}
    return {todays: _train(folder, layout, todays) for todays in (False, True)}


@pytest.mark.distributed
def test_tp2_by_pp2_on_four_ranks_equals_todays_load(tmp_path):
    folder = _save_layers(tmp_path, "llama", 4)
    ranks = run_distributed(_tp_pp_runs, nprocs=4, timeout=900, folder=folder)
    stages = []
    for runs in ranks:
        new, old = runs[False], runs[True]
        assert new["prepared"].keys() == old["prepared"].keys()
        for name, tensor in old["prepared"].items():
            assert torch.equal(new["prepared"][name], tensor), name
        assert new["losses"] == old["losses"]
        for name, tensor in old["exported"].items():
            assert torch.equal(new["exported"][name], tensor), name
        own = {_block(name) for name in new["prepared"]} - {None}
        read = {name: share for name, share in new["read"].items() if _block(name) is not None}
        assert {_block(name) for name, share in read.items() if share} == own  # its stage's layers only
        assert {share for name, share in read.items() if _block(name) in own} == {0.5, 1.0}  # split rows: half
        stages.append(own)
    assert stages[0] == stages[1] != stages[2] == stages[3]  # tp ranks adjacent, one stage each
    assert any("loaded for tp=2: their" in line and "pp=2" in line for line in ranks[0][False]["lines"])


SPECIAL = ("phi3", "olmo2", "modernbert")  # fused q/k/v and gate/up (blocks), width norms, packed Wqkv + GLU Wi


def _two_steps(folder: str, kind: str, todays: bool) -> tuple[dict, list[float], list[str]]:
    """This rank's weights after ``prepare``, 2 fp32 losses at tp2 and the ``model:`` lines (the tokenizer built
    here: ``AutoTokenizer`` would rebuild a word-level one by the family's class, pitfall 33)."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.config import TrainingConfig
    from hftrain.data.batching import tokenize_splits
    from hftrain.log import get_logger
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers import SequenceClassificationTrainer
    from tests.tiny import _fresh_output_dir, reset_accelerate_state, tiny_splits, tiny_tokenizer

    reset_accelerate_state()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    get_logger().addHandler(handler)
    tokenizer = tiny_tokenizer(kind)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    splits = tokenize_splits(tiny_splits(24, 4), tokenizer, max_seq_length=16)
    args = TrainingConfig(
        output_dir=_fresh_output_dir(), per_device_train_batch_size=8, max_steps=2, learning_rate=1e-3,
        logging_steps=1, log_with="none", mixed_precision="no",
    )  # fmt: skip
    builder = _builder(folder)
    trainer = SequenceClassificationTrainer(
        args,
        strategy=strategy_from_options("megatron", {"tp": 2}, launch=launch_info_from_environ()),
        model_init=TodaysBuilder(builder) if todays else builder,
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=None,
    )
    prepared = {name: p.detach().clone() for name, p in trainer.runtime._params.items()}
    trainer.fit()
    get_logger().removeHandler(handler)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return prepared, losses, [x for x in lines if x.startswith("model: ")]


def _special_runs(folders: dict[str, str]) -> dict:
    return {(kind, todays): _two_steps(folder, kind, todays) for kind, folder in folders.items() for todays in (0, 1)}


@pytest.mark.distributed
def test_families_with_special_splits_equal_todays_load_at_tp2(tmp_path):
    folders = {kind: _save_layers(tmp_path / kind, kind, 2) for kind in SPECIAL}
    ranks = run_distributed(_special_runs, nprocs=2, timeout=900, folders=folders)
    for runs in ranks:
        for kind in SPECIAL:
            (new, new_losses, _), (old, old_losses, _) = runs[(kind, 0)], runs[(kind, 1)]
            assert new.keys() == old.keys()
            for name, tensor in old.items():
                assert torch.equal(new[name], tensor), (kind, name)
            assert len(old_losses) == 2 and new_losses == old_losses, kind
    for kind in SPECIAL:  # rank 0's line
        lines = ranks[0][(kind, 0)][2]
        assert any("loaded for tp=2: their" in line for line in lines), (kind, lines)
