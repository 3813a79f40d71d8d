"""What a step costs and how fast it goes: real tokens/s, samples/s, model and hardware FLOPs, MFU.

FLOPs are counted per micro-batch of ``b`` sequences padded to ``s`` positions, the way Megatron-LM, PaLM (Chowdhery
et al. 2022, appendix B) and torchtitan count them, from the model's own shapes:

    linear weights W inside the transformer layers:  (2 + 2 + 2·[W trainable]) · numel(W) · b·s
        (the forward matmul, the input gradient, and the weight gradient when W is trained: 6Ψ per token for
        full fine-tuning, 4Ψ for LoRA's frozen base weights)
    attention core, per layer:                       12 · H·d · s² · b
        (q·kᵀ and probabilities·v: 2·2·s²·H·d forward, twice that backward; H query heads of width d)
    linear weights outside the layers (pooler, classifier): as above, per sequence when they read one pooled
        token (BERT's pooler and classifier), per token when they read every position (GPT-2's and Llama's score)

These are *model* FLOPs: what the model's math needs, whatever the implementation. *Hardware* FLOPs add what
activation recomputation runs again. torch's non-reentrant checkpoint stops recomputing once the last tensor the
backward needs is back, so: under ``full`` a layer's forward (``2·Σ numel(W)·b·s + 4·H·d·s²·b``) less its last
linear when nothing after it keeps that output (a pre-norm layer without residual dropout, as Llama's
``down_proj``); under ``selective`` only ``q·kᵀ`` (``2·H·d·s²·b``: the probabilities·v product is not needed by
the backward). Embedding lookups, norms, activations and softmax are not counted (as in those references; a few
percent at the models hftrain trains). Checked against ``torch.utils.flop_counter.FlopCounterMode`` over real
steps (``tests/test_throughput.py``).

MFU is model FLOPs per second over the processes' peak: ``flops / (seconds · peak · processes)``, with the peak of
one process measured at the start of the run as the best rate of a ``1024³`` matmul in the run's compute dtype with
its threads (a CPU has no datasheet figure that matches its threads and its memory), the datasheet's dense
bf16/fp16 figure on a known GPU, or ``training.peak_tflops`` when set. Real tokens are the non-padding ones
(``attention_mask``); the tokens/s a user reads count only those. Padded positions (every position of a batch,
``b·s``) are counted beside them, so the summary says what the length buckets cost: ``padding = 1 - tokens /
positions``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Dense peaks (TFLOP/s) from NVIDIA's datasheets: (bf16/fp16 tensor cores, fp32 without TF32), by a fragment of the
# name the device reports, most specific first ("NVIDIA H100 PCIe" and "NVIDIA H100 80GB HBM3", the SXM part, differ
# by a third; "A100" before "A10"). V100 has no bf16: its fp16 figure.
DATASHEET_TFLOPS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (756.0, 51.2),
    "H100 NVL": (835.0, 60.0),
    "H100": (989.0, 66.9),
    "H200": (989.0, 66.9),
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "A10": (125.0, 31.2),
    "V100": (125.0, 15.7),
}


def datasheet_peak(name: str, mixed_precision: str) -> tuple[float, str] | None:
    """The datasheet peak (TFLOP/s) of a GPU named ``name`` for this precision, and what it is; None when unknown.

    fp32 (``mixed_precision: no``) is rated against the fp32 peak, or the TF32 one (half the bf16 peak) when torch
    lets fp32 matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``), not against the bf16 peak.

    Args:
        name: ``torch.cuda.get_device_name``.
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"``.
    """
    for model, (half, fp32) in DATASHEET_TFLOPS.items():
        if model in name:
            if mixed_precision in ("bf16", "fp16"):
                return half, f"{name} datasheet, dense {mixed_precision}"
            if torch.backends.cuda.matmul.allow_tf32:
                return half / 2, f"{name} datasheet, dense tf32"
            return fp32, f"{name} datasheet, fp32"
    return None


@dataclass(frozen=True)
class FlopModel:
    """A model's shapes as FLOP counting needs them (taken once, from the unsplit model).

    Args:
        layers: transformer layers ``L``.
        attention_width: ``H·d``, query heads times head width.
        per_token: FLOPs per token of the linear weights read at every position (forward and backward).
        per_sequence: FLOPs per sequence of the linear weights that read one pooled token.
        forward_per_token: forward FLOPs per token of the layers' weights that full recomputation repeats.
    """

    layers: int
    attention_width: int
    per_token: float
    per_sequence: float
    forward_per_token: float

    @classmethod
    def of(cls, model: nn.Module) -> FlopModel:
        """Count ``model``'s linear weights (``nn.Linear`` and transformers' ``Conv1D``; LoRA's adapters too)."""
        from transformers.modeling_layers import GradientCheckpointingLayer
        from transformers.pytorch_utils import Conv1D

        config = model.config
        heads = config.num_attention_heads
        width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        per_token = per_sequence = forward = 0.0
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear | Conv1D):
                continue
            weight = module.weight
            flops = (4 + 2 * weight.requires_grad) * _numel(weight)
            if id(weight) in in_layers:
                per_token += flops
                forward += 2 * _numel(weight)
            elif "pooler" in name or "classifier" in name:  # reads the pooled first token (BERT-style heads)
                per_sequence += flops
            else:  # a score head computed at every position, then pooled (GPT-2, Llama)
                per_token += flops
        for layer in layers:  # the last linear's forward is not repeated when nothing after it keeps its output
            name, last = [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear | Conv1D)][-1]
            parent, _, child = name.rpartition(".")
            siblings = list(layer.get_submodule(parent).named_children())
            after = [m for _, m in siblings[[n for n, _ in siblings].index(child) + 1 :]]
            if not any(_keeps_its_input(m) for m in after):
                forward -= 2 * _numel(last.weight)
        return cls(config.num_hidden_layers, width, per_token, per_sequence, forward)

    def step(self, batch: int, length: int, *, recompute: str | None = None) -> tuple[float, float]:
        """``(model FLOPs, hardware FLOPs)`` of forward and backward over ``batch`` sequences of ``length``.

        Args:
            batch: sequences in the micro-batch.
            length: their padded length.
            recompute: ``"full"``, ``"selective"`` or None.
        """
        attention = 4.0 * self.layers * self.attention_width * length * length * batch  # one forward
        model = self.per_token * batch * length + self.per_sequence * batch + 3 * attention
        if recompute == "full":
            return model, model + self.forward_per_token * batch * length + attention
        if recompute == "selective":
            return model, model + attention / 2  # q·kᵀ again; probabilities·v is not needed by the backward
        return model, model


def _keeps_its_input(module: nn.Module) -> bool:
    """Whether ``module`` saves its input for the backward (a norm, or a dropout that drops something)."""
    return (
        isinstance(module, nn.LayerNorm)
        or type(module).__name__.endswith("RMSNorm")
        or (isinstance(module, nn.Dropout) and module.p > 0)
    )


def measured_peak_flops(dtype: torch.dtype, *, seconds: float = 0.05) -> float:
    """The best rate (FLOP/s) of a ``1024³`` matmul in ``dtype`` on this process's CPU threads, over ``seconds``.

    0.05 s is ~40 products at 1.6 TFLOP/s; their best was within 2% of a 0.15-s measurement's (1.60-1.65 against
    1.63-1.64 TFLOP/s bf16 on the 2-core AMX machine), at a third of the cost every run pays before its first step.
    """
    # a generator of its own: the run's random state (dropout masks, a resumed run's restored state) is untouched
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(1024, 1024, generator=generator).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm-up: thread pool and kernel selection
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * 1024**3 / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, mixed_precision: str, user_tflops: float | None) -> tuple[float, str]:
    """One process's peak FLOP/s and where it comes from.

    Args:
        device: the run's device.
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"``.
        user_tflops: ``training.peak_tflops`` (None: measure or look up).
    """
    if user_tflops:
        return user_tflops * 1e12, "training.peak_tflops"
    if device.type == "cuda":
        found = datasheet_peak(torch.cuda.get_device_name(device), mixed_precision)
        if found is not None:
            return found[0] * 1e12, found[1]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
    name = str(dtype).removeprefix("torch.")
    if device.type != "cpu":
        return measured_peak_flops_on(device, dtype), f"measured {name} matmul on {device}"
    return measured_peak_flops(dtype), f"measured {name} matmul, {torch.get_num_threads()} threads"


def measured_peak_flops_on(device: torch.device, dtype: torch.dtype) -> float:
    """A GPU's matmul rate when no datasheet figure is known (8192³, synchronised)."""
    module = torch.get_device_module(device.type)
    a = torch.randn(8192, 8192, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    torch.mm(a, a)
    module.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        torch.mm(a, a)
    module.synchronize()
    return 5 * 2 * 8192**3 / (time.perf_counter() - start)


class Throughput:
    """Counts real tokens, samples and FLOPs of this process's micro-batches, and rates over optimizer steps.

    Args:
        flops: the model's shapes.
        recompute: the run's recomputation mode (None: off).
    """

    FIELDS = ("tokens", "samples", "model_flops", "hardware_flops", "positions")

    def __init__(self, flops: FlopModel, *, recompute: str | None) -> None:
        self.flops = flops
        self.recompute = recompute
        self.window = dict.fromkeys(self.FIELDS, 0.0)  # this process's, since the last optimizer step
        self.totals = dict.fromkeys(self.FIELDS, 0.0)  # the job's (over data-parallel replicas), whole run
        self.seconds = 0.0
        self.peak: tuple[float, str] | None = None
        self._started = time.perf_counter()

    def count(self, batch: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch of this process."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        model, hardware = self.flops.step(ids.shape[0], ids.shape[1], recompute=self.recompute)
        # a tensor sum, read once per optimizer step with the loss (no device sync per micro-batch)
        self.window["tokens"] += mask.sum() if mask is not None else ids.numel()
        self.window["samples"] += ids.shape[0]
        self.window["model_flops"] += model
        self.window["hardware_flops"] += hardware
        self.window["positions"] += ids.numel()

    def local_window(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """This process's counts since the last step on ``device``, to reduce with the loss (``FIELDS`` order).

        The token count stays the device tensor it was summed into and the other counts are written by fill kernels,
        so the step's one host read is that of the reduced loss and counts together (no sync here).
        """
        values = [
            v.to(device=device, dtype=torch.float32).reshape(())
            if isinstance(v, torch.Tensor)
            else torch.full((), float(v), dtype=torch.float32, device=device)
            for v in (self.window[k] for k in self.FIELDS)
        ]
        return torch.stack(values)

    def close_window(self, means: list[float], replicas: int, processes: int) -> dict[str, float]:
        """End an optimizer step: its job-wide counts from the per-process means; returns its rates.

        Args:
            means: the window's counts averaged over all processes (model-parallel ranks repeat their replica's).
            replicas: data-parallel replicas (the mean times this is the job's count).
            processes: all processes (MFU divides the FLOPs among them).
        """
        now = time.perf_counter()
        seconds = max(now - self._started, 1e-9)
        step = {k: mean * replicas for k, mean in zip(self.FIELDS, means, strict=True)}
        for k in self.FIELDS:
            self.totals[k] += step[k]
        self.seconds += seconds
        self.window = dict.fromkeys(self.FIELDS, 0.0)
        self._started = now
        return self.rates(step, seconds, processes)

    def restart_clock(self) -> None:
        """Exclude what happened since the last step (evaluation, a checkpoint) from the next step's time."""
        self._started = time.perf_counter()

    def rates(self, counts: dict[str, float], seconds: float, processes: int) -> dict[str, float]:
        """Rates of ``counts`` over ``seconds`` (MFU against this run's peak once it is known)."""
        rates = {
            "tokens_per_second": counts["tokens"] / seconds,
            "samples_per_second": counts["samples"] / seconds,
            "tflops_per_process": counts["model_flops"] / seconds / processes / 1e12,
        }
        if self.peak is not None:
            rates["mfu"] = counts["model_flops"] / seconds / processes / self.peak[0]
        return rates

    def summary(self, processes: int) -> dict[str, Any]:
        """The whole run's numbers (``run_summary.json``)."""
        seconds = max(self.seconds, 1e-9)
        return {
            "train_steps_seconds": self.seconds,
            "train_tokens": self.totals["tokens"],
            "train_positions": self.totals["positions"],
            "train_padding_fraction": padding_fraction(self.totals["tokens"], self.totals["positions"]),
            "train_samples": self.totals["samples"],
            "model_flops": self.totals["model_flops"],
            "hardware_flops": self.totals["hardware_flops"],
            "processes": processes,
            "peak_tflops_per_process": self.peak[0] / 1e12 if self.peak else None,
            "peak_source": self.peak[1] if self.peak else None,
            **{f"train_{k}": v for k, v in self.rates(self.totals, seconds, processes).items()},
        }


def padding_fraction(tokens: float, positions: float) -> float | None:
    """The share of computed positions that are padding, ``1 - tokens / positions`` (None before any batch)."""
    return 1.0 - tokens / positions if positions else None


def padding_words(summary: dict[str, Any]) -> str:
    """``"padding 7.9% of tokens"`` from a run summary, for the closing line ("" when nothing was counted)."""
    fraction = summary.get("train_padding_fraction")
    return "" if fraction is None else f"padding {100 * fraction:.1f}% of tokens"


def _numel(weight: torch.Tensor) -> int:
    """The weight's element count as the model defines it (a ZeRO-3 parameter built partitioned holds none)."""
    from hftrain.models.weights import logical_shape

    return math.prod(logical_shape(weight))
