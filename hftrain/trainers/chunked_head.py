"""A language model's loss without its whole logits: the output projection and the cross entropy run chunk by chunk.

For a micro-batch of ``T`` positions (all rows together) and a vocabulary ``V``, the next-token loss of position ``t``
is ``ℓ_t = logsumexp(W h_t) − (W h_t)_{y_t}``. Built whole, the logits ``[T, V]``, their fp32 copy, log-softmax and
gradient are each ``T·V·4`` bytes: at ``T = 1,024`` and SmolLM2's ``V = 49,152``, 0.2 GB each; a tiny Llama's
run peaked at 1.47 GiB with them against 0.79 GiB in chunks (``benchmarks/lm_loss_memory.py``). Here, while the
loss's forward runs, the output projection's ``forward`` is replaced by one that takes the hidden states ``[b, s, h]``
and returns the per-position losses ``[b, s]`` (fp32, 0 where the target is ``-100``):

    for each chunk c of C positions:  ℓ_c = token_losses(head, head.forward(h_c), y_c)

with ``torch.utils.checkpoint`` (non-reentrant) around each chunk: its forward keeps only the chunk's hidden states (a
view) and its targets, and the backward recomputes the chunk's logits, so the step holds one chunk's logits and
their gradient at a time (``C·V·4`` bytes each; pitfall "a language model's step holds its whole logits",
docs/pitfalls.md). The head's own forward and ``token_losses`` run per chunk, so under tensor parallelism the
vocabulary-parallel projection and its cross entropy (``hftrain.parallel.cross_entropy``) chunk the same way, every
tp rank through the same chunks in the same order. The values are those of the whole logits' loss: the same rows
through the same head and the same cross entropy (within fp32 rounding, a matmul's blocking depends on its row
count). No collective of its own.

Only the head's bound ``forward`` changes, and only inside :meth:`ChunkedHead.losses`: the module, its parameter
names, the hooks that strategies put on it (FSDP's unshard, ZeRO-3's gather, DDP's reducer, which all wrap
``__call__``), evaluation elsewhere and the export see the model as it is. Hand-written because torch and transformers
offer no chunked loss for an arbitrary head: Liger's fused linear cross entropy is a Triton kernel for CUDA (and a
plain ``nn.Linear``), not a vocabulary-parallel shard on a CPU.

A family's causal-LM forward may change the logits after the head (Gemma-2's soft-capping, Cohere's logit scale,
Granite's scaling, an encoder-decoder's final bias), which would then apply to the losses instead; and a pipeline's
last stage hands the loss outputs its schedule already computed. The first call watches the head: the losses are
used only if the head ran and the model returned its output itself (the same memory: no host read, no extra forward).
Otherwise that micro-batch and every later one build the whole logits, said in one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

AUTO_LOGITS = {"cpu": 2**22, "accelerator": 2**26}
"""``training.loss_chunk_tokens: auto``: about this many logits per chunk. A chunk's step holds some eight ``[C, V]``
fp32 tensors at once (the logits, the cross entropy's, their gradients): measured 1.6 MB per position at ``V =
49,152`` (``benchmarks/lm_loss_memory.py``). On a CPU 2^22 (16 MiB a tensor): 64 positions there add ~0.1 GB where the
whole 1,024-token logits added 0.95. On an accelerator 2^26 (256 MiB a tensor, ~2 GiB a chunk's step): fewer,
larger chunks (1,024 positions at 49,152 rows), since each chunk is a few kernel launches and a checkpoint's host
work, and a GPU's memory is tens of GiB."""


def auto_chunk(rows: int, device_type: str = "cpu") -> int:
    """``training.loss_chunk_tokens: auto`` for a head with ``rows`` (local) vocabulary rows on ``device_type``: the
    largest power of two at most ``AUTO_LOGITS / rows``, within [16, 16384]."""
    budget = AUTO_LOGITS["cpu" if device_type == "cpu" else "accelerator"]
    wanted = max(1, budget // max(1, rows))
    return min(16384, max(16, 1 << (wanted.bit_length() - 1)))


class ChunkedHead:
    """The loss's forward through the model with the head computing per-position losses, ``chunk`` positions at a time.

    Args:
        head: the model's output projection (``get_output_embeddings()``), vocabulary-parallel or not.
        chunk: positions per chunk (``training.loss_chunk_tokens``; ``"auto"``: :func:`auto_chunk` of the head's rows).
        token_losses: ``(head, logits, targets) -> [.., positions]`` fp32 losses, 0 at ``-100``.
        log: where the one-line outcome of the first call's check goes.
    """

    def __init__(
        self,
        head: torch.nn.Module,
        chunk: int | str,
        token_losses: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor],
        log: Callable[[str], None],
    ) -> None:
        chunk = auto_chunk(head.weight.shape[0], head.weight.device.type) if chunk == "auto" else int(chunk)
        self.head, self.chunk, self.token_losses, self.log = head, chunk, token_losses, log
        self.checked: bool | None = None  # None: not yet compared; False: the family changes its logits

    def losses(self, model: torch.nn.Module, inputs: dict[str, Any], targets: torch.Tensor) -> torch.Tensor | None:
        """The per-position losses ``[b, s]`` of ``model(**inputs)`` against ``targets``, or None where this model's
        output is not its head's (the caller then computes the whole logits, as every later call does).

        Args:
            model: the (wrapped) model whose forward runs.
            inputs: its keyword inputs.
            targets: ``[b, s]`` next-token targets aligned with the positions the model returns.
        """
        if self.checked is False:
            return None
        returned: list[torch.Tensor] = []
        watch = self.head.register_forward_hook(lambda _module, _args, output: returned.append(output))
        try:
            with self._head_returns_losses(targets):
                losses = model(**inputs).logits
        finally:
            watch.remove()
        if self.checked is None:
            # the same tensor, or a view of it that a strategy's hook made (ZeRO-3 detaches module outputs into its
            # backward hook): same memory and shape; a family that soft-caps or scales returns new memory
            self.checked = bool(returned) and _same_memory(returned[-1], losses)
            self.log(
                f"loss: the output projection and cross entropy in chunks of {self.chunk} positions (no whole logits; "
                "training.loss_chunk_tokens)"
                if self.checked
                else f"loss: {type(model).__name__} does not return its output projection's logits as they are "
                "(soft-capping or scaling after it, or a pipeline stage); its whole logits are built "
                "(training.loss_chunk_tokens does not apply)"
            )
        return losses if self.checked else None

    @contextlib.contextmanager
    def _head_returns_losses(self, targets: torch.Tensor) -> Iterator[None]:
        head, original = self.head, self.head.forward
        chunk, token_losses = self.chunk, self.token_losses

        def chunk_losses(hidden: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
            return token_losses(head, original(hidden), wanted)

        def forward(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            rows, positions = hidden.shape[0], hidden.shape[1]
            flat, wanted = hidden.reshape(rows * positions, 1, -1), targets.reshape(rows * positions, 1)
            parts = [
                checkpoint(
                    chunk_losses,
                    flat[i : i + chunk],
                    wanted[i : i + chunk],
                    use_reentrant=False,
                    preserve_rng_state=False,
                )  # fmt: skip
                for i in range(0, flat.shape[0], chunk)
            ]
            return torch.cat(parts).reshape(rows, positions)

        own = head.__dict__.get("forward")  # an instance's own forward (None: the class's)
        head.forward = forward
        try:
            yield
        finally:
            if own is None:
                del head.forward
            else:
                head.forward = own


def _same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are tensors of one shape over the same memory."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )
