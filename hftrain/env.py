"""``hftrain env``: versions, devices, backend and which strategies can run on this machine."""

from __future__ import annotations

import importlib.metadata
import platform as _platform

PACKAGES = ("torch", "accelerate", "deepspeed", "transformers", "datasets", "peft", "evaluate", "safetensors")


def versions() -> dict[str, str]:
    """Installed versions of the stack (``missing`` when absent)."""
    found = {"python": _platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def report(*, check_ops: bool = True) -> str:
    """A human-readable environment report.

    Args:
        check_ops: also load (building once, ~1 min) DeepSpeed's CPU Adam op that optimizer offload needs.
    """
    import os

    from hftrain.strategies import available_strategies, strategy_class
    from hftrain.strategies.platform import Platform

    plat = Platform.detect()
    lines = [f"{k}: {v}" for k, v in versions().items()]
    lines.append(f"device: {plat.device}  backend: {plat.backend}  cores: {os.cpu_count()}")
    lines.append("strategies:")
    for name in available_strategies():
        reason = strategy_class(name).unavailable_reason()
        lines.append(f"  {name}: {'can run' if reason is None else 'cannot run: ' + reason}")
    if check_ops and strategy_class("zero2").unavailable_reason() is None:
        from hftrain.strategies.deepspeed import cpu_adam_status

        reason = cpu_adam_status()
        lines.append(f"  zero2/zero3 offload_optimizer: {'can run' if reason is None else 'cannot run: ' + reason}")
    return "\n".join(lines)
