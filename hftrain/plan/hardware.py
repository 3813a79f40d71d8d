"""What the plan runs on: GPUs per node, nodes, memory, link bandwidth classes and compute speed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hftrain.errors import ConfigError

GB = 1e9
# Beyond any machine (a hostfile's slots stop at 4096 too) and any cluster; layouts are enumerated over these.
MAX_GPUS_PER_NODE = 4096
MAX_NODES = 1_000_000
# bandwidth class -> bytes/s one GPU can send (unidirectional, what a ring collective is bound by)
BANDWIDTHS = {
    "nvlink": 150e9,  # NVLink 3/4 per GPU, one direction (A100 300 GB/s, H100 450 GB/s bidirectional / 2)
    "pcie": 12e9,  # PCIe 4 x16 in practice
    "ib": 25e9,  # 200 Gb/s InfiniBand per GPU
    "ethernet": 3e9,  # 25 Gb/s Ethernet
    "loopback": 2e9,  # gloo on one CPU machine
}


@dataclass(frozen=True)
class Hardware:
    """The machines a plan is for.

    Args:
        gpus_per_node: accelerators (processes) per node.
        nodes: number of nodes.
        gpu_memory: bytes of memory per GPU.
        cpu_memory: bytes of CPU memory per node (for offload).
        intra: bandwidth class inside a node (a key of ``BANDWIDTHS``).
        inter: bandwidth class between nodes.
        tflops: dense bf16 TFLOP/s per GPU (A100: 312), for the compute-time estimate.
        efficiency: the fraction of ``tflops`` training reaches (model FLOPs utilisation).
        reserve: bytes per GPU kept for the framework (CUDA context, allocator fragmentation).
        dropout_mask_bytes: bytes per dropout-mask element (1 on GPUs, 4 under torch's CPU dropout).
    """

    gpus_per_node: int = 8
    nodes: int = 1
    gpu_memory: float = 80 * GB
    cpu_memory: float = 512 * GB
    intra: str = "nvlink"
    inter: str = "ib"
    tflops: float = 312.0
    efficiency: float = 0.4
    reserve: float = 2 * GB
    dropout_mask_bytes: int = 1

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_memory(self) -> float:
        """Per-GPU bytes available to model states and activations."""
        return self.gpu_memory - self.reserve

    def bandwidth(self, spans_nodes: bool) -> float:
        """Bytes/s per GPU of the link a group uses (the slowest link of a ring).

        Args:
            spans_nodes: whether the group's ranks are on more than one node.
        """
        return BANDWIDTHS[self.inter if spans_nodes else self.intra]

    def validate(self) -> Hardware:
        """Refuse a description that cannot run anything (one line, naming the option)."""
        counts = (("--gpus-per-node", self.gpus_per_node, MAX_GPUS_PER_NODE), ("--nodes", self.nodes, MAX_NODES))
        for name, value, most in counts:
            if value < 1:
                raise ConfigError(f"{name} {value}: needs at least 1")
            if value > most:
                raise ConfigError(f"{name} {value}: more than the planner takes ({most} at most); check the value")
        for name, value, unit in (
            ("--gpu-memory", self.gpu_memory, GB),
            ("--cpu-memory", self.cpu_memory, GB),
            ("--reserve", self.reserve, GB),
            ("--tflops", self.tflops, 1.0),
            ("--efficiency", self.efficiency, 1.0),
        ):
            if not math.isfinite(value):
                raise ConfigError(f"{name} {value / unit:g}: must be a finite number")
        if self.reserve < 0:
            raise ConfigError(
                f"--reserve {self.reserve / GB:g}: must be >= 0 GB (memory per GPU the framework keeps; default 2)"
            )
        if self.gpu_memory <= self.reserve:
            raise ConfigError(
                f"--gpu-memory {self.gpu_memory / GB:g} GB leaves nothing after the {self.reserve / GB:g} GB "
                "framework reserve; give the memory per GPU in GB (e.g. --gpu-memory 80)"
            )
        if self.cpu_memory < 0:
            raise ConfigError(f"--cpu-memory {self.cpu_memory / GB:g}: must be >= 0 GB (CPU memory per node)")
        if self.tflops <= 0:
            raise ConfigError(f"--tflops {self.tflops:g}: must be > 0 (dense bf16 TFLOP/s per GPU, e.g. 312)")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(
                f"--efficiency {self.efficiency:g}: must be in (0, 1] (the fraction of --tflops reached, e.g. 0.4)"
            )
        for name, value in (("--intra", self.intra), ("--inter", self.inter)):
            if value not in BANDWIDTHS:
                raise ConfigError(f"{name} {value!r} is not a bandwidth class; choose one of {', '.join(BANDWIDTHS)}")
        return self
