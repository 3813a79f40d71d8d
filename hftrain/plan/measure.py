"""Measured counterparts of the planner's estimates, read from live objects (used by tests and benchmarks).

- ``saved_activation_bytes``: the bytes autograd saves for backward during one forward pass, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; parameters and buffers excluded, since they
  are model states, not activations).
- ``model_state_bytes``: per-rank bytes of parameters, gradients and optimizer state of a plain (non-DeepSpeed,
  non-FSDP) model and optimizer, e.g. a tensor-parallel shard. DeepSpeed and FSDP objects are read by
  ``tests/test_sharding.py``'s reader, which knows their internal buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _storage_key(tensor: Any) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_activation_bytes(model: Any, forward: Callable[[], Any]) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward()`` runs, each storage counted once.

    Args:
        model: the module whose parameters and buffers are excluded (they are saved too, but are model state).
        forward: runs the forward pass (its result is discarded; backward is not run).
    """
    import torch

    excluded = {_storage_key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            address, size = _storage_key(tensor)
            if address and address not in excluded:
                seen[address] = size
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


def model_state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (each storage once).

    Args:
        model: a module whose ``parameters()`` are this rank's (local shards under tensor parallelism).
        optimizer: a torch optimizer (or one wrapping it as ``.optimizer``) whose ``state`` holds its tensors.
    """
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    if hasattr(inner, "optim"):  # ZeroRedundancyOptimizer keeps the local optimizer as .optim
        inner = inner.optim
    groups = {
        "params": list(model.parameters()),
        "grads": [p.grad for p in model.parameters() if p.grad is not None],
        "optimizer": [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
    }
    counted: set[int] = set()
    result = {}
    for name, tensors in groups.items():
        total = 0
        for tensor in tensors:
            address, size = _storage_key(tensor)
            if address and address not in counted:
                counted.add(address)
                total += size
        result[name] = total
    return result
