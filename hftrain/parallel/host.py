"""Host-side agreement: flags, counts, shapes and small objects exchanged over a gloo group of their own.

Ranks often need to agree on facts that live on the host, not on the device: "did any rank fail to write", "how
many markers do you see", "what shape is the next batch", "here is a small Python object". Under NCCL the default
group (and every group built like it) has no CPU backend: a CPU tensor in one of its collectives raises
``RuntimeError: No backend type associated with device type cpu`` (reproduced on CPU by a ``cuda:gloo`` group,
which has no CPU backend either). Moving the fact to the GPU instead costs a host-device copy and a sync per
agreement. So, as Megatron-core (``get_data_parallel_group_gloo``) and torchtitan keep a gloo group beside their
NCCL ones, every host-side agreement in hftrain goes through this module, over the *host twin* of its group:

- the group itself when it already has a CPU backend (gloo on CPU, ``cpu:gloo,cuda:nccl``);
- otherwise a gloo group over the same ranks, made once per group, by its members only
  (``new_group(..., use_local_synchronization=True)``: a group's twin is named by its ranks, so the members need
  not create twins in the same order as other groups' members).

Device tensors (gradients, activations, losses) never come here: they stay on the device group. (Pitfall "CPU
tensor in an NCCL collective", docs/pitfalls.md.)

=====================  =======================================  ==========================================
function               collective (host twin of ``group``)      used where
=====================  =======================================  ==========================================
``any_rank``           all-reduce (max) of one flag             every "did any rank fail / get a signal"
``all_sum``            all-reduce (sum) of a few numbers        markers every rank sees
``all_max``            all-reduce (max) of a few numbers        checksums of replicated weights
``broadcast_ints``     broadcast of a few integers              the pipeline's batch shape
``broadcast_object``   broadcast of a small pickled object      the shared-storage check's token
``barrier``            barrier                                  the shared-storage check
``gather_bytes``       all-gather of equal-length byte rows     RNG streams into the checkpoint
``once_per_machine``   all-reduce (max) of one number per rank  which rank prints an error all ranks met
``send_object``        send/recv of a pickled object            ZBV evaluation, the export of later stages
=====================  =======================================  ==========================================
"""

from __future__ import annotations

import pickle
import threading
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=60)
"""How long a collective waits for its peers before the job fails, for the host twins here and the device groups
(``strategies.platform``). Work that one rank does while the others wait at the next agreement (the main process
verifying every checksum of a large checkpoint before a resume, writing and reloading the export) can outlast
NCCL's default 10 minutes (gloo's 30) on a big model; a hang still ends the job, after an hour."""

_GROUP_OPTIONS = {"gloo": "ProcessGroupGloo._Options", "nccl": "ProcessGroupNCCL.Options"}
"""Each single backend's options class in ``torch.distributed``: what carries a timeout into a ``DeviceMesh``'s
groups."""


def mesh_group_options(axes: tuple[str, ...]) -> dict[str, tuple[str, Any]] | None:
    """``init_device_mesh``'s ``backend_override`` that gives every axis's group :data:`COLLECTIVE_TIMEOUT`: the
    default group's backend with its options (``_timeout``). A mesh's groups are made by ``new_group`` or
    ``split_group``, which take torch's default timeout (NCCL's 10 minutes, gloo's 30), not the default group's.
    None where the default group's backend is not one of :data:`_GROUP_OPTIONS` (a mixed ``cpu:gloo,cuda:nccl``
    group): there each axis keeps torch's default.

    Args:
        axes: the mesh's dimension names.
    """
    backend = str(dist.get_backend())
    if backend not in _GROUP_OPTIONS:
        return None
    owner, _, name = _GROUP_OPTIONS[backend].partition(".")
    options_class = getattr(getattr(dist, owner, None), name, None)
    if options_class is None:  # a torch built without that backend
        return None
    override = {}
    for axis in axes:
        options = options_class()
        options._timeout = COLLECTIVE_TIMEOUT
        override[axis] = (backend, options)
    return override


def group_timeout(group: Any, device: str = "cpu") -> timedelta:
    """How long ``group``'s collectives on ``device`` wait for their peers (its backend's options)."""
    return group._get_backend(torch.device(device)).options._timeout


_TWINS: dict[Any, Any] = {}  # group -> its host twin (the group itself when it has a CPU backend)
_LOCK = threading.Lock()  # the checkpoint writer thread agrees too


def host_group(group: Any = None) -> Any:
    """The group to exchange CPU tensors over for ``group`` (None: the default group); None out of a process group.

    Collective over the members of ``group`` the first time a group without a CPU backend asks (every member must
    then ask; hftrain's agreements are all called by every member).

    Args:
        group: a process group, or None for the default group.
    """
    if not dist.is_initialized():
        return None
    pg = dist.group.WORLD if group is None else group
    with _LOCK:
        if pg not in _TWINS:
            if has_cpu_backend(pg):
                _TWINS[pg] = group
            else:
                ranks = dist.get_process_group_ranks(pg)
                _TWINS[pg] = dist.new_group(
                    ranks=ranks, backend="gloo", timeout=COLLECTIVE_TIMEOUT, use_local_synchronization=True
                )
        return _TWINS[pg]


def has_cpu_backend(group: Any = None) -> bool:
    """Whether ``group`` (None: the default group) takes CPU tensors itself."""
    pg = dist.group.WORLD if group is None else group
    return "cpu:" in dist.get_backend_config(pg)


def _size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def any_rank(flag: bool, group: Any = None) -> bool:
    """True on every member when ``flag`` is true on any (free in one process).

    Args:
        flag: this rank's condition.
        group: the ranks that agree (None: all).
    """
    return all_max([float(flag)], group)[0] > 0


def once_per_machine(line: str | None, *, local_rank: int) -> bool:
    """Whether this rank prints ``line``, an error that the ranks met at one point (None where this rank did not
    fail): once per machine for each distinct line. The machine's first process (local rank 0) prints its own line;
    another prints only a line its machine's first process does not (a file only it reads), so ranks that failed
    alike say it once, as the CLI says a bad input (``hftrain.launch.supervise.reports_errors``).

    Collective over all ranks: every rank calls it, failed or not. Ranks are numbered machine by machine, as the
    launchers number them: a machine's first process is ``rank - local_rank``.

    Args:
        line: this rank's error line, or None.
        local_rank: this rank's index on its machine (the launcher's ``LOCAL_RANK``).
    """
    world = _size(None)
    rank = dist.get_rank() if world > 1 else 0
    codes = [0.0] * world  # each rank's line as a number (CRC-32 + 1, exact in float64), 0: no error
    if line is not None:
        codes[rank] = float(zlib.crc32(line.encode()) + 1)
    codes = all_max(codes)  # an all-gather: every other rank adds 0 at this rank's place
    return line is not None and (local_rank == 0 or codes[rank - local_rank] != codes[rank])


def all_sum(values: list[float], group: Any = None) -> list[float]:
    """The element-wise sum of ``values`` over the members (the same list length on every member), in float64
    (integers exact up to 2**53).

    Args:
        values: this rank's numbers.
        group: the ranks that sum (None: all).
    """
    return _all_reduce(values, group, dist.ReduceOp.SUM)


def all_max(values: list[float], group: Any = None) -> list[float]:
    """The element-wise maximum of ``values`` over the members (``max(x), max(-x)`` gives a range in one call).

    Args:
        values: this rank's numbers.
        group: the ranks that compare (None: all).
    """
    return _all_reduce(values, group, dist.ReduceOp.MAX)


def _all_reduce(values: list[float], group: Any, op: Any) -> list[float]:
    if _size(group) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=host_group(group))
    return tensor.tolist()


def broadcast_ints(values: list[int] | None, count: int, *, group: Any = None, group_src: int = 0) -> list[int]:
    """``count`` integers from the member of group rank ``group_src`` (its ``values``) to every member.

    Args:
        values: the integers, on the source (ignored elsewhere).
        count: how many.
        group: the ranks that take part (None: all).
        group_src: the source's rank within ``group``.
    """
    tensor = torch.tensor(values, dtype=torch.int64) if values is not None else torch.zeros(count, dtype=torch.int64)
    if _size(group) > 1:
        dist.broadcast(tensor, group=host_group(group), group_src=group_src)
    return [int(x) for x in tensor.tolist()]


def broadcast_object(obj: Any, *, group: Any = None, group_src: int = 0) -> Any:
    """A picklable host object from member ``group_src`` (its ``obj``) to every member.

    Args:
        obj: the object, on the source (ignored elsewhere).
        group: the ranks that take part (None: all).
        group_src: the source's rank within ``group``.
    """
    if _size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=host_group(group), group_src=group_src)
    return box[0]


def barrier(group: Any = None) -> None:
    """Wait until every member arrives (over the host group: no device work is waited for)."""
    if _size(group) > 1:
        dist.barrier(group=host_group(group))


def gather_bytes(row: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every member's ``row`` (1-D uint8 on the host, the same length everywhere), in group-rank order.

    Args:
        row: this rank's bytes.
        group: the ranks that gather (None: all).
    """
    row = row.cpu()
    if _size(group) == 1:
        return [row]
    gathered = [torch.empty_like(row) for _ in range(_size(group))]
    dist.all_gather(gathered, row, group=host_group(group))
    return gathered


def send_object(obj: Any, *, group: Any, group_dst: int) -> None:
    """Send a picklable object to the member ``group_dst`` of ``group`` (its tensors on the host: pickling a CUDA
    tensor would carry its device, and the receiver would have to hold that GPU)."""
    data = torch.frombuffer(bytearray(pickle.dumps(_to_host(obj))), dtype=torch.uint8)
    twin = host_group(group)
    dst = dist.get_global_rank(group, group_dst)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst, group=twin)
    dist.send(data, dst=dst, group=twin)


def recv_object(*, group: Any, group_src: int, device: torch.device | str | None = None) -> Any:
    """The object :func:`send_object` sent from member ``group_src``, its tensors moved to ``device``.

    Pickles come only from this job's own ranks over its own group (never from a file).
    """
    twin = host_group(group)
    src = dist.get_global_rank(group, group_src)
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=twin)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=src, group=twin)
    obj = pickle.loads(data.numpy().tobytes())  # noqa: S301 - sent by a rank of this job (see the docstring)
    return _to_device(obj, device) if device is not None else obj


def _to_host(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, tuple | list):
        return type(obj)(_to_host(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    return obj


def _to_device(obj: Any, device: torch.device | str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple | list):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
