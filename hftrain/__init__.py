"""hftrain: distributed fine-tuning over Hugging Face Accelerate and DeepSpeed, done right.

Importing the package is cheap; heavy libraries load in the modules that need them. The Python API
(``make_config``, ``train``, ``load_splits``; see ``hftrain.api``) is imported on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it, imported on first attribute access (PEP 562).
_LAZY = {
    "make_config": "hftrain.api",
    "with_fields": "hftrain.api",
    "train": "hftrain.api",
    "load_splits": "hftrain.api",
    "TrainConfig": "hftrain.config",
    "JobResult": "hftrain.job",
    "HFTrainError": "hftrain.errors",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hftrain' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
