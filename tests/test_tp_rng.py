"""The RNG tracker (``hftrain.parallel.random``) under tensor, sequence and pipeline parallelism, with dropout on.

Pitfalls "dropout masks copied across tp ranks" and "resume at a larger tp silently diverges" (docs/pitfalls.md).
Two launches carry the checks (starting processes is the slow part):

- 2 processes: BERT and GPT-2 at tp=2 (GPT-2 also with torch's dropout kernel), BERT with sequence parallelism,
  BERT in LoRA adapters (LoRA dropout on a column- and a row-parallel layer), dropout 0.1, 20 steps: replicated
  parameters bit-identical across the tp ranks; the masks drawn on each rank's own heads (on its own sequence
  chunk under sequence parallelism, on its own input features of a row-parallel LoRA layer) agree on a fraction
  near ``(1-p)² + p²`` = 0.82, the masks on replicated activations on 1.0. At pp=2 no mask of stage 1 is drawn
  from a generator state stage 0 drew from.
- 1 then 4 processes: tp2 × dp2 for 20 steps, and a run resumed tp=1 (one process) → tp=2 × dp=2 → tp=4 (10 steps
  each after the resume): replicated parameters bit-identical across every tp group.

Masks are observed by wrapping hftrain's own mask function (``hftrain.models.dropout.scaled_keep_mask``) in the
worker: the model runs unchanged, each mask is recorded with the generator state it was drawn from.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

P = 0.1
INDEPENDENT = (1 - P) ** 2 + P**2  # agreement of two independent masks
HEADS4 = {"num_attention_heads": 4}  # tp=4 needs 4 heads


def _record_masks(limit: int = 48) -> list[dict]:
    """Record the keep masks the ``bits`` kernel draws in this process (the first ``limit`` of each run)."""
    import hftrain.models.dropout as dropout

    original = dropout.scaled_keep_mask
    masks: list[dict] = []

    def recording(shape, p, dtype, device=None):
        state = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
        out = original(shape, p, dtype, device)
        if len(masks) < limit:
            masks.append({"keep": out != 0, "state": state})
        return out

    dropout.scaled_keep_mask = recording
    return masks


def _replicated(trainer) -> dict:
    """This rank's unsplit parameters (the tp group's replicated ones), by HF name."""
    from hftrain.parallel import split_over

    model = trainer.runtime.unwrap_model(trainer.model)
    split = set(split_over(model, "tp"))
    return {n: p.detach().clone() for n, p in model.named_parameters() if n not in split and p.device.type != "meta"}


TWO = {  # label -> (kind, strategy options, dropout kernel)
    "bert": ("bert", {"tp": 2}, "bits"),
    "bert-sp": ("bert", {"tp": 2, "sequence_parallel": True}, "bits"),
    "gpt2": ("gpt2", {"tp": 2}, "bits"),
    "gpt2-torch-kernel": ("gpt2", {"tp": 2}, "torch"),
}


def _two(root: str) -> dict:
    masks = _record_masks()
    out = {}
    for label, (kind, options, kernel) in TWO.items():
        masks.clear()
        result = run_tiny_training(
            kind=kind, strategy="megatron", strategy_options=options, steps=20, micro=8, dropout=P,
            dropout_kernel=kernel, inspect=_replicated, output_dir=f"{root}/{label}",
        )  # fmt: skip
        out[label] = {"replicated": result["inspected"], "masks": list(masks), "losses": result["losses"]}
    masks.clear()
    lora = {"lora_r": 4, "lora_dropout": P, "lora_target_modules": ["query", "attention.output.dense"]}
    result = run_tiny_training(
        kind="bert", strategy="megatron", strategy_options={"tp": 2}, steps=5, micro=8, dropout=P,
        dropout_kernel="bits", lora_options=lora, inspect=_replicated, output_dir=f"{root}/lora",
    )  # fmt: skip
    out["lora"] = {"replicated": result["inspected"], "masks": list(masks)}
    masks.clear()
    run_tiny_training(
        kind="bert", strategy="megatron", strategy_options={"pp": 2}, steps=3, micro=8, dropout=P,
        dropout_kernel="bits", output_dir=f"{root}/pp2",
    )  # fmt: skip
    out["pp2"] = {"states": [m["state"] for m in masks]}
    return out


COMMON = {"kind": "bert", "strategy": "megatron", "dropout": P, "dropout_kernel": "bits", "save_steps": 5}
# a model with 4 heads so that tp=4 splits it; the global batch stays 8 along the chain
CHAIN = {**COMMON, "config_overrides": HEADS4, "trust_external_checkpoint": True}


def _one(root: str) -> None:
    """The first link of the chain: tp=1 on one process (a larger resume's new ranks find no RNG state of theirs)."""
    run_tiny_training(strategy_options={"tp": 1}, steps=5, micro=8, output_dir=f"{root}/tp1", **CHAIN)


def _four(root: str) -> dict:
    tp2dp2 = run_tiny_training(
        strategy_options={"tp": 2}, steps=20, micro=4, inspect=_replicated, output_dir=f"{root}/tp2dp2", **COMMON
    )
    chain = {**CHAIN, "inspect": _replicated}
    tp2 = run_tiny_training(
        strategy_options={"tp": 2}, steps=15, micro=4, output_dir=f"{root}/tp2",
        resume_from_checkpoint=f"{root}/tp1/checkpoints/step_00000005", **chain,
    )  # fmt: skip
    tp4 = run_tiny_training(
        strategy_options={"tp": 4}, steps=25, micro=8, output_dir=f"{root}/tp4",
        resume_from_checkpoint=f"{root}/tp2/checkpoints/step_00000015", **chain,
    )  # fmt: skip
    return {
        "tp2dp2": tp2dp2["inspected"],
        "tp2": tp2["inspected"],
        "tp4": tp4["inspected"],
        "steps": (tp2["global_step"], tp4["global_step"]),
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_distributed(_two, 2, root=str(tmp_path_factory.mktemp("rng2")))


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    root = str(tmp_path_factory.mktemp("rng4"))
    run_distributed(_one, 1, root=root)
    return run_distributed(_four, 4, root=root)


def _assert_bit_identical(ranks: list[dict]) -> None:
    first, *others = ranks
    assert first, "no replicated parameter was found"
    for other in others:
        assert set(other) == set(first)
        for name, tensor in first.items():
            assert torch.equal(tensor, other[name]), (name, (tensor - other[name]).abs().max().item())


def _agreements(a: list[dict], b: list[dict]) -> list[tuple[int, float]]:
    """(mask dimensionality, fraction of equal elements) for each pair of masks drawn at the same point."""
    assert len(a) == len(b) and a
    pairs = []
    for x, y in zip(a, b, strict=True):
        assert x["keep"].shape == y["keep"].shape
        pairs.append((x["keep"].dim(), (x["keep"] == y["keep"]).float().mean().item()))
    return pairs


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(TWO))
def test_replicated_parameters_stay_bit_identical_across_tp_with_dropout(two, label):
    _assert_bit_identical([rank[label]["replicated"] for rank in two])
    assert len(two[0][label]["losses"]) == 20


@pytest.mark.distributed
@pytest.mark.parametrize("label", ["bert", "bert-sp", "gpt2"])
def test_attention_masks_of_different_heads_are_independent(two, label):
    pairs = _agreements(two[0][label]["masks"], two[1][label]["masks"])
    attention = [agreement for dim, agreement in pairs if dim == 4]  # (batch, heads, query, key)
    assert attention
    mean = sum(attention) / len(attention)
    assert abs(mean - INDEPENDENT) < 0.03, (mean, INDEPENDENT)  # copies would agree on 1.0
    if label != "bert-sp":  # every other mask is on activations all tp ranks hold whole: the same mask
        assert all(agreement == 1.0 for dim, agreement in pairs if dim != 4)


@pytest.mark.distributed
def test_sequence_parallel_chunks_draw_their_own_masks(two):
    pairs = _agreements(two[0]["bert-sp"]["masks"], two[1]["bert-sp"]["masks"])
    residual = [agreement for dim, agreement in pairs if dim == 3]
    # per forward: the embeddings' dropout on whole sequences (the same mask), then each layer's two residual
    # dropouts on this rank's half of the sequence (a mask of its own, not the other half's repeated)
    chunks = [agreement for agreement in residual if agreement < 1.0]
    assert residual[0] == 1.0 and chunks
    assert abs(sum(chunks) / len(chunks) - INDEPENDENT) < 0.03


@pytest.mark.distributed
def test_lora_dropout_follows_the_split(two):
    """LoRA dropout on a column-parallel layer's input (replicated: the same mask on every rank), and on a
    row-parallel layer's input (this rank's own features, hidden / tp = 16 wide: a mask of its own)."""
    _assert_bit_identical([rank["lora"]["replicated"] for rank in two])
    pairs = zip(two[0]["lora"]["masks"], two[1]["lora"]["masks"], strict=True)
    by_width: dict[int, list[float]] = {}
    for x, y in pairs:
        if x["keep"].dim() == 3:
            by_width.setdefault(x["keep"].shape[-1], []).append((x["keep"] == y["keep"]).float().mean().item())
    assert all(agreement == 1.0 for agreement in by_width[32])  # hidden-wide: residual and column-LoRA inputs
    split = by_width[16]  # the row-parallel attention.output.dense's input features on this rank
    assert abs(sum(split) / len(split) - INDEPENDENT) < 0.03


@pytest.mark.distributed
def test_pipeline_stages_draw_from_different_streams(two):
    stage0, stage1 = (set(rank["pp2"]["states"]) for rank in two)
    assert stage0 and stage1
    assert not stage0 & stage1  # stage 1 no longer starts from stage 0's generator state


@pytest.mark.distributed
def test_replicated_parameters_stay_bit_identical_in_tp2_dp2(four):
    _assert_bit_identical([four[0]["tp2dp2"], four[1]["tp2dp2"]])
    _assert_bit_identical([four[2]["tp2dp2"], four[3]["tp2dp2"]])


@pytest.mark.distributed
def test_resume_at_larger_tp_keeps_replicated_parameters_identical(four):
    assert four[0]["steps"] == (15, 25)
    _assert_bit_identical([four[0]["tp2"], four[1]["tp2"]])  # tp=1 → tp=2, 10 steps after the resume
    _assert_bit_identical([four[2]["tp2"], four[3]["tp2"]])
    _assert_bit_identical([rank["tp4"] for rank in four])  # tp=2 → tp=4


def test_streams_follow_megatron_seeding():
    """Default stream shared by tp ranks, ``tensor`` stream per tp rank, both per stage; switching nests."""
    from hftrain.parallel.random import RNGTracker

    def draws(tp_rank: int, pp_rank: int) -> tuple[float, float, float]:
        torch.manual_seed(7)
        tracker = RNGTracker(seed=7, tp_rank=tp_rank, pp_rank=pp_rank).seed_streams()
        with tracker.stream("tensor"):
            tensor = torch.rand(()).item()
            with tracker.stream("default"):
                nested = torch.rand(()).item()
        return torch.rand(()).item(), tensor, nested

    (d00, t00, n00), (d10, t10, _), (d01, t01, _) = draws(0, 0), draws(1, 0), draws(0, 1)
    assert d00 == d10 and t00 != t10  # tp ranks: one default stream, their own tensor streams
    assert d00 != d01 and t00 != t01  # stages differ in both
    assert n00 != d00  # the nested default draw advanced the default stream: the next default draw is the second
    torch.manual_seed(7)
    assert torch.rand(()).item() == n00


def test_states_round_trip_and_a_rebuild_is_the_same_on_every_tp_rank():
    from hftrain.parallel.random import RNGTracker

    tracker = RNGTracker(seed=3, tp_rank=0, pp_rank=0).seed_streams()
    saved = tracker.states()
    first = [torch.rand(()).item(), None]
    with tracker.stream("tensor"):
        first[1] = torch.rand(()).item()
    tracker.load_states(saved)
    again = [torch.rand(()).item(), None]
    with tracker.stream("tensor"):
        again[1] = torch.rand(()).item()
    assert first == again

    def rebuilt(tp_rank: int) -> tuple[float, float]:
        other = RNGTracker(seed=3, tp_rank=tp_rank, pp_rank=0)
        other.rebuild(b"checkpoint bytes")
        with other.stream("tensor"):
            tensor = torch.rand(()).item()
        return torch.rand(()).item(), tensor

    (default0, tensor0), (default1, tensor1) = rebuilt(0), rebuilt(1)
    assert default0 == default1 and tensor0 != tensor1


def _checksum_refusals() -> dict:
    """A one-bit change on one rank, to a replicated norm or to one copy of a replicated key/value head, is named."""
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from hftrain.errors import HFTrainError
    from hftrain.parallel import apply_tensor_parallel, check_replicas_agree
    from tests.tiny import tiny_config

    dist.init_process_group("gloo")
    outcomes = {}
    for target in (None, "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.k_proj.weight"):
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.update({"num_key_value_heads": 1})  # at tp=2 both ranks hold the one key/value head
        model = apply_tensor_parallel(AutoModelForSequenceClassification.from_config(config), tp_group=None)
        if target and dist.get_rank() == 1:
            with torch.no_grad():
                model.get_parameter(target).view(torch.int32).view(-1)[0] += 1  # the last bit of one element
        try:
            check_replicas_agree(model, tp_group=None)
            outcomes[target] = None
        except HFTrainError as error:
            outcomes[target] = str(error)
        # Where kernels are not deterministic (a GPU): the one-bit drift is accepted and rank 0's bits taken ...
        check_replicas_agree(model, tp_group=None, exact=False)
        check_replicas_agree(model, tp_group=None)  # now bit-identical again
        # ... while a replica that trained on (an update's worth away) is refused.
        if target and dist.get_rank() == 1:
            with torch.no_grad():
                weight = model.get_parameter(target)
                weight.add_(weight.abs().max() * 0.01)
        try:
            check_replicas_agree(model, tp_group=None, exact=False)
            outcomes[f"{target} diverged"] = None
        except HFTrainError as error:
            outcomes[f"{target} diverged"] = str(error)
    return outcomes


@pytest.mark.distributed
def test_checkpoint_checksum_names_a_replicated_parameter_that_drifted():
    for outcomes in run_distributed(_checksum_refusals, 2):
        assert outcomes[None] is None
        for target in ("model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.k_proj.weight"):
            assert outcomes[target] and f"'{target}'" in outcomes[target], outcomes[target]
            assert "differs across the tensor-parallel ranks by more than" in outcomes[f"{target} diverged"]
        assert outcomes["None diverged"] is None


def test_streams_of_another_device_type_are_rebuilt_not_loaded(tmp_path):
    """A checkpoint's streams written by CUDA generators (16-byte Philox states) resumed on a CPU (5056-byte
    Mersenne states), or the other way round, cannot load into this device's generator: they are rebuilt from the
    checkpoint as after a layout change, and the line says why."""
    import json
    import types

    from safetensors.torch import save_file

    from hftrain.parallel import ParallelDims
    from hftrain.parallel.random import FILE, RNGTracker, load_streams

    dims = ParallelDims(1).validate()
    groups = types.SimpleNamespace(dims=dims, coordinates={"pp": 0, "tp": 0, "cp": 0, "dp": 0})
    cuda_like = {f"pp0.tp0.cp0.dp0.{s}": torch.arange(16, dtype=torch.uint8) for s in ("default", "tensor")}
    layout = {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "seed": 3}
    save_file(cuda_like, str(tmp_path / FILE), metadata={"layout": json.dumps(layout)})
    tracker = RNGTracker(seed=3, tp_rank=0, pp_rank=0).seed_streams()
    line = load_streams(tmp_path, tracker, groups=groups)
    assert line is not None and "another device's generator than cpu's" in line
    torch.rand(3)  # the rebuilt CPU streams draw
