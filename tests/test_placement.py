"""The placement records (``hftrain/parallel/placement.py``) carry a new axis with no code of its own.

An axis ``xp`` that no hftrain module knows cuts one parameter and leaves another's gradient partial, on 2 gloo
processes; the functions written once over the records complete, count, gather and box them exactly as the whole
module on one process: the partial gradient summed over ``xp``, the clipped norm equal to the unsplit
``torch.nn.utils.clip_grad_norm_``'s (each slice counted once, the whole parameter once), the cut parameter
gathered back and its checkpoint boxes covering the logical tensor once. Tensor and expert parallelism run through
the same functions in tests/test_tp_*.py and tests/test_ep_trainer.py.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed

ROWS, COLS, MAX_NORM = 6, 4, 0.5


def _reference():
    """The whole module's parameters and each rank's share of the loss's inputs (the same on every rank)."""
    import torch

    torch.manual_seed(0)
    return {
        "cut": torch.randn(ROWS, COLS),
        "partial": torch.randn(3),
        "whole": torch.randn(5),
        "probe": torch.randn(ROWS, COLS),
        "shares": torch.randn(2, 3),  # the partial parameter's input on rank 0 and rank 1
        "whole_probe": torch.randn(5),
    }


def _run_on_xp() -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing import assert_close

    from hftrain.parallel.placement import (
        Split,
        clip_grad_norm_,
        gather_full_tensors,
        place,
        placements,
        sum_partial_grads,
    )

    dist.init_process_group("gloo")
    ref, group = _reference(), dist.group.WORLD  # the made-up axis spans both ranks
    rank = dist.get_rank()

    # one process, whole: L = Σ W ⊙ probe + Σ_r P · a_r + Q · q
    whole = {name: nn.Parameter(ref[name].clone()) for name in ("cut", "partial", "whole")}
    loss = (whole["cut"] * ref["probe"]).sum() + (whole["partial"] * ref["shares"].sum(0)).sum()
    (loss + (whole["whole"] * ref["whole_probe"]).sum()).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(list(whole.values()), MAX_NORM)

    # two ranks: W cut along xp by rows, P's gradient partial over xp, Q whole on both
    module = nn.Module()
    split = Split(dim=0, rank=rank, size=2, full_shape=(ROWS, COLS))
    module.cut = nn.Parameter(split.local(ref["cut"]))
    module.partial = nn.Parameter(ref["partial"].clone())
    module.whole = nn.Parameter(ref["whole"].clone())
    place(module, "cut", axis="xp", split=split)
    place(module, "partial", partial=("xp",))
    assert set(placements(module)) == {"cut", "partial"}  # the whole parameter needs no record
    loss = (module.cut * split.local(ref["probe"])).sum() + (module.partial * ref["shares"][rank]).sum()
    (loss + (module.whole * ref["whole_probe"]).sum()).backward()

    sum_partial_grads(module, "xp", group)
    params = dict(module.named_parameters())
    norm = clip_grad_norm_(module, params, MAX_NORM, groups={"xp": group})
    assert_close(norm, expected_norm)
    assert_close(module.cut.grad, split.local(whole["cut"].grad))
    assert_close(module.partial.grad, whole["partial"].grad)
    assert_close(module.whole.grad, whole["whole"].grad)

    local = {"cut": module.cut.detach(), "whole": module.whole.detach()}
    full = gather_full_tensors(local, module, groups={"xp": group})
    assert_close(full["cut"], ref["cut"])
    assert_close(full["whole"], ref["whole"])
    boxes = [(offsets, tuple(view.shape)) for offsets, view in split.boxes(module.cut.detach())]
    return {"norm": float(norm), "boxes": boxes}


@pytest.mark.distributed
def test_a_new_axis_is_completed_clipped_gathered_and_boxed_by_its_records():
    results = run_distributed(_run_on_xp, nprocs=2, timeout=300)
    assert results[0]["norm"] == pytest.approx(results[1]["norm"], rel=0, abs=0)  # one norm on every rank
    boxes = sorted(box for result in results for box in result["boxes"])
    assert boxes == [((0, 0), (ROWS // 2, COLS)), ((ROWS // 2, 0), (ROWS // 2, COLS))]  # the tensor once


def _run_pipeline_copies() -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.testing import assert_close

    from hftrain.parallel.placement import clip_grad_norm_, place, sum_copies

    dist.init_process_group("gloo")
    rank, group = dist.get_rank(), dist.group.WORLD  # two pipeline stages
    torch.manual_seed(0)
    init = {"shared": torch.randn(ROWS), "unused_here": torch.randn(3)}
    probes = torch.randn(2, ROWS)  # what each stage's use of the shared weight contributes
    own = [torch.randn(4), torch.randn(2)]  # each stage's own parameter

    # one process: the shared weight used by both stages, the other used by stage 0 only
    whole = {name: nn.Parameter(value.clone()) for name, value in init.items()}
    stages = [nn.Parameter(value.clone()) for value in own]
    loss = sum((whole["shared"] * probes[r]).sum() + stages[r].pow(2).sum() for r in range(2))
    (loss + whole["unused_here"].sum()).backward()
    expected = {name: param.grad.clone() for name, param in whole.items()}  # before clipping
    expected_norm = torch.nn.utils.clip_grad_norm_([*whole.values(), *stages], MAX_NORM)

    # two ranks: each holds a copy of both (rank 0's primary) and its own stage's parameter
    module = nn.Module()
    module.shared = nn.Parameter(init["shared"].clone())
    module.unused_here = nn.Parameter(init["unused_here"].clone())
    module.own = nn.Parameter(own[rank].clone())
    for name in ("shared", "unused_here"):
        place(module, name, copies="pp", primary=rank == 0)
    loss = (module.shared * probes[rank]).sum() + module.own.pow(2).sum()
    if rank == 0:
        loss = loss + module.unused_here.sum()
    loss.backward()
    assert (module.unused_here.grad is None) == (rank == 1)  # the copy on rank 1 took no gradient

    sum_copies(module, "pp", group)
    assert_close(module.shared.grad, expected["shared"])  # every copy applies the sum
    assert_close(module.unused_here.grad, expected["unused_here"])  # rank 1 joined with zeros
    params = dict(module.named_parameters())
    norm = clip_grad_norm_(module, params, MAX_NORM, groups={}, pp_group=group)
    assert_close(norm, expected_norm)  # each copied weight counted once, on its primary
    assert_close(module.shared.grad, whole["shared"].grad)  # clipped as one process clips
    return {"norm": float(norm), "shared": module.shared.grad.tolist()}


@pytest.mark.distributed
def test_pipeline_copies_are_summed_and_counted_once_by_their_records():
    results = run_distributed(_run_pipeline_copies, nprocs=2, timeout=300)
    assert results[0] == results[1]  # one norm, one clipped gradient of the copies
