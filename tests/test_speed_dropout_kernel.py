"""``training.dropout_kernel: bits`` (hftrain.models.dropout): the same dropout as torch's, drawn faster on CPU.

The mask keeps each element with probability 1 - p and is reproducible from torch's generator; the attention path
it takes with dropout is SDPA's attention exactly (checked with a vanishing p on tiny BERT, GPT-2 and Llama with
grouped key/value heads, padded and unpadded); nothing saved changes; ``auto`` picks it on CPU. Resume with dropout on
(RNG restored) is checked under DDP in ``test_checkpoint.py`` (``ddp-dropout-random``), which runs this kernel.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hftrain.models.dropout import (
    ATTENTION,
    BitsDropout,
    bits_sdpa_attention,
    keep_mask,
    scaled_keep_mask,
    use_bits_dropout,
)
from hftrain.strategies.platform import Platform
from tests.tiny import run_tiny_training, tiny_config


def test_keep_mask_keeps_one_minus_p_reproducibly():
    torch.manual_seed(0)
    first = keep_mask((1000, 1001), 0.1)
    assert first.dtype == torch.bool and first.shape == (1000, 1001)
    assert first.float().mean().item() == pytest.approx(0.9, abs=2e-3)
    for quarter in range(4):  # each 16-bit quarter of a 64-bit draw is uniform
        assert first.flatten()[quarter::4].float().mean().item() == pytest.approx(0.9, abs=3e-3)
    torch.manual_seed(0)
    assert torch.equal(keep_mask((1000, 1001), 0.1), first)  # the default generator decides it
    assert not torch.equal(keep_mask((1000, 1001), 0.1), first)
    assert keep_mask((64,), 0.0).all()
    assert keep_mask((10_000,), 0.5).float().mean().item() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_scaled_keep_mask_is_the_keep_mask_times_the_rounded_scale(dtype):
    """The numpy-built mask has exactly the values of ``keep.to(dtype) * (1 / (1 - p))`` from the same draw."""
    for p in (0.1, 0.3):
        torch.manual_seed(7)
        keep = keep_mask((33, 17, 5), p)
        torch.manual_seed(7)
        scaled = scaled_keep_mask((33, 17, 5), p, dtype)
        assert scaled.dtype == dtype and scaled.shape == (33, 17, 5)
        assert torch.equal(scaled, keep.to(dtype).mul_(1.0 / (1.0 - p)))
        assert set(scaled.unique().tolist()) == {0.0, torch.tensor(1.0 / (1.0 - p), dtype=dtype).item()}


def test_bits_dropout_is_inverted_dropout():
    layer = BitsDropout(0.25)
    assert isinstance(layer, nn.Dropout) and layer.p == 0.25
    x = torch.rand(200, 300) + 1.0
    y = layer(x)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.75)
    assert kept.float().mean().item() == pytest.approx(0.75, abs=5e-3)
    x.requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    assert torch.allclose(x.grad, (out != 0).float() / 0.75)
    assert torch.equal(layer.eval()(x), x)
    assert torch.equal(BitsDropout(1.0).train()(x), torch.zeros_like(x))


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_attention_path_with_dropout_is_sdpa_attention(kind, tmp_path):
    from transformers import AttentionInterface, AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = tiny_config(kind, dropout=0.1)
    if kind == "llama":
        config.num_key_value_heads = config.num_attention_heads // 2  # grouped key/value heads
    config.pad_token_id = 0
    reference = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").eval()
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    model.load_state_dict(reference.state_dict())
    swapped = use_bits_dropout(model)
    assert swapped == sum(isinstance(m, BitsDropout) for m in model.modules()) and (swapped > 0) == (kind != "llama")
    assert model.config._attn_implementation == ATTENTION
    assert AttentionInterface().get_interface(ATTENTION, None) is bits_sdpa_attention
    # A vanishing p: training mode takes the dropout path everywhere, but keeps every element.
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 1e-12
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 1e-12
    model.train()
    ids = torch.randint(3, 60, (4, 12))
    padded = torch.ones_like(ids)
    padded[1, 8:] = padded[3, 5:] = 0
    for mask in (padded, torch.ones_like(ids)):
        with torch.no_grad():
            expected = reference(input_ids=ids, attention_mask=mask).logits
            assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path)
    assert ATTENTION not in (tmp_path / "config.json").read_text()  # plain transformers reloads the export


def test_auto_is_bits_on_cpu_and_torch_on_gpu():
    assert Platform(device="cpu", backend="gloo").resolve_dropout_kernel("auto")[0] == "bits"
    assert Platform(device="cuda", backend="nccl").resolve_dropout_kernel("auto")[0] == "torch"
    assert Platform(device="cpu", backend="gloo").resolve_dropout_kernel("torch") == ("torch", "set in the config")


def test_compiled_blocks_take_torch_dropout_and_bits_is_refused_with_compile():
    """``bits`` seeds numpy from a host read of torch's generator per mask: under ``training.compile`` each draw was a
    new constant to dynamo, a recompile per mask until the recompile limit stopped the default job on a CPU."""
    from hftrain.config import TrainingConfig
    from hftrain.errors import ConfigError
    from hftrain.strategies import LaunchInfo, strategy_from_options
    from tests.tiny import reset_accelerate_state

    cpu = Platform(device="cpu", backend="gloo")
    assert cpu.resolve_dropout_kernel("auto", compiled=True)[0] == "torch"
    assert cpu.resolve_dropout_kernel("torch", compiled=True)[0] == "torch"
    with pytest.raises(ConfigError, match=r"^training\.compile: dropout_kernel: bits .*training\.dropout_kernel: auto"):
        cpu.resolve_dropout_kernel("bits", compiled=True)
    reset_accelerate_state()
    strategy = strategy_from_options("ddp", None, launch=LaunchInfo())
    resolved, notes = strategy.resolve_training(TrainingConfig(compile=True))
    assert resolved.dropout_kernel == "torch" and "dropout_kernel: torch (auto: training.compile" in " ".join(notes)
    assert strategy.resolve_training(TrainingConfig())[0].dropout_kernel == "bits"


def test_a_job_with_dropout_runs_the_chosen_kernel(tmp_path):
    def run(kernel: str, folder: str) -> dict:
        return run_tiny_training(steps=4, dropout=0.1, dropout_kernel=kernel, output_dir=str(tmp_path / folder))

    runs = {kernel: run(kernel, kernel) for kernel in ("bits", "torch")}
    for kernel in runs:
        saved = json.loads((tmp_path / kernel / "hftrain_strategy.json").read_text())
        assert saved["dropout_kernel"] == kernel
    # Same seed, same data, same first forward's weights: the losses differ only by the masks drawn.
    assert runs["bits"]["losses"] != runs["torch"]["losses"]
    assert run("bits", "again")["losses"] == runs["bits"]["losses"]
