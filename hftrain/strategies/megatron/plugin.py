"""``MegatronPlugin``: the adapter between ``hftrain.parallel`` and an Accelerate loop (tensor × data parallelism).

``hftrain.parallel`` knows neither Accelerate nor the Trainer; this adapter is where Accelerate meets it: the
optimizer wrapper, data sharding by dp rank and ``gather_for_metrics``'s remainder rule are Accelerate's. The
``megatron`` strategy's runtimes use it, and so can a hand-written loop.

Accelerate cannot run this layout itself: its TP refuses ``MULTI_CPU``, and ``prepare(model)`` wraps a TP model
in DDP over the *whole* world, averaging gradients between ranks that hold different shards. The plugin does the
four things Accelerate would get wrong, and leaves the rest (process group, ``accumulate``, ``backward``,
autocast, trackers) to Accelerate::

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)   # the default process group
    plugin = MegatronPlugin(ParallelismConfig(tp=2)).setup()  # Megatron-order groups (4 processes: tp2 × dp2)
    model = plugin.prepare_model(model)                  # TP layers, then DDP over the dp group only
    optimizer = plugin.prepare_optimizer(torch.optim.AdamW(model.parameters()))
    loader = plugin.prepare_data_loader(loader)          # sharded by dp rank: tp ranks see the same batches
    for batch in loader:
        with accelerator.accumulate(model):              # DDP's no_sync inside the window, as usual
            with accelerator.autocast():
                loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                plugin.finalize_grads(model)             # sequence-parallel norm grads summed over tp
                plugin.clip_grad_norm_(model, 1.0)       # split weights counted once
            optimizer.step()                             # skipped inside the accumulation window
            optimizer.zero_grad()
    weights = plugin.full_state_dict(model)              # collective over tp: the HF names and full shapes

The plugin knows nothing of hftrain's Trainer; hftrain's ``megatron`` strategy is this plugin behind the
Trainer's runtime interface. Groups are held by the plugin object, never in module globals.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from hftrain.config import ParallelismConfig
    from hftrain.parallel.dims import ParallelDims, ParallelGroups
    from hftrain.parallel.random import RNGTracker


def axis_options(parallelism: ParallelismConfig) -> dict[str, Any]:
    """The ``parallelism`` options the axes read (each axis's module names its own, ``hftrain.parallel.axis_ops``),
    by field name: a field renamed in the schema fails here, one an axis reads under another name fails its read."""
    from hftrain.parallel.axis_ops import option_defaults

    return parallelism.named(tuple(option_defaults()))


@dataclass
class MegatronPlugin:
    """Megatron-style tensor parallelism composed with data parallelism over the dp groups.

    Args:
        parallelism: the axes' sizes and options (the job config's ``parallelism`` section,
            ``hftrain.config.ParallelismConfig``), passed to ``hftrain.parallel`` whole.
        shard_optimizer: ZeRO-1-style optimizer-state sharding over the dp group
            (``torch.distributed.optim.ZeroRedundancyOptimizer``); with pipeline stages, each stage's optimizer over
            that stage's dp group; under expert parallelism the routed experts' state over their own data replicas
            (the edp group, :class:`ReplicaShardedOptimizer`).
        recompute: activation recomputation, ``"full"``, ``"selective"`` or None.
    """

    parallelism: ParallelismConfig = field(default_factory=lambda: _section())
    shard_optimizer: bool = False
    recompute: str | None = None
    _groups: ParallelGroups | None = field(default=None, init=False, repr=False)
    _split: torch.nn.Module | None = field(default=None, init=False, repr=False)  # set by parallelize()
    rng_tracker: RNGTracker | None = field(default=None, init=False, repr=False)  # set by parallelize()

    # ----------------------------------------------------------------- groups
    def setup(self, *, device_type: str = "cpu", dims: ParallelDims | None = None) -> MegatronPlugin:
        """Build the tp/dp/pp groups in Megatron's rank order (collective; needs the default process group).

        Args:
            device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
            dims: the layout, validated once by its owner (the strategy); None builds it from the section's
                sizes and the world size (a hand-written loop).
        """
        import torch.distributed as dist

        from hftrain.parallel.dims import AXIS_SIZES, ParallelDims, build_groups

        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        if dims is None:
            dims = ParallelDims(world, **{axis: getattr(self.parallelism, axis) for axis in AXIS_SIZES}).validate()
        if not dist.is_initialized():  # one process (tp=1): a group of one keeps every code path the same
            _init_single_process_group("nccl" if device_type == "cuda" else "gloo")
        self._groups = build_groups(dims, rank, device_type=device_type)
        return self

    @property
    def groups(self) -> ParallelGroups:
        """This rank's groups; ``setup()`` must have run."""
        if self._groups is None:
            raise RuntimeError("MegatronPlugin.setup() must run before the plugin is used")
        return self._groups

    @property
    def sequence_multiple(self) -> int | None:
        """What every batch's sequence length must be padded up to a multiple of: ``tp`` under sequence parallelism,
        ``2·cp`` under context parallelism, else None (any length); the trainer's length buckets
        (``data.pad_to_multiple_of``) combine with it."""
        from hftrain.parallel import padding_multiple

        return padding_multiple(self.groups.dims, **axis_options(self.parallelism))

    # ----------------------------------------------------------------- wrapping
    def parallelize(
        self, model: torch.nn.Module, *, device: Any = None, move: bool = True, head: Any = "sequence_classification"
    ) -> torch.nn.Module:
        """Split the model over this rank's groups (``hftrain.parallel.parallelize_model``) where it was built (the
        host), then move only this rank's shards to ``device``; in place.

        The whole model never reaches the GPU: a model that needs tensor parallelism because it does not fit one GPU
        would not survive being moved there whole first (pitfall "whole model on every GPU before the split",
        docs/pitfalls.md). Splitting runs no collective on the weights (the replica check agrees on a host checksum,
        ``parallel.host``).

        Every rank must hold the same full weights before (same seed or the same checkpoint), or leave them on
        ``meta`` with a reader of the checkpoint (``hftrain.parallel.deferred``: ``MegatronLoading``), read as they
        are split, and whole once the split is done where no split reached them. The RNG tracker
        (``hftrain.parallel.random``) is seeded here from the seed the model was built with (``torch.initial_seed``,
        what ``set_seed`` set on every rank): the model's dropout then draws Megatron's streams.

        Args:
            model: an unchanged HF ``*ForSequenceClassification`` model.
            device: where the shards live and the RNG streams draw (None: stay where they are).
            move: move the split model to ``device`` (False: the caller moves the parts this rank keeps, as the
                pipeline moves only its stages).
            head: the task's head (the runtime's ``stage_head``: a kind of ``hftrain.parallel.heads.HEADS`` or a
                task's own ``StageHead``): context parallelism gathers the sequences back for a head that is not per
                token.
        """
        import torch

        from hftrain.parallel import parallelize_model
        from hftrain.parallel.deferred import read_remaining
        from hftrain.parallel.random import RNGTracker

        groups = self.groups
        self.rng_tracker = RNGTracker.for_groups(
            groups, seed=torch.initial_seed(), device=device or "cpu"
        ).seed_streams()
        options = axis_options(self.parallelism)
        model = parallelize_model(
            model, groups, rng_tracker=self.rng_tracker, recompute=self.recompute, head=head, **options
        )
        read_remaining(model)  # what a loader left on meta that no split read (``MegatronLoading``): read whole now
        self._split = model  # its placement records tell prepare_optimizer each parameter's data replicas
        return to_device(model, device) if device is not None and move else model

    def prepare_model(
        self, model: torch.nn.Module, *, device: Any = None, head: Any = "sequence_classification"
    ) -> torch.nn.Module:
        """``parallelize`` the model, then wrap it in DDP over the dp group (no pipeline stages).

        Args:
            model: an unchanged HF ``*ForSequenceClassification`` model.
            device: where the shards live (None: stay where they are).
        """
        from torch.nn.parallel import DistributedDataParallel

        groups = self.groups
        model = self.parallelize(model, device=device, head=head)
        data_group, _, replicas = groups.data_replicas(None)  # dp × cp: the ranks holding the same shards
        if replicas == 1:
            return model
        from hftrain.parallel import ddp_ignored

        # parameters whose data replicas are another group (ep's experts): finalize_grads averages them there
        ignored = ddp_ignored(model, groups)
        if ignored:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        # Gradients are averaged over the ranks holding the same shard only (and its sequence parts: dp × cp);
        # DDP's no_sync serves accumulation.
        return DistributedDataParallel(model, process_group=data_group)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """The optimizer, sharded over each parameter's data replicas when ``shard_optimizer``, wrapped so that it
        steps only at window ends.

        Under ``shard_optimizer`` a dense parameter's state is sharded over the dp group; one whose data replicas
        are another group (ep's routed experts: the edp group, ``ParallelGroups.data_replicas`` over the placement
        records of the model :meth:`parallelize` split) over that group (:func:`_zero_from`).

        Args:
            optimizer: built over the prepared model's (sharded) parameters; under pipeline parallelism over this
                rank's stages' only, so the dp group (the ranks holding the same stages and tp shard) shards them.
        """
        from accelerate.optimizer import AcceleratedOptimizer

        if self.shard_optimizer and self.groups.dp_size > 1:
            optimizer = _zero_from(optimizer, self.groups.dp_group, carved=self._carved_replicas())
        # device_placement=False: a ZeroRedundancyOptimizer has no state_dict() before consolidation.
        return AcceleratedOptimizer(optimizer, device_placement=False)

    def _carved_replicas(self) -> dict[int, tuple[Any, int]]:
        """``id(parameter) -> (group, size)`` of its data replicas, for the parameters whose replicas are not the
        dense ones (the experts under ep: the edp group); empty without such parameters."""
        if self._split is None:
            return {}
        from hftrain.parallel import placements

        groups = self.groups
        dense = groups.data_replicas(None)[0]
        records = placements(self._split)
        carved = {}
        for name, param in self._split.named_parameters():
            record = records.get(name)
            replicas, _, size = groups.data_replicas(record.axis if record is not None else None)
            if record is not None and replicas is not dense:
                carved[id(param)] = (replicas, size)
        return carved

    def prepare_data_loader(self, loader: DataLoader, *, device: Any = None) -> DataLoader:
        """Shard ``loader`` by dp rank (tp ranks of one replica get the same batches), Accelerate's way.

        Args:
            loader: the full loader, built identically on every rank.
            device: where batches go (None: leave them).
        """
        from accelerate.data_loader import prepare_data_loader

        if self.sequence_multiple:
            loader = _padded_to_multiple(loader, self.sequence_multiple)
        groups = self.groups
        return prepare_data_loader(
            loader,
            device,
            num_processes=groups.dp_size,
            process_index=groups.dp_rank,
            put_on_device=device is not None,
            use_seedable_sampler=True,
            non_blocking=loader.pin_memory,  # pinned batches (a GPU run): their copies do not wait for the device
        )

    # ----------------------------------------------------------------- step
    def finalize_grads(self, model: torch.nn.Module) -> None:
        """Complete the gradients after backward (before clipping and the step): what DDP did not average, and what
        is partial over an axis (``hftrain.parallel.complete_grads``, over the placement records).

        Args:
            model: the prepared model.
        """
        from hftrain.parallel import complete_grads

        complete_grads(unwrap(model), self.groups, data_mean=False)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to the global gradient norm, as one process with the whole model would compute it
        (``hftrain.parallel.clip_grad_norm_``: a cut parameter's squares summed over its axis, whole ones once).

        Args:
            model: the prepared model (after ``finalize_grads``).
            max_norm: the largest allowed norm.
        """
        from hftrain.parallel import clip_grad_norm_

        module = unwrap(model)
        return clip_grad_norm_(module, dict(module.named_parameters()), max_norm, groups=self.groups.cut_groups)

    # ----------------------------------------------------------------- evaluation and state
    def gather_for_metrics(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Per-example tensors of one evaluation batch from every dp rank, each example once.

        tp ranks of a replica hold the same examples, so gathering over the world would count each ``tp`` times;
        the duplicates Accelerate adds to even out the last batch are dropped as ``gather_for_metrics`` does.

        Args:
            tensors: this rank's per-example tensors (first dimension = batch).
        """
        import torch
        import torch.distributed as dist
        from accelerate.state import GradientState

        groups = self.groups
        if groups.dp_size == 1:
            return tensors
        parts: list[Any] = [None] * groups.dp_size
        dist.all_gather_object(parts, [t.cpu() for t in tensors], group=groups.dp_group)
        gathered = tuple(torch.cat([p[i] for p in parts]) for i in range(len(tensors)))
        state = GradientState()
        if state.end_of_dataloader and state.remainder > 0:
            gathered = tuple(t[: state.remainder] for t in gathered)
        return gathered

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights with the HF names (collective over the groups of the axes that cut them).

        Args:
            model: the prepared model.
        """
        from hftrain.parallel import full_state_dict

        return full_state_dict(unwrap(model), groups=self.groups.cut_groups)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (and nothing else: the TP layers are the model)."""
    return getattr(model, "module", model)


def to_device(model: torch.nn.Module, device: Any) -> torch.nn.Module:
    """``model.to(device)``, leaving parameters on ``meta`` where they are (a pipeline rank's other stages)."""
    return model._apply(lambda t: t if t.device.type == "meta" else t.to(device))


def _zero_from(
    optimizer: torch.optim.Optimizer, dp_group: Any, *, carved: dict[int, tuple[Any, int]] | None = None
) -> Any:
    """A ``ZeroRedundancyOptimizer`` over ``dp_group`` of the same class, hyper-parameters and parameter groups; with
    ``carved`` parameters (other data replicas than dp's), a :class:`ReplicaShardedOptimizer` of one per group.

    Every group is passed to the constructor, an empty one too: a pipeline stage may hold no parameter of a group
    (``OptimizerPlan.build`` keeps it so that the groups line up across stages in the checkpoint), and ZeRO's
    constructor refuses an empty parameter list, not an empty group. Within each group the parameters are dealt to
    the dp ranks largest first, each to the rank holding the fewest elements so far (ZeRO's greedy partition): each
    rank's local optimizer keeps Adam's moments of ~1/dp of the elements, and after its step each owner broadcasts
    its updated parameters over ``dp_group`` (one broadcast per parameter, ``ZeroRedundancyOptimizer.step``).

    Args:
        optimizer: built over the prepared model's (sharded) parameters, no state yet.
        dp_group: the ranks holding the same parameters (this stage's and tp shard's data replicas).
        carved: ``id(parameter) -> (group, size)`` for the parameters whose data replicas are another group (the
            experts' edp group under ep).
    """
    groups = [dict(group) for group in optimizer.param_groups]
    if not carved:
        return _zero_over(groups, type(optimizer), dp_group)
    replicas = {id(dp_group): (dp_group, None)}  # the dense parameters' first, then each carved group once
    replicas.update({id(group): (group, size) for group, size in carved.values()})
    parts = []
    for key, (group, size) in replicas.items():
        mine = [
            {**entry, "params": [p for p in entry["params"] if id(carved.get(id(p), (dp_group,))[0]) == key]}
            for entry in groups
        ]
        if not any(entry["params"] for entry in mine):
            continue
        # a carved group of one (ep = dp: each rank holds its experts alone) has nothing to shard them over
        parts.append(type(optimizer)(mine) if size == 1 else _zero_over(mine, type(optimizer), group))
    return ReplicaShardedOptimizer(optimizer.param_groups, optimizer.defaults, parts)


def _zero_over(groups: list[dict[str, Any]], optimizer_class: type, group: Any) -> Any:
    """A ``ZeroRedundancyOptimizer`` of ``optimizer_class`` over ``groups``' parameters, sharded over ``group``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        groups, optimizer_class=optimizer_class, process_group=group, **_group_options(groups[0], optimizer_class)
    )


class ReplicaShardedOptimizer:
    """ZeRO-1 over parameters with different data replicas: one ``ZeroRedundancyOptimizer`` per replica group, stepped
    together behind the original parameter groups.

    Under expert parallelism the dp ranks hold different routed experts: the ranks of one expert's replicas are its
    edp group (``dp/ep`` ranks), the dense parameters' the dp group. One ZeRO over dp would deal an expert to a rank
    that does not hold it and broadcast one rank's experts over the others'; so the dense parameters' state is
    sharded over dp (``1/dp`` per rank) and the experts' over edp (``1/(dp/ep)``), each part broadcasting its owners'
    updates over its own group. Why one per replica group rather than one ZeRO with a custom partition: ZeRO's
    partition, step and broadcast are per process group, and its local optimizers stay plain ``torch.optim`` ones
    (the checkpoint reads their state as it reads one ZeRO's, :mod:`hftrain.strategies.megatron.state`).

    ``param_groups`` are the original ones (every parameter; the scheduler and the checkpoint see as many groups as
    without sharding): each step copies their hyper-parameters (the scheduler's ``lr``) into every part's groups,
    which ZeRO copies into its local optimizer.

    Args:
        param_groups: the original optimizer's parameter groups.
        defaults: its defaults.
        parts: one ``ZeroRedundancyOptimizer`` per replica group (a plain optimizer for a group of one), each over
            the same groups holding only that group's parameters.
    """

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any], parts: list[Any]) -> None:
        self.param_groups = param_groups
        self.defaults = defaults
        self.parts = parts

    @property
    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers holding this rank's state: each part's local one."""
        return [getattr(part, "optim", part) for part in self.parts]

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        """This rank's state (its parts' local optimizers' merged; read-only)."""
        return {param: values for local in self.local_optimizers for param, values in local.state.items()}

    def step(self, closure: Any = None) -> None:
        """Every part's step (each broadcasts its owners' updated parameters over its group), with this step's
        hyper-parameters."""
        if closure is not None:
            raise ValueError("ReplicaShardedOptimizer.step takes no closure")
        for part in self.parts:
            for mine, group in zip(part.param_groups, self.param_groups, strict=True):
                mine.update({key: value for key, value in group.items() if key != "params"})
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every part's ``zero_grad``."""
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def _group_options(group: dict[str, Any], optimizer_class: type) -> dict[str, Any]:
    """A parameter group's hyper-parameters that ``optimizer_class``'s constructor accepts."""
    import inspect

    accepted = inspect.signature(optimizer_class).parameters
    return {k: v for k, v in group.items() if k != "params" and k in accepted}


def _padded_to_multiple(loader: DataLoader, multiple: int) -> DataLoader:
    """The same loader whose collator pads sequences to a multiple of ``multiple`` (sequence or context parallelism):
    as it is when its collator's ``pad_to_multiple_of`` already is one (the trainer's length buckets, combined with
    this multiple), else with the lcm of the two."""
    from torch.utils.data import DataLoader

    collate = loader.collate_fn
    if not hasattr(collate, "pad_to_multiple_of"):
        raise ConfigError(
            "parallelism.sequence_parallel needs a padding collator with pad_to_multiple_of "
            f"(hftrain's BucketCollator or transformers' DataCollatorWithPadding), got {type(collate).__name__}"
        )
    buckets = collate.pad_to_multiple_of or 1
    if buckets % multiple == 0:
        return loader
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=loader.sampler,
        collate_fn=dataclasses.replace(collate, pad_to_multiple_of=math.lcm(buckets, multiple)),
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        generator=loader.generator,
    )


def _init_single_process_group(backend: str) -> None:
    """A one-process group on a free loopback port (a one-process run uses the same code as many): nccl on a GPU
    (gloo would copy every CUDA tensor of a collective through the host), gloo on a CPU."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _section() -> ParallelismConfig:
    """The default ``parallelism`` section (no axis splits the model)."""
    from hftrain.config import ParallelismConfig

    return ParallelismConfig()
