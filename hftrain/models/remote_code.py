"""No code from a model folder: the check before transformers reads a folder, and the keys an export never writes.

Below ``hftrain.models`` and its checks, which both call it (the folder's loaders, the model-folder check, the
planner, export and convert). Pitfall "remote code behind a prompt", docs/pitfalls.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError, HFTrainError
from hftrain.files import read_input

if TYPE_CHECKING:
    from transformers import PretrainedConfig

REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
"""The files whose ``auto_map`` makes transformers import Python code from the model folder (the model's classes,
its tokenizer's)."""


def check_remote_code(folder: str | os.PathLike[str], field: str, *, trusted: bool = False, fix: str = "") -> bool:
    """Refuse a model folder whose config names Python code to run (an ``auto_map``) unless ``trusted``; True when
    it names some (the caller passes ``trust_remote_code=True`` on, under ``trusted``). Pitfall "remote code behind a
    prompt", docs/pitfalls.md.

    Runs before transformers sees the folder: transformers asks "Do you wish to run the custom code? [y/N]" on stdin
    when it is not told, so a command would stop at a terminal, and a "y" piped in would run the planted code.

    Args:
        folder: the model folder.
        field: the config field or argument that named it, for the message.
        trusted: the user's ``model.trust_remote_code`` (never a checkpoint's).
        fix: how to get past the refusal; the default names ``model.trust_remote_code``.
    """
    folder = Path(folder)
    for name in REMOTE_CODE_FILES:
        raw = _json_if_regular(folder / name)
        auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
        if not auto_map:
            continue
        if trusted:
            return True
        named = ", ".join(sorted(map(str, auto_map))) if isinstance(auto_map, dict) else _shown(auto_map)
        fix = fix or "remove auto_map from it, or set model.trust_remote_code: true if you wrote or checked that code"
        raise ConfigError(
            f"{field}: {folder / name} names Python code to run (auto_map: {named}), and hftrain runs no code from a "
            f"model folder; {fix}"
        )
    return False


CODE_KEYS = ("auto_map", "trust_remote_code")
"""Config keys that make a loader import code from beside the file: never written into an export or a conversion."""


def without_code(model_config: PretrainedConfig) -> PretrainedConfig:
    """``model_config`` without :data:`CODE_KEYS` (in place; returned), so that the ``config.json`` written from it
    names no code for a later loader to run.

    Args:
        model_config: a copy of the model's config about to be saved.
    """
    for key in CODE_KEYS:
        model_config.__dict__.pop(key, None)
    # A config class loaded through an auto_map is registered for an auto class: save_pretrained would copy its
    # module beside the file and write the auto_map back (transformers' custom_object_save).
    model_config.__dict__["_auto_class"] = None
    return model_config


def _json_if_regular(file: Path) -> Any:
    """A JSON file's contents; None when it is missing, not a regular file (a FIFO is not waited on) or not JSON
    (the checks that read it properly say why)."""
    with contextlib.suppress(OSError, ValueError, HFTrainError):
        return json.loads(read_input(file, str(file)))
    return None


def _shown(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
