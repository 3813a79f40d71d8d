"""The ``Task`` record: everything a ``model.task`` brings to a job, in one place (the registry: ``hftrain.tasks``).

A record names the code of the layers above it (its data reader, its input preparation, its trainer) as
``"module:function"`` strings, imported only when a job asks for them (:func:`resolve`): the record itself imports
nothing above ``hftrain.errors``, so the config schema, the model builder, the strategies and the planner all read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PIPELINE_HEADS = ("sequence_classification", "token_classification", "causal_lm")
"""The head kinds a pipeline's last stage runs (``Task.pipeline_head``; ``hftrain.parallel`` builds each)."""


@dataclass(frozen=True)
class Task:
    """What one ``model.task`` is.

    Args:
        name: the ``model.task`` value.
        human: what the model is called in messages ("sequence classifier").
        auto_class: transformers' ``AutoModelFor...`` class that builds the model.
        auto_mapping: transformers' model-type -> class mapping of that auto class
            (``transformers.models.auto.modeling_auto``).
        peft_task_type: PEFT's ``TaskType`` under LoRA (its name: ``SEQ_CLS``, ``TOKEN_CLS``, ``CAUSAL_LM``); PEFT's
            model for that type marks the head modules ``modules_to_save`` (trained and saved in full).
        head_modules: the head's module names that LoRA must train and save in full (one of them must exist and be
            trainable under PEFT's task type; empty: the task trains adapters only, a language model's head is tied).
        labels: where the head's outputs come from: ``"config"`` (``model.num_labels``, and ``model.problem_type``),
            ``"data"`` (the label names the data holds; ``model.num_labels`` left at its default or equal to
            their count), or ``"none"`` (no label head: a language model).
        load: ``"module:function"`` reading the ``train``/``validation`` splits:
            ``load(config, facts, sources) -> DatasetDict`` (``sources``: the data section's common fields).
        prepare: ``"module:function"`` turning the splits into model inputs:
            ``prepare(splits, tokenizer, inputs: Inputs, log) -> (tokenized, head)``, ``head`` the model-config
            fields the data decides (``problem_type``; ``num_labels``, ``id2label``, ``label2id``), ``{}`` when none.
        trainer: ``"module:Class"``, the task's ``hftrain.trainers`` Trainer subclass.
        pipeline_head: the head kind a pipeline's last stage runs (one of :data:`PIPELINE_HEADS`).
        per_token_loss: the loss is a mean over tokens (each labelled token counts once over the global batch), not
            over examples.
        packed_text: the data is text packed into blocks (``data.long_documents``, ``data.streaming`` apply).
        vocabulary_head: the head projects onto the vocabulary (the planner counts its logits as activations, its
            untied output projection on the pipeline's last stage, split over the vocabulary under tp).
        megatron_axes_not_built: megatron axes this task does not run yet (refused in one line when above 1).
    """

    name: str
    human: str
    auto_class: str
    auto_mapping: str
    peft_task_type: str
    head_modules: tuple[str, ...]
    labels: str
    load: str
    prepare: str
    trainer: str
    pipeline_head: str
    per_token_loss: bool = False
    packed_text: bool = False
    vocabulary_head: bool = False
    megatron_axes_not_built: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert self.pipeline_head in PIPELINE_HEADS, self.pipeline_head
        assert self.labels in ("config", "data", "none"), self.labels

    @property
    def takes_labels(self) -> bool:
        """Whether the model has a label head (``model.num_labels`` sizes it, or the data does)."""
        return self.labels != "none"

    @property
    def takes_problem_type(self) -> bool:
        """Whether ``model.problem_type`` applies (transformers' sequence-classification losses)."""
        return self.labels == "config"

    def trainer_class(self) -> type:
        """The trainer class, imported now."""
        return resolve(self.trainer)

    def read(self, config: Any, facts: Any, sources: dict[str, Any]) -> Any:
        """The splits before tokenization (``load``)."""
        return resolve(self.load)(config, facts, sources)

    def inputs(self, splits: Any, tokenizer: Any, inputs: Inputs, log: Any) -> tuple[Any, dict[str, Any]]:
        """The model inputs and the model-config fields the data decides (``prepare``)."""
        return resolve(self.prepare)(splits, tokenizer, inputs, log)


@dataclass(frozen=True)
class Inputs:
    """How a task's splits become model inputs, besides the splits and the tokenizer (``Task.prepare``).

    Args:
        max_length: ``data.max_seq_length`` as far as the model takes it (truncation, or the block length).
        long_documents: ``data.long_documents`` (causal LM).
        max_position: the model's position bound (causal LM: continued positions restart below it).
        work_dir: where the Arrow files of the tokens go (a cache build's scratch folder); None: in memory.
        num_proc: processes that tokenize.
        num_labels: ``model.num_labels`` when it is not its default, else None (a task whose labels come from the
            data checks a given count against them).
    """

    max_length: int
    long_documents: str = "continue"
    max_position: int | None = None
    work_dir: Path | None = None
    num_proc: int = 1
    num_labels: int | None = None


def resolve(reference: str) -> Any:
    """The object a ``"module:name"`` string names, imported now.

    Args:
        reference: ``"package.module:attribute"``.
    """
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
