"""The ``"token_classification"`` head kind at the parallel level (``hftrain.parallel.heads``): a tiny
``*ForTokenClassification`` cut into pipeline chunks, run in global order in one process, gives the HF model's
per-token logits, loss and gradients; under tp=2 (with and without sequence parallelism, 2 gloo processes) the split
model gives the same per-token logits, loss and full gradients. The head kinds' traits and refusals are checked
from configs (no processes). The Trainer and task side of token classification are tested with the task."""

from __future__ import annotations

import pytest

from hftrain.errors import ConfigError
from tests.distributed import run_distributed

NUM_LABELS = 5


def _model(kind: str, layers: int = 4, seed: int = 0):
    import torch
    from transformers import AutoModelForTokenClassification

    from tests.tiny import tiny_config

    config = tiny_config(kind, num_labels=NUM_LABELS, num_layers=layers)
    config.classifier_dropout = 0.0  # transformers' generic decoder head defaults to 0.1: one process's masks differ
    torch.manual_seed(seed)
    return AutoModelForTokenClassification.from_config(config)


def _batch(pad: int = 0):
    """Right-padded rows; word labels on some positions, ``-100`` on padding and on sub-tokens after the first."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (4, 8), generator=gen)
    mask = torch.ones_like(ids)
    for row, keep in enumerate([8, 5, 3, 7]):
        ids[row, keep:], mask[row, keep:] = pad, 0
    labels = torch.randint(0, NUM_LABELS, ids.shape, generator=gen)
    labels[mask == 0] = -100
    labels[:, 2] = -100  # a later sub-token of a word
    return {"input_ids": ids, "attention_mask": mask}, labels


@pytest.mark.parametrize("kind", ["bert", "llama", "gpt2", "modernbert"])
def test_token_chunks_in_sequence_equal_model(kind):
    """2 × 2 chunks with head ``"token_classification"``, run in global order: the model's logits ``[b, s, n]``
    exactly, transformers' per-token loss (padding and ``-100`` left out) and every gradient exactly."""
    import torch

    from hftrain.parallel import build_stage_modules

    model = _model(kind)
    inputs, labels = _batch()
    out = model(**inputs, labels=labels)
    assert out.logits.shape == (4, 8, NUM_LABELS)
    out.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    by_index = {}
    for rank in range(2):
        chunks = build_stage_modules(model, pp_rank=rank, pp=2, virtual_stages=2, head="token_classification")
        for k, chunk in enumerate(chunks):
            by_index[rank + k * 2] = chunk
    head = by_index[0].task_head
    assert head.per_position
    acts = by_index[0].first_args(inputs)
    for index in range(4):
        acts = by_index[index](*acts)
        acts = acts if isinstance(acts, tuple) or index == 3 else (acts,)
        if index < 3:
            assert len(acts) == 2  # hidden and the mask: a token classifier carries nothing beside them
    logits = acts
    assert torch.equal(logits, out.logits)
    output = head.output(logits, labels, model.config)
    assert torch.equal(output.loss, out.loss)
    manual = torch.nn.functional.cross_entropy(logits.view(-1, NUM_LABELS), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(output.loss, manual, rtol=0, atol=0)  # the mean over the labelled tokens
    output.loss.backward()
    names = {name for chunk in by_index.values() for name, _ in chunk.hf_named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_head_kinds_and_their_refusals():
    """The head kind is the caller's word, not the model class's: its traits decide what pp takes; a name that is
    not a kind is refused in one line naming the kinds."""
    from hftrain.parallel.families import check_family, stages_of, trainable_axes
    from hftrain.parallel.heads import HEADS, CausalLMHead, TokenClassificationHead, head_kind
    from tests.tiny import tiny_config

    assert set(HEADS) == {"sequence_classification", "token_classification", "causal_lm"}
    assert [HEADS[k].per_token for k in HEADS] == [False, True, True]
    assert trainable_axes(tiny_config("bert"), head="token_classification") == {"tp", "pp", "cp"}
    assert trainable_axes(tiny_config("llama"), head="token_classification") == {"tp", "pp", "cp"}
    # pp takes a MoE family's sequence classifier and causal LM (their pipeline losses add the router loss), not its
    # token classifier (its router loss is not in that pipeline loss yet)
    assert [HEADS[k].router_loss for k in HEADS] == [True, False, True]
    moe = tiny_config("mixtral")
    assert trainable_axes(moe) == trainable_axes(moe, head="causal_lm") == {"tp", "pp", "cp", "ep"}
    check_family(moe, head="causal_lm")
    assert trainable_axes(moe, head="token_classification") == {"tp", "cp", "ep"}
    with pytest.raises(ConfigError, match="not its token_classification head") as info:
        check_family(moe, head="token_classification")
    assert "\n" not in str(info.value)
    # a causal LM head needs a causal trunk under pp
    with pytest.raises(ConfigError, match="splits decoder causal LMs, not a BERT causal_lm model"):
        check_family(tiny_config("bert"), head="causal_lm")
    with pytest.raises(ConfigError, match="head 'ForMaskedLM' is not a pipeline head kind; use one of") as info:
        head_kind("ForMaskedLM")
    assert "\n" not in str(info.value)
    # the kind picks the head on the family's trunk: the decoders' per-token classifier is transformers' ``score``
    llama, bert = _model("llama", layers=2), _model("bert", layers=2)
    assert isinstance(stages_of(llama, "token_classification").head, TokenClassificationHead)
    assert stages_of(llama, "token_classification").head.modules(llama)["classifier"] is llama.score
    assert stages_of(bert, "token_classification").head.modules(bert)["classifier"] is bert.classifier
    assert isinstance(stages_of(llama, "causal_lm").head, CausalLMHead)


def _tp_token_classification(sequence_parallel: tuple[bool, ...]) -> dict:
    """Each kind, split by ``parallelize_model(..., head="token_classification")`` over tp=2: per-token logits, loss
    and the gathered full gradients equal the unsharded model's, for each sequence-parallel setting."""
    import torch.distributed as dist
    from torch.testing import assert_close

    from hftrain.parallel import (
        ParallelDims,
        build_groups,
        gather_full_tensors,
        parallelize_model,
        split_over,
        sum_partial_grads,
    )

    dist.init_process_group("gloo")
    groups = build_groups(ParallelDims(dist.get_world_size(), tp=2), dist.get_rank())
    report = {}
    for kind in ("bert", "llama"):
        for sp in sequence_parallel:
            ref, model = _model(kind, layers=2), _model(kind, layers=2)
            parallelize_model(model, groups, sequence_parallel=sp, head="token_classification")
            assert split_over(model, "tp")  # the layers are split (the classifier stays whole on every rank)
            inputs, labels = _batch()
            expected, out = ref(**inputs, labels=labels), model(**inputs, labels=labels)
            assert_close(out.logits, expected.logits)  # [b, s, n]: every position's, on every tp rank
            assert_close(out.loss, expected.loss)
            expected.loss.backward()
            out.loss.backward()
            sum_partial_grads(model, "tp", groups.tp_group)
            grads = gather_full_tensors(
                {n: p.grad for n, p in model.named_parameters()}, model, groups={"tp": groups.tp_group}
            )
            for name, param in ref.named_parameters():
                assert_close(grads[name], param.grad, msg=lambda m, n=f"{kind} sp={sp} {name}": f"{n}: {m}")
            report[(kind, sp)] = tuple(out.logits.shape)
    for kind in ("bert", "llama"):
        report[(kind, "pp2")] = _pp_token_classification(kind, dist.get_rank())
    dist.destroy_process_group()
    return report


def _pp_token_classification(kind: str, rank: int) -> str:
    """pp=2 through the 1F1B schedule (real sends between the 2 processes, 2 micro-batches), head
    ``"token_classification"``: the batch's per-token loss (each micro-batch's token sum over the batch's labelled
    count, so the parts add up to transformers' mean), the accumulated gradients and the evaluation's per-token
    logits ``[b, s, n]`` on the last stage equal the unsharded model's."""
    import torch
    import torch.distributed as dist
    from torch.testing import assert_close

    from hftrain.parallel import build_schedule, build_stage_modules

    ref, model = _model(kind), _model(kind)
    inputs, labels = _batch()
    expected = ref(**inputs, labels=labels)
    expected.loss.backward()
    chunks = build_stage_modules(model, pp_rank=rank, pp=2, head="token_classification")
    count = int((labels != -100).sum())

    def token_loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, NUM_LABELS)
        return torch.nn.functional.cross_entropy(flat, rows.reshape(-1), ignore_index=-100, reduction="sum") / count

    pipe = build_schedule(
        "1f1b", chunks, pp_group=dist.group.WORLD, pp_rank=rank, pp=2, num_microbatches=2, loss_fn=token_loss,
        device="cpu",
    )  # fmt: skip
    loss = pipe.train_step(inputs if pipe.is_first else None, labels if pipe.is_last else None, per_example_mean=False)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            hf_name = chunk.hf_name(name)
            assert_close(param.grad, ref.get_parameter(hf_name).grad, msg=lambda m, n=f"{kind} {hf_name}": f"{n}: {m}")
    logits = pipe.eval_step(inputs if pipe.is_first else None)
    if pipe.is_last:
        assert_close(loss, expected.loss.detach())
        assert_close(logits, expected.logits.detach())
        return f"last {tuple(logits.shape)}"
    assert loss is None and logits is None
    return "first"


@pytest.mark.distributed
def test_tp2_and_pp2_token_classification_match_unsharded():
    results = run_distributed(_tp_token_classification, nprocs=2, timeout=600, sequence_parallel=(False, True))
    for rank, report in enumerate(results):  # the comparisons are asserted inside every rank
        assert {k: v for k, v in report.items() if k[1] != "pp2"} == {
            (k, sp): (4, 8, NUM_LABELS) for k in ("bert", "llama") for sp in (False, True)
        }
        stage = f"last (4, 8, {NUM_LABELS})" if rank == 1 else "first"
        assert report[("bert", "pp2")] == report[("llama", "pp2")] == stage
