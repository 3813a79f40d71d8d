"""The one place that adapts distributed training to the machine: CPU/gloo here, CUDA/nccl on a cluster.

Facts this module encodes (checked with torch 2.13 CPU, accelerate 1.15, deepspeed 0.19):
- A plain ``Accelerator()`` on a CPU-only machine resolves to ``DistributedType.NO`` in *every* process of a
  2-process launch: two independent runs, no gradient sync, no error. ``cpu=True`` gives ``MULTI_CPU`` on gloo.
- DeepSpeed on CPU needs ``InitProcessGroupKwargs(backend="gloo")`` and *not* ``cpu=True``.
- Stock Accelerate never selects FSDP on CPU; the state has to be set after construction (``force_fsdp``),
  on both ``AcceleratorState`` and ``PartialState``: ``gather``/``reduce`` read the latter and silently become
  no-ops while it says ``NO``.
- FSDP1's full state dict (``accelerator.get_state_dict``, offload_to_cpu=True) frees the parameters it has just
  "offloaded" when they already live on the CPU, and then reads them: a segfault. ``force_fsdp`` makes that
  offload the identity on CPU.
Strategies ask this module what to do instead of testing for CUDA themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin


@dataclass(frozen=True)
class Platform:
    """Where the processes compute and how they talk.

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        backend: the torch.distributed backend, ``"gloo"`` or ``"nccl"``.
    """

    device: str
    backend: str

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    @classmethod
    def detect(cls) -> Platform:
        """CUDA and nccl when a GPU is visible, else CPU and gloo."""
        import torch

        if torch.cuda.is_available():
            return cls(device="cuda", backend="nccl")
        return cls(device="cpu", backend="gloo")

    def check_precision(self, mixed_precision: str) -> None:
        """Refuse a mixed precision this device cannot train in, instead of Accelerate's silent fp32 fallback.

        Args:
            mixed_precision: ``training.mixed_precision``.
        """
        if self.is_cpu and mixed_precision == "fp16":
            from hftrain.errors import ConfigError

            raise ConfigError(
                "training.mixed_precision: fp16 needs a CUDA GPU and this machine has none (Accelerate would "
                "silently train in fp32); use bf16 on CPU, or no"
            )

    def process_group_handlers(self, *, cpu_collectives: bool = False) -> list:
        """Accelerate kwargs handlers that pin the process-group backend for this platform.

        Args:
            cpu_collectives: some collectives run on CPU tensors (FSDP's parameter offload); on CUDA this adds
                gloo beside nccl, as Accelerate itself does when ``accelerate launch`` asks for FSDP offload.
        """
        from accelerate.utils import InitProcessGroupKwargs

        backend = f"{self.device}:{self.backend},cpu:gloo" if cpu_collectives and not self.is_cpu else self.backend
        return [InitProcessGroupKwargs(backend=backend)]

    def force_fsdp(self, accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
        """Make a freshly built accelerator's state FSDP where stock Accelerate does not select it (CPU).

        On CUDA, Accelerate selects FSDP itself from the plugin and this does nothing. On CPU, the process group
        is already up (gloo, from ``process_group_handlers``) but the state says ``NO``; this sets what
        Accelerate's own GPU branch would have set: the distributed type, the plugin, its mixed precision.

        Args:
            accelerator: the accelerator just constructed with ``fsdp_plugin=plugin``.
            plugin: the FSDP plugin the strategy built.
        """
        if not self.is_cpu:
            return
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        PartialState().distributed_type = DistributedType.FSDP  # read by gather/reduce/broadcast
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        if plugin.fsdp_version == 1:
            _make_fsdp1_cpu_offload_identity()


def _make_fsdp1_cpu_offload_identity() -> None:
    """Patch torch's ``FlatParamHandle.to_cpu`` (private) to do nothing when the parameter is already on the CPU.

    Departs from the official API because there is no other way in: torch 2.13's version "copies" the unsharded
    flat parameter to the CPU (the same storage on a CPU device), frees that storage, and yields views into it.
    """
    import contextlib

    from torch.distributed.fsdp._flat_param import FlatParamHandle

    original = FlatParamHandle.to_cpu
    if getattr(original, "hftrain_cpu_identity", False):
        return

    @contextlib.contextmanager
    def to_cpu(handle: FlatParamHandle):
        if handle.flat_param.device.type == "cpu":
            yield
            return
        with original(handle):
            yield

    to_cpu.hftrain_cpu_identity = True
    FlatParamHandle.to_cpu = to_cpu
