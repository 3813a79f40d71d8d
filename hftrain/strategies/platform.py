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


EAGER_ATTENTION_MAX_LENGTH = 128
"""Up to this length eager attention trains faster than SDPA on CPU (measured crossover: between 128 and 256)."""


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

    def native_bf16(self) -> str | None:
        """Why this device computes bf16 natively (the CPU flag or the GPU), or None when it only emulates it.

        On a CPU without AMX or AVX512-BF16 (e.g. AVX2 only), oneDNN emulates bf16 and a bf16 matmul runs ~500x
        slower than fp32 (0.3 vs 152 GFLOP/s measured on an AVX2 EPYC); with AVX512-BF16 it ran 4.4x faster.
        """
        import torch

        if not self.is_cpu:
            return "CUDA bf16" if torch.cuda.is_bf16_supported() else None
        flags = cpu_flags()
        found = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]
        return f"CPU flag {found[0]}" if found else None

    def resolve_precision(self, mixed_precision: str) -> tuple[str, str]:
        """The concrete mixed precision for ``training.mixed_precision`` and why (``auto`` -> bf16 or no).

        Args:
            mixed_precision: ``training.mixed_precision``; values other than ``auto`` are returned as they are.
        """
        if mixed_precision != "auto":
            return mixed_precision, "set in the config"
        native = self.native_bf16()
        if native:
            return "bf16", f"auto: {native}"
        device = "GPU" if not self.is_cpu else "CPU (no amx_bf16/avx512_bf16 flag)"
        return "no", f"auto: this {device} only emulates bf16, fp32 is faster"

    def resolve_attention(self, attn_implementation: str, max_seq_length: int) -> tuple[str, str]:
        """The concrete attention kernel for ``model.attn_implementation`` and why (``auto`` -> eager or sdpa).

        On CPU, torch's fused SDPA backward dominates a short-sequence training step: MiniLM, batch 32, bf16,
        142 ms (eager) vs 205 ms (sdpa) per step at 28 tokens and 629 vs 891 ms at 128, SmolLM2 1.07 vs 1.38 s
        at 96; fp32 likewise (364 vs 388 ms). From 256 tokens on, sdpa is faster (1.69 vs 2.27 s).

        Args:
            attn_implementation: ``model.attn_implementation``; values other than ``auto`` are kept.
            max_seq_length: the longest sequence a batch can have.
        """
        if attn_implementation != "auto":
            return attn_implementation, "set in the config"
        if self.is_cpu and max_seq_length <= EAGER_ATTENTION_MAX_LENGTH:
            return "eager", f"auto: CPU, sequences <= {EAGER_ATTENTION_MAX_LENGTH} tokens"
        return "sdpa", "auto: " + ("GPU" if not self.is_cpu else f"sequences up to {max_seq_length} tokens")

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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none: then nothing is assumed)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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
