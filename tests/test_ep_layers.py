"""The expert-parallel MoE layer and the load-balancing loss against transformers' own (real gloo processes, fp32).

Each rank routes different tokens; with ep=2 a rank holds half the experts and exchanges tokens by all-to-all. The
split layer must give every rank the unsplit layer's output on its own tokens, the same input gradients, and, for
its experts, the sum of both ranks' expert gradients (a rank's experts see the tokens of its whole ep group). The
loss over the ep/dp group must equal ``load_balancing_loss_func`` of transformers on the concatenated batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny import tiny_config


def _moe_block(kind: str, seed: int = 0):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(tiny_config(kind)).float()
    return model.model.layers[0].mlp


def _tokens(rank: int, tokens: int = 24, hidden: int = 32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(tokens, hidden, generator=generator)


def _reference(kind: str, rank: int) -> dict[str, torch.Tensor]:
    """The unsplit block's output and gradients on rank ``rank``'s tokens (loss: a fixed random projection)."""
    block = _moe_block(kind)
    x = _tokens(rank).requires_grad_()
    out = block(x[None])[0]
    (out * _tokens(rank + 7)).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "gate_up_grad": block.experts.gate_up_proj.grad,
        "down_grad": block.experts.down_proj.grad,
        "router_grad": block.gate.weight.grad,
    }


def _split_layer_on_every_rank(kind: str, capacity_factor: float | None, padded: bool = True) -> dict:
    import torch.distributed as dist

    from hftrain.parallel.collectives import record_collectives
    from hftrain.parallel.expert_parallel import ExpertParallelExperts

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    block = _moe_block(kind)
    full_experts = block.experts
    block.experts = ExpertParallelExperts(
        full_experts, ep_group=dist.group.WORLD, capacity_factor=capacity_factor, padded=padded
    )
    x = _tokens(rank).requires_grad_()
    from hftrain.metrics.syncs import count_host_syncs

    with record_collectives() as counted, count_host_syncs() as reads:
        out = block(x[None])[0]
        (out * _tokens(rank + 7)).sum().backward()
    result = {
        "out": out.detach(),
        "x_grad": x.grad,
        "gate_up_grad": block.experts.gate_up_proj.grad,
        "down_grad": block.experts.down_proj.grad,
        "router_grad": block.gate.weight.grad,
        "local_shape": tuple(block.experts.gate_up_proj.shape),
        "first": block.experts.first,
        "dropped": block.experts.dropped,
        "collectives": dict(counted),
        # the host twin's agreement on the token count reads a host tensor (parallel/host.py): no device waits for it
        "host_reads": sum("hftrain/parallel/host.py" not in where for where in reads.where),
        "read_where": list(reads.where),
    }
    dist.destroy_process_group()
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("kind,padded", [("mixtral", True), ("qwen2_moe", True), ("mixtral", False)])
def test_expert_parallel_layer_equals_the_unsplit_block_on_two_ranks(kind, padded):
    results = run_distributed(_split_layer_on_every_rank, nprocs=2, kind=kind, capacity_factor=None, padded=padded)
    references = [_reference(kind, rank) for rank in range(2)]
    experts = tiny_config(kind).num_experts if kind == "qwen2_moe" else tiny_config(kind).num_local_experts
    for rank, (got, want) in enumerate(zip(results, references, strict=True)):
        assert got["local_shape"][0] == experts // 2 and got["first"] == rank * experts // 2
        torch.testing.assert_close(got["out"], want["out"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["x_grad"], want["x_grad"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got["router_grad"], want["router_grad"], atol=1e-6, rtol=1e-5)
        mine = slice(got["first"], got["first"] + experts // 2)
        for name in ("gate_up_grad", "down_grad"):  # this rank's experts saw both ranks' tokens
            both = references[0][name][mine] + references[1][name][mine]
            torch.testing.assert_close(got[name], both, atol=1e-6, rtol=1e-5)
        assert got["dropped"] == 0
        if padded:  # fixed slots: no host read; dispatch and combine forward, the two again backward
            assert got["host_reads"] == 0, got["read_where"]
            assert got["collectives"] == {"forward all_to_all": 2, "backward all_to_all": 2}
        else:  # the split sizes, read once for the layer's forward and backward (the router's top-k reads none)
            assert got["host_reads"] == 1, got["read_where"]
            # dispatch (counts, then rows) and combine forward; the two row exchanges again backward
            assert got["collectives"] == {"forward all_to_all": 2, "backward all_to_all": 2}


@pytest.mark.distributed
def test_a_capacity_factor_drops_and_counts_the_overflow():
    generous = run_distributed(_split_layer_on_every_rank, nprocs=2, kind="mixtral", capacity_factor=4.0)
    tight = run_distributed(_split_layer_on_every_rank, nprocs=2, kind="mixtral", capacity_factor=0.5)
    tight_read = run_distributed(
        _split_layer_on_every_rank, nprocs=2, kind="mixtral", capacity_factor=0.5, padded=False
    )
    references = [_reference("mixtral", rank) for rank in range(2)]
    for got, want in zip(generous, references, strict=True):  # a cap of all T·k assignments per expert: dropless
        assert got["dropped"] == 0
        torch.testing.assert_close(got["out"], want["out"], atol=1e-6, rtol=1e-5)
    # 24 tokens × top-2 over 4 experts, cap ⌈0.5 · 48 / 4⌉ = 6 per expert: at most 24 kept, at least 24 dropped
    for got, read, want in zip(tight, tight_read, references, strict=True):
        assert got["dropped"] >= 24 and got["dropped"] == read["dropped"]
        assert got["host_reads"] == 0, got["read_where"]  # fixed slots: nothing read
        assert read["host_reads"] == 1, read["read_where"]  # the kept count comes with the split sizes
        assert not torch.allclose(got["out"], want["out"], atol=1e-4)
        # the padded exchange keeps the same assignments as the exact split sizes: same outputs and gradients
        for name in ("out", "x_grad", "gate_up_grad", "down_grad", "router_grad"):
            torch.testing.assert_close(got[name], read[name], atol=1e-6, rtol=1e-5)


def _aux_loss_on_every_rank() -> dict:
    import torch.distributed as dist

    from hftrain.parallel.expert_parallel import load_balancing_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logits, mask = _router_batch(rank)
    logits = [layer.requires_grad_() for layer in logits]
    loss = load_balancing_loss(logits, num_experts=4, top_k=2, attention_mask=mask, group=dist.group.WORLD)
    loss.backward()
    result = {"loss": loss.item(), "grads": [layer.grad for layer in logits]}
    dist.destroy_process_group()
    return result


def _router_batch(rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(7 + rank)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3 + rank :] = 0  # padding differs between the ranks
    return [torch.randn(15, 4, generator=generator) for _ in range(2)], mask


@pytest.mark.distributed
def test_load_balancing_loss_over_the_group_is_transformers_loss_of_the_global_batch():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    results = run_distributed(_aux_loss_on_every_rank, nprocs=2)
    batches = [_router_batch(rank) for rank in range(2)]
    logits = [torch.cat([batches[0][0][layer], batches[1][0][layer]]).requires_grad_() for layer in range(2)]
    mask = torch.cat([batches[0][1], batches[1][1]])
    expected = load_balancing_loss_func(tuple(logits), num_experts=4, top_k=2, attention_mask=mask)
    expected.backward()
    for rank, got in enumerate(results):
        assert got["loss"] == pytest.approx(expected.item(), rel=1e-6)
        for layer in range(2):
            mine = logits[layer].grad[rank * 15 : (rank + 1) * 15]
            # each rank's gradient is the global loss's × dp: data parallelism's mean over the 2 ranks divides it back
            torch.testing.assert_close(got["grads"][layer] / 2, mine, atol=1e-7, rtol=1e-5)


def test_one_rank_loss_is_transformers_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from hftrain.parallel.expert_parallel import load_balancing_loss

    logits, mask = _router_batch(0)
    for attention_mask in (mask, None):
        mine = load_balancing_loss(logits, num_experts=4, top_k=2, attention_mask=attention_mask)
        theirs = load_balancing_loss_func(tuple(logits), num_experts=4, top_k=2, attention_mask=attention_mask)
        assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_bad_expert_layouts_are_refused_in_one_line():
    from hftrain.errors import ConfigError
    from hftrain.parallel.expert_parallel import check_expert_parallel

    with pytest.raises(ConfigError, match=r"ep=3 does not divide the 4 experts.*valid ep values with dp=6: 1, 2"):
        check_expert_parallel(tiny_config("mixtral"), ep=3, dp=6)
    with pytest.raises(ConfigError, match=r"^the model \(bert\) is not a mixture of experts") as refused:
        check_expert_parallel(tiny_config("bert"), ep=2, dp=2)
    assert refused.value.axis == "ep"  # parallel/ names the axis; the strategy names its config key (parallelism.ep)
    # a capacity factor <= 0 is the config schema's to refuse (ep dividing dp is ParallelDims')
    from hftrain.config import ParallelismConfig

    with pytest.raises(ConfigError, match=r"parallelism.moe_capacity_factor must be a number > 0"):
        ParallelismConfig(moe_capacity_factor=0.0).validate()
