"""hftrain from Python: build a config, train in this process or on several, and get the result back.

```python
import hftrain

config = hftrain.make_config("configs/minilm_rotten_tomatoes.yaml", max_steps=50, output_dir="runs/a")
result = hftrain.train(config)                     # in this process (a notebook kernel, a script)
result = hftrain.train(config, num_processes=2, output_dir="runs/b")   # 2 data-parallel processes
result.metrics["eval_accuracy"], result.log_history, result.model_dir
```

``train(..., num_processes=N)`` starts the processes with ``accelerate.notebook_launcher`` (forked from this
process, so it works inside a Jupyter kernel) and returns rank 0's result. Everything CPU needs is done by the
strategies (``Accelerator(cpu=True)`` for DDP, gloo for DeepSpeed), so there is nothing else to set.
"""

from __future__ import annotations

import copy
import pickle
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.config import TrainConfig, load_config, set_field
from hftrain.errors import ConfigError, HFTrainError

if TYPE_CHECKING:
    import datasets

    from hftrain.job import JobResult

_RESULT_FILE = "result.pkl"


def make_config(path: str | Path | None = None, **fields: Any) -> TrainConfig:
    """A validated job config: the defaults or a YAML file, with fields overridden by keyword.

    Args:
        path: a job YAML (sections ``model``, ``data``, ``training``, ``strategy``, ``lora``); None for defaults.
        **fields: any config field by its name, e.g. ``max_steps=50``, ``use_lora=True`` (checked and typed
            exactly like a command-line override; an unknown name is an error naming the closest one).
    """
    _show_errors_as_one_line()
    return with_fields(load_config(path) if path is not None else TrainConfig(), **fields)


def with_fields(config: TrainConfig, **fields: Any) -> TrainConfig:
    """A validated copy of ``config`` with some fields changed (the original is left as it is).

    Args:
        config: a job config.
        **fields: config fields by name, as in ``make_config``.
    """
    changed = copy.deepcopy(config)
    for key, value in fields.items():
        set_field(changed, key, value, source="keyword arguments")
    return changed.validate()


def train(config: TrainConfig | str | Path | None = None, *, num_processes: int = 1, **fields: Any) -> JobResult:
    """Fine-tune, evaluate and export as ``hftrain train`` does, and return the result.

    Args:
        config: a ``TrainConfig``, a job YAML path, or None for the default job.
        num_processes: 1 trains in this process; N > 1 forks N data-parallel processes on this machine
            with ``accelerate.notebook_launcher`` and returns rank 0's result. Either works any number of
            times, in any order, in one notebook kernel.
        **fields: config fields to change for this run, e.g. ``output_dir="runs/b"``.
    """
    _show_errors_as_one_line()
    config = config if isinstance(config, TrainConfig) else make_config(config)
    config = with_fields(config, **fields)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigError(f"num_processes: expected a positive integer, got {num_processes!r}")
    if num_processes == 1:
        return _train_here(config)
    return _train_on_processes(config, num_processes)


def load_splits(config: TrainConfig | str | Path | None = None, **fields: Any) -> datasets.DatasetDict:
    """The ``train`` and ``validation`` splits (columns ``text``, ``label``) exactly as a run of ``config`` sees them.

    Args:
        config: a ``TrainConfig``, a job YAML path, or None for the default job.
        **fields: config fields to change, as in ``train``.
    """
    from hftrain.data.loading import load_classification_splits

    _show_errors_as_one_line()
    config = with_fields(config if isinstance(config, TrainConfig) else make_config(config), **fields)
    data = config.data
    return load_classification_splits(
        dataset_name=data.dataset_name,
        train_file=data.train_file,
        validation_file=data.validation_file,
        text_column=data.text_column,
        label_column=data.label_column,
        num_labels=config.model.num_labels,
        validation_split_percentage=data.validation_split_percentage,
        max_train_samples=data.max_train_samples,
        max_eval_samples=data.max_eval_samples,
        seed=config.training.seed,
        log=lambda _: None,
    )


def _train_here(config: TrainConfig) -> JobResult:
    """Train in the calling process (under torchrun/accelerate launch, as one of its ranks)."""
    from hftrain.cli import launch_info_from_environ
    from hftrain.job import run_training

    launch = launch_info_from_environ()
    try:
        return run_training(config, launch)
    finally:
        if launch.world_size == 1:
            _reset_accelerate_state()


def _train_on_processes(config: TrainConfig, num_processes: int) -> JobResult:
    """Fork ``num_processes`` ranks with ``notebook_launcher`` and return rank 0's result (or its error)."""
    from accelerate import notebook_launcher

    from hftrain.models import resolve_model_path

    # Convert an embedded GGUF model once here rather than in every rank (and fail early on a missing package).
    resolve_model_path(config.model.model_name_or_path)
    with tempfile.TemporaryDirectory(prefix="hftrain-launch-") as outbox:
        try:
            notebook_launcher(run_rank, args=(config, outbox), num_processes=num_processes, use_port=_free_port())
        except Exception:
            error = _first_reported_error(Path(outbox))
            if error is None:
                raise
            # The ranks' one-line HFTrainError, not torch.elastic's ChildFailedError wall around it.
            raise error from None
        return pickle.loads((Path(outbox) / _RESULT_FILE).read_bytes())


def run_rank(config: TrainConfig, outbox: str) -> None:
    """The function each launched process runs: train, and leave rank 0's result (or any rank's error) in ``outbox``.

    Module-level so that ``notebook_launcher`` can fork (or pickle, where it spawns) it.

    Args:
        config: the validated job config.
        outbox: a folder the launching process reads the result from.
    """
    import os

    from hftrain.cli import launch_info_from_environ
    from hftrain.job import run_training

    rank = os.environ.get("RANK", "0")
    # notebook_launcher marks forked ranks FORK_LAUNCHED, and Accelerate then skips destroy_process_group at
    # end_training; the gloo group is freed when the DDP reducer is, holding the GIL while it joins a gloo thread
    # that needs the GIL: a deadlock at exit (seen in a Jupyter kernel). Unmarked, the rank ends as under torchrun.
    os.environ.pop("FORK_LAUNCHED", None)
    try:
        result = run_training(config, launch_info_from_environ())
    except HFTrainError as error:
        _write(Path(outbox) / f"error-{int(rank):05d}.pkl", error)
        raise
    if rank == "0":
        _write(Path(outbox) / _RESULT_FILE, result)


def _write(path: Path, value: Any) -> None:
    staging = path.with_suffix(".tmp")
    staging.write_bytes(pickle.dumps(value))
    staging.rename(path)  # the launcher never reads half a file


def _first_reported_error(outbox: Path) -> HFTrainError | None:
    reports = sorted(outbox.glob("error-*.pkl"))
    return pickle.loads(reports[0].read_bytes()) if reports else None


def _free_port() -> str:
    """A free local TCP port for the ranks' rendezvous (the fixed default 29500 may be taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _reset_accelerate_state() -> None:
    """Forget this process's Accelerate state after an in-process run.

    ``notebook_launcher`` refuses to fork while an ``AcceleratorState`` exists, and the next in-process run must
    build its own. The reset is Accelerate's private ``_reset_state``, which its own test cases use the same way.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _show_errors_as_one_line() -> None:
    """In IPython/Jupyter, show an ``HFTrainError`` as its one line, as the CLI does, not as a traceback.

    Only when no other custom exception handler is installed; outside IPython, nothing changes.
    """
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or shell.custom_exceptions:
        return

    def one_line(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None) -> list[str]:
        return [f"hftrain: error: {value}"]  # IPython shows this in place of the traceback

    shell.set_custom_exc((HFTrainError,), one_line)
