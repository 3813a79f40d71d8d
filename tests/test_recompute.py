"""Activation recomputation (``training.gradient_checkpointing``) changes memory, never the numbers.

With dropout 0.1, recomputation off, full and selective give bitwise-identical losses and final weights (so every
step's gradients) over 5 steps under DDP, ZeRO-3, FSDP2 and megatron tp=2 (2 processes) and tp2 × pp2 (4
processes): the recomputed forward draws the masks the first forward drew (torch restores the default generator,
and under tensor parallelism the RNG tracker's ``tensor`` stream is replayed). The activations kept per layer are
counted by saved-tensor hooks in one process and equal ``hftrain plan``'s formulas within 15% (measured: within 0.1%
for BERT-base's layer; SmolLM2's selective 6% under it, its grouped key/value heads are saved unrepeated).
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


SHAPES = {  # BERT-base's layer, and SmolLM2-135M's (grouped-query attention, gated MLP)
    "bert": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072},
    "llama": {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
    },
}
SEQ, BATCH = 128, 2


def _saved_bytes(kind: str, mode: str | None, layers: int) -> int:
    """Bytes of the activations autograd saves for backward in one training forward (dropout on, fp32).

    Every tensor a saved-tensor hook sees counts once per storage, except the parameters' (a linear layer saves its
    weight's transpose, a view of the parameter, not an activation).
    """
    from transformers import AutoModelForSequenceClassification

    from hftrain.models.dropout import use_bits_dropout
    from hftrain.parallel.recompute import apply_activation_checkpointing
    from tests.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config(kind, dropout=0.1, num_layers=layers, max_positions=SEQ)
    config.update(SHAPES[kind])
    model = AutoModelForSequenceClassification.from_config(config).train()
    use_bits_dropout(model)
    if mode:
        apply_activation_checkpointing(model, mode)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(3, config.vocab_size, (BATCH, SEQ))
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=torch.zeros(BATCH, dtype=torch.long)).loss
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_activation_memory_per_layer_matches_the_plan(kind):
    """Per layer (the difference between 4 and 2 layers, halved), off / full / selective against
    ``hftrain.plan.formulas``: Korthikanti et al.'s layer with fp32 activations and the bits kernel's fp32 masks,
    its input only under full recomputation, and no score terms under selective recomputation."""
    from hftrain.plan import formulas

    shape = SHAPES[kind]
    common = {"seq": SEQ, "micro_batch": BATCH, "hidden": shape["hidden_size"], "element": 4}
    layer = {
        **common,
        "heads": shape["num_attention_heads"],
        "intermediate": shape["intermediate_size"],
        "mask": 4,  # the bits kernel keeps its scaled mask in the activation's dtype
        "gated_mlp": kind == "llama",
    }
    expected = {
        None: formulas.layer_activation_bytes(**layer),
        "full": formulas.recomputed_layer_bytes(**common),
        "selective": formulas.layer_activation_bytes(**layer, fused_attention=True),
    }
    for mode, formula in expected.items():
        per_layer = (_saved_bytes(kind, mode, 4) - _saved_bytes(kind, mode, 2)) / 2
        assert abs(per_layer / formula - 1) < 0.15, (mode, per_layer, formula)
