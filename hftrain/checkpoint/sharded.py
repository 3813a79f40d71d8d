"""The sharded checkpoint format: every rank writes what it owns, under logical HF names and full shapes.

Layout of a checkpoint's ``state/`` folder (the manager adds ``checkpoint.json`` with checksums beside it)::

    dcp/              a torch.distributed.checkpoint folder (``.metadata`` + ``__<rank>_0.distcp``), flat keys:
                        model.<name>        every parameter and persistent buffer of the unwrapped model
                                            (``model.state_dict()`` names), fp32 master values, full shape
                        optim.<name>.<key>  its optimizer state (Adam's exp_avg, exp_avg_sq, step)
    sharded.json      {"format": "hftrain-dcp-v1", "strategy", "layout"}: what wrote it
    optimizer.json    the optimizer's parameter groups: hyper-parameters (lr, betas...) and parameter names
    hf_model/         config.json (and adapter_config.json under LoRA): what ``hftrain convert`` needs
    ...               Accelerate's scheduler, sampler and per-rank RNG files

Every strategy describes its state as the *boxes* of each logical tensor that this rank holds
(:class:`Chunked`): DDP the whole tensor, FSDP2 its DTensor shard, FSDP1 its ShardedTensor shards, megatron its
tensor-parallel slices (trimmed of vocabulary padding; a replicated key/value head is the same box on several
ranks), ZeRO its partitions of the flattened parameter (a flat range is a few boxes). DCP's planner then removes
boxes written by several ranks (replicated tensors, spread over the ranks by size), checks that the boxes tile each
tensor exactly, and writes each rank's boxes into its own file; a load reads, on each rank, only the stored pieces
that overlap the boxes it holds. So a checkpoint of any strategy and process count loads under any other: the
keys and shapes are the model's, not the layout's.

Written around DCP rather than with its stock planners because those take only tensors, DTensors and
ShardedTensors: a vocabulary shard trimmed of its padding, packed query/key/value blocks and ZeRO's flat ranges are
none of these, and a ShardedTensor built per parameter costs a collective each. :class:`Chunked` plus the two
planner subclasses below (``create_local_plan``, ``lookup_object``/``lookup_tensor``, DCP's documented extension
points) carry any set of boxes; everything else (dedup, validation, storage, resharding reads) is DCP's.

Read back in one process (``hftrain convert``), a tensor is read whole by :func:`read_dcp_tensor`, its saved chunks'
bytes straight into the result.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import struct
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hftrain.checkpoint.reading import active_checkpoint, open_regular
from hftrain.errors import CheckpointError

FORMAT = "hftrain-dcp-v1"
DCP_DIR = "dcp"
INFO_FILE = "sharded.json"
from hftrain.checkpoint.safety import GROUPS_FILE  # noqa: E402 - one name for both

HF_DIR = "hf_model"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."

Box = tuple[tuple[int, ...], torch.Tensor]


@dataclass
class Chunked:
    """A logical tensor of ``size`` of which this rank holds ``boxes`` (possibly none).

    Args:
        size: the full (logical) shape.
        boxes: ``(offsets, tensor)`` pairs: ``tensor`` is the block of the full tensor starting at ``offsets``;
            on save it is read, on load written in place (views of live state load straight into it).
    """

    size: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.size = tuple(int(s) for s in self.size)
        self.boxes = [(tuple(int(o) for o in offsets), t) for offsets, t in self.boxes if t.numel() > 0]
        for offsets, tensor in self.boxes:
            if len(offsets) != len(self.size) or any(
                o < 0 or o + n > s for o, n, s in zip(offsets, tensor.shape, self.size, strict=True)
            ):
                raise ValueError(f"box at {offsets} of shape {tuple(tensor.shape)} lies outside {self.size}")

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Chunked:
        """All of ``tensor`` (a replicated tensor: DCP writes it once, on the least loaded rank)."""
        return cls(tuple(tensor.shape), [((0,) * tensor.dim(), tensor)])

    @classmethod
    def of(cls, value: Any) -> Chunked:
        """The boxes of a tensor, DTensor (FSDP2) or ShardedTensor (FSDP1) as this rank holds them."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(value, Chunked):
            return value
        if isinstance(value, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            return cls(tuple(value.shape), [(tuple(offsets), value.to_local())])
        if isinstance(value, ShardedTensor):
            return cls(tuple(value.size()), [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()])
        if isinstance(value, torch.Tensor):
            return cls.whole(value)
        raise TypeError(f"cannot checkpoint a {type(value).__name__} as a tensor")

    @classmethod
    def flat_range(cls, size: tuple[int, ...], start: int, flat: torch.Tensor) -> Chunked:
        """The elements ``start … start + flat.numel()`` of the row-major flattening of a tensor of ``size``.

        A contiguous range is cut into boxes: a partial row, whole rows, a partial row, recursively per
        dimension (at most ``2·dim - 1`` boxes), each a view of ``flat``. ZeRO holds its partitions this way.

        Args:
            size: the full shape.
            start: the flat index of ``flat[0]``.
            flat: this rank's contiguous elements (1-D).
        """
        return cls(size, list(_flat_boxes(tuple(size), start, flat)))

    @property
    def dtype(self) -> torch.dtype | None:
        return self.boxes[0][1].dtype if self.boxes else None

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.boxes]

    def box_at(self, offsets: Iterable[int]) -> torch.Tensor:
        wanted = tuple(offsets)
        for box_offsets, tensor in self.boxes:
            if box_offsets == wanted:
                return tensor
        raise KeyError(f"no box at {wanted}")

    def staged(self, staging: Staging) -> Chunked:
        """A copy in CPU memory that the training step does not change (a background save writes it).

        Args:
            staging: the save's staging block; each box is copied into its next slice.
        """
        boxes = []
        for offsets, tensor in self.boxes:
            # From a GPU: into page-locked memory, without blocking the host (Snapshot.staged records the event the
            # writer waits on); from the host: a plain copy.
            boxes.append((offsets, staging.take(tensor).copy_(tensor.detach(), non_blocking=tensor.is_cuda)))
        return Chunked(self.size, boxes)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.boxes)


def _flat_boxes(size: tuple[int, ...], start: int, flat: torch.Tensor) -> Iterable[Box]:
    """Boxes covering ``flat`` = elements ``[start, start + len)`` of a row-major tensor of ``size``."""
    if flat.numel() == 0:
        return
    if not size:  # a scalar
        yield (), flat.view(())
        return
    inner = math.prod(size[1:])
    end = start + flat.numel()
    first_row, last_row = start // inner, (end - 1) // inner
    if first_row == last_row or inner == 1 and len(size) == 1:
        if len(size) == 1:
            yield (start,), flat
            return
        # all inside one row: recurse into it
        for offsets, t in _flat_boxes(size[1:], start - first_row * inner, flat):
            yield (first_row, *offsets), t.unsqueeze(0)
        return
    position = 0
    if start % inner:  # the partial first row
        head = inner - start % inner
        yield from _flat_boxes(size, start, flat[:head])
        position, first_row = head, first_row + 1
    whole = (end - (start + position)) // inner
    if whole:
        yield (first_row, *(0,) * (len(size) - 1)), flat[position : position + whole * inner].view(whole, *size[1:])
        position += whole * inner
    if position < flat.numel():  # the partial last row
        yield from _flat_boxes(size, start + position, flat[position:])


def split_replicated(state: dict[str, Chunked], keys: list[str], index: int, count: int) -> dict[str, Chunked]:
    """Keep, of the ``keys`` that ``count`` ranks hold identically, the whole tensors this holder writes.

    The tensors are dealt out largest first to the holder with the fewest bytes so far, the same way on every
    holder (they hold the same keys and shapes), so each is written once and the bytes are spread evenly; the
    others keep no box of it. A whole tensor is written from the live memory (a slice of one would be copied
    first), and a background save stages only this holder's part.

    Args:
        state: this rank's boxes.
        keys: the keys held identically by the ``count`` holders.
        index: this rank's position among them.
        count: how many ranks hold them.
    """
    if count == 1:
        return state
    loads = [0] * count
    kept = dict(state)
    for key in sorted(keys, key=lambda k: (-state[k].nbytes, k)):
        holder = loads.index(min(loads))
        loads[holder] += max(state[key].nbytes, 1)
        if holder != index:
            kept[key] = Chunked(state[key].size, [])
    return kept


# ----------------------------------------------------------------- planners
def _write_items(key: str, value: Chunked) -> list[WriteItem]:
    return [
        WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape),
                properties=TensorProperties.create_from_tensor(tensor),
                size=torch.Size(value.size),
            ),
        )
        for offsets, tensor in value.boxes
    ]


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner over a flat ``{key: Chunked}`` state (dedup, validation and metadata stay DCP's)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = [item for key, value in self.state_dict.items() for item in _write_items(key, value)]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _own_storage(self.state_dict[index.fqn].box_at(index.offset))


def _own_storage(box: torch.Tensor) -> torch.Tensor:
    """``box`` as a tensor whose storage is exactly its own bytes, sharing its memory (a contiguous CPU view).

    DCP's writer clones a tensor that views a larger storage (torch saves whole storages), and keeps every clone
    until its file is written (``filesystem._write_files_from_queue`` collects them for its safetensors format): a
    live snapshot's boxes are views of DeepSpeed's flat partitions and of fused weights, so the last checkpoint of
    a ZeRO-3 run copied the rank's whole state once more (+0.94 GB for 1 GB of views, issue 42). The alias is
    written the same bytes as the clone, with no copy.
    """
    if box.device.type != "cpu" or not box.is_contiguous() or box.numel() == 0:
        return box
    if box.untyped_storage().nbytes() == box.nbytes:
        return box
    return torch.from_numpy(box.detach().reshape(-1).view(torch.uint8).numpy()).view(box.dtype).view(box.shape)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner reading, for each ``Chunked``, the stored pieces that overlap this rank's boxes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # Not the base's: it first maps every value through DCP's tensor initialisation, which empties a Chunked.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        stored = self.metadata.state_dict_metadata
        for key, value in self.state_dict.items():
            md = stored.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(
                    f"the checkpoint's state does not load into this run: it holds no tensor '{key}'; resume from "
                    "another checkpoint, or with the model and config that wrote it"
                )
            if tuple(md.size) != value.size:
                raise CheckpointError(
                    f"the checkpoint's state does not load into this run: '{key}' has shape {tuple(md.size)} there "
                    f"and {value.size} here; resume with the model and config that wrote it"
                )
            requests += create_read_items_for_chunk_list(key, md, value.chunks())
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].box_at(index.offset)


# ----------------------------------------------------------------- writing and reading
BYTES_PER_WRITER_THREAD = 64 * 2**20
"""A rank's state gets one writer thread (and one ``.distcp`` file) per this many bytes, up to ``threads``: a small
state is written by one thread into one file, as a file per thread buys nothing below a few tens of MiB."""


def default_write_threads() -> int:
    """The writer threads a rank uses at most by default: ``min(4, CPUs this process may run on)`` beside GPUs; 1 on
    a CPU-only host, where the training's own threads compute on those cores and more writers measured no faster
    (``benchmarks/checkpoint_memory.py --writer``: 1.10-1.71 × one thread's time on the 2-core machine)."""
    if not torch.cuda.is_available():
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus))


def write_threads(state: dict[str, Chunked], threads: int | None = None) -> int:
    """The writer threads for ``state``: ``threads`` where given; by default :func:`default_write_threads`, at most
    one per :data:`BYTES_PER_WRITER_THREAD` of this rank's boxes, at least one."""
    if threads is not None:
        return max(1, threads)
    nbytes = sum(value.nbytes for value in state.values())
    return max(1, min(default_write_threads(), -(-nbytes // BYTES_PER_WRITER_THREAD)))


def write(
    state: dict[str, Chunked], directory: str | Path, *, process_group: Any = None, threads: int | None = None
) -> None:
    """Write ``state`` into the DCP folder ``directory`` (collective over ``process_group``; every rank passes its
    own boxes of the same keys).

    Each rank writes with :func:`write_threads` threads, one file each (``__<rank>_<i>.distcp``, ``i`` < threads;
    DCP deals the boxes out by size, largest first, to the least-filled file); a failure in any of them is this
    rank's one error, as with one thread (:class:`_Writer`).

    Args:
        state: key -> this rank's boxes.
        directory: the ``state/dcp`` folder.
        process_group: the group whose ranks write together (None: the default group, or no group in one process).
        threads: the writer threads (None: :func:`write_threads`' default, by the state's size).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    single = _single_process(dist)
    writer = _Writer(str(directory), thread_count=write_threads(state, threads), sync_files=True)
    with _first_failure(f"writing '{directory}'", writing=Path(directory)), _without_zip_checksums():
        dcp.save(state, storage_writer=writer, planner=_SavePlanner(), process_group=process_group, no_dist=single)


class _Writer(FileSystemWriter):
    """DCP's file writer, whose extra threads' failures are raised, not printed and lost.

    ``FileSystemWriter._write_data`` runs ``thread_count − 1`` threads beside the calling one, each taking files from
    a queue (``_write_files_from_queue``); an exception in one of those threads goes to ``threading.excepthook``
    (a traceback on stderr) and its files' results are simply missing. Here every thread runs the same function
    inside a catch; after all have joined, the first failure is raised in the calling thread, where DCP reports it
    as this rank's (and :func:`_first_failure` turns it into one line).
    """

    def _write_data(self, planner: Any, file_queue: Any) -> Any:
        import queue
        import threading

        from torch.distributed.checkpoint.filesystem import _write_files_from_queue
        from torch.futures import Future

        results: queue.Queue = queue.Queue()
        failures: list[BaseException] = []

        def work() -> None:
            try:
                _write_files_from_queue(
                    create_stream=self.fs.create_stream, file_queue=file_queue, result_queue=results,
                    planner=planner, transforms=self.transforms, inflight_threshhold=self.per_thread_copy_ahead,
                    use_fsync=self.sync_files, thread_count=self.thread_count,
                    serialization_format=self.serialization_format,
                )  # fmt: skip
            except BaseException as error:  # noqa: BLE001 - re-raised below, in the calling thread
                failures.append(error)

        threads = [threading.Thread(target=work, name=f"hftrain-dcp-writer-{i}") for i in range(1, self.thread_count)]
        for thread in threads:
            thread.start()
        work()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        written = []
        while not results.empty():
            written += results.get_nowait()
        done: Future = Future()
        done.set_result(written)
        return done


@contextlib.contextmanager
def _without_zip_checksums() -> Iterator[None]:
    """``torch.save``'s CRC-32 of each record off while DCP writes (each tensor is a ``torch.save`` zip record).

    Every file of a checkpoint is checksummed in its ``checkpoint.json`` (``manager.file_checksum``), and verified
    before anything loads it (``manager.read_checkpoint``), so the records' CRC-32 checks nothing more; computed by
    miniz at ~1 GB/s, it was 0.25-0.4 s of the 0.77 s DCP write of the default job's 273 MB (MiniLM and its Adam
    state). ``torch.load`` reads records without one; Python's ``zipfile`` reader rejects them, so ``hftrain
    convert`` reads them at their offsets. The option is torch's, process-wide: a ``torch.save`` in another thread
    during the write writes no CRC-32 either, and is read back just the same.
    """
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


def read(state: dict[str, Chunked], directory: str | Path) -> None:
    """Fill this rank's boxes of ``state`` from the DCP folder ``directory`` (collective; no rank reads more than
    the stored pieces overlapping its boxes).

    Args:
        state: key -> this rank's boxes (written in place).
        directory: the ``state/dcp`` folder.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    single = _single_process(dist)
    reader = VerifiedReader(directory, dcp_metadata(directory))
    with _first_failure(f"reading '{directory}'"):
        dcp.load(state, storage_reader=reader, planner=_LoadPlanner(), no_dist=single)
    _check_optimizer_steps(state, directory)


class VerifiedReader(FileSystemReader):
    """DCP's file reader, handed the metadata hftrain built from verified bytes (:func:`dcp_metadata`) instead of
    unpickling ``.metadata`` again, opening each ``.distcp`` file through the resume's ``VerifiedCheckpoint`` (the
    very file whose checksum was verified, or at least no link and no FIFO), and refusing to read a byte entry.

    DCP's own ``read_metadata`` runs ``pickle.load`` on the path, a second read after hftrain's checks that a writer
    can race (issue 52); its ``read_data`` reads tensors with ``weights_only=True``, but gives a byte entry to the
    planner, whose ``load_bytes`` unpickles it without a restriction. hftrain's checkpoints hold tensors only (its
    planners ask for nothing else), so a request for a byte entry is a forged checkpoint's.

    Args:
        directory: the DCP folder.
        metadata: its metadata, from :func:`dcp_metadata`.
    """

    def __init__(self, directory: str | Path, metadata: Any) -> None:
        super().__init__(str(directory))
        self.metadata = metadata
        self.fs = _VerifiedFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType

        entry = next((item for item in plan.items if item.type == LoadItemType.BYTE_IO), None)
        if entry is not None:
            raise CheckpointError(
                f"'{self.path}' holds a pickled entry '{entry.storage_index.fqn}' where hftrain stores tensors only; "
                "it is damaged or forged: resume from another checkpoint"
            )
        sizes: dict[str, int] = {}
        for item in plan.items:  # every chunk inside its file: a truncated or forged one is named, not an EOFError
            info = self.storage_data[item.storage_index]
            if info.relative_path not in sizes:
                with open_verified(Path(self.path) / info.relative_path) as handle:
                    sizes[info.relative_path] = os.fstat(handle.fileno()).st_size
            try:
                check_extent(sizes[info.relative_path], info.offset, info.length)
            except ValueError as error:
                raise CheckpointError(
                    f"'{Path(self.path) / info.relative_path}' ({item.storage_index.fqn}): {error}; resume from "
                    "another checkpoint"
                ) from None
        return super().read_data(plan, planner)


class _VerifiedFileSystem(type(FileSystemReader(".").fs)):  # torch's private FileSystem class, by its instance
    """DCP's file system whose read streams are :func:`open_verified` files."""

    @contextlib.contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise ValueError(f"a verified checkpoint is read only, not opened with mode {mode!r}")
        with open_verified(Path(path)) as handle:
            yield handle


def open_verified(path: Path) -> Any:
    """A binary file object on a checkpoint file: through the resume's ``VerifiedCheckpoint`` (the very file whose
    checksum was verified), or outside a resume through one descriptor that follows no link and never waits on a
    FIFO (``reading.open_regular``).

    Args:
        path: the file.
    """
    verified = active_checkpoint()
    if verified is not None:
        return verified.open(path)
    return os.fdopen(open_regular(path.parent, path.name), "rb")


def read_verified(path: Path) -> bytes:
    """The bytes of a checkpoint file, read once: checked against its checksum when a resume's ``VerifiedCheckpoint``
    is active, through one descriptor that follows no link otherwise.

    Args:
        path: the file.
    """

    verified = active_checkpoint()
    if verified is not None:
        return verified.read(path)
    with open_verified(path) as handle:
        return handle.read()


def dcp_metadata(directory: str | Path) -> Any:
    """The metadata of the DCP folder ``directory``: its ``.metadata`` read once (its checksum checked on those
    bytes during a resume) and built from those bytes by the restricted unpickler (``checkpoint.safety``).

    Args:
        directory: the DCP folder.
    """
    from hftrain.checkpoint.safety import dcp_metadata_of

    path = Path(directory) / ".metadata"
    verified = active_checkpoint()
    if verified is not None:
        return dcp_metadata_of(verified.path, verified.name_of(path), verified.read(path))
    checkpoint = Path(directory).parent.parent
    if not os.path.lexists(path):
        raise CheckpointError(
            f"checkpoint '{checkpoint}' is incomplete: {path.relative_to(checkpoint)} is missing; resume from another "
            "checkpoint"
        )
    with open_verified(path) as handle:
        data = handle.read()
    return dcp_metadata_of(checkpoint, str(path.relative_to(checkpoint)), data)


def _check_optimizer_steps(state: dict[str, Chunked], directory: str | Path) -> None:
    """Adam's per-parameter ``step`` counts optimizer steps: one beyond the checkpoint's step is forged (it sets the
    bias correction of every later update)."""

    verified = active_checkpoint()
    if verified is None:
        return
    for key, value in state.items():
        if not (key.startswith(OPTIM_PREFIX) and key.endswith(".step")):
            continue
        for _, box in value.boxes:
            values = box.detach().float()
            if values.numel() and not bool(((values >= 0) & (values <= verified.step)).all()):
                raise CheckpointError(
                    f"checkpoint '{verified.path}': {DCP_DIR}/ holds {key} {values.max().item():g}, more optimizer "
                    f"steps than the checkpoint's {verified.step}; it is damaged or forged: resume from "
                    "another checkpoint"
                )


def _single_process(dist: Any) -> bool:
    """True without a process group (a 1-process job): DCP then saves and loads alone, as intended here.

    DCP warns at every such call that it is "assuming the intent is to save in a single process"; that is hftrain's
    intent and nothing a user could act on, so that one notice (matched by its text, nothing else) is filtered out.
    A filter added once for the process, not ``catch_warnings`` around the call: saves run in a background thread,
    and ``catch_warnings`` swaps the filters of every thread.
    """
    if dist.is_initialized():
        return False
    import warnings

    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to",
        category=UserWarning,
    )
    return True


@contextlib.contextmanager
def _first_failure(what: str, writing: Path | None = None) -> Iterator[None]:
    """DCP reports a failure as every rank's traceback in one exception; raise the first rank's cause instead, in
    one line (a disk-full ``OSError`` stays one, for the manager's message).

    A full disk does not always arrive as an ``OSError``: torch's zip writer, which DCP's file writer serialises
    items through, reports the short write as ``RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos``. A write that fails while its file system has less than 1 MiB left is therefore reported as the
    ``ENOSPC`` it is.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        failures = list(error.failures.values())  # per rank: (exception, traceback summary)
        cause = failures[0][0] if failures and isinstance(failures[0], tuple) else error
        if isinstance(cause, CheckpointError | OSError):
            raise cause from None
        if writing is not None and _nearly_full(writing):
            import errno
            import os

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(writing)) from None
        if not isinstance(cause, Exception):  # the CheckpointException itself: a BaseException, kept from the user
            cause = RuntimeError(str(cause).splitlines()[0])
        reason = " ".join(str(cause).split())[:200]
        if isinstance(cause, pickle.UnpicklingError):  # not torch's advice to load it with weights_only=False
            reason = "a tensor record holds something else: a pickle, or another file's bytes"
        raise CheckpointError(f"{what} failed, its files are damaged ({type(cause).__name__}: {reason})") from None


def _nearly_full(path: Path) -> bool:
    """Whether the file system holding ``path`` (or its nearest existing parent) has less than 1 MiB free."""
    import shutil

    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free < 2**20
    except OSError:
        return False


def stored_keys(directory: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of every tensor stored in the DCP folder ``directory`` (reads only its metadata)."""
    metadata = dcp_metadata(directory)
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def read_model_tensors(state_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of a checkpoint's ``state/`` folder, whole, by its model name (one process, the
    whole model in memory: for tests and small tools; ``hftrain convert`` streams instead).

    Args:
        state_dir: a checkpoint's ``state/`` folder.
    """
    directory = Path(state_dir) / DCP_DIR
    tensors = {
        key: torch.empty(shape, dtype=dtype)
        for key, (shape, dtype) in stored_keys(directory).items()
        if key.startswith(MODEL_PREFIX)
    }
    read({key: Chunked.whole(tensor) for key, tensor in tensors.items()}, directory)
    return {key.removeprefix(MODEL_PREFIX): tensor for key, tensor in tensors.items()}


# ----------------------------------------------------------------- reading one tensor whole, in one process
def stored_chunks(metadata: Any, prefix: str) -> dict[str, list[tuple[tuple[int, ...], Any]]]:
    """``(offsets, _StorageInfo)`` of each saved chunk of every key starting with ``prefix``, by the key without it
    (what :func:`read_dcp_tensor` reads).

    Args:
        metadata: a DCP folder's metadata (``FileSystemReader.read_metadata()``).
        prefix: the keys' prefix (``model.``).
    """
    chunks: dict[str, list[tuple[tuple[int, ...], Any]]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(prefix):
            chunks.setdefault(index.fqn[len(prefix) :], []).append((tuple(index.offset), info))
    return chunks


def read_dcp_tensor(
    dcp_dir: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype, chunks: list[tuple[tuple[int, ...], Any]]
) -> torch.Tensor:
    """One tensor of a DCP folder, its chunks' bytes read straight into the full-size result.

    ``dcp.load`` would do: its ``FileSystemReader`` ``torch.load``s each saved chunk into a new tensor and copies that
    into the destination, so a tensor costs twice its size at the peak. Each chunk is a ``torch.save`` archive at a
    known offset of a ``.distcp`` file; its tensor's shape, strides and dtype come from loading it on the meta device
    (``weights_only``: torch's restricted unpickler, no data read), and its one storage record (stored, not
    compressed) is read with ``readinto`` into the result's memory. A chunk that is not a plain contiguous record,
    or that DCP stored with transforms, goes through ``dcp.load`` instead.

    Args:
        dcp_dir: the DCP folder.
        key: the DCP key (``model.<name>``).
        shape: the full shape.
        dtype: its dtype.
        chunks: ``(offsets, _StorageInfo)`` of each saved chunk (from the metadata's ``storage_data``).
    """
    if any(info.transform_descriptors for _, info in chunks):  # compressed or otherwise transformed: DCP's reader
        return _dcp_load(dcp_dir, key, shape, dtype)
    result = torch.empty(shape, dtype=dtype)
    stored = sum(math.prod(info_shape) for info_shape in _chunk_shapes(dcp_dir, chunks))
    if stored != result.numel():  # DCP keeps each element once: the chunks must tile the tensor
        raise ValueError(f"its stored chunks hold {stored} of its {result.numel()} elements")
    for offsets, info in chunks:
        with open_verified(dcp_dir / info.relative_path) as handle:
            window = _Window(handle, info.offset, info.length)
            saved = torch.load(window, map_location="meta", weights_only=True)
            region = (
                result[tuple(slice(o, o + s) for o, s in zip(offsets, saved.shape, strict=True))] if offsets else result
            )
            record = _storage_record(window, saved)
            if record is None or saved.dtype != dtype or tuple(region.shape) != tuple(saved.shape):
                del result, region
                return _dcp_load(dcp_dir, key, shape, dtype)
            if region.is_contiguous():
                _read_exactly(handle, info.offset + record, region)
            else:  # a chunk split along an inner dimension (e.g. a row-parallel shard): via one chunk-sized buffer
                buffer = torch.empty(saved.shape, dtype=dtype)
                _read_exactly(handle, info.offset + record, buffer)
                region.copy_(buffer)
                del buffer
    return result


def _chunk_shapes(dcp_dir: Path, chunks: list[tuple[tuple[int, ...], Any]]) -> list[tuple[int, ...]]:
    """Each stored chunk's shape, from its archive loaded on the meta device (no data read)."""
    shapes = []
    for _, info in chunks:
        with open_verified(dcp_dir / info.relative_path) as handle:
            shapes.append(tuple(torch.load(_Window(handle, info.offset, info.length), map_location="meta",
                                           weights_only=True).shape))  # fmt: skip
    return shapes


def _dcp_load(dcp_dir: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    destination = {key: torch.empty(shape, dtype=dtype)}  # full size: DCP copies each chunk into it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's notice, once per tensor
        dcp.load(destination, storage_reader=VerifiedReader(dcp_dir, dcp_metadata(dcp_dir)), no_dist=True)
    return destination.pop(key)


def _storage_record(window: _Window, saved: torch.Tensor) -> int | None:
    """Offset in ``window`` of the bytes of ``saved``'s storage when they are exactly its values in order, else None.

    The records are read at their offsets, not through ``zipfile``'s reader: hftrain writes them without a CRC-32
    (:func:`_without_zip_checksums`; the checkpoint's own checksums cover the files), which that reader rejects.
    """
    import zipfile

    if sys.byteorder != "little" or not saved.is_contiguous() or saved.storage_offset() != 0:
        return None
    window.seek(0)
    with zipfile.ZipFile(window) as archive:
        records = [r for r in archive.infolist() if r.filename.split("/")[-2:-1] == ["data"]]
        order = [r for r in archive.infolist() if r.filename.endswith("/byteorder")]
    if any(r.compress_type != zipfile.ZIP_STORED for r in records + order):
        return None
    if order:
        start = _data_offset(window, order[0])
        window.seek(start or 0)
        if start is None or window.read(order[0].file_size).strip() != b"little":
            return None
    if len(records) != 1 or records[0].file_size != saved.numel() * saved.element_size():
        return None
    return _data_offset(window, records[0])


def _data_offset(window: _Window, record: Any) -> int | None:
    """Where a stored zip record's bytes start: after its local file header, whose name and extra-field lengths
    say how long it is (None: no local header there)."""
    window.seek(record.header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return record.header_offset + 30 + name_length + extra_length


def _read_exactly(handle: Any, offset: int, into: torch.Tensor) -> None:
    view = memoryview(into.view(-1).view(torch.uint8).numpy())
    handle.seek(offset)
    done = 0
    while done < len(view):
        count = handle.readinto(view[done:])
        if not count:
            raise CheckpointError(f"'{handle.name}' ends before the tensor it lists; the checkpoint is damaged")
        done += count


def check_extent(size: int, offset: Any, length: Any) -> None:
    """A chunk ``[offset, offset + length)`` that DCP's ``.metadata`` places in a file of ``size`` bytes must lie
    inside it: a forged or truncated checkpoint's would read past the end (an ``EOFError``, or a message about
    torch's internals, instead of what is wrong).

    Args:
        size: the file's size.
        offset: where the chunk starts.
        length: its length.
    """
    for value in (offset, length):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"its .metadata places a chunk at {offset!r}+{length!r}, not a byte range")
    if offset + length > size:
        raise ValueError(
            f"its .metadata places a chunk at bytes {offset} to {offset + length}, beyond the end of its "
            f"{size}-byte file (truncated, or the .metadata is forged)"
        )


class _Window(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + length)`` of an open file (one saved DCP chunk)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        super().__init__()
        check_extent(os.fstat(handle.fileno()).st_size, offset, length)
        self._handle, self._start, self._length, self._position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, min(self._length, base + position))
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self._length - self._position)
        if count <= 0:
            return 0
        self._handle.seek(self._start + self._position)
        read = self._handle.readinto(memoryview(buffer)[:count])
        self._position += read
        return read


def is_sharded(state_dir: str | Path) -> bool:
    """Whether ``state_dir`` holds a checkpoint in this format (older checkpoints hold the libraries' own): its
    ``sharded.json`` or its DCP folder (one without the other is a damaged checkpoint of this format, which
    :func:`read_info` names, not an old one)."""
    return (Path(state_dir) / INFO_FILE).is_file() or (Path(state_dir) / DCP_DIR).is_dir()


def check_sharded(state_dir: str | Path) -> None:
    """Refuse, in one line naming the checkpoint and the fix, a checkpoint written before this format: its
    ``state/`` holds the libraries' own per-strategy files (Accelerate's ``model.safetensors``/``optimizer.bin``,
    DeepSpeed's ``pytorch_model/``, megatron's full tensors with ``layout.json``), which this hftrain does not read.

    Args:
        state_dir: a checkpoint's ``state/`` folder.
    """
    state = Path(state_dir)
    if not is_sharded(state):
        raise CheckpointError(
            f"checkpoint '{state.parent}' is in the per-strategy format of an hftrain from before the sharded one "
            f"(its {state.name}/ holds neither {INFO_FILE} nor {DCP_DIR}/), which this hftrain does not read; export "
            "it with the hftrain version that wrote it (hftrain export) and fine-tune from the exported model"
        )


def read_info(state_dir: str | Path) -> dict[str, Any]:
    """``sharded.json``: the format, strategy and layout that wrote ``state_dir``."""
    path = Path(state_dir) / INFO_FILE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint '{path.parent.parent}': {path.parent.name}/{INFO_FILE} is missing beside its "
            f"{DCP_DIR}/ folder; it is damaged: resume from another checkpoint"
        )
    try:
        info = json.loads(read_verified(path))
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested deeper than Python's stack
        raise CheckpointError(f"'{path}' is damaged ({error}); resume from another checkpoint") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else None
        raise CheckpointError(
            f"'{path}' has format {found!r}, this hftrain reads {FORMAT}; resume it with the hftrain that wrote it"
        )
    return info


# The facts of sharded.json (``Snapshot.info``) that are names, not counts; every other one is a count (the world size,
# each axis's size of a megatron layout), at least 1 except the ZeRO stage (0 and up).
_INFO_TEXT = ("strategy", "format")
_INFO_LEAST = {"zero_stage": 0}


def check_info(state_dir: str | Path, topology: dict[str, Any]) -> None:
    """``sharded.json`` must describe the layout ``checkpoint.json``'s topology records: counts that are positive
    integers and agree with it (a forged layout would otherwise pass as a reshard, or fail deep in DCP).

    Args:
        state_dir: the checkpoint's ``state/`` folder.
        topology: ``checkpoint.json``'s topology (already checked by ``manager.read_checkpoint``).
    """
    path = Path(state_dir) / INFO_FILE
    info = read_info(state_dir)
    for key, value in info.items():
        if key in _INFO_TEXT:
            continue
        least = _INFO_LEAST.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise CheckpointError(
                f"'{path}' is damaged ({key} {value!r} is not an integer >= {least}); resume from another checkpoint"
            )
        if key in topology and value != topology[key]:
            raise CheckpointError(
                f"'{path}' is damaged: it records {key} {value}, checkpoint.json's topology {topology[key]}; resume "
                "from another checkpoint"
            )
    if "strategy" in info and info["strategy"] != topology.get("strategy"):
        raise CheckpointError(
            f"'{path}' is damaged: it records strategy {info['strategy']!r}, checkpoint.json's topology "
            f"{topology.get('strategy')!r}; resume from another checkpoint"
        )


# ----------------------------------------------------------------- a strategy's state at one step
class Staging:
    """The CPU memory of one background save's staged copies: one block of exactly the boxes' bytes (each box starts
    :data:`ALIGN`-byte aligned), held from the snapshot until its write is done, then released (:meth:`release`).

    Page-locked where a box is on a GPU (so the copies run without blocking the host), by registering this block
    with CUDA (``cudaHostRegister``, as torch's own DCP stager does): torch's pinned allocator would round every
    buffer up to a power of two (up to 2× the state) and keep it cached for the whole run after it is freed. On a
    CPU nothing is page-locked; the block goes back to the heap after the write, where the next allocation (the next
    save's block, or training's) reuses its warm pages.

    Args:
        state: the boxes to stage (their sizes and devices).
    """

    ALIGN = 64

    def __init__(self, state: dict[str, Chunked]) -> None:
        tensors = [t for value in state.values() for _, t in value.boxes]
        self.block: torch.Tensor | None = torch.empty(sum(map(self._slot, tensors)), dtype=torch.uint8)
        self.registered = False
        if any(t.is_cuda for t in tensors) and self.block.numel():
            code = int(torch.cuda.cudart().cudaHostRegister(self.block.data_ptr(), self.block.numel(), 0))
            if code != 0:
                raise CheckpointError(
                    f"could not page-lock {self.block.numel()} bytes of host memory for a background save (CUDA "
                    f"error {code}); raise the locked-memory limit (ulimit -l) or save in the foreground"
                )
            self.registered = True
        self._used = 0

    @classmethod
    def _slot(cls, tensor: torch.Tensor) -> int:
        return -(-tensor.numel() * tensor.element_size() // cls.ALIGN) * cls.ALIGN

    @property
    def nbytes(self) -> int:
        """Bytes held (0 once released)."""
        return 0 if self.block is None else self.block.numel()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """The next slice of the block as an empty CPU tensor of ``like``'s shape and dtype."""
        assert self.block is not None, "a released staging block"
        nbytes = like.numel() * like.element_size()
        piece = self.block[self._used : self._used + nbytes].view(like.dtype).view(like.shape)
        self._used += self._slot(like)
        return piece

    def release(self) -> None:
        """Unregister the block (CUDA) and drop it (idempotent); the boxes viewing it must be dropped too."""
        if self.block is not None and self.registered:
            code = int(torch.cuda.cudart().cudaHostUnregister(self.block.data_ptr()))
            if code != 0:
                raise CheckpointError(f"could not release a background save's page-locked memory (CUDA error {code})")
        self.block, self.registered = None, False


@dataclass
class Snapshot:
    """What a strategy hands the checkpoint manager at a save: this rank's boxes and the facts beside them.

    Args:
        state: key (``model.<name>``, ``optim.<name>.<key>``) -> this rank's boxes.
        param_groups: the optimizer's parameter groups (``params`` left out: groups are matched by position).
        info: the layout that wrote it, for ``sharded.json``.
        model: the unwrapped model (its config goes to ``hf_model/`` on the main process), or None.
    """

    state: dict[str, Chunked]
    param_groups: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    model: Any = None
    copied: Any = None
    """A CUDA event recorded after the staging copies from a GPU (None: nothing to wait for)."""
    staging: Staging | None = None
    """The memory of a staged copy's boxes (None: the boxes are the live states)."""

    def staged(self) -> Snapshot:
        """The same snapshot with every box copied to CPU memory, for a write while training goes on: one
        :class:`Staging` block of exactly its boxes' bytes, released by :meth:`release` once written.

        Copies from a GPU are non-blocking into page-locked memory, on the current stream, so they are ordered after
        the step that computed the states and before the next one's in-place updates; the writer thread waits for
        :attr:`copied` before it reads a byte (:meth:`wait_copied`).
        """
        staging = Staging(self.state)
        state = {key: value.staged(staging) for key, value in self.state.items()}
        copied = None
        if staging.registered:
            copied = torch.cuda.Event()
            copied.record()
        return Snapshot(state, self.param_groups, self.info, self.model, copied, staging)

    def release(self) -> None:
        """Drop a staged copy's boxes and release their memory (nothing for live states; idempotent)."""
        if self.staging is not None:
            self.state = {}
            self.staging.release()

    def wait_copied(self) -> None:
        """Block until the staging copies have landed (nothing to wait for on a CPU, or for live states)."""
        if self.copied is not None:
            self.copied.synchronize()

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's boxes (its own state; replicated boxes counted on every rank that holds them)."""
        return sum(value.nbytes for value in self.state.values())


def write_metadata(directory: str | Path, snapshot: Snapshot) -> None:
    """The main process's files beside the DCP folder: ``sharded.json``, ``optimizer.json``, ``hf_model/``.

    Args:
        directory: the checkpoint's ``state/`` folder.
        snapshot: the main process's snapshot.
    """
    directory = Path(directory)
    (directory / INFO_FILE).write_text(json.dumps({"format": FORMAT, **snapshot.info}, indent=1) + "\n")
    groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in snapshot.param_groups]
    groups = [{k: v for k, v in g.items() if v is not _SKIP} for g in groups]
    (directory / GROUPS_FILE).write_text(json.dumps({"param_groups": groups}, indent=1) + "\n")
    model = snapshot.model
    if model is not None:
        target = directory / HF_DIR
        target.mkdir(exist_ok=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(target)
        peft = getattr(model, "peft_config", None)
        if peft:
            next(iter(peft.values())).save_pretrained(target)


def read_snapshot(directory: str | Path, state: dict[str, Chunked], param_groups: list[dict[str, Any]]) -> None:
    """Fill ``state``'s boxes from a checkpoint's ``state/`` folder and set the optimizer's hyper-parameters.

    Args:
        directory: the ``state/`` folder.
        state: this rank's boxes of the live model and optimizer (written in place).
        param_groups: the live optimizer's parameter groups, once nothing else will replace them.
    """
    directory = Path(directory)
    read_info(directory)
    read(state, directory / DCP_DIR)
    try:
        saved = json.loads(read_verified(directory / GROUPS_FILE))["param_groups"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"'{directory / GROUPS_FILE}' is damaged ({error}); resume from another checkpoint"
        ) from None
    restore_param_groups(param_groups, saved, where=directory.parent)


# ----------------------------------------------------------------- the optimizer's parameter groups
_SKIP = object()


def _jsonable(value: Any) -> Any:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, tuple | list) and all(isinstance(v, int | float) for v in value):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return _SKIP  # library internals (DeepSpeed's flat-group bookkeeping): not hyper-parameters


# How the writer's optimizer ran, not hyper-parameters: another implementation (ZeRO offload's CPU Adam, a fused AdamW)
# keeps its own (a fused AdamW set to fused=False fails its next step).
_IMPLEMENTATION_FLAGS = {"fused", "foreach", "capturable", "differentiable"}


def restore_param_groups(param_groups: list[dict[str, Any]], saved: list[dict[str, Any]], *, where: Path) -> None:
    """Set each live group's hyper-parameters (lr, betas, weight decay...) to the saved group's, by position.

    The scheduler restores its own counters but sets the learning rate only at its next step, so without this the
    first step after a resume would run at the initial learning rate (pitfall "LR schedule resets after resume",
    docs/pitfalls.md).

    Args:
        param_groups: the live optimizer's ``param_groups``.
        saved: what :func:`write_metadata` wrote.
        where: the checkpoint, for the message.
    """
    if not isinstance(saved, list) or not all(isinstance(record, dict) for record in saved):
        raise CheckpointError(
            f"checkpoint '{where}': {GROUPS_FILE} is damaged (param_groups is not a list of records); resume from "
            "another checkpoint"
        )
    if len(saved) != len(param_groups):
        raise CheckpointError(
            f"checkpoint '{where}' has {len(saved)} optimizer parameter groups and this run {len(param_groups)}; "
            "resume with the same model, LoRA and weight-decay settings"
        )
    for index, (group, record) in enumerate(zip(param_groups, saved, strict=True)):
        # This run's training.learning_rate: the scheduler set each live group's initial_lr to it (a schedule never
        # goes above it), before any saved value replaces it.
        run_lr = _run_learning_rate(group)
        for key, value in record.items():
            if key not in group or key in _IMPLEMENTATION_FLAGS:
                continue
            live = group[key]
            problem = _hyperparameter_problem(key, value, live)
            if problem:
                raise CheckpointError(
                    f"checkpoint '{where}': {GROUPS_FILE} is damaged (param_groups[{index}].{key} {value!r} "
                    f"{problem}); resume from another checkpoint"
                )
            if key in ("lr", "initial_lr") and run_lr is not None and value > run_lr * (1 + _LR_ROUNDING):
                raise CheckpointError(
                    f"checkpoint '{where}': {GROUPS_FILE}'s param_groups[{index}].{key} {value!r} is above this "
                    f"run's training.learning_rate {run_lr!r} (no schedule goes above it): a forged value, or a "
                    "resume with a lower rate than the checkpoint's; resume with the learning rate it was trained "
                    "with, or from another checkpoint"
                )
            if isinstance(live, torch.Tensor):
                live.fill_(value)
            else:
                group[key] = tuple(value) if isinstance(live, tuple) else value


# Hyper-parameters with a range (the config's own checks: a learning rate, decay or epsilon is >= 0, Adam's betas lie
# in [0, 1)); every other one only keeps the live value's type.
_AT_LEAST_ZERO = {"lr", "initial_lr", "weight_decay", "eps"}


def _hyperparameter_problem(key: str, value: Any, live: Any) -> str | None:
    """What is wrong with a saved hyper-parameter for the live one it replaces (None: nothing)."""

    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

    if live is None:
        return None  # an option left unset (DeepSpeed's and torch's optional flags): nothing to compare with
    if isinstance(live, bool | str):
        return None if type(value) is type(live) else f"is not a {type(live).__name__}"
    if isinstance(live, tuple | list):
        if not isinstance(value, list) or len(value) != len(live) or not all(number(v) for v in value):
            return f"is not a list of {len(live)} numbers"
        if key == "betas" and not all(0 <= v < 1 for v in value):
            return "lies outside [0, 1)"
        return None
    if isinstance(live, int | float | torch.Tensor):
        if not number(value):
            return "is not a finite number"
        if key in _AT_LEAST_ZERO and value < 0:
            return "is negative"
        if key == "eps" and value < _MIN_EPS:
            return (
                f"is below {_MIN_EPS:.4g}, float32's smallest normal number (fused fp32 Adam flushes it to 0 and "
                "divides by it: an update would be NaN)"
            )
        if key in ("lr", "initial_lr") and value > _MAX_LR:
            return f"is above {_MAX_LR:g}, no fine-tuning rate (the first steps would make the loss NaN)"
    return None


# The largest learning rate a checkpoint may hold (checkpoint.safety.MAX_LR, the scheduler's bound too).
_MAX_LR = 10.0
# The smallest Adam epsilon a checkpoint may hold: below float32's smallest normal number, a fused fp32 Adam (and a
# flush-to-zero device) computes with 0, and an update whose second moment is 0 divides 0 by 0.
_MIN_EPS = torch.finfo(torch.float32).tiny
# A learning rate that went through a float32 tensor (DeepSpeed's groups) differs from the config's by its rounding.
_LR_ROUNDING = 1e-6


def _run_learning_rate(group: dict[str, Any]) -> float | None:
    """The live group's ``initial_lr`` (this run's ``training.learning_rate``, which the scheduler wrote there), or
    None where no scheduler set one (only ``_MAX_LR`` bounds a saved rate then)."""
    value = group.get("initial_lr")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None
