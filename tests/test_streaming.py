"""Streaming training data (``data.streaming``): a sharded JSONL read as a ``datasets`` IterableDataset, packed on the
fly, dealt over the data-parallel ranks, and resumed exactly.

- One process: the stream trains as a map-style run fed the same blocks in the same order (fp32, within 1e-6).
- Two gloo processes (DDP): a run stopped at a step and resumed, and a run SIGKILLed at a step and resumed from its
  last checkpoint, equal the uninterrupted run: every step's loss, the final weights, and the sequence of blocks each
  rank trained on (hashes of every consumed block: none skipped, none repeated).
- Bad input: a malformed line in the middle of a shard, and a shard deleted while the run goes on, each stop every rank
  with one ``DataError`` line (exit code 2) naming the file (and the line), and the last checkpoint stays complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import WORDS, reset_accelerate_state, tiny_tokenizer

BLOCK = 32
EVAL_DOCUMENTS = 6


def write_shards(folder: Path, *, shards: int = 4, documents: int = 30, seed: int = 0) -> Path:
    """``shards`` JSONL files of plain text in ``folder``: documents counting up through ``WORDS`` (learnable), 2 to
    70 words (some longer than a block: they continue over blocks), with blank lines and rows without text between."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        lines = []
        for i in range(documents):
            start, length = rng.randrange(len(WORDS)), rng.choice([2, 5, 9, 14, 20, 45, 70])
            lines.append(json.dumps({"text": " ".join(WORDS[(start + k) % len(WORDS)] for k in range(length))}))
            if i % 11 == 3:
                lines.append(json.dumps({"text": "   "}))  # blank: dropped and counted
            if i % 13 == 5:
                lines.append("")  # an empty line is no row
        (folder / f"part-{shard:02d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _tokenizer():
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _model_init():
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    return AutoModelForCausalLM.from_config(tiny_config("llama", max_positions=BLOCK * 4))


def _args(output_dir: str, **changes):
    from hftrain.config import TrainingConfig

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=8,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        log_with="none",
        mixed_precision="no",
        train_sampling_strategy="sequential",
    )
    return TrainingConfig(**{**settings, **changes})


def _stream(data: Path):
    from hftrain.config.schema import DataConfig
    from hftrain.data.packing import BlockRules
    from hftrain.data.streaming import stream_train_split

    tokenizer = _tokenizer()
    section = DataConfig(train_file=str(data), streaming=True, max_eval_samples=EVAL_DOCUMENTS)
    return tokenizer, stream_train_split(section, tokenizer, BlockRules.of(tokenizer, BLOCK), log=lambda _: None)


def block_hash(ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> str:
    data = torch.stack([ids, labels, positions]).to(torch.int64).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _recording_trainer():
    """A causal-LM trainer that appends ``step hash`` of every block it trains on to a file (flushed per line, so a
    SIGKILL keeps what was trained), and can SIGKILL its own process after a step."""
    from hftrain.trainers.language import CausalLMTrainer

    class Recording(CausalLMTrainer):
        record: Path | None = None
        kill_at: int | None = None
        delete_at: tuple[int, Path] | None = None

        def train_step(self, batch):
            if self.record is not None:
                with open(self.record, "a") as out:
                    for row in range(batch["input_ids"].shape[0]):
                        digest = block_hash(batch["input_ids"][row], batch["labels"][row], batch["position_ids"][row])
                        out.write(f"{self.state.global_step + 1} {digest}\n")
            return super().train_step(batch)

        def _on_step_end(self, preemption, stop_at_step):
            stopped = super()._on_step_end(preemption, stop_at_step)
            if self.delete_at is not None and self.state.global_step == self.delete_at[0]:
                if self.accelerator.is_main_process:
                    self.delete_at[1].unlink()
                self.runtime.wait_for_everyone()
            if self.state.global_step == self.kill_at:
                self.wait_for_checkpoint()  # the kill lands after a step, not inside a save being written
                os.kill(os.getpid(), signal.SIGKILL)
            return stopped

    return Recording


def run_stream(*, data: str, output_dir: str, record_dir: str | None = None, resume: bool = False,
               stop_at_step: int | None = None, kill_at: int | None = None, delete_at: tuple | None = None,
               **changes) -> dict:  # fmt: skip
    """Train on the stream of ``data`` in this process group; the losses, the final weights, the step resumed from."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.errors import HFTrainError
    from hftrain.strategies import strategy_from_options

    reset_accelerate_state()
    tokenizer, splits = _stream(Path(data))
    args = _args(output_dir, resume_from_checkpoint="latest" if resume else None, **changes)
    trainer = _recording_trainer()(
        args,
        strategy=strategy_from_options("ddp", None, launch=launch_info_from_environ()),
        model_init=_model_init,
        tokenizer=tokenizer,
        train_dataset=splits["train"],
        eval_dataset=splits["validation"],
    )
    rank = trainer.accelerator.process_index
    if record_dir is not None:
        trainer.record = Path(record_dir) / f"rank{rank}.txt"
    trainer.kill_at = kill_at
    trainer.delete_at = delete_at
    started = trainer.state.global_step
    try:
        result = trainer.fit(stop_at_step=stop_at_step)
    except HFTrainError as error:
        trainer.checkpoints.settle()
        return {"error": str(error), "code": error.exit_code, "latest": str(trainer.checkpoints.latest())}
    model = trainer.runtime.unwrap_model(trainer.model)
    return {
        "started": started,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "step": result.global_step,
        "eval": result.metrics.get("eval_loss"),
    }


# ---------------------------------------------------------------------------
# One process: the stream is the map-style run on the same blocks
# ---------------------------------------------------------------------------


def test_stream_trains_as_the_same_blocks_fed_in_order(tmp_path, monkeypatch):
    """Several shards streamed in one process equal a map-style run (sequential order) on the blocks of the same
    documents packed in file order after the validation documents: every step's loss and the final weights (1e-6)."""
    from datasets import Dataset

    from hftrain.data.packing import BlockRules, block_features, pack_documents
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.language import CausalLMTrainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    data = write_shards(tmp_path / "data")
    streamed = run_stream(data=str(data), output_dir=str(tmp_path / "stream"))
    # The reference: every document of the files in order, the first EVAL_DOCUMENTS left to validation.
    tokenizer, splits = _stream(data)
    texts = []
    for file in sorted(data.iterdir()):
        for line in file.read_text().splitlines():
            if line.strip() and json.loads(line)["text"].strip():
                texts.append(json.loads(line)["text"])
    documents = [([], tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts[EVAL_DOCUMENTS:]]
    blocks = list(pack_documents(documents, BlockRules.of(tokenizer, BLOCK)))
    assert len(blocks) >= 8 * 4  # no epoch wraps: the stream's first pass covers the run
    table = Dataset.from_dict({k: [b[k] for b in blocks] for k in block_features()}, features=block_features())
    reset_accelerate_state()
    from hftrain.cli import launch_info_from_environ

    reference = CausalLMTrainer(
        _args(str(tmp_path / "reference")),
        strategy=strategy_from_options("ddp", None, launch=launch_info_from_environ()),
        model_init=_model_init,
        tokenizer=tokenizer,
        train_dataset=table,
        eval_dataset=splits["validation"],
    )
    result = reference.fit()
    losses = [h["loss"] for h in reference.state.log_history if "loss" in h]
    torch.testing.assert_close(streamed["losses"], losses, rtol=0, atol=1e-6)
    weights = reference.runtime.unwrap_model(reference.model).state_dict()
    for key, value in streamed["weights"].items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=1e-6, msg=key)
    assert streamed["eval"] == pytest.approx(result.metrics["eval_loss"], abs=1e-6)


# ---------------------------------------------------------------------------
# Two processes: exact resume
# ---------------------------------------------------------------------------


def _trained(record_dir: Path, rank: int, *, through: int | None = None, after: int | None = None) -> list[str]:
    """The ``step hash`` lines rank ``rank`` recorded, of the steps up to ``through`` / after ``after``."""
    lines = (record_dir / f"rank{rank}.txt").read_text().splitlines()
    steps = [(int(line.split()[0]), line) for line in lines]
    return [line for step, line in steps if (through is None or step <= through) and (after is None or step > after)]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ddp_stream")
    data = str(write_shards(root / "data", shards=3))  # 3 shards over 2 ranks: dealt by stride
    runs: dict = {"root": root}
    for name in ("whole", "stopped", "killed"):
        (root / name / "blocks").mkdir(parents=True)
        (root / name / "blocks_resumed").mkdir()
    common = dict(data=data, save_steps=2)
    runs["whole"] = run_distributed(
        run_stream, 2, output_dir=str(root / "whole" / "out"), record_dir=str(root / "whole" / "blocks"), **common
    )
    runs["stopped_first"] = run_distributed(
        run_stream, 2, output_dir=str(root / "stopped" / "out"), record_dir=str(root / "stopped" / "blocks"),
        stop_at_step=3, **common,
    )  # fmt: skip
    runs["stopped"] = run_distributed(
        run_stream, 2, output_dir=str(root / "stopped" / "out"), record_dir=str(root / "stopped" / "blocks_resumed"),
        resume=True, **common,
    )  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 - both ranks SIGKILL themselves: the launcher reports their deaths
        run_distributed(
            run_stream, 2, output_dir=str(root / "killed" / "out"), record_dir=str(root / "killed" / "blocks"),
            kill_at=5, **common,
        )  # fmt: skip
    runs["killed"] = run_distributed(
        run_stream, 2, output_dir=str(root / "killed" / "out"), record_dir=str(root / "killed" / "blocks_resumed"),
        resume=True, **common,
    )  # fmt: skip
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["stopped", "killed"])
def test_a_resumed_stream_sees_exactly_the_blocks_of_an_uninterrupted_run(ddp_runs, case):
    """ddp×2 over 3 shards (by stride): stopped at step 3 (a clean stop, with its checkpoint), or SIGKILLed after
    step 5 (the last checkpoint: step 4), then resumed: the same loss at every step, the same final weights, and on
    each rank the same sequence of trained blocks as the uninterrupted run (the interrupted run's blocks up to the
    checkpoint it resumed from, then the resumed run's)."""
    whole, resumed = ddp_runs["whole"], ddp_runs[case]
    root = ddp_runs["root"]
    start = resumed[0]["started"]
    assert start == (3 if case == "stopped" else 4)
    for rank in (0, 1):
        assert resumed[rank]["step"] == whole[rank]["step"] == 8
        torch.testing.assert_close(resumed[rank]["losses"], whole[rank]["losses"], rtol=0, atol=1e-6)
        for key, value in whole[rank]["weights"].items():
            torch.testing.assert_close(resumed[rank]["weights"][key], value, rtol=0, atol=1e-6, msg=key)
        seen = _trained(root / case / "blocks", rank, through=start) + _trained(root / case / "blocks_resumed", rank)
        expected = _trained(root / "whole" / "blocks", rank)
        assert len(expected) == 8 * 2 * 2  # steps × accumulation × micro-batch
        assert seen == expected
    if case == "killed":  # the killed run trained step 5 before it died: the resume trained it again, from step 4
        assert _trained(root / "killed" / "blocks", 0, after=4)
    # the two ranks trained different blocks (each its share of the stream)
    assert set(_trained(root / "whole" / "blocks", 0)).isdisjoint(_trained(root / "whole" / "blocks", 1))


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def _checkpoint_is_complete(path: str) -> None:
    from hftrain.checkpoint.manager import open_checkpoint

    assert path != "None"
    open_checkpoint(Path(path), verify_files=True)  # raises on a missing or changed file


@pytest.mark.distributed
def test_a_malformed_line_mid_shard_stops_every_rank_in_one_line(tmp_path):
    """4 shards over 2 ranks (by shard: rank 1 reads shards 1 and 3); a line near the end of shard 3 is not JSON. Rank
    1 says which file and line, rank 0 that another process failed; both raise a DataError (exit 2) and the last
    checkpoint (written before the stream reached the line) is complete."""
    data = write_shards(tmp_path / "data", shards=4, documents=60)
    shard = data / "part-03.jsonl"
    lines = shard.read_text().splitlines()
    lines[-3] = '{"text": "w1 w2'
    shard.write_text("\n".join(lines) + "\n")
    results = run_distributed(
        run_stream, 2, data=str(data), output_dir=str(tmp_path / "out"), save_steps=2, max_steps=60
    )
    assert all(r["code"] == 2 for r in results)
    bad = f"{shard} line {len(lines) - 2} is not a JSON object"
    assert results[1]["error"].startswith("data.train_file: ") and bad in results[1]["error"]
    assert "another process" in results[0]["error"]
    # the newest complete checkpoint once both ranks are gone (a rank's own view at its error may predate the marker
    # of the save the main process was still finishing)
    from hftrain.checkpoint.manager import CheckpointManager

    latest = CheckpointManager(tmp_path / "out" / "checkpoints").latest()
    assert latest is not None and str(latest) in {results[0]["latest"], results[1]["latest"]}
    _checkpoint_is_complete(str(latest))


@pytest.mark.distributed
def test_a_shard_deleted_mid_run_stops_every_rank_in_one_line(tmp_path):
    """4 shards over 2 ranks (by shard); the last, not yet opened, is deleted after step 2 (its checkpoint written):
    when rank 1's stream reaches it, every rank stops with a DataError (exit 2), the file named, and the step-2
    checkpoint is complete."""
    data = write_shards(tmp_path / "data", shards=4, documents=60)
    gone = data / "part-03.jsonl"
    results = run_distributed(
        run_stream, 2, data=str(data), output_dir=str(tmp_path / "out"), save_steps=2, max_steps=60,
        delete_at=(2, gone),
    )  # fmt: skip
    assert all(r["code"] == 2 for r in results)
    assert any(f"{gone} is gone" in r["error"] for r in results)
    _checkpoint_is_complete(results[0]["latest"])
