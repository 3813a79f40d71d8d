"""The one validation pass of a job, run before anything is written.

``validate_job`` checks the platform and strategy, ``output_dir``, the resume request and the model folder
(``hftrain.models.checks``); ``hftrain.job.prepare_job`` runs it, then loads and checks the data, builds the
trainer (which verifies the resume checkpoint against the live topology) and only then writes the run's config.
A refused command therefore leaves a run directory exactly as it was and creates none. A new command or
strategy gets all of this by calling ``validate_job`` (or ``prepare_job``) first.

What a run directory may be asked to do by a later command (``plan_run`` decides it, once):
- resume, extend (more ``max_steps``/``num_train_epochs``), change its logging/eval/save cadence, or move
  (``config.RUN_INVARIANT_EXEMPT``): accepted;
- change the model, data, optimisation or strategy: refused naming the field; the global batch is checked
  against the checkpoint (``checkpoint.resume``), where the process count is known;
- start again without resuming: refused, since the new run's checkpoints would mix with the old run's;
- with ``overwrite_output_dir``: a new run replaces the old one, whose outputs are removed before the new run writes
  anything (``checkpoint.run``); ``auto`` then starts fresh. Only ``auto``/``latest`` with the same run's config
  continue the run instead (a preempted job requeued with the same command resumes, overwrite or not).
A directory holding only the config of a start that failed before its first checkpoint is not a run to protect.

A directory another command holds (``.hftrain.lock``: a live run, an overwrite under way) is refused first, naming
the holder, before any data is loaded; the main process takes the lock before it writes anything
(``hftrain.job.take_run_folder``), and decides again under it if the folder changed meanwhile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.checkpoint.run import (
    LOCK_FILENAME,
    check_outside_source,
    check_run_folder,
    check_writable_dir,
    folder_state,
    run_folder_lock,
)
from hftrain.config import CONFIG_FILENAME, config_differences, from_dict
from hftrain.errors import ConfigError, reading
from hftrain.files import read_input

if TYPE_CHECKING:
    from hftrain.checkpoint.manager import VerifiedCheckpoint
    from hftrain.config import TrainConfig, TrainingConfig
    from hftrain.models.checks import ModelFacts
    from hftrain.strategies import Strategy


@dataclass(frozen=True)
class RunPlan:
    """What a command does with its ``output_dir``, decided before anything is written."""

    run_id: str | None
    """The run's id: the output_dir's run, the explicitly resumed checkpoint's, or a new one (None: a run from before
    run ids, continued as it was)."""
    resume: str | None
    """The ``resume_from_checkpoint`` the trainer takes (``auto`` is dropped when a new run replaces an old one)."""
    checkpoint: VerifiedCheckpoint | None = None
    """The checkpoint ``resume`` names, its ``checkpoint.json`` read and checked once here (its files' checksums are
    verified when it is loaded); None: none named, or ``latest``/``auto`` in an output_dir still without one."""
    replaces: bool = False
    """An earlier run's outputs are removed before the new run writes (``overwrite_output_dir``)."""
    notes: list[str] = field(default_factory=list)
    """What to log about the decision."""
    folder_state: tuple = ()
    """``output_dir`` as the plan found it (``checkpoint.run.folder_state``), compared again under the folder's lock."""


def validate_job(
    config: TrainConfig, strategy: Strategy, *, write: bool, opened: VerifiedCheckpoint | None = None
) -> tuple[ModelFacts, RunPlan]:
    """Every check of a job's inputs that needs no data and no process group.

    Returns what the model takes and what the command does with ``output_dir``.

    Args:
        config: the validated job config.
        strategy: the resolved strategy (its platform and preflight).
        write: the command will write into ``output_dir`` (a training run; an export writes elsewhere).
        opened: the checkpoint an export reads, opened already (not read again).
    """
    from hftrain.models import model_config
    from hftrain.models.checks import check_model_folder

    training, _ = strategy.resolve_training(config.training)  # what the trainer will run: 'auto' made concrete
    strategy.platform.check_precision(training.mixed_precision)
    strategy.preflight(training)
    plan = plan_run(config, write=write, opened=opened)
    facts = check_model_folder(config.model)
    # Model-parallel strategies split the model's sizes: refused here, before any process group exists.
    strategy.check_model(model_config(config.model), use_lora=config.lora.use_lora, task=config.model.task)
    return facts, plan


def plan_run(config: TrainConfig, *, write: bool, opened: VerifiedCheckpoint | None = None) -> RunPlan:
    """Check ``output_dir`` and the resume request together, and decide which run the command continues or starts.

    A training command is refused first if another command holds ``output_dir`` (a probe: the lock is taken when
    the run first writes), and last if an entry the run would write through or delete is a link or a FIFO.

    Args:
        config: the validated job config.
        write: the command trains into ``output_dir`` (an export only reads a checkpoint).
        opened: the checkpoint an export reads, opened already (not read again).
    """
    if not write:
        return _decide(config, write=False, opened=opened)
    output_dir = Path(config.training.output_dir)
    run_folder_lock(output_dir).check_free()
    plan = _decide(config, write=True)
    check_run_folder(output_dir, replaces=plan.replaces)
    return dataclasses.replace(plan, folder_state=folder_state(output_dir))


def _decide(config: TrainConfig, *, write: bool, opened: VerifiedCheckpoint | None = None) -> RunPlan:
    from hftrain.checkpoint.run import new_run_id, saved_run_id

    training = config.training
    output_dir = Path(training.output_dir)
    spec = training.resume_from_checkpoint
    if not write:  # an export: trust comes from the run folder its command names
        explicit = check_resume_request(training, run_id=None, export=True, opened=opened)
        return RunPlan(run_id=_checkpoint_run_id(explicit), resume=spec, checkpoint=explicit)
    check_output_dir(config)
    if not _holds_results(output_dir):
        # A new run; a resumed checkpoint (from elsewhere) brings its run's id.
        explicit = check_resume_request(training, run_id=None)
        return RunPlan(run_id=_checkpoint_run_id(explicit) or new_run_id(), resume=spec, checkpoint=explicit)
    run_id = saved_run_id(output_dir)
    saved = output_dir / CONFIG_FILENAME  # absent: checkpoints without a run config, replaced only by overwrite
    same_run = saved.is_file() and not _run_differences(config, _saved_config(saved))
    if not training.overwrite_output_dir or (spec in ("auto", "latest") and same_run):
        if spec is None:
            raise ConfigError(
                f"training.output_dir '{output_dir}' already holds this run ({_results(output_dir)}); continue it "
                "with resume_from_checkpoint: auto, or set overwrite_output_dir: true to start over"
            )
        explicit = check_resume_request(training, run_id=run_id)
        other = _checkpoint_run_id(explicit)
        if explicit is not None and other != run_id and not _inside(explicit.path, output_dir):
            raise ConfigError(
                f"training.resume_from_checkpoint: '{explicit.path}' is of another run (run id {other}) than the one "
                f"training.output_dir '{output_dir}' holds ({run_id}); resume it into a new output_dir, or set "
                "overwrite_output_dir: true to replace this run"
            )
        return RunPlan(run_id=run_id, resume=spec, checkpoint=explicit)
    # overwrite_output_dir: a new run replaces the one in output_dir.
    notes = [f"overwrite_output_dir: the earlier run in '{output_dir}' ({_results(output_dir)}) is removed"]
    if spec == "latest":
        raise ConfigError(
            "training.resume_from_checkpoint is 'latest' but overwrite_output_dir: true starts a new run, which has "
            f"no checkpoint yet; use 'auto', or drop overwrite_output_dir to continue the run in '{output_dir}'"
        )
    if spec == "auto":
        notes.append("resume_from_checkpoint: auto: the run is new (overwrite_output_dir), starting fresh")
        return RunPlan(run_id=new_run_id(), resume=None, replaces=True, notes=notes)
    if spec is not None and _inside(Path(spec), output_dir):
        raise ConfigError(
            f"training.resume_from_checkpoint: '{spec}' lies in the output_dir that overwrite_output_dir: true "
            "replaces; copy it elsewhere first, or drop overwrite_output_dir"
        )
    explicit = check_resume_request(training, run_id=None)
    run_id = _checkpoint_run_id(explicit) or new_run_id()
    return RunPlan(run_id=run_id, resume=spec, checkpoint=explicit, replaces=True, notes=notes)


def check_output_dir(config: TrainConfig) -> None:
    """Refuse an ``output_dir`` that cannot be written, or that holds another run, unless overwriting is allowed.

    Args:
        config: the validated job config.
    """
    output_dir = Path(config.training.output_dir)
    check_writable_dir(output_dir, "training.output_dir")
    if not output_dir.exists() or config.training.overwrite_output_dir:
        return
    saved = output_dir / CONFIG_FILENAME
    if not saved.is_file():
        # the lock file of a run killed before it wrote its config (a probe found it free) is no one's run
        if any(entry.name != LOCK_FILENAME for entry in output_dir.iterdir()):
            raise ConfigError(
                f"training.output_dir '{output_dir}' is not empty and holds no hftrain run; choose a new "
                "output_dir or set overwrite_output_dir: true"
            )
        return
    if not _holds_results(output_dir):
        return  # the config of a start that failed before its first checkpoint: nothing to protect
    differences = _run_differences(config, _saved_config(saved))
    if differences:
        raise ConfigError(
            f"training.output_dir '{output_dir}' already holds a different run "
            f"(differs in {', '.join(differences[:5])}); "
            "choose a new output_dir or set overwrite_output_dir: true"
        )


def check_resume_request(
    training: TrainingConfig, *, run_id: str | None, export: bool = False, opened: VerifiedCheckpoint | None = None
) -> VerifiedCheckpoint | None:
    """Refuse a ``resume_from_checkpoint`` that names nothing usable, before any model is built.

    What needs the live strategy (topology, global batch) is checked when the trainer resumes, still before
    anything is written.

    Args:
        training: the ``training`` config section.
        run_id: the output_dir's run: ``latest``/``auto`` take only its checkpoints.
        export: the request comes from ``hftrain export`` (messages name its flags).
        opened: the checkpoint the request names, opened already (its ``checkpoint.json`` is not read again).

    Returns the checkpoint the request names, its ``checkpoint.json`` read once and checked (None: none, or ``auto``
    with none yet); its files' checksums are verified when it is loaded.
    """
    from hftrain.checkpoint.manager import CheckpointManager
    from hftrain.checkpoint.resume import check_trusted

    spec = training.resume_from_checkpoint
    if spec is None:
        return None
    output_dir = Path(training.output_dir)
    manager = CheckpointManager(output_dir / "checkpoints", run_id=run_id)
    path = manager.resolve(spec)
    if path is None:
        return None
    if not path.exists():
        raise ConfigError(
            f"training.resume_from_checkpoint: '{path}' does not exist; give a step_<N> folder under "
            "output_dir/checkpoints, or latest / auto"
        )
    # marker, format, keys (the marker's bytes resolve read, if it did); checksums are verified on load
    checkpoint = opened if opened is not None and opened.path == path else manager.opened(path)
    check_trusted(path, output_dir, trusted=training.trust_external_checkpoint, export=export)
    return checkpoint


def check_export_dir(directory: Path, source: Path, *, merged: bool = False, locked: bool = False) -> None:
    """Refuse an export folder that another command holds, cannot be written, already holds files (nothing is
    overwritten), lies inside what it exports, or is a link or a special file (as are the staging and previous
    folders beside it that the export writes and deletes).

    Args:
        directory: the folder ``hftrain export`` writes.
        source: the checkpoint or run folder it exports, as given.
        merged: ``<directory>_merged`` is written too (``--merge_lora``).
        locked: this command holds the folder's lock already (checked again under it; else only probed).
    """
    from hftrain.files import FolderLock, check_own

    if not locked:
        FolderLock.for_folder(directory, "export directory").check_free()
    targets = [directory, directory.with_name(directory.name + "_merged")] if merged else [directory]
    for target in targets:
        check_own(target, "export directory", folder=True)
        for kind in ("staging", "previous"):  # what the export writes and deletes beside it
            check_own(target.with_name(f".{kind}-{target.name}"), f"export directory: the {kind} folder", folder=True)
    check_outside_source(directory, source, "export directory")
    check_writable_dir(directory, "export directory")
    if directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"export directory '{directory}' is not empty; give a new folder (nothing is overwritten)")


def _holds_results(output_dir: Path) -> bool:
    from hftrain.checkpoint.manager import CheckpointManager

    return CheckpointManager(output_dir / "checkpoints").latest() is not None or (output_dir / "model").is_dir()


def _results(output_dir: Path) -> str:
    """``checkpoints up to step 40`` / ``an exported model``, for messages."""
    from hftrain.checkpoint.manager import CheckpointManager

    latest = CheckpointManager(output_dir / "checkpoints").latest()
    return f"checkpoints up to {latest.name}" if latest is not None else "an exported model"


def _checkpoint_run_id(checkpoint: VerifiedCheckpoint | None) -> str | None:
    if checkpoint is None:
        return None
    run_id = checkpoint.meta.get("run_id")
    return run_id if isinstance(run_id, str) else None


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _saved_config(saved: Path) -> TrainConfig:
    import yaml

    with reading(
        f"training.output_dir: {saved}",
        "it is damaged: restore it, or choose a new output_dir",
        catch=(OSError, ValueError, yaml.YAMLError),
    ):
        raw = yaml.safe_load(read_input(saved, "training.output_dir's config"))
    return from_dict(raw or {}, source=str(saved), written=False)


def _run_differences(config: TrainConfig, saved: TrainConfig) -> list[str]:
    """The keys in which ``config`` is another run than the ``saved`` one.

    The strategy and the parallel layout are not among them: a run continues under another strategy, layout or
    process count (``--strategy.name fsdp --resume_from_checkpoint latest``, ``--parallelism.tp 4``), and the resume
    itself checks that the checkpoint can be resharded (``hftrain.checkpoint.resume``); the run config then records
    the new ones.
    """
    moving = ("strategy.", "parallelism.")
    return [key for key in config_differences(config, saved) if not key.startswith(moving)]
