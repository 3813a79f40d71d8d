"""Short runs without a fixed tax (issue 22): what the end of a run and its setup cost, made impossible to regress.

The wall-clock figures are ``benchmarks/end_to_end.py --sizes``'s; these tests hold the mechanisms: the garbage
collector paused while a job sets up and its survivors frozen (and thawed for a notebook), the last checkpoint
written after the final evaluation on a CPU (so it holds that evaluation) and beside it where writes are free, an
evaluation that casts each weight to bf16 once, a checkpoint whose files carry no zip CRC-32.
"""

from __future__ import annotations

import gc
import json
import weakref
import zipfile
from pathlib import Path

import pytest
import torch

from hftrain.job import collections_paused_while_setting_up
from tests.tiny import reset_accelerate_state, run_tiny_training


def test_the_collector_is_paused_while_a_job_sets_up_then_its_survivors_are_frozen():
    assert gc.isenabled() and gc.get_freeze_count() == 0

    class Node:
        pass

    with collections_paused_while_setting_up() as collector:
        assert not gc.isenabled()  # libraries and model load without full collections
        survivor = [Node() for _ in range(100)]
        garbage = Node()
        garbage.itself = garbage  # a cycle the setup left behind: freed before the freeze, not frozen
        dead = weakref.ref(garbage)
        del garbage
        collector.set_up()
        assert dead() is None
        assert gc.isenabled() and gc.get_freeze_count() >= len(survivor)  # skipped by every later collection
    assert gc.isenabled() and gc.get_freeze_count() == 0  # a notebook's process collects as usual afterwards

    with collections_paused_while_setting_up(thaw=False) as collector:  # the CLI: the process exits next
        collector.set_up()
    assert gc.get_freeze_count() > 0
    gc.unfreeze()

    with collections_paused_while_setting_up(thaw=False) as collector:  # several processes: close must collect
        collector.set_up()
        collector.thaw()
        assert gc.get_freeze_count() == 0

    with pytest.raises(RuntimeError), collections_paused_while_setting_up():  # a failed setup: nothing left paused
        raise RuntimeError("bad input")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def _last_checkpoint_state(result: dict) -> dict:
    return json.loads((Path(result["checkpoint"]) / "checkpoint.json").read_text())["trainer_state"]


def test_on_a_cpu_the_last_checkpoint_is_written_after_the_final_evaluation_and_holds_it(tmp_path):
    result = run_tiny_training(steps=4, output_dir=str(tmp_path / "cpu"))
    state = _last_checkpoint_state(result)
    assert state["global_step"] == 4 and state["last_eval_step"] == 4
    assert "eval_loss" in state["log_history"][-1]


def test_where_writes_are_free_the_last_checkpoint_is_written_beside_the_final_evaluation(tmp_path, monkeypatch):
    from hftrain.strategies.platform import Platform

    monkeypatch.setattr(Platform, "writes_beside_compute", property(lambda self: True))  # as on a GPU
    result = run_tiny_training(steps=4, output_dir=str(tmp_path / "gpu"))
    state = _last_checkpoint_state(result)
    assert state["global_step"] == 4 and state["last_eval_step"] < 4  # started before the evaluation ran
    assert result["metrics"]["eval_samples"] == 25


def _casts_of(weight: torch.Tensor, evaluate) -> int:
    """How many times ``evaluate()`` casts ``weight`` to bf16 (seen below autocast, where the casts dispatch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
                if args[0].shape == weight.shape and torch.equal(args[0], weight):
                    Casts.count += 1
            return func(*args, **kwargs)

    with Casts():
        evaluate()
    return Casts.count


def test_an_evaluation_casts_each_weight_to_bf16_once(tmp_path):
    def casts(trainer):
        weight = trainer.accelerator.unwrap_model(trainer.model).bert.encoder.layer[0].attention.self.query.weight
        batches = len(trainer.eval_loader)
        return batches, _casts_of(weight.detach(), trainer.evaluate)

    result = run_tiny_training(steps=1, mixed_precision="bf16", output_dir=str(tmp_path / "run"), inspect=casts)
    batches, count = result["inspected"]
    assert batches == 5 and count == 1  # 25 rows in batches of 5: once per evaluation, not once per batch


def test_checkpoint_files_carry_no_zip_crc_and_torch_save_keeps_its_own(tmp_path):
    import io

    from torch.distributed.checkpoint import FileSystemReader

    result = run_tiny_training(steps=2, output_dir=str(tmp_path / "run"))
    dcp_dir = Path(result["checkpoint"]) / "state" / "dcp"
    stored = FileSystemReader(str(dcp_dir)).read_metadata().storage_data.values()
    item = max(stored, key=lambda info: info.length)  # the largest tensor: one torch.save zip in its shard file
    with (dcp_dir / item.relative_path).open("rb") as handle:
        handle.seek(item.offset)
        records = zipfile.ZipFile(io.BytesIO(handle.read(item.length))).infolist()
    assert records and all(record.CRC == 0 for record in records if record.file_size)  # SHA-256/XXH3 covers it
    torch.save(torch.ones(4), tmp_path / "user.pt")  # the option was restored after the write
    with zipfile.ZipFile(tmp_path / "user.pt") as archive:
        assert all(record.CRC != 0 for record in archive.infolist() if record.file_size)


def _mapped_ranges(name: str) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of files called ``name``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("/" + name):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_trained_parameters_do_not_alias_the_weights_file(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hftrain.config import load_config
    from hftrain.job import prepare_job
    from hftrain.models import resolve_model_path
    from hftrain.strategies import LaunchInfo

    def in_the_file(params) -> int:
        ranges = _mapped_ranges("model.safetensors")
        return sum(any(a <= p.data_ptr() < b for a, b in ranges) for p in params)

    # transformers maps the weights file copy-on-write and its tensors are views of it: the first optimizer step
    # would fault in every page of every parameter it writes
    plain = AutoModelForSequenceClassification.from_pretrained(resolve_model_path("embedded:minilm"), num_labels=2)
    assert in_the_file(plain.parameters()) > 0
    config = load_config(None, ["--output_dir", str(tmp_path / "run"), "--max_train_samples", "8"])
    reset_accelerate_state()  # the Accelerator of an earlier test in this process
    trainer, _, _ = prepare_job(config, LaunchInfo(), write=False)
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert len(trained) > 100 and in_the_file(trained) == 0
    trainer.close()
    reset_accelerate_state()
