"""``hftrain convert``: checkpoints into save_pretrained folders, one tensor at a time, checked against the source.

The hftrain checkpoints here are built the way the DCP format lays them out (``state/dcp`` with ``model.<name>``
keys written by ``torch.distributed.checkpoint`` in one process, ``state/hf_model``, ``checkpoint.json``); the
DeepSpeed folder is written by a real 2-process ZeRO run and compared with DeepSpeed's own ``zero_to_fp32``. Each
converted folder is reloaded with plain transformers/peft and must give the source model's logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hftrain.checkpoint.manager import file_checksum
from hftrain.cli import main
from tests.conftest import assert_refused
from tests.tiny import tiny_config, tiny_model_init, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GPT2_VOCAB = 50257  # GPT-2's real vocabulary: an odd row count, the largest tensor of these models


def write_dcp_checkpoint(
    model: torch.nn.Module, run_dir: Path, *, step: int = 40, model_path: str | None = None, extra: dict | None = None
) -> Path:
    """A complete new-format checkpoint of ``model`` under ``run_dir/checkpoints/step_<step>`` (one process).

    Args:
        model: the unwrapped model (a PEFT model under LoRA).
        run_dir: the run's output_dir.
        step: the step in the folder name.
        model_path: recorded as ``model.model_name_or_path`` (the tokenizer's source).
        extra: more tensors to save beside the model's (e.g. ``optim.*``).
    """
    import torch.distributed.checkpoint as dcp

    from hftrain.checkpoint.manager import FORMAT_VERSION
    from hftrain.models.lora import is_peft_model

    path = run_dir / "checkpoints" / f"step_{step:08d}"
    state = path / "state"
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({**tensors, **(extra or {})}, checkpoint_id=str(state / "dcp"), no_dist=True)
    base = model.get_base_model() if is_peft_model(model) else model
    base.config.save_pretrained(state / "hf_model")
    if is_peft_model(model):
        model.peft_config["default"].save_pretrained(state / "hf_model")
    (state / "sharded.json").write_text(json.dumps({"format": "hftrain-dcp-v1", "strategy": "ddp", "layout": {}}))
    files = {str(p.relative_to(path)): file_checksum(p) for p in sorted(path.rglob("*")) if p.is_file()}
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "run_id": "test-run",
        "trainer_state": {"epoch": 0, "global_step": step, "micro_step": 0, "samples_seen": 0},
        "topology": {"strategy": "ddp", "world_size": 1, "micro_batch": 4, "global_batch": 4},
        "config": {
            "model.model_name_or_path": model_path or "none",
            "model.num_labels": base.config.num_labels,
            "lora.use_lora": is_peft_model(model),
        },
        "files": files,
    }
    (path / "checkpoint.json").write_text(json.dumps(meta))
    return path


def _inputs(vocab: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, vocab, (3, 9), generator=generator), "attention_mask": torch.ones(3, 9)}


@torch.no_grad()
def _logits(model: torch.nn.Module, vocab: int = 64) -> torch.Tensor:
    return model.eval()(**_inputs(vocab)).logits


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    """Perturb every float tensor so that no value equals its initialisation (a LoRA B is zero at start)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator))
    return model


def _convert(*args: str) -> int:
    return main(["convert", *map(str, args)])


# ----------------------------------------------------------------- full models from a DCP checkpoint
@pytest.mark.parametrize(("kind", "vocab"), [("bert", 64), ("gpt2", GPT2_VOCAB)], ids=["bert", "gpt2-vocab-50257"])
def test_dcp_checkpoint_converts_to_a_model_with_identical_logits(tmp_path, kind, vocab):
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    config = tiny_config(kind, vocab_size=vocab)
    model = _trained(AutoModelForSequenceClassification.from_config(config))
    tokenizer_dir = tmp_path / "tokenizer"
    tiny_tokenizer(kind).save_pretrained(tokenizer_dir)
    checkpoint = write_dcp_checkpoint(model, tmp_path / "run", model_path=str(tokenizer_dir))

    assert _convert(tmp_path / "run", tmp_path / "out") == 0  # a run folder: its latest checkpoint, trusted
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    reloaded, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    torch.testing.assert_close(_logits(reloaded, vocab), _logits(model, vocab), rtol=0, atol=0)
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(model.state_dict())  # what save_pretrained writes: no tied copy here
        assert handle.metadata() == {"format": "pt"}
    assert not list(tmp_path.glob(".staging-*"))
    assert checkpoint.is_dir()


def test_tied_copy_is_left_out_as_save_pretrained_does(tmp_path):
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    model = _trained(GPT2LMHeadModel(tiny_config("gpt2")))
    model.tie_weights()
    write_dcp_checkpoint(model, tmp_path / "run")
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    assert _convert(tmp_path / "run", tmp_path / "out") == 0
    with (
        safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as ours,
        safe_open(str(reference / "model.safetensors"), framework="pt") as theirs,
    ):
        assert set(ours.keys()) == set(theirs.keys())
        assert "lm_head.weight" not in ours.keys()
        for key in ours.keys():
            assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key)), key
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=0)


def test_export_dtype_bf16_and_shards(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    model = _trained(AutoModelForSequenceClassification.from_config(tiny_config("bert")))
    write_dcp_checkpoint(model, tmp_path / "run", extra={"optim.x.exp_avg": torch.ones(3)})
    out = tmp_path / "out"
    assert _convert(tmp_path / "run", out, "--dtype", "bfloat16", "--max_shard_size", "20KB") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.state_dict())
    state = model.state_dict()
    for file in files:
        with safe_open(str(out / file), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                assert tensor.dtype == torch.bfloat16
                assert torch.equal(tensor, state[key].to(torch.bfloat16)), key
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    # bf16 rounding of the weights only: the logits stay within bf16's relative precision of the fp32 model's.
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------- LoRA: adapter and merged model
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_lora_checkpoint_converts_to_an_adapter_and_a_merged_model(tmp_path, kind):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    model = _trained(tiny_model_init(kind, lora_options={"lora_r": 4, "lora_alpha": 8})())
    write_dcp_checkpoint(model, tmp_path / "run")
    out = tmp_path / "adapter"
    assert _convert(tmp_path / "run", out, "--merge_lora") == 0

    # The adapter has exactly PEFT's own file: names without the adapter name, same values.
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    ours, theirs = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not any(".default." in k for k in ours)

    # Loaded by peft onto a base model holding the checkpoint's frozen weights, it gives the trained logits.
    base = AutoModelForSequenceClassification.from_config(tiny_config(kind))
    base.load_state_dict(_frozen_base(model))
    expected = _logits(model)
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(base, out)), expected, rtol=0, atol=0)

    # The merged model equals PEFT's merge_and_unload bit for bit, and loads in plain transformers.
    merged_dir = tmp_path / "adapter_merged"
    reloaded, info = AutoModelForSequenceClassification.from_pretrained(merged_dir, output_loading_info=True)
    assert not any(info.values()), info
    peft_merged = model.merge_and_unload().state_dict()
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, peft_merged[key]), key
    torch.testing.assert_close(_logits(reloaded), expected, rtol=1e-6, atol=1e-6)


def _frozen_base(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights inside a PEFT model (the frozen layers and the head's original copy)."""
    state = peft_model.get_base_model().state_dict()
    kept = {k: v for k, v in state.items() if "lora_" not in k and ".modules_to_save." not in k}
    return {k.replace(".base_layer", "").replace(".original_module", ""): v for k, v in kept.items()}


# ----------------------------------------------------------------- bad input
@pytest.fixture
def checkpoint(tmp_path) -> Path:
    from transformers import AutoModelForSequenceClassification

    return write_dcp_checkpoint(AutoModelForSequenceClassification.from_config(tiny_config("bert")), tmp_path / "run")


def _refused(capsys, args: list[str], fragment: str, scratch: Path) -> None:
    before = {str(p): p.stat().st_mtime_ns for p in scratch.rglob("*")}
    code = main(["convert", *map(str, args)])
    assert_refused(capsys.readouterr().err, code, fragment)
    assert {str(p): p.stat().st_mtime_ns for p in scratch.rglob("*")} == before


def test_bad_input_is_one_line(tmp_path, capsys, checkpoint):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "out"
    _refused(capsys, [tmp_path / "missing", out], "does not exist", tmp_path)
    (tmp_path / "plain").mkdir()
    _refused(capsys, [tmp_path / "plain", out], "is not a checkpoint", tmp_path)
    _refused(capsys, [checkpoint, out], "--trust_external_checkpoint", tmp_path)  # a step folder, no run named
    _refused(capsys, [checkpoint, out, "--dtype", "int8"], "--dtype", tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    _refused(capsys, [tmp_path / "run", tmp_path / "full"], "is not empty", tmp_path)
    _refused(capsys, [tmp_path / "run", out, "--merge_lora"], "no adapter to merge", tmp_path)
    _refused(capsys, [tmp_path / "run", out, "--max_shard_size", "lots"], "max_shard_size", tmp_path)
    # The output inside what it reads: the run folder, the checkpoint's state/, the run's checkpoints/ (whose names
    # the run's saves rotate and replace).
    inside = "which holds the checkpoint it reads (a checkpoint is only read, never written into)"
    _refused(capsys, [tmp_path / "run", tmp_path / "run" / "conv_out"], inside, tmp_path)
    _refused(capsys, [checkpoint, checkpoint / "state" / "out", "--trust_external_checkpoint"], inside, tmp_path)
    beside = checkpoint.parent / "step_00000041"
    _refused(capsys, [checkpoint, beside, "--output_dir", tmp_path / "run"], inside, tmp_path)
    # A run that stopped before its first save: said in convert's words, not training's ('auto').
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    _refused(capsys, [tmp_path / "fresh", out], "holds no complete checkpoint in checkpoints/ (the run stopped before "
             "its first save): nothing to convert", tmp_path)  # fmt: skip
    # A checkpoint of another model than its config says (the config is of a 3-label head).
    other = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    broken = write_dcp_checkpoint(other, tmp_path / "other")
    config = json.loads((broken / "state" / "hf_model" / "config.json").read_text())
    config["id2label"] = {str(i): f"L{i}" for i in range(3)}
    (broken / "state" / "hf_model" / "config.json").write_text(json.dumps(config))
    meta = json.loads((broken / "checkpoint.json").read_text())
    meta["files"]["state/hf_model/config.json"] = file_checksum(broken / "state" / "hf_model" / "config.json")
    (broken / "checkpoint.json").write_text(json.dumps(meta))
    _refused(capsys, [tmp_path / "other", out], "does not hold the model its config describes", tmp_path)
    # A file of the checkpoint missing, then a damaged shard: their checksums no longer match.
    sharded = checkpoint / "state" / "sharded.json"
    kept = sharded.read_bytes()
    sharded.unlink()
    _refused(capsys, [tmp_path / "run", out], "sharded.json is missing", tmp_path)
    sharded.write_bytes(kept)
    shard = next((checkpoint / "state" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    _refused(capsys, [tmp_path / "run", out], "does not match its checksum", tmp_path)
    assert not out.exists()


# ----------------------------------------------------------------- a real DeepSpeed ZeRO folder
def _zero_save(directory: str) -> list[str]:
    """Train a tiny BERT 2 steps under ZeRO-2 and ZeRO-3 (and a LoRA one under ZeRO-3) on 2 gloo processes, and
    write each with ``engine.save_checkpoint`` (the body of a 2-process launch)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    written = []
    for name, stage, lora in (("zero2", 2, None), ("zero3", 3, None), ("zero3_lora", 3, {"lora_r": 4})):
        torch.manual_seed(0)
        model = tiny_model_init("bert", lora_options=lora)()
        trainable = [p for p in model.parameters() if p.requires_grad]
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2), config=config)
        batch = _inputs()
        for _ in range(2):
            loss = engine(**{k: v[:2] for k, v in batch.items()}, labels=torch.tensor([0, 1])).loss
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(f"{directory}/{name}")
        if engine.global_rank == 0:  # the model's config, which a DeepSpeed folder lacks (convert --config)
            tiny_config("bert").save_pretrained(f"{directory}/{name}_config")
            if lora is not None:
                model.peft_config["default"].save_pretrained(f"{directory}/{name}_config")
        written.append(name)
    return written


@pytest.fixture(scope="module")
def zero_folders(tmp_path_factory) -> Path:
    from tests.distributed import run_distributed

    directory = tmp_path_factory.mktemp("zero")
    run_distributed(_zero_save, nprocs=2, directory=str(directory))
    return directory


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_zero_folder_equals_zero_to_fp32(zero_folders, tmp_path, name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    folder, out = zero_folders / name, tmp_path / "out"
    config = str(zero_folders / f"{name}_config")
    assert _convert(folder, out, "--config", config, "--trust_external_checkpoint") == 0
    reference = get_fp32_state_dict_from_zero_checkpoint(str(folder))  # DeepSpeed's own, all in memory
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(reference)
        for key in handle.keys():
            torch.testing.assert_close(handle.get_tensor(key), reference[key], rtol=0, atol=1e-7)
    reloaded, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    plain = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    plain.load_state_dict(reference)
    torch.testing.assert_close(_logits(reloaded), _logits(plain), rtol=0, atol=0)
    # A global_step<N> folder itself converts the same.
    assert _convert(folder / "global_step2", tmp_path / "tag", "--config", config, "--trust_external_checkpoint") == 0
    assert (tmp_path / "tag" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.distributed
def test_deepspeed_zero3_lora_folder_converts_to_adapter_and_merged(zero_folders, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    folder, out = zero_folders / "zero3_lora", tmp_path / "adapter"
    config = str(zero_folders / "zero3_lora_config")
    assert _convert(folder, out, "--config", config, "--merge_lora", "--trust_external_checkpoint") == 0
    trained = tiny_model_init("bert", lora_options={"lora_r": 4})()
    trained.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(folder)))
    expected = _logits(trained)
    base = AutoModelForSequenceClassification.from_config(tiny_config("bert"))
    base.load_state_dict(_frozen_base(trained))
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(base, out)), expected, rtol=0, atol=0)
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "adapter_merged")
    torch.testing.assert_close(_logits(merged), expected, rtol=1e-6, atol=1e-6)


def test_deepspeed_folder_needs_config_and_trust(zero_folders, tmp_path, capsys):
    _refused(capsys, [zero_folders / "zero3", tmp_path / "out", "--trust_external_checkpoint"], "--config", tmp_path)
    config = zero_folders / "zero3_config"
    _refused(capsys, [zero_folders / "zero3", tmp_path / "out", "--config", config], "--trust_external", tmp_path)
    # A rank's partition missing: DeepSpeed's own check, as one line.
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(zero_folders / "zero3", partial)
    next((partial / "global_step2").glob("zero_pp_rank_1_*_optim_states.pt")).unlink()
    trusted = ["--config", config, "--trust_external_checkpoint"]
    _refused(capsys, [partial, tmp_path / "out", *trusted], "optim_states.pt", tmp_path)


# ----------------------------------------------------------------- DCP chunks written by several ranks
def _sharded_save(directory: str) -> None:
    """Save full tensors as 2-rank DTensors split along dim 0, along dim 1 and replicated (a 2-process body)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    placements = {"model.rows": Shard(0), "model.cols": Shard(1), "model.replicated": Replicate()}
    state = {
        key: distribute_tensor(_sharded_value(key), mesh, [placements[key]])
        if key in placements
        else _sharded_value(key)
        for key in SHARDED_SHAPES
    }
    dcp.save(state, checkpoint_id=directory)
    dist.destroy_process_group()


SHARDED_SHAPES = {"model.rows": (7, 6), "model.cols": (4, 10), "model.replicated": (3, 5), "model.scalar": ()}


def _sharded_value(key: str) -> torch.Tensor:
    return torch.randn(SHARDED_SHAPES[key], generator=torch.Generator().manual_seed(len(key)))


@pytest.mark.distributed
def test_dcp_tensor_read_from_chunks_of_two_ranks(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from hftrain.checkpoint.sharded import read_dcp_tensor
    from tests.distributed import run_distributed

    directory = tmp_path / "dcp"
    run_distributed(_sharded_save, nprocs=2, directory=str(directory))
    metadata = FileSystemReader(str(directory)).read_metadata()
    assert len({info.relative_path for info in metadata.storage_data.values()}) == 2  # each rank wrote its part
    for key in SHARDED_SHAPES:
        entry = metadata.state_dict_metadata[key]
        chunks = [(tuple(i.offset), info) for i, info in metadata.storage_data.items() if i.fqn == key]
        value = read_dcp_tensor(directory, key, tuple(entry.size), entry.properties.dtype, chunks)
        assert torch.equal(value, _sharded_value(key)), key


# ----------------------------------------------------------------- memory: one tensor at a time
LARGE = {"vocab_size": GPT2_VOCAB, "n_embd": 768, "n_layer": 4, "n_head": 12, "n_positions": 128}
MEMORY_MARGIN = 64 << 20


def measure_convert(run_dir: str, out: str, *args: str) -> dict[str, int]:
    """Build a GPT-2-shaped classifier of ~270 MiB (its 50,257 × 768 embedding the largest tensor, 147 MiB), write
    its checkpoint, free it, then convert it and return the peak RSS increase over the process before converting.

    Run in a fresh process (``python -c``): the peak is this process's own ``VmHWM``, reset after the checkpoint is
    written, so neither the parameters nor pytest's memory count.
    """
    import gc

    from transformers import AutoModelForSequenceClassification, GPT2Config

    from tests.memory import process_memory, reset_peak

    model = AutoModelForSequenceClassification.from_config(GPT2Config(num_labels=2, pad_token_id=0, **LARGE))
    write_dcp_checkpoint(model, Path(run_dir))
    sizes = [v.numel() * v.element_size() for v in model.state_dict().values()]
    del model
    gc.collect()
    reset_peak()
    before = process_memory("VmRSS")
    assert main(["convert", run_dir, out, *args]) == 0
    return {"peak": process_memory("VmHWM") - before, "largest": max(sizes), "total": sum(sizes)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_holds_one_tensor_at_a_time(tmp_path, dtype):
    code = (
        "import json, sys; from tests.test_convert import measure_convert; "
        "print(json.dumps(measure_convert(sys.argv[1], sys.argv[2], '--dtype', sys.argv[3])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run"), str(tmp_path / "out"), dtype],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["total"] > 250 << 20 and measured["largest"] > 140 << 20
    # The largest tensor once, plus libraries' working memory: not the model, not the tensor twice.
    assert measured["peak"] <= measured["largest"] + MEMORY_MARGIN, measured


# ----------------------------------------------------------------- checkpoints of real hftrain runs
def _export_equals_convert(run: Path, out: Path, *, adapter: bool = False) -> None:
    """The converted folder holds the same tensors as the run's end-of-training export (its last checkpoint)."""
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if adapter else "model.safetensors"
    exported, converted = load_file(run / "model" / name), load_file(out / name)
    assert converted.keys() == exported.keys()
    for key, tensor in converted.items():
        torch.testing.assert_close(tensor, exported[key], rtol=0, atol=1e-7, msg=key)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_run_checkpoint_converts_like_its_export(tiny_job, tmp_path, dtype):
    from tests.conftest import job_args, run_ok

    run = tmp_path / "run"
    train = [sys.executable, "-m", "hftrain", "train", *job_args(tiny_job, run), "--mixed_precision", "no"]
    done = run_ok([*train, "--export_dtype", dtype])
    assert "(streamed, one tensor at a time)" in done.stdout + done.stderr  # the end-of-run export streamed
    assert (next((run / "checkpoints").iterdir()) / "state" / "dcp" / ".metadata").is_file()
    assert _convert(run, tmp_path / "out", "--dtype", dtype) == 0
    _export_equals_convert(run, tmp_path / "out")  # the same fp32 master weights, cast alike
    assert (tmp_path / "out" / "tokenizer.json").is_file()  # from model.model_name_or_path
    for folder in (run / "model", tmp_path / "out"):
        assert json.loads((folder / "config.json").read_text())["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_lora_run_converts_like_its_export(tiny_job, tmp_path, dtype):
    from tests.conftest import job_args, run_ok

    run = tmp_path / "run"
    lora = ["--use_lora", "true", "--lora_r", "4", "--merge_lora_on_export", "true", "--mixed_precision", "no"]
    run_ok([sys.executable, "-m", "hftrain", "train", *job_args(tiny_job, run), *lora, "--export_dtype", dtype])
    # Both merge the fp32 master weights, then cast.
    assert _convert(run, tmp_path / "out", "--merge_lora", "--dtype", dtype) == 0
    _export_equals_convert(run, tmp_path / "out", adapter=True)
    from safetensors.torch import load_file

    exported, converted = (
        load_file(run / "model_merged" / "model.safetensors"),
        load_file(tmp_path / "out_merged" / "model.safetensors"),
    )
    assert converted.keys() == exported.keys()
    for key, tensor in converted.items():
        torch.testing.assert_close(tensor, exported[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.distributed
def test_real_megatron_tp2_checkpoint_converts_like_its_export(tiny_job, tmp_path):
    from tests.conftest import job_args, torchrun

    run = tmp_path / "run"
    megatron = ["--strategy.name", "megatron", "--parallelism.tp", "2", "--mixed_precision", "no"]
    torchrun(2, ["scripts/train.py", *job_args(tiny_job, run), *megatron])
    assert _convert(run, tmp_path / "out") == 0  # one process, without the tp=2 world
    _export_equals_convert(run, tmp_path / "out")


@pytest.mark.distributed
def test_real_zero3_checkpoint_converts_like_its_export(tiny_job, tmp_path):
    from tests.conftest import job_args, torchrun

    run = tmp_path / "run"
    done = torchrun(
        2, ["scripts/train.py", *job_args(tiny_job, run), "--strategy.name", "zero3", "--mixed_precision", "no"]
    )
    assert "(streamed, one tensor at a time)" in done.stdout + done.stderr
    assert _convert(run, tmp_path / "out") == 0  # ZeRO-3's flat partitions, read in one process
    _export_equals_convert(run, tmp_path / "out")
