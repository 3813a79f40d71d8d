"""Load a pretrained classifier with some of its submodules left on the ``meta`` device (no memory, no reads).

A pipeline rank trains only its stage's layers; building the whole model first and freeing the rest afterwards
makes every rank's *peak* memory the whole model (the weights of every stage, read and materialized, then cut).
This module asks ``transformers`` to load the model without the left-out submodules, so their weights are never
materialized: ``from_pretrained`` builds the model on ``meta`` (as it always does), and the left-out submodules
are taken out of the model before its weights are read, so their checkpoint tensors are skipped (unexpected); the
same module objects (still on ``meta``) are put back afterwards, so names and shapes stay those of the whole model.

Why not a public API: ``from_pretrained(device_map=...)`` cannot leave modules on ``meta`` (it dispatches with
hooks and pushes every later module to ``meta`` too), and transformers' own pipeline split
(``distributed_config``) is an even split of Llama-named layers. The hook used here is the one thing every
``PreTrainedModel`` has: the class's ``__init__``, run under ``from_pretrained``'s meta-device context. A
subclass created on the fly removes the submodules after the original ``__init__``, and the loaded model gets
its original class back, so nothing downstream (``save_pretrained``, ``type(model)``) sees the subclass.

Exactness: everything that is loaded is loaded by ``from_pretrained`` itself (dtype, key renames, tied weights,
new-head initialisation). The one difference a left-out module could make is the random stream: the full model
draws random numbers for every parameter its checkpoint lacks (the new classifier head), in module order. So
the head is never left out (callers leave out layers and embeddings, which the checkpoint holds), and
:func:`from_pretrained_leaving_out` checks that every left-out parameter is in the checkpoint (the safetensors
headers; the whole model would otherwise have initialised it); if one is not, the result would not equal the
whole model's, so it returns None and the caller builds the whole model (from the same random state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

LeaveOut = Callable[["nn.Module"], Iterable[str]]


def from_pretrained_leaving_out(
    model_class: type[PreTrainedModel], path: Any, leave_out: LeaveOut, *, trust_remote_code: bool, **kwargs: Any
) -> tuple[PreTrainedModel, list[str]] | None:
    """``model_class.from_pretrained(path, **kwargs)`` with the submodules ``leave_out`` names left on ``meta``.

    Args:
        model_class: the ``*ForSequenceClassification`` class ``AutoModelForSequenceClassification`` would pick.
        path: the model folder.
        leave_out: given the whole model (on ``meta``, before any weight is read), the dotted paths of the
            submodules this process does not need; they must not hold parameters the checkpoint lacks.
        trust_remote_code: the user's ``model.trust_remote_code``, said to transformers (never left to its prompt).
        kwargs: ``from_pretrained``'s keyword arguments (``num_labels``, ``attn_implementation``...).

    Returns:
        The model, every parameter outside the left-out submodules loaded exactly as ``from_pretrained`` loads
        it, the left-out ones on ``meta`` with their names and shapes, and the names ``from_pretrained``
        initialised (not in the checkpoint: the new head); or None when a left-out parameter was not in the
        checkpoint (the whole model would have initialised it from the random stream: build it whole).
    """
    from torch import nn

    removed: dict[str, nn.Module] = {}

    def init(self: Any, config: Any, *args: Any, **init_kwargs: Any) -> None:
        model_class.__init__(self, config, *args, **init_kwargs)
        for dotted in leave_out(self):
            parent, _, name = dotted.rpartition(".")
            owner = self.get_submodule(parent)
            removed[dotted] = owner._modules[name]
            owner._modules[name] = nn.Module()  # no parameters while the weights load

    partial = type(
        model_class.__name__,
        (model_class,),
        {"__init__": init, "__module__": model_class.__module__, "__qualname__": model_class.__qualname__},
    )
    with quiet_load_report():
        model, info = partial.from_pretrained(
            path, output_loading_info=True, trust_remote_code=trust_remote_code, **kwargs
        )
    model.__class__ = model_class
    for dotted, module in removed.items():
        parent, _, name = dotted.rpartition(".")
        model.get_submodule(parent)._modules[name] = module
    # A checkpoint of the base model (BertModel, GPT-2's own) names its tensors without the base-model prefix.
    prefix = model_class.base_model_prefix + "."
    saved = {key.removeprefix(prefix) for key in _checkpoint_keys(path)}
    left_out = {
        f"{dotted}.{name}".removeprefix(prefix)
        for dotted, module in removed.items()
        for name, _ in module.named_parameters()
    }
    return (model, sorted(info["missing_keys"])) if left_out <= saved else None


def _checkpoint_keys(path: Any) -> set[str]:
    """The tensor names of the folder's safetensors checkpoint (headers only); empty for other formats, which
    then cannot be shown to hold the left-out tensors (the whole model is built)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as weights:
            return set(weights.keys())
    return set()


@contextlib.contextmanager
def quiet_load_report():
    """transformers' load report is a table of every key it did not match (a new head as MISSING, a language
    model's ``lm_head`` as UNEXPECTED, here every left-out key); hftrain says in one line what matters."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
