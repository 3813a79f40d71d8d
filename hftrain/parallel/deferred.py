"""Parameters a loader leaves on ``meta`` until an axis splits them: this rank's slice read from the checkpoint then,
never the whole tensor.

A loader (megatron's, ``hftrain.strategies.megatron.loading``) marks a ``meta`` parameter with a reader
(:func:`defer`): ``read(split)`` returns ``split.local(W)`` of the checkpoint's tensor ``W`` (the file's bytes, cast as
``from_pretrained`` casts them), and ``read(None)`` the whole ``W``. Where tensor parallelism replaces the parameter
by its slice (``hftrain.parallel.layers``: the column-, row- and width-parallel layers), :func:`local_slice` calls
the reader instead of slicing a full tensor; what no split reaches is read whole by :func:`read_remaining`, which
the plugin calls once the model is split (``MegatronPlugin.parallelize``). A parameter without a reader (a pipeline
rank's other stages, left on ``meta`` for good) is never touched.

Exactness: ``split.local`` of the file's tensor is what the split of a ``from_pretrained`` model holds, element by
element (a cast commutes with a slice), so the model after the split is bit-identical to the whole load's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hftrain.parallel.placement_records import Split

READER = "hftrain_deferred_read"  # parameter attribute: its reader
Reader = Callable[["Split | None"], "torch.Tensor"]


def defer(param: nn.Parameter, read: Reader) -> None:
    """Mark ``param`` (on ``meta``) as read by ``read`` when it is split (or whole, by :func:`read_remaining`)."""
    setattr(param, READER, read)


def local_slice(tensor: torch.Tensor, split: Split) -> torch.Tensor:
    """This rank's slice of ``tensor`` under ``split``: read from the checkpoint for a deferred parameter, else
    ``split.local`` of its values (a copy either way)."""
    read = getattr(tensor, READER, None) if tensor.is_meta else None
    return split.local(tensor.detach()) if read is None else read(split)


def read_remaining(model: nn.Module) -> list[str]:
    """Give every deferred parameter of ``model`` that no split replaced its whole values, in place (the same
    ``Parameter`` object, now host memory: ``torch.utils.swap_tensors``); returns their names."""
    import torch

    done = []
    for name, param in model.named_parameters():
        read = getattr(param, READER, None) if param.is_meta else None
        if read is None:
            continue
        host = torch.nn.Parameter(read(None), requires_grad=param.requires_grad)
        host.__dict__.update({k: v for k, v in param.__dict__.items() if k != READER})
        torch.utils.swap_tensors(param, host)
        done.append(name)
    return done
