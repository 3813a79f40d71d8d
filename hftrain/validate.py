"""The one validation pass of a job, run before anything is written.

``validate_job`` checks the platform and strategy, ``output_dir``, the resume request and the model folder
(``hftrain.models.checks``); ``hftrain.job.prepare_job`` runs it, then loads and checks the data, builds the
trainer (which verifies the resume checkpoint against the live topology) and only then writes the run's config.
A refused command therefore leaves a run directory exactly as it was and creates none. A new command or
strategy gets all of this by calling ``validate_job`` (or ``prepare_job``) first.

What a run directory may be asked to do by a later command:
- resume, extend (more ``max_steps``/``num_train_epochs``), change its logging/eval/save cadence, or move
  (``config.RUN_INVARIANT_EXEMPT``): accepted;
- change the model, data, optimisation or strategy: refused naming the field; the global batch is checked
  against the checkpoint (``checkpoint.resume``), where the process count is known.
A directory holding only the config of a start that failed before its first checkpoint is not a run to protect.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.config import CONFIG_FILENAME, config_differences, from_dict
from hftrain.errors import ConfigError, reading

if TYPE_CHECKING:
    from hftrain.config import TrainConfig, TrainingConfig
    from hftrain.models.checks import ModelFacts
    from hftrain.strategies import Strategy


def validate_job(config: TrainConfig, strategy: Strategy, *, write: bool) -> ModelFacts:
    """Every check of a job's inputs that needs no data and no process group; returns what the model takes.

    Args:
        config: the validated job config.
        strategy: the resolved strategy (its platform and preflight).
        write: the command will write into ``output_dir`` (a training run; an export writes elsewhere).
    """
    from hftrain.models import model_config
    from hftrain.models.checks import check_model_folder

    training, _ = strategy.resolve_training(config.training)  # what the trainer will run: 'auto' made concrete
    strategy.platform.check_precision(training.mixed_precision)
    strategy.preflight(training)
    if write:
        check_output_dir(config)
    check_resume_request(config.training)
    facts = check_model_folder(config.model)
    # Model-parallel strategies split the model's sizes: refused here, before any process group exists.
    strategy.check_model(model_config(config.model), use_lora=config.lora.use_lora)
    return facts


def check_writable_dir(path: Path, field: str) -> None:
    """Refuse a target folder that is a file, lies under a file, or cannot be created or written.

    Args:
        path: the folder a command will create or write into.
        field: the config field or argument that named it, for the message.
    """
    if path.is_file():
        raise ConfigError(f"{field} '{path}' is a file; choose a directory path")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{field} '{path}': '{existing}' is a file, not a directory; choose another path")
    # access() also reports a read-only file system (EROFS) to root, for whom permissions are no obstacle.
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{field} '{path}' is not writable ('{existing}' is read-only or not yours); choose a writable location"
        )


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
        if any(output_dir.iterdir()):
            raise ConfigError(
                f"training.output_dir '{output_dir}' is not empty and holds no hftrain run; choose a new "
                "output_dir or set overwrite_output_dir: true"
            )
        return
    if not _holds_results(output_dir):
        return  # the config of a start that failed before its first checkpoint: nothing to protect
    differences = config_differences(config, _saved_config(saved))
    if differences:
        raise ConfigError(
            f"training.output_dir '{output_dir}' already holds a different run "
            f"(differs in {', '.join(differences[:5])}); "
            "choose a new output_dir or set overwrite_output_dir: true"
        )


def check_resume_request(training: TrainingConfig) -> None:
    """Refuse a ``resume_from_checkpoint`` that names nothing usable, before any model is built.

    What needs the live strategy (topology, global batch) is checked when the trainer resumes, still before
    anything is written.

    Args:
        training: the ``training`` config section.
    """
    from hftrain.checkpoint.manager import CheckpointManager, read_checkpoint
    from hftrain.checkpoint.resume import check_trusted

    spec = training.resume_from_checkpoint
    if spec is None:
        return
    output_dir = Path(training.output_dir)
    path = CheckpointManager(output_dir / "checkpoints").resolve(spec)
    if path is None:
        return
    if not path.exists():
        raise ConfigError(
            f"training.resume_from_checkpoint: '{path}' does not exist; give a step_<N> folder under "
            "output_dir/checkpoints, or latest / auto"
        )
    read_checkpoint(path, verify_files=False)  # marker, format, keys; checksums are verified on load
    check_trusted(path, output_dir, trusted=training.trust_external_checkpoint)


def check_export_dir(directory: Path) -> None:
    """Refuse an export folder that cannot be written or already holds files (nothing is overwritten).

    Args:
        directory: the folder ``hftrain export`` writes.
    """
    check_writable_dir(directory, "export directory")
    if directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"export directory '{directory}' is not empty; give a new folder (nothing is overwritten)")


def _holds_results(output_dir: Path) -> bool:
    from hftrain.checkpoint.manager import CheckpointManager

    return CheckpointManager(output_dir / "checkpoints").latest() is not None or (output_dir / "model").is_dir()


def _saved_config(saved: Path) -> TrainConfig:
    import yaml

    with reading(
        f"training.output_dir: {saved}",
        "it is damaged: restore it, or choose a new output_dir",
        catch=(OSError, ValueError, yaml.YAMLError),
    ):
        raw = yaml.safe_load(saved.read_text())
    return from_dict(raw or {}, source=str(saved))
