"""Packed documents attended one by one (``training.packed_attention: varlen``, ``hftrain.models.packed_attention``;
issue 54, part 2): through Llama (grouped heads), GPT-2 and Qwen2 (a sliding window of 4, shorter than its documents)
the varlen path (its CPU kernel) gives the dense packed mask's logits and every gradient within 1e-5 (fp32); a tiny
causal LM trained with ``varlen`` equals ``mask`` in losses and weights, with no more host reads per step; a model
varlen cannot take (attention dropout) keeps the mask and says why. One process; the CUDA kernel cannot run here."""

from __future__ import annotations

import copy
import random
from collections import defaultdict

import pytest
import torch

from hftrain.metrics.syncs import count_host_syncs
from hftrain.models.packed_attention import (
    ATTENTION_NAME,
    PackedDocuments,
    apply_packed_attention,
    kernel_refusal,
    varlen_refusal,
)
from tests.tiny import WORDS, reset_accelerate_state, tiny_tokenizer

POSITIONS = torch.tensor(
    [
        [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6],  # three documents
        [3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1],  # one continued from a previous block, then two
    ]
)


def _config(kind: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    if kind == "llama":
        return LlamaConfig(**sizes, **heads)
    if kind == "gpt2":
        return GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
    # layer 0 full, layer 1 a window of 4 keys
    return Qwen2Config(**sizes, **heads, use_sliding_window=True, sliding_window=4, max_window_layers=1)


def test_cu_seqlens_are_the_documents_with_an_empty_tail_and_no_host_read():
    with count_host_syncs() as report:
        documents = PackedDocuments.of(POSITIONS)
    assert report.total == 0, report.where
    starts = [0, 6, 9, 16, 20, 30]  # row 1 starts a document although its positions continue
    assert documents.cu_seqlens.dtype == torch.int32 and documents.cu_seqlens.shape == (33,)
    assert documents.cu_seqlens.tolist() == starts + [32] * (33 - len(starts))
    assert documents.max_length == documents.block == 16


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_varlen_equals_the_dense_packed_mask_in_logits_and_every_gradient(kind):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="sdpa")  # transformers' packed masks
    varlen = copy.deepcopy(dense)
    assert varlen_refusal(varlen) is None
    apply_packed_attention(varlen)
    assert varlen.config._attn_implementation == ATTENTION_NAME
    ids = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    expected = dense(input_ids=ids, position_ids=POSITIONS, use_cache=False).logits
    with count_host_syncs() as report:
        documents = PackedDocuments.of(POSITIONS)
        got = varlen(input_ids=ids, position_ids=POSITIONS, use_cache=False, packed_documents=documents).logits
    assert report.total == 0, report.where  # no packed-sequence detection, no per-layer read
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    for (name, p), q in zip(dense.named_parameters(), varlen.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)
    # the documents are really apart: one causal sequence per row gives other logits
    whole = torch.arange(16).expand(2, 16)
    mixed = varlen(input_ids=ids, position_ids=POSITIONS, use_cache=False, packed_documents=PackedDocuments.of(whole))
    assert (mixed.logits - expected).abs().max() > 1e-3
    # a call without the documents (the export's logit check) gets them from its positions, once per forward
    plain = varlen(input_ids=ids, position_ids=POSITIONS, use_cache=False).logits
    torch.testing.assert_close(plain, got, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="an attention mask was given"):
        varlen(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    with pytest.raises(RuntimeError, match="without packed_documents"):
        varlen.base_model(input_ids=ids, position_ids=POSITIONS, use_cache=False)


def test_compiled_blocks_take_the_varlen_attention_without_a_graph_break():
    """``training.compile`` compiles each block: the documents object crosses into the graph (its ints as
    constants), so the compiled model equals the dense packed mask and dynamo breaks no graph."""
    import torch._dynamo.utils as dynamo_utils
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(_config("qwen2"), attn_implementation="sdpa")
    varlen = copy.deepcopy(dense)
    apply_packed_attention(varlen)
    for layer in varlen.model.layers:
        layer.compile(dynamic=False)
    ids = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    dynamo_utils.counters.clear()
    expected = dense(input_ids=ids, position_ids=POSITIONS, use_cache=False).logits
    for _ in range(2):  # the second call replays the graphs
        got = varlen(input_ids=ids, position_ids=POSITIONS, use_cache=False).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= len(varlen.model.layers)
    expected.sum().backward()
    got.sum().backward()
    for (name, p), q in zip(dense.named_parameters(), varlen.parameters(), strict=True):
        # inductor fuses the block's arithmetic in another order: gradients within 1e-4 (uncompiled: 1e-5, above)
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------------------------- the trainer
STEPS = 4
HOST_MADE = ("hftrain/data/batching.py", "hftrain/parallel/host.py")
"""Tensors in host memory by construction (the sampler's epoch order, drawn when the first window's targets are
counted; the host group's flags): their reads wait for no device (as ``tests/test_host_syncs.py`` counts)."""


def _splits(n_train: int = 64, n_eval: int = 10):
    """Documents counting up through ``WORDS``, 2 to 14 words, so blocks pack several of uneven length."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(0)

    def text() -> str:
        start, length = rng.randrange(len(WORDS)), rng.randint(2, 14)
        return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))

    return DatasetDict(
        train=Dataset.from_dict({"text": [text() for _ in range(n_train)]}),
        validation=Dataset.from_dict({"text": [text() for _ in range(n_eval)]}),
    )


def _run(packed_attention: str, *, attention_dropout: float = 0.0) -> dict:
    """A tiny Llama trained ``STEPS`` steps in this process with ``packed_attention``; its losses, weights, startup
    lines and each step's host reads."""
    from transformers import AutoModelForCausalLM

    from hftrain.cli import launch_info_from_environ
    from hftrain.data.language import pack_splits
    from hftrain.strategies import strategy_from_options
    from hftrain.trainers.language import CausalLMTrainer
    from tests.tiny import _fresh_output_dir, fp32_args, tiny_config

    class Recording(CausalLMTrainer):
        def __init__(self, *args, **kwargs):
            self.lines: list[str] = []
            self.syncs: dict[int, int] = defaultdict(int)
            super().__init__(*args, **kwargs)

        def _log(self, message):
            self.lines.append(message)
            super()._log(message)

        def train_step(self, batch):
            with count_host_syncs() as report:
                result = super().train_step(batch)
            step = self.state.global_step + 1
            self.syncs[step] += sum(not any(m in where for m in HOST_MADE) for where in report.where)
            return result

    def model_init():
        config = tiny_config("llama", max_positions=64)
        config.attention_dropout = attention_dropout
        return AutoModelForCausalLM.from_config(config)

    reset_accelerate_state()
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    packed = pack_splits(_splits(), tokenizer, block_size=32, log=lambda _: None)
    args = fp32_args(
        _fresh_output_dir(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        logging_steps=STEPS,
        learning_rate=3e-3,
        warmup_steps=1,
        save_steps=0,
        packed_attention=packed_attention,
        train_sampling_strategy="random",
    )
    trainer = Recording(
        args,
        strategy=strategy_from_options("ddp", None, launch=launch_info_from_environ()),
        model_init=model_init,
        tokenizer=tokenizer,
        train_dataset=packed["train"],
        eval_dataset=packed["validation"],
    )
    trainer.fit()
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        "weights": {k: v.detach().clone() for k, v in trainer.runtime.get_state_dict(trainer.model).items()},
        "lines": [line for line in trainer.lines if line.startswith("packed_attention:")],
        "syncs": dict(trainer.syncs),
        "attention": trainer.runtime.unwrap_model(trainer.model).config._attn_implementation,
    }


def test_a_trainer_run_with_varlen_equals_mask_in_losses_and_weights_with_no_more_host_reads():
    varlen, mask = _run("varlen"), _run("mask")
    assert varlen["attention"] == ATTENTION_NAME and mask["attention"] != ATTENTION_NAME
    assert varlen["lines"] == ["packed_attention: varlen (set in the config)"], varlen["lines"]
    assert mask["lines"] == ["packed_attention: mask (set in the config)"], mask["lines"]
    assert len(varlen["losses"]) == len(mask["losses"]) >= 1 and varlen["eval"]
    torch.testing.assert_close(varlen["losses"], mask["losses"], rtol=0, atol=1e-5)
    torch.testing.assert_close(varlen["eval"], mask["eval"], rtol=0, atol=1e-5)
    for name, value in mask["weights"].items():
        torch.testing.assert_close(varlen["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    # the micro-batches' forward and backward read nothing on the host, with either attention
    assert varlen["syncs"] == mask["syncs"] == dict.fromkeys(range(1, STEPS + 1), 0), (varlen["syncs"], mask["syncs"])


def test_a_model_with_attention_dropout_keeps_the_mask_and_says_why():
    run = _run("varlen", attention_dropout=0.1)
    assert run["attention"] != ATTENTION_NAME
    (line,) = run["lines"]
    assert line.startswith("packed_attention: mask, not varlen (set in the config): attention dropout"), line


def test_auto_is_varlen_on_cuda_and_mask_on_a_cpu():
    from hftrain.strategies.platform import Platform

    cpu = Platform.detect()
    assert cpu.device == "cpu"
    assert cpu.resolve_packed_attention("auto")[0] == "mask"
    assert cpu.resolve_packed_attention("varlen") == ("varlen", "set in the config")
    assert Platform(device="cuda", backend="nccl").resolve_packed_attention("auto")[0] == "varlen"
    # flash is 16-bit only: an fp32 CUDA run keeps the mask; the CPU reference takes any precision
    assert "bf16 or fp16 only" in kernel_refusal("cuda", "no")
    assert kernel_refusal("cuda", "bf16") is None and kernel_refusal("cpu", "no") is None
    assert "no varlen kernel for 'mps'" in kernel_refusal("mps", "bf16")
