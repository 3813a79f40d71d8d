"""LoRA with PEFT: low-rank adapters on chosen linear layers, the classification head trained in full.

A LoRA layer computes ``y = W x + (alpha / r) · B A x`` with ``W`` frozen, ``A`` (r × in) random and ``B``
(out × r) zero at start, so the adapted model starts equal to the base model. Each task's record
(``hftrain.tasks``) names its PEFT task type and head modules. PEFT's ``SEQ_CLS`` and ``TOKEN_CLS`` task types
add the head (``classifier`` for BERT-style, ``score`` for GPT-style models) to ``modules_to_save``: a full
trainable copy that is written into the adapter, or the freshly initialised head would be lost on reload
(pitfall "classification head lost with LoRA", docs/pitfalls.md). A causal language model (``CAUSAL_LM``) trains
only its adapters: its head is the (often tied) vocabulary projection the base model already has. The trainer's
optimizer takes only parameters with ``requires_grad``, so nothing else changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hftrain.errors import ConfigError, reading
from hftrain.tasks import DEFAULT_TASK, task_of

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from hftrain.config import LoraConfig


def apply_lora(model: PreTrainedModel, config: LoraConfig, task: str = DEFAULT_TASK) -> PeftModel:
    """Wrap a model in LoRA adapters; only the adapters (and a classifier's head) stay trainable.

    Args:
        model: the base model (full weights, not yet prepared).
        config: the ``lora`` config section; null ``lora_target_modules`` takes PEFT's default for the
            architecture (BERT ``query``/``value``, GPT-2 ``c_attn``, Llama ``q_proj``/``v_proj``).
        task: ``model.task``: its record's PEFT task type (``SEQ_CLS``, ``TOKEN_CLS``: the head modules trained
            and saved in full, ``modules_to_save``; ``CAUSAL_LM``).
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model

    targets = config.lora_target_modules or None
    if targets is None and not _has_default_targets(model):
        raise ConfigError(
            f"lora.lora_target_modules: PEFT has no default for model type '{model.config.model_type}'; "
            "list the linear layers to adapt (e.g. [q_proj, v_proj])"
        )
    _check_rank(model, config.lora_r, targets)
    record = task_of(task)
    peft_config = PeftLoraConfig(
        task_type=TaskType[record.peft_task_type],
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        # GPT-2 stores Conv1D weights transposed (in × out); PEFT would flip this itself, with a warning.
        fan_in_fan_out=_uses_conv1d(model),
    )
    with reading(
        f"lora.lora_target_modules {targets}",
        "name linear layers of the model (e.g. query value for BERT, q_proj v_proj for Llama)",
        catch=(ValueError,),  # PEFT: "Target modules ... not found in the base model"
    ):
        peft_model = get_peft_model(model, peft_config)
    if not record.head_modules:
        return peft_model
    head = [n for n in record.head_modules if hasattr(model, n)]
    if not head or not any(p.requires_grad for p in getattr(model, head[0]).parameters()):
        raise ConfigError(
            f"lora: {type(model).__name__} has no trainable '{'/'.join(record.head_modules)}' head under PEFT's "
            f"{record.peft_task_type} task; use a {record.auto_class.replace('AutoModel', '*')} model"
        )
    return peft_model


def _check_rank(model: PreTrainedModel, rank: int, targets: list[str] | None) -> None:
    """Refuse a rank above the smallest adapted layer's ``min(in, out)``, before PEFT allocates ``r × (in + out)``
    weights per layer (``lora_r`` 10⁹ asked for 128 GB): such a rank adds parameters and no capacity.

    Args:
        model: the base model.
        rank: ``lora.lora_r``.
        targets: ``lora.lora_target_modules``, or None for PEFT's default of the architecture.
    """
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        targets = list(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model.config.model_type, []))
    sizes = {}
    for name, module in model.named_modules():
        if not any(name == key or name.endswith(f".{key}") for key in targets):  # PEFT's match of a name
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and weight.dim() == 2:  # Linear (out × in), GPT-2's Conv1D (in × out): either way
            sizes[name] = tuple(weight.shape)
    if not sizes:
        return  # PEFT says which names match nothing
    name, shape = min(sizes.items(), key=lambda item: min(item[1]))
    if rank > min(shape):
        raise ConfigError(
            f"lora.lora_r {rank:,} is larger than the smallest adapted layer ({name}: {shape[0]} × {shape[1]}), whose "
            f"rank is at most {min(shape)}: a larger r adds parameters and no capacity; set lora_r to at most "
            f"{min(shape)} (typical: 4 to 64)"
        )


def is_peft_model(model: object) -> bool:
    """True for a ``peft.PeftModel`` (without importing peft for full models)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _has_default_targets(model: PreTrainedModel) -> bool:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    return model.config.model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING


def _uses_conv1d(model: PreTrainedModel) -> bool:
    from transformers.pytorch_utils import Conv1D

    return any(isinstance(m, Conv1D) for m in model.modules())
