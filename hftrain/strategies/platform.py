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

Two choices that depend on the device only are made here too: the length buckets ``data.pad_to_multiple_of: auto``
stands for (:meth:`Platform.resolve_length_buckets`), and the order in which ``scaled_dot_product_attention`` tries
its CUDA kernels (:meth:`Platform.sdpa_priority`, ``training.sdpa_backend``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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

    @property
    def writes_beside_compute(self) -> bool:
        """Whether a background checkpoint write costs the computation beside it nothing: on a GPU (the kernels run
        there, the host's cores are free), not on a CPU, where torch's intra-op threads take every core: a writer
        thread preempts one of them, and each parallel region then waits for the preempted thread."""
        return not self.is_cpu

    @property
    def pinned_batches(self) -> bool:
        """Whether batches are collated into pinned host memory and copied to the device without waiting: on a GPU a
        copy from pageable memory synchronises the host with the device, once per tensor of every batch (three per
        micro-batch of a classifier: the host would wait for each step's kernels before it could queue the next)."""
        return not self.is_cpu

    @classmethod
    def detect(cls) -> Platform:
        """CUDA and nccl when a GPU is visible, else CPU and gloo."""
        import torch

        if torch.cuda.is_available():
            return cls(device="cuda", backend="nccl")
        import os

        # DeepSpeed gets imported by Accelerate's and transformers' unwrap helpers even when no strategy uses it; told
        # the device detected here, it does not warn "Setting accelerator to CPU ... unable to detect it".
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return cls(device="cpu", backend="gloo")

    @property
    def gpus(self) -> int | None:
        """GPUs visible to this process (None on a CPU)."""
        import torch

        return None if self.is_cpu else torch.cuda.device_count()

    def native_bf16(self) -> str | None:
        """Why this device computes bf16 natively (the CPU flag or the GPU), or None when it only emulates it.

        On a CPU without AMX or AVX512-BF16 (e.g. AVX2 only), oneDNN emulates bf16 and a bf16 matmul runs ~500x
        slower than fp32 (0.3 vs 152 GFLOP/s measured on an AVX2 EPYC); with AVX512-BF16 it ran 4.4x faster.
        """
        import torch

        if not self.is_cpu:  # natively: V100 and T4 emulate bf16, several times slower than fp16 or fp32
            return "CUDA bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else None
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

    def resolve_dropout_kernel(self, kernel: str, *, compiled: bool = False) -> tuple[str, str]:
        """The concrete ``training.dropout_kernel`` and why (``auto`` -> ``bits`` on CPU, ``torch`` on GPU and under
        ``training.compile``).

        torch's CPU ``bernoulli_`` draws one element at a time outside Intel's MKL path (~30 ms of a 170 ms MiniLM
        bf16 step on an AMD EPYC); on GPU, torch's fused dropout and SDPA's in-kernel dropout are the fast path.
        Compiled blocks take torch's dropout, which inductor generates into the block's kernels: ``bits`` seeds numpy
        from a host read of torch's generator at every mask, which dynamo cannot trace (a graph break per dropout,
        and the seed as a constant: a recompile per draw until the recompile limit stops the run). An explicit
        ``bits`` with ``training.compile`` is refused in one line (pitfall "`torch.compile` recompiles until the limit
        stops the run", docs/pitfalls.md).

        Args:
            kernel: ``training.dropout_kernel``.
            compiled: ``training.compile``.
        """
        if kernel == "bits" and compiled:
            from hftrain.errors import ConfigError

            raise ConfigError(
                "training.compile: dropout_kernel: bits draws each mask's seed on the host, which torch.compile cannot "
                "trace (a recompile per draw); set training.dropout_kernel: auto or torch, or training.compile: false"
            )
        if kernel != "auto":
            return kernel, "set in the config"
        if compiled:
            return "torch", "auto: training.compile, torch's dropout compiles into the block"
        if self.is_cpu:
            return "bits", "auto: CPU, 64 random bits per draw instead of one bernoulli_ draw per element"
        return "torch", "auto: GPU, torch's fused dropout"

    def resolve_packed_attention(self, setting: str) -> tuple[str, str]:
        """The concrete ``training.packed_attention`` and why (``auto`` -> ``varlen`` on CUDA, ``mask`` elsewhere).

        On CUDA, torch's flash varlen kernel computes each packed document alone and a dense mask would rule flash
        out; on a CPU the exact varlen reference computes the same pairs as the dense mask, and one SDPA call per
        document was slower than the masked call at the tests' sizes (``benchmarks/README.md``).

        Args:
            setting: ``training.packed_attention``.
        """
        if setting != "auto":
            return setting, "set in the config"
        if self.device == "cuda":
            return "varlen", "auto: CUDA, flash varlen_attn computes each packed document alone"
        return "mask", f"auto: {self.device}, the dense block-diagonal mask (no varlen kernel faster here)"

    def resolve_length_buckets(
        self, setting: int | str | None, *, longest: int, compiled: bool = False
    ) -> tuple[int | None, str]:
        """The multiple ``data.pad_to_multiple_of`` stands for on this device, and why (``auto`` is per device).

        On CUDA, ``auto`` keeps the shapes few: every new sequence length costs SDPA a new plan (cuDNN attention keeps
        one per exact shape, forward and backward, 55-400 ms of host time each) and ``torch.compile`` a recompile,
        while a padded position costs only its FLOPs. The multiple is the smallest power of two ≥ 64 that cuts
        ``longest`` into at most :data:`MAX_CUDA_BUCKETS` lengths: 64 up to ``max_seq_length`` 512 (128 → 2 lengths,
        512 → 8), then ``longest / 8`` rounded up to a power of two (2048 → 256). On CPU every padded position is
        computed by the same cores and no plan is cached per shape: ``auto`` is :data:`CPU_AUTO_BUCKETS`, the fastest
        of the default job's step times measured by ``benchmarks/length_buckets.py`` (benchmarks/README.md). Under
        ``training.compile`` every batch shape is a graph (``dynamic=False``) on any device: ``auto`` on a CPU then
        cuts ``longest`` into at most :data:`MAX_CUDA_BUCKETS` lengths too, from a multiple of 8 up (128 → 16).

        Args:
            setting: ``data.pad_to_multiple_of``: an int, ``"auto"`` or None (no buckets).
            longest: the longest example allowed (``data.max_seq_length`` as the model takes it).
            compiled: ``training.compile``.
        """
        if setting is None:
            return None, "data.pad_to_multiple_of: null, each batch padded to its longest example"
        if setting != "auto":
            return int(setting), "set in data.pad_to_multiple_of"
        per_bucket = 1 << (-(-longest // MAX_CUDA_BUCKETS) - 1).bit_length()
        if self.is_cpu and compiled:
            return max(8, per_bucket), "auto under training.compile: few shapes, one compiled graph each"
        if self.is_cpu:
            return CPU_AUTO_BUCKETS, CPU_AUTO_REASON
        return max(CUDA_MIN_MULTIPLE, per_bucket), "auto on cuda: few shapes, one attention plan each"

    def resolve_sdpa_backend(self, setting: str) -> tuple[tuple[str, ...], str]:
        """The order in which SDPA tries its CUDA kernels for ``training.sdpa_backend``, and why; () on a CPU.

        ``auto`` on CUDA: flash, then memory-efficient, then cuDNN, then math. torch ≥ 2.11 puts cuDNN first on
        sm90, and cuDNN builds a plan per exact shape (forward and backward apart); flash and memory-efficient are
        shape-generic kernels. Flash takes no attention mask (a padded batch's mask goes to memory-efficient, which
        takes a mask and in-kernel dropout), and needs fp16/bf16 (fp32 goes to memory-efficient too); math takes
        everything. A named backend is tried first, the others after it in the ``auto`` order, so a shape it cannot
        run still runs. ``benchmarks/sdpa_backends.py`` times them at the bucketed shapes. On a CPU the setting is
        ignored: SDPA has its own CPU kernels (flash-style for fp32/bf16, math otherwise), not these.

        Args:
            setting: ``training.sdpa_backend``: ``auto``, ``flash``, ``efficient``, ``cudnn`` or ``math``.
        """
        if setting not in ("auto", *SDPA_ORDER):
            from hftrain.errors import ConfigError

            raise ConfigError(f"training.sdpa_backend: {setting!r} is not one of auto, {', '.join(SDPA_ORDER)}")
        if self.is_cpu:
            return (), "CPU: SDPA's own CPU kernels, training.sdpa_backend applies to CUDA only"
        if setting == "auto":
            return SDPA_ORDER, "auto on cuda: shape-generic kernels before cuDNN's plan per shape"
        return (setting, *(b for b in SDPA_ORDER if b != setting)), "set in training.sdpa_backend"

    @contextlib.contextmanager
    def sdpa_priority(self, setting: str) -> Iterator[str]:
        """Run the body with SDPA's CUDA kernels tried in :meth:`resolve_sdpa_backend`'s order; yields the line to log.

        torch's ``sdpa_kernel(backends, set_priority=True)`` enables the listed backends and sets their priority in
        the global context (read by the autograd threads too), and restores both on exit. On a CPU nothing changes.

        Args:
            setting: ``training.sdpa_backend``.
        """
        order, why = self.resolve_sdpa_backend(setting)
        if not order:
            yield f"sdpa_backend: not applied ({why})"
            return
        from torch.nn.attention import SDPBackend, sdpa_kernel

        names = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }
        with sdpa_kernel([names[b] for b in order], set_priority=True):
            yield f"sdpa_backend: {' > '.join(order)} ({why})"

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

    def tune_host_allocator(self, *, lean: bool = False) -> str:
        """Tune glibc's allocator on CPU for speed (the default) or for a lean resident set; says what it did.

        glibc serves blocks above its mmap threshold with a fresh ``mmap`` and unmaps them on free; the threshold
        adapts (up to 32 MiB) to the largest block freed so far. For speed, every step's large temporaries
        (MiniLM's 47 MB word-embedding gradient, the attention and FFN activations of a batch) would otherwise
        arrive as new pages the kernel must fault in and zero: raising the mmap and trim thresholds makes the heap
        keep and reuse them (a MiniLM bf16 training step went from 0.193 to 0.167 s alone, and the default job's
        steps 7% faster end to end: the effect PyTorch's CPU tuning guide gets from jemalloc/tcmalloc).

        ``lean`` does the opposite, for runs whose point is memory (pipeline stages): a fixed 128 KiB mmap and
        trim threshold (which switches the adaptation off), so every tensor of a layer's size is its own mapping,
        returned to the system when freed. With the adaptive threshold, gradients freed by ``zero_grad`` and
        allocated again in the heap the next step left a random 0-25% of a stage's model states resident beside
        them (SmolLM2-135M at pp = 4: peaks 1.06-1.28 × the plan from run to run, against 1.02-1.06 and identical
        runs with the fixed threshold, ``benchmarks/pipeline_memory.py``).

        Args:
            lean: return freed memory at once instead of keeping it for reuse.
        """
        if not self.is_cpu:
            return "host allocator: left as is (GPU)"
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return "host allocator: left as is (no glibc mallopt here)"
        if lean:
            options = {"M_MMAP_THRESHOLD": (-3, 128 << 10), "M_TRIM_THRESHOLD": (-1, 128 << 10)}
            done = "host allocator: glibc returns freed blocks >= 128 KiB at once (fixed mmap/trim thresholds)"
        else:
            options = {"M_MMAP_THRESHOLD": (-3, _KEPT), "M_TRIM_THRESHOLD": (-1, _KEPT), "M_TOP_PAD": (-2, 1 << 28)}
            done = "host allocator: glibc keeps freed blocks < 1 GiB for reuse (mmap/trim thresholds 1 GiB)"
        refused = [name for name, (option, value) in options.items() if mallopt(option, ctypes.c_int(value)) != 1]
        if refused:
            return f"host allocator: glibc refused {', '.join(refused)}; left as is"
        _HEAP["keeps_freed"] = not lean
        return done

    def warm_heap(self, nbytes: int) -> HeapWarmer | None:
        """Fault in ``nbytes`` of heap on another thread, for the first training step; None where it would not help.

        The first step writes its gradients, the optimizer's new states and the longest batch's activations into
        pages the kernel has never handed out: each first write is a page fault that zero-fills 4 KiB, on the thread
        that computes. In the default job that was ~0.1 s of a 0.37-s first step (its forward 0.21 s, 0.13 s with the
        pages already in the heap). A :class:`HeapWarmer` takes a block from the heap and writes it on a thread of its
        own while the job builds the model and the optimizer (the main thread's work there leaves a core idle);
        :meth:`HeapWarmer.release` gives the block back to the heap before the first step, whose tensors are then
        carved from pages already present. Only where freed blocks stay in the heap (the CPU speed tuning of
        :meth:`tune_host_allocator`); elsewhere a freed block of this size would be unmapped and the work lost.

        Only in a process with two or more intra-op threads (cores of its own, one of them idle during the setup);
        where processes share the cores one each, the writes would only be taken from another process's setup.

        Args:
            nbytes: bytes to fault in: the memory the first step takes for certain (gradients and optimizer states),
                so that the resident peak of the run is not raised.
        """
        import torch

        if not self.is_cpu or not _HEAP["keeps_freed"] or nbytes <= 0 or torch.get_num_threads() < 2:
            return None
        return HeapWarmer(min(nbytes, _KEPT - (1 << 20)))  # a block at the mmap threshold would be unmapped on free

    def release_freed_memory(self) -> None:
        """Give memory freed in bulk back to the system now (a pipeline rank dropping the other stages' weights).

        On CPU, glibc keeps freed blocks in its heap (above all with ``tune_host_allocator``'s thresholds), so the
        process's resident memory would not shrink; ``malloc_trim(0)`` returns the free pages of every arena. On
        CUDA, torch's caching allocator keeps them; ``empty_cache`` returns them.
        """
        if not self.is_cpu:
            import torch

            torch.cuda.empty_cache()
            return
        import ctypes
        import ctypes.util

        try:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            return  # not glibc: nothing to ask

    def process_group_handlers(self, *, cpu_collectives: bool = False) -> list:
        """Accelerate kwargs handlers that pin the process-group backend for this platform.

        Args:
            cpu_collectives: some collectives run on CPU tensors (FSDP's parameter offload); on CUDA this adds
                gloo beside nccl, as Accelerate itself does when ``accelerate launch`` asks for FSDP offload.
        """
        from accelerate.utils import InitProcessGroupKwargs

        from hftrain.parallel.host import COLLECTIVE_TIMEOUT

        backend = f"{self.device}:{self.backend},cpu:gloo" if cpu_collectives and not self.is_cpu else self.backend
        return [InitProcessGroupKwargs(backend=backend, timeout=COLLECTIVE_TIMEOUT)]

    def start_group_eagerly(self, backend: str, timeout: Any) -> bool:
        """On a GPU, start the default process group bound to this rank's device, before Accelerate would; returns
        whether it did (on a CPU, or in one process, or with a group already up: nothing to do).

        Accelerate calls ``init_process_group`` without ``device_id`` and sets the device afterwards, so NCCL creates
        the world communicator lazily at the first collective and every later group bootstraps its own from scratch.
        Bound to its device (``device_id``), the default group connects at once (a rank whose GPU or network is
        broken fails here, not minutes into the run), and ``new_group`` / ``init_device_mesh`` split their
        communicators from it (``ncclCommSplit``) instead of a new bootstrap each. Accelerate (and DeepSpeed's
        ``init_distributed``) find the group started and keep it.

        Args:
            backend: the backend Accelerate would start (``nccl``; ``cuda:nccl,cpu:gloo`` with FSDP offload).
            timeout: how long every collective waits (``COLLECTIVE_TIMEOUT``).
        """
        import os

        import torch
        import torch.distributed as dist

        if self.is_cpu or int(os.environ.get("WORLD_SIZE", "1")) < 2 or dist.is_initialized():
            return False
        device = torch.device(self.device, int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device)
        return True

    def default_handlers(self) -> list:
        """The kwargs handlers a strategy that names none gets: on a GPU the backend with ``COLLECTIVE_TIMEOUT``
        (Accelerate's NCCL default is 10 minutes); on a CPU none (``cpu=True`` picks gloo, 30 minutes)."""
        return [] if self.is_cpu else self.process_group_handlers()

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


SDPA_ORDER = ("flash", "efficient", "cudnn", "math")
"""SDPA's CUDA kernels in the order ``training.sdpa_backend: auto`` tries them (``resolve_sdpa_backend``)."""

MAX_CUDA_BUCKETS = 8
"""``data.pad_to_multiple_of: auto`` on CUDA cuts ``max_seq_length`` into at most this many padded lengths."""

CUDA_MIN_MULTIPLE = 64
"""The smallest multiple ``auto`` takes on CUDA: tensor-core tiles and attention kernels' blocks are 64 wide."""

CPU_AUTO_BUCKETS: int | None = None
"""``data.pad_to_multiple_of: auto`` on CPU: none. ``benchmarks/length_buckets.py``, the default job's own batches
(bf16, 2 threads): median step 2.50 s with none, 3.40 s with a multiple of 8, 5.96 s with 16, 5.48 s with 32, 3.62 s
with 64 (padding 2.7%, 13.5%, 23%, 36%, 58% of positions); a CPU computes every padded position and caches no plan per
shape, so fewer shapes buy nothing there (see :data:`CPU_AUTO_REASON`)."""

CPU_AUTO_REASON = "auto on cpu: each batch padded to its longest example, the fastest (benchmarks/length_buckets.py)"

_KEPT = 1 << 30
"""glibc's mmap and trim thresholds under the speed tuning: freed blocks below this stay in the heap."""

_HEAP = {"keeps_freed": False}
"""Process-wide: whether glibc was told (``tune_host_allocator``, speed) to keep freed blocks < 1 GiB in the heap."""


class HeapWarmer:
    """A block of heap being written on a thread of its own, until :meth:`release` frees it for reuse.

    Args:
        nbytes: the block's size.
    """

    def __init__(self, nbytes: int) -> None:
        import ctypes
        import threading

        import torch

        self._block: Any = torch.empty(nbytes, dtype=torch.uint8)  # from glibc's heap: below the mmap threshold

        def write(block: torch.Tensor) -> None:  # holds the block: a warmer dropped early frees it only after this
            ctypes.memset(block.data_ptr(), 0, block.numel())  # ctypes releases the GIL: the main thread goes on

        self._thread = threading.Thread(target=write, args=(self._block,), name="hftrain-heap-warmer", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Wait for the writes, then free the block into the heap (idempotent)."""
        if self._block is not None:
            self._thread.join()
            self._block = None


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
