"""Every bad input is one ``hftrain: error:`` line, exit code 2, no traceback, and nothing written.

One good run (a tiny BERT folder, a small CSV, 4 steps, checkpoints at steps 2 and 4, an export) is trained
once; every case of the table then runs ``hftrain.cli.main`` in-process and must leave each file of that run
byte-identical (SHA-256), create no new ``output_dir``, and leave any run directory it was given unchanged. A
few cases run as real subprocesses, where the process exit code itself matters. The other tests cover what
users expect to work: extending, moving and resuming runs, list fields on the command line, the non-finite
loss stop, and a full or read-only disk (a real tmpfs; skipped with the reason where it cannot be mounted).
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hftrain.cli import main
from tests.conftest import assert_refused, cli_in_process
from tests.forged_checkpoints import STEP2, STEP4, planted_bytes, reseal, symlinked_planted_dcp
from tests.tiny import reset_accelerate_state, save_model_folder, synthetic_texts, write_csv

ROOT = Path(__file__).resolve().parents[1]


def checksums(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under ``directory`` (empty when it does not exist)."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@dataclass
class Ctx:
    """What a case builds its command from; ``watch`` collects extra directories that must not change."""

    model: Path
    data: Path
    run: Path
    scratch: Path
    new: Path
    watched: list[Path] = field(default_factory=list)

    def base(self, output_dir: Path | None = None) -> list[str]:
        """The good run's command line (same config), into ``output_dir`` (default: a new folder)."""
        return [
            "train",
            "--model_name_or_path",
            str(self.model),
            "--dataset_name",
            "null",
            "--train_file",
            str(self.data),
            "--log_with",
            "none",
            "--per_device_train_batch_size",
            "8",
            "--max_steps",
            "4",
            "--save_steps",
            "2",
            "--output_dir",
            str(output_dir or self.new),
        ]

    def file(self, name: str, text: str) -> str:
        path = self.scratch / name
        path.write_text(text)
        return str(path)

    def model_variant(self, name: str, edit: Callable[[Path], None]) -> str:
        path = self.scratch / name
        shutil.copytree(self.model, path)
        edit(path)
        return str(path)

    def run_copy(self, edit: Callable[[Path], None] | None = None) -> Path:
        """A copy of the good run (to damage), watched: a refused command must leave it as it was."""
        path = self.scratch / "run-copy"
        shutil.copytree(self.run, path)
        if edit is not None:
            edit(path)
        self.watched.append(path)
        return path

    def config(self, text: str) -> list[str]:
        return ["train", "--config", self.file("job.yaml", text), "--output_dir", str(self.new)]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Iterator[Ctx]:
    root = tmp_path_factory.mktemp("good")
    ctx = Ctx(
        model=save_model_folder(root / "model"),
        data=write_csv(root / "train.csv"),
        run=root / "run",
        scratch=root,
        new=root / "unused",
    )
    reset_accelerate_state()
    assert main(ctx.base(ctx.run)) == 0
    assert (ctx.run / STEP4 / "checkpoint.json").is_file() and (ctx.run / "model" / "model.safetensors").is_file()
    yield ctx
    reset_accelerate_state()  # the in-process runs leave Accelerate's singletons set; later modules start clean


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _drop_topology(run: Path) -> None:
    _edit_json(run / STEP4 / "checkpoint.json", lambda d: d.pop("topology"))


def _plant_foreign_step6(run: Path) -> None:
    """A checkpoint of another run (another run id, checksums intact) at a newer step than the run's own."""
    shutil.copytree(run / STEP4, run / "checkpoints/step_00000006")
    _edit_json(run / "checkpoints/step_00000006/checkpoint.json", lambda d: d.update(run_id="0123456789ab", step=6))


def _state_edit(name: str, edit: Callable[[Path], None]) -> Callable[[Path], None]:
    """Edit ``state/<name>`` of the run copy's step 4, then reseal its checksums."""

    def apply(run: Path) -> None:
        edit(run / STEP4 / "state" / name)
        reseal(run)

    return apply


def _drop_a_weight(path: Path) -> None:
    """Remove one weight from a DCP ``.metadata`` (the test's own pickle: it is written, then loaded by hftrain)."""
    import pickle

    metadata = pickle.loads(path.read_bytes())
    name = sorted(k for k in metadata.state_dict_metadata if k.startswith("model."))[0]
    del metadata.state_dict_metadata[name]
    metadata.storage_data = {i: v for i, v in metadata.storage_data.items() if i.fqn != name}
    path.write_bytes(pickle.dumps(metadata))


def _reshape_a_weight(path: Path) -> None:
    """Give one 2-D weight of a DCP ``.metadata`` one column fewer."""
    import pickle

    import torch

    metadata = pickle.loads(path.read_bytes())
    name, md = next((k, v) for k, v in sorted(metadata.state_dict_metadata.items()) if len(getattr(v, "size", ())) == 2)
    md.size = torch.Size([md.size[0], md.size[1] - 1])
    path.write_bytes(pickle.dumps(metadata))


def _as_pre_sharded(run: Path) -> None:
    """Step 4 in the layout of a DDP checkpoint from before the sharded format: Accelerate's ``model.safetensors``
    and ``optimizer.bin`` in ``state/`` beside its scheduler and RNG files, no ``dcp/``, ``sharded.json``,
    ``optimizer.json`` or ``hf_model/``; resealed."""
    import torch
    from safetensors.torch import save_file

    state = run / STEP4 / "state"
    for name in ("dcp", "hf_model"):
        shutil.rmtree(state / name)
    for name in ("sharded.json", "optimizer.json"):
        (state / name).unlink()
    save_file({"classifier.weight": torch.zeros(2, 4)}, str(state / "model.safetensors"))
    torch.save({"state": {}, "param_groups": []}, state / "optimizer.bin")
    reseal(run)


def _marker_edit(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda run: _edit_json(run / STEP4 / "checkpoint.json", change)


def _as_step(step: int) -> Callable[[Path], None]:
    """Step 4 renamed, in its folder name, step and global_step, to ``step`` (consistent, but beyond the run)."""

    def apply(run: Path) -> None:
        folder = run / f"checkpoints/step_{step:08d}"
        shutil.move(str(run / STEP4), str(folder))
        _edit_json(
            folder / "checkpoint.json", lambda d: (d.update(step=step), d["trainer_state"].update(global_step=step))
        )
        reseal(run, folder.relative_to(run).as_posix())

    return apply


def _json_edit(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """Edit the JSON file ``state/<name>`` of step 4, then reseal."""
    return _state_edit(name, lambda path: _edit_json(path, change))


def _groups_edit(**values) -> Callable[[Path], None]:
    return _json_edit("optimizer.json", lambda d: d["param_groups"][0].update(values))


def _rng_with_wrong_types(path: Path) -> None:
    """Accelerate's keys, each of the wrong type (Accelerate would catch the failure and go on silently)."""
    import torch

    torch.save({"random_state": [3, [1, 2], None], "numpy_random_seed": "MT19937", "torch_manual_seed": 7}, path)


def _tensor_record_as_a_pickle(path: Path) -> None:
    """Point one tensor's storage in a DCP ``.metadata`` at a pickle appended to its ``.distcp`` file (torch would
    advise loading it with weights_only=False)."""
    import pickle

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = pickle.loads(path.read_bytes())
    tensors = [i for i in sorted(metadata.storage_data, key=lambda i: i.fqn) if i.fqn.startswith("model.")]
    index = next(i for i in tensors if isinstance(metadata.state_dict_metadata[i.fqn], TensorStorageMetadata))
    info = metadata.storage_data[index]
    data_file = path.parent / info.relative_path
    payload, offset = planted_bytes(), data_file.stat().st_size
    with data_file.open("ab") as handle:
        handle.write(payload)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload), info.transform_descriptors)
    path.write_bytes(pickle.dumps(metadata))


def _fresh_run(ctx: Ctx) -> Path:
    """A run folder whose run stopped before its first save: an empty ``checkpoints/``."""
    (ctx.scratch / "fresh" / "checkpoints").mkdir(parents=True)
    return ctx.scratch / "fresh"


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


# id -> (command builder, a fragment the one error line must contain)
CASES: dict[str, tuple[Callable[[Ctx], list[str]], str]] = {
    # ------------------------------------------------------------------ config file
    "config: integer section name": (lambda c: c.config("1: {max_steps: 2}\n"), "section name 1"),
    "config: empty file": (lambda c: c.config(""), "is empty"),
    "config: only comments": (lambda c: c.config("# nothing\n"), "is empty"),
    "config: duplicated key": (lambda c: c.config("training:\n  seed: 1\n  seed: 2\n"), "duplicate key 'seed'"),
    "config: invalid YAML": (lambda c: c.config("training: [1\n"), "not valid YAML"),
    "config: a directory": (lambda c: ["train", "--config", str(c.scratch), "--output_dir", str(c.new)], "directory"),
    "config: missing file": (
        lambda c: ["train", "--config", str(c.scratch / "nope.yaml"), "--output_dir", str(c.new)],
        "does not exist",
    ),
    "config: unknown section": (lambda c: c.config("trainig: {seed: 1}\n"), "did you mean 'training'"),
    "config: unknown key": (lambda c: c.config("training: {learnig_rate: 1}\n"), "training.learning_rate"),
    "config: not a mapping": (lambda c: c.config("- a\n- b\n"), "expected a mapping"),
    "config: section not a mapping": (lambda c: c.config("training: 5\n"), "must be a mapping"),
    "config: integer key in a section": (lambda c: c.config("training: {1: 2}\n"), "not a field name"),
    "config: infinite learning rate": (lambda c: c.config("training: {learning_rate: .inf}\n"), "finite"),
    "config: NaN weight decay": (lambda c: c.config("training: {weight_decay: .nan}\n"), "training.weight_decay"),
    "config: wrong type": (lambda c: c.config("training: {max_steps: many}\n"), "training.max_steps"),
    # ------------------------------------------------------------------ command line
    "cli: infinite learning rate": (lambda c: [*c.base(), "--learning_rate", "inf"], "must be a finite number"),
    "cli: negative seed": (lambda c: [*c.base(), "--seed", "-1"], "training.seed"),
    "cli: key without value": (lambda c: [*c.base(), "--max_steps"], "needs a value"),
    "cli: two values for a scalar": (lambda c: [*c.base(), "--learning_rate", "1", "2"], "takes one value"),
    "cli: unknown subcommand": (lambda c: ["bogus"], "invalid choice"),
    "cli: export without arguments": (lambda c: ["export"], "required"),
    "cli: export with unknown option": (lambda c: ["export", "a", "b", "--fast"], "unrecognized arguments"),
    "cli: not an integer": (lambda c: [*c.base(), "--per_device_train_batch_size", "big"], "expected an integer"),
    "cli: misspelt choice": (lambda c: [*c.base(), "--mixed_precision", "bf61"], "did you mean 'bf16'"),
    "cli: misspelt key": (lambda c: [*c.base(), "--learnin_rate", "1"], "did you mean 'learning_rate'"),
    "cli: stray word": (lambda c: ["train", "fast", *c.base()[1:]], "expected '--key value'"),
    "cli: stray word after a value": (lambda c: [*c.base(), "fast"], "takes one value"),
    "cli: warmup ratio above 1": (lambda c: [*c.base(), "--warmup_steps", "1.5"], "ratio"),
    "cli: zero epochs": (lambda c: [*c.base(), "--max_steps", "-1", "--num_train_epochs", "0"], "num_train_epochs"),
    "cli: LoRA rank 0": (lambda c: [*c.base(), "--lora_r", "0"], "lora.lora_r"),
    "cli: negative loader workers": (lambda c: [*c.base(), "--dataloader_num_workers", "-1"], "dataloader_num_workers"),
    "cli: LoRA on modules the model lacks": (
        lambda c: [*c.base(), "--use_lora", "true", "--lora_target_modules", "nothing,else"],
        "lora.lora_target_modules",
    ),
    # ------------------------------------------------------------------ strategy and platform
    "strategy: fp16 on CPU": (lambda c: [*c.base(), "--mixed_precision", "fp16"], "use bf16 on CPU"),
    "strategy: unknown name": (lambda c: [*c.base(), "--strategy.name", "zero9"], "strategy.name"),
    "strategy: fused AdamW under optimizer offload": (
        lambda c: [
            *c.base(),
            "--strategy.name",
            "zero2",
            "--offload_optimizer",
            "true",
            "--optim",
            "adamw_torch_fused",
        ],
        "training.optim: adamw_torch_fused cannot run",
    ),
    "cli: unknown attention kernel": (lambda c: [*c.base(), "--attn_implementation", "flash"], "attn_implementation"),
    "strategy: FSDP version 3": (lambda c: [*c.base(), "--fsdp_version", "3"], "strategy.fsdp_version"),
    "strategy: vocabulary multiple 0": (
        lambda c: [*c.base(), "--strategy.name", "megatron", "--vocab_multiple", "0"],
        "parallelism.vocab_multiple must be a positive integer, got 0",
    ),
    "strategy: vocabulary multiple not an integer": (
        lambda c: [*c.base(), "--strategy.name", "megatron", "--vocab_multiple", "1.5"],
        "parallelism.vocab_multiple: expected an integer",
    ),
    "strategy: vocabulary multiple 2**40 (an allocator traceback)": (
        lambda c: [*c.base(), "--strategy.name", "megatron", "--vocab_multiple", "1099511627776"],
        "parallelism.vocab_multiple must be at most 65536, got 1099511627776",
    ),
    # MFU divides by it: 0 meant "measure" without a word, -1 printed MFU -11.9%, 1e-30 an MFU of 1.3e31%.
    **{
        f"cli: peak_tflops {value}": (
            lambda c, value=value: [*c.base(), "--peak_tflops", value],
            f"training.peak_tflops {float(value)} is not a process's peak: give TFLOP/s between 0.001 and 100,000",
        )
        for value in ("0", "-1", "1e-30", "1e6")
    },
    # ------------------------------------------------------------------ data
    "data: train_file is a directory": (lambda c: [*c.base(), "--train_file", str(c.scratch)], "is a directory"),
    "data: missing train_file": (lambda c: [*c.base(), "--train_file", str(c.scratch / "no.csv")], "file not found"),
    "data: missing text column": (lambda c: [*c.base(), "--text_column", "review"], "data.text_column"),
    "data: labels out of range": (
        lambda c: [*c.base(), "--train_file", c.file("t.csv", "text,label\nw1,0\nw2,7\n")],
        "model.num_labels",
    ),
    "data: label names": (lambda c: [*c.base(), "--train_file", c.file("t.csv", "text,label\nw1,pos\n")], "integer"),
    "data: a fraction as a class id": (
        lambda c: [*c.base(), "--train_file", c.file("t.csv", "text,label\nw1,0\nw2,0.5\n")],
        "found 0.5 at row 2; for a numeric target set model.num_labels: 1 (model.problem_type: regression)",
    ),
    "data: a list label for single-label": (
        lambda c: [
            *c.base(),
            "--problem_type",
            "single_label_classification",
            "--train_file",
            c.file("t.jsonl", '{"text": "w1", "label": [0, 1]}\n'),
        ],
        "found the list [0, 1] at row 1; for several labels per text set model.problem_type: multi_label",
    ),  # fmt: skip
    "data: a word as a regression target": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            _regressor(c),
            "--num_labels",
            "1",
            "--train_file",
            c.file("t.csv", "text,label\nw1,0.5\nw2,high\n"),
        ],
        "t.csv must be numbers, found 'high' at row 2",
    ),
    "data: a list as a regression target": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            _regressor(c),
            "--num_labels",
            "1",
            "--problem_type",
            "regression",
            "--train_file",
            c.file("t.jsonl", '{"text": "w1", "label": 0.5}\n{"text": "w2", "label": [1, 2]}\n'),
        ],
        "regression trains one target per text",
    ),  # fmt: skip
    "data: a multi-label class id out of range": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            _regressor(c, num_labels=3),
            "--num_labels",
            "3",
            "--train_file",
            c.file("t.jsonl", '{"text": "w1", "label": [0, 2]}\n{"text": "w2", "label": [3]}\n'),
        ],
        "must be lists of class ids 0..2 (or multi-hot lists of 3 values in [0, 1]), found [3] at row 2",
    ),  # fmt: skip
    "model: regression with two outputs": (
        lambda c: [*c.base(), "--problem_type", "regression"],
        "model.num_labels: regression (from model.problem_type) trains one target, but model.num_labels is 2",
    ),
    "data: empty file": (lambda c: [*c.base(), "--train_file", c.file("t.csv", "")], "is empty"),
    "data: header only": (lambda c: [*c.base(), "--train_file", c.file("t.csv", "text,label\n")], "no data rows"),
    "data: unsupported type": (lambda c: [*c.base(), "--train_file", c.file("t.txt", "w1 1\n")], "unsupported file"),
    "data: split 100 percent": (lambda c: [*c.base(), "--validation_split_percentage", "100"], "(0, 100)"),
    "model: a classification setting for a language model": (
        lambda c: [*c.base(), "--task", "causal_lm", "--problem_type", "regression"],
        "model.problem_type is a classification setting and model.task is causal_lm; remove model.problem_type",
    ),
    "model: a family without a causal language model": (
        lambda c: [
            *c.base(),
            "--task",
            "causal_lm",
            "--model_name_or_path",
            c.model_variant(
                "distil", lambda p: _edit_json(p / "config.json", lambda j: j.update(model_type="distilbert"))
            ),
        ],
        "transformers has no causal lm model for model type 'distilbert'",
    ),  # fmt: skip
    "data: a language model's text column missing": (
        lambda c: [*c.base(), "--task", "causal_lm", "--text_column", "review"],
        "data.text_column",
    ),
    "data: fewer blocks than one global batch": (
        lambda c: [
            *c.base(),
            "--task",
            "causal_lm",
            "--per_device_train_batch_size",
            "512",
            "--model_name_or_path",
            c.model_variant(
                "eos", lambda p: _edit_json(p / "tokenizer_config.json", lambda j: j.update(eos_token="[CLS]"))
            ),
        ],
        "fewer than one global batch (512",
    ),  # fmt: skip
    "model: a language model's tokenizer without an end of text": (
        lambda c: [*c.base(), "--task", "causal_lm"],
        "has no eos token (nor sep), which ends every packed document; set eos_token in its tokenizer_config.json",
    ),
    # ------------------------------------------------------------------ model folder
    "model: config.json not JSON": (
        lambda c: [*c.base(), "--model_name_or_path", c.model_variant("m", lambda p: _truncate(p / "config.json"))],
        "not valid JSON",
    ),
    "model: no weights": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            c.model_variant("m", lambda p: (p / "model.safetensors").unlink()),
        ],
        "no weights file",
    ),
    "model: no tokenizer": (
        lambda c: [*c.base(), "--model_name_or_path", c.model_variant("m", lambda p: (p / "tokenizer.json").unlink())],
        "no tokenizer files",
    ),
    "model: damaged tokenizer.json": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            c.model_variant("m", lambda p: (p / "tokenizer.json").write_text('{"a": 1}')),
        ],
        "the tokenizer in",
    ),
    "model: num_labels against a trained head": (lambda c: [*c.base(), "--num_labels", "3"], "model.num_labels: 2"),
    "model: sizes the architecture rejects": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            c.model_variant("m", lambda p: _edit_json(p / "config.json", lambda d: d.update(num_attention_heads=3))),
        ],
        "buildable",
    ),
    "model: config sizes that do not match the weights": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            c.model_variant("m", lambda p: _edit_json(p / "config.json", lambda d: d.update(hidden_size=30))),
        ],
        "do not match",
    ),
    "model: no model_type": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            c.model_variant("m", lambda p: _edit_json(p / "config.json", lambda d: d.pop("model_type"))),
        ],
        "no model_type",
    ),
    "model: tokenizer larger than the vocabulary": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            str(save_model_folder(c.scratch / "small-vocab", vocab_size=20)),
        ],
        "vocab_size is 20",
    ),
    **{
        f"model: config.json with {key} {value!r}": (
            lambda c, key=key, value=value: [
                *c.base(),
                "--model_name_or_path",
                c.model_variant("m", lambda p: _edit_json(p / "config.json", lambda d: d.update({key: value}))),
            ],
            "config.json",
        )
        for key, value in (("num_hidden_layers", "two"), ("num_attention_heads", 0), ("vocab_size", 0))
    },
    "model: truncated weights": (
        lambda c: [
            *c.base(),
            "--model_name_or_path",
            c.model_variant("m", lambda p: _truncate(p / "model.safetensors")),
        ],
        "weights in",
    ),
    "model: not a model folder": (lambda c: [*c.base(), "--model_name_or_path", str(c.scratch)], "config.json"),
    "model: unknown embedded model": (lambda c: [*c.base(), "--model_name_or_path", "embedded:nope"], "embedded"),
    # ------------------------------------------------------------------ output_dir
    "output_dir: parent is a file": (
        lambda c: [*c.base(Path(c.file("f", "x")) / "out")],
        "is a file, not a directory",
    ),
    "output_dir: a file, with overwrite": (
        lambda c: [*c.base(Path(c.file("f", "x"))), "--overwrite_output_dir", "true"],
        "is a file",
    ),
    "output_dir: holds a different run": (lambda c: [*c.base(c.run), "--learning_rate", "1e-3"], "differs in"),
    "output_dir: holds a different model task": (
        lambda c: [*c.base(c.run), "--max_seq_length", "16"],
        "data.max_seq_length",
    ),
    "strategy: ZeRO on one process": (lambda c: [*c.base(c.run), "--strategy.name", "zero1"], "zero1"),
    "output_dir: not a run": (
        lambda c: [*c.base(Path(c.file("x", "x")).parent)],
        "holds no hftrain run",
    ),
    # ------------------------------------------------------------------ checkpoints and resume
    "resume: path that does not exist": (
        lambda c: [*c.base(c.run), "--resume_from_checkpoint", str(c.scratch / "nope")],
        "does not exist",
    ),
    "resume: external checkpoint": (
        lambda c: [*c.base(c.run), "--resume_from_checkpoint", str(c.run_copy() / STEP4)],
        "trust_external_checkpoint",
    ),
    "resume: latest with none": (lambda c: [*c.base(), "--resume_from_checkpoint", "latest"], "no complete"),
    "resume: checkpoint.json lacks a key": (
        lambda c: [*c.base(c.run_copy(_drop_topology)), "--resume_from_checkpoint", "latest"],
        "lacks 'topology'",
    ),
    "resume: checkpoint.json corrupted": (
        lambda c: [
            *c.base(c.run_copy(lambda r: _truncate(r / STEP4 / "checkpoint.json"))),
            "--resume_from_checkpoint",
            "latest",
        ],
        "corrupted",
    ),
    "resume: truncated state file": (
        lambda c: [
            *c.base(c.run_copy(lambda r: _truncate(r / STEP4 / "state" / "dcp" / "__0_0.distcp"))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "does not match its checksum",
    ),
    "resume: missing state file": (
        lambda c: [
            *c.base(c.run_copy(lambda r: (r / STEP4 / "state" / "dcp" / ".metadata").unlink())),
            "--resume_from_checkpoint",
            "auto",
        ],
        "is missing",
    ),
    "resume: folder that is not a checkpoint": (
        lambda c: [*c.base(c.run), "--resume_from_checkpoint", str(c.run / "model")],
        "not a complete hftrain checkpoint",
    ),
    "resume: changed global batch": (
        lambda c: [*c.base(c.run), "--per_device_train_batch_size", "4", "--resume_from_checkpoint", "auto"],
        "global batch from 8 to 4",
    ),
    "resume: latest after overwrite_output_dir": (
        lambda c: [
            *c.base(c.run),
            "--overwrite_output_dir",
            "true",
            "--use_lora",
            "true",
            "--resume_from_checkpoint",
            "latest",
        ],
        "starts a new run, which has no checkpoint yet",
    ),
    "resume: a checkpoint inside the output_dir that overwrite replaces": (
        lambda c: [
            *c.base(c.run_copy()),
            "--overwrite_output_dir",
            "true",
            "--learning_rate",
            "1e-3",
            "--resume_from_checkpoint",
            str(c.scratch / "run-copy" / STEP2),
        ],
        "overwrite_output_dir: true replaces",
    ),
    "resume: another run's checkpoint planted in checkpoints/": (
        lambda c: [*c.base(c.run_copy(_plant_foreign_step6)), "--resume_from_checkpoint", "auto"],
        "belongs to another run",
    ),
    "output_dir: holds this run, started again without resuming": (
        lambda c: [*c.base(c.run)],
        "already holds this run (checkpoints up to step_00000004); continue it with resume_from_checkpoint: auto",
    ),
    # ------------------------------------------------------------------ a checkpoint never runs code
    "resume: a planted pickle in the scheduler state (checksums recomputed)": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("custom_checkpoint_0.pkl", lambda p: p.write_bytes(planted_bytes())))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "custom_checkpoint_0.pkl holds a pickled object (posix.system) that could run code",
    ),
    "resume: a planted bare pickle as the optimizer state": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("dcp/.metadata", lambda p: p.write_bytes(planted_bytes("bare"))))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "dcp/.metadata holds a pickled object (posix.system)",
    ),
    "resume: a planted pickle as an RNG state": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("random_states_0.pkl", lambda p: p.write_bytes(planted_bytes())))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "random_states_0.pkl holds a pickled object",
    ),
    "resume: a planted pickle, trusted external checkpoint": (
        lambda c: [
            *c.base(c.run),
            "--trust_external_checkpoint",
            "true",
            "--resume_from_checkpoint",
            str(c.run_copy(_state_edit("dcp/.metadata", lambda p: p.write_bytes(planted_bytes("bare")))) / STEP4),
        ],
        "could run code",
    ),
    "export: a planted pickle from a folder named checkpoints/, without the flag": (
        lambda c: [
            "export",
            str(c.run_copy(_state_edit("custom_checkpoint_0.pkl", lambda p: p.write_bytes(planted_bytes()))) / STEP4),
            str(c.new),
        ],
        "is outside the run folder this command names; its custom_checkpoint_0.pkl, dcp/.metadata, "
        "random_states_0.pkl are pickles",
    ),
    "export: a planted pickle with --trust_external_checkpoint": (
        lambda c: [
            "export",
            str(c.run_copy(_state_edit("custom_checkpoint_0.pkl", lambda p: p.write_bytes(planted_bytes()))) / STEP4),
            str(c.new),
            "--trust_external_checkpoint",
        ],
        "could run code",
    ),
    "export: a planted pickle inside the run the command names": (
        lambda c: [
            "export",
            str(c.run_copy(_state_edit("dcp/.metadata", lambda p: p.write_bytes(planted_bytes("bare"))))),
            str(c.new),
        ],
        "could run code",
    ),
    # A checkpoint is a tree of regular files: a symlinked state/dcp whose .metadata plants code (the walk that
    # checks pickles never entered it, and torch's DCP reader unpickles it unrestricted) is refused before any
    # library reads a byte, by every command that reads a checkpoint, trusted or not.
    **{
        f"{command}: a symlinked state/dcp with a planted .metadata{how}": (
            lambda c, build=build: build(c, c.run_copy(symlinked_planted_dcp)),
            "state/dcp is a symbolic link",
        )
        for command, how, build in (
            ("resume", " (auto)", lambda c, r: [*c.base(r), "--resume_from_checkpoint", "auto"]),
            ("resume", " (latest)", lambda c, r: [*c.base(r), "--resume_from_checkpoint", "latest"]),
            (
                "resume",
                " (trusted external)",
                lambda c, r: [
                    *c.base(c.run),
                    "--trust_external_checkpoint",
                    "true",
                    "--resume_from_checkpoint",
                    str(r / STEP4),
                ],  # fmt: skip
            ),
            ("export", " (the run)", lambda c, r: ["export", str(r), str(c.new)]),
            (
                "export",
                " (trusted)",
                lambda c, r: ["export", str(r / STEP4), str(c.new), "--trust_external_checkpoint"],
            ),
            ("convert", " (the run)", lambda c, r: ["convert", str(r), str(c.new)]),
            (
                "convert",
                " (trusted)",
                lambda c, r: ["convert", str(r / STEP4), str(c.new), "--trust_external_checkpoint"],
            ),
        )
    },
    # A checkpoint of the per-strategy formats before the sharded one (the libraries' own files in state/, checksums
    # intact) is refused in one line by every command that reads a checkpoint, naming it and the fix.
    **{
        f"{command}: a checkpoint in the per-strategy format before the sharded one": (
            lambda c, build=build: build(c, c.run_copy(_as_pre_sharded)),
            "is in the per-strategy format of an hftrain from before the sharded one",
        )
        for command, build in (
            ("resume", lambda c, r: [*c.base(r), "--resume_from_checkpoint", "auto"]),
            ("export", lambda c, r: ["export", str(r), str(c.new)]),
            ("convert", lambda c, r: ["convert", str(r), str(c.new)]),
        )
    },
    # ------------------------------------------------------------------ damaged state behind good checksums
    "resume: garbage optimizer state": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("dcp/__0_0.distcp", lambda p: p.write_bytes(b"\x00 not a state" * 9)))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "(truncated, or the .metadata is forged)",
    ),
    "resume: truncated optimizer state": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("dcp/__0_0.distcp", _truncate))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "(truncated, or the .metadata is forged)",
    ),
    "resume: weights missing a key": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("dcp/.metadata", _drop_a_weight))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "does not load into this run",
    ),
    "resume: a weight of another shape": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("dcp/.metadata", _reshape_a_weight))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "does not load into this run",
    ),
    "resume: garbage weights file": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("dcp/.metadata", lambda p: p.write_bytes(b"{garbage")))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "dcp/.metadata is damaged",
    ),
    "resume: an RNG state of the wrong structure": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("random_states_0.pkl", lambda p: __import__("torch").save({"x": 1}, p)))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "not Accelerate's RNG states",
    ),
    "resume: the RNG state missing (and unlisted)": (
        lambda c: [
            *c.base(c.run_copy(_state_edit("random_states_0.pkl", lambda p: p.unlink()))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "random_states_0.pkl is missing",
    ),
    "resume: files is an empty list": (
        lambda c: [
            *c.base(c.run_copy(_marker_edit(lambda d: d.update(files=[])))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "damaged 'files'",
    ),
    "resume: global_step is a string": (
        lambda c: [
            *c.base(c.run_copy(_marker_edit(lambda d: d["trainer_state"].update(global_step="four")))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "damaged 'trainer_state.global_step' ('four' is not an integer >= 0)",
    ),
    "resume: micro_step is negative": (
        lambda c: [
            *c.base(c.run_copy(_marker_edit(lambda d: d["trainer_state"].update(micro_step=-5)))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "damaged 'trainer_state.micro_step'",
    ),
    "resume: world_size is a string": (
        lambda c: [
            *c.base(c.run_copy(_marker_edit(lambda d: d["topology"].update(world_size="two")))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "damaged 'topology.world_size'",
    ),
    "resume: trainer_state with an unknown key": (
        lambda c: [
            *c.base(c.run_copy(_marker_edit(lambda d: d["trainer_state"].update(steps_left=3)))),
            "--resume_from_checkpoint",
            "auto",
        ],
        "unknown key 'steps_left'",
    ),
    # ------------------------------------------------------------------ forged counters and state (resealed)
    **{
        f"resume: forged {what}": (
            lambda c, edit=edit: [*c.base(c.run_copy(edit)), "--resume_from_checkpoint", "auto"],
            fragment,
        )
        for what, edit, fragment in (
            ("global_step 10**18", _marker_edit(lambda d: d["trainer_state"].update(global_step=10**18)), "disagree"),
            (
                "global_step 1 inside step 4",
                _marker_edit(lambda d: d["trainer_state"].update(global_step=1)),
                "disagree",
            ),  # fmt: skip
            ("step 6 inside step 4", _marker_edit(lambda d: d.update(step=6)), "disagree"),
            ("step 100 throughout (folder, step, global_step)", _as_step(100), "beyond this run's 4 steps"),
            (
                "micro_step 10**9",
                _marker_edit(lambda d: d["trainer_state"].update(micro_step=10**9)),
                "beyond the end of an epoch",
            ),  # fmt: skip
            (
                "micro_step one batch beyond the epoch",
                _marker_edit(lambda d: d["trainer_state"].update(micro_step=8)),
                "beyond the end of an epoch",
            ),  # fmt: skip
            ("epoch 99", _marker_edit(lambda d: d["trainer_state"].update(epoch=99)), "not a position of this run"),
            ("config []", _marker_edit(lambda d: d.update(config=[])), "damaged 'config'"),
            (
                "log_history step 'x'",
                _marker_edit(lambda d: d["trainer_state"].update(log_history=[{"step": "x"}])),
                "damaged 'trainer_state.log_history'",
            ),  # fmt: skip
            (
                "topology.strategy 'zzz'",
                _marker_edit(lambda d: d["topology"].update(strategy="zzz")),
                "topology.strategy 'zzz' is not a strategy",
            ),  # fmt: skip
            ("checkpoint.json []", lambda r: (r / STEP4 / "checkpoint.json").write_text("[]"), "not a JSON object"),
            (
                "sharded.json strategy 5",
                _json_edit("sharded.json", lambda d: d.update(strategy=5)),
                "records strategy 5",
            ),  # fmt: skip
            (
                "sharded.json world_size -7",
                _json_edit("sharded.json", lambda d: d.update(world_size=-7)),
                "world_size -7 is not an integer >= 1",
            ),  # fmt: skip
            (
                "sharded.json world_size 3",
                _json_edit("sharded.json", lambda d: d.update(world_size=3)),
                "records world_size 3, checkpoint.json's topology 1",
            ),  # fmt: skip
            ("sharded.json deleted", _state_edit("sharded.json", lambda p: p.unlink()), "sharded.json is missing"),
            ("optimizer.json lr a string", _groups_edit(lr="0.001"), "param_groups[0].lr '0.001' is not a finite"),
            ("optimizer.json lr -1", _groups_edit(lr=-1), "param_groups[0].lr -1 is negative"),
            ("optimizer.json betas strings", _groups_edit(betas=["0.9", "0.999"]), "is not a list of 2 numbers"),
            ("optimizer.json weight_decay a string", _groups_edit(weight_decay="0"), "weight_decay '0' is not a"),
            (
                "RNG state with Accelerate's keys, wrong types",
                _state_edit("random_states_0.pkl", _rng_with_wrong_types),
                "random_state is not a state its generator takes",
            ),  # fmt: skip
            (
                "tensor record that is a pickle",
                _state_edit("dcp/.metadata", _tensor_record_as_a_pickle),
                "a tensor record holds something else",
            ),  # fmt: skip
        )
    },
    # ------------------------------------------------------------------ export
    "export: process count other than the checkpoint's": (
        lambda c: ["export", str(c.run_copy(_marker_edit(lambda d: d["topology"].update(world_size=2)))), str(c.new)],
        "was written by 2 processes and this export runs on 1; launch it on 2 processes",
    ),
    "export: --merge_lora of a run without LoRA": (
        lambda c: ["export", str(c.run), str(c.new), "--merge_lora"],
        "there is no adapter to merge; drop --merge_lora",
    ),
    "export: into a file": (lambda c: ["export", str(c.run / STEP4), c.file("f", "x")], "is a file"),
    "export: under a file": (lambda c: ["export", str(c.run / STEP4), c.file("f", "x") + "/out"], "not a directory"),
    "export: into a non-empty folder": (lambda c: ["export", str(c.run / STEP4), str(c.run)], "not empty"),
    "export: into the run it exports": (
        lambda c: ["export", str(c.run), str(c.run / "exported")],
        "/run', which holds the checkpoint it reads",
    ),
    "export: into the checkpoint's state/": (
        lambda c: ["export", str(c.run / STEP4), str(c.run / STEP4 / "state" / "exported"), "--output_dir", str(c.run)],
        "/run/checkpoints/step_00000004', which holds the checkpoint it reads",
    ),
    "export: a run folder with no checkpoint yet": (
        lambda c: ["export", str(_fresh_run(c)), str(c.new)],
        "holds no complete checkpoint in checkpoints/ (the run stopped before its first save): nothing to export",
    ),
    "export: checkpoint that does not exist": (
        lambda c: ["export", str(c.scratch / "nope"), str(c.new)],
        "does not exist",
    ),
    "export: checkpoint lacking a key": (
        lambda c: ["export", str(c.run_copy(_drop_topology) / STEP4), str(c.new)],
        "lacks 'topology'",
    ),
}


def _regressor(ctx: Ctx, num_labels: int = 1) -> str:
    """A tiny BERT folder whose trained head has ``num_labels`` outputs (the good run's has 2)."""
    return str(save_model_folder(ctx.scratch / f"head{num_labels}", num_labels=num_labels))


def _refused(ctx: Ctx, argv: list[str], fragment: str, stderr: str, code: int) -> None:
    assert_refused(stderr, code, fragment)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_nothing_written(good, tmp_path, capsys, monkeypatch, case):
    monkeypatch.chdir(tmp_path)  # anything written to a relative default path would land here
    ctx = Ctx(model=good.model, data=good.data, run=good.run, scratch=tmp_path, new=tmp_path / "new-run")
    build, fragment = CASES[case]
    argv = build(ctx)
    before = {d: checksums(d) for d in [ctx.run, *ctx.watched]}
    listing = sorted(p.name for p in tmp_path.iterdir())
    reset_accelerate_state()
    capsys.readouterr()
    code = main(argv)
    _refused(ctx, argv, fragment, capsys.readouterr().err, code)
    assert {d: checksums(d) for d in before} == before
    assert not ctx.new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # nothing new beside the inputs either


def test_at_least_40_bad_inputs_in_every_category():
    assert len(CASES) >= 40
    categories = {case.split(":")[0] for case in CASES}
    assert categories >= {"config", "cli", "strategy", "data", "model", "output_dir", "resume", "export"}


# ---------------------------------------------------------------------- the real process: exit code 2, one line
SUBPROCESS_CASES = {
    "config is a directory": (lambda c: ["train", "--config", str(c.scratch)], "is a directory"),
    "export into a file": (lambda c: ["export", str(c.run / STEP4), c.file("f", "x")], "is a file"),
    "resume refused after the model is built": (
        lambda c: [*c.base(c.run), "--per_device_train_batch_size", "4", "--resume_from_checkpoint", "auto"],
        "global batch",
    ),
}


@pytest.mark.parametrize("case", list(SUBPROCESS_CASES))
def test_bad_input_exits_2_from_the_console_entry(good, tmp_path, case):
    ctx = Ctx(model=good.model, data=good.data, run=good.run, scratch=tmp_path, new=tmp_path / "new-run")
    build, fragment = SUBPROCESS_CASES[case]
    argv = build(ctx)
    before = checksums(ctx.run)
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", *argv], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    _refused(ctx, argv, fragment, done.stderr, done.returncode)
    assert checksums(ctx.run) == before
    assert not ctx.new.exists()


# ---------------------------------------------------------------------- what users expect to work
def _train(argv: list[str]) -> int:
    reset_accelerate_state()
    return main(argv)


def _trainer_state(run: Path) -> dict:
    return json.loads((run / "trainer_state.json").read_text())


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_extending_a_finished_run_equals_training_longer(good, tmp_path, capsys):
    """4 steps then extended to 6 (resume auto) gives the weights of 6 steps in one go (constant LR)."""
    import torch

    ctx = Ctx(model=good.model, data=good.data, run=tmp_path / "run", scratch=tmp_path, new=tmp_path / "straight")
    constant = ["--lr_scheduler_type", "constant", "--eval_steps", "2", "--logging_steps", "1"]
    assert _train([*ctx.base(ctx.run), *constant]) == 0
    extended = [*ctx.base(ctx.run), *constant, "--max_steps", "6", "--resume_from_checkpoint", "auto"]
    assert _train([*extended, "--save_steps", "3", "--eval_steps", "3"]) == 0  # cadence may change too
    assert "resumed from" in capsys.readouterr().out
    assert _train([*ctx.base(ctx.new), *constant, "--max_steps", "6"]) == 0
    assert _trainer_state(ctx.run)["global_step"] == 6
    a, b = _weights(ctx.run / "model"), _weights(ctx.new / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (ctx.run / "checkpoints/step_00000006/checkpoint.json").is_file()
    assert not list(ctx.run.glob(".staging-*")) and not list(ctx.run.glob(".previous-*"))


def test_overwrite_starts_a_clean_run_and_auto_resumes_that_run(good, tmp_path, capsys):
    """The overwrite/resume bug: run 1 (lr 1e-3, steps 2 and 4), run 2 over it (lr 1e-5, overwrite, step 2),
    then run 2 extended with auto: it must continue run 2, not run 1's newer step 4."""
    ctx = Ctx(model=good.model, data=good.data, run=tmp_path / "run", scratch=tmp_path, new=tmp_path / "unused")
    assert _train([*ctx.base(ctx.run), "--learning_rate", "1e-3"]) == 0
    first_id = yaml_run_id(ctx.run)
    capsys.readouterr()
    second = [*ctx.base(ctx.run), "--learning_rate", "1e-5", "--max_steps", "2"]
    assert _train([*second, "--overwrite_output_dir", "true"]) == 0
    out = capsys.readouterr().out
    assert "overwrite_output_dir: removed the earlier run's checkpoints, model" in out
    second_id = yaml_run_id(ctx.run)
    assert second_id != first_id
    assert sorted(p.name for p in (ctx.run / "checkpoints").iterdir()) == ["step_00000002"]
    assert json.loads((ctx.run / STEP2 / "checkpoint.json").read_text())["run_id"] == second_id
    assert _train([*second, "--max_steps", "6", "--resume_from_checkpoint", "auto"]) == 0
    assert f"resumed from {ctx.run / STEP2} at step 2" in capsys.readouterr().out
    history = _trainer_state(ctx.run)["log_history"]
    rates = [h["learning_rate"] for h in history if "learning_rate" in h]
    assert len(rates) == 6 and max(rates) <= 1e-5, rates  # run 2's schedule throughout, none of run 1's 1e-3
    assert yaml_run_id(ctx.run) == second_id
    assert all(
        json.loads((p / "checkpoint.json").read_text())["run_id"] == second_id
        for p in (ctx.run / "checkpoints").iterdir()
    )
    # Overwriting with auto over a different run starts fresh; the same run with auto continues, overwrite or not.
    assert (
        _train([*second, "--max_steps", "6", "--resume_from_checkpoint", "auto", "--overwrite_output_dir", "true"]) == 0
    )
    assert "resumed from" in capsys.readouterr().out and yaml_run_id(ctx.run) == second_id


def yaml_run_id(run: Path) -> str:
    import yaml

    return yaml.safe_load((run / "hftrain_config.yaml").read_text())["run_id"]


def test_a_moved_run_resumes_where_it_now_lives(good, tmp_path, capsys):
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(good.run, moved)
    ctx = Ctx(model=good.model, data=good.data, run=good.run, scratch=tmp_path, new=tmp_path / "unused")
    before = checksums(good.run)
    assert _train([*ctx.base(moved), "--max_steps", "6", "--resume_from_checkpoint", "auto"]) == 0
    assert f"resumed from {moved}/{STEP4}" in capsys.readouterr().out
    assert _trainer_state(moved)["global_step"] == 6
    reset_accelerate_state()
    assert (
        main(
            ["export", str(moved / "checkpoints/step_00000006"), str(tmp_path / "exported"), "--output_dir", str(moved)]
        )
        == 0
    )
    reset_accelerate_state()
    assert main(["export", str(moved), str(tmp_path / "latest")]) == 0  # a run folder: its latest checkpoint
    reset_accelerate_state()  # a checkpoint outside any run the command names, trusted by the flag
    assert (
        main(["export", str(moved / "checkpoints/step_00000006"), str(tmp_path / "t"), "--trust_external_checkpoint"])
        == 0
    )
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    assert checksums(good.run) == before  # the original is untouched


def test_a_trusted_checkpoint_in_a_folder_of_any_name_resumes_exactly(good, tmp_path, capsys):
    """A step-2 checkpoint copied to ``backup-of-step-two`` and resumed into a new run with the trust flag trains
    steps 3 and 4 to the weights of the straight 4-step run (it stopped with an IndexError after two steps when the
    step was read from the folder name), and the run's own checkpoints are named by their steps."""
    import torch

    backup = tmp_path / "backup-of-step-two"
    shutil.copytree(good.run / STEP2, backup)
    ctx = Ctx(model=good.model, data=good.data, run=good.run, scratch=tmp_path, new=tmp_path / "continued")
    resumed = [*ctx.base(ctx.new), "--resume_from_checkpoint", str(backup), "--trust_external_checkpoint", "true"]
    assert _train(resumed) == 0
    assert f"resumed from {backup} at step 2" in capsys.readouterr().out
    assert sorted(p.name for p in (ctx.new / "checkpoints").iterdir()) == ["step_00000004"]
    a, b = _weights(good.run / "model"), _weights(ctx.new / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_texts_longer_than_the_model_takes_are_truncated_to_its_limit(good, tmp_path, capsys):
    """The default max_seq_length (128) is above the tiny model's 64 positions: clamped with a note, no crash."""
    texts, labels = synthetic_texts(40)
    data = tmp_path / "long.csv"
    with data.open("w", newline="") as handle:
        csv.writer(handle).writerows(
            [("text", "label"), *((" ".join([t] * 12), y) for t, y in zip(texts, labels, strict=True))]
        )
    ctx = Ctx(model=good.model, data=data, run=tmp_path / "run", scratch=tmp_path, new=tmp_path / "unused")
    assert _train([*ctx.base(ctx.run), "--max_steps", "2"]) == 0
    assert "data.max_seq_length 128 exceeds what the model takes (64 tokens); truncating texts to 64" in (
        capsys.readouterr().out
    )
    # the config keeps what the user asked for, so rerunning the same command is the same run
    assert "max_seq_length: 128" in (ctx.run / "hftrain_config.yaml").read_text()


def test_fp16_is_refused_on_cpu_only():
    from hftrain.errors import ConfigError
    from hftrain.strategies.platform import Platform

    with pytest.raises(ConfigError, match="use bf16 on CPU"):
        Platform(device="cpu", backend="gloo").check_precision("fp16")
    for precision in ("no", "bf16"):
        Platform(device="cpu", backend="gloo").check_precision(precision)
    Platform(device="cuda", backend="nccl").check_precision("fp16")


def test_list_fields_from_the_command_line():
    from hftrain.config import load_config

    for args in (["query", "value"], ["query,value"], ["query,", "value"]):
        assert load_config(None, ["--lora_target_modules", *args]).lora.lora_target_modules == ["query", "value"]
    assert load_config(None, ["--lora.lora_target_modules=query,value"]).lora.lora_target_modules == [
        "query",
        "value",
    ]
    assert load_config(None, ["--lora_target_modules", "null"]).lora.lora_target_modules is None
    # the README's own example, then a scalar after it
    config = load_config(None, ["--use_lora", "true", "--lora_target_modules", "query", "value", "--lora_r", "4"])
    assert config.lora.lora_target_modules == ["query", "value"] and config.lora.lora_r == 4


def test_a_non_finite_loss_stops_at_its_step_without_a_checkpoint(good, tmp_path, capsys):
    """A finite but absurd learning rate: the loss is fine at step 1, infinite or NaN from step 2."""
    ctx = Ctx(model=good.model, data=good.data, run=tmp_path / "run", scratch=tmp_path, new=tmp_path / "unused")
    argv = [*ctx.base(ctx.run), "--learning_rate", "1e30", "--save_steps", "1", "--max_grad_norm", "0"]
    code = _train(argv)
    err = capsys.readouterr().err
    _refused(ctx, argv, "training loss is", err, code)
    step = int(err.split(" at step ")[1].split(";")[0])
    kept = sorted(p.name for p in (ctx.run / "checkpoints").iterdir())
    assert kept == [f"step_{s:08d}" for s in range(1, step)], (step, kept)  # every checkpoint before, none at it
    assert f"the last complete checkpoint is {ctx.run / 'checkpoints' / f'step_{step - 1:08d}'}" in err
    assert not (ctx.run / "model").exists()


def test_lr_inf_is_refused_before_anything_is_written(good, tmp_path, capsys):
    ctx = Ctx(model=good.model, data=good.data, run=tmp_path / "run", scratch=tmp_path, new=tmp_path / "unused")
    assert _train([*ctx.base(ctx.run), "--learning_rate", "inf"]) == 2
    assert "training.learning_rate: must be a finite number" in capsys.readouterr().err
    assert not ctx.run.exists()


def test_a_failed_start_does_not_block_the_corrected_command(good, tmp_path, capsys):
    """A start that died before its first checkpoint leaves a config; the corrected command must still run."""
    ctx = Ctx(model=good.model, data=good.data, run=tmp_path / "run", scratch=tmp_path, new=tmp_path / "unused")
    argv = [*ctx.base(ctx.run), "--learning_rate", "1e30", "--max_grad_norm", "0"]
    assert _train(argv) == 2  # non-finite loss at step 2, before the first save (step 2 is never written)
    assert (ctx.run / "hftrain_config.yaml").is_file() and not (ctx.run / "checkpoints").exists()
    assert _train(ctx.base(ctx.run)) == 0


# ---------------------------------------------------------------------- a real full / read-only disk


def _fill(disk: Path, leave_bytes: int) -> None:
    """Fill ``disk`` until about ``leave_bytes`` stay free."""
    import os

    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    filler = disk / f"filler-{len(list(disk.glob('filler-*')))}"
    filler.write_bytes(b"\0" * max(0, free - leave_bytes))


def test_disk_full_keeps_the_last_checkpoint_and_stages_the_export(good, tmp_path, tmpfs, capsys):
    disk = tmpfs("disk", "size=4m")
    run = disk / "run"
    ctx = Ctx(model=good.model, data=good.data, run=run, scratch=tmp_path, new=tmp_path / "unused")
    assert _train([*ctx.base(run), "--max_steps", "2"]) == 0
    _fill(disk, 120_000)  # a checkpoint takes ~340 kB, the export ~100 kB
    before, exported = checksums(run / STEP2), checksums(run / "model")
    argv = [*ctx.base(run), "--max_steps", "4", "--resume_from_checkpoint", "auto"]
    code = _train(argv)
    err = capsys.readouterr().err
    _refused(ctx, argv, "no space left on device while writing checkpoint step 4", err, code)
    assert f"the last complete checkpoint is {run / STEP2}" in err
    assert checksums(run / STEP2) == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]  # no staging left
    # The export written beside the failed checkpoint was not published: the step-2 export is still the model.
    assert exported and checksums(run / "model") == exported and not list(run.glob(".staging-*"))
    # The export: staged, so a full disk leaves no folder that looks complete.
    _fill(disk, 40_000)
    reset_accelerate_state()
    code = main(["export", str(run), str(disk / "exported")])
    err = capsys.readouterr().err
    _refused(ctx, [], "no space left on device while writing the export", err, code)
    assert not (disk / "exported").exists() and not list(disk.glob(".staging-*"))


def test_read_only_output_dir_is_refused_up_front(good, tmp_path, tmpfs, capsys):
    disk = tmpfs("ro", "size=1m,ro")
    ctx = Ctx(model=good.model, data=good.data, run=disk / "run", scratch=tmp_path, new=tmp_path / "unused")
    for argv in (ctx.base(disk / "run"), ctx.base(disk), ["export", str(good.run / STEP4), str(disk / "exported")]):
        code = _train(argv)
        _refused(ctx, argv, "is not writable", capsys.readouterr().err, code)
    assert list(disk.iterdir()) == []


@pytest.mark.distributed
def test_disk_full_on_two_processes_stops_both_with_one_message(good, tmp_path, tmpfs):
    """Rank 0 cannot write the checkpoint; rank 1 learns of it at the next agreement instead of hanging."""
    from tests.distributed import run_distributed

    disk = tmpfs("disk", "size=4m")
    run = disk / "run"
    ctx = Ctx(model=good.model, data=good.data, run=run, scratch=tmp_path, new=tmp_path / "unused")
    assert _train([*ctx.base(run), "--max_steps", "2"]) == 0  # 1 process x micro 8
    _fill(disk, 120_000)
    before = checksums(run / STEP2)
    # 2 processes x micro 4: the same global batch, so the DDP checkpoint reshards.
    argv = [
        *ctx.base(run),
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--resume_from_checkpoint",
        "auto",
    ]
    results = run_distributed(cli_in_process, nprocs=2, timeout=300, argv=argv)
    for code, err in results:  # rank 1 says that another process could not write
        _refused(ctx, argv, "checkpoint step 4", err, code)
    assert (
        f"no space left on device while writing checkpoint step 4 ({run / 'checkpoints/step_00000004'}); "
        in (results[0][1])
    )
    assert checksums(run / STEP2) == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


# ---------------------------------------------------------------------- the rule itself
def test_boundaries_convert_input_failures_and_nothing_else(tmp_path):
    import errno

    from hftrain.errors import ConfigError, WriteError, reading, writing

    with pytest.raises(ConfigError, match=r"^data.x: file f: missing key 'k'; fix it$"):
        with reading("data.x: file f", "fix it", catch=(KeyError,)):
            raise KeyError("k")
    with pytest.raises(ZeroDivisionError):  # not an input failure: a bug keeps its type and traceback
        with reading("data.x", "fix it"):
            _ = 1 / 0
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(WriteError, match="no space left on device while writing x; the last complete checkpoint is c"):
        with writing("x", location=tmp_path, last_checkpoint=lambda: "c"):
            raise full
    with pytest.raises(WriteError, match="cannot write x: Read-only file system"):
        with writing("x", location=tmp_path):
            raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))
    with pytest.raises(RuntimeError, match="a bug"):  # plenty of space here: not a write failure
        with writing("x", location=tmp_path, catch=(Exception,)):
            raise RuntimeError("a bug")


def test_a_bug_still_shows_its_traceback():
    code = "from hftrain import cli; cli.COMMANDS['env'] = lambda args, extra: 1 / 0; cli.main(['env'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ZeroDivisionError" in done.stderr and "hftrain: error" not in done.stderr
