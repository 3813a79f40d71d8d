"""The parallel axes, declared once (:data:`AXIS_SPECS`), and a layout's sizes (:class:`ParallelDims`).

torchtitan's ``ParallelDims.build_mesh`` is the model: each axis's name, its size's meaning, its place in the rank
order, what it is carved out of (ep out of dp), whether it cuts parameters, splits sequences or holds pipeline stages,
and the group it is flattened into with another axis (``dp × cp``). Coordinates, rank order, group iteration, the
checks, ``hftrain groups``' lines and ``ParallelGroups`` (``hftrain.parallel.dims``, which re-exports this module)
are derived from that list. A carved axis splits its parent into ``(parent / size, size)`` sub-dimensions, outermost
first (``dp`` into ``(edp, ep)``), so that every group is one set of sub-dimensions varied in row-major order with
the others held fixed. The rank layout itself is stated in ``hftrain.parallel.dims``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hftrain.errors import AxisError

# The largest world whose groups ``hftrain groups`` prints: each rank is on 4 lines (its tp, pp and dp group and
# the rank table), ~1 s of output here; larger layouts follow the same rule, stated in the module docstring.
MAX_PRINTED_WORLD = 65536


@dataclass(frozen=True)
class AxisSpec:
    """One parallel axis, declared once.

    Args:
        name: the axis's name (a :class:`ParallelDims` field when it has a size of its own, a group name).
        label: what ``hftrain groups`` calls its groups (``"tensor parallel"``).
        meaning: what its size means (a field of :class:`ParallelDims` and a flag of ``hftrain groups``); None
            for the axis whose size is what remains of the world (dp).
        stride: its place in the rank order, 0 for the axis whose ranks are adjacent (None: carved out of another).
        carved_from: the axis it splits into consecutive runs of its ranks (ep out of dp), None for a mesh axis.
        complement: ``(name, label)`` of a carved axis's other part: the parent's ranks with the same index in
            this axis (edp: the dp ranks holding the same experts).
        carves: ``(plural, singular)`` of what a carved axis splits (``("experts", "expert")``).
        flattened_with: the axis this one is flattened with into one group named ``<that>_<this>`` (dp × cp: the
            ranks gradients are averaged over), with ``flat_label``.
        flat_label: the flattened group's label.
        cuts_parameters: its ranks hold different slices of the same parameters (their norms and full tensors
            visit its group; the RNG's tensor stream differs along it).
        splits_sequence: its ranks hold different parts of every sequence.
        pipelined: its ranks hold consecutive pipeline stages (the first and last form the embedding group).
        always_listed: ``hftrain groups`` lists its groups at size 1 too.
        module: its own module, whose ``AXIS`` (``hftrain.parallel.axis_ops.AxisOps``) holds its checks, split and
            refusals (None: the caller wraps the model, data parallelism).
    """

    name: str
    label: str
    meaning: str | None
    stride: int | None = None
    carved_from: str | None = None
    complement: tuple[str, str] | None = None
    carves: tuple[str, str] = ("", "")
    flattened_with: str | None = None
    flat_label: str = ""
    cuts_parameters: bool = False
    splits_sequence: bool = False
    pipelined: bool = False
    always_listed: bool = False
    module: str | None = None


AXIS_SPECS: tuple[AxisSpec, ...] = (  # the order ``hftrain groups`` lists them and the flags come in
    AxisSpec(
        "tp",
        "tensor parallel",
        "tensor-parallel size",
        stride=0,
        cuts_parameters=True,
        always_listed=True,
        module="hftrain.parallel.tensor_parallel",
    ),
    AxisSpec(
        "pp",
        "pipeline parallel",
        "pipeline-parallel size",
        stride=3,
        pipelined=True,
        always_listed=True,
        module="hftrain.parallel.pipeline",
    ),
    AxisSpec("dp", "data parallel", None, stride=2, always_listed=True),
    AxisSpec(
        "cp",
        "context parallel",
        "context-parallel size (ranks that split each sequence)",
        stride=1,
        splits_sequence=True,
        flattened_with="dp",
        flat_label="gradient (dp × cp)",
        module="hftrain.parallel.context_parallel",
    ),
    AxisSpec(
        "ep",
        "expert parallel",
        "expert-parallel size (data-parallel ranks that split the experts)",
        carved_from="dp",
        complement=("edp", "expert data parallel"),
        carves=("experts", "expert"),
        cuts_parameters=True,
        module="hftrain.parallel.expert_parallel",
    ),
)
SPEC = {spec.name: spec for spec in AXIS_SPECS}
MESH_SPECS = tuple(sorted((s for s in AXIS_SPECS if s.stride is not None), key=lambda s: -(s.stride or 0)))
AXES = tuple(spec.name for spec in MESH_SPECS)  # outermost first: the mesh's dimension order (pp, dp, cp, tp)
AXIS_SIZES = {spec.name: spec.meaning for spec in AXIS_SPECS if spec.meaning}
"""The axes a layout is given by, besides the world size (dp is what remains), with what each size means: the fields of
:class:`ParallelDims`, and ``hftrain groups``' flags."""
# The groups that are not a mesh axis: the flattened pairs (dp_cp) and the carved axes' complements (edp).
FLATTENED = {f"{s.flattened_with}_{s.name}": s for s in AXIS_SPECS if s.flattened_with}
COMPLEMENTS = {s.complement[0]: s for s in AXIS_SPECS if s.complement}
CUT_AXES = tuple(s.name for s in AXIS_SPECS if s.cuts_parameters)  # the axes that cut parameters into slices
SEQUENCE_AXES = tuple(s.name for s in AXIS_SPECS if s.splits_sequence)
STAGE_AXIS = next(s.name for s in AXIS_SPECS if s.pipelined)
# The group over which a parameter no axis cuts is replicated: every mesh axis that neither cuts parameters nor
# holds stages, flattened (dp × cp).
REPLICA_GROUP = next(name for name, s in FLATTENED.items() if not (s.cuts_parameters or s.pipelined))


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


def group_names(*specs: AxisSpec) -> Iterator[str]:
    """The group names of these axes (all by default), each followed by its flattened pair and its complement:
    ``tp, pp, dp, cp, dp_cp, ep, edp``."""
    for spec in specs or AXIS_SPECS:
        yield spec.name
        yield from [f"{spec.flattened_with}_{spec.name}"] if spec.flattened_with else []
        yield from [spec.complement[0]] if spec.complement else []


def _listed(names: list[str]) -> str:
    """``"tp, pp and dp"``: names joined for a message."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _inner_first(specs: Any) -> list[AxisSpec]:
    return sorted(specs, key=lambda s: s.stride)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the tensor-, context-, pipeline- and data-parallel dimensions of one job (:data:`AXIS_SIZES`).

    The size of every other group (``dp``, ``dp_cp``, ``edp``) is an attribute too (:meth:`size`).

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

    def __getattr__(self, name: str) -> int:
        if name in SPEC or name in FLATTENED or name in COMPLEMENTS:
            return self.size(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def size(self, axis: str) -> int:
        """The size of an axis's or group's ranks: a given size, ``world / (tp · cp · pp)`` for dp, the product
        of a flattened pair (``dp_cp``), the parent's size divided by the carved axis's for a complement (``edp``).

        Args:
            axis: a name of :data:`AXIS_SPECS`, :data:`FLATTENED` or :data:`COMPLEMENTS`.
        """
        if axis in FLATTENED:
            return self.size(FLATTENED[axis].flattened_with or "") * self.size(FLATTENED[axis].name)
        if axis in COMPLEMENTS:
            return self.size(COMPLEMENTS[axis].carved_from or "") // self.size(COMPLEMENTS[axis].name)
        spec = SPEC[axis]
        if spec.meaning is not None:
            return self.__dict__[axis]
        return self.world_size // math.prod(self.__dict__[s.name] for s in MESH_SPECS if s.meaning)

    def validate(self) -> ParallelDims:
        """Return ``self`` if the given mesh sizes divide the world size and each carved axis divides its parent,
        else raise an ``AxisError`` naming the axis and its valid values.

        The axes that hold parameters (tp, pp) are checked first, outermost first; the ones that split sequences
        then divide what they leave. The message names the product that failed."""
        for axis, value in (("world_size", self.world_size), *((a, self.__dict__[a]) for a in AXIS_SIZES)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AxisError(axis, f"{axis} must be a positive integer, got {value!r}")
        given = sorted((s for s in MESH_SPECS if s.meaning), key=lambda s: (s.splits_sequence, -(s.stride or 0)))
        for count, spec in enumerate(given, 1):
            checked = given[:count]
            if self.world_size % math.prod(self.size(s.name) for s in checked) == 0:
                continue
            others = _inner_first(checked[:-1])
            rest = math.prod(self.size(s.name) for s in others)
            valid = _divisors(self.world_size // rest) if self.world_size % rest == 0 else []
            shown = " × ".join(f"{s.name}={self.size(s.name)}" for s in _inner_first(checked))
            given_with = ", ".join(f"{s.name}={self.size(s.name)}" for s in others)
            raise AxisError(
                spec.name,
                f"{shown} does not divide the world size {self.world_size}; valid {spec.name} values"
                + (f" with {given_with}" if others else "")
                + f": {', '.join(map(str, valid)) or 'none'} (or change the number of processes)",
            )
        for spec in (s for s in AXIS_SPECS if s.carved_from):
            parent, size = SPEC[spec.carved_from or ""], self.size(spec.name)
            if self.size(parent.name) % size:
                mesh = " × ".join(f"{s.name} {self.size(s.name)}" for s in _inner_first(MESH_SPECS) if s.meaning)
                raise AxisError(
                    spec.name,
                    f"{spec.name}={size} does not divide the {parent.label.replace(' ', '-')} size "
                    f"{self.size(parent.name)} (world {self.world_size} / ({mesh})): {spec.carves[0]} are split "
                    f"over {parent.label.replace(' ', '-')} ranks; valid {spec.name} values here: "
                    f"{', '.join(map(str, _divisors(self.size(parent.name))))} (or launch more processes)",
                )
        return self

    def validate_trainable(self) -> ParallelDims:
        """Return ``self`` if it is a layout (:meth:`validate`) that hftrain's megatron runtimes train, else raise an
        ``AxisError`` naming the axis: a carved axis (expert parallelism) composes only with its parent, the axes
        that cut parameters (tp), the pipeline's stages (pp: ep is carved out of dp within each stage) and the axes
        that split sequences (cp: an ep group is the dp ranks of one cp coordinate, which exchange the tokens of
        their positions; an expert's gradient is partial over cp, ``expert_parallel.py``). Every mesh axis composes
        with it today; the rule stays for the next carved axis. The megatron strategy and ``hftrain groups`` both
        check this, so a layout that ``groups`` prints is one that training takes.
        """
        self.validate()
        for carved in (s for s in AXIS_SPECS if s.carved_from and self.size(s.name) > 1):
            allowed = [
                s
                for s in AXIS_SPECS
                if s.name == carved.carved_from
                or (s.stride is not None and (s.cuts_parameters or s.pipelined or s.splits_sequence))
            ]
            for spec in AXIS_SPECS:
                size = self.size(spec.name)
                if spec.stride is None or spec.meaning is None or spec in allowed or size == 1:
                    continue
                raise AxisError(
                    spec.name,
                    f"{spec.name}={size} with {carved.name}={self.size(carved.name)} is not supported yet "
                    f"({carved.label}ism composes with {_listed([s.name for s in allowed])}); use {spec.name} 1 "
                    f"or {carved.name} 1",
                )
        return self

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes whose groups are listed: tp, pp, dp, cp (with dp_cp) when it splits sequences, ep and edp when
        it splits experts."""
        shown = [s for s in AXIS_SPECS if s.always_listed or self.size(s.name) > 1]
        return tuple(name for spec in shown for name in group_names(spec))

    @property
    def group_sizes(self) -> dict[str, int]:
        """The size of each listed group (:attr:`axes`): ``{"tp", "pp", "dp"}``, and cp's and ep's groups when
        they split something."""
        return {axis: self.size(axis) for axis in self.axes}

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh's axis sizes, ``{"tp", "cp", "pp", "dp"}`` (given ones innermost first, then dp; ep lies inside
        dp), as checkpoints record a layout."""
        order = sorted(MESH_SPECS, key=lambda s: (s.meaning is None, s.stride))
        return {s.name: self.size(s.name) for s in order}

    def coords(self, rank: int) -> tuple[int, ...]:
        """``(pp_rank, dp_rank, cp_rank, tp_rank)`` of a global rank (the mesh's order, :data:`AXES`).

        Args:
            rank: a global rank in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        coords = []
        for spec in reversed(MESH_SPECS):
            rank, coord = divmod(rank, self.size(spec.name))
            coords.append(coord)
        return tuple(coords[::-1])

    def rank(self, *coords: int) -> int:
        """The global rank at these coordinates, in the mesh's order (inverse of :meth:`coords`): ``((pp_rank · dp +
        dp_rank) · cp + cp_rank) · tp + tp_rank``.

        Args:
            coords: ``pp_rank, dp_rank, cp_rank, tp_rank``.
        """
        rank = 0
        for spec, coord in zip(MESH_SPECS, coords, strict=True):
            rank = rank * self.size(spec.name) + coord
        return rank

    def _subdims(self) -> list[tuple[str, int]]:
        """The mesh's dimensions, outermost first, with each carved axis splitting its parent into ``(complement,
        carved)``: ``[pp, edp, ep, cp, tp]``. The global rank is their row-major index."""
        carved = {s.carved_from: s for s in AXIS_SPECS if s.carved_from}
        subdims: list[tuple[str, int]] = []
        for spec in MESH_SPECS:
            if spec.name in carved:
                part = carved[spec.name]
                complement = part.complement[0] if part.complement else ""
                subdims += [(complement, self.size(complement)), (part.name, self.size(part.name))]
            else:
                subdims.append((spec.name, self.size(spec.name)))
        return subdims

    def _members(self, axis: str) -> set[str]:
        """The sub-dimensions (:meth:`_subdims`) a group of ``axis`` varies."""
        if axis in FLATTENED:
            return self._members(FLATTENED[axis].flattened_with or "") | self._members(FLATTENED[axis].name)
        parts = {s.carved_from: s for s in AXIS_SPECS if s.carved_from}
        if axis in parts:
            part = parts[axis]
            return {part.name, part.complement[0] if part.complement else ""}
        if axis in SPEC or axis in COMPLEMENTS:
            return {axis}
        raise ValueError(f"axis {axis!r} is not one of {', '.join([*group_names(), 'embedding'])}")

    def group_rank(self, axis: str, rank: int) -> int:
        """The position of a global rank in its group of ``axis`` (the group's row-major index)."""
        index, position = rank, {}
        for name, size in reversed(self._subdims()):
            index, position[name] = divmod(index, size)
        members, result = self._members(axis), 0
        for name, size in self._subdims():
            if name in members:
                result = result * size + position[name]
        return result

    def rank_groups(self) -> dict[str, list[list[int]]]:
        """Every group of :attr:`axes` as lists of global ranks (pure: starts no process).

        Ordered like Megatron-LM: tp groups by first rank; pp groups by their first-stage rank; dp (and cp, dp_cp)
        groups by pipeline stage, then the inner ranks.
        """
        return {axis: list(self.iter_groups(axis)) for axis in self.axes}

    def iter_groups(self, axis: str) -> Iterator[list[int]]:
        """The groups of one axis, one at a time, in :meth:`rank_groups`' order (nothing else is held): the ranks
        varying the axis's sub-dimensions (:meth:`_subdims`), for each setting of the others in row-major order.

        Args:
            axis: ``"tp"``, ``"pp"``, ``"dp"``, ``"cp"``, ``"dp_cp"`` (the ranks gradients are averaged over),
                ``"ep"`` (consecutive dp ranks splitting the experts), ``"edp"`` (dp ranks holding the same experts) or
                ``"embedding"`` (Megatron's embedding group: the first and last stage of each pipeline, which hold the
                two copies of tied input/output embeddings; none when ``pp = 1``).
        """
        self.validate()
        subdims = self._subdims()
        strides = {name: math.prod(size for _, size in subdims[i + 1 :]) for i, (name, _) in enumerate(subdims)}
        if axis == "embedding":
            stages = self.size(STAGE_AXIS)
            members = {STAGE_AXIS}
            offsets = [0, (stages - 1) * strides[STAGE_AXIS]] if stages > 1 else []
            if not offsets:
                return iter([])
        else:
            members = self._members(axis)
            inner = [(n, s) for n, s in subdims if n in members]
            offsets = [
                sum(c * strides[n] for (n, _), c in zip(inner, at, strict=True))
                for at in itertools.product(*(range(s) for _, s in inner))
            ]
        outer = [(n, s) for n, s in subdims if n not in members]
        return (
            [base + offset for offset in offsets]
            for base in (
                sum(c * strides[n] for (n, _), c in zip(outer, at, strict=True))
                for at in itertools.product(*(range(s) for _, s in outer))
            )
        )
