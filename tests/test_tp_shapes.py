"""Tensor parallelism at real model shapes (issue 20 items 2, 3, 5): padded vocabularies, balanced and replicated
grouped-query heads, out-of-range ids, the row-parallel output dtype.

- Layers and tiny Llama models against their unsharded references on 4 gloo processes (tp = 2 and tp = 4 groups in
  one launch): outputs and every gradient after ``sum_partial_grads``, the clipped norm, checkpoint gather/shard.
- A GPT-2-shaped model with GPT-2's 50,257-token vocabulary through the Trainer at tp = 2 and tp = 4 against one
  process, its export reloaded by plain transformers, and its tp = 2 checkpoint resumed at tp = 1.
- The size checks and ``hftrain plan`` rows without processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hftrain.checkpoint.sharded import read_model_tensors
from hftrain.errors import ConfigError
from hftrain.parallel.placement import placed
from tests.distributed import run_distributed
from tests.megatron_runs import launch_on_two_four_one
from tests.tiny import run_tiny_training, tiny_config, tiny_tokenizer

GPT2_VOCAB = 50_257
BATCH, SEQ, HIDDEN = 3, 4, 8


# ----------------------------------------------------------------- layers and tiny models, 4 processes
def _embedding_case(group, vocab: int, vocab_multiple: int) -> dict:
    """A vocabulary tp does not divide: output and gradient equal ``nn.Embedding``'s, padding rows zero and
    trimmed from gathered tensors; ids outside ``[0, vocab)`` raise as ``nn.Embedding`` does."""
    import torch
    from torch import nn
    from torch.testing import assert_close

    from hftrain.parallel import VocabParallelEmbedding, gather_full_tensors, shard_full_tensor

    torch.manual_seed(2)
    ref = nn.Embedding(vocab, HIDDEN, padding_idx=vocab - 1)  # the padding_idx row sits on the last rank
    ids = torch.tensor([[0, 1, vocab - 1, 9], [5, 4, vocab - 1, 7], [9, 8, 2, 3]])
    probe = torch.randn(BATCH, SEQ, HIDDEN)
    (ref(ids) * probe).sum().backward()

    layer = VocabParallelEmbedding(ref, tp_group=group, vocab_multiple=vocab_multiple)
    shard = placed(layer)["weight"].split
    y = layer(ids)
    assert_close(y, ref(ids).detach())
    (y * probe).sum().backward()
    assert_close(layer.weight.grad, shard.local(ref.weight.grad))
    padding = slice(max(vocab - layer.vocab_start, 0), None)  # this rank's rows beyond the logical vocabulary
    assert layer.weight[padding].abs().sum() == 0 and layer.weight.grad[padding].abs().sum() == 0
    # checkpoint and export path: gathered tensors have the logical rows; sharding a full tensor pads it again
    full = gather_full_tensors({"weight": layer.weight.detach()}, layer, groups={"tp": group})
    assert full["weight"].shape == (vocab, HIDDEN)
    assert torch.equal(full["weight"], ref.weight.detach())
    grad = gather_full_tensors({"weight": layer.weight.grad}, layer, groups={"tp": group})["weight"]
    assert torch.equal(grad, ref.weight.grad)
    assert torch.equal(shard_full_tensor("weight", full["weight"], layer), layer.weight.detach())
    raised = {}
    for bad in (vocab, -1, layer.padded_vocab_size - 1):
        messages = []
        for module in (ref, layer):
            try:
                module(torch.tensor([[0, bad]]))
            except IndexError as error:
                messages.append(str(error))
        raised[bad] = messages
    return {"padded": layer.padded_vocab_size, "rows": layer.weight.shape[0], "raised": raised}


def _row_dtype_case(group) -> dict:
    """Under bf16 autocast a row-parallel layer with a bias returns ``nn.Linear``'s dtype (bf16), not fp32."""
    import torch
    from torch import nn
    from torch.testing import assert_close

    from hftrain.parallel import RowParallelLinear

    torch.manual_seed(1)
    ref = nn.Linear(12, HIDDEN)
    x = torch.randn(BATCH, SEQ, 12)
    layer = RowParallelLinear(ref, tp_group=group)
    rank, size = placed(layer)["weight"].split.rank, placed(layer)["weight"].split.size
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, y = ref(x), layer(x.chunk(size, -1)[rank])
    assert_close(y.float(), expected.float(), rtol=2e-2, atol=2e-2)  # bf16: summed in another order
    return {"dtype": str(y.dtype), "reference": str(expected.dtype)}


def _llama(heads: int, kv_heads: int, vocab: int, seed: int = 0):
    import torch
    from transformers import AutoModelForSequenceClassification

    config = tiny_config("llama", vocab_size=vocab)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = heads, kv_heads, 8
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def _grouped_query_case(group, heads: int, kv_heads: int, sequence_parallel: bool) -> dict:
    """A tiny Llama whose key/value heads tp divides or replicates equals the unsharded model: logits, loss, every
    gradient after ``sum_partial_grads`` (replicated key/value slices summed over their holders), the clipped norm,
    two AdamW steps (replicas stay bit-identical), and the full state dict reloading into the plain class."""
    import torch
    import torch.distributed as dist
    from torch.testing import assert_close

    from hftrain.parallel import (
        apply_tensor_parallel,
        clip_grad_norm_,
        full_state_dict,
        gather_full_tensors,
        load_full_state_dict,
        sum_partial_grads,
    )

    vocab = 61  # padded to 62 at tp = 2, 64 at tp = 4
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (4, 8), generator=generator)
    ids[1, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([0, 1, 1, 0])}
    ref = _llama(heads, kv_heads, vocab)
    model = apply_tensor_parallel(_llama(heads, kv_heads, vocab), tp_group=group, sequence_parallel=sequence_parallel)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    attention = model.model.layers[0].self_attn
    k_shard = placed(attention.k_proj)["weight"].split
    replicas = max(tp // kv_heads, 1)
    assert k_shard.replicas == replicas
    assert attention.num_key_value_groups == (heads // tp) // max(kv_heads // tp, 1)
    head = rank // replicas if replicas > 1 else None  # the key/value head this rank holds (replicated)
    if head is not None:
        rows = ref.model.layers[0].self_attn.k_proj.weight[8 * head : 8 * head + 8]
        assert torch.equal(attention.k_proj.weight.detach(), rows)
    # eps 1e-6: Adam turns float32 summation-order noise in near-zero gradients into weight differences (lr/eps)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (ref, model)]
    norms = []
    for _step in range(2):
        expected, out = ref(**batch), model(**batch)
        assert_close(out.logits, expected.logits)
        assert_close(out.loss, expected.loss)
        expected.loss.backward()
        out.loss.backward()
        sum_partial_grads(model, "tp", group)
        grads = gather_full_tensors({n: p.grad for n, p in model.named_parameters()}, model, groups={"tp": group})
        for name, param in ref.named_parameters():
            assert_close(grads[name], param.grad, msg=lambda m, name=name: f"grad {name}: {m}")
        # the replicas of a key/value slice hold the same (summed) gradient, and the norm counts it once
        reference_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        norm = clip_grad_norm_(model, dict(model.named_parameters()), 0.5, groups={"tp": group})
        assert_close(norm, reference_norm)
        norms.append(norm.item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = full_state_dict(model, groups={"tp": group})
    assert full["model.embed_tokens.weight"].shape[0] == vocab
    plain = _llama(heads, kv_heads, vocab, seed=123)
    plain.load_state_dict(full, strict=True)
    with torch.no_grad():
        assert_close(plain(**batch).logits, ref(**batch).logits)
        fresh = apply_tensor_parallel(_llama(heads, kv_heads, vocab), tp_group=group)
        load_full_state_dict(fresh, ref.state_dict())
        assert_close(fresh(**batch).logits, ref(**batch).logits)
    # replicated key/value slices stayed bit-identical over their holders through the steps
    mine = attention.k_proj.weight.detach().clone()
    every = [torch.empty_like(mine) for _ in range(tp)]
    dist.all_gather(every, mine, group=group)
    same = all(torch.equal(every[r], every[(r // replicas) * replicas]) for r in range(tp))
    return {"replicas": replicas, "norms": norms, "replicas_identical": same}


def _layer_checks() -> dict:
    import torch.distributed as dist

    from hftrain.parallel import ParallelDims, build_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp4 = build_groups(ParallelDims(4, tp=4), rank).tp_group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in the same order
    tp2 = pairs[rank // 2]
    report = {
        "embedding tp2": _embedding_case(tp2, vocab=11, vocab_multiple=1),
        "embedding tp4": _embedding_case(tp4, vocab=11, vocab_multiple=2),
        "row dtype": _row_dtype_case(tp2),
        "4q/1kv tp2": _grouped_query_case(tp2, 4, 1, sequence_parallel=False),
        "4q/1kv tp2 sp": _grouped_query_case(tp2, 4, 1, sequence_parallel=True),
        "4q/1kv tp4": _grouped_query_case(tp4, 4, 1, sequence_parallel=False),
        "4q/2kv tp4": _grouped_query_case(tp4, 4, 2, sequence_parallel=False),
        "4q/2kv tp2": _grouped_query_case(tp2, 4, 2, sequence_parallel=False),  # split evenly: nothing replicated
    }
    dist.destroy_process_group()
    return report


@pytest.mark.distributed
def test_padded_embedding_replicated_kv_heads_and_row_dtype_match_the_references():
    results = run_distributed(_layer_checks, nprocs=4, timeout=600)
    for report in results:  # the comparisons are asserted in every rank; here what they reported
        assert (report["embedding tp2"]["padded"], report["embedding tp2"]["rows"]) == (12, 6)
        assert (report["embedding tp4"]["padded"], report["embedding tp4"]["rows"]) == (16, 4)  # 4 × 2 divides 16
        for case in ("embedding tp2", "embedding tp4"):
            for bad, messages in report[case]["raised"].items():
                assert messages == ["index out of range in self"] * 2, (case, bad)  # as nn.Embedding, padding too
        assert report["row dtype"] == {"dtype": "torch.bfloat16", "reference": "torch.bfloat16"}
        assert [report[c]["replicas"] for c in ("4q/1kv tp2", "4q/1kv tp4", "4q/2kv tp4", "4q/2kv tp2")] == [2, 4, 2, 1]
        assert all(report[c]["replicas_identical"] for c in report if "kv" in c)


# ----------------------------------------------------------------- GPT-2's vocabulary through the Trainer
GPT2_SHAPE = {"vocab_size": GPT2_VOCAB, "n_embd": 64, "n_head": 4}
COMMON = {"kind": "gpt2", "config_overrides": GPT2_SHAPE, "micro": 4, "steps": 10, "return_weights": True}


def _export(trainer) -> dict:
    """Export the trained model (every rank: collective) and reload it with plain transformers (reload-verified by
    ``export_pretrained`` against the trained tp model's logits on a fixed batch)."""
    import torch

    from hftrain.checkpoint.export import export_pretrained

    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    batch = dict(tokenizer(["w1 w2 w3 w30", "w5 w9"], padding=True, return_tensors="pt"))
    directory = Path(trainer.args.output_dir) / "export"
    result = export_pretrained(trainer.runtime, trainer.model, tokenizer, directory, verify_inputs=batch)
    if not trainer.accelerator.is_main_process:
        return {}
    from transformers import AutoModelForSequenceClassification

    plain = AutoModelForSequenceClassification.from_pretrained(directory)
    with torch.no_grad():
        logits = plain(**batch).logits
    return {
        "max_logit_diff": result.max_logit_diff,
        "rows": tuple(plain.transformer.wte.weight.shape),
        "logits": logits,
    }


def _gpt2_tp2(root: str) -> dict:
    return run_tiny_training(
        strategy="megatron", strategy_options={"tp": 2}, output_dir=f"{root}/tp2", save_steps=5, inspect=_export,
        **COMMON,
    )  # fmt: skip


def _gpt2_tp4(root: str) -> dict:
    return run_tiny_training(
        strategy="megatron", strategy_options={"tp": 4, "vocab_multiple": 128}, output_dir=f"{root}/tp4", **COMMON
    )


def _gpt2_one(root: str) -> dict:
    reference = run_tiny_training(strategy="ddp", output_dir=f"{root}/ddp", **COMMON)
    # Last: the one-process megatron run starts a process group, which the DDP reference must not see.
    resumed = run_tiny_training(
        strategy="megatron", strategy_options={"tp": 1}, output_dir=f"{root}/tp1",
        resume_from_checkpoint=f"{root}/tp2/checkpoints/step_00000005", trust_external_checkpoint=True, **COMMON,
    )  # fmt: skip
    return {"reference": reference, "resumed": resumed}


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("gpt2_vocab"))
    runs = launch_on_two_four_one(root, _gpt2_tp2, _gpt2_tp4, _gpt2_one)
    return {"tp2": runs["two"], "tp4": runs["four"], "one": runs["one"], "root": root}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2", "tp4"])
def test_gpt2_vocabulary_trains_at_tp_like_one_process(gpt2_runs, layout):
    reference = gpt2_runs["one"]["reference"]
    for run in gpt2_runs[layout]:
        assert len(run["losses"]) == len(reference["losses"]) == 10
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert reference["losses"][-1] != pytest.approx(reference["losses"][0], rel=1e-3)  # it trained
    weights = gpt2_runs[layout][0]["weights"]
    assert weights["transformer.wte.weight"].shape == (GPT2_VOCAB, 64)  # the logical rows, padding trimmed
    for name, tensor in reference["weights"].items():
        assert (weights[name] - tensor).abs().max().item() <= 1e-5, name
    worst = max(abs(a - b) / abs(b) for a, b in zip(gpt2_runs[layout][0]["losses"], reference["losses"], strict=True))
    print(f"\nGPT-2 shape, vocabulary {GPT2_VOCAB:,}, {layout}: largest relative loss difference {worst:.1e}")


@pytest.mark.distributed
def test_gpt2_vocabulary_exports_and_checkpoints_logical_rows_and_resumes_at_tp1(gpt2_runs):
    from torch.testing import assert_close

    exported = gpt2_runs["tp2"][0]["inspected"]
    assert exported["rows"] == (GPT2_VOCAB, 64)
    assert exported["max_logit_diff"] <= 1e-5  # plain transformers' reload gives the trained tp=2 model's logits
    state = Path(gpt2_runs["root"], "tp2", "checkpoints", "step_00000005", "state")
    assert read_model_tensors(state)["transformer.wte.weight"].shape == (GPT2_VOCAB, 64)  # padding not stored
    layout = json.loads((state / "sharded.json").read_text())
    assert layout["tp"] == 2
    # the tp=2 checkpoint at step 5, resumed at tp=1 (one process), continues exactly as tp=2 did
    full, resumed = gpt2_runs["tp2"][0], gpt2_runs["one"]["resumed"]
    assert resumed["global_step"] == 10
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5)
    for name, tensor in full["weights"].items():
        assert_close(resumed["weights"][name], tensor, rtol=0, atol=1e-5)


# ----------------------------------------------------------------- sizes and plans, no processes
def _llama_config(**sizes):
    config = tiny_config("llama")
    for name, value in sizes.items():
        setattr(config, name, value)
    return config


SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "head_dim": 64,
           "intermediate_size": 1536, "vocab_size": 49152}  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4, 9])
def test_smollm2_shapes_refuse_tp_other_than_1_and_3_naming_them(tp):
    from hftrain.parallel import check_tensor_parallel

    with pytest.raises(ConfigError, match=r"of this llama model; valid tp values for it: 1, 3$"):
        check_tensor_parallel(_llama_config(**SMOLLM2), tp)


def test_smollm2_shapes_split_evenly_at_tp3():
    from hftrain.parallel import check_tensor_parallel
    from hftrain.parallel.plans import GroupedQuerySplit, grouped_query_split

    check_tensor_parallel(_llama_config(**SMOLLM2), 3)
    assert grouped_query_split(9, 3, 3) == GroupedQuerySplit(heads=3, kv_heads=1, replicas=1)
    assert grouped_query_split(4, 1, 4) == GroupedQuerySplit(heads=1, kv_heads=1, replicas=4)
    assert grouped_query_split(8, 2, 4).groups == 2


def test_key_value_heads_neither_divided_nor_replicated_are_refused():
    from hftrain.parallel import check_tensor_parallel

    config = _llama_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                           intermediate_size=96)  # fmt: skip
    refusal = r"tp=2 neither divides nor is a multiple of num_key_value_heads=3 \(split evenly or replicated\)"
    with pytest.raises(ConfigError, match=refusal + r" of this llama model; valid tp values for it: 1, 3, 6$"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 6)  # 6 query heads, each key/value head on 2 ranks


@pytest.mark.parametrize(
    ("vocab", "tp", "multiple", "padded"),
    [(GPT2_VOCAB, 1, 1, GPT2_VOCAB), (GPT2_VOCAB, 2, 1, 50_258), (GPT2_VOCAB, 8, 1, 50_264),
     (GPT2_VOCAB, 1, 128, 50_304), (GPT2_VOCAB, 8, 128, 51_200), (50_265, 2, 1, 50_266),
     (119_547, 2, 1, 119_548), (30_522, 4, 1, 30_524)],
)  # fmt: skip
def test_vocabularies_pad_to_a_multiple_of_tp(vocab, tp, multiple, padded):
    from hftrain.parallel import check_tensor_parallel
    from hftrain.parallel.plans import padded_vocab_size

    assert padded_vocab_size(vocab, tp, multiple) == padded
    from transformers import GPT2Config

    check_tensor_parallel(GPT2Config(vocab_size=vocab, n_embd=64, n_head=8), tp)  # the vocabulary is no constraint


def test_plan_has_tensor_parallel_rows_for_gpt2_vocabularies(tmp_path):
    """``hftrain plan`` for GPT-2 small (12 heads: tp 2, 4) and medium (16 heads: tp 2, 4, 8), both with 50,257
    tokens: each GPU's embedding share is the padded vocabulary's."""
    from transformers import GPT2Config

    from hftrain.plan import Hardware, Workload, model_from_config, plan
    from hftrain.plan.model_parallel import layer_parameters_per_gpu, stage_parameters

    for name, config, tps in (("small", GPT2Config(), (2, 4)),
                              ("medium", GPT2Config(n_layer=24, n_embd=1024, n_head=16), (2, 4, 8))):  # fmt: skip
        config.save_pretrained(tmp_path / name)
        model = model_from_config(str(tmp_path / name / "config.json"))
        assert model.vocab == GPT2_VOCAB
        rows = plan(model, Hardware(gpus_per_node=8, gpu_memory=80e9), Workload()).rows
        labels = {row.label for row in rows}
        for tp in tps:
            assert f"megatron tp{tp}·pp1·dp{8 // tp}" in labels, (name, tp, sorted(labels))
            padded = -(-GPT2_VOCAB // tp) * tp  # 50,258 / 50,260 / 50,264 rows, split over tp
            outside = model.embedding_parameters - GPT2_VOCAB * model.hidden
            expected = model.layers * layer_parameters_per_gpu(model, tp) + padded * model.hidden / tp + outside
            assert stage_parameters(model, tp, 1) == pytest.approx(expected)
        if name == "small":
            assert not any(label.startswith("megatron tp8") for label in labels)  # 12 heads


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_plan_command_takes_gpt2_medium_at_tp(tp, capsys):
    """``hftrain plan --tp`` with GPT-2 medium's sizes and its 50,257-token vocabulary (refused at every tp > 1 before
    the vocabulary was padded); the model states count the padded embedding's share."""
    from hftrain.cli import main

    sizes = ["--layers", "24", "--hidden", "1024", "--heads", "16", "--vocab", str(GPT2_VOCAB)]
    assert main(["plan", *sizes, "--tp", str(tp), "--gpus-per-node", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert f"megatron tp{tp}·pp1·dp{8 // tp}" in [row["label"] for row in rows]  # and the tp × pp layouts
