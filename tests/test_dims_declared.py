"""The axes declared once (``hftrain.parallel.axes.AXIS_SPECS``): what is derived from the list equals Megatron-LM's
rank rule written out by hand, for every layout of up to 24 processes; the checks name the axis and its valid values;
the axis traits (cuts parameters, splits sequences, holds stages) are what placement and the RNG read.

Pure: no process group (``tests/test_parallel_layout.py`` builds the groups under gloo).
"""

from __future__ import annotations

import itertools

import pytest

from hftrain.errors import AxisError
from hftrain.parallel.axes import AXES, AXIS_SIZES, AXIS_SPECS, CUT_AXES, REPLICA_GROUP, SEQUENCE_AXES, STAGE_AXIS
from hftrain.parallel.dims import AxisGroup, ParallelDims, ParallelGroups


def _by_hand(dims: ParallelDims, axis: str) -> list[list[int]]:
    """The groups as the 8-branch ladder of hftrain before the declarations wrote them."""
    pp, dp, cp, tp, ep = range(dims.pp), range(dims.dp), range(dims.cp), range(dims.tp), dims.ep
    edp = range(dims.dp // ep)

    def rank(p: int, d: int, c: int, t: int) -> int:
        return ((p * dims.dp + d) * dims.cp + c) * dims.tp + t

    return {
        "tp": lambda: [[rank(p, d, c, t) for t in tp] for p in pp for d in dp for c in cp],
        "pp": lambda: [[rank(p, d, c, t) for p in pp] for d in dp for c in cp for t in tp],
        "dp": lambda: [[rank(p, d, c, t) for d in dp] for p in pp for c in cp for t in tp],
        "cp": lambda: [[rank(p, d, c, t) for c in cp] for p in pp for d in dp for t in tp],
        "dp_cp": lambda: [[rank(p, d, c, t) for d in dp for c in cp] for p in pp for t in tp],
        "ep": lambda: [[rank(p, g * ep + e, c, t) for e in range(ep)] for p in pp for g in edp for c in cp for t in tp],
        "edp": lambda: [
            [rank(p, g * ep + e, c, t) for g in edp] for p in pp for e in range(ep) for c in cp for t in tp
        ],
        "embedding": lambda: (
            [[rank(0, d, c, t), rank(dims.pp - 1, d, c, t)] for d in dp for c in cp for t in tp] if dims.pp > 1 else []
        ),
    }[axis]()


def _layouts(limit: int = 24):
    for world in range(1, limit + 1):
        for tp, pp, cp, ep in itertools.product((1, 2, 3, 4), repeat=4):
            dims = ParallelDims(world, tp=tp, pp=pp, cp=cp, ep=ep)
            try:
                dims.validate()
            except AxisError:
                continue
            yield dims


def test_derived_groups_equal_the_rank_rule():
    layouts = list(_layouts())
    assert len(layouts) > 100
    for dims in layouts:
        for axis in ("tp", "pp", "dp", "cp", "dp_cp", "ep", "edp", "embedding"):
            assert list(dims.iter_groups(axis)) == _by_hand(dims, axis), (dims, axis)
        for rank in range(dims.world_size):
            p, d, c, t = dims.coords(rank)
            assert rank == ((p * dims.dp + d) * dims.cp + c) * dims.tp + t and dims.rank(p, d, c, t) == rank
            # every group's rank is the rank's index in its group
            for axis in ("tp", "pp", "dp", "cp", "dp_cp", "ep", "edp"):
                (group,) = [g for g in dims.iter_groups(axis) if rank in g]
                assert dims.group_rank(axis, rank) == group.index(rank), (dims, axis, rank)
    dims = ParallelDims(16, tp=2, ep=2)
    assert dims.axes == ("tp", "pp", "dp", "ep", "edp") and dims.edp == 4 and dims.dp_cp == 8
    assert ParallelDims(16, tp=2, cp=2).axes == ("tp", "pp", "dp", "cp", "dp_cp")
    with pytest.raises(ValueError, match="is not one of tp, pp, dp, cp, dp_cp, ep, edp, embedding"):
        list(dims.iter_groups("sp"))


def test_declared_order_and_traits():
    assert AXES == ("pp", "dp", "cp", "tp")  # the mesh: pp outermost, tp adjacent
    assert list(AXIS_SIZES) == ["tp", "pp", "cp", "ep"]  # hftrain groups' and hftrain plan's flags
    assert CUT_AXES == ("tp", "ep") and SEQUENCE_AXES == ("cp",) and STAGE_AXIS == "pp" and REPLICA_GROUP == "dp_cp"
    assert [s.name for s in AXIS_SPECS if s.carved_from] == ["ep"]
    assert ParallelDims(8, tp=2, pp=2).sizes == {"tp": 2, "cp": 1, "pp": 2, "dp": 2}  # the checkpoint's layout keys


@pytest.mark.parametrize(
    ("sizes", "axis", "message"),
    [
        ((4, 3, 1, 1, 1), "tp", "tp=3 × pp=1 does not divide the world size 4; valid tp values with pp=1: 1, 2, 4"),
        ((2, 2, 2, 1, 1), "tp", "tp=2 × pp=2 does not divide the world size 2; valid tp values with pp=2: 1 ("),
        ((6, 1, 4, 1, 1), "pp", "pp=4 does not divide the world size 6; valid pp values: 1, 2, 3, 6"),
        ((8, 2, 1, 3, 1), "cp", "tp=2 × cp=3 × pp=1 does not divide the world size 8; valid cp values with tp=2, pp=1"),
        ((12, 2, 1, 1, 4), "ep", "ep=4 does not divide the data-parallel size 6 (world 12 / (tp 2 × cp 1 × pp 1)): "
         "experts are split over data-parallel ranks; valid ep values here: 1, 2, 3, 6"),
        ((4, 0, 1, 1, 1), "tp", "tp must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_checks_name_the_axis(sizes, axis, message):
    world, tp, pp, cp, ep = sizes
    with pytest.raises(AxisError) as raised:
        ParallelDims(world, tp=tp, pp=pp, cp=cp, ep=ep).validate()
    assert raised.value.axis == axis and message in str(raised.value)


def test_carved_axis_composes_with_its_parent_the_cut_axes_the_stages_and_the_sequence_axes():
    ParallelDims(8, tp=2, ep=2).validate_trainable()
    ParallelDims(8, tp=2, pp=2, ep=2).validate_trainable()  # ep carved out of dp within each stage
    dims = ParallelDims(8, ep=2, cp=2).validate_trainable()  # ep carved out of dp at each cp coordinate
    # rank = dp·2 + cp: an ep group is two consecutive dp ranks of one cp coordinate
    assert sorted(dims.rank_groups()["ep"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_parallel_groups_read_the_axes():
    """``ParallelGroups`` is ``{axis: AxisGroup}``; the old attribute names read it, and placement's and the RNG's
    questions are answered from the traits (groups stand in as strings: nothing collective runs)."""
    dims = ParallelDims(16, tp=2, ep=2)  # rank 13: pp 0, dp 6, cp 0, tp 1
    rank = 13
    axes = {
        name: AxisGroup(f"<{name}>" if dims.size(name) > 1 else None, dims.group_rank(name, rank), dims.size(name))
        for name in ("tp", "pp", "dp", "cp", "dp_cp", "ep", "edp")
    }
    groups = ParallelGroups(dims=dims, mesh=None, axes=axes)
    assert (groups.tp_rank, groups.dp_rank, groups.pp_rank, groups.cp_rank) == (1, 6, 0, 0)
    assert (groups.ep_rank, groups.ep_size, groups.edp_group, groups.dp_cp_group) == (0, 2, "<edp>", "<dp_cp>")
    assert groups.coordinates == {"pp": 0, "tp": 1, "cp": 0, "dp": 6}  # the RNG checkpoint's key order
    assert (groups.stage, groups.cut_coordinate) == (0, 1)
    assert groups.cut_groups == {"tp": "<tp>", "ep": "<ep>"}
    assert groups.data_replicas(None) == ("<dp_cp>", 6, 8) and groups.data_replicas("ep") == ("<edp>", 3, 4)
    assert groups.holders(None) == (13, 16) and groups.holders("tp") == (6, 8) and groups.holders("ep") == (7, 8)
    with pytest.raises(AttributeError, match="xp_group"):
        _ = groups.xp_group
