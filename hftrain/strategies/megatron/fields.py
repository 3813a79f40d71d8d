"""The megatron strategy's config names for the layout axes ``hftrain.parallel`` refuses values of.

``hftrain.parallel`` names an axis (``tp``, ``pp``, ``virtual_stages``) and knows no config; this strategy took
those values from the ``parallelism`` section, so its refusals name ``parallelism.<axis>`` (and the launcher for
the world size).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from hftrain.errors import AxisError


@contextlib.contextmanager
def named_by_config() -> Iterator[None]:
    """Re-raise an ``AxisError`` naming the config field (or the launcher) its value came from."""
    try:
        yield
    except AxisError as error:
        field = "the launcher's process count" if error.axis == "world_size" else f"parallelism.{error.axis}"
        raise error.named_as(field) from None
