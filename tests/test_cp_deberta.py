"""Context parallelism for DeBERTa-v2/v3's disentangled relative attention (``hftrain.parallel.cp_relative``).

One 2-process launch (cp = 2, all-to-all), one 4-process launch (tp = 2 × cp = 2, pp = 2 × cp = 2) and one
1-process launch (the Trainer's reference):
- the attention layer split over cp equals transformers' unsplit ``DisentangledSelfAttention`` (output, the input's
  gradient, the relative embeddings' and every parameter's, summed over cp) within 1e-5 of each tensor's largest
  entry (fp32), on padded sequences of 32 tokens (relative positions up to 31 in 8 log buckets): shared and own
  position projections, c2p with p2c and c2p alone;
- the whole classifier split over cp (``apply_context_parallel``, the family's trunk) equals the unsplit model: loss,
  logits and every gradient averaged over cp, recomputed or not;
- Trainer runs at cp = 2, tp = 2 × cp = 2 and pp = 2 × cp = 2 (``cp_comm: all_to_all``, own position projections,
  4 heads) equal one process: losses every step, the evaluation, the trained weights.
The ring (the default ``cp_comm``) is refused in one line, exit 2, naming ``cp_comm: all_to_all``.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.tiny import run_tiny_training

SEQ = 32
TRAIN = {
    "kind": "deberta-v2", "micro": 8, "steps": 4, "n_train": 32, "n_eval": 10, "words": (10, 40),
    "max_seq_length": SEQ, "return_weights": True,
    # own position projections, 4 heads (2 per rank at tp2 × cp2), weights drawn wide enough that the attention is
    # far from uniform (at the default 0.02 every head attends almost evenly, whatever its scores)
    "config_overrides": {"share_att_key": False, "num_attention_heads": 4, "initializer_range": 0.2},
}  # fmt: skip
LAYER_CASES = ((True, ("p2c", "c2p")), (False, ("p2c", "c2p")), (False, ("c2p",)))  # (share_att_key, pos_att_type)


def _error(got, expected, floor: float = 1e-4) -> float:
    """The largest difference relative to the reference tensor's largest entry (at least ``floor``)."""
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


def _layer_parity(group) -> dict:
    """Each case's worst relative error of the cp-split attention layer against the unsplit one."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers.models.deberta_v2.modeling_deberta_v2 import (
        DisentangledSelfAttention,
        build_relative_position,
    )

    from hftrain.parallel.context_parallel import ContextSplit, _Batch, zigzag_positions
    from hftrain.parallel.cp_relative import apply_relative_context_parallel
    from tests.tiny import tiny_config

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    errors = {}
    for share, types in LAYER_CASES:
        torch.manual_seed(0)
        config = tiny_config("deberta-v2", max_positions=2 * SEQ)
        config.share_att_key, config.pos_att_type = share, list(types)
        module = DisentangledSelfAttention(config)
        reference = copy.deepcopy(module)
        g = torch.Generator().manual_seed(1)
        b, width = 3, config.hidden_size
        hidden = torch.randn(b, SEQ, width, generator=g)
        embeddings = torch.randn(2 * config.position_buckets, width, generator=g)
        weights = torch.randn(b, SEQ, width, generator=g)
        keep = torch.arange(SEQ)[None] < torch.tensor([SEQ, SEQ - 7, SEQ // 2 + 3])[:, None]
        # the reference, called as transformers' encoder calls it: pairwise mask, relative positions of the sequence
        whole, whole_e = hidden.clone().requires_grad_(), embeddings.clone().requires_grad_()
        pairwise = (keep[:, None, None, :] & keep[:, None, :, None]).long()
        relative = build_relative_position(whole, whole, config.position_buckets, module.max_relative_positions)
        expected, _ = reference(whole, pairwise, relative_pos=relative, rel_embeddings=whole_e)
        (expected * weights).sum().backward()
        # the split: this rank's zigzag positions, padding and positions set as the base model's pre-hook sets them
        batch = _Batch(group, "all_to_all")
        positions = ContextSplit(batch).attend(keep[:, zigzag_positions(SEQ, cp, rank)])
        apply_relative_context_parallel([module], batch)
        mine, mine_e = hidden[:, positions].clone().requires_grad_(), embeddings.clone().requires_grad_()
        got, _ = module(mine, None, rel_embeddings=mine_e)
        (got * weights[:, positions]).sum().backward()
        worst = max(_error(got, expected[:, positions]), _error(mine.grad, whole.grad[:, positions]))
        summed = [mine_e.grad] + [p.grad for p in module.parameters()]
        for grad in summed:
            dist.all_reduce(grad, group=group)  # each rank's share: its positions' and its heads' terms
        # A bias whose gradient is 0 in exact arithmetic (softmax ignores a per-query constant: pos_key_proj's, and
        # key_proj's without p2c) holds rounding noise of 1e-7: the scale has a floor of 1, the other gradients' order.
        for grad, ref in zip(summed, [whole_e.grad] + [p.grad for p in reference.parameters()], strict=True):
            worst = max(worst, _error(grad, ref, floor=1.0))
        errors[f"share_att_key={share} {'+'.join(types)}"] = worst
    return errors


def _model_parity(group) -> dict:
    """The whole classifier split over cp against the unsplit model, plain and fully recomputed."""
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from hftrain.parallel.context_parallel import apply_context_parallel
    from hftrain.parallel.families import stages_for
    from hftrain.parallel.recompute import apply_activation_checkpointing
    from tests.tiny import tiny_config

    cp = dist.get_world_size(group)
    errors = {}
    for recompute in (None, "full"):
        torch.manual_seed(0)
        config = tiny_config("deberta-v2", num_labels=3, vocab_size=128, max_positions=2 * SEQ)
        model = AutoModelForSequenceClassification.from_config(config).train()
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 128, (3, SEQ), generator=g)
        mask = (torch.arange(SEQ)[None] < torch.tensor([SEQ, SEQ - 9, SEQ // 2 + 3])[:, None]).long()
        inputs = {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}
        expected = reference(**inputs)
        expected.loss.backward()
        trunk = stages_for(model.config, axis="cp")
        apply_context_parallel(model, trunk=trunk, per_token=False, cp_group=group, comm="all_to_all")
        if recompute is not None:
            apply_activation_checkpointing(model, recompute)
        got = model(**inputs)
        got.loss.backward()
        worst = max(_error(got.loss, expected.loss), _error(got.logits, expected.logits))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            grad = p.grad.clone()
            dist.all_reduce(grad, group=group)
            worst = max(worst, _error(grad / cp, q.grad))
        errors[f"recompute={recompute}"] = worst
    return errors


def _split_runs() -> dict:
    import torch.distributed as dist

    run = run_tiny_training(strategy="megatron", strategy_options={"cp": 2, "cp_comm": "all_to_all"}, **TRAIN)
    group = dist.group.WORLD  # the Trainer's process group stays up
    return {"trainer": run, "layer": _layer_parity(group), "model": _model_parity(group)}


FOUR = {  # the 4-process layouts
    "tp2cp2": {"tp": 2, "cp": 2, "cp_comm": "all_to_all"},
    "pp2cp2": {"pp": 2, "cp": 2, "cp_comm": "all_to_all", "num_microbatches": 2},
}


def _four_runs() -> dict:
    return {label: run_tiny_training(strategy="megatron", strategy_options=o, **TRAIN) for label, o in FOUR.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    (reference,) = run_distributed(run_tiny_training, nprocs=1, timeout=600, strategy="ddp", **TRAIN)
    return {
        "reference": reference,
        "ranks": run_distributed(_split_runs, nprocs=2, timeout=900),
        "four": run_distributed(_four_runs, nprocs=4, timeout=900),
    }


@pytest.mark.distributed
def test_the_split_attention_layer_equals_transformers_unsplit_layer(runs):
    for rank in runs["ranks"]:
        assert len(rank["layer"]) == len(LAYER_CASES) and max(rank["layer"].values()) < 1e-5, rank["layer"]


@pytest.mark.distributed
def test_the_split_classifier_equals_the_unsplit_model(runs):
    for rank in runs["ranks"]:
        assert len(rank["model"]) == 2 and max(rank["model"].values()) < 1e-5, rank["model"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["cp2", *FOUR])
def test_a_training_run_split_over_cp_equals_one_process(runs, layout):
    """cp = 2, tp = 2 × cp = 2 (each tp rank's 2 heads split again over cp: one per rank) and pp = 2 × cp = 2 (each
    pipeline chunk's layers split over cp, 2 micro-batches), against one process."""
    import torch

    ref = runs["reference"]
    ranks = [rank["trainer"] for rank in runs["ranks"]] if layout == "cp2" else [r[layout] for r in runs["four"]]
    run = ranks[0]
    assert len(run["losses"]) == len(ref["losses"]) == TRAIN["steps"]
    assert ref["losses"][-1] != pytest.approx(ref["losses"][0], rel=1e-2)  # it trained
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert all(rank["losses"] == run["losses"] for rank in ranks)
    assert run["metrics"] == pytest.approx(ref["metrics"], rel=1e-5, abs=1e-6)
    assert run["weights"].keys() == ref["weights"].keys()
    assert any("pos_key_proj" in name for name in ref["weights"])  # its own position projections, trained
    bound = TRAIN["steps"] * 1e-3  # Adam's largest move in these steps (learning rate 1e-3), from 0
    for name, tensor in ref["weights"].items():
        if name.endswith("pos_key_proj.bias"):
            # its gradient is 0 in exact arithmetic (c2p adds q_i · b, constant over the keys j, which the softmax
            # ignores): Adam scales the rounding noise in it to steps of up to lr on both sides, so it only stays
            # near 0
            assert run["weights"][name].abs().max() <= bound and tensor.abs().max() <= bound, name
            continue
        torch.testing.assert_close(run["weights"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)


def test_the_ring_is_refused_in_one_line_naming_all_to_all(tmp_path, capsys, monkeypatch):
    """The default ``cp_comm`` (ring) cannot take c2p/p2c scores: ``hftrain train --cp 2`` exits 2 before writing,
    in one line naming the fix; the same check passes with ``cp_comm: all_to_all``."""
    from transformers import AutoModelForSequenceClassification

    from hftrain.parallel.context_parallel import check_context_parallel_model
    from tests.megatron_runs import refused_as_launched_rank0
    from tests.tiny import tiny_config, tiny_tokenizer, write_csv

    config = tiny_config("deberta-v2")
    check_context_parallel_model(config, 2, comm="all_to_all")  # accepted
    model = tmp_path / "deberta"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(model)
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(model)
    data = str(write_csv(tmp_path / "train.csv"))
    capsys.readouterr()  # the folder's save progress
    message = (
        "parallelism.cp: cp_comm ring cannot split this model's attention: its disentangled attention adds c2p and "
        "p2c scores (each query's and key's contents against their relative position's embedding), which the ring's "
        "fused block kernel cannot take; use cp_comm: all_to_all"
    )
    refused_as_launched_rank0(monkeypatch, capsys, tmp_path, str(model), data, ["--cp", "2"], "2", message)
