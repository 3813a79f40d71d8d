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


def report() -> str:
    """A human-readable environment report."""
    from hftrain.strategies import available_strategies
    from hftrain.strategies.platform import Platform

    plat = Platform.detect()
    lines = [f"{k}: {v}" for k, v in versions().items()]
    lines.append(f"device: {plat.device}  backend: {plat.backend}")
    lines.append(f"strategies: {', '.join(available_strategies())}")
    return "\n".join(lines)
