"""Write safetensors files from tensors that arrive one at a time, holding at most one tensor.

``safetensors.torch.save_file`` (and ``save_pretrained`` on top of it) takes the whole state dict: to export a model
that only exists as shards on disk or on other ranks, a caller would first have to assemble every tensor in one
process. This writer is hand-written because the format makes that unnecessary: a safetensors file is an 8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range (``data_offsets``,
relative to the end of the header) plus ``"__metadata__": {"format": "pt"}``, then the raw bytes. The names, shapes and
dtypes are known before any value (from a checkpoint's metadata, or a model built on the meta device), so the headers
are written first and each tensor's bytes go to their place as the tensor arrives; then it is dropped.

The folder has transformers' layout: ``model.safetensors`` when everything fits in ``max_shard_size``, else
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``weight_map``, ``total_size``), the
shards filled greedily in the given order as ``huggingface_hub.split_torch_state_dict_into_shards`` does.
``verify_written`` reads the files back through ``safetensors.safe_open``, one tensor at a time.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from hftrain.errors import ConfigError, HFTrainError
from hftrain.files import open_regular, write_file

# safetensors' dtype names (the Rust crate's Dtype enum) for the torch dtypes a model holds.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default
BLOCK_BYTES = 16 << 20  # a tensor is cast, written and read back in blocks of about this size
INDEX_SUFFIX = ".safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file to write: its name, full shape and the dtype it is saved in.

    Args:
        name: the key in the file.
        shape: the full (logical) shape.
        dtype: the saved dtype (the value given to ``write`` is cast to it).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the file."""
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def saved_dtype(dtype: torch.dtype, export_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is saved in: floating-point tensors in ``export_dtype``, others (integer buffers) as they are.

    Args:
        dtype: the tensor's dtype in the checkpoint.
        export_dtype: the chosen dtype for floating-point tensors.
    """
    return export_dtype if dtype.is_floating_point else dtype


def parse_shard_size(value: int | str, *, field: str = "max_shard_size") -> int:
    """Bytes per shard from an int or a string like transformers' (``"5GB"`` = 5·10⁹, ``"5GiB"`` = 5·2³⁰).

    Args:
        value: the size.
        field: the option that gave it, for the message.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ConfigError(f"{field} '{value}' is not a size; write e.g. 5GB, 500MB or 2GiB")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise ConfigError(f"{field} '{value}' is not a positive size; write e.g. 5GB")
    return size


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Split ``specs`` in order into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own).

    Args:
        specs: the tensors, in the order they are written.
        max_shard_size: bytes per shard.
    """
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > max_shard_size:  # alone, as huggingface_hub does
            shards.append([spec])
            continue
        if current and size + spec.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(prefix: str, count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000n.safetensors``... (transformers' names)."""
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class StreamedSafetensorsWriter:
    """Writes one safetensors file per shard, the headers first, each tensor's bytes when ``write`` receives it.

    Tensors may arrive in any order (each one's place is fixed by the header); ``close`` refuses to finish while a
    declared tensor was never written (its bytes would be zeros) and writes the index of a sharded folder.

    Args:
        directory: the folder to write into (created).
        specs: every tensor of the files, in file order.
        max_shard_size: bytes per file (int, or a string like ``"5GB"``).
        prefix: the file name stem: ``model`` (transformers) or ``adapter_model`` (PEFT, never sharded).
        metadata: extra ``__metadata__`` strings besides ``format: pt``.
    """

    def __init__(
        self,
        directory: str | Path,
        specs: list[TensorSpec],
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        prefix: str = "model",
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in {prefix}: {sorted({n for n in names if names.count(n) > 1})}")
        unsupported = [spec for spec in specs if spec.dtype not in SAFETENSORS_DTYPES]
        if unsupported:
            raise ValueError(f"safetensors cannot hold {unsupported[0].name} of dtype {unsupported[0].dtype}")
        self.prefix = prefix
        shards = plan_shards(specs, parse_shard_size(max_shard_size))
        self.files = shard_file_names(prefix, len(shards))
        # name -> (file index, absolute byte offset of its data, spec)
        self._where: dict[str, tuple[int, int, TensorSpec]] = {}
        for index, (shard, file) in enumerate(zip(shards, self.files, strict=True)):
            header_size = self._write_header(self.directory / file, shard, {"format": "pt", **(metadata or {})})
            offset = 8 + header_size
            for spec in shard:
                self._where[spec.name] = (index, offset, spec)
                offset += spec.nbytes
        self._written: set[str] = set()
        self._open_index: int | None = None
        self._handle = None

    @staticmethod
    def _write_header(path: Path, shard: list[TensorSpec], metadata: dict[str, str]) -> int:
        """Write the header and size the file to its full length; return the header's byte count."""
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for spec in shard:
            header[spec.name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors itself writes
        # not through a link, nor into a FIFO or a hard link (``files.open_regular``)
        with open_regular(path, "a safetensors file being written") as handle:
            handle.write(struct.pack("<Q", len(encoded)))
            handle.write(encoded)
            handle.truncate(8 + len(encoded) + offset)  # sparse until written; close() checks nothing is left out
        return len(encoded)

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a declared tensor."""
        return name in self._where

    def write(self, name: str, tensor: torch.Tensor, *, verify: bool = False) -> None:
        """Cast ``tensor`` to its declared dtype and write its bytes in place; the writer keeps no reference.

        Args:
            name: a declared tensor name, written once.
            tensor: its full value (on any device; copied to CPU if needed).
            verify: read the tensor back through ``safetensors.safe_open`` (a block of rows at a time, the file
                opened afresh for each so that its mapped pages do not pile up) and compare it bit for bit.
        """
        if name not in self._where:
            raise KeyError(f"{name} is not a tensor declared for {self.prefix}")
        if name in self._written:
            raise ValueError(f"{name} was already written")
        index, offset, spec = self._where[name]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, declared {spec.shape}")
        source = tensor.detach().to(device="cpu").contiguous()
        if self._open_index != index:
            self._close_handle()
            self._handle = open_regular(self.directory / self.files[index], "a safetensors file being written", "r+b")
            self._open_index = index
        self._handle.seek(offset)
        flat = source.view(-1)
        step = max(1, BLOCK_BYTES // max(1, source.element_size()))
        for start in range(0, flat.numel(), step):
            # Cast a block at a time (an export_dtype copy of the whole tensor would be half its size again); the
            # bytes go out through a view of the block's own memory (numpy has no bfloat16, uint8 it has).
            block = flat[start : start + step].to(spec.dtype)
            self._handle.write(memoryview(block.view(torch.uint8).numpy()))
            del block
        self._written.add(name)
        if verify:
            self._handle.flush()
            check_tensor(self.directory / self.files[index], name, source)

    def close(self) -> list[str]:
        """Finish the files (and the index when sharded); return the file names written.

        Raises ``ValueError`` when a declared tensor was never written.
        """
        self._close_handle()
        missing = [name for name in self._where if name not in self._written]
        if missing:
            raise ValueError(f"{len(missing)} declared tensors were never written (e.g. {missing[0]})")
        if len(self.files) > 1:
            specs = [spec for _, _, spec in self._where.values()]
            index = {
                "metadata": {
                    "total_parameters": sum(spec.nbytes // _itemsize(spec.dtype) for spec in specs),
                    "total_size": sum(spec.nbytes for spec in specs),
                },
                "weight_map": {name: self.files[i] for name, (i, _, _) in sorted(self._where.items())},
            }
            write_file(self.directory / f"{self.prefix}{INDEX_SUFFIX}", json.dumps(index, indent=2) + "\n")
            return [*self.files, f"{self.prefix}{INDEX_SUFFIX}"]
        return list(self.files)

    def _close_handle(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle, self._open_index = None, None


def write_streamed(
    directory: str | Path,
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    verify: bool = False,
    **options: object,
) -> list[str]:
    """Write ``tensors`` (pairs ``(name, value)``, produced one at a time) into safetensors files under ``directory``.

    Args:
        directory: the folder.
        specs: every tensor's name, shape and saved dtype, in file order.
        tensors: the values; each is written and released before the next is drawn.
        verify: read each tensor back after writing it and compare (``StreamedSafetensorsWriter.write``).
        options: ``max_shard_size``, ``prefix``, ``metadata`` of ``StreamedSafetensorsWriter``.
    """
    writer = StreamedSafetensorsWriter(directory, specs, **options)  # type: ignore[arg-type]
    try:
        for name, tensor in tensors:
            writer.write(name, tensor, verify=verify)
            del tensor  # the only reference left is the producer's, which it drops for the next one
    finally:
        writer._close_handle()
    return writer.close()


def verify_written(directory: str | Path, expected: Callable[[str], torch.Tensor], *, prefix: str = "model") -> int:
    """Read every tensor of the written files back (``safe_open``, one at a time) and compare with ``expected(name)``.

    Returns the number of tensors compared; raises ``HFTrainError`` at the first that differs in dtype, shape or a
    single bit (after casting the expected value to the file's dtype, as the writer did).

    Args:
        directory: the folder ``StreamedSafetensorsWriter`` wrote.
        expected: the source value of a tensor, by name (re-read from the checkpoint).
        prefix: the file name stem.
    """
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / f"{prefix}{INDEX_SUFFIX}"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else [f"{prefix}.safetensors"]
    )
    count = 0
    for file in files:
        with safe_open(str(directory / file), framework="pt") as handle:
            for name in handle.keys():
                written = handle.get_tensor(name)
                source = expected(name).to(written.dtype)
                if written.shape != source.shape or not torch.equal(written, source):
                    raise HFTrainError(
                        f"'{directory / file}': {name} read back differs from the checkpoint's; the write is "
                        "damaged, do not use this folder (check the disk and convert again)"
                    )
                count += 1
                del written, source
    return count


def check_tensor(path: Path, name: str, expected: torch.Tensor, *, block_bytes: int = BLOCK_BYTES) -> None:
    """Raise ``HFTrainError`` unless ``name`` in the safetensors file ``path`` equals ``expected`` (cast to the file's
    dtype) bit for bit.

    Read through ``safe_open`` (the library's own parser of header and offsets) in blocks of rows of about
    ``block_bytes``, reopening the file for each block: safetensors maps the file, and pages read through a mapping
    stay in the process's resident set until it is closed.

    Args:
        path: the safetensors file.
        name: the tensor's key.
        expected: its value (each block is cast to the file's dtype before comparing, as the writer cast it).
        block_bytes: bytes compared per block.
    """
    from safetensors import safe_open

    rows = expected.shape[0] if expected.dim() else 1
    row_bytes = max(1, expected.numel() * expected.element_size() // max(rows, 1))
    step = max(1, block_bytes // row_bytes)
    for start in range(0, max(rows, 1), step):
        with safe_open(str(path), framework="pt") as handle:
            if expected.dim() == 0 or (start == 0 and step >= rows):
                written = handle.get_tensor(name)
                part = expected
            else:
                written = handle.get_slice(name)[start : start + step]
                part = expected[start : start + step]
        part = part.to(written.dtype)
        if written.shape != part.shape or not torch.equal(written, part):
            raise HFTrainError(
                f"'{path}': {name} read back differs from the value written; the write is damaged, do not use this "
                "folder (check the disk and write it again)"
            )
        del written


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
