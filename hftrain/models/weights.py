"""A model folder's safetensors weights read tensor by tensor with ``pread``: no memory map, no whole file.

Why not ``safetensors.safe_open`` or ``from_pretrained``: both map the file. Every page of the map that a copy
touches stays in the process's resident set until the whole map is closed, so a rank that copies its blocks out of
the map one at a time still peaks at the whole file (a 1.29 GB, 322M-parameter checkpoint adds 1.29 GB to each
rank's ``VmHWM``, the ``RssFile`` share). ``pread`` into the destination tensor reads each byte once into memory the
process keeps anyway, and the page cache it goes through is the kernel's to drop.

The format (safetensors' own specification): an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
mapping each tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (byte offsets after the header),
then the data, each tensor C-contiguous and little-endian. A folder holds ``model.safetensors``, or shards listed by
``model.safetensors.index.json``'s ``weight_map``.

Names: a model's parameter is found under its own name or without the model's ``base_model_prefix`` (a checkpoint
of the base model: BERT's ``bert.``, GPT-2's ``transformer.``), as ``from_pretrained`` matches them. A name that is
found under neither, or whose shape differs (a checkpoint transformers converts on load: fused experts, renamed
keys), is not in :meth:`Weights.find`'s answer, so a caller leaves its module to ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
READ_PIECE = 1 << 26
"""Bytes read per ``pread`` into a staging tensor when the destination cannot take the file's bytes as they are
(another dtype, a device other than the host): 64 MiB of host memory at a time, whatever the tensor's size."""


def _dtypes() -> dict[str, torch.dtype]:
    import torch

    names = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool,
    }  # fmt: skip
    for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
        if hasattr(torch, attr):
            names[name] = getattr(torch, attr)
    return names


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's first element in ``file``."""

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


class Weights:
    """The safetensors tensors of one model folder (headers only until :meth:`read_into`).

    Args:
        folder: the model folder.
        prefix: the model's ``base_model_prefix`` (``"model"``, ``"bert"``...); "" for none.
    """

    def __init__(self, folder: str | Path, prefix: str = "") -> None:
        self.folder = Path(folder)
        self.prefix = f"{prefix}." if prefix else ""
        self.entries: dict[str, Entry] = {}
        index = self.folder / INDEX
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else [SINGLE]
            if (self.folder / SINGLE).is_file()
            else []
        )
        dtypes = _dtypes()
        for name in files:
            path = self.folder / name
            with path.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            for key, info in header.items():
                if key == "__metadata__" or info["dtype"] not in dtypes:
                    continue
                begin, _ = info["data_offsets"]
                self.entries[key] = Entry(path, dtypes[info["dtype"]], tuple(info["shape"]), 8 + length + begin)

    @classmethod
    def of(cls, folder: str | Path, prefix: str = "") -> Weights | None:
        """The folder's weights, or None where they are not safetensors (a ``pytorch_model.bin``: pickled, only
        ``from_pretrained`` reads it)."""
        folder = Path(folder)
        if not ((folder / INDEX).is_file() or (folder / SINGLE).is_file()):
            return None
        return cls(folder, prefix)

    def find(self, name: str, shape: tuple[int, ...]) -> Entry | None:
        """The entry of the model's tensor ``name`` (its own name, or without the base-model prefix), or None when
        the checkpoint has no tensor of that name and shape."""
        for key in (name, name.removeprefix(self.prefix) if self.prefix else None):
            entry = self.entries.get(key) if key else None
            if entry is not None and entry.shape == tuple(shape) and entry.dtype.is_floating_point:
                return entry
        return None

    def read_into(self, entry: Entry, out: torch.Tensor) -> None:
        """Read ``entry``'s whole tensor into ``out`` (its shape; any dtype, cast as ``Tensor.copy_`` casts, which is
        how ``from_pretrained`` loads a checkpoint into a model of another dtype)."""
        import torch

        if out.numel() != entry.numel:
            raise ValueError(f"{entry.file.name}: {entry.numel} elements for a tensor of {out.numel()}")
        direct = out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous()
        with entry.file.open("rb", buffering=0) as handle:
            fd = handle.fileno()
            if direct:
                _pread_all(fd, _bytes_of(out), entry.offset, entry.file)
                return
            flat, itemsize = out.reshape(-1), torch.empty((), dtype=entry.dtype).element_size()
            step = max(1, READ_PIECE // itemsize)
            stage = torch.empty(min(step, entry.numel), dtype=entry.dtype)
            for start in range(0, entry.numel, step):
                count = min(step, entry.numel - start)
                piece = stage[:count]
                _pread_all(fd, _bytes_of(piece), entry.offset + start * itemsize, entry.file)
                flat[start : start + count].copy_(piece)
            if flat.data_ptr() != out.data_ptr():  # reshape copied (a non-contiguous destination)
                out.copy_(flat.view(out.shape))


def _bytes_of(tensor: torch.Tensor) -> object:
    """A writable byte buffer over a contiguous host tensor's memory. Not ``Tensor.numpy()``: that marks the storage
    as not resizable for numpy's sake, and a storage that is not resizable is how ``DDPRuntime`` tells a memory map
    of the file from the process's own memory."""
    import ctypes

    return (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())


def _pread_all(fd: int, buffer: object, offset: int, path: Path) -> None:
    """Fill ``buffer`` (a writable byte array) from ``fd`` at ``offset``; a short file raises ``OSError`` naming it."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"{path}: ends before its header says (truncated?)")
        done += got


class BlockLoading(Protocol):
    """A strategy's way to hold the blocks a rank leaves out of ``from_pretrained`` (``hftrain.strategies.loading``)."""

    name: ClassVar[str]
    supports_lora: ClassVar[bool]
    """Whether LoRA adapters may be added after :meth:`materialize` (a layout fixed at materialization cannot take
    parameters added later)."""

    def materialize(self, model: torch.nn.Module, blocks: list[str], weights: Weights) -> None:
        """Give the blocks at ``blocks`` (on ``meta``) their weights, in this strategy's layout."""

    def describe(self, count: int) -> str:
        """One line for the log: how ``count`` blocks were loaded."""


def say_loaded_whole(why: str, *, stages_only: bool = False) -> None:
    """The ``model:`` startup line of a rank that loads without its strategy's blockwise loading, and why."""
    from hftrain.log import log_main

    whole = "its pipeline stages' part of the model" if stages_only else "the whole model"
    log_main(f"model: every rank loads {whole} ({why}; peak memory: {whole} per rank)")


def blocks_in(model: torch.nn.Module, weights: Weights) -> list[str]:
    """The dotted paths of ``model``'s transformer blocks (its ``_no_split_modules`` classes, outermost) whose every
    parameter is in ``weights`` under its name and shape, and which hold no buffer (a buffer a block computes when it
    is built, as a causal mask or rotary frequencies, is not in the checkpoint: only ``from_pretrained`` makes it).

    These are what a rank can leave out of ``from_pretrained`` and read itself: together they are nearly all of a
    model's weights (the embeddings, final norm and head are the rest).
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    chosen: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ not in classes or any(name.startswith(f"{c}.") for c in chosen):
            continue
        if next(module.buffers(), None) is not None:
            continue
        params = list(module.named_parameters())
        if params and all(weights.find(f"{name}.{p}", tuple(t.shape)) is not None for p, t in params):
            chosen.append(name)
    return chosen


def logical_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as the model defines it, also for a ZeRO-3 parameter (whose own ``shape`` is that of an
    empty placeholder; DeepSpeed keeps the real one in ``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))
