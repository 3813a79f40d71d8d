"""Checks of a model folder and its tokenizer, run before anything is written.

A folder passes when its ``config.json`` parses and builds the classification model (on the meta device: no
memory, no weights read), it holds weights and tokenizer files, a trained classification head in it has
``model.num_labels`` classes, and its tokenizer's ids fit the model's embedding. What a model cannot take
(texts longer than its position embeddings) is clamped here with a logged note, never a shape error at step N.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError, reading
from hftrain.models.remote_code import check_remote_code
from hftrain.tasks import task_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from hftrain.config import ModelConfig

FIELD = "model.model_name_or_path"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Architectures whose position ids start after the padding index (RoBERTa-style): they take fewer tokens.
_PADDING_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet", "ibert", "data2vec-text")
# Exceptions transformers raises when a config describes a model it cannot build (the user's config.json).
_BUILD_ERRORS = (ValueError, TypeError, KeyError, AttributeError, RuntimeError, AssertionError)


def config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it cannot read or a model it cannot build from it.

    Besides ``_BUILD_ERRORS``: a config.json field of the wrong type (a string layer count) fails huggingface_hub's
    strict dataclass validation, and a zero size fails in the arithmetic (heads 0: a modulo by zero; vocab_size 0:
    an index out of range).
    """
    import huggingface_hub.errors

    strict = getattr(huggingface_hub.errors, "StrictDataclassError", None)
    return (*_BUILD_ERRORS, OSError, ArithmeticError, IndexError, *((strict,) if strict else ()))


@dataclass(frozen=True)
class ModelFacts:
    """What the checks learned about a model folder.

    Args:
        path: the folder ``from_pretrained`` loads.
        max_length: the most tokens the model takes in one text (None when it declares no limit).
        vocab_size: rows of its input embedding (None when it declares none).
        problem_type: the task its ``config.json`` names (``problem_type``), or None.
    """

    path: Path
    max_length: int | None
    vocab_size: int | None
    problem_type: str | None = None


def check_model_folder(config: ModelConfig) -> ModelFacts:
    """Check that the folder loads as a ``num_labels``-class classifier, reading no weights.

    Args:
        config: the ``model`` config section.
    """
    from hftrain.models import resolve_model_path

    path = resolve_model_path(config.model_name_or_path)
    trusted = check_remote_code(path, FIELD, trusted=config.trust_remote_code)
    _read_config_json(path)
    present = {p.name for p in path.iterdir()}
    if not present & set(WEIGHT_FILES):
        raise ConfigError(
            f"{FIELD}: '{path}' has no weights file ({' or '.join(WEIGHT_FILES[::2])}); save the model there with "
            "save_pretrained, or point to a complete model folder"
        )
    if not present & set(TOKENIZER_FILES):
        raise ConfigError(
            f"{FIELD}: '{path}' has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}...); a default tokenizer "
            "would turn every text into unknown tokens: save the model's tokenizer there (tokenizer.save_pretrained)"
        )
    model_config = _auto_config(path, trusted)
    if task_of(config.task).takes_problem_type:  # model.num_labels sizes the head: a trained head must match it
        _check_head(path, model_config, config.num_labels)
    _build_on_meta(path, model_config, config.num_labels, config.task, trusted)
    return ModelFacts(
        path=path,
        max_length=_max_positions(model_config),
        vocab_size=_vocab_size(model_config),
        problem_type=getattr(model_config, "problem_type", None),
    )


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, facts: ModelFacts) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding (an index error at the first step).

    Args:
        tokenizer: the loaded tokenizer.
        facts: what ``check_model_folder`` found.
    """
    if facts.vocab_size is not None and len(tokenizer) > facts.vocab_size:
        raise ConfigError(
            f"{FIELD}: the tokenizer in '{facts.path}' has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{facts.vocab_size}; ids above it would crash training: save the model's own tokenizer there"
        )


def effective_max_length(requested: int, facts: ModelFacts, tokenizer: Any, log: Callable[[str], None]) -> int:
    """``data.max_seq_length``, clamped to what the model (and its tokenizer) can take, with a logged note.

    Args:
        requested: ``data.max_seq_length``.
        facts: what ``check_model_folder`` found.
        tokenizer: its ``model_max_length`` also bounds the length when it is a real limit.
        log: receives the note when the length is clamped.
    """
    limits = [n for n in (facts.max_length, getattr(tokenizer, "model_max_length", None)) if n and n < 10**6]
    limit = min(limits, default=requested)
    if requested <= limit:
        return requested
    log(f"data.max_seq_length {requested} exceeds what the model takes ({limit} tokens); truncating texts to {limit}")
    return limit


def _read_config_json(path: Path) -> dict[str, Any]:
    return read_config_file(path / "config.json", FIELD)


def read_config_file(file: Path, field: str) -> dict[str, Any]:
    """A model's config file as a mapping with a ``model_type``, or one line naming ``field`` and the file.

    Args:
        file: a ``config.json`` (or another config file ``hftrain plan --model`` is given).
        field: the config field or flag that named it, for the message.
    """
    with reading(f"{field}: {file}", "fix the file or save the model again with save_pretrained"):
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{field}: {file} is not valid JSON (line {error.lineno}: {error.msg}); fix the file or save "
                "the model again with save_pretrained"
            ) from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(
            f"{field}: {file} has no model_type; it is not a transformers model config: save the model with "
            "save_pretrained"
        )
    return raw


def _auto_config(path: Path, trusted: bool = False) -> PretrainedConfig:
    from transformers import AutoConfig

    with reading(
        f"{FIELD}: {path / 'config.json'}",
        "fix the config or save the model again with save_pretrained",
        catch=config_errors(),
    ):
        return AutoConfig.from_pretrained(path, trust_remote_code=trusted)


def _check_head(path: Path, model_config: PretrainedConfig, num_labels: int) -> None:
    """A trained classification head must have ``num_labels`` outputs (loading would fail on its shape)."""
    trained_head = any(a.endswith("ForSequenceClassification") for a in model_config.architectures or [])
    if trained_head and model_config.num_labels != num_labels:
        raise ConfigError(
            f"model.num_labels is {num_labels} but '{path}' holds a trained {model_config.num_labels}-class "
            f"classification head; set model.num_labels: {model_config.num_labels}, or start from the base model"
        )


def _build_on_meta(
    path: Path, model_config: PretrainedConfig, num_labels: int, task: str, trusted: bool = False
) -> None:
    """Construct the task's model on the meta device: the architecture's own checks of its sizes, at no cost.

    Args:
        path: the model folder, for messages.
        model_config: its config.
        num_labels: ``model.num_labels``.
        task: ``model.task``.
        trusted: the folder's own code (its ``auto_map``) may build it (``model.trust_remote_code``).
    """
    import copy

    import torch

    from hftrain.models import auto_model_class, task_model_class

    if task_model_class(task, model_config) is None and not trusted:
        raise ConfigError(
            f"{FIELD}: transformers has no {task.replace('_', ' ')} model for model type '{model_config.model_type}' "
            f"({path / 'config.json'}); choose a model of another family, or another model.task"
        )
    model_config = copy.deepcopy(model_config)
    model_config.num_labels = num_labels
    with reading(
        f"{FIELD}: {path / 'config.json'} does not describe a buildable {task.replace('_', ' ')} model",
        "fix its sizes (e.g. hidden_size divisible by num_attention_heads) or choose another model",
        catch=config_errors(),
    ):
        with torch.device("meta"):
            auto_model_class(task).from_config(model_config, trust_remote_code=trusted)


def _max_positions(model_config: PretrainedConfig) -> int | None:
    positions = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if positions and model_config.model_type in _PADDING_OFFSET_TYPES:
        positions -= (model_config.pad_token_id or 0) + 1
    return positions


def _vocab_size(model_config: PretrainedConfig) -> int | None:
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text_config, "vocab_size", None)
