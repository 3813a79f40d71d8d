"""Host syncs counted: the operations that make the host wait for the device to read a value back.

A step the host can queue ahead of the device reads nothing back; each read below stalls it until the device has
run everything queued before it (pitfall 37, docs/pitfalls.md):

- ``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` and ``if t:`` on a tensor, and
  ``.tolist()`` of a device tensor (one per element);
- ``aten.is_nonzero``: ``bool(t)`` of a one-element tensor on some paths;
- ``aten.nonzero`` / ``aten.nonzero_static`` with a data-dependent size, ``aten.masked_select``, and indexing with a
  boolean mask (``aten.index`` with a bool index: its output size is the mask's count);
- ``aten.repeat_interleave`` without ``output_size``, ``aten.unique*``: data-dependent output sizes;
- a copy from a non-CPU device to the CPU (``aten._to_copy`` / ``aten.copy_`` into a CPU tensor).

:class:`HostSyncCounter` counts them with a ``TorchDispatchMode`` on any device, so a CPU run shows what a GPU run
would wait for. ``Tensor.tolist()`` of a CPU tensor dispatches nothing: :class:`TolistCounter`, a
``TorchFunctionMode``, counts each call as one read (a device tensor's ``tolist`` is one copy to the host). A CPU
tensor that is host memory by construction (a gloo flag of ``parallel.host``) is read through ``numpy()`` where it
must not count. On a CUDA
device torch's own ``torch.cuda.set_sync_debug_mode("warn")`` reports the syncs its kernels really make;
:func:`count_host_syncs` runs both there and the dispatch counter alone elsewhere. Hand-written because torch has no
counter: the CUDA sync debug mode only warns (and only on CUDA), and the profiler sees kernels, not reads.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.is_nonzero",
        "aten.nonzero",
        "aten.masked_select",
        "aten.unique",
        "aten._unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.unique_dim",
    }
)
"""Ops that read device values back to the host whatever their arguments (by overload packet name)."""


def _packet(func: Any) -> str:
    """``aten.nonzero`` for ``aten.nonzero.default``."""
    return f"{func.namespace}.{func._opname}" if hasattr(func, "_opname") else str(func).rsplit(".", 1)[0]


def _is_read(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether one dispatched op makes the host wait for a device value (module docstring)."""
    if name in _READS:
        return True
    if name == "aten.index":  # x[mask]: a bool index's count is the output's size
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    if name == "aten.repeat_interleave":  # tensor repeats: the output's size is their sum
        return kwargs.get("output_size") is None and any(
            isinstance(a, torch.Tensor) and a.dtype != torch.bool and a.ndim > 0 for a in args[:2][-1:]
        )
    if name in ("aten._to_copy", "aten.copy_"):  # a device tensor copied into host memory
        source = args[1] if name == "aten.copy_" else args[0]
        target = kwargs.get("device") if name == "aten._to_copy" else args[0].device
        return (
            isinstance(source, torch.Tensor)
            and source.device.type != "cpu"
            and target is not None
            and torch.device(target).type == "cpu"
        )
    return False


@dataclass
class SyncReport:
    """What :class:`HostSyncCounter` saw.

    Args:
        ops: reads by op name (``aten._local_scalar_dense``: 3, ...).
        where: for each read, the innermost frame outside torch that caused it (``file:line function``).
        cuda_warnings: the reads torch's CUDA sync debug mode reported (0 off CUDA).
    """

    ops: Counter[str] = field(default_factory=Counter)
    where: list[str] = field(default_factory=list)
    cuda_warnings: int = 0

    @property
    def total(self) -> int:
        """Reads counted by the dispatch counter."""
        return sum(self.ops.values())


class HostSyncCounter(TorchDispatchMode):
    """A dispatch mode that counts the host reads of the ops run inside it (module docstring); it changes no result.

    Args:
        report: where the counts go (a fresh one by default).
        trace: record the caller of each read in ``report.where`` (slower: a stack walk per read).
    """

    def __init__(self, report: SyncReport | None = None, *, trace: bool = True) -> None:
        super().__init__()
        self.report = report if report is not None else SyncReport()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _packet(func)
        if _is_read(name, args, kwargs):
            self.report.ops[name] += 1
            if self.trace:
                self.report.where.append(_caller())
        return func(*args, **kwargs)


class TolistCounter(TorchFunctionMode):
    """Counts ``Tensor.tolist()`` calls as ``tolist`` reads into ``report`` (one host read each; a CPU tensor's
    ``tolist`` dispatches no op that :class:`HostSyncCounter` could see).

    Args:
        report: where the counts go.
        trace: record the caller of each read.
    """

    def __init__(self, report: SyncReport, *, trace: bool = True) -> None:
        super().__init__()
        self.report = report
        self.trace = trace

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            self.report.ops["tolist"] += 1
            if self.trace:
                self.report.where.append(_caller())
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame outside torch: the line that asked for the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str | None = None, *, trace: bool = True) -> Iterator[SyncReport]:
    """Count the host syncs of the code run inside: the dispatch counter everywhere, and on a CUDA ``device`` torch's
    ``set_sync_debug_mode("warn")`` too (its warnings counted in ``cuda_warnings``, the previous mode restored).

    Args:
        device: the device the counted code runs on (None or a CPU: the dispatch counter only).
        trace: record where each counted read comes from.
    """
    report = SyncReport()
    on_cuda = device is not None and torch.device(device).type == "cuda"
    with contextlib.ExitStack() as stack:
        if on_cuda:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
        stack.enter_context(TolistCounter(report, trace=trace))
        stack.enter_context(HostSyncCounter(report, trace=trace))
        try:
            yield report
        finally:
            if on_cuda:
                report.cuda_warnings = sum("synchroniz" in str(w.message) for w in caught)
