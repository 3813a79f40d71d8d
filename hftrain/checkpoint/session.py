"""A run's checkpoint protocol: what a save records and how a resume verifies, checks and restores it.

The Trainer holds one :class:`CheckpointSession`, built from what the protocol needs (the runtime, the training
arguments, the checkpoint manager, the run's identity and topology) and never from the Trainer itself: this package
sits below ``hftrain.trainers``. The trainer state it saves and restores is any dataclass of plain fields (the
Trainer's ``TrainerState``); the session knows its fields, not its meaning, except the counters a resume checks
(``checkpoint.resume``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.checkpoint.manager import STATE_DIR, CheckpointError, CheckpointManager, VerifiedCheckpoint
from hftrain.checkpoint.resume import (
    batches_to_skip,
    check_position,
    check_resumable,
    check_stream_position,
    check_trusted,
)
from hftrain.checkpoint.safety import check_no_code, check_rng_states

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclasses.dataclass
class Resumed:
    """What :meth:`CheckpointSession.resume` restored besides the model, optimizer, scheduler and RNG."""

    state: Any
    """The trainer state of the checkpoint (its ``micro_step`` already this run's)."""
    skip: int
    """Micro-batches of the current epoch this process already consumed, in this run's topology: the loader skips
    them."""
    rank_state: dict[str, Any] | None = None
    """This rank's own state saved beside the trainer state (a training stream's position), when asked for."""


class CheckpointSession:
    """Saves a run's checkpoints and resumes from one, for a Trainer that holds it.

    Args:
        runtime: the strategy's runtime (``hftrain.strategies.runtime``): writes and loads the state, and answers
            the collective questions (``any_rank``, ``reports``, ``is_main_process``, ``num_processes``).
        args: the ``training`` config section (``output_dir``, ``async_save``, ``trust_external_checkpoint``,
            ``seed``, ``gradient_accumulation_steps``).
        manager: the run's :class:`~hftrain.checkpoint.manager.CheckpointManager`.
        state_type: the trainer state's dataclass, built from a checkpoint's ``trainer_state``.
        run_id: the run's id, stored in every checkpoint.
        topology: the strategy summary (strategy, world size, batch geometry), stored and checked on resume.
        run_config: the resolved flat job config, stored and checked on resume.
        strategies: the strategy names this hftrain knows (a checkpoint naming another is damaged).
        versions: the library versions recorded in a checkpoint (called at each save).
        log: where notes go (the main process's log).
    """

    def __init__(
        self,
        runtime: Any,
        args: Any,
        manager: CheckpointManager,
        *,
        state_type: type,
        run_id: str | None,
        topology: dict[str, Any],
        run_config: dict[str, Any],
        strategies: tuple[str, ...],
        versions: Callable[[], dict[str, str]],
        log: Callable[[str], None],
    ) -> None:
        self.runtime = runtime
        self.args = args
        self.manager = manager
        self.state_type = state_type
        self.run_id = run_id
        self.topology = topology
        self.run_config = run_config
        self.strategies = strategies
        self.versions = versions
        self.log = log
        self.last: Path | None = None
        """The last checkpoint written or resumed from."""
        self.last_step: int | None = None
        """Its step (a trusted checkpoint's folder may be named freely)."""
        self._verified: Any = None  # the checkpoint being resumed (manager.VerifiedCheckpoint)

    # ----------------------------------------------------------------- save
    def save(
        self, trainer_state: dict[str, Any], *, step: int, max_steps: int, rank_state: dict[str, Any] | None = None
    ) -> Path:
        """Write a complete checkpoint of step ``step`` (collective: every rank calls it); returns its folder.

        Its ``checkpoint.json`` records the run id, the trainer state, the topology, the config and the versions.
        The write runs in the background under ``async_save``; at the run's last step (``step ≥ max_steps``) no
        optimizer step changes the states before the run waits for the write, so the manager may write from the
        live tensors.

        Args:
            trainer_state: the trainer state as plain data.
            step: the optimizer steps taken.
            max_steps: the run's last step.
            rank_state: this rank's own plain state (a training stream's position; every rank gives one or none).
        """
        meta = {
            "run_id": self.run_id,
            "trainer_state": trainer_state,
            "topology": self.topology,
            "config": self.run_config,
            "versions": self.versions(),
        }
        self.last_step = step
        self.last = self.manager.save(
            self.runtime,
            step=step,
            meta=meta,
            background=self.args.async_save,
            live=step >= max_steps,
            rank_state=rank_state,
        )
        return self.last

    def wait(self) -> None:
        """Wait until the checkpoint being written in the background, if any, is complete (collective)."""
        self.manager.wait()

    def checkpointed_step(self) -> int | None:
        """The step of the last checkpoint written or resumed from; None when there is none."""
        return self.last_step

    def detach(self) -> None:
        """Drop the runtime (and through it the model), so that the Trainer's ``close`` frees them; the last
        checkpoint stays known."""
        self.runtime = None

    # ----------------------------------------------------------------- resume
    def resume(
        self,
        spec: str,
        *,
        model: Any,
        optimizer: Any,
        micro_batches: int | None,
        max_steps: int,
        opened: VerifiedCheckpoint | None = None,
    ) -> Resumed | None:
        """Restore model, optimizer, scheduler and RNG from a checkpoint (after ``prepare``); return its trainer
        state and the data position, or None when ``spec`` is ``auto`` and there is no checkpoint yet.

        In order: the checkpoint must be inside ``output_dir`` or trusted, and in the sharded format (one of the
        per-strategy formats before it is refused); the main process verifies every checksum
        and unpickles every file with a restricted unpickler; it must be of this model and task, in a layout this
        run can load, at a position of this run; then the state is loaded into the live objects (after
        ``prepare``, so the scheduler and optimizer it restores are the live ones: pitfall "LR schedule resets
        after resume", docs/pitfalls.md). Every refusal is a :class:`CheckpointError`, raised on every rank.

        Args:
            spec: ``latest``, ``auto`` or a checkpoint folder.
            model: the prepared model.
            optimizer: the prepared optimizer.
            micro_batches: micro-batches per epoch on each process of this run; None: a stream (no epochs): the
                checkpoint must be of a stream on as many data-parallel ranks, and each rank's position
                (``rank_state``, :func:`~hftrain.checkpoint.manager.rank_state_file`) is read and returned.
            max_steps: this run's last step.
            opened: the checkpoint ``spec`` names, as the command's checks opened it (``hftrain.validate.RunPlan``):
                its ``checkpoint.json`` is not read again; None: opened here.
        """
        opened = opened if opened is not None else self.manager.open(spec)  # its checkpoint.json read once
        if opened is None:
            self.log(f"resume_from_checkpoint: {spec}: no checkpoint yet, starting fresh")
            return None
        path = opened.path
        check_trusted(path, Path(self.args.output_dir), trusted=self.args.trust_external_checkpoint)
        from hftrain.checkpoint.sharded import check_sharded  # torch.distributed.checkpoint: imported when used

        check_sharded(path / STATE_DIR)  # a checkpoint of the per-strategy formats before it: one line
        meta = self._read_verified(opened)
        notes = check_resumable(
            meta, path=path, run_config=self.run_config, topology=self.topology, strategies=self.strategies
        )
        if micro_batches is None:
            check_stream_position(meta, path=path, topology=self.topology, max_steps=max_steps)
            skip = 0
        else:
            skip = batches_to_skip(meta, self.topology)
            check_position(
                meta,
                path=path,
                skip=skip,
                micro_batches=micro_batches,
                accumulation=self.args.gradient_accumulation_steps,
                max_steps=max_steps,
            )
        self._load_state(path, model=model, optimizer=optimizer)
        rank_state = self._read_rank_state(path) if micro_batches is None else None
        state = _trainer_state(path, meta["trainer_state"], self.state_type)
        # a stream counts every micro-batch of the run (this run's accumulation), an epoch's the ones into it
        state.micro_step = (
            skip if micro_batches is not None else state.global_step * self.args.gradient_accumulation_steps
        )
        self.last, self.last_step = path, state.global_step
        notes += _rng_notes(meta["topology"]["world_size"], self.runtime.num_processes, self.args.seed)
        for note in notes:
            self.log(note)
        if micro_batches is None:
            where = "each data-parallel rank at its saved stream position"
        else:
            where = f"epoch {state.epoch}, {skip} batches into it"
        self.log(f"resumed from {path} at step {state.global_step} ({where})")
        return Resumed(state, skip, rank_state)

    def _read_rank_state(self, path: Path) -> dict[str, Any]:
        """This rank's ``rank_state_<rank>.json`` of the verified checkpoint (its checksum checked on the bytes read);
        a rank that cannot read its own is refused on every rank alike."""
        import json

        from hftrain.checkpoint.manager import rank_state_file

        file = rank_state_file(path / STATE_DIR)
        error: CheckpointError | None = None
        state: dict[str, Any] = {}
        try:
            state = json.loads(self._verified.read(file))
        except CheckpointError as raised:
            error = raised
        except ValueError as raised:
            error = CheckpointError(f"checkpoint '{path}': {file.name} is not JSON ({raised}); it is damaged")
        if not isinstance(state, dict) and error is None:
            error = CheckpointError(f"checkpoint '{path}': {file.name} is not a JSON object; it is damaged")
        if self.runtime.any_rank(error is not None):
            says = self.runtime.reports(error)
            if error is not None:
                error.every_rank = says
            raise error or CheckpointError(f"checkpoint '{path}': another process cannot read its stream position")
        return state

    def _read_verified(self, opened: VerifiedCheckpoint) -> dict[str, Any]:
        # The main process checks every checksum and loads every pickled file once with a restricted unpickler
        # (nothing in a checkpoint runs code); the others wait for its verdict instead of re-reading.
        # Every rank then loads through its VerifiedCheckpoint (_load_state): each small file read once, its checksum
        # checked on those bytes, which are what is parsed (issue 52's check-then-load race).
        error = None
        path = opened.path
        if self.runtime.is_main_process:
            try:
                opened.verify()
                check_no_code(path, path / STATE_DIR)
                meta = opened.meta
                check_rng_states(path, path / STATE_DIR, meta["topology"]["world_size"], self.runtime.num_processes)
            except CheckpointError as raised:
                error = raised
        failed = self.runtime.any_rank(error is not None)
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"checkpoint '{path}' failed verification on the main process; see its error")
        from hftrain.parallel.host import broadcast_object

        # Every rank compares each file it opens with the main process's record of the file it verified (a file
        # renamed over it since is refused on every rank, not only on the main process).
        record = broadcast_object((opened.identities, opened.machine) if self.runtime.is_main_process else None)
        if not self.runtime.is_main_process:
            opened.adopt(*record)
        self._verified = opened
        return opened.meta

    def _load_state(self, path: Path, *, model: Any, optimizer: Any) -> None:
        """Load the verified state; a file that does not fit this run (a missing key, another shape) is one line.

        Every rank agrees on the outcome, so a rank whose load failed does not leave the others waiting.
        """
        error: Exception | None = None
        try:
            with self._verified.active():  # every loader below reads through it
                self.runtime.load_state(str(path / STATE_DIR), model=model, optimizer=optimizer)
        except CheckpointError as raised:
            error = raised
        except Exception as raised:  # the libraries' load errors: RuntimeError (keys, shapes), KeyError, ValueError
            reason = " ".join(str(raised).split())[:300] or type(raised).__name__
            error = CheckpointError(
                f"checkpoint '{path}': its state does not load into this run ({type(raised).__name__}: {reason}); "
                "resume from another checkpoint, or with the config that wrote it"
            )
        if self.runtime.any_rank(error is not None):
            # Collective: a rank whose load failed differently (only its RNG file) says why; ranks that failed
            # alike say it once per machine.
            says = self.runtime.reports(error)
            if error is not None:
                error.every_rank = says
            raise error or CheckpointError(f"checkpoint '{path}' failed to load on another process; see its error")


def _trainer_state(path: Path, saved: dict[str, Any], state_type: type) -> Any:
    """The trainer state of ``checkpoint.json`` (its integer fields are checked by ``read_checkpoint``)."""
    known = {f.name for f in dataclasses.fields(state_type)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise CheckpointError(
            f"checkpoint '{path}': checkpoint.json's trainer_state has an unknown key '{unknown[0]}'; it is damaged "
            "or written by another hftrain: resume from another checkpoint"
        )
    return state_type(**saved)


def _rng_notes(saved_world: int, live_world: int, seed: int) -> list[str]:
    """What a change of process count does to the per-process RNG states (each process restores its own rank's)."""

    def processes(first: int, last: int) -> str:
        return f"process {first}" if first == last else f"processes {first} to {last}"

    if live_world > saved_world:
        return [
            f"{processes(saved_world, live_world - 1)} of this run have no RNG state in the checkpoint (written by "
            f"{saved_world}); they keep the RNG they started with (seed {seed})"
        ]
    if live_world < saved_world:
        return [
            f"the RNG states of the checkpoint's {processes(live_world, saved_world - 1)} are not used (this run has "
            f"{live_world}); random streams (dropout) continue from those of {processes(0, live_world - 1)}"
        ]
    return []
