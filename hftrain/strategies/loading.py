"""A pretrained model loaded without a whole copy per rank: the transformer blocks held as the strategy holds them.

``from_pretrained`` gives every process the whole model: 8 copies on an 8-GPU node, and a ZeRO-3 or FSDP rank
peaks at the whole model before it shards it. Here each rank leaves its model's transformer blocks (nearly all the
weights) out of ``from_pretrained`` (``hftrain.models.partial``: they stay on ``meta``; the embeddings, norms and
a new head are loaded and initialised by transformers exactly as before, from the same random stream), and the
strategy's :class:`BlockLoading` gives them their weights:

=====================  ===========================================================================================
``ReadLoading``        DDP and ZeRO-1/2 on rank 0 (and a 1-process run): each block given host memory and read
                       with ``pread`` (``hftrain.models.weights``: no memory map). The model is the process's own
                       memory at once, never a copy-on-write map of the file that the first optimizer step would
                       copy page by page, and never the file's pages plus a copy of them.
``ReplicaLoading``     DDP and ZeRO-1/2, every rank but 0: the blocks get uninitialised memory (``to_empty``) and
                       are never read; the wrapper's broadcast from rank 0 in ``prepare`` writes rank 0's weights into
                       them (DDP's ``_sync_module_states``, DeepSpeed's ``_broadcast_model``: one broadcast per
                       tensor, as before). A node holds its N replicas, not N replicas and N mapped files.
``ShardedLoading``     ZeRO-3 and FSDP2: one block at a time is given host memory, read from the safetensors files
                       with ``pread`` (``hftrain.models.weights``: no memory map) and sharded at once, so the whole
                       block is freed before the next is read: a rank peaks at its shards plus one block. No
                       collective: every rank reads the bytes it keeps (and the rest of its block) from the folder.
``FSDP1Loading``       FSDP1 (``hftrain.strategies.fsdp``): the blocks stay on ``meta`` until ``prepare``. FSDP1's
                       constructor wraps one unit at a time (post-order) and first materialises a unit on ``meta``
                       with the plugin's ``param_init_fn``, here: give the block host memory and read it with
                       ``pread``; FSDP then flattens and shards it before the next unit: a rank peaks at its shards
                       plus one block (and its flat copy). No collective.
``MegatronLoading``    megatron (``hftrain.strategies.megatron.loading``): a rank's pipeline stages' blocks only (the
                       other stages stay on ``meta``); under tp each tensor the plan splits stays on ``meta`` until
                       ``prepare`` splits it, then reads this rank's slice only (``hftrain.parallel.deferred``: output
                       rows by byte range, a row-parallel weight whole then sliced), the rest of each block read at
                       once: a rank peaks at its shards plus one tensor. No collective.
=====================  ===========================================================================================

Exactness: the blocks hold the file's bytes, cast as ``from_pretrained`` casts them (``Tensor.copy_``); a block is
read only when every one of its tensors is stored under its name and shape and it holds no buffer
(``hftrain.models.weights.blocks_in``), otherwise ``from_pretrained`` loads it. Resume and export see the same
model as before: what is sharded is sharded exactly as the strategy's ``prepare`` would have sharded it.

Why hand-written: transformers' own paths keep a whole copy on some rank (ZeRO-3 under ``zero.Init`` has rank 0
read every tensor from a memory map and broadcast it, Accelerate's ``cpu_ram_efficient_loading`` has rank 0 hold
the whole state dict, and needs a GPU for FSDP1's broadcast), and neither reads a shard without its whole file
mapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import nn

    from hftrain.models.weights import Weights


class BlockLoading:
    """How a strategy holds the blocks a rank leaves out of ``from_pretrained`` (``hftrain.models.weights``'s
    protocol): :meth:`place` each one in turn."""

    name: ClassVar[str] = "this strategy"
    supports_lora: ClassVar[bool] = True

    def materialize(self, model: nn.Module, blocks: list[str], weights: Weights) -> None:
        for path in blocks:
            self.place(path, model.get_submodule(path), weights)

    def place(self, path: str, block: nn.Module, weights: Weights) -> None:
        raise NotImplementedError

    def describe(self, count: int) -> str:
        raise NotImplementedError


class ReplicaLoading(BlockLoading):
    """Ranks other than 0 of a replicating strategy: the blocks' memory, unread, for ``prepare``'s broadcast."""

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]

    def place(self, path: str, block: nn.Module, weights: Weights) -> None:
        block.to_empty(device="cpu")

    def describe(self, count: int) -> str:
        return (
            f"{count} transformer blocks not read on this rank: {self.name}'s broadcast from rank 0 fills them in "
            "prepare (rank 0 reads the whole model)"
        )


class ReadLoading(BlockLoading):
    """Each block given host memory and read from the files (a replica's rank 0, one process)."""

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]

    def place(self, path: str, block: nn.Module, weights: Weights) -> None:
        block.to_empty(device="cpu")
        for name, param in block.named_parameters():
            entry = weights.find(f"{path}.{name}", tuple(param.shape))
            assert entry is not None, f"{path}.{name}: blocks_in chose a block whose tensor is not stored"
            weights.read_into(entry, param.data)

    def describe(self, count: int) -> str:
        return f"{count} transformer blocks read from the safetensors files into this process's memory ({self.name})"


class ShardedLoading(ReadLoading):
    """A sharding strategy: each block read whole into host memory, then sharded (:meth:`shard`) and freed."""

    def __init__(self) -> None:
        pass

    def place(self, path: str, block: nn.Module, weights: Weights) -> None:
        super().place(path, block, weights)
        self.shard(block)

    def shard(self, block: nn.Module) -> None:
        """Shard ``block`` (its full weights on the host) as the strategy's ``prepare`` would, freeing them."""
        raise NotImplementedError

    def describe(self, count: int) -> str:
        return f"{count} transformer blocks read from the safetensors files one at a time and sharded ({self.name})"


def replica_loading(name: str, accelerator: Any) -> BlockLoading:
    """:class:`ReplicaLoading` on every rank but 0 of a multi-process run, :class:`ReadLoading` on rank 0."""
    if accelerator.num_processes < 2 or accelerator.process_index == 0:
        return ReadLoading(name)
    return ReplicaLoading(name)
