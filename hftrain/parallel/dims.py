"""The PTD rank layout: ``tp × cp × dp × pp = world size`` in Megatron-LM's order, and its process groups.

A global rank is ``((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank``: tensor-parallel ranks are adjacent
(they talk every layer, so they should share a node), context parallel next (a ring of key/value blocks every
layer), then data parallel, pipeline outermost. This is the order of Megatron-LM's ``initialize_model_parallel``
(``tp-cp-ep-dp-pp``) and also the row-major order of a ``DeviceMesh`` shaped ``(pp, dp, cp, tp)``, which is how
the groups are built. Gradients are averaged over ``dp × cp`` (the ``dp_cp`` group: context-parallel ranks hold
the same parameters and see the same examples, each a part of every sequence). Nothing here holds a group in a
module global: the groups live in the :class:`ParallelGroups` returned by :func:`build_groups` and are passed on
explicitly.

Expert parallelism is carved out of data parallelism, as Megatron-LM does (``ep`` divides ``dp``): the ``ep``
group is ``ep`` consecutive dp ranks (same pp, cp and tp coordinates), which hold different experts of every MoE
layer and exchange tokens by all-to-all; the expert-data-parallel (``edp``) group is the ``dp / ep`` dp ranks that
hold the same experts (dp ranks with the same ``dp_rank mod ep``), over which expert gradients are reduced. Dense
parameters are still averaged over all of dp.

The axes are declared once, in ``hftrain.parallel.axes`` (:data:`AXIS_SPECS`, re-exported here with
:class:`ParallelDims`); the groups below are derived from that list.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hftrain.errors import ConfigError
from hftrain.parallel.axes import (
    AXES,
    AXIS_SIZES,
    AXIS_SPECS,
    COMPLEMENTS,
    CUT_AXES,
    FLATTENED,
    MAX_PRINTED_WORLD,
    MESH_SPECS,
    REPLICA_GROUP,
    SEQUENCE_AXES,
    SPEC,
    STAGE_AXIS,
    AxisSpec,
    ParallelDims,
    group_names,
)

__all__ = [
    "AXES",
    "AXIS_SIZES",
    "AXIS_SPECS",
    "COMPLEMENTS",
    "CUT_AXES",
    "FLATTENED",
    "MAX_PRINTED_WORLD",
    "MESH_SPECS",
    "REPLICA_GROUP",
    "SEQUENCE_AXES",
    "SPEC",
    "STAGE_AXIS",
    "AxisGroup",
    "AxisSpec",
    "ParallelDims",
    "ParallelGroups",
    "build_groups",
    "format_groups",
    "group_lines",
    "group_names",
    "groups_json_chunks",
]


@dataclass(frozen=True)
class AxisGroup:
    """One axis's process group as seen from one rank.

    Args:
        group: the process group (None where this rank has none: a carved axis at size 1).
        rank: this rank's position in it.
        size: its number of ranks.
    """

    group: Any
    rank: int
    size: int


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups and coordinates in a :class:`ParallelDims` layout: ``{axis: AxisGroup}`` for
    every group name (:func:`group_names`).

    ``groups.<axis>_group``, ``<axis>_rank`` and ``<axis>_size`` read ``groups.axes[<axis>]`` (``tp_group``,
    ``dp_cp_group``, ``edp_group`` ...). The dp × cp group is the dp group when ``cp = 1``; a carved axis's groups
    (ep, edp) are None when its size is 1.

    Args:
        dims: the validated layout.
        mesh: the ``DeviceMesh`` shaped ``(pp, dp, cp, tp)`` with those dimension names (usable by DTensor).
        axes: every group name -> this rank's :class:`AxisGroup`.
        embedding_group: this pipeline's first and last stage rank, when this rank is one of them (Megatron's embedding
            group: the copies of a weight both hold, tied input/output embeddings, sum their gradients over it); None
            elsewhere and when ``pp = 1``.
    """

    dims: ParallelDims
    mesh: Any
    axes: dict[str, AxisGroup]
    embedding_group: Any = None

    def __getattr__(self, name: str) -> Any:
        axis, _, part = name.rpartition("_")
        axes = self.__dict__.get("axes") or {}
        if part in ("group", "rank", "size") and axis in axes:
            return getattr(axes[axis], part)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's position on each mesh axis, ``{"pp", "tp", "cp", "dp"}`` (the order RNG checkpoints key by:
        the stage axis, the axes cutting parameters, those splitting sequences, then the rest)."""
        order = sorted(MESH_SPECS, key=lambda s: (not s.pipelined, not s.cuts_parameters, not s.splits_sequence))
        return {s.name: self.axes[s.name].rank for s in order}

    @property
    def cut_coordinate(self) -> int:
        """This rank's index among the mesh ranks holding different slices of the same parameters (its tp rank): what
        the RNG's tensor stream is seeded by."""
        index = 0
        for spec in (s for s in MESH_SPECS if s.cuts_parameters):
            index = index * self.axes[spec.name].size + self.axes[spec.name].rank
        return index

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.axes[STAGE_AXIS].rank

    def axis_group(self, axis: str) -> Any:
        """The process group of axis ``axis`` (``tp``, ``cp``, ``dp``, ``pp``, ``ep``), or of the pipeline's
        ``embedding`` group; None where this rank has none."""
        return self.embedding_group if axis == "embedding" else self.axes[axis].group

    @property
    def cut_groups(self) -> dict[str, Any]:
        """The axes that cut parameters into slices in this layout -> their groups (tp always; ep when > 1), in the
        order the gradient norm and the full tensors visit them (``hftrain.parallel.placement``)."""
        return {axis: self.axis_group(axis) for axis in CUT_AXES if axis in self.dims.axes}

    def data_replicas(self, axis: str | None) -> tuple[Any, int, int]:
        """The data-parallel replicas of a parameter cut along ``axis`` (None: whole): the group whose ranks hold the
        same slice and average its gradient, this rank's index in it, and their count.

        A dense parameter's are the dp × cp ranks (:data:`REPLICA_GROUP`); one cut along a carved axis (ep, out of
        dp) has its complement's (edp: the ranks holding the same experts).

        Args:
            axis: the axis cutting the parameter (``Placement.axis``), or None.
        """
        spec = SPEC.get(axis or "")
        replicas = self.axes[spec.complement[0] if spec is not None and spec.complement else REPLICA_GROUP]
        return replicas.group, replicas.rank, replicas.size

    def holders(self, axis: str | None) -> tuple[int, int]:
        """``(this rank's index, count)`` among the ranks of its pipeline stage holding the same box of a parameter cut
        along ``axis``: its data replicas, times the ranks of every mesh axis cutting parameters but not this one
        (tp unless tp cuts it; a checkpoint deals the box's writes out among them).

        Args:
            axis: the axis cutting the parameter, or None.
        """
        _, index, count = self.data_replicas(axis)
        for spec in (s for s in MESH_SPECS if s.cuts_parameters and s.name != axis):
            index, count = (
                index * self.axes[spec.name].size + self.axes[spec.name].rank,
                count * self.axes[spec.name].size,
            )
        return index, count


def build_groups(dims: ParallelDims, rank: int, *, device_type: str = "cpu") -> ParallelGroups:
    """Create every group of the layout (collective: every rank of the default group calls it in the same order).

    The mesh axes' groups are the ``DeviceMesh``'s; a flattened pair's (dp × cp) and a carved axis's and its
    complement's (ep, edp) are made with ``new_group`` when they differ from a mesh group, and the embedding group
    when ``pp > 2``.

    Args:
        dims: the layout; validated here, before any group is created.
        rank: this process's global rank (checked against ``torch.distributed``).
        device_type: the mesh's device type (``"cpu"`` for gloo, ``"cuda"`` for NCCL).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hftrain.parallel.host import COLLECTIVE_TIMEOUT, mesh_group_options

    dims.validate()
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialized default process group (torch.distributed)")
    if dist.get_world_size() != dims.world_size or dist.get_rank() != rank:
        raise ConfigError(
            f"layout world size {dims.world_size} / rank {rank} do not match the running job "
            f"(world size {dist.get_world_size()}, rank {dist.get_rank()}); launch {dims.world_size} processes"
        )
    # Row-major (pp, dp, cp, tp) is exactly Megatron's rank rule, so the mesh's per-dimension groups are its groups.
    # Every group waits COLLECTIVE_TIMEOUT for its peers, as the default group does (torch gives a new group its own
    # default: NCCL's 10 minutes), so one rank's long work before a collective does not time the others out
    # (pitfall "a subgroup times out at NCCL's 10 minutes while one rank verifies or exports", docs/pitfalls.md).
    mesh = init_device_mesh(
        device_type,
        tuple(dims.size(axis) for axis in AXES),
        mesh_dim_names=AXES,
        backend_override=mesh_group_options(AXES),
    )

    def made(axis: str) -> Any:  # every rank creates every group of the axis, in the same order (collective)
        mine = None
        for ranks in dims.iter_groups(axis):
            group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            mine = group if rank in ranks else mine
        return mine

    axes = {}
    for spec in AXIS_SPECS:
        for name in group_names(spec):
            if name in SPEC and spec.carved_from is None:
                group = mesh.get_group(name)
            elif name in FLATTENED:  # a flattened pair is its partner's mesh group while this axis is 1
                group = made(name) if dims.size(spec.name) > 1 else mesh.get_group(spec.flattened_with)
            else:  # a carved axis and its complement exist while the carved axis splits something
                group = made(name) if dims.size(spec.name) > 1 else None
            axes[name] = AxisGroup(group, dims.group_rank(name, rank), dims.size(name))
    stages = dims.size(STAGE_AXIS)
    embedding_group = mesh.get_group(STAGE_AXIS) if stages == 2 else made("embedding") if stages > 2 else None
    return ParallelGroups(dims=dims, mesh=mesh, axes=axes, embedding_group=embedding_group)


def format_groups(dims: ParallelDims) -> str:
    """A readable table of the groups of a layout (for ``hftrain groups``).

    Args:
        dims: the layout.
    """
    return "\n".join(group_lines(dims))


def group_lines(dims: ParallelDims) -> Iterator[str]:
    """The lines of :func:`format_groups`, made one at a time (a large layout is printed as it is computed).

    Args:
        dims: the layout.
    """
    dims.validate()
    labels = {name: label for s in AXIS_SPECS for name, label in ((s.name, s.label), s.complement or ("", ""))}
    labels |= {name: s.flat_label for name, s in FLATTENED.items()}
    mesh = [s for s in MESH_SPECS if s.name in dims.axes]  # outermost first
    inner = mesh[::-1]
    order = (
        [f"{inner[0].name} ranks adjacent"] + [f"then {s.name}" for s in inner[1:-1]] + [f"{inner[-1].name} outermost"]
    )
    yield (
        f"world size {dims.world_size} = {' × '.join(f'{s.name} {dims.size(s.name)}' for s in inner)} "
        f"(Megatron-LM order: {', '.join(order)})"
    )
    for spec in (s for s in AXIS_SPECS if s.carved_from and s.name in dims.axes and s.complement):
        name, parent, complement = spec.name, spec.carved_from or "", spec.complement[0]
        yield (
            f"{spec.carves[0]}: {name} {dims.size(name)} × {complement} {dims.size(complement)} = {parent} "
            f"{dims.size(parent)} ({name} consecutive {parent} ranks split the {spec.carves[0]}; {spec.carves[1]} "
            f"gradients are reduced over {complement}, the others over {parent})"
        )
    for axis in dims.axes:
        size = dims.size(axis)
        yield f"{labels[axis]} groups ({dims.world_size // size} groups of {size} ranks):"
        yield from (f"  {axis}{i}: {group}" for i, group in enumerate(dims.iter_groups(axis)))
    shown = [i for i, s in enumerate(MESH_SPECS) if s in mesh]
    yield "rank" + "".join(f"  {s.name}_rank" for s in mesh)
    yield from (
        f"{r:>4}" + "".join(f"  {coords[i]:>7}" for i in shown)
        for r in range(dims.world_size)
        for coords in [dims.coords(r)]
    )


def groups_json_chunks(dims: ParallelDims) -> Iterator[str]:
    """``json.dumps(dims.rank_groups())``, in pieces made one group at a time.

    Args:
        dims: the layout.
    """
    dims.validate()
    for index, axis in enumerate(dims.axes):
        yield ("{" if index == 0 else ", ") + f"{json.dumps(axis)}: ["
        for number, group in enumerate(dims.iter_groups(axis)):
            yield (", " if number else "") + json.dumps(group)
        yield "]"
    yield "}"
