"""The one place that adapts distributed training to the machine: CPU/gloo here, CUDA/nccl on a cluster.

Facts this module encodes (checked with torch 2.13 CPU, accelerate 1.15, deepspeed 0.19):
- A plain ``Accelerator()`` on a CPU-only machine resolves to ``DistributedType.NO`` in *every* process of a
  2-process launch: two independent runs, no gradient sync, no error. ``cpu=True`` gives ``MULTI_CPU`` on gloo.
- DeepSpeed on CPU needs ``InitProcessGroupKwargs(backend="gloo")`` and *not* ``cpu=True``.
- Stock Accelerate never selects FSDP on CPU; the state has to be set after construction.
Strategies ask this module what to do instead of testing for CUDA themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def process_group_handlers(self) -> list:
        """Accelerate kwargs handlers that pin the process-group backend for this platform."""
        from accelerate.utils import InitProcessGroupKwargs

        return [InitProcessGroupKwargs(backend=self.backend)]
