"""TP plans on tiny BERT, GPT-2, Llama and the mixture-of-experts Mixtral and Qwen2-MoE: TP=2 (2 gloo processes) and
TP2×DP2 (4) equal the unsharded model; every other family with a plan (``tests.tiny.FAMILY_KINDS``: RoBERTa, XLM-R,
ELECTRA, DistilBERT, GPT-NeoX, Mistral, Qwen2, Qwen3, Gemma, Gemma-2, Gemma-3, Phi-3, OLMo-2, Qwen3-MoE,
DeBERTa-v2, ALBERT) at TP=2 with sequence parallelism (MoE and ALBERT: without), its special layers on (sliding
windows, soft-capping, qk-norm, scaled embeddings, fused qkv: GPT-NeoX's per head, Phi-3's grouped-query q, k, v
parts and fused gate/up; DeBERTa-v2's disentangled relative attention, its key projections shared with the
positions (v3) or not; ALBERT's one layer group run by every layer, split once).

Checked per family, with and without sequence parallelism, in one launch: logits, loss and full gradients;
three AdamW steps; each rank holding 1/tp of each split weight (read from the live modules); the per-rank
attention head counts; ``full_state_dict`` loading strictly into the plain HF class with identical logits;
``load_full_state_dict`` / ``shard_full_tensor`` as its inverse. DeBERTa-v2's dropout on its relative embeddings
draws one mask for the tp group (the unsplit model's heads all see one mask).
"""

from __future__ import annotations

import pytest

from hftrain.errors import ConfigError
from tests.distributed import run_distributed

# split parameters per family in the tiny 2-layer models: per layer (BERT: q, k, v weights and biases, attention
# output weight, intermediate weight and bias, output weight; GPT-2: c_attn w+b, attn c_proj w, c_fc w+b, mlp
# c_proj w; Llama: q, k, v, o, gate, up, down) + the word embeddings
# Mixtral: q, k, v, o (its MoE block is replicated); Qwen2-MoE: q, k, v weights and biases, o
SPLIT_COUNTS = {
    "bert": 2 * 10 + 1,
    "gpt2": 2 * 6 + 1,
    "llama": 2 * 7 + 1,
    "llama_kv1": 2 * 7 + 1,
    "mixtral": 2 * 4 + 1,
    "qwen2_moe": 2 * 7 + 1,
    # BERT's layout (DistilBERT: q, k, v w+b, out_lin w, lin1 w+b, lin2 w); GPT-NeoX: fused qkv w+b, dense w,
    # h_to_4h w+b, 4h_to_h w; Qwen2: q, k, v w+b, o, gate, up, down; Qwen3-MoE: q, k, v, o
    **dict.fromkeys(("roberta", "xlm-roberta", "electra", "distilbert", "qwen2"), 2 * 10 + 1),
    "gpt_neox": 2 * 6 + 1,
    **dict.fromkeys(("mistral", "qwen3", "gemma", "gemma2", "gemma3_text"), 2 * 7 + 1),
    "qwen3_moe": 2 * 4 + 1,
    "olmo2": 2 * 9 + 1,  # q, k, v, o, gate, up, down and the q/k norms over the whole width
    "modernbert": 2 * 6 + 1,  # fused Wqkv w+b (q, k, v each per head), attention Wo, fused GLU Wi w+b, mlp Wo
    "phi3": 2 * 4 + 1,  # fused qkv (q, k and v rows split each per head), o, fused gate_up (each half split), down
    "deberta-v2": 2 * 10 + 1,  # BERT's layout (its relative embeddings are replicated, their gradient summed)
    "deberta-v2_separate": 2 * 14 + 1,  # and pos_key_proj, pos_query_proj w+b: share_att_key off (DeBERTa-v2's default)
    "albert": 10 + 1,  # its one layer group, which both layers run: q, k, v w+b, dense w, ffn w+b, ffn_output w
}
HEAD_ATTRIBUTES = {
    "bert": ("bert.encoder.layer.0.attention.self", {"num_attention_heads": 1, "all_head_size": 16}),
    "gpt2": ("transformer.h.0.attn", {"num_heads": 1, "embed_dim": 16, "split_size": 16}),
    "llama": ("model.layers.0.self_attn", {"num_key_value_groups": 2}),
    "llama_kv1": ("model.layers.0.self_attn", {"num_key_value_groups": 2}),
    "mixtral": ("model.layers.0.self_attn", {"num_key_value_groups": 2}),
    "qwen2_moe": ("model.layers.0.self_attn", {"num_key_value_groups": 2}),
    "roberta": ("roberta.encoder.layer.0.attention.self", {"num_attention_heads": 1, "all_head_size": 16}),
    "xlm-roberta": ("roberta.encoder.layer.0.attention.self", {"num_attention_heads": 1, "all_head_size": 16}),
    "electra": ("electra.encoder.layer.0.attention.self", {"num_attention_heads": 1, "all_head_size": 16}),
    "distilbert": ("distilbert.transformer.layer.0.attention", {}),  # its views take the head count from -1
    "gpt_neox": ("gpt_neox.layers.0.attention", {}),
    **{
        kind: ("model.layers.0.self_attn", {"num_key_value_groups": 2})
        for kind in ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "qwen3_moe", "olmo2")
    },
    "modernbert": ("model.layers.0.attn", {}),  # its views take the head count from -1
    "albert": ("albert.encoder.albert_layer_groups.0.albert_layers.0.attention", {}),  # its views too
    # Phi-3 slices its fused qkv by its (own, per-rank) config's head counts
    "phi3": ("model.layers.0.self_attn", {"num_key_value_groups": 2, "num_key_value_heads": 1}),
    **{
        kind: ("deberta.encoder.layer.0.attention.self", {"num_attention_heads": 1, "all_head_size": 16})
        for kind in ("deberta-v2", "deberta-v2_separate")
    },
}
KINDS = ("bert", "gpt2", "llama", "llama_kv1")
# mixture of experts: without sequence parallelism only (refused: the replicated MoE block needs the whole sequence)
MOE_KINDS = ("mixtral", "qwen2_moe")
# the other families with a tensor-parallel plan: at tp2 (2 processes) with sequence parallelism (MoE: without)
FAMILY_SP = {kind: kind not in ("qwen3_moe", "albert") for kind in SPLIT_COUNTS if kind not in (*KINDS, *MOE_KINDS)}
# "llama_kv1": 4 query heads of 8 and one key/value head: tp=2 replicates it (Megatron/vLLM), each rank holds the
# whole head (k/v rows 8) beside its 2 query heads (q/o rows 16)
REPLICATED = {"k_proj": 8, "v_proj": 8}


def _batch(kind: str):
    import torch

    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (4, 8), generator=generator)
    pad = 1 if kind in ("roberta", "xlm-roberta", "electra") else 0  # the tiny configs' pad ids
    ids[1, 5:] = pad  # right padding
    ids[3, 3:] = pad
    return {"input_ids": ids, "attention_mask": (ids != pad).long(), "labels": torch.tensor([0, 1, 1, 0])}


def _build(kind: str, seed: int = 0, dropout: float = 0.0):
    import torch
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    config = tiny_config(kind.removesuffix("_kv1").removesuffix("_separate"), dropout=dropout)
    if kind == "llama_kv1":
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 1, 8
    if kind == "deberta-v2_separate":  # c2p and p2c through their own position projections
        config.share_att_key = False
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config)


def _check_family(kind: str, sequence_parallel: bool, groups) -> dict:
    """TP over ``groups.tp_group``; each dp replica takes its rows of the batch and gradients are averaged over dp."""
    import torch
    import torch.distributed as dist
    from torch.testing import assert_close

    from hftrain.parallel import (
        apply_tensor_parallel,
        full_state_dict,
        gather_full_tensors,
        load_full_state_dict,
        shard_full_tensor,
        split_over,
        sum_partial_grads,
    )
    from hftrain.parallel.collectives import all_reduce_coalesced

    group, tp = groups.tp_group, groups.tp_size
    ref, model = _build(kind), _build(kind)
    apply_tensor_parallel(model, tp_group=group, sequence_parallel=sequence_parallel)
    batch = _batch(kind)
    local_batch = {k: v.chunk(groups.dp_size)[groups.dp_rank] for k, v in batch.items()}  # sharded by dp rank

    # each rank holds 1/tp of every split weight (a whole key/value head when tp replicates them), read from the
    # live modules
    shards = split_over(model, "tp")
    assert len(shards) == SPLIT_COUNTS[kind], sorted(shards)
    local_numel = full_numel = 0
    for name, shard in shards.items():
        live, full = model.get_parameter(name), ref.get_parameter(name)
        module = name.split(".")[-2]
        expected = list(shard.full_shape)
        replicated = kind == "llama_kv1" and module in REPLICATED
        expected[shard.dim] = REPLICATED[module] if replicated else expected[shard.dim] // tp
        assert list(live.shape) == expected, name
        assert_close(live.detach(), shard_full_tensor(name, full.detach(), model))
        if not replicated:
            local_numel, full_numel = local_numel + live.numel(), full_numel + full.numel()
    total = torch.tensor(float(local_numel))
    dist.all_reduce(total, group=group)
    assert total.item() == full_numel  # the shards partition the split weights
    assert local_numel * tp == full_numel
    path, attributes = HEAD_ATTRIBUTES[kind]
    attention = model.get_submodule(path)
    assert {a: getattr(attention, a) for a in attributes} == attributes

    # AdamW steps: logits, loss and full gradients equal the unsharded model's at every step
    # eps 1e-6: Adam's first step moves a weight by lr·g/(|g| + eps), so with the default 1e-8 a gradient element
    # near zero (1.7e-9 in llama_kv1's up_proj) turns float32 summation-order noise (2e-10) into 1.5e-4 of weight
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (ref, model)]
    losses = []
    for _step in range(3):
        expected_out, out = ref(**batch), model(**local_batch)
        assert_close(out.logits, expected_out.logits.chunk(groups.dp_size)[groups.dp_rank])
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=groups.dp_group)
        assert_close(loss / groups.dp_size, expected_out.loss.detach())
        expected_out.loss.backward()
        out.loss.backward()
        sum_partial_grads(model, "tp", group)
        # data parallel over the dp group only: the mean of the replicas' gradients (equal row counts)
        all_reduce_coalesced([p.grad for p in model.parameters()], groups.dp_group)
        for param in model.parameters():
            param.grad /= groups.dp_size
        grads = gather_full_tensors({n: p.grad for n, p in model.named_parameters()}, model, groups={"tp": group})
        for name, param in ref.named_parameters():
            assert_close(grads[name], param.grad, msg=lambda m, name=name: f"{kind} grad {name}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item() / groups.dp_size)

    # the unsharded state dict loads strictly into the plain HF class and gives the same logits
    full = full_state_dict(model, groups={"tp": group})
    plain = _build(kind, seed=123)
    plain.load_state_dict(full, strict=True)
    with torch.no_grad():
        assert_close(plain(**batch).logits, ref(**batch).logits)
        # and back: a fresh TP model loads the trained full weights
        fresh = apply_tensor_parallel(_build(kind), tp_group=group, sequence_parallel=sequence_parallel)
        load_full_state_dict(fresh, ref.state_dict())
        assert_close(fresh(**batch).logits, ref(**batch).logits)
    return {"losses": losses, "decreased": losses[-1] < losses[0], "moved": losses[-1] != losses[0]}


def _dropout_stays_replicated(kind: str, groups) -> str:
    """With dropout on, the tp ranks' replicated activations and gradients must stay identical (same streams)."""
    import torch
    import torch.distributed as dist

    from hftrain.errors import ConfigError
    from hftrain.parallel import apply_tensor_parallel, split_over, sum_partial_grads

    try:
        model = apply_tensor_parallel(_build(kind, dropout=0.1), tp_group=groups.tp_group).train()
    except ConfigError as error:
        return str(error)
    torch.manual_seed(7)  # as the Trainer seeds every rank
    out = model(**_batch(kind))
    out.loss.backward()
    sum_partial_grads(model, "tp", groups.tp_group)
    split = split_over(model, "tp")
    mine = torch.cat(
        [out.logits.detach().reshape(-1)] + [p.grad.reshape(-1) for n, p in model.named_parameters() if n not in split]
    )
    every = [torch.empty_like(mine) for _ in range(groups.tp_size)]
    dist.all_gather(every, mine, group=groups.tp_group)
    return "identical" if all(torch.equal(every[0], other) for other in every) else "diverged"


def _relative_dropout_masks(groups) -> dict:
    """DeBERTa-v2's dropout on the relative embeddings (every layer's ``pos_dropout``, before each rank projects them
    onto its own heads) draws one mask for the tp group under hftrain's RNG streams, with and without sequence
    parallelism: the unsplit model's heads all see one mask. Returns per sp: the kept fraction of the masks, and
    whether every rank drew the same masks."""
    import torch
    import torch.distributed as dist

    from hftrain.parallel import apply_tensor_parallel
    from hftrain.parallel.random import RNGTracker

    report = {}
    for sequence_parallel in (False, True):
        tracker = RNGTracker(seed=7, tp_rank=groups.tp_rank, pp_rank=0).seed_streams()
        model = apply_tensor_parallel(
            _build("deberta-v2", dropout=0.1),
            tp_group=groups.tp_group,
            sequence_parallel=sequence_parallel,
            rng_tracker=tracker,
        ).train()
        masks = []
        for name, module in model.named_modules():
            if name.endswith("pos_dropout"):
                module.register_forward_hook(lambda _m, _args, out, masks=masks: masks.append((out != 0).flatten()))
        model(**_batch("deberta-v2")).loss.backward()
        mine = torch.cat(masks).float()
        every = [torch.empty_like(mine) for _ in range(groups.tp_size)]
        dist.all_gather(every, mine, group=groups.tp_group)
        report[sequence_parallel] = {
            "layers": len(masks),
            "kept": mine.mean().item(),
            "same": all(torch.equal(every[0], other) for other in every),
        }
    return report


def _all_plan_checks(sequence_parallel: tuple[bool, ...]) -> dict:
    import torch.distributed as dist

    from hftrain.errors import HFTrainError
    from hftrain.parallel import ParallelDims, apply_tensor_parallel, build_groups

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = build_groups(ParallelDims(dist.get_world_size(), tp=2), rank)
    report = {(kind, sp): _check_family(kind, sp, groups) for kind in KINDS for sp in sequence_parallel}
    report |= {(kind, False): _check_family(kind, False, groups) for kind in MOE_KINDS}
    report |= {(kind, "dropout"): _dropout_stays_replicated(kind, groups) for kind in KINDS + MOE_KINDS}
    if groups.dp_size == 1:  # the other families at tp2 only (the 2-process launch)
        report |= {(kind, sp): _check_family(kind, sp, groups) for kind, sp in FAMILY_SP.items()}
        report |= {(kind, "dropout"): _dropout_stays_replicated(kind, groups) for kind in FAMILY_SP}
        report["relative_dropout"] = _relative_dropout_masks(groups)
    try:  # sequence parallelism with a replicated MoE block is refused before anything is split
        apply_tensor_parallel(_build("mixtral"), tp_group=groups.tp_group, sequence_parallel=True)
    except HFTrainError as error:
        report["moe_sp"] = str(error)
    try:  # different weights per rank (no common seed) are refused, not silently mixed
        apply_tensor_parallel(_build("bert", seed=rank), tp_group=groups.tp_group)
    except HFTrainError as error:
        report["unseeded"] = str(error)
    dist.destroy_process_group()
    return report


@pytest.mark.distributed
# TP2×DP2 runs the sequence-parallel variant only (the harder path) to keep the 4-process launch short
@pytest.mark.parametrize(("nprocs", "sequence_parallel"), [(2, (False, True)), (4, (True,))], ids=["tp2", "tp2xdp2"])
def test_tp_plans_match_unsharded_models(nprocs, sequence_parallel):
    results = run_distributed(_all_plan_checks, nprocs=nprocs, timeout=900, sequence_parallel=sequence_parallel)
    for report in results:  # the comparisons are asserted inside every rank
        for kind in KINDS:
            assert all(report[(kind, sp)]["decreased"] for sp in sequence_parallel)
        for kind in MOE_KINDS:
            assert report[(kind, False)]["decreased"], kind
        for kind in KINDS + MOE_KINDS:  # replicated key/value heads too: no refusal of attention dropout any more
            assert report[(kind, "dropout")] == "identical", kind
        if nprocs == 2:
            for kind, sp in FAMILY_SP.items():
                assert report[(kind, sp)]["moved"], kind  # trained (each step compared inside the ranks)
                assert report[(kind, "dropout")] == "identical", kind
            for masks in report["relative_dropout"].values():  # 2 layers, p = 0.1: one mask for the tp group
                assert masks["layers"] == 2 and 0.8 < masks["kept"] < 0.97 and masks["same"], masks
        assert "same seed" in report["unseeded"]
        assert report["moe_sp"].startswith("sequence parallelism is not supported for this mixtral model")
    assert all(r[("gpt2", True)]["losses"] == results[0][("gpt2", True)]["losses"] for r in results)


def _config(kind: str, **sizes):
    from tests.tiny import tiny_config

    config = tiny_config(kind)
    for name, value in sizes.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize(
    ("kind", "sizes", "tp", "named"),
    [
        ("bert", {}, 4, "num_attention_heads=2"),
        ("bert", {"intermediate_size": 66}, 4, "intermediate_size=66"),
        ("gpt2", {"n_head": 4, "n_embd": 36}, 8, "n_head=4, n_embd=36"),
        (
            "llama",
            {},
            8,
            r"tp=8 does not divide num_attention_heads=4 of this llama model; valid tp values for it: 1, 2, 4$",
        ),
        (
            "llama",
            {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8},
            4,
            "tp=4 does not divide num_attention_heads=6 and neither divides nor is a multiple of num_key_value_heads=3",
        ),
        (
            "llama",
            {"intermediate_size": 66},
            4,
            r"tp=4 does not divide intermediate_size=66 of this llama model; valid tp values for it: 1, 2$",
        ),
        # Phi-3's fused qkv_proj: tp divides its key/value heads (no replicated head beside split query rows)
        ("phi3", {"num_key_value_heads": 1}, 2, r"tp=2 does not divide num_key_value_heads=1 of this phi3 model"),
        # SmolLM2-135M's sizes: 9 heads, 3 key/value heads: tp 1 or 3 (tests/test_tp_shapes.py has more)
        (
            "llama",
            {
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "hidden_size": 576,
                "intermediate_size": 1536,
                "vocab_size": 49152,
            },
            2,
            r"tp=2 does not divide num_attention_heads=9 and neither divides nor is a multiple of "
            r"num_key_value_heads=3 \(split evenly or replicated\) of this llama model; valid tp values for it: 1, 3$",
        ),
    ],
)
def test_check_tensor_parallel_names_the_size(kind, sizes, tp, named):
    from hftrain.parallel import check_tensor_parallel

    with pytest.raises(ConfigError, match=named):
        check_tensor_parallel(_config(kind, **sizes), tp)
    check_tensor_parallel(_config(kind, **sizes), 1)


def test_smollm2_sizes_run_at_tp_3_balanced():
    from hftrain.parallel import check_tensor_parallel
    from hftrain.parallel.plans import GroupedQuerySplit, grouped_query_split

    config = _config(
        "llama",
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
    )
    for tp in (1, 3):
        check_tensor_parallel(config, tp)
    # 3 query heads and 1 key/value head on every rank (no longer 6+3 / 2+1 at tp=2, which is refused)
    assert grouped_query_split(9, 3, 3) == GroupedQuerySplit(heads=3, kv_heads=1, replicas=1)
    with pytest.raises(ConfigError, match="valid tp values for it: 1, 3$"):
        check_tensor_parallel(config, 2)


def test_check_tensor_parallel_refuses_unknown_family():
    from transformers import AlbertConfig, BartConfig

    from hftrain.parallel import check_tensor_parallel
    from hftrain.parallel.families import check_family

    with pytest.raises(ConfigError, match="tensor parallelism has no entry for model type 'bart' .supported: BERT"):
        check_tensor_parallel(BartConfig(), 2)
    check_tensor_parallel(AlbertConfig(), 2)  # its shared layer group is split once
    with pytest.raises(ConfigError, match="sequence parallelism is not supported for this albert model: its attention"):
        check_tensor_parallel(AlbertConfig(), 2, sequence_parallel=True)
    check_family(AlbertConfig(), axis="cp")  # cp gathers its whole sequences once, after the encoder's last run


def test_deberta_v2_refuses_what_its_plan_cannot_split_in_one_line():
    """DeBERTa-v2 takes tp (v3's config and v2's default share_att_key off alike) and pp; its convolution layer
    (conv_kernel_size > 0: v2-xlarge) is refused for both and for cp (which takes the other configs), each naming
    why."""
    from hftrain.errors import AxisError
    from hftrain.parallel import check_tensor_parallel
    from hftrain.parallel.families import check_family, trainable_axes

    config = _config("deberta-v2")
    check_tensor_parallel(config, 2, sequence_parallel=True)
    assert trainable_axes(config) == {"tp", "pp", "cp"}
    with pytest.raises(ConfigError, match=r"tp=4 does not divide num_attention_heads=2 of this deberta-v2 model"):
        check_tensor_parallel(config, 4)
    check_family(config, head="sequence_classification")  # pp takes it
    check_family(config, head="sequence_classification", axis="cp")  # and cp (all-to-all: tests/test_cp_deberta.py)
    conv = _config("deberta-v2", conv_kernel_size=3)
    with pytest.raises(AxisError, match=r"DeBERTa-v2 model: its convolution after the first layer \(conv_kernel_size"):
        check_tensor_parallel(conv, 2)
    check_tensor_parallel(conv, 1)  # nothing to split: it runs whole (dp)
    with pytest.raises(AxisError, match=r"^pipeline parallelism cannot split this DeBERTa-v2 model: its convolution"):
        check_family(conv, head="sequence_classification")
    with pytest.raises(AxisError, match=r"^context parallelism cannot split this DeBERTa-v2 model: its convolution"):
        check_family(conv, head="sequence_classification", axis="cp")
    assert trainable_axes(conv) == set()


def test_sequence_multiple():
    from hftrain.parallel import sequence_multiple

    assert sequence_multiple(4, sequence_parallel=True) == 4
    assert sequence_multiple(4, sequence_parallel=False) == 1


def _smollm2_matches(model_dir: str) -> dict:
    """The real SmolLM2-135M (9 query / 3 key-value heads, 30 layers) split evenly at tp=3 equals the whole model."""
    import torch
    import torch.distributed as dist
    from torch.testing import assert_close
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hftrain.parallel import (
        ParallelDims,
        apply_tensor_parallel,
        build_groups,
        gather_full_tensors,
        split_over,
        sum_partial_grads,
    )

    dist.init_process_group("gloo")
    groups = build_groups(ParallelDims(dist.get_world_size(), tp=3), dist.get_rank())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["a gripping, beautifully acted film", "dull and far too long; I left early"]
    batch = dict(tokenizer(texts, padding="max_length", max_length=12, return_tensors="pt"))
    batch["labels"] = torch.tensor([1, 0])

    def build():
        torch.manual_seed(0)  # the new classification head: same initial weights on every rank
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
        model.config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
        return model

    ref = build()
    expected = ref(**batch)
    expected.loss.backward()
    report = {}
    for sequence_parallel in (False, True):
        model = apply_tensor_parallel(build(), tp_group=groups.tp_group, sequence_parallel=sequence_parallel)
        out = model(**batch)
        out.loss.backward()
        sum_partial_grads(model, "tp", groups.tp_group)
        grads = gather_full_tensors(
            {n: p.grad for n, p in model.named_parameters()}, model, groups={"tp": groups.tp_group}
        )
        assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
        for name, param in ref.named_parameters():
            # atol 2e-6: at tp=3, 1 of q_proj's 331,776 gradient elements in layer 12 differed by 1.2e-6 (float32
            # summation order over 30 layers; 1e-6 held at tp=2)
            assert_close(grads[name], param.grad, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")
        q = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
        report[sequence_parallel] = {
            "q_rows": q.shape[0],
            "logit_diff": (out.logits - expected.logits).abs().max().item(),
            "split": len(split_over(model, "tp")),
        }
    dist.destroy_process_group()
    return report


@pytest.mark.slow
@pytest.mark.distributed
def test_smollm2_tp3_matches_unsharded():
    from hftrain.models import resolve_model_path

    model_dir = str(resolve_model_path("embedded:smollm2"))  # converts the GGUF once, before the launch
    results = run_distributed(_smollm2_matches, nprocs=3, timeout=1200, model_dir=model_dir)
    assert [r[False]["q_rows"] for r in results] == [3 * 64] * 3  # 3 query heads (and 1 key/value head) per rank
    assert all(r[sp]["split"] == 30 * 7 + 1 for r in results for sp in (False, True))
    largest = max(r[sp]["logit_diff"] for r in results for sp in (False, True))
    print(f"\nSmolLM2-135M tp=3 vs unsharded: max logit difference {largest:.2e}")
