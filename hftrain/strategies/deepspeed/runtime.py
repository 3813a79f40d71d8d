"""ZeRO-1/2/3's state in the sharded checkpoint format and the streamed export: :class:`ZeroRuntime`.

The ZeRO strategies (``hftrain.strategies.deepspeed``) run through Accelerate's runtime; this subclass adds what a
checkpoint and an export need from DeepSpeed's partitions, through its public per-parameter accessors (and, for a
ZeRO-1/2 save, the per-parameter fragment mapping those accessors read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from hftrain.strategies.runtime import AccelerateRuntime

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from hftrain.checkpoint.sharded import Chunked, Snapshot

# Full tensors read together when a ZeRO-1/2 run loads (one DCP read per bucket; a larger tensor is a bucket alone).
LOAD_BUCKET_BYTES = 256 * 2**20


class ZeroRuntime(AccelerateRuntime):
    """Accelerate's runtime with ZeRO's partitions checkpointed in the sharded format (``hftrain.checkpoint.sharded``).

    Every parameter is reached through DeepSpeed's per-parameter accessors (``deepspeed.utils``), never its flat
    buffers, and saved under the model's own names with its fp32 master values (under bf16 too) and Adam's
    moments, so a ZeRO checkpoint resumes under any strategy and process count and any checkpoint resumes here:

    - ZeRO-3: each rank holds the flat range ``[rank·part, rank·part + part)`` of every parameter, ``part =
      ceil(numel / N)`` (DeepSpeed pads the last partition; the padding is not saved), read with
      ``safe_get_local_fp32_param``/``safe_get_local_optimizer_state`` and cut into boxes
      (:meth:`~hftrain.checkpoint.sharded.Chunked.flat_range`). A load reads exactly those ranges and sets them
      with the ``safe_set_local_*`` forms (from scratch partitions: one copy of the rank's own state), then copies
      them into the working partitions and regathers the parameters DeepSpeed keeps whole: no other collective.
    - ZeRO-1/2: DeepSpeed has no public local accessors at these stages; the save reads each rank's fragment of
      a parameter where DeepSpeed's own full accessor does (``param._hp_mapping``: its flat start in the parameter
      and a view of the fp32 partition or optimizer state), and writes it in place as ZeRO-3's ranges: no copy and
      no collective (``_z12_fragment``). Without that mapping it gathers one parameter's full tensor at a time
      (``safe_get_full_*``, an all-reduce each) and keeps a copy of an even split of its dim 0. The setters take
      full tensors, so a load reads full tensors, a bucket of :data:`LOAD_BUCKET_BYTES` at a time: each rank
      reads the whole fp32 model and both moments (12 bytes per parameter instead of its ``4 + 8/N``). The model's
      full weights are needed anyway (ZeRO-1/2 keep them on every rank); the excess is the optimizer state of the
      other ranks' partitions, read and dropped.

    Frozen parameters (a LoRA base) have no fp32 master: their working copy is saved (as fp32) and loaded, partitioned
    like the others under ZeRO-3, split over the ranks under ZeRO-1/2.

    Adam's ``step`` lives in the inner optimizer's state of each flat parameter group (a 0-dim tensor in torch's
    AdamW, an int in DeepSpeed's CPU Adam under offload); it is saved per parameter as torch's AdamW holds it and
    restored into the group that holds the parameter. fp16's dynamic loss scale is not carried (bf16 and fp32 have
    none).

    Args:
        accelerator: the run's accelerator (DeepSpeed's engine inside).
        stage: the ZeRO stage, 1, 2 or 3.
        size_from_model: fills the DeepSpeed JSON's model-sized ``"auto"`` values from the model, before the engine
            is built (``strategies.deepspeed.fill_model_sized``).
        plain_model_context: passed on (the export's reload outside ``zero.Init``).
    """

    clip_returns_this_steps_norm = False  # Accelerate returns the engine's cached norm, computed in the previous step

    def __init__(
        self, accelerator: Accelerator, *, stage: int, size_from_model: Callable[[Any], Any], **hooks: Any
    ) -> None:
        super().__init__(accelerator, **hooks)
        self.stage = stage
        self._size_from_model = size_from_model

    def prepare(self, model: Any, optimizer: Any, train_loader: Any, eval_loader: Any) -> tuple[Any, Any, Any, Any]:
        """Size DeepSpeed's buckets and residency limits from the model (its JSON's ``"auto"`` values), then prepare
        as Accelerate does (which builds DeepSpeed's engine from that JSON); under ZeRO-3 the fp32 master then shares
        the working partition where DeepSpeed meant it to (:func:`alias_fp32_master`)."""
        self._size_from_model(model)
        prepared = super().prepare(model, optimizer, train_loader, eval_loader)
        if self.stage == 3:
            alias_fp32_master(self._inner_optimizer())
        return prepared

    def evaluation_context(self) -> contextlib.AbstractContextManager:
        """Under ZeRO-3, a forward-only pass (an evaluation, the export's logits) ends with DeepSpeed's engine
        releasing what its prefetcher gathered (``empty_partition_cache``, its public API): the prefetch follows the
        training trace, and a parameter it left in flight made the next ``GatheredParameters`` (a LoRA export's
        frozen weights, a user's gather) fail with "Cannot partition a param in flight" (DeepSpeed 0.19.8, seen once
        the prefetch bucket and persistence threshold were sized from the model, as the HF integration sizes them)."""
        if self.stage != 3:
            return super().evaluation_context()
        return self._released_after()

    @contextlib.contextmanager
    def gradients_released(self) -> Iterator[None]:
        """ZeRO-3 keeps its gradient partitions in one flat buffer between steps (``grad_partitions_flat_buffer``,
        ``4Ψ/N`` bytes), where the other runtimes free their gradients at ``zero_grad(set_to_none=True)``: inside,
        its storage is released (the views DeepSpeed keeps into it stay, pointing at no memory), and afterwards it is
        allocated again, zeroed (the next backward overwrites it: DeepSpeed copies at its first micro-step). The
        export's reload check then holds its whole model in that room (rank 0 of a 322M model on 2 ranks: 4.52 ->
        3.9 GB, ``benchmarks/memory_timeline.py``)."""
        buffer = getattr(self._inner_optimizer(), "grad_partitions_flat_buffer", None) if self.stage == 3 else None
        if buffer is None or buffer.device.type != "cpu":  # on a GPU the reload runs on the host: nothing to lend
            yield
            return
        storage = buffer.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)
        try:
            yield
        finally:
            storage.resize_(size)
            buffer.zero_()

    @contextlib.contextmanager
    def _released_after(self) -> Iterator[None]:
        try:
            yield
        finally:
            self._prepared_model.empty_partition_cache()

    # ----------------------------------------------------------------- save
    def snapshot(self) -> Snapshot:
        """This rank's boxes of the fp32 master weights, Adam's moments and steps, and the buffers: views of
        DeepSpeed's partitions (no collective; under ZeRO-1/2 without DeepSpeed's fragment mapping, one all-reduce
        per tensor)."""
        from hftrain.checkpoint.sharded import MODEL_PREFIX, OPTIM_PREFIX, Chunked, Snapshot, split_replicated

        model = self.unwrap_model(self._prepared_model)
        groups = _FlatGroups(self._inner_optimizer())
        state: dict[str, Chunked] = {}
        replicated = []  # whole on every rank: buffers and steps, each written by one rank
        for name, value in model.state_dict(keep_vars=True).items():
            if not _is_parameter(value):
                state[MODEL_PREFIX + name] = Chunked.whole(value.detach())
                replicated.append(MODEL_PREFIX + name)
                continue
            state[MODEL_PREFIX + name] = self._share(value, None, trained=value in groups)
            if value in groups:
                for key in groups.moment_keys():
                    state[f"{OPTIM_PREFIX}{name}.{key}"] = self._share(value, key, trained=True)
                step = groups.step(value)
                if step is not None:
                    state[f"{OPTIM_PREFIX}{name}.step"] = Chunked.whole(step)
                    replicated.append(f"{OPTIM_PREFIX}{name}.step")
        return Snapshot(
            state=split_replicated(state, replicated, self.accelerator.process_index, self.num_processes),
            param_groups=self._inner_optimizer().param_groups,
            info={"world_size": self.num_processes, "zero_stage": self.stage},
            model=model,
        )

    def _share(self, param: torch.nn.Parameter, key: str | None, *, trained: bool) -> Chunked:
        """This rank's boxes of ``param``'s fp32 master value (``key`` None) or optimizer state ``key``."""
        from hftrain.checkpoint.sharded import Chunked

        if self.stage == 3:
            start, count = _z3_range(param)
            if trained:
                local = _z3_get_local(param, key)
            else:  # frozen: no master copy, the partition itself
                local = param.ds_tensor.detach()
            return Chunked.flat_range(tuple(param.ds_shape), start, local[:count].float())
        fragment = _z12_fragment(param, key) if trained else None
        if fragment is not None:  # this rank's fragment, in place: no copy, no collective
            start, local = fragment
            return Chunked.flat_range(tuple(param.shape), start, local)
        if trained:
            full = _z12_get_full(param, key)  # collective
        else:  # frozen: every rank holds it whole
            full = param.detach()
        rows = _even_rows(param)
        if rows is None:
            return Chunked.whole(full.float().clone()) if _rank() == 0 else Chunked(tuple(full.shape))
        start, stop = rows
        return Chunked(tuple(full.shape), [((start,) + (0,) * (full.dim() - 1), full[start:stop].float().clone())])

    # ----------------------------------------------------------------- load
    def load_snapshot(self, directory: str) -> None:
        """Fill the live ZeRO partitions and optimizer state from a sharded checkpoint of any strategy and layout
        (collective: DCP's reads; see the class docstring for what each stage reads)."""
        from pathlib import Path

        from hftrain.checkpoint.sharded import DCP_DIR, OPTIM_PREFIX, stored_keys

        model = self.unwrap_model(self._prepared_model)
        groups = _FlatGroups(self._inner_optimizer())
        names = {n for n, v in model.state_dict(keep_vars=True).items() if _is_parameter(v)}
        # A fresh optimizer has no state until its first step: give it zeros of the saved keys to load into.
        stored = [key for key in stored_keys(Path(directory) / DCP_DIR) if key.startswith(OPTIM_PREFIX)]
        saved = {tuple(key[len(OPTIM_PREFIX) :].rsplit(".", 1)) for key in stored}
        keys = sorted({key for name, key in saved if name in names})
        groups.ensure_state([k for k in keys if k != "step"])
        if self.stage == 3:
            self._load_partitions(directory, model, groups)
        else:
            self._load_full_tensors(directory, model, groups)

    def _load_partitions(self, directory: str, model: torch.nn.Module, groups: _FlatGroups) -> None:
        """ZeRO-3: read this rank's flat range of every tensor, set it with the local setters."""
        import torch
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        from hftrain.checkpoint.sharded import MODEL_PREFIX, OPTIM_PREFIX, Chunked, read_snapshot

        state: dict[str, Chunked] = {}
        scratch: dict[tuple[str, str | None], torch.Tensor] = {}
        params: dict[str, torch.nn.Parameter] = {}
        steps: dict[str, torch.Tensor] = {}
        for name, value in model.state_dict(keep_vars=True).items():
            if not _is_parameter(value):
                state[MODEL_PREFIX + name] = Chunked.whole(value.detach())  # read in place
                continue
            params[name] = value
            start, count = _z3_range(value)
            keys = [None, *groups.moment_keys()] if value in groups else [None]
            for key in keys:
                buffer = torch.zeros(value.ds_tensor.numel(), dtype=torch.float32)  # padded like the partition
                scratch[name, key] = buffer
                label = MODEL_PREFIX + name if key is None else f"{OPTIM_PREFIX}{name}.{key}"
                state[label] = Chunked.flat_range(tuple(value.ds_shape), start, buffer[:count])
            if value in groups:
                steps[name] = torch.zeros((), dtype=torch.float32)
                state[f"{OPTIM_PREFIX}{name}.step"] = Chunked.whole(steps[name])
        read_snapshot(directory, state, self._inner_optimizer().param_groups)
        for (name, key), buffer in scratch.items():
            param = params[name]
            if param in groups:
                if key is None:
                    safe_set_local_fp32_param(param, buffer)
                else:
                    safe_set_local_optimizer_state(param, buffer, key)
            if key is None:  # the working (bf16 or fp32) partition the forward gathers from
                param.ds_tensor.data.copy_(buffer)
        groups.set_steps({params[name]: step for name, step in steps.items()})
        _regather(list(params.values()))

    def _load_full_tensors(self, directory: str, model: torch.nn.Module, groups: _FlatGroups) -> None:
        """ZeRO-1/2: read full tensors a bucket at a time, set them with the full setters."""
        import torch
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from hftrain.checkpoint.sharded import DCP_DIR, MODEL_PREFIX, OPTIM_PREFIX, Chunked, read, read_snapshot

        entries = []  # (state key, param or None, optimizer key or None, live tensor for buffers)
        for name, value in model.state_dict(keep_vars=True).items():
            if not _is_parameter(value):
                entries.append((MODEL_PREFIX + name, None, None, value.detach()))
                continue
            entries.append((MODEL_PREFIX + name, value, None, None))
            if value in groups:
                entries += [(f"{OPTIM_PREFIX}{name}.{key}", value, key, None) for key in groups.moment_keys()]
                entries.append((f"{OPTIM_PREFIX}{name}.step", value, "step", None))
        steps: dict[torch.nn.Parameter, torch.Tensor] = {}
        for index, bucket in enumerate(_buckets(entries)):
            state, full = {}, {}
            for label, param, key, live in bucket:
                if live is not None:
                    state[label] = Chunked.whole(live)  # a buffer, read in place
                    continue
                shape = () if key == "step" else tuple(param.shape)
                full[label] = torch.zeros(shape, dtype=torch.float32)
                state[label] = Chunked.whole(full[label])
            if index == 0:  # the first read also restores the groups' hyper-parameters
                read_snapshot(directory, state, self._inner_optimizer().param_groups)
            else:
                read(state, f"{directory}/{DCP_DIR}")
            for label, param, key, live in bucket:
                if live is not None:
                    continue
                value = full.pop(label)
                if key == "step":
                    steps[param] = value
                elif key is not None:
                    safe_set_full_optimizer_state(param, value, key)
                elif param in groups:
                    safe_set_full_fp32_param(param, value)
                    param.data.copy_(value)  # the working copy every ZeRO-1/2 rank holds whole
                else:
                    param.data.copy_(value)
        groups.set_steps(steps)

    # ----------------------------------------------------------------- export
    def get_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full state dict with the fp32 master weights (not the 16-bit working copy), gathered one tensor at a
        time (collective); the main process holds it, the others get an empty dict."""
        return {name: tensor for name, tensor in self.iter_full_state(model) if tensor is not None}

    def iter_full_state(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, full tensor)`` for every parameter (fp32 master values) and persistent buffer of the model, one
        at a time, in ``state_dict`` order (collective: every rank must consume it whole). The tensor is on the CPU
        of the main process and None elsewhere, so no rank holds more than one full tensor beyond its own state.

        Args:
            model: the prepared model (DeepSpeed's engine).
        """
        from deepspeed.utils import safe_get_full_fp32_param

        unwrapped = self.unwrap_model(model)
        groups = _FlatGroups(self._inner_optimizer())
        main = self.is_main_process
        for name, value in unwrapped.state_dict(keep_vars=True).items():
            if not _is_parameter(value):
                full = value.detach()
            elif value in groups:
                full = safe_get_full_fp32_param(value)  # collective
            elif self.stage == 3:  # frozen and partitioned: gather its working copy
                import deepspeed  # deepspeed.zero is an attribute, not an importable module, in 0.19

                with deepspeed.zero.GatheredParameters([value]):
                    full = value.detach().float().clone() if main else None
            else:
                full = value.detach().float()
            yield name, (full.detach().to("cpu", copy=True) if main and full is not None else None)


def _is_parameter(value: Any) -> bool:
    """Whether a ``state_dict(keep_vars=True)`` entry is a parameter (else a persistent buffer)."""
    import torch

    return isinstance(value, torch.nn.Parameter)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _even_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """This rank's rows ``[start, stop)`` of an even split of ``param``'s dim 0 (None for a scalar)."""
    if param.dim() == 0:
        return None
    per_rank = -(-param.shape[0] // _world())
    start = min(_rank() * per_rank, param.shape[0])
    return start, min(start + per_rank, param.shape[0])


def _z3_range(param: torch.nn.Parameter) -> tuple[int, int]:
    """ZeRO-3: the flat index of this rank's partition and how many of its elements are the parameter's (DeepSpeed
    pads the numel to a multiple of the partition count; ``partition_numel`` includes the padding)."""
    import torch.distributed as dist

    part = param.ds_tensor.ds_numel
    start = part * dist.get_rank(group=getattr(param, "ds_process_group", None))
    return start, max(0, min(part, param.ds_numel - start))


def _z3_get_local(param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    local = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
    return local.detach().flatten()


def _z12_fragment(param: torch.nn.Parameter, key: str | None) -> tuple[int, torch.Tensor] | None:
    """ZeRO-1/2: ``(flat start, view)`` of this rank's fragment of ``param``'s fp32 master value (``key`` None) or
    optimizer state ``key``, from DeepSpeed's per-parameter mapping (``param._hp_mapping``, what its own
    ``get_full_hp_param`` reads before its all-reduce); ``(0, empty)`` where the rank holds none of it; None where
    DeepSpeed has no such mapping (then the public, collective full accessor serves).

    The full accessor gave each rank a copy of its share of every tensor, held until the write was done: 12Ψ/N more
    at the last checkpoint of an fp32 run (+1.9 GB per rank for a 322M model on 2 ranks, issue 42)."""
    if not hasattr(param, "_hp_mapping"):
        return None
    import torch

    mapping = param._hp_mapping
    if mapping is None:
        return 0, torch.empty(0, dtype=torch.float32)
    local = mapping.get_hp_fragment(key).detach().flatten()
    return mapping.lp_fragment_address.start, local


def _z12_get_full(param: torch.nn.Parameter, key: str | None) -> torch.Tensor:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    full = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    return full.detach()


def _buckets(entries: list[tuple]) -> Iterator[list[tuple]]:
    """``entries`` in consecutive runs of at most :data:`LOAD_BUCKET_BYTES` of fp32 full tensors."""
    bucket: list[tuple] = []
    size = 0
    for entry in entries:
        param, key = entry[1], entry[2]
        nbytes = 4 if param is None or key == "step" else 4 * param.numel()
        if bucket and size + nbytes > LOAD_BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


def _regather(params: list[torch.nn.Parameter]) -> None:
    """ZeRO-3: refresh the full copies of parameters that are gathered now (the persistent small ones) from their
    just-loaded partitions, as DeepSpeed does after a step (collective)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    gathered = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
    if gathered:
        gathered[0].partition(param_list=gathered)
        gathered[0].all_gather(param_list=gathered)


def alias_fp32_master(zero_optimizer: Any) -> None:
    """ZeRO-3: make each sub group's fp32 master the working partition itself where both are fp32 on one device (fp32
    training; under optimizer offload where the parameters are offloaded too): ``4Ψ/N`` bytes per rank freed.

    DeepSpeed means to do this (``_create_fp32_partitions`` of 0.19.8: "we don't need another copy of the weights")
    but its test compares the partition's ``torch.device`` with the accelerator's device *name*, a ``str``, which is
    never equal in torch 2.13 (``torch.device("cpu") == "cpu"`` is False; ``"cuda:0"`` likewise), so it clones: a
    second copy of every parameter a rank holds (0.64 GB per rank for a 322M model on 2 ranks, measured). With the
    alias the optimizer updates the working partition in place, and the copy DeepSpeed makes back after each step
    (``_reassign_or_swap_out_partitioned_parameters``) copies a tensor onto itself, as in DeepSpeed's own aliased case.
    Under optimizer offload DeepSpeed clones the working partition into the host master unconditionally; where the
    parameters are offloaded too (fp32 on the host both), the clone is the same bytes again and DeepSpeed's CPU Adam
    steps the master in place, so it is aliased as well.

    Args:
        zero_optimizer: DeepSpeed's ZeRO-3 optimizer (its ``fp32_partitioned_groups_flat`` and
            ``fp16_partitioned_groups_flat``).
    """
    import torch

    masters = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None) or []
    working = getattr(zero_optimizer, "fp16_partitioned_groups_flat", None) or []
    for master, part in zip(masters, working, strict=False):
        if master is None or part is None or master.data_ptr() == part.data_ptr():
            continue
        if (master.dtype, master.device, master.shape) != (part.dtype, part.device, part.shape):
            continue  # bf16/fp16 training: the master is a different dtype, as it must be
        if not torch.equal(master, part):  # not a fresh clone: nothing to alias
            continue
        master.data = part.data


class _FlatGroups:
    """The inner optimizer's flat parameter groups of a ZeRO optimizer, and which model parameters each holds.

    Adam's ``step`` is per flat group (not reachable through DeepSpeed's per-parameter accessors); this is the one
    place that reads DeepSpeed's group bookkeeping: ``bit16_groups``/``single_partition_of_fp32_groups`` at stages
    1-2, ``fp16_groups``/``fp32_partitioned_groups_flat`` at stage 3.

    Args:
        zero_optimizer: DeepSpeed's ZeRO optimizer (the engine's ``optimizer``).
    """

    def __init__(self, zero_optimizer: Any) -> None:
        self.zero = zero_optimizer
        self.inner = zero_optimizer.optimizer
        if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # stage 3
            pairs = zip(zero_optimizer.fp32_partitioned_groups_flat, zero_optimizer.fp16_groups, strict=True)
        else:
            pairs = zip(zero_optimizer.single_partition_of_fp32_groups, zero_optimizer.bit16_groups, strict=True)
        self.groups = [(flat, list(params)) for flat, params in pairs]
        self._flat_of = {id(p): flat for flat, params in self.groups for p in params}
        self._link()

    def __contains__(self, param: Any) -> bool:
        return id(param) in self._flat_of

    def moment_keys(self) -> list[str]:
        """The optimizer's state tensors shaped like its parameters (Adam's ``exp_avg``, ``exp_avg_sq``)."""
        keys: set[str] = set()
        for flat, _ in self.groups:
            state = self.inner.state.get(flat, {})
            keys |= {k for k, v in state.items() if k != "step" and _is_tensor(v) and v.shape == flat.shape}
        return sorted(keys)

    def step(self, param: Any) -> torch.Tensor | None:
        """The step count of ``param``'s flat group as torch's AdamW holds it (a 0-dim float32 tensor)."""
        import torch

        step = self.inner.state.get(self._flat_of[id(param)], {}).get("step")
        return None if step is None else torch.tensor(float(step), dtype=torch.float32)

    def set_steps(self, steps: dict[Any, torch.Tensor]) -> None:
        """Set each flat group's step from its parameters' saved steps (equal within a group when saved by any
        strategy that steps every parameter at once; the largest is taken)."""
        for flat, params in self.groups:
            values = [float(steps[p]) for p in params if p in steps]
            if not values:
                continue
            state = self.inner.state[flat]
            if _is_tensor(state.get("step")):
                state["step"].fill_(max(values))
            else:
                state["step"] = int(max(values))

    def ensure_state(self, keys: list[str]) -> None:
        """Give flat groups without optimizer state (a fresh optimizer, before its first step) zero-valued ``keys``
        and step 0 as the optimizer would create them, and link ZeRO-1/2's per-parameter views to them."""
        import torch

        integer_steps = _is_cpu_adam(self.inner)
        created = False
        for index, (flat, _) in enumerate(self.groups):
            state = self.inner.state[flat]
            if state or not keys:
                continue
            created = True
            for key in keys:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            group = self.inner.param_groups[index] if index < len(self.inner.param_groups) else {}
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = (
                0 if integer_steps else torch.zeros((), dtype=torch.float32, device=flat.device if on_device else "cpu")
            )
        if created:
            self._link()

    def _link(self) -> None:
        """ZeRO-1/2: point each parameter's optimizer-state fragment at its flat group's state.

        DeepSpeed links them once, after stepping the first flat group only (``_optimizer_step`` of 0.19.8), so the
        parameters of every later group are left with no fragment and ``safe_get_full_optimizer_state`` raises for
        them; relinking (views only, no copy) is what DeepSpeed's own lazy initialisation does for every group.
        """
        if hasattr(self.zero, "fp32_partitioned_groups_flat"):
            return  # ZeRO-3 reads the flat groups' state directly
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        for flat, params in self.groups:
            if self.inner.state.get(flat):
                lazy_init_hp_params_optimizer_state(params, flat, self.inner.state)


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_cpu_adam(optimizer: Any) -> bool:
    """DeepSpeed's CPU Adam (optimizer offload) counts steps in a Python int."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return isinstance(optimizer, DeepSpeedCPUAdam)
