"""The tasks a job can train (``model.task``): one :class:`Task` record each, one module each, and the registry.

A new task is its module here (its record), its data reader under ``hftrain/data/`` and, when no existing trainer
fits, its trainer under ``hftrain/trainers/``; every other layer reads the record (the config's check, the model
builder, LoRA, the strategies' refusals, the planner, the job).
"""

from __future__ import annotations

from hftrain.errors import ConfigError
from hftrain.tasks import causal_lm, sequence_classification, token_classification
from hftrain.tasks.record import PIPELINE_HEADS, Inputs, Task, resolve

TASKS: dict[str, Task] = {
    task.name: task for task in (sequence_classification.TASK, causal_lm.TASK, token_classification.TASK)
}
"""``model.task`` -> its record."""

DEFAULT_TASK = sequence_classification.TASK.name
"""``model.task``'s default."""


def task_of(name: str) -> Task:
    """The record of ``model.task`` ``name``; an unknown name is one line naming the field and the choices.

    Args:
        name: a ``model.task`` value.
    """
    task = TASKS.get(name)
    if task is None:
        import difflib

        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"model.task: '{name}' is not one of {', '.join(TASKS)}{hint}")
    return task


__all__ = ["DEFAULT_TASK", "PIPELINE_HEADS", "TASKS", "Inputs", "Task", "resolve", "task_of"]
