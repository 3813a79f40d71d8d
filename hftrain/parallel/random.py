"""Megatron's model-parallel RNG tracker: which random stream each dropout mask is drawn from under tp × pp.

Without it every rank draws every mask from one stream (the default generator, seeded alike everywhere), and two
pitfalls follow: *dropout masks copied across tensor-parallel ranks* (the attention probabilities of rank 0's heads
and rank 1's heads get the same mask, agreement 1.0 where independent masks at p agree on ``(1-p)² + p²``; under
sequence parallelism the residual-stream masks repeat every ``S/tp`` positions; stage 1 reuses stage 0's masks), and
*a run resumed at a larger tensor-parallel size silently diverges* (a new tp rank finds no RNG state and draws
other masks than its peers on replicated activations, so "replicated" weights drift apart).

Streams, as Megatron-LM's ``model_parallel_cuda_manual_seed`` and ``_set_random_seed`` lay them out:

- ``default``: the device's default generator. Identical on every tp rank of a stage (replicated regions:
  embeddings, the head, hidden dropout on whole sequences), seeded ``seed + 100·pp_rank`` so that stages differ.
  Data-parallel (and context-parallel) ranks share it, Megatron's default.
- ``tensor``: a per-rank stream, seeded ``seed + 100·pp_rank + 2718 + tp_rank``, used inside the tensor-parallel
  region (attention probabilities on this rank's heads, dropout on this rank's sequence chunk under sequence
  parallelism, LoRA dropout on this rank's input features).

A stream is *switched into* the default generator (its state swapped in and out, as Megatron's ``fork()``), so
every dropout implementation that draws from the default generator follows it unchanged: torch's dropout, SDPA's,
and hftrain's ``bits`` kernel (which seeds its SFC64 words with one draw from the default generator). Modules enter
a stream through forward hooks (:func:`run_in_stream`); the tensor-parallel plan says which (``region`` and
``sequence_dropout`` styles in ``hftrain.parallel.plans``).

Checkpoints keep every rank's streams under its mesh coordinates (``pp, tp, cp, dp``) (:func:`save_streams`); a resume
on the same layout restores them exactly, and a resume on another layout *rebuilds* them deterministically from
the checkpoint (:meth:`RNGTracker.rebuild`), the default stream identical over each new tp group, so replicated
tensors stay bit-identical. Hand-written because torch has no such tracker outside DTensor's (which tracks only
DTensor ops' offsets, not module dropout on plain tensors).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

STREAMS = ("default", "tensor")
PIPELINE_SEED_OFFSET = 100  # Megatron's seed + 100 * pp_rank
TENSOR_SEED_OFFSET = 2718  # Megatron's tensor-model-parallel offset
FILE = "rng_tracker.safetensors"


def _get_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on ``device`` (a uint8 tensor)."""
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The state of a generator on ``device`` seeded with ``seed`` (the default generator is left alone)."""
    return torch.Generator(device=device).manual_seed(seed % 2**63).get_state()


class RNGTracker:
    """The ``default`` and ``tensor`` random streams of one rank, and which one the default generator holds now.

    Args:
        seed: the run's seed (what every rank passed to ``set_seed``).
        tp_rank: this rank's index among the ranks holding different slices of the same parameters (its
            tensor-parallel rank: ``ParallelGroups.cut_coordinate``).
        pp_rank: this rank's pipeline stage (``ParallelGroups.stage``).
        device: the device whose default generator dropout draws from (activations' device).
    """

    def __init__(self, *, seed: int, tp_rank: int, pp_rank: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self.cut_rank = tp_rank
        self.stage = pp_rank
        self.device = torch.device(device)
        self._stored: dict[str, torch.Tensor] = {}  # states of the streams not in the default generator now
        self._active = "default"
        self._stack: list[str] = []

    @classmethod
    def for_groups(cls, groups: Any, *, seed: int, device: torch.device | str = "cpu") -> RNGTracker:
        """The tracker of this rank of a layout: its coordinates read from the axis traits (the stage axis, the axes
        cutting parameters), not from axis names.

        Args:
            groups: the run's ``ParallelGroups``.
            seed: the run's seed.
            device: as for the constructor.
        """
        return cls(seed=seed, tp_rank=groups.cut_coordinate, pp_rank=groups.stage, device=device)

    # ----------------------------------------------------------------- seeding
    def seed_streams(self) -> RNGTracker:
        """Seed both streams as Megatron does: ``default`` with ``seed + 100·pp`` on stages after the first (stage 0
        keeps the generator as the model's initialisation left it, identical on every tp rank), ``tensor`` with
        ``seed + 100·pp + 2718 + tp``."""
        self._require_default()
        stage_seed = self.seed + PIPELINE_SEED_OFFSET * self.stage
        if self.stage > 0:
            _set_state(self.device, _seeded_state(self.device, stage_seed))
        self._stored["tensor"] = _seeded_state(self.device, stage_seed + TENSOR_SEED_OFFSET + self.cut_rank)
        return self

    def rebuild(self, source: bytes) -> None:
        """Reseed both streams from ``source`` (bytes of the checkpoint's streams) after a layout change.

        The default stream's seed depends on ``source`` and the stage only, so every tp rank of a stage draws the
        same replicated masks; the tensor stream's on the tp rank too.

        Args:
            source: bytes every rank reads alike from the checkpoint (e.g. its first rank's states).
        """
        self._require_default()

        def seed_of(*parts: Any) -> int:
            digest = hashlib.sha256(source + json.dumps(parts).encode()).digest()
            return int.from_bytes(digest[:8], "little") % 2**63

        _set_state(self.device, _seeded_state(self.device, seed_of("default", self.stage)))
        self._stored["tensor"] = _seeded_state(self.device, seed_of("tensor", self.stage, self.cut_rank))

    # ----------------------------------------------------------------- switching
    def _switch(self, name: str) -> None:
        if name == self._active:
            return
        self._stored[self._active] = _get_state(self.device)
        _set_state(self.device, self._stored.pop(name))
        self._active = name

    def enter(self, name: str) -> None:
        """Make ``name`` the default generator's stream until the matching :meth:`exit` (nests)."""
        if name not in STREAMS:
            raise ValueError(f"unknown RNG stream {name!r}; streams: {', '.join(STREAMS)}")
        self._stack.append(self._active)
        self._switch(name)

    def exit(self) -> None:
        """Return to the stream that was active before the matching :meth:`enter`."""
        self._switch(self._stack.pop())

    @contextmanager
    def stream(self, name: str) -> Iterator[None]:
        """Draw from stream ``name`` inside the block (Megatron's ``get_cuda_rng_tracker().fork()`` for ``tensor``).

        Args:
            name: ``"default"`` or ``"tensor"``.
        """
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def checkpoint_contexts(self) -> tuple[Any, Any]:
        """``torch.utils.checkpoint``'s ``context_fn`` for a block that enters the ``tensor`` stream inside: the
        forward context records that stream's state, the recomputation context replays from it and then puts back
        the state the stream had reached (Megatron's ``CheckpointFunction``). torch itself saves and restores the
        default generator, which holds the ``default`` stream at the block's boundary."""
        recorded: dict[str, torch.Tensor] = {}

        @contextmanager
        def forward() -> Iterator[None]:
            recorded["tensor"] = self._stored["tensor"].clone()
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            reached = self._stored["tensor"]
            self._stored["tensor"] = recorded["tensor"].clone()
            try:
                yield
            finally:
                self._stored["tensor"] = reached

        return forward(), recompute()

    # ----------------------------------------------------------------- state
    def _require_default(self) -> None:
        if self._active != "default":
            raise RuntimeError(f"the RNG tracker is inside the '{self._active}' stream; leave it first")

    def states(self) -> dict[str, torch.Tensor]:
        """Both streams' generator states (copies), outside any stream."""
        self._require_default()
        return {"default": _get_state(self.device).clone(), "tensor": self._stored["tensor"].clone()}

    def load_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore both streams from :meth:`states` of the same rank."""
        self._require_default()
        _set_state(self.device, states["default"])
        self._stored["tensor"] = states["tensor"].clone()


def run_in_stream(module: nn.Module, tracker: RNGTracker, name: str) -> None:
    """Run ``module``'s forward (and whatever it calls) inside stream ``name`` of ``tracker``.

    A forward pre-hook enters the stream and a forward hook that runs even when the forward raises leaves it, so a
    failed step cannot leave the default generator holding the wrong stream.

    Args:
        module: e.g. an attention block (``tensor``), or a residual dropout under sequence parallelism.
        tracker: this rank's tracker.
        name: ``"default"`` or ``"tensor"``.
    """
    module.register_forward_pre_hook(lambda _module, _args: tracker.enter(name))
    module.register_forward_hook(lambda _module, _args, _output: tracker.exit(), always_call=True)


# ----------------------------------------------------------------- checkpoints
def _key(coords: dict[str, int], stream: str) -> str:
    return ".".join(f"{axis}{position}" for axis, position in coords.items()) + f".{stream}"


def save_streams(directory: str | Path, tracker: RNGTracker, *, groups: Any) -> None:
    """Write every rank's streams under its mesh coordinates (``ParallelGroups.coordinates``) into ``directory/FILE``.

    Collective over the world (one all-gather of the states, a few KiB per rank); the global rank 0 writes.

    Args:
        directory: the checkpoint's ``state/`` folder (exists on the main process).
        tracker: this rank's tracker.
        groups: the run's ``ParallelGroups``.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    from hftrain.parallel.host import gather_bytes

    states = tracker.states()
    axes = list(groups.coordinates)
    coords = torch.tensor(list(groups.coordinates.values()), dtype=torch.int64)
    flat = torch.cat([coords.view(torch.uint8), states["default"].cpu(), states["tensor"].cpu()])
    gathered = gather_bytes(flat)  # over the host group: a CUDA run's default group takes no CPU tensor
    if dist.get_rank() != 0:
        return
    size = states["default"].numel()
    tensors = {}
    head = 8 * len(axes)
    for row in gathered:
        where = dict(zip(axes, row[:head].view(torch.int64).tolist(), strict=True))
        tensors[_key(where, "default")] = row[head : head + size].clone()
        tensors[_key(where, "tensor")] = row[head + size :].clone()
    layout = {**groups.dims.sizes, "seed": tracker.seed}
    save_file(tensors, str(Path(directory) / FILE), metadata={"layout": json.dumps(layout)})


def load_streams(
    directory: str | Path, tracker: RNGTracker, *, groups: Any, read: Callable[[Path], bytes] | None = None
) -> str | None:
    """Restore this rank's streams from ``directory/FILE`` (no collective); returns a line to log, or None.

    The same layout restores each rank's own states (the run continues exactly as if uninterrupted). Another layout,
    or a checkpoint written before the tracker existed, rebuilds the streams deterministically from the checkpoint,
    identical over each tp group: the new ranks do not keep whatever they were seeded with.

    Args:
        directory: the checkpoint's ``state/`` folder.
        tracker: this rank's tracker.
        groups: the run's ``ParallelGroups``.
        read: reads a checkpoint file's bytes once, checked against its checksum (``checkpoint.sharded.
            read_verified``): the streams are parsed from those bytes, never from the path again, which a writer
            could have swapped since the check. None reads the file as it is (a test's tracker).
    """
    from safetensors.torch import load

    path = Path(directory) / FILE
    here = groups.dims.sizes
    if os.path.lexists(path):  # a link or a FIFO there is the reader's to refuse, not a checkpoint without streams
        data = read(path) if read is not None else path.read_bytes()
        saved = json.loads(_safetensors_metadata(data).get("layout", "{}"))
        tensors = load(data)
        coords = groups.coordinates
        first = dict.fromkeys(coords, 0)
        # A generator state of another device type (a CPU run resumed on a GPU: 5056 bytes against CUDA's 16)
        # does not load: rebuilt from the checkpoint as for another layout.
        same_device = tensors[_key(first, "default")].numel() == _get_state(tracker.device).numel()
        if {axis: saved.get(axis) for axis in here} == here and same_device:
            tracker.load_states({s: tensors[_key(coords, s)] for s in STREAMS})
            return None
        source = b"".join(tensors[_key(first, s)].numpy().tobytes() for s in STREAMS)
        described = " × ".join(f"{axis}={saved.get(axis)}" for axis in here)
        if not same_device:
            described += f", written with another device's generator than {tracker.device.type}'s"
    else:  # a checkpoint written before the tracker: seeded from what every rank agrees on, its folder's name
        source = Path(directory).resolve().parent.name.encode()
        described = "unrecorded"
    tracker.rebuild(source)
    now = " × ".join(f"{axis}={value}" for axis, value in here.items())
    return (
        f"RNG streams rebuilt for the layout {now} (the checkpoint's is {described}): every tp group draws "
        "identical replicated dropout masks"
    )


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes (its 8-byte header length, then the JSON header)."""
    length = int.from_bytes(data[:8], "little")
    if len(data) < 8 or length > len(data) - 8:
        raise ValueError(f"{FILE} is truncated (its header says {length} bytes, {len(data) - 8} follow)")
    metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{FILE}'s __metadata__ is not a mapping")
    return metadata
