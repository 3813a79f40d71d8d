"""The PTD layout: hftrain's groups equal Megatron-LM's rank rule; `hftrain groups`; real groups on 4 processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hftrain.errors import ConfigError
from hftrain.parallel.dims import ParallelDims
from tests.distributed import run_distributed

LAYOUTS = [(1, 1, 1), (2, 2, 1), (4, 2, 1), (4, 1, 2), (8, 2, 2), (16, 2, 4), (16, 4, 2), (12, 3, 2), (24, 2, 3)]


def megatron_groups(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Megatron-LM's ``initialize_model_parallel`` rank rule, written out independently of hftrain."""
    groups_per_stage = world // pp  # ranks in one pipeline stage
    dp_groups = [
        list(range(stage * groups_per_stage + j, (stage + 1) * groups_per_stage, tp))
        for stage in range(pp)
        for j in range(tp)
    ]
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    pp_groups = [list(range(i, world, groups_per_stage)) for i in range(groups_per_stage)]
    return {"tp": tp_groups, "pp": pp_groups, "dp": dp_groups}


def test_megatron_documented_example():
    """Megatron's docstring: 16 GPUs, tp=2, pp=4 -> these groups."""
    groups = ParallelDims(16, tp=2, pp=4).rank_groups()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert groups["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]


@pytest.mark.parametrize(("world", "tp", "pp"), LAYOUTS)
def test_rank_groups_follow_megatron_rule(world, tp, pp):
    dims = ParallelDims(world, tp=tp, pp=pp).validate()
    groups = dims.rank_groups()
    assert groups == megatron_groups(world, tp, pp)
    assert dims.dp == world // (tp * pp)
    for rank in range(world):
        pp_rank, dp_rank, cp_rank, tp_rank = dims.coords(rank)
        assert cp_rank == 0 and dims.rank(pp_rank, dp_rank, 0, tp_rank) == rank
        # each rank sits at its coordinate in exactly one group of each kind
        assert sum(rank in g for g in groups["tp"]) == sum(rank in g for g in groups["dp"]) == 1
        assert next(g for g in groups["tp"] if rank in g).index(rank) == tp_rank
        assert next(g for g in groups["dp"] if rank in g).index(rank) == dp_rank
        assert next(g for g in groups["pp"] if rank in g).index(rank) == pp_rank


@pytest.mark.parametrize(
    ("world", "tp", "pp", "named"),
    [(6, 4, 1, "tp=4"), (8, 3, 1, "1, 2, 4, 8"), (8, 2, 3, "pp=3"), (4, 0, 1, "tp must be a positive integer")],
)
def test_bad_layouts_are_refused(world, tp, pp, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        ParallelDims(world, tp=tp, pp=pp).validate()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hftrain", "groups", *args], capture_output=True, text=True)


def test_groups_command_json_and_table():
    done = _cli("--world-size", "16", "--tp", "2", "--pp", "4", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == megatron_groups(16, 2, 4)
    table = _cli("--world-size", "8", "--tp", "2", "--pp", "2")
    assert table.returncode == 0, table.stderr
    assert "tp 2 × dp 2 × pp 2" in table.stdout
    assert "tp1: [2, 3]" in table.stdout and "pp0: [0, 4]" in table.stdout and "dp1: [1, 3]" in table.stdout
    assert "   5        1        0        1" in table.stdout  # rank 5: pp 1, dp 0, tp 1


def test_groups_command_bad_sizes_exit_2_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "groups", "--world-size", "6", "--tp", "4"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("hftrain: error: --tp: tp=4") and "1, 2, 3, 6" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _groups_on_every_rank() -> dict:
    """Build several layouts on this world; report each group's member ranks as torch.distributed sees them."""
    import os

    import torch.distributed as dist

    from hftrain.parallel import ParallelDims, build_groups

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    seen = {}
    for tp, pp in ((2, 1), (1, 2), (2, 2), (4, 1)):
        groups = build_groups(ParallelDims(world, tp=tp, pp=pp), rank)
        seen[(tp, pp)] = {
            "tp": dist.get_process_group_ranks(groups.tp_group),
            "dp": dist.get_process_group_ranks(groups.dp_group),
            "pp": dist.get_process_group_ranks(groups.pp_group),
            "coords": (groups.pp_rank, groups.dp_rank, groups.cp_rank, groups.tp_rank),
            "sizes": (groups.pp_size, groups.dp_size, groups.tp_size),
        }
    # a real collective over each tp group: the sum of its members' ranks
    groups = build_groups(ParallelDims(world, tp=2), rank)
    import torch

    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=groups.tp_group)
    seen["tp_sum"] = total.item()
    try:
        build_groups(ParallelDims(world, tp=3), rank)
    except ConfigError as error:
        seen["refused"] = str(error)
    dist.destroy_process_group()
    return seen


@pytest.mark.distributed
def test_build_groups_on_four_processes():
    results = run_distributed(_groups_on_every_rank, nprocs=4, timeout=300)
    layouts = [key for key in results[0] if isinstance(key, tuple)]
    assert layouts == [(2, 1), (1, 2), (2, 2), (4, 1)]
    for tp, pp in layouts:
        dims = ParallelDims(4, tp=tp, pp=pp)
        expected = megatron_groups(4, tp, pp)
        for rank, seen in enumerate(results):
            got = seen[(tp, pp)]
            for axis in ("tp", "dp", "pp"):
                assert got[axis] == next(g for g in expected[axis] if rank in g), (tp, pp, axis, rank)
            assert got["coords"] == dims.coords(rank)
            assert got["sizes"] == (pp, dims.dp, tp)
    assert [seen["tp_sum"] for seen in results] == [1.0, 1.0, 5.0, 5.0]
    assert all("tp=3 × pp=1 does not divide the world size 4" in seen["refused"] for seen in results)


def test_context_parallel_ranks_sit_between_tp_and_dp():
    """Megatron's order tp-cp-dp-pp: 16 ranks, tp=2, cp=2, pp=2 -> dp=2."""
    dims = ParallelDims(16, tp=2, pp=2, cp=2).validate()
    groups = dims.rank_groups()
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    assert groups["cp"][:2] == [[0, 2], [1, 3]]
    assert groups["dp"][:2] == [[0, 4], [1, 5]]
    assert groups["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["pp"][:2] == [[0, 8], [1, 9]]
    for rank in range(16):
        assert dims.rank(*dims.coords(rank)) == rank
    assert "cp" not in ParallelDims(4, tp=2).rank_groups()  # without cp the groups are the three of before
    with pytest.raises(ConfigError, match=r"valid cp values with tp=2, pp=1: 1, 3"):
        ParallelDims(6, tp=2, cp=2).validate()


def test_expert_parallel_ranks_are_carved_out_of_data_parallel():
    """Megatron's rule: ep consecutive dp ranks split the experts, the dp ranks with the same ep rank (edp) hold the
    same ones. 16 ranks, tp=2, pp=2 -> dp=4; ep=2 -> edp=2."""
    dims = ParallelDims(16, tp=2, pp=2, ep=2).validate()
    groups = dims.rank_groups()
    assert groups["dp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["ep"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["edp"][:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis in ("ep", "edp"):  # every rank is in exactly one group of each
        assert sorted(r for g in groups[axis] for r in g) == list(range(16))
    for ep_group in groups["ep"]:  # an ep group lies inside one dp group, and meets every edp group of it once
        dp_group = next(g for g in groups["dp"] if ep_group[0] in g)
        assert set(ep_group) <= set(dp_group)
    assert "ep" not in ParallelDims(4, tp=2).rank_groups()
    with pytest.raises(ConfigError, match=r"ep=4 does not divide the data-parallel size 2.*valid ep values here: 1, 2"):
        ParallelDims(4, tp=2, ep=4).validate()
    done = subprocess.run(
        [sys.executable, "-m", "hftrain", "groups", "--world-size", "8", "--tp", "2", "--ep", "2", "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def _group_timeouts_on_every_rank() -> dict:
    import os
    import types

    import torch.distributed as dist

    from hftrain.checkpoint.manager import CheckpointManager
    from hftrain.parallel import ParallelDims, build_groups
    from hftrain.parallel.host import group_timeout

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    seen = {}
    for label, dims in (("cp", ParallelDims(world, cp=2)), ("ep", ParallelDims(world, ep=2)),
                        ("pp4", ParallelDims(world, pp=4)), ("tp", ParallelDims(world, tp=2))):  # fmt: skip
        groups = build_groups(dims, rank)
        for field in ("tp_group", "dp_group", "pp_group", "cp_group", "dp_cp_group", "ep_group", "edp_group",
                      "embedding_group"):  # fmt: skip
            group = getattr(groups, field)
            if group is not None:
                seen[f"{label}.{field}"] = group_timeout(group).total_seconds()
    # the checkpoint writer's own group, made by the manager's own method
    seen["writer"] = group_timeout(CheckpointManager._background_group(types.SimpleNamespace(_group=None)))
    seen["writer"] = seen["writer"].total_seconds()
    dist.destroy_process_group()
    return seen


@pytest.mark.distributed
def test_every_group_waits_as_long_as_the_default_group():
    """torch gives each new group its own default timeout (NCCL's 10 minutes, gloo's 30), not the default group's:
    the mesh's axes, the dp × cp, ep, edp and embedding groups and the checkpoint writer's group each wait
    ``COLLECTIVE_TIMEOUT`` (an hour) instead, like the default group and the host twins."""
    from hftrain.parallel.host import COLLECTIVE_TIMEOUT

    results = run_distributed(_group_timeouts_on_every_rank, nprocs=4, timeout=300)
    for rank, seen in enumerate(results):
        named = {"cp.dp_cp_group", "ep.ep_group", "ep.edp_group", "tp.tp_group", "writer"}
        named |= {"pp4.embedding_group"} if rank in (0, 3) else set()  # the first and last stage's ranks
        assert named <= set(seen), seen
        assert set(seen.values()) == {COLLECTIVE_TIMEOUT.total_seconds()}, seen
