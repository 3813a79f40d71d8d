"""Data loading for hftrain: local files and embedded datasets as text/label splits."""

from __future__ import annotations

from hftrain.data.embedded import EMBEDDED_DATASETS
from hftrain.data.loading import load_classification_splits

__all__ = ["EMBEDDED_DATASETS", "load_classification_splits"]
