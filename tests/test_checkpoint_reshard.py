"""Sharded checkpoints resume under any strategy and process count (issue 21's matrix), fp32 on gloo.

A checkpoint written at step 3 by each writer (ddp×2, fsdp2×2, zero1/2/3×2, zero3 with optimizer and parameter
offload, megatron tp2, megatron tp2×pp2 on 4 processes) is resumed by each reader (ddp on 1 process, zero3×2,
fsdp2×2, megatron tp2; zero3+offload×2, zero1×2 and zero2×2 from a few writers, from all under ``-m slow``); the
continued run must equal the writer's own uninterrupted run: the same
losses and final weights within 1e-6, the global batch (8) kept. A resume that loses Adam's moments or step, or any
parameter, continues differently by orders of magnitude more (a negative control checks that). Launches are
combined: one per process count writes, one per process count reads every checkpoint in turn (per tier).

Under bf16 ZeRO-3, the checkpoint's ``model.*`` tensors and the export are the fp32 master weights: equal to what
DeepSpeed's own ``zero_to_fp32`` consolidates from a DeepSpeed checkpoint of the same state. A ZeRO checkpoint in
DeepSpeed's layout (hftrain before the sharded format) still resumes on its own layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

STEPS, SAVE_AT, GLOBAL_BATCH = 6, 3, 8
TOLERANCE = 1e-6
OFFLOAD = {"offload_optimizer": True, "offload_params": True}
# label -> (processes, strategy, options); micro-batch = GLOBAL_BATCH / data-parallel size
WRITERS = {
    "ddp×2": (2, "ddp", {}),
    "fsdp2×2": (2, "fsdp", {"fsdp_version": 2}),
    "zero1×2": (2, "zero1", {}),
    "zero2×2": (2, "zero2", {}),
    "zero3×2": (2, "zero3", {}),
    "zero3+offload×2": (2, "zero3", OFFLOAD),
    "megatron tp2": (2, "megatron", {"tp": 2}),
    "megatron tp2×pp2": (4, "megatron", {"tp": 2, "pp": 2, "num_microbatches": 2}),
}
READERS = {
    "ddp×1": (1, "ddp", {}),
    "zero3×2": (2, "zero3", {}),
    "fsdp2×2": (2, "fsdp", {"fsdp_version": 2}),
    "megatron tp2": (2, "megatron", {"tp": 2}),
    "zero3+offload×2": (2, "zero3", OFFLOAD),
    "zero1×2": (2, "zero1", {}),
    "zero2×2": (2, "zero2", {}),
}
# The four readers take every writer's checkpoint; ZeRO-1/2 (full-tensor loads) and offload read a few in
# the default tier, the rest in the slow one (the default tier's launches stay near 4 minutes on 2 cores).
FAST_PAIRS = [(writer, reader) for writer in WRITERS for reader in ("ddp×1", "zero3×2", "fsdp2×2", "megatron tp2")] + [
    ("ddp×2", "zero3+offload×2"),
    ("megatron tp2×pp2", "zero3+offload×2"),
    ("zero3+offload×2", "zero3+offload×2"),
    ("fsdp2×2", "zero2×2"),
    ("megatron tp2×pp2", "zero2×2"),
    ("zero3+offload×2", "zero1×2"),
]
SLOW_PAIRS = [(writer, reader) for reader in READERS for writer in WRITERS if (writer, reader) not in FAST_PAIRS]
PAIRS = [pytest.param(w, r, id=f"{w}->{r}") for w, r in FAST_PAIRS] + [
    pytest.param(w, r, id=f"{w}->{r}", marks=pytest.mark.slow) for w, r in SLOW_PAIRS
]


def _micro(processes: int, options: dict) -> int:
    return GLOBAL_BATCH * options.get("tp", 1) * options.get("pp", 1) // processes


def _train(layout: tuple, output_dir: str, **kwargs) -> dict:
    processes, strategy, options = layout
    return run_tiny_training(
        strategy=strategy,
        strategy_options=options,
        micro=_micro(processes, options),
        steps=STEPS,
        save_steps=SAVE_AT,
        return_weights=True,
        output_dir=output_dir,
        **kwargs,
    )


def _attempt(fn, *args, **kwargs) -> dict:
    """``fn``'s run, or its error: reported per run so that one failure does not hide the others."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _write(root: str, processes: int) -> dict:
    """Every writer of this process count trains uninterrupted, checkpointing at step 3 (and 6)."""
    runs = {}
    for label, layout in WRITERS.items():
        if layout[0] != processes:
            continue
        runs[label] = _attempt(_train, layout, f"{root}/{_slug(label)}")
    return runs


def _read(root: str, processes: int, pairs: list[tuple[str, str]], controls: bool) -> dict:
    """Each reader of this process count resumes from its writers' step-3 checkpoints and runs to the end."""
    runs = {}
    for writer, reader in pairs:
        layout = READERS[reader]
        if layout[0] != processes:
            continue
        runs[writer, reader] = _attempt(
            _train,
            layout,
            f"{root}/read/{_slug(writer)}-{_slug(reader)}",
            resume_from_checkpoint=f"{root}/{_slug(writer)}/checkpoints/step_{SAVE_AT:08d}",
            trust_external_checkpoint=True,
        )
    if controls and processes == 2:
        # negative control: the same resume with Adam's moments dropped after the load
        runs["control"] = _attempt(_resume_without_moments, root)
    return runs


def _resume_without_moments(root: str) -> dict:
    from hftrain.strategies.deepspeed.runtime import ZeroRuntime

    load = ZeroRuntime.load_snapshot

    def load_then_forget(self, directory: str) -> None:
        load(self, directory)
        for state in self._inner_optimizer().optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].zero_()

    ZeroRuntime.load_snapshot = load_then_forget
    try:
        return _train(
            READERS["zero3×2"],
            f"{root}/read/control",
            resume_from_checkpoint=f"{root}/{_slug('ddp×2')}/checkpoints/step_{SAVE_AT:08d}",
            trust_external_checkpoint=True,
        )
    finally:
        ZeroRuntime.load_snapshot = load


def _slug(label: str) -> str:
    return label.replace("×", "x").replace(" ", "-").replace("+", "-")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """The writers' uninterrupted runs (``runs``) and the folder holding their checkpoints (``root``)."""
    root = str(tmp_path_factory.mktemp("reshard"))
    runs = {**run_distributed(_write, 2, root=root, processes=2)[0]}
    runs.update(run_distributed(_write, 4, root=root, processes=4)[0])
    return {"root": root, "runs": runs}


def _reads(written: dict, pairs: list[tuple[str, str]], *, controls: bool) -> dict:
    root, runs = written["root"], written["runs"]
    pairs = [(writer, reader) for writer, reader in pairs if "error" not in runs[writer]]
    read = {**run_distributed(_read, 1, root=root, processes=1, pairs=pairs, controls=controls)[0]}
    read.update(run_distributed(_read, 2, root=root, processes=2, pairs=pairs, controls=controls)[0])
    return read


@pytest.fixture(scope="module")
def fast_reads(written) -> dict:
    return _reads(written, FAST_PAIRS, controls=True)


@pytest.fixture(scope="module")
def slow_reads(written) -> dict:
    return _reads(written, SLOW_PAIRS, controls=False)


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize(("writer", "reader"), PAIRS)
def test_a_checkpoint_resumes_under_another_strategy_equal_to_the_uninterrupted_run(request, written, writer, reader):
    original = written["runs"][writer]
    assert "error" not in original, original.get("error")
    reads = request.getfixturevalue("fast_reads" if (writer, reader) in FAST_PAIRS else "slow_reads")
    resumed = reads[writer, reader]
    assert "error" not in resumed, resumed.get("error")
    assert resumed["global_step"] == original["global_step"] == STEPS
    # the first SAVE_AT losses come from the checkpoint's log history, the rest were computed after the resume
    losses = max(abs(a - b) for a, b in zip(resumed["losses"], original["losses"], strict=True))
    weights = _max_difference(resumed["weights"], original["weights"])
    print(f"{writer} -> {reader}: max |loss difference| {losses:.1e}, max |weight difference| {weights:.1e}")
    assert resumed["losses"] == pytest.approx(original["losses"], abs=TOLERANCE, rel=0)
    assert resumed["lrs"] == pytest.approx(original["lrs"], rel=1e-9)
    assert weights <= TOLERANCE


@pytest.mark.distributed
def test_a_resume_that_drops_adams_moments_does_not_pass(written, fast_reads):
    # The tolerance above is far below what a broken resume gives: the matrix would catch a lost optimizer state.
    original, control = written["runs"]["ddp×2"], fast_reads["control"]
    assert "error" not in control, control.get("error")
    assert _max_difference(control["weights"], original["weights"]) > 100 * TOLERANCE


@pytest.mark.distributed
def test_zero_writes_the_keys_and_shapes_ddp_writes_spread_over_its_ranks(written):
    from hftrain.checkpoint.sharded import DCP_DIR, read_info, stored_keys

    def state(label: str) -> Path:
        return Path(written["root"], _slug(label), "checkpoints", f"step_{SAVE_AT:08d}", "state")

    reference = stored_keys(state("ddp×2") / DCP_DIR)
    assert any(key.endswith(".exp_avg") for key in reference) and any(key.endswith(".step") for key in reference)
    for label in ("zero1×2", "zero2×2", "zero3×2", "zero3+offload×2"):
        assert stored_keys(state(label) / DCP_DIR) == reference, label
        assert read_info(state(label))["world_size"] == 2
        files = {p.name: p.stat().st_size for p in (state(label) / DCP_DIR).glob("*.distcp")}
        # each rank wrote its own share (ZeRO-3 its partitions; ZeRO-1/2 its rows of each gathered tensor)
        assert sorted(files) == ["__0_0.distcp", "__1_0.distcp"], label
        assert min(files.values()) > 0.3 * max(files.values()), (label, files)


# ----------------------------------------------------------------- LoRA: frozen parameters beside trained ones
LORA = {"lora_r": 4, "lora_alpha": 64}


def _lora(root: str) -> dict:
    """LoRA under ZeRO-3 and ZeRO-2 (frozen base weights: partitioned without an fp32 master, or whole on every rank),
    each checkpoint resumed by the other stage."""
    runs = {}
    for label in ("zero3×2", "zero2×2"):
        runs[label] = _attempt(_train, WRITERS[label], f"{root}/{_slug(label)}", lora_options=LORA)
    for writer, reader in (("zero3×2", "zero2×2"), ("zero2×2", "zero3×2")):
        runs[writer, reader] = _attempt(
            _train,
            READERS[reader],
            f"{root}/read/{_slug(writer)}-{_slug(reader)}",
            lora_options=LORA,
            resume_from_checkpoint=f"{root}/{_slug(writer)}/checkpoints/step_{SAVE_AT:08d}",
            trust_external_checkpoint=True,
        )
    return runs


@pytest.mark.distributed
def test_zero_lora_checkpoints_resume_under_the_other_stage(tmp_path):
    runs = run_distributed(_lora, 2, root=str(tmp_path))[0]
    for writer, reader in (("zero3×2", "zero2×2"), ("zero2×2", "zero3×2")):
        original, resumed = runs[writer], runs[writer, reader]
        assert "error" not in original and "error" not in resumed, (original.get("error"), resumed.get("error"))
        assert any(".lora_B." in name for name in original["weights"])
        assert resumed["losses"] == pytest.approx(original["losses"], abs=TOLERANCE, rel=0)
        assert _max_difference(resumed["weights"], original["weights"]) <= TOLERANCE, (writer, reader)


# ----------------------------------------------------------------- bf16 ZeRO-3: the fp32 master weights
def _bf16_zero3(root: str) -> dict:
    def inspect(trainer):
        export = trainer.runtime.get_state_dict(trainer.model)
        trainer.model.save_checkpoint(f"{root}/deepspeed")  # DeepSpeed's own format, for its zero_to_fp32
        return export if trainer.runtime.is_main_process else None

    run = run_tiny_training(
        strategy="zero3",
        micro=4,
        steps=SAVE_AT,
        save_steps=SAVE_AT,
        mixed_precision="bf16",
        output_dir=f"{root}/run",
        inspect=inspect,
    )
    return {"export": run["inspected"], "checkpoint": run["checkpoint"]}


@pytest.mark.distributed
def test_bf16_zero3_saves_and_exports_the_fp32_master_weights(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hftrain.checkpoint.sharded import DCP_DIR, MODEL_PREFIX

    run = run_distributed(_bf16_zero3, 2, root=str(tmp_path))[0]
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "deepspeed"))
    dcp_to_torch_save(Path(run["checkpoint"], "state", DCP_DIR), tmp_path / "ours.pt")
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    export = run["export"]
    # the bf16 working copy is not what is compared: the master weights hold bits bf16 cannot
    assert any((value.bfloat16().float() != value).any() for value in theirs.values())
    for name, master in theirs.items():
        assert ours[MODEL_PREFIX + name].dtype == export[name].dtype == torch.float32, name
        torch.testing.assert_close(ours[MODEL_PREFIX + name], master, rtol=0, atol=1e-7, msg=name)
        torch.testing.assert_close(export[name], master, rtol=0, atol=1e-7, msg=name)
