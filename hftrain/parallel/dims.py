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
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hftrain.errors import AxisError, ConfigError

AXES = ("pp", "dp", "cp", "tp")  # outermost first: the mesh's dimension order
# The largest world whose groups ``hftrain groups`` prints: each rank is on 4 lines (its tp, pp and dp group and
# the rank table), ~1 s of output here; larger layouts follow the same rule, stated in the module docstring.
MAX_PRINTED_WORLD = 65536


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, in O(√n) steps."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


AXIS_SIZES = {
    "tp": "tensor-parallel size",
    "pp": "pipeline-parallel size",
    "cp": "context-parallel size (ranks that split each sequence)",
    "ep": "expert-parallel size (data-parallel ranks that split the experts)",
}
"""The axes a layout is given by, besides the world size (dp is what remains), with what each size means: the fields of
:class:`ParallelDims`, and ``hftrain groups``' flags."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the tensor-, context-, pipeline- and data-parallel dimensions of one job.

    Args:
        world_size: number of processes in the job.
        tp: tensor-parallel size (ranks that split every layer's weights).
        pp: pipeline-parallel size (stages).
        cp: context-parallel size (ranks that split every sequence).
        ep: expert-parallel size (dp ranks that split the experts of every MoE layer; divides dp).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the dp ranks holding the same experts (``dp / ep``)."""
        return self.dp // self.ep

    @property
    def dp(self) -> int:
        """Data-parallel size: the world divided by ``tp · cp · pp``."""
        return self.world_size // (self.tp * self.cp * self.pp)

    def validate(self) -> ParallelDims:
        """Return ``self`` if ``tp · cp · pp`` divides the world size, else raise a ConfigError naming the valid
        values."""
        for axis, value in (
            ("world_size", self.world_size),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AxisError(axis, f"{axis} must be a positive integer, got {value!r}")
        if self.world_size % (self.tp * self.pp) == 0 and self.world_size % (self.tp * self.cp * self.pp):
            valid_cp = _divisors(self.world_size // (self.tp * self.pp))
            raise AxisError(
                "cp",
                f"tp={self.tp} × cp={self.cp} × pp={self.pp} does not divide the world size {self.world_size}; "
                f"valid cp values with tp={self.tp}, pp={self.pp}: {', '.join(map(str, valid_cp)) or 'none'}",
            )
        if self.world_size % (self.tp * self.pp):
            valid_tp = [d for d in _divisors(self.world_size) if (self.world_size // d) % self.pp == 0]
            raise AxisError(
                "tp",
                f"tp={self.tp} × pp={self.pp} does not divide the world size {self.world_size}; "
                f"valid tp values with pp={self.pp}: {', '.join(map(str, valid_tp)) or 'none'} "
                f"(or change the number of processes)",
            )
        if self.dp % self.ep:
            valid_ep = _divisors(self.dp)
            raise AxisError(
                "ep",
                f"ep={self.ep} does not divide the data-parallel size {self.dp} (world {self.world_size} / "
                f"(tp {self.tp} × cp {self.cp} × pp {self.pp})): experts are split over data-parallel ranks; "
                f"valid ep values here: {', '.join(map(str, valid_ep))} (or launch more processes)",
            )
        return self

    def validate_trainable(self) -> ParallelDims:
        """Return ``self`` if it is a layout (:meth:`validate`) that hftrain's megatron runtimes train, else raise an
        ``AxisError`` naming the axis: expert parallelism composes with tp and dp only (``expert_parallel.py`` routes
        the tokens of whole sequences within one stage; pipeline stages and context-parallel parts of a sequence are
        not handled yet), although Megatron-LM's rank order defines those layouts too. The megatron strategy and
        ``hftrain groups`` both check this, so a layout that ``groups`` prints is one that training takes.
        """
        self.validate()
        for axis in ("pp", "cp"):
            size = getattr(self, axis)
            if self.ep > 1 and size > 1:
                raise AxisError(
                    axis,
                    f"{axis}={size} with ep={self.ep} is not supported yet (expert parallelism composes with tp and "
                    f"dp); use {axis} 1 or ep 1",
                )
        return self

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes whose groups are listed: tp, pp, dp, cp (with dp_cp) when it splits sequences, ep and edp when
        it splits experts."""
        return ("tp", "pp", "dp") + (("cp", "dp_cp") if self.cp > 1 else ()) + (("ep", "edp") if self.ep > 1 else ())

    @property
    def group_sizes(self) -> dict[str, int]:
        """The size of each listed group (:attr:`axes`): ``{"tp", "pp", "dp"}``, and cp's and ep's groups when
        they split something."""
        every = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "cp": self.cp, "dp_cp": self.dp * self.cp}
        every |= {"ep": self.ep, "edp": self.edp}
        return {axis: every[axis] for axis in self.axes}

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's axis sizes, ``{"tp", "cp", "pp", "dp"}`` (ep lies inside dp), as checkpoints record a layout."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp}

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(pp_rank, dp_rank, cp_rank, tp_rank)`` of a global rank (the mesh's order).

        Args:
            rank: a global rank in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        tp_cp = self.tp * self.cp
        return rank // (self.dp * tp_cp), rank // tp_cp % self.dp, rank // self.tp % self.cp, rank % self.tp

    def rank(self, pp_rank: int, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        """The global rank at these coordinates (inverse of :meth:`coords`).

        Args:
            pp_rank: pipeline stage.
            dp_rank: data-parallel replica.
            cp_rank: context-parallel rank (which part of each sequence).
            tp_rank: tensor-parallel rank.
        """
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def rank_groups(self) -> dict[str, list[list[int]]]:
        """Every group of :attr:`axes` as lists of global ranks (pure: starts no process).

        Ordered like Megatron-LM: tp groups by first rank; pp groups by their first-stage rank; dp (and cp, dp_cp)
        groups by pipeline stage, then the inner ranks.
        """
        return {axis: list(self.iter_groups(axis)) for axis in self.axes}

    def iter_groups(self, axis: str) -> Iterator[list[int]]:
        """The groups of one axis, one at a time, in :meth:`rank_groups`' order (nothing else is held).

        Args:
            axis: ``"tp"``, ``"pp"``, ``"dp"``, ``"cp"``, ``"dp_cp"`` (the ranks gradients are averaged over),
                ``"ep"`` (consecutive dp ranks splitting the experts), ``"edp"`` (dp ranks holding the same experts) or
                ``"embedding"`` (Megatron's embedding group: the first and last stage of each pipeline, which hold the
                two copies of tied input/output embeddings; none when ``pp = 1``).
        """
        self.validate()
        pp_range, dp_range, cp_range, tp_range = range(self.pp), range(self.dp), range(self.cp), range(self.tp)
        rank = self.rank
        if axis == "tp":
            return ([rank(p, d, c, t) for t in tp_range] for p in pp_range for d in dp_range for c in cp_range)
        if axis == "pp":
            return ([rank(p, d, c, t) for p in pp_range] for d in dp_range for c in cp_range for t in tp_range)
        if axis == "dp":
            return ([rank(p, d, c, t) for d in dp_range] for p in pp_range for c in cp_range for t in tp_range)
        if axis == "cp":
            return ([rank(p, d, c, t) for c in cp_range] for p in pp_range for d in dp_range for t in tp_range)
        if axis == "dp_cp":
            return ([rank(p, d, c, t) for d in dp_range for c in cp_range] for p in pp_range for t in tp_range)
        ep, edp = range(self.ep), range(self.edp)
        if axis == "ep":
            return (
                [rank(p, g * self.ep + e, c, t) for e in ep]
                for p in pp_range
                for g in edp
                for c in cp_range
                for t in tp_range
            )
        if axis == "edp":
            return (
                [rank(p, g * self.ep + e, c, t) for g in edp]
                for p in pp_range
                for e in ep
                for c in cp_range
                for t in tp_range
            )
        if axis == "embedding":
            last = self.pp - 1
            return iter(
                [[rank(0, d, c, t), rank(last, d, c, t)] for d in dp_range for c in cp_range for t in tp_range]
                if self.pp > 1
                else []
            )
        raise ValueError(f"axis {axis!r} is not one of tp, pp, dp, cp, dp_cp, ep, edp, embedding")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups and coordinates in a :class:`ParallelDims` layout.

    Args:
        dims: the validated layout.
        mesh: the ``DeviceMesh`` shaped ``(pp, dp, cp, tp)`` with those dimension names (usable by DTensor).
        tp_group: ranks that split this rank's layers.
        dp_group: ranks holding the same shards of the same stage and sequence part (the data is sharded over it).
        pp_group: ranks holding the other stages of the same replica and shard.
        tp_rank: position in ``tp_group``.
        dp_rank: position in ``dp_group`` (shard the data by this, not by the global rank).
        pp_rank: pipeline stage.
        cp_group: ranks holding the other parts of the same sequences.
        cp_rank: position in ``cp_group``.
        dp_cp_group: ``dp × cp``: the ranks gradients are averaged over (``dp_group`` when ``cp = 1``).
        ep_group: the ``ep`` dp ranks splitting the experts (tokens are exchanged over it); None when ``ep = 1``.
        ep_rank: position in ``ep_group`` (which experts this rank holds).
        edp_group: the dp ranks holding the same experts (expert gradients are reduced over it); None if ``ep = 1``.
        embedding_group: this pipeline's first and last stage rank, when this rank is one of them (Megatron's embedding
            group: the copies of a weight both hold, tied input/output embeddings, sum their gradients over it); None
            elsewhere and when ``pp = 1``.
    """

    dims: ParallelDims
    mesh: Any
    tp_group: Any
    dp_group: Any
    pp_group: Any
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_group: Any = None
    cp_rank: int = 0
    dp_cp_group: Any = None
    ep_group: Any = None
    ep_rank: int = 0
    edp_group: Any = None
    embedding_group: Any = None

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's position on each mesh axis, ``{"pp", "tp", "cp", "dp"}`` (the order RNG checkpoints key by)."""
        return {"pp": self.pp_rank, "tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank}

    def axis_group(self, axis: str) -> Any:
        """The process group of mesh axis ``axis`` (``tp``, ``cp``, ``dp``, ``pp``, ``ep``), or of the pipeline's
        ``embedding`` group; None where this rank has none."""
        return {"tp": self.tp_group, "cp": self.cp_group, "dp": self.dp_group, "pp": self.pp_group,
                "ep": self.ep_group, "embedding": self.embedding_group}[axis]  # fmt: skip

    @property
    def cut_groups(self) -> dict[str, Any]:
        """The axes that cut parameters into slices in this layout -> their groups (tp always; ep when > 1), in the
        order the gradient norm and the full tensors visit them (``hftrain.parallel.placement``)."""
        return {axis: self.axis_group(axis) for axis in (("tp", "ep") if self.ep_size > 1 else ("tp",))}

    def data_replicas(self, axis: str | None) -> tuple[Any, int, int]:
        """The data-parallel replicas of a parameter cut along ``axis`` (None: whole): the group whose ranks hold the
        same slice and average its gradient, this rank's index in it, and their count.

        A dense parameter's are the dp × cp ranks; one cut along ep (carved out of dp) has the edp ranks holding the
        same experts.

        Args:
            axis: the axis cutting the parameter (``Placement.axis``), or None.
        """
        if axis == "ep":
            return self.edp_group, self.dp_rank // self.ep_size, self.dims.edp
        index = self.dp_rank * self.cp_size + self.cp_rank
        return self.dp_cp_group or self.dp_group, index, self.dp_size * self.cp_size

    def holders(self, axis: str | None) -> tuple[int, int]:
        """``(this rank's index, count)`` among the ranks of its pipeline stage holding the same box of a parameter cut
        along ``axis``: its data replicas, times the tp ranks unless tp cuts it (a checkpoint deals the box's writes out
        among them).

        Args:
            axis: the axis cutting the parameter, or None.
        """
        _, index, count = self.data_replicas(axis)
        if axis == "tp":
            return index, count
        return index * self.tp_size + self.tp_rank, count * self.tp_size


def build_groups(dims: ParallelDims, rank: int, *, device_type: str = "cpu") -> ParallelGroups:
    """Create the tp/dp/pp groups (collective: every rank of the default group calls it in the same order).

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
        (dims.pp, dims.dp, dims.cp, dims.tp),
        mesh_dim_names=AXES,
        backend_override=mesh_group_options(AXES),
    )
    pp_rank, dp_rank, cp_rank, tp_rank = dims.coords(rank)
    dp_cp_group = mesh.get_group("dp")
    if dims.cp > 1:  # every rank creates every dp × cp group, in the same order (new_group is collective)
        for ranks in dims.iter_groups("dp_cp"):
            group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            if rank in ranks:
                dp_cp_group = group
    ep_group = edp_group = None
    if dims.ep > 1:  # every rank creates every ep and edp group, in the same order
        for axis in ("ep", "edp"):
            for ranks in dims.iter_groups(axis):
                group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
                if rank in ranks:
                    ep_group, edp_group = (group, edp_group) if axis == "ep" else (ep_group, group)
    embedding_group = None
    if dims.pp == 2:  # the first and last stage are the whole pipeline
        embedding_group = mesh.get_group("pp")
    else:  # every rank creates every embedding group, in the same order
        for ranks in dims.iter_groups("embedding"):
            group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            if rank in ranks:
                embedding_group = group
    return ParallelGroups(
        dims=dims,
        mesh=mesh,
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        cp_group=mesh.get_group("cp"),
        cp_rank=cp_rank,
        dp_cp_group=dp_cp_group,
        ep_group=ep_group,
        ep_rank=dp_rank % dims.ep,
        edp_group=edp_group,
        embedding_group=embedding_group,
    )


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
    names = {
        "tp": "tensor parallel",
        "pp": "pipeline parallel",
        "dp": "data parallel",
        "cp": "context parallel",
        "dp_cp": "gradient (dp × cp)",
        "ep": "expert parallel",
        "edp": "expert data parallel",
    }
    sizes = {
        "tp": dims.tp,
        "pp": dims.pp,
        "dp": dims.dp,
        "cp": dims.cp,
        "dp_cp": dims.dp * dims.cp,
        "ep": dims.ep,
        "edp": dims.edp,
    }
    if dims.cp > 1:
        yield (
            f"world size {dims.world_size} = tp {dims.tp} × cp {dims.cp} × dp {dims.dp} × pp {dims.pp} "
            "(Megatron-LM order: tp ranks adjacent, then cp, then dp, pp outermost)"
        )
    else:
        yield (
            f"world size {dims.world_size} = tp {dims.tp} × dp {dims.dp} × pp {dims.pp} "
            "(Megatron-LM order: tp ranks adjacent, then dp, pp outermost)"
        )
    if dims.ep > 1:
        yield (
            f"experts: ep {dims.ep} × edp {dims.edp} = dp {dims.dp} (ep consecutive dp ranks split the experts; "
            "expert gradients are reduced over edp, the others over dp)"
        )
    for axis in dims.axes:
        size = sizes[axis]
        yield f"{names[axis]} groups ({dims.world_size // size} groups of {size} ranks):"
        yield from (f"  {axis}{i}: {group}" for i, group in enumerate(dims.iter_groups(axis)))
    if dims.cp > 1:
        yield "rank  pp_rank  dp_rank  cp_rank  tp_rank"
        yield from (
            f"{r:>4}  {p:>7}  {d:>7}  {c:>7}  {t:>7}" for r in range(dims.world_size) for p, d, c, t in [dims.coords(r)]
        )
    else:
        yield "rank  pp_rank  dp_rank  tp_rank"
        yield from (
            f"{r:>4}  {p:>7}  {d:>7}  {t:>7}" for r in range(dims.world_size) for p, d, _, t in [dims.coords(r)]
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
