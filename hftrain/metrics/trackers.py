"""Experiment trackers through Accelerate's own (``accelerate.tracking``): which exist, which are installed, and the
one place every figure of a run goes through on its way to them.

``training.log_with`` names trackers from :data:`TRACKERS` (or ``all``: every one installed here, Accelerate's
meaning; or ``none``). :func:`resolve_trackers` turns it into tracker names and refuses, in one line with the install
command, a named tracker whose package is missing (Accelerate itself would drop it silently, at debug level).

:class:`TrackerHub` wraps the ``Accelerator``'s trackers. Accelerate runs ``init_trackers``/``log`` on the main
process only (``@on_main_process``; the other ranks hold no tracker), and so does every method here: no collective,
nothing written by another rank. What goes to every tracker:

- the resolved job config once, as the run's parameters (``store_init_configuration``), with the topology;
- every scalar at its global step (:meth:`TrackerHub.log`): a key's steps strictly increase, also across a resume (a
  value at a step not above the key's last, or the resumed checkpoint's step, is dropped): W&B refuses a step that
  goes back, and MLflow would keep two points at one step;
- the run's pictures (:meth:`TrackerHub.log_pictures`): as images where Accelerate's tracker has ``log_images``
  (TensorBoard, W&B, Aim, ClearML, SwanLab), as run artifacts in MLflow (``log_artifact``), as ``trackio.Image`` in
  trackio (its run's ``log``); comet_ml and dvclive get none: Accelerate's trackers for them have no image call, and
  hftrain writes no client code of its own;
- the topology as tags where the tracker has tags: W&B's ``tags`` and MLflow's ``tags`` (``init_kwargs``), Comet's
  and ClearML's ``add_tags``, Aim's ``add_tag``; TensorBoard, trackio, dvclive and SwanLab see it in the parameters.

A resumed run continues its tracker runs: :meth:`TrackerHub.run_ids` (W&B's run id, MLflow's run id, trackio's run
name) is stored in the checkpoint's trainer state and given back at the next start (W&B ``id`` + ``resume="allow"``,
MLflow ``run_id``, trackio ``name`` + ``resume="allow"``). The other trackers start a new run on resume.

Offline defaults (``docs/tracking.md``): W&B writes under ``output_dir/runs`` unless ``WANDB_DIR`` is set (its mode is
W&B's own: ``WANDB_MODE=offline`` for no network); MLflow uses a file store ``output_dir/runs/mlruns`` unless a
tracking URI is set (``MLFLOW_TRACKING_URI``; MLflow 3 keeps its file store in maintenance and refuses it unless
``MLFLOW_ALLOW_FILE_STORE=true``, which hftrain sets for the store it picks, not for one you name); trackio is local
unless given a Space (``TRACKIO_DIR`` or ``~/.cache/huggingface/trackio``). These are the tracker libraries' own
variables, read here only to keep their choice when set.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftrain.errors import CheckpointError, ConfigError

PROJECT = "hftrain"
"""The project (W&B, trackio, Comet, SwanLab) or experiment (MLflow) name every run is logged under."""


@dataclass(frozen=True)
class Tracker:
    """One of Accelerate's trackers: the module it imports and the distributions that provide it."""

    module: str
    distributions: tuple[str, ...]
    pip: str
    """What ``pip install`` takes for it (hftrain's extra of the same name installs it too)."""


TRACKERS: dict[str, Tracker] = {
    "tensorboard": Tracker("tensorboard", ("tensorboard",), "tensorboard"),
    "wandb": Tracker("wandb", ("wandb",), "wandb"),
    "mlflow": Tracker("mlflow", ("mlflow", "mlflow-skinny"), "mlflow-skinny"),
    "trackio": Tracker("trackio", ("trackio",), "trackio"),
    "comet_ml": Tracker("comet_ml", ("comet_ml", "comet-ml"), "comet_ml"),
    "aim": Tracker("aim", ("aim",), "'aim<4'"),
    "clearml": Tracker("clearml", ("clearml",), "clearml"),
    "dvclive": Tracker("dvclive", ("dvclive",), "dvclive"),
    "swanlab": Tracker("swanlab", ("swanlab",), "swanlab"),
}
"""Accelerate 1.15's trackers (``accelerate.tracking.LOGGER_TYPE_TO_CLASS``), by their ``log_with`` names."""

CHOICES = (*TRACKERS, "all", "none")


def installed(name: str) -> bool:
    """True when tracker ``name``'s package is importable here (Accelerate's ``is_<name>_available`` test: the module
    is found and a distribution providing it is installed; Aim below 4, as Accelerate requires)."""
    tracker = TRACKERS[name]
    try:
        if importlib.util.find_spec(tracker.module) is None:
            return False
    except (ImportError, ValueError):
        return False
    for distribution in tracker.distributions:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name != "aim" or int(version.split(".")[0]) < 4
    return False


def requested(log_with: Any) -> list[str]:
    """The names ``training.log_with`` gives, as a list (a single name is a list of one; null and ``none``: none),
    each checked against :data:`CHOICES`.

    Raises:
        ConfigError: an unknown name, or ``none``/``all`` beside other names.
    """
    import difflib

    if log_with is None:
        return []
    names = [log_with] if isinstance(log_with, str) else list(log_with)
    for name in names:
        if not isinstance(name, str) or name not in CHOICES:
            close = difflib.get_close_matches(str(name), CHOICES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"training.log_with: '{name}' is not one of {', '.join(CHOICES)}{hint}")
    if len(names) > 1 and ({"none", "all"} & set(names)):
        special = "none" if "none" in names else "all"
        raise ConfigError(f"training.log_with: '{special}' stands alone; give it alone or list trackers without it")
    return [] if names == ["none"] else list(dict.fromkeys(names))


def resolve_trackers(log_with: Any) -> list[str]:
    """The trackers a run logs to: the names given, or every installed one for ``all``.

    Raises:
        ConfigError: a bad name (:func:`requested`), or a named tracker whose package is not installed: one line
            with the install command.
    """
    names = requested(log_with)
    if names == ["all"]:
        return [name for name in TRACKERS if installed(name)]
    for name in names:
        if not installed(name):
            raise ConfigError(
                f"training.log_with: {name}'s package is not installed here; install it with "
                f"pip install 'hftrain[{name}]' (or pip install {TRACKERS[name].pip}), or remove {name} from "
                "training.log_with"
            )
    return names


def scalars(config: dict[str, Any]) -> dict[str, Any]:
    """A flat config's values as tracker parameters: numbers, strings and booleans kept, the rest (lists, null) as
    their text (TensorBoard's hparams and MLflow's params take nothing else)."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}


class TrackerHub:
    """The run's trackers, over ``accelerator.trackers`` (main process only; empty elsewhere).

    Args:
        accelerator: the run's ``Accelerator``, built with ``log_with`` = :func:`resolve_trackers`'s names.
        logging_dir: the run's tracker folder (``output_dir/runs``): the default local stores go under it (see the
            module).
    """

    def __init__(self, accelerator: Any, logging_dir: str | Path) -> None:
        self.accelerator = accelerator
        self.logging_dir = Path(logging_dir)
        self.names = [str(name) for name in accelerator.log_with]
        self._floor = -1
        self._last: dict[str, int] = {}
        self._finished = False

    @property
    def active(self) -> bool:
        """This process holds trackers (the main process of a run that logs)."""
        return bool(self.accelerator.trackers)

    def start(
        self,
        *,
        config: dict[str, Any],
        topology: dict[str, Any],
        resumed: dict[str, str] | None = None,
        resumed_step: int = -1,
    ) -> None:
        """Start (or continue) each tracker's run and log the job config and the topology once.

        Args:
            config: the resolved flat job config (``TrainConfig.flat()``).
            topology: strategy, axis sizes, world size (the strategy summary): parameters ``topology/<key>`` and tags.
            resumed: the run ids a checkpoint stored (:meth:`run_ids`); their runs are continued.
            resumed_step: the resumed checkpoint's global step: no key is logged at or below it again.
        """
        self._floor = resumed_step
        if not self.names or not self.accelerator.is_main_process:  # the other ranks hold no tracker and write nothing
            return
        resumed = resumed or {}
        if not isinstance(resumed, dict) or not all(isinstance(v, str) for v in resumed.values()):
            raise CheckpointError(
                f"the resumed checkpoint's trainer_state.tracker_runs is not a table of run ids ({resumed!r}); it is "
                "damaged: resume from another checkpoint"
            )
        tags = {k: str(v) for k, v in topology.items() if isinstance(v, (int, float, str, bool))}
        init: dict[str, dict[str, Any]] = {}
        if "wandb" in self.names:
            init["wandb"] = {"tags": [f"{k}:{v}" for k, v in tags.items()]}
            if "WANDB_DIR" not in os.environ:  # W&B's own variable: its choice wins
                self.logging_dir.mkdir(parents=True, exist_ok=True)
                init["wandb"]["dir"] = str(self.logging_dir)
            if "wandb" in resumed:
                init["wandb"].update(id=resumed["wandb"], resume="allow")
        if "mlflow" in self.names:
            init["mlflow"] = {"tags": tags}
            if "mlflow" in resumed:
                init["mlflow"]["run_id"] = resumed["mlflow"]
            if not os.environ.get("MLFLOW_TRACKING_URI"):  # MLflow's own variable: its choice wins
                import mlflow
                from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE

                # MLflow 3 refuses its file store (in maintenance) unless this opts in: the default here is one
                MLFLOW_ALLOW_FILE_STORE.set("true")
                mlflow.set_tracking_uri((self.logging_dir / "mlruns").resolve().as_uri())
        if "trackio" in self.names and "trackio" in resumed:
            init["trackio"] = {"name": resumed["trackio"], "resume": "allow"}
        parameters = {**scalars(config), **{f"topology/{k}": v for k, v in scalars(topology).items()}}
        self.accelerator.init_trackers(PROJECT, init_kwargs=init)
        for tracker in self.accelerator.trackers:
            tracker.store_init_configuration(_new_parameters(tracker, parameters))
            if tracker.name in ("comet_ml", "clearml"):
                tracker.tracker.add_tags([f"{k}:{v}" for k, v in tags.items()])
            elif tracker.name == "aim":
                for k, v in tags.items():
                    tracker.tracker.add_tag(f"{k}:{v}")

    def run_ids(self) -> dict[str, str]:
        """The ids that continue this process's tracker runs on resume: ``{"wandb": id, "mlflow": run_id, "trackio":
        run name}`` for those it logs to (empty on the other ranks)."""
        ids = {}
        for tracker in self.accelerator.trackers:
            if tracker.name == "wandb":
                ids["wandb"] = tracker.run.id
            elif tracker.name == "mlflow":
                ids["mlflow"] = tracker.active_run.info.run_id
            elif tracker.name == "trackio":
                ids["trackio"] = tracker.run.name
        return ids

    def log(self, values: dict[str, float], step: int) -> None:
        """Log scalars at global ``step`` to every tracker, each key only at a step above its last (and above a
        resumed checkpoint's step)."""
        if not self.active:
            return
        fresh = {k: v for k, v in values.items() if step > max(self._floor, self._last.get(k, -1))}
        if fresh:
            self._last.update(dict.fromkeys(fresh, step))
            self.accelerator.log(fresh, step=step)

    def log_pictures(self, pictures: dict[str, Path], step: int) -> None:
        """Log the run's PNGs that exist (``{name: path}``) at ``step`` where the tracker takes pictures (see the
        module); a picture not drawn (no pipeline, no experts) is left out, and so is every picture of a resumed run
        that trained no step (``step`` not above the checkpoint's: its pictures were logged at that step)."""
        if not self.active or step <= self._floor:
            return
        present = {name: path for name, path in pictures.items() if path.is_file()}
        if not present:
            return
        import numpy as np
        from PIL import Image

        arrays = {}
        for name, path in present.items():
            with Image.open(path) as image:
                arrays[f"pictures/{name}"] = np.asarray(image.convert("RGB"))
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":  # a batch of one, height-width-channel
                tracker.log_images({k: v[None] for k, v in arrays.items()}, step=step, dataformats="NHWC")
            elif tracker.name in ("wandb", "swanlab"):  # a list of images per key
                tracker.log_images({k: [v] for k, v in arrays.items()}, step=step)
            elif tracker.name in ("aim", "clearml"):  # one image per key
                tracker.log_images(arrays, step=step)
            elif tracker.name == "mlflow":
                for path in present.values():
                    tracker.log_artifact(str(path), artifact_path="pictures")
            elif tracker.name == "trackio":
                import trackio

                tracker.run.log({f"pictures/{n}": trackio.Image(str(p)) for n, p in present.items()}, step=step)

    def finish(self) -> None:
        """Close every tracker's run once (flushes W&B's and TensorBoard's files); Accelerate's ``end_training`` then
        finds none left to close."""
        if self._finished:
            return
        self._finished = True
        for tracker in self.accelerator.trackers:
            tracker.finish()
        self.accelerator.trackers = []


def _new_parameters(tracker: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    """The parameters to store in ``tracker``'s run: all of them, except for a continued MLflow run, whose parameters
    cannot change: there, only keys it does not hold yet (a resume may change ``max_steps``, the logging cadence and the
    other run-invariant-exempt fields; MLflow keeps the first run's values)."""
    if tracker.name != "mlflow" or tracker.run_id is None:
        return parameters
    import mlflow

    held = mlflow.get_run(tracker.active_run.info.run_id).data.params
    return {k: v for k, v in parameters.items() if k not in held}
