"""Activation recomputation (``training.gradient_checkpointing``) changes memory, never the numbers.

With dropout 0.1, recomputation off, full and selective give bitwise-identical losses and final weights (so every
step's gradients) over 5 steps under DDP, ZeRO-3, FSDP2 and megatron tp=2 (2 processes) and tp2 × pp2 (4
processes): the recomputed forward draws the masks the first forward drew (torch restores the default generator,
and under tensor parallelism the RNG tracker's ``tensor`` stream is replayed). The activations kept per layer are
counted by saved-tensor hooks in one process: full keeps less than selective, which keeps less than none.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

MODES = (False, True, "selective")
TWO = {  # label -> (strategy, options, micro-batch per process)
    "ddp": ("ddp", None),
    "zero3": ("zero3", None),
    "fsdp2": ("fsdp", {"fsdp_version": 2}),
    "megatron-tp2": ("megatron", {"tp": 2}),
    "megatron-tp2-sp": ("megatron", {"tp": 2, "sequence_parallel": True}),
}


def _runs(cases: dict, kind: str, micro: int) -> dict:
    out = {}
    for label, (strategy, options) in cases.items():
        for mode in MODES:
            result = run_tiny_training(
                kind=kind, strategy=strategy, strategy_options=options, steps=5, micro=micro, dropout=0.1,
                gradient_checkpointing=mode, return_weights=True, dropout_kernel="bits",
            )  # fmt: skip
            out[(label, str(mode))] = {"losses": result["losses"], "weights": result["weights"]}
    return out


def _two() -> dict:
    return _runs(TWO, "bert", 4)


def _four() -> dict:
    return _runs({"megatron-tp2-pp2": ("megatron", {"tp": 2, "pp": 2})}, "gpt2", 4)


@pytest.fixture(scope="module")
def two() -> dict:
    return run_distributed(_two, 2)[0]


@pytest.fixture(scope="module")
def four() -> dict:
    return run_distributed(_four, 4)[0]


def _assert_identical(runs: dict, label: str) -> None:
    reference = runs[(label, "False")]
    assert len(reference["losses"]) == 5 and reference["weights"]
    for mode in ("True", "selective"):
        run = runs[(label, mode)]
        assert run["losses"] == reference["losses"], (mode, run["losses"], reference["losses"])
        assert run["weights"].keys() == reference["weights"].keys()
        for name, tensor in reference["weights"].items():
            assert torch.equal(run["weights"][name], tensor), (mode, name)


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(TWO))
def test_recomputation_is_bitwise_identical_with_dropout(two, label):
    _assert_identical(two, label)


@pytest.mark.distributed
def test_recomputation_is_bitwise_identical_under_tp2_pp2(four):
    _assert_identical(four, "megatron-tp2-pp2")


def _saved_bytes(kind: str, mode: bool | str) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward of a tiny model (dropout on)."""
    from transformers import AutoModelForSequenceClassification

    from hftrain.models.dropout import use_bits_dropout
    from hftrain.parallel.recompute import apply_activation_checkpointing, recompute_mode
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config(kind, dropout=0.1, num_layers=4, max_positions=128)
    model = AutoModelForSequenceClassification.from_config(config).train()
    use_bits_dropout(model)
    if recompute_mode(mode):
        apply_activation_checkpointing(model, recompute_mode(mode))
    ids = torch.randint(3, config.vocab_size, (4, 128))
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # parameters are saved too, but they are not activations: count only tensors that are not leaves
        if not (tensor.is_leaf and tensor.requires_grad):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=torch.zeros(4, dtype=torch.long)).loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_recomputation_keeps_fewer_activations(kind):
    off, full, selective = (_saved_bytes(kind, mode) for mode in MODES)
    assert full < selective < off, (full, selective, off)
