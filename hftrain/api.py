"""hftrain from Python: build a config, train in this process or on several, and get the result back.

```python
import hftrain

config = hftrain.make_config("configs/minilm_rotten_tomatoes.yaml", max_steps=50, output_dir="runs/a")
config = hftrain.make_config({"training": {"max_steps": 50}})   # or a dict of sections, like the YAML file
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
import dataclasses
import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.config import TrainConfig, from_dict, load_config, set_field
from hftrain.errors import ConfigError, HFTrainError

if TYPE_CHECKING:
    import datasets

    from hftrain.job import JobResult

_RESULT_FILE = "result.pkl"


def make_config(path: str | Path | dict[str, Any] | None = None, **fields: Any) -> TrainConfig:
    """A validated job config: the defaults, a YAML file or a dict of sections, with fields overridden by keyword.

    Args:
        path: a job YAML (sections ``model``, ``data``, ``training``, ``strategy``, ``parallelism``, ``lora``),
            the same sections as a dict (``{"training": {"max_steps": 50}}``, checked as the file would be), a
            ``TrainConfig`` (copied), or None for defaults.
        **fields: any config field by its name, e.g. ``max_steps=50``, ``use_lora=True`` (checked and typed
            exactly like a command-line override; an unknown name is an error naming the closest one).
    """
    _show_errors_as_one_line()
    return with_fields(_base_config(path), **fields)


def _base_config(source: Any) -> TrainConfig:
    """The config ``make_config`` starts from: defaults, a YAML file, or a dict of sections.

    Args:
        source: None, a ``TrainConfig`` (copied), a path, or ``{section: {field: value}}``.
    """
    if source is None:
        return TrainConfig()
    if isinstance(source, TrainConfig):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        return load_config(source)
    if isinstance(source, dict):
        defaults = TrainConfig()
        sections = {f.name for f in dataclasses.fields(defaults)}
        owners = {f.name: section for section in sections for f in dataclasses.fields(getattr(defaults, section))}
        for key in source:
            if key not in sections and key in owners:  # a flat {"max_steps": 50}
                raise ConfigError(
                    f"config dict: '{key}' is a field of section '{owners[key]}', not a section; nest it "
                    f"({{'{owners[key]}': {{'{key}': ...}}}}) or pass it as a keyword ({key}=...)"
                )
        return from_dict(copy.deepcopy(source), source="config dict")
    raise ConfigError(
        f"config: expected a TrainConfig, a job YAML path or a dict of sections ({{'training': {{'max_steps': 50}}}}), "
        f"got {type(source).__name__}; pass one of those"
    )


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
        config: a ``TrainConfig``, a job YAML path, a dict of sections (as ``make_config``), or None for the
            default job.
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
    """The ``train`` and ``validation`` splits exactly as a run of ``config`` sees them, before tokenization (columns
    ``text`` and ``label``; ``model.task: causal_lm``: ``text``, or ``prompt`` and ``response``).

    Args:
        config: a ``TrainConfig``, a job YAML path, a dict of sections, or None for the default job.
        **fields: config fields to change, as in ``train``.
    """
    from hftrain.job import load_splits as job_splits
    from hftrain.models.checks import check_model_folder

    _show_errors_as_one_line()
    config = with_fields(config if isinstance(config, TrainConfig) else make_config(config), **fields)
    return job_splits(config, check_model_folder(config.model), lambda _: None)


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
    import sys

    from accelerate import notebook_launcher

    from hftrain.models import resolve_model_path

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # The ranks are forked, and a forked child cannot use a CUDA context its parent created (Accelerate's
        # launcher would stop with a traceback); a run in this process on the GPU (train(config)) created one.
        raise ConfigError(
            f"num_processes: {num_processes} processes are forked from this process, which has used the GPU "
            "already (an earlier run in it); restart the kernel and run train(..., num_processes=...) before any "
            "run in the kernel itself, or launch with torchrun"
        )
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
    # Leave the gloo group alive to the forked rank's os._exit, as Accelerate's own fork launch (PrepareForLaunch,
    # which notebook_launcher's elastic path skips) does with FORK_LAUNCHED. Destroyed at end_training, the group
    # dies with the DDP reducer when run_training returns; its destructor joins a gloo thread while holding the
    # GIL, and that thread may need the GIL to free a finished collective's tensors: a deadlock, seen in a kernel.
    os.environ["FORK_LAUNCHED"] = "1"
    try:
        result = run_training(config, launch_info_from_environ(), process_exits_after=True)
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

    def one_line(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None) -> None:
        # IPython discards a custom handler's return value; _showtraceback is the hook through which IPython and
        # ipykernel show a formatted traceback (as the cell's error output), here given one line instead.
        shell._showtraceback(etype, value, [f"hftrain: error: {value}"])

    shell.set_custom_exc((HFTrainError,), one_line)
