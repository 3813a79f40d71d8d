"""No checkpoint runs code: every pickled file of a checkpoint is loaded once by a restricted unpickler first.

The libraries that read a checkpoint's state unpickle some of it without restriction: DeepSpeed loads its
``*_states.pt`` with ``torch.load(weights_only=False)``, Accelerate its registered objects (the scheduler's
``custom_checkpoint_0.pkl``), and ``torch.distributed.checkpoint`` its ``.metadata`` with ``pickle.load`` and the
non-tensor entries of its ``.distcp`` files with ``weights_only=False``. A planted pickle in any of them would run
code on resume or export, trusted folder or not: checksums (``checkpoint.json``) give integrity, not authenticity,
since whoever plants a file can recompute them.

So before any library touches a checkpoint, the main process loads every such file with torch's ``weights_only``
unpickler (``torch.load(weights_only=True, mmap=True)``: storages are mapped, not read) and the DCP metadata with a
``pickle.Unpickler`` whose ``find_class`` admits only ``SAFE_GLOBALS``. Both construct nothing but tensors,
containers, numbers, strings and the few listed classes, and both refuse opcodes and globals outside that set. A
file that passes loads the same bytes the same way in the library afterwards, so it cannot run code there either.
A file that is refused is named in one line, with the global it asked for; a file that is not what its name says
(garbage, truncated, the wrong structure) is named as damaged.

Written by hand because no library does it for a whole checkpoint: torch's ``weights_only`` covers one
``torch.load`` call, and ``torch.serialization.get_unsafe_globals_in_checkpoint`` only lists the GLOBAL opcodes of a
zip file (a protocol-0 ``INST`` or a non-zip pickle slips past it).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hftrain.checkpoint.reading import active_checkpoint, check_regular_tree
from hftrain.errors import CheckpointError

GROUPS_FILE = "optimizer.json"
"""The optimizer's param groups in a checkpoint's ``state/`` (written by ``checkpoint.sharded``)."""

# Globals that the checkpoints of hftrain's strategies hold besides tensors and plain data, found by loading the
# checkpoints of every strategy (tests/test_checkpoint_trust.py): NumPy's RNG state arrays (what Accelerate adds to
# torch's own allow-list), DeepSpeed's ZeRO optimizer metadata, and torch.distributed.checkpoint's metadata classes.
# Each is a data container whose construction runs no user-controlled code.
SAFE_GLOBAL_NAMES = (
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "codecs.encode",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
DCP_GLOBAL_NAMES = (
    "collections.OrderedDict",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "torch.Size",
    "torch.serialization._get_layout",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
)
# Files no library unpickles: JSON, safetensors (a header and raw bytes), DeepSpeed's `latest` tag (text) and the
# conversion scripts it copies beside its checkpoints (never run by hftrain).
_NOT_PICKLED_SUFFIXES = (".json", ".safetensors", ".py", ".txt", ".md")
_NOT_PICKLED_NAMES = ("latest",)
_RNG_FILE = re.compile(r"^random_states_(\d+)\.pkl$")
_RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")


def pickled_files(state_dir: Path) -> list[Path]:
    """The files of a checkpoint's ``state/`` that a library unpickles on load (the trust message names them).

    Args:
        state_dir: the checkpoint's ``state/`` folder.
    """
    return [
        path
        for path in sorted(state_dir.rglob("*"))
        if path.is_file() and not _not_pickled(path) and path.suffix != ".distcp"
    ]


def check_no_code(checkpoint: Path, state_dir: Path) -> None:
    """Load every pickled file of ``state_dir`` with a restricted unpickler; refuse the checkpoint if one fails.

    Args:
        checkpoint: the ``step_<N>`` folder, for messages.
        state_dir: its ``state/`` folder.
    """
    # A tree of regular files first: every file a loader can reach is then one this walk finds (rglob does not enter
    # a symlinked folder; DCP's reader would follow it to a .metadata never checked).
    check_regular_tree(checkpoint)
    for path in sorted(state_dir.rglob("*")):
        if not path.is_file():
            continue
        name = str(path.relative_to(checkpoint))
        if path.suffix == ".safetensors":
            _check_safetensors(checkpoint, name, path)
        elif path.suffix == ".json":
            _check_json(checkpoint, name, path)
        elif path.name == ".metadata":
            _check_dcp(checkpoint, path.parent)
        elif not _not_pickled(path) and path.suffix != ".distcp":  # .distcp: through their .metadata
            loaded = _restricted_torch_load(checkpoint, name, path)
            if _RNG_FILE.match(path.name):
                _check_rng(checkpoint, name, loaded)


def check_rng_states(checkpoint: Path, state_dir: Path, saved_world: int, live_world: int) -> None:
    """Every process that had a rank in the saved run must find its RNG state (Accelerate skips a missing one).

    A process beyond the saved world (a resume on more processes) has none and keeps its seeded RNG; the trainer
    logs it.

    Args:
        checkpoint: the ``step_<N>`` folder, for messages.
        state_dir: its ``state/`` folder.
        saved_world: processes that wrote the checkpoint.
        live_world: processes of this run.
    """
    for rank in range(min(saved_world, live_world)):
        name = f"random_states_{rank}.pkl"
        if not (state_dir / name).is_file():
            raise CheckpointError(
                f"checkpoint '{checkpoint}': {state_dir.name}/{name} is missing (the RNG state of process {rank}); "
                "resume from another checkpoint"
            )


def _not_pickled(path: Path) -> bool:
    return path.suffix in _NOT_PICKLED_SUFFIXES or path.name in _NOT_PICKLED_NAMES


def _safe_globals() -> list[Any]:
    """The objects of ``SAFE_GLOBAL_NAMES`` that exist in this environment (numpy 1 or 2, DeepSpeed or not).

    DeepSpeed's are taken only when the run has imported DeepSpeed (a ZeRO strategy): importing it here would cost
    every other run seconds, and a checkpoint of theirs holds none of its classes.
    """
    import importlib
    import sys

    found = []
    for qualified in SAFE_GLOBAL_NAMES:
        module, _, attribute = qualified.rpartition(".")
        if module.split(".")[0] not in sys.modules and module.startswith("deepspeed"):
            continue
        try:
            found.append(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):
            continue
    return found


def _restricted_torch_load(checkpoint: Path, name: str, source: Any) -> Any:
    """``torch.load(weights_only=True)`` with ``SAFE_GLOBALS``; a refusal or damage becomes a CheckpointError."""
    import torch

    is_zip = zipfile.is_zipfile(source) if isinstance(source, Path) else zipfile.is_zipfile(io.BytesIO(source))
    if not is_zip:
        # Not torch's zip format: a bare pickle (which torch.load(weights_only=False) would run) or garbage.
        _refuse_or_damaged(checkpoint, name, _plain_pickle_global(source))
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            if isinstance(source, Path):
                return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(io.BytesIO(source), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        _refuse_or_damaged(checkpoint, name, found.group(1) if found else None, detail=str(error).splitlines()[0])
    except Exception as error:  # torch reports a damaged zip as RuntimeError, a bad record as EOFError, ...
        raise _damaged(checkpoint, name, error) from None
    raise AssertionError("unreachable")


def _plain_pickle_global(source: Any) -> str | None:
    """The first global a bare pickle asks for (None when it is not a pickle at all)."""
    import pickletools

    data = source.read_bytes() if isinstance(source, Path) else source
    try:
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "INST") and isinstance(argument, str):
                return argument.replace(" ", ".")
            if opcode.name in ("STACK_GLOBAL", "REDUCE", "OBJ", "NEWOBJ", "NEWOBJ_EX"):
                return "an object built by a call"
    except Exception:  # noqa: BLE001 - anything pickletools cannot walk is not a pickle: damaged
        return None
    return None


def _refuse_or_damaged(checkpoint: Path, name: str, global_name: str | None, *, detail: str = "") -> None:
    if global_name is not None:
        raise CheckpointError(
            f"checkpoint '{checkpoint}': {name} holds a pickled object ({global_name}) that could run code when "
            "loaded; hftrain loads only tensors and plain data from checkpoints: resume from another checkpoint"
        )
    raise CheckpointError(
        f"checkpoint '{checkpoint}': {name} is damaged (not a valid state file{': ' + detail if detail else ''}); "
        "resume from another checkpoint"
    )


def _damaged(checkpoint: Path, name: str, error: BaseException) -> CheckpointError:
    reason = " ".join(str(error).split())[:160] or type(error).__name__
    return CheckpointError(f"checkpoint '{checkpoint}': {name} is damaged ({reason}); resume from another checkpoint")


def _check_rng(checkpoint: Path, name: str, loaded: Any) -> None:
    """An RNG file must hold Accelerate's states, each one its generator takes: Accelerate catches any failure to
    restore them and goes on with the seeded RNG after an info line, so a run would resume on other random streams
    without a word. Each state is set on a generator of its own here (never the process's), as the loader sets it.
    """
    import random

    import numpy as np
    import torch

    if not isinstance(loaded, dict) or any(key not in loaded for key in _RNG_KEYS):
        raise CheckpointError(
            f"checkpoint '{checkpoint}': {name} is damaged (not Accelerate's RNG states: it lacks "
            f"{', '.join(k for k in _RNG_KEYS if not isinstance(loaded, dict) or k not in loaded)}); resume from "
            "another checkpoint"
        )
    setters = {
        "random_state": lambda state: random.Random().setstate(state),
        "numpy_random_seed": lambda state: np.random.RandomState().set_state(state),
        "torch_manual_seed": lambda state: torch.Generator().set_state(state),
        "torch_cuda_manual_seed": _check_cuda_states,  # no GPU needed to read one: checked as torch would take it
    }
    for key, setter in setters.items():
        if key not in loaded:
            continue
        try:
            setter(loaded[key])
        except Exception as error:  # noqa: BLE001 - TypeError, ValueError, RuntimeError: what the loader would hit
            reason = " ".join(str(error).split())[:120] or type(error).__name__
            raise CheckpointError(
                f"checkpoint '{checkpoint}': {name} is damaged (its {key} is not a state its generator takes: "
                f"{reason}; Accelerate would skip it and resume on other random streams); resume from another "
                "checkpoint"
            ) from None


def _check_cuda_states(states: Any) -> None:
    """``torch.cuda.set_rng_state_all``'s argument: one byte tensor per GPU."""
    import torch

    if not isinstance(states, list | tuple) or not all(
        isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1 for s in states
    ):
        raise TypeError("not a list of byte tensors, one per GPU")


def _check_safetensors(checkpoint: Path, name: str, path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # SafetensorError, OSError: a damaged header
        raise _damaged(checkpoint, name, error) from None


def _check_json(checkpoint: Path, name: str, path: Path) -> None:
    try:
        json.loads(path.read_text())
    except (ValueError, RecursionError, OSError) as error:  # RecursionError: nested deeper than Python's stack
        raise _damaged(checkpoint, name, error) from None


class _DcpUnpickler(pickle.Unpickler):
    """Builds a ``torch.distributed.checkpoint`` ``.metadata`` and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if module == "torch" and name in _torch_dtypes():  # tensor properties name their dtype
            return super().find_class(module, name)
        if qualified not in DCP_GLOBAL_NAMES:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {qualified}")
        return super().find_class(module, name)


def _torch_dtypes() -> set[str]:
    import torch

    return {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


def _check_dcp(checkpoint: Path, folder: Path) -> None:
    """The ``.metadata`` of a DCP folder, and every non-tensor entry its ``.distcp`` files hold."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    name = str((folder / ".metadata").relative_to(checkpoint))
    metadata = dcp_metadata_of(checkpoint, name, (folder / ".metadata").read_bytes())
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    for index, info in storage.items():
        if not isinstance(entries.get(index.fqn), BytesStorageMetadata):
            continue  # tensors: DCP reads them with weights_only=True
        entry = f"{folder.relative_to(checkpoint)}/{info.relative_path} ({index.fqn})"
        if info.transform_descriptors:
            raise CheckpointError(
                f"checkpoint '{checkpoint}': {entry} is stored with transforms hftrain cannot check; "
                "resume from another checkpoint"
            )
        try:
            with (folder / info.relative_path).open("rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
        except OSError as error:
            raise _damaged(checkpoint, entry, error) from None
        _restricted_torch_load(checkpoint, entry, data)


def dcp_metadata_of(checkpoint: Path, name: str, data: bytes) -> Any:
    """A DCP ``.metadata`` built from ``data`` by the restricted unpickler, with every file it points at a plain name
    of its folder; a refusal or damage is one line.

    Args:
        checkpoint: the ``step_<N>`` folder, for messages.
        name: the file's name in the checkpoint, for messages.
        data: its bytes (read once, checksum checked: ``VerifiedCheckpoint.read``).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _DcpUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}, not DCP metadata")
        storage = metadata.storage_data
        if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
            raise TypeError("its storage or state records are not mappings")
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        _refuse_or_damaged(checkpoint, name, found.group(1) if found else None, detail=str(error).splitlines()[0])
        raise AssertionError("unreachable") from None
    except Exception as error:  # noqa: BLE001 - truncated, or not DCP metadata at all
        raise _damaged(checkpoint, name, error) from None
    for index, info in storage.items():
        # DCP reads folder / relative_path: a name with a separator or '..' would read a file outside the checkpoint
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or Path(relative).name != relative or relative in ("", ".", ".."):
            raise CheckpointError(
                f"checkpoint '{checkpoint}': {name} points {index.fqn} at {relative!r}, not a file of its folder; "
                "it is damaged or forged: resume from another checkpoint"
            )
    return metadata


# The files of a checkpoint's state/ that Accelerate's load_state reads (its scheduler and registered objects, its
# samplers, its per-rank RNG, its loss scaler): copied, verified, into a private folder (:func:`verified_copy`).
_ACCELERATE_FILE = re.compile(
    r"^(custom_checkpoint_\d+\.pkl|random_states_\d+\.pkl|(sampler|dl_state_dict|scheduler)(_\d+)?\.bin|scaler\.pt)$"
)


@contextlib.contextmanager
def verified_copy(state_dir: str | Path) -> Iterator[str]:
    """A private folder holding the very bytes of ``state_dir``'s Accelerate files that were checked: each read once
    (through the resume's ``VerifiedCheckpoint``: its checksum checked on those bytes), loaded by the restricted
    unpickler, its counters checked (:func:`check_counters`), and written into a new folder only this process can
    write; Accelerate's ``load_state`` is pointed there.

    Why a copy: Accelerate's loader takes a folder and ``torch.load``s each file by its path, without a restriction;
    handed the checkpoint itself, it would read again a file that a writer may have swapped since it was checked (the
    check-then-load race of issue 52). Its folder is made by ``tempfile.mkdtemp`` (mode 0700, a random name) and
    removed after the load, so the bytes Accelerate unpickles are the ones the restricted unpickler built: built again
    without the restriction, they construct the same tensors and plain data, and run nothing.

    Args:
        state_dir: the checkpoint's ``state/`` folder.
    """
    import shutil
    import tempfile

    state_dir = Path(state_dir)
    verified = active_checkpoint()
    rates = _saved_initial_rates(verified, state_dir) if verified is not None else None
    private = tempfile.mkdtemp(prefix="hftrain-verified-")
    try:
        for entry in sorted(os.scandir(state_dir), key=lambda e: e.name):
            if not _ACCELERATE_FILE.match(entry.name):
                continue
            path = state_dir / entry.name
            if verified is None:  # a load outside a resume (a test's): the file as it is, read once all the same
                from hftrain.files import read_regular

                checkpoint, data = state_dir.parent, read_regular(path, f"checkpoint file '{path}'")
            else:
                checkpoint, data = verified.path, verified.read(path)
            name = str(path.relative_to(checkpoint))
            loaded = _restricted_torch_load(checkpoint, name, data)
            if _RNG_FILE.match(entry.name):
                _check_rng(checkpoint, name, loaded)
            if verified is not None:
                check_counters(checkpoint, name, loaded, verified.meta, initial_rates=rates)
            with open(os.path.join(private, entry.name), "xb") as handle:
                handle.write(data)
        yield private
    finally:
        shutil.rmtree(private, ignore_errors=True)


def check_counters(
    checkpoint: Path, name: str, loaded: Any, meta: dict[str, Any], *, initial_rates: list[float] | None = None
) -> None:
    """A learning-rate scheduler's state must be one of this checkpoint's step: it steps once per optimizer step (a
    step skipped by fp16's loss scaler skips it too), so ``last_epoch`` lies in ``[0, step]``, ``_step_count`` is one
    more, and its learning rates are finite and not negative. A forged ``last_epoch`` of 10⁹ would otherwise move the
    schedule (and the weights it trains) to a step the run never reaches. Its rates are no higher than the
    optimizer groups' ``initial_lr`` (the schedule's base: a forged ``base_lrs`` would set the rate at the next step;
    ``sharded.restore_param_groups`` bounds ``initial_lr`` by this run's ``training.learning_rate``).

    Args:
        checkpoint: the ``step_<N>`` folder, for messages.
        name: the file's name, for messages.
        loaded: what the restricted unpickler built from it.
        meta: the checkpoint's ``checkpoint.json``.
        initial_rates: the ``initial_lr`` of each group of the checkpoint's ``optimizer.json`` (None: no bound).
    """
    if not isinstance(loaded, dict) or "last_epoch" not in loaded:
        return
    step = meta["step"]

    def refuse(what: str) -> None:
        raise CheckpointError(
            f"checkpoint '{checkpoint}': {name} is damaged or forged ({what}, at step {step}); resume from another "
            "checkpoint"
        )

    last = loaded["last_epoch"]
    if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last <= step:
        refuse(f"the scheduler's last_epoch {last!r} is not a step in [0, {step}]")
    count = loaded.get("_step_count", last + 1)
    if count != last + 1:
        refuse(f"the scheduler's _step_count {count!r} is not last_epoch + 1")
    for key in ("base_lrs", "_last_lr"):
        values = loaded.get(key, [])
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= MAX_LR
            for v in values
        ):
            refuse(f"the scheduler's {key} {values!r} are not learning rates in [0, {MAX_LR}]")
        if initial_rates and values and max(values) > max(initial_rates) * (1 + 1e-6):
            refuse(f"the scheduler's {key} {values!r} lie above optimizer.json's initial_lr {max(initial_rates)!r}")


def _saved_initial_rates(verified: Any, state_dir: Path) -> list[float] | None:
    """The ``initial_lr`` of each group of the checkpoint's ``optimizer.json`` (read through ``verified``, checked
    on the bytes read), or None where there is none to bound the scheduler's rates by (its own damage is refused
    where the groups are restored: ``sharded.read_snapshot``)."""

    if not (state_dir / GROUPS_FILE).is_file():
        return None
    try:
        groups = json.loads(verified.read(state_dir / GROUPS_FILE))["param_groups"]
        rates = [group["initial_lr"] for group in groups]
    except (ValueError, RecursionError, KeyError, TypeError):
        return None
    if not rates or not all(isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) for r in rates):
        return None
    return [float(r) for r in rates]


MAX_LR = 10.0
"""The largest learning rate a checkpoint may hold (a scheduler's, an optimizer group's): fine-tuning rates are
around 1e-5 to 1e-2; one above this is a forged value that would make the first step's loss NaN."""


# The files of a DeepSpeed tag folder that DeepSpeed's zero_to_fp32 reads (its two globs).
_ZERO_FILE = re.compile(r"^.*_(model|optim)_states\.pt$")


@contextlib.contextmanager
def verified_zero_copy(root: Path, tag: str, *, scratch: Path | None = None) -> Iterator[Path]:
    """A private DeepSpeed checkpoint folder (``<private>/<tag>``) holding copies of ``root/tag``'s state files, each
    checked by the restricted unpickler on the copy itself; DeepSpeed's ``zero_to_fp32`` is pointed there.

    Why a copy: ``zero_to_fp32`` takes a folder and ``torch.load``\\ s each ``*_states.pt`` by its path with
    ``weights_only=False``; handed the checkpoint itself, it would read again a file that a writer may have swapped
    since it was checked (issue 52's check-then-load race), and run the planted pickle. Each file is read once through
    a descriptor that follows no link and never waits on a FIFO (``fstat``: a regular file), streamed into a folder
    made by ``tempfile.mkdtemp`` (mode 0700, a random name), and the copy is what the restricted unpickler loads
    (mapped, not read into memory) and what DeepSpeed loads after it: the same bytes, which construct the same tensors
    and plain data, and run nothing. The folder is removed on leaving; what DeepSpeed mapped stays mapped.

    Args:
        root: the DeepSpeed checkpoint folder (holding ``tag``).
        tag: the tag folder's name (``global_step<N>``), a plain name.
        scratch: where the private folder is made (the converted model's parent: the copy is as large as the
            checkpoint); None: the system's temporary folder.
    """
    import shutil
    import stat
    import tempfile

    from hftrain.files import kind_of

    if Path(tag).name != tag or tag in ("", ".", ".."):
        raise CheckpointError(
            f"DeepSpeed checkpoint '{root}': its tag {tag!r} is not a folder name of it; it is damaged or forged: "
            "give the folder of a complete ZeRO save"
        )
    folder = root / tag
    check_regular_tree(folder)
    private = Path(tempfile.mkdtemp(prefix=".hftrain-verified-", dir=scratch))
    try:
        (private / tag).mkdir(mode=0o700)
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if not _ZERO_FILE.match(entry.name):
                continue
            name = f"{tag}/{entry.name}"
            try:
                fd = os.open(folder / entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as error:
                raise CheckpointError(
                    f"DeepSpeed checkpoint '{root}': {name} cannot be read ({error.strerror}); a checkpoint is a "
                    "tree of regular files: give the folder of a complete ZeRO save"
                ) from None
            with os.fdopen(fd, "rb") as source:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):
                    raise CheckpointError(f"DeepSpeed checkpoint '{root}': {name} is {kind_of(mode)}, not a file; "
                                          "give the folder of a complete ZeRO save")  # fmt: skip
                size = os.fstat(fd).st_size
                if source.read(4) != b"PK\x03\x04":  # torch's zip format; a bare pickle or garbage is never copied
                    source.seek(0)
                    _refuse_or_damaged(root, name, _plain_pickle_global(source.read(1 << 20)))
                free = shutil.disk_usage(private).free
                if size > free:  # a sparse file of a terabyte would otherwise fill the disk with its zeros
                    raise CheckpointError(
                        f"DeepSpeed checkpoint '{root}': {name} is {size} bytes, more than the {free} free beside the "
                        f"converted model, where its verified copy is made; free space there, or convert elsewhere"
                    )
                source.seek(0)
                copy = private / tag / entry.name
                with open(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as target:
                    shutil.copyfileobj(source, target, 1 << 20)
            _restricted_torch_load(root, name, copy)  # the copy: what DeepSpeed loads next
        yield private
    finally:
        shutil.rmtree(private, ignore_errors=True)
