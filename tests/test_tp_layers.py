"""Each tensor-parallel layer against its unsharded reference on 2 gloo processes: outputs and all gradients.

Every rank builds the same reference module and input (same seed), runs it whole, then runs its TP shard
with the layer's collectives. A fixed random ``probe`` turns outputs into a scalar loss; each rank backprops
the loss of its own part of the output, so the gradients add up to the reference's exactly when the
layers' conjugate collectives are right.
"""

from __future__ import annotations

import pytest

from hftrain.parallel.placement import placed
from tests.distributed import run_distributed

BATCH, SEQ, HIDDEN, OUT, VOCAB = 3, 4, 8, 12, 10


def _dense(kind: str, n_in: int, n_out: int):
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return nn.Linear(n_in, n_out) if kind == "linear" else Conv1D(n_out, n_in)


def _weight_grad_in_layout(ref, tp_layer):
    """The reference gradient sliced like the TP layer's weight (same layout: Linear or Conv1D)."""
    return placed(tp_layer)["weight"].split.local(ref.weight.grad)


def _column_case(kind: str, parts: int, sequence_parallel: bool, group, counts: tuple[int, ...] | None = None) -> dict:
    import torch
    from torch.testing import assert_close

    from hftrain.parallel import ColumnParallelLinear
    from hftrain.parallel.collectives import copy_to_tp, gather_from_sequence

    torch.manual_seed(0)
    ref = _dense(kind, HIDDEN, OUT * parts)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    probe = torch.randn(BATCH, SEQ, OUT * parts)
    (ref(x) * probe).sum().backward()

    layer = ColumnParallelLinear(ref, tp_group=group, parts=parts, counts=counts)
    shard_out = placed(layer)["weight"].split
    out_shard = type(shard_out)(2, shard_out.rank, shard_out.size, tuple(probe.shape), parts, counts)  # features
    rank, size = shard_out.rank, shard_out.size
    x_local = x.detach().chunk(size, 1)[rank] if sequence_parallel else x.detach()
    x_local.requires_grad_(True)
    enter = gather_from_sequence if sequence_parallel else copy_to_tp
    y = layer(enter(x_local, group))
    assert_close(y, out_shard.local(ref(x).detach()))
    (y * out_shard.local(probe)).sum().backward()
    expected_dx = x.grad.chunk(size, 1)[rank] if sequence_parallel else x.grad
    assert_close(x_local.grad, expected_dx)
    assert_close(layer.weight.grad, _weight_grad_in_layout(ref, layer))
    assert_close(layer.bias.grad, placed(layer)["bias"].split.local(ref.bias.grad))
    expected_numel = ref.weight.numel() // (OUT * parts) * parts * (counts[rank] if counts else OUT // size)
    assert layer.weight.numel() == expected_numel
    return {"max_dx": (x_local.grad - expected_dx).abs().max().item()}


def _row_case(kind: str, sequence_parallel: bool, group, counts: tuple[int, ...] | None = None) -> dict:
    import torch
    from torch.testing import assert_close

    from hftrain.parallel import RowParallelLinear, sum_partial_grads

    torch.manual_seed(1)
    ref = _dense(kind, OUT, HIDDEN)
    x = torch.randn(BATCH, SEQ, OUT, requires_grad=True)
    probe = torch.randn(BATCH, SEQ, HIDDEN)
    (ref(x) * probe).sum().backward()

    layer = RowParallelLinear(ref, tp_group=group, sequence_parallel=sequence_parallel, counts=counts)
    rank, size = placed(layer)["weight"].split.rank, placed(layer)["weight"].split.size
    widths = list(counts or [OUT // size] * size)
    x_local = x.detach().split(widths, 2)[rank].clone().requires_grad_(True)  # input features are split
    y = layer(x_local)
    seq_part = (lambda t: t.chunk(size, 1)[rank]) if sequence_parallel else (lambda t: t)
    assert_close(y, seq_part(ref(x).detach()))
    (y * seq_part(probe)).sum().backward()
    assert_close(x_local.grad, x.grad.split(widths, 2)[rank])
    assert_close(layer.weight.grad, _weight_grad_in_layout(ref, layer))
    partial_bias = layer.bias.grad.clone()
    sum_partial_grads(layer, "tp", group)  # sequence parallel: the replicated bias saw only its chunk
    assert_close(layer.bias.grad, ref.bias.grad)
    return {"bias_was_partial": not torch.allclose(partial_bias, ref.bias.grad)}


def _embedding_case(sequence_parallel: bool, group) -> dict:
    import torch
    from torch import nn
    from torch.testing import assert_close

    from hftrain.parallel import VocabParallelEmbedding
    from hftrain.parallel.collectives import scatter_to_sequence

    torch.manual_seed(2)
    ref = nn.Embedding(VOCAB, HIDDEN, padding_idx=7)  # the padding row sits in rank 1's half
    ids = torch.tensor([[0, 1, 7, 9], [5, 4, 7, 7], [9, 8, 2, 3]])
    probe = torch.randn(BATCH, SEQ, HIDDEN)
    (ref(ids) * probe).sum().backward()

    layer = VocabParallelEmbedding(ref, tp_group=group)
    rank, size = placed(layer)["weight"].split.rank, placed(layer)["weight"].split.size
    y = layer(ids)
    seq_part = (lambda t: t.chunk(size, 1)[rank]) if sequence_parallel else (lambda t: t)
    if sequence_parallel:
        y = scatter_to_sequence(y, group)
    assert_close(y, seq_part(ref(ids).detach()))
    (y * seq_part(probe)).sum().backward()
    assert_close(layer.weight.grad, placed(layer)["weight"].split.local(ref.weight.grad))
    assert layer.weight.shape[0] * size == VOCAB
    return {"padding_row_grad": layer.weight.grad[7 - layer.vocab_start].abs().sum().item() if rank else None}


def _all_layer_checks() -> dict:
    import torch
    import torch.distributed as dist

    from hftrain.errors import ConfigError
    from hftrain.parallel import ParallelDims, build_groups, record_collectives
    from hftrain.parallel.collectives import scatter_to_sequence

    dist.init_process_group("gloo")
    group = build_groups(ParallelDims(dist.get_world_size(), tp=dist.get_world_size()), dist.get_rank()).tp_group
    report: dict = {}
    for sequence_parallel in (False, True):
        for kind in ("linear", "conv1d"):
            with record_collectives() as counts:
                report[("column", kind, sequence_parallel)] = _column_case(kind, 1, sequence_parallel, group)
            report[("column counts", kind, sequence_parallel)] = dict(counts)
            report[("column_qkv", kind, sequence_parallel)] = _column_case(kind, 3, sequence_parallel, group)
            # unequal widths (Split.counts, a generic feature; no plan uses it since heads split evenly): 8 + 4
            report[("column_unequal", kind, sequence_parallel)] = _column_case(
                kind, 1, sequence_parallel, group, (8, 4)
            )
            report[("row_unequal", kind, sequence_parallel)] = _row_case(kind, sequence_parallel, group, (8, 4))
            with record_collectives() as counts:
                report[("row", kind, sequence_parallel)] = _row_case(kind, sequence_parallel, group)
            report[("row counts", kind, sequence_parallel)] = dict(counts)
        report[("embedding", sequence_parallel)] = _embedding_case(sequence_parallel, group)
    try:  # a sequence that does not divide by tp is refused with the fix
        scatter_to_sequence(torch.zeros(1, 3, 2), group)
    except ConfigError as error:
        report["odd_sequence"] = str(error)
    dist.destroy_process_group()
    return report


@pytest.mark.distributed
def test_tp_layers_match_unsharded_reference():
    results = run_distributed(_all_layer_checks, nprocs=2, timeout=300)
    for report in results:  # each case asserted inside; here the collectives each layer ran
        for kind in ("linear", "conv1d"):
            # column: f (identity fwd, all-reduce bwd) or the sequence all-gather / reduce-scatter
            assert report[("column counts", kind, False)] == {"backward all_reduce": 1}
            assert report[("column counts", kind, True)] == {"forward all_gather": 1, "backward reduce_scatter": 1}
            # row: g (all-reduce fwd); sequence parallel: reduce-scatter fwd, all-gather bwd, + the bias grads
            assert report[("row counts", kind, False)] == {"forward all_reduce": 1}
            assert report[("row counts", kind, True)] == {
                "forward reduce_scatter": 1,
                "backward all_gather": 1,
                "grads all_reduce": 1,
            }
            assert report[("row", kind, True)]["bias_was_partial"]
            assert not report[("row", kind, False)]["bias_was_partial"]
        assert "sequence length 3 is not a multiple of tp=2" in report["odd_sequence"]
        assert "sequence_multiple" in report["odd_sequence"]
    assert results[1][("embedding", False)]["padding_row_grad"] == 0.0
