"""``hftrain convert``: a checkpoint into a ``save_pretrained`` folder, in one CPU process, one tensor at a time.

Two sources, both read without starting the world that wrote them:

- an hftrain checkpoint (``output_dir/checkpoints/step_<N>``, or a run folder: its latest): the
  ``torch.distributed.checkpoint`` folder ``state/dcp`` holds every tensor of the unwrapped model under
  ``model.<name>`` with its full shape and fp32 master values, whatever strategy and layout wrote it; its
  ``.metadata`` gives every name, shape and dtype and where each rank's chunk of a tensor lies, and
  ``read_dcp_tensor`` reads the chunks of one tensor straight into it (``dcp.load`` would hold each chunk twice).
  ``state/hf_model`` has the model's ``config.json`` (and, under LoRA, ``adapter_config.json``).
- a DeepSpeed ZeRO checkpoint folder (what ``engine.save_checkpoint`` writes: ``latest``,
  ``global_step<N>/*_optim_states.pt``): DeepSpeed's own ``zero_to_fp32`` in lazy mode gives the fp32 master
  weights; under ZeRO-3 each is gathered from the ranks' mapped partitions only when asked for (``contiguous()``).
  Under ZeRO-1/2 DeepSpeed loads the module's weights and concatenates each parameter group's partitions first, so
  that source holds about twice the model (DeepSpeed's "memory usage doubles here (zero2)"). The folder has no
  model config: ``--config`` names one.

The names, shapes and dtypes are known up front, so ``hftrain.checkpoint.stream`` writes the safetensors headers
first and each tensor as it is read. A full model becomes ``config.json`` + ``model.safetensors`` (tied copies left
out, as ``save_pretrained`` does); a LoRA checkpoint a PEFT adapter folder (``adapter_config.json`` +
``adapter_model.safetensors`` under PEFT's own key names, found by asking ``get_peft_model_state_dict`` on a model
built on the meta device), and with ``merge_lora`` also ``<out>_merged``: each adapted weight merged on its own,
``W + B A · scaling`` (transposed for ``fan_in_fan_out`` layers), as PEFT's ``merge_and_unload`` computes it.

Everything is written under a staging name, read back tensor by tensor and compared bit for bit with the
checkpoint, then renamed into place. Pickles are unpickled only after ``checkpoint.safety`` loaded every one with
its restricted unpickler, and a checkpoint outside the run folder the command names needs
``--trust_external_checkpoint`` (``checkpoint.resume.check_trusted``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hftrain.checkpoint.manager import STATE_DIR, CheckpointError
from hftrain.checkpoint.sharded import DCP_DIR, MODEL_PREFIX, check_sharded, read_dcp_tensor, stored_chunks
from hftrain.checkpoint.sharded import HF_DIR as HF_MODEL_DIR
from hftrain.checkpoint.stream import EXPORT_DTYPES, TensorSpec, parse_shard_size, saved_dtype, write_streamed
from hftrain.errors import ConfigError, reading, writing
from hftrain.files import FolderLock, check_own, fresh_folder, read_input, remove_quietly, write_file
from hftrain.log import get_logger

PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"
# LoRA variants whose merge is not W + B A · scaling: refused rather than merged wrongly.
_UNMERGEABLE = ("lora_embedding_A", "lora_magnitude_vector", "lora_E")


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert_checkpoint`` wrote.

    Args:
        model_dir: the output folder (a full model, or the LoRA adapter).
        merged_dir: the merged full model, when ``merge_lora`` was set.
        is_adapter: whether ``model_dir`` holds a PEFT adapter.
        tensors: tensors written and verified, over every folder.
        source: ``"dcp"`` (an hftrain checkpoint) or ``"zero"`` (a DeepSpeed folder).
        tokenizer: whether tokenizer files were written.
    """

    model_dir: str
    merged_dir: str | None
    is_adapter: bool
    tensors: int
    source: str
    tokenizer: bool


@dataclass
class _Source:
    """A checkpoint's tensors by name (``load`` reads one), and the model description beside them."""

    kind: str
    path: Path
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    load: Callable[[str], torch.Tensor]
    config: Any  # transformers PretrainedConfig
    adapter_config: dict[str, Any] | None
    tokenizer_from: str | None


@dataclass(frozen=True)
class _Target:
    """One tensor of an output folder: where its value comes from."""

    spec: TensorSpec
    produce: Callable[[], torch.Tensor]


def convert_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    merge_lora: bool = False,
    trust: bool = False,
    output_dir: str | Path | None = None,
    config: str | None = None,
    max_shard_size: int | str = "50GB",
) -> ConvertResult:
    """Write ``checkpoint`` as a ``save_pretrained`` folder ``out`` (LoRA: a PEFT adapter), streaming.

    Args:
        checkpoint: a ``step_<N>`` folder, a run's ``output_dir`` (its latest checkpoint), or a DeepSpeed
            checkpoint folder (holding ``latest``, or a ``global_step<N>`` folder itself).
        out: a new (or empty) folder.
        dtype: the saved dtype of floating-point tensors: ``float32``, ``bfloat16`` or ``float16``.
        merge_lora: for a LoRA checkpoint, also write ``<out>_merged``, the adapter merged into the base model.
        trust: allow a checkpoint outside the run folder the command names.
        output_dir: the run folder the checkpoint belongs to (a checkpoint inside it needs no ``trust``).
        config: for a DeepSpeed folder, the model's config: a folder with ``config.json`` (and
            ``adapter_config.json`` for a LoRA run) or a cached model name.
        max_shard_size: bytes per safetensors file (int or e.g. ``"5GB"``).
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype '{dtype}' is not one of {', '.join(EXPORT_DTYPES)}; choose one of them")
    parse_shard_size(max_shard_size, field="--max_shard_size")  # refused before anything is read or written
    out = Path(out)
    merged = out.with_name(out.name + "_merged") if merge_lora else None
    for target in (out, merged):
        if target is not None:
            _check_new_dir(target, Path(checkpoint))
    # OUT is this command's from its first write to its end; a second command is refused naming it (probed now,
    # before the checkpoint is read; taken before the first write, and the folder checked again under it)
    lock = FolderLock.for_folder(out, "convert output", command="convert")
    lock.check_free()
    # Trust comes from the command: without a run folder named, nothing is inside one (as ``hftrain export``).
    run_dir = Path(output_dir) if output_dir is not None else out
    scratch = out.parent if out.parent.is_dir() else None  # DeepSpeed's files are copied there: as large
    source = _open_source(Path(checkpoint), trust=trust, output_dir=run_dir, config=config, scratch=scratch)
    if merge_lora and source.adapter_config is None:
        raise ConfigError(
            f"--merge_lora: checkpoint '{source.path}' is of a full fine-tune, there is no adapter to merge; "
            "drop --merge_lora"
        )
    export_dtype = EXPORT_DTYPES[dtype]
    folders = _plan_folders(source, export_dtype, merged is not None)
    targets = [out] + ([merged] if merged is not None else [])
    stages = [t.with_name(f".staging-{t.name}") for t in targets]
    from hftrain.checkpoint.export import _publish_all

    tensors = 0
    tokenizer_written = False
    with lock, writing(f"the converted model '{out}'", location=out, catch=(OSError,)):
        for target in targets:  # another convert may have published into it since the check above
            _check_new_dir(target, Path(checkpoint))
        try:
            for stage, (write_config, prefix, planned) in zip(stages, folders, strict=True):
                # a killed convert's staging folder is removed; a link or a FIFO there is refused, never written
                fresh_folder(stage, "the convert's staging folder")
                write_config(stage)
                write_streamed(
                    stage,
                    [t.spec for t in planned],
                    ((t.spec.name, t.produce()) for t in planned),  # one tensor alive at a time
                    verify=True,  # each read back while its source value is still at hand
                    prefix=prefix,
                    max_shard_size=max_shard_size if prefix == "model" else 1 << 62,
                )
                tensors += len(planned)
                tokenizer_written = _save_tokenizer(source.tokenizer_from, stage)
            _publish_all(list(zip(stages, targets, strict=True)))  # every target checked before the first rename
        finally:
            for stage in stages:
                remove_quietly(stage)  # a link or a FIFO is left as it is
    if source.tokenizer_from is not None and not tokenizer_written:
        get_logger().warning(
            f"no tokenizer written: '{source.tokenizer_from}' has no tokenizer files here; copy them into {out}"
        )
    return ConvertResult(
        model_dir=str(out),
        merged_dir=str(merged) if merged is not None else None,
        is_adapter=source.adapter_config is not None,
        tensors=tensors,
        source=source.kind,
        tokenizer=tokenizer_written,
    )


# ----------------------------------------------------------------- sources
def _open_source(path: Path, *, trust: bool, output_dir: Path, config: str | None, scratch: Path | None) -> _Source:
    """The checkpoint behind ``path``, after its trust and no-code checks (``scratch``: where a DeepSpeed folder's
    verified copy is made, :func:`~hftrain.checkpoint.safety.verified_zero_copy`)."""
    from hftrain.checkpoint.manager import MARKER, open_checkpoint
    from hftrain.checkpoint.run import CHECKPOINTS_DIR, latest_of_run

    if not path.exists():
        raise CheckpointError(
            f"checkpoint '{path}' does not exist; give a step_<N> folder, a run's output_dir or a DeepSpeed "
            "checkpoint folder"
        )
    if (path / CHECKPOINTS_DIR).is_dir():  # a run folder: its latest checkpoint, trusted as the user named the run
        output_dir = path
        opened = latest_of_run(path, "convert")
        opened.verify()
        path = opened.path
    else:
        opened = None
    if (path / MARKER).is_file():
        if config is not None:
            raise ConfigError(
                f"--config: checkpoint '{path}' carries its model config (state/{HF_MODEL_DIR}); drop --config"
            )
        return _dcp_source(path, opened or open_checkpoint(path), trust=trust, output_dir=output_dir)
    deepspeed_root = _deepspeed_root(path)
    if deepspeed_root is not None:
        return _zero_source(*deepspeed_root, trust=trust, output_dir=output_dir, config=config, scratch=scratch)
    raise CheckpointError(
        f"'{path}' is not a checkpoint: it has neither {MARKER} (an hftrain checkpoint) nor a DeepSpeed 'latest' "
        "file or *_optim_states.pt; give a step_<N> folder, a run's output_dir or a DeepSpeed checkpoint folder"
    )


def _dcp_source(path: Path, verified: Any, *, trust: bool, output_dir: Path) -> _Source:
    """The tensors of an hftrain checkpoint, read through ``verified`` (``manager.VerifiedCheckpoint``): the metadata
    from the bytes whose checksum was checked, each ``.distcp`` through a descriptor on the very file verified."""
    from hftrain.checkpoint.resume import check_trusted
    from hftrain.checkpoint.safety import check_no_code
    from hftrain.checkpoint.sharded import dcp_metadata

    meta = verified.meta

    state = path / STATE_DIR
    dcp_dir = state / DCP_DIR
    check_sharded(state)  # a checkpoint of the per-strategy formats before the sharded one: one line
    if not (dcp_dir / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint '{path}' has no {STATE_DIR}/{DCP_DIR}/.metadata; it is damaged: convert another checkpoint"
        )
    hf_model = state / HF_MODEL_DIR
    if not (hf_model / "config.json").is_file():
        raise CheckpointError(
            f"checkpoint '{path}' has no {STATE_DIR}/{HF_MODEL_DIR}/config.json (the model's config); it is "
            "damaged: convert another checkpoint"
        )
    check_trusted(path, output_dir, trusted=trust, export=True)
    check_no_code(path, state)  # every pickle (the DCP .metadata included) through a restricted unpickler first
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with verified.active():  # read once, its checksum checked on those bytes, built by the restricted unpickler
        metadata = dcp_metadata(dcp_dir)
    shapes = {
        key[len(MODEL_PREFIX) :]: (tuple(entry.size), entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not shapes:
        raise CheckpointError(
            f"checkpoint '{path}': {STATE_DIR}/{DCP_DIR} holds no '{MODEL_PREFIX}*' tensor; it is damaged or not "
            "hftrain's: convert another checkpoint"
        )

    chunks = stored_chunks(metadata, MODEL_PREFIX)

    def load(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        with reading(f"checkpoint '{path}': {MODEL_PREFIX}{name}", "convert another checkpoint",
                     catch=(Exception,), error_class=CheckpointError), verified.active():  # fmt: skip
            return read_dcp_tensor(dcp_dir, MODEL_PREFIX + name, shape, dtype, chunks.get(name, []))

    # The model's config and adapter config from the bytes whose checksums were checked, never by path again
    # (transformers' from_pretrained would open config.json anew, a file a writer could have swapped since).
    adapter_file = hf_model / "adapter_config.json"
    config_what = f"checkpoint '{path}': {STATE_DIR}/{HF_MODEL_DIR}/config.json"
    adapter_what = f"checkpoint '{path}': {STATE_DIR}/{HF_MODEL_DIR}/adapter_config.json"
    listed = f"{STATE_DIR}/{HF_MODEL_DIR}/adapter_config.json" in meta["files"]
    return _Source(
        kind="dcp",
        path=path,
        shapes=shapes,
        load=load,
        config=_config_of(verified.read(hf_model / "config.json"), config_what),
        adapter_config=_adapter_config_of(verified.read(adapter_file), adapter_what) if listed else None,
        tokenizer_from=meta["config"].get("model.model_name_or_path"),
    )


def _deepspeed_root(path: Path) -> tuple[Path, str] | None:
    """``(checkpoint_dir, tag)`` of a DeepSpeed folder: one holding ``latest``, or a tag folder of optim states."""
    latest = path / "latest"
    if path.is_dir() and os.path.lexists(latest):
        import stat

        from hftrain.files import kind_of

        status = os.lstat(latest)  # never opened when it is a link or a FIFO (which would block), nor when huge
        if not stat.S_ISREG(status.st_mode) or status.st_size > 4096:
            what = kind_of(status.st_mode) if not stat.S_ISREG(status.st_mode) else f"{status.st_size} bytes"
            raise CheckpointError(
                f"DeepSpeed checkpoint '{path}': 'latest' is {what}, not the tag DeepSpeed writes (a short text "
                "file); give the folder of a complete ZeRO save, or a global_step<N> folder inside it"
            )
        from hftrain.files import UnsafePathError, read_regular

        try:
            tag = read_regular(latest, "DeepSpeed's 'latest'").decode("utf-8", "replace").strip()
        except (OSError, UnsafePathError) as error:
            raise CheckpointError(
                f"DeepSpeed checkpoint '{path}': {error}; give the folder of a complete ZeRO save"
            ) from None
        if not (path / tag).is_dir():
            raise CheckpointError(
                f"DeepSpeed checkpoint '{path}': 'latest' names '{tag}', which is missing; give the folder of a "
                "complete save, or a global_step<N> folder inside it"
            )
        return path, tag
    if path.is_dir() and any(path.glob("*_optim_states.pt")):
        return path.parent, path.name
    return None


def _zero_source(
    root: Path, tag: str, *, trust: bool, output_dir: Path, config: str | None, scratch: Path | None
) -> _Source:
    """The fp32 weights of a DeepSpeed ZeRO folder, through DeepSpeed's ``zero_to_fp32`` in lazy mode, handed a
    private copy of the state files that the restricted unpickler checked (never the folder itself, whose files a
    writer could swap between the check and DeepSpeed's unrestricted load)."""
    from hftrain.checkpoint.safety import verified_zero_copy

    folder = root / tag
    if config is None:
        raise ConfigError(
            f"DeepSpeed checkpoint '{root}' holds no model config; give --config, a folder with the model's "
            "config.json (and adapter_config.json for LoRA) or a cached model name"
        )
    inside = folder.resolve().is_relative_to(output_dir.resolve())
    if not (trust or inside):
        raise CheckpointError(
            f"DeepSpeed checkpoint '{root}' is outside the run folder this command names; its *.pt files are "
            "pickles, unpickled on load (after a restricted unpickler accepted them); name the run it belongs to "
            "with --output_dir RUN, or pass --trust_external_checkpoint if you trust it"
        )
    import deepspeed  # noqa: F401 - its classes are in the restricted unpickler's allow-list only once imported
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with verified_zero_copy(root, tag, scratch=scratch) as private:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints its progress
                # Its optimizer files are mapped: the lazy tensors outlive the private folder's removal.
                lazy = get_fp32_state_dict_from_zero_checkpoint(str(private), tag=tag, lazy_mode=True)
        except (OSError, ValueError, KeyError) as error:
            reason = " ".join(str(error).replace(str(private), str(root)).split())  # the user's folder, not ours
            raise CheckpointError(
                f"DeepSpeed checkpoint '{folder}': {reason}; give the folder of a complete ZeRO save"
            ) from None
    shapes = {name: (tuple(value.shape), value.dtype) for name, value in lazy.items()}

    def load(name: str) -> torch.Tensor:
        return lazy[name].contiguous()  # a ZeRO-3 GatheredTensor is assembled here, from the mapped partitions

    config_dir = Path(config)
    adapter_file = config_dir / "adapter_config.json"
    return _Source(
        kind="zero",
        path=folder,
        shapes=shapes,
        load=load,
        config=_read_config(config, f"--config '{config}'"),
        adapter_config=_read_adapter_config(adapter_file) if adapter_file.is_file() else None,
        tokenizer_from=config,
    )


def _read_config(where: str, what: str) -> Any:
    from transformers import AutoConfig

    from hftrain.models.remote_code import check_remote_code

    # Before transformers reads it: it would ask on stdin whether to run the code an auto_map names.
    check_remote_code(where, what, fix="hftrain convert never runs model code: remove auto_map from that config.json")
    with reading(what, "give a folder with the model's config.json or a cached model name",
                 catch=(OSError, ValueError, KeyError)):  # fmt: skip
        return AutoConfig.from_pretrained(where, local_files_only=True, trust_remote_code=False)


def _config_of(data: bytes, what: str) -> Any:
    """A transformers config built from a checkpoint's ``config.json`` bytes (read once and checked), of a model type
    transformers itself knows: a checkpoint's ``auto_map`` (code to import) is left out, as hftrain runs no code that
    comes with a checkpoint.

    Args:
        data: the file's bytes.
        what: the file, for messages.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fix = "convert another checkpoint"
    with reading(what, fix, catch=(ValueError, RecursionError), error_class=CheckpointError):
        values = json.loads(data)
    if not isinstance(values, dict):
        raise CheckpointError(f"{what} holds a {type(values).__name__}, not a config; it is damaged: {fix}")
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"{what}: model_type {model_type!r} is not one this transformers knows (hftrain runs no code shipped with "
            f"a checkpoint); {fix}, or upgrade transformers"
        )
    values = {key: value for key, value in values.items() if key != "auto_map"}
    with reading(what, fix, catch=(ValueError, TypeError, KeyError, AttributeError), error_class=CheckpointError):
        return CONFIG_MAPPING[model_type].from_dict(values)


def _read_adapter_config(path: Path) -> dict[str, Any]:
    with reading(f"{path}", "restore the adapter_config.json PEFT wrote", catch=(OSError, ValueError, RecursionError)):
        adapter = json.loads(read_input(path, "adapter_config.json"))
    return _lora_only(adapter, str(path), ConfigError)


def _adapter_config_of(data: bytes, what: str) -> dict[str, Any]:
    """A checkpoint's ``adapter_config.json`` from its bytes (read once and checked).

    Args:
        data: the file's bytes.
        what: the file, for messages.
    """
    with reading(what, "convert another checkpoint", catch=(ValueError, RecursionError), error_class=CheckpointError):
        adapter = json.loads(data)
    return _lora_only(adapter, what, CheckpointError)


def _lora_only(adapter: Any, what: str, error_class: type[Exception]) -> dict[str, Any]:
    if not isinstance(adapter, dict):
        raise error_class(f"{what} holds a {type(adapter).__name__}, not an adapter config; restore the one PEFT wrote")
    if adapter.get("peft_type") != "LORA":
        raise error_class(f"{what}: peft_type {adapter.get('peft_type')!r} is not LORA; hftrain converts LoRA only")
    return adapter


# ----------------------------------------------------------------- what each folder holds
def _plan_folders(
    source: _Source, export_dtype: torch.dtype, merge: bool
) -> list[tuple[Callable[[Path], None], str, list[_Target]]]:
    """Per output folder: its config writer, its file prefix and its tensors."""
    base, peft_model = _skeleton(source)
    from hftrain.models.remote_code import without_code

    config = without_code(copy.deepcopy(source.config))  # no auto_map: the converted folder names no code to run
    config.architectures = [type(base).__name__]
    if hasattr(config, "dtype"):
        config.dtype = export_dtype

    def write_config(stage: Path) -> None:
        config.save_pretrained(stage)

    if peft_model is None:
        return [(write_config, "model", _full_targets(source, base, export_dtype, prefix=""))]

    def write_adapter_config(stage: Path) -> None:
        adapter = {**source.adapter_config, "inference_mode": True}
        write_file(stage / "adapter_config.json", json.dumps(adapter, indent=2, sort_keys=True) + "\n")

    folders = [(write_adapter_config, "adapter_model", _adapter_targets(source, peft_model, export_dtype))]
    if merge:
        folders.append((write_config, "model", _merged_targets(source, base, export_dtype)))
    return folders


def _skeleton(source: _Source) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The model (and its PEFT wrapper under LoRA) on the meta device, of the class whose names the checkpoint has."""
    import transformers

    candidates = []
    for name in source.config.architectures or []:
        if hasattr(transformers, name):
            candidates.append(getattr(transformers, name))
    # The class the config names (a base model's config may name a pretraining head), then hftrain's own task, then
    # the heads a DeepSpeed folder of another task may hold: the first whose names and shapes match is taken.
    candidates += [
        transformers.AutoModelForSequenceClassification,
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForMaskedLM,
        transformers.AutoModel,
    ]
    names = set(source.shapes)
    best: tuple[int, str] | None = None
    for model_class in candidates:
        config_class = getattr(model_class, "config_class", None)
        if isinstance(config_class, type) and not isinstance(source.config, config_class):
            # A class named by ``architectures`` built from another model type's config (a resealed model_type)
            # would take the tensors, and the written folder would then load as the config's own class, whose
            # names differ: random weights. Only classes of the config's own type count.
            continue
        with torch.device("meta"), warnings.catch_warnings(), _quiet_transformers():
            warnings.simplefilter("ignore")  # a class that does not fit this config says so: it is only a candidate
            try:
                base = (
                    model_class.from_config(copy.deepcopy(source.config), trust_remote_code=False)
                    if hasattr(model_class, "from_config")
                    else model_class(copy.deepcopy(source.config))
                )
            except (ValueError, TypeError, KeyError, AttributeError):  # a class that does not take this config
                continue
            # get_peft_model rewrites the modules it is given: the adapter's skeleton is built on a second copy.
            peft_model = (
                _peft_on(copy.deepcopy(base), source.adapter_config) if source.adapter_config is not None else None
            )
        skeleton = peft_model if peft_model is not None else base
        expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        tied = _tied(base, prefix=PEFT_PREFIX if peft_model is not None else "")
        missing = sorted(set(expected) - names - tied)
        extra = sorted(names - set(expected))
        wrong = [k for k in expected if k in names and source.shapes[k][0] != expected[k]]
        if not (missing or extra or wrong):
            return base, peft_model
        problem = (
            f"lacks {len(missing)} of its tensors (e.g. {missing[0]})" if missing
            else f"holds {len(extra)} tensors it does not have (e.g. {extra[0]})" if extra
            else f"has {wrong[0]} of shape {source.shapes[wrong[0]][0]}, the model {expected[wrong[0]]}"
        )  # fmt: skip
        score = len(missing) + len(extra) + len(wrong)
        if best is None or score < best[0]:
            best = (score, f"{type(base).__name__}: the checkpoint {problem}")
    raise CheckpointError(
        f"checkpoint '{source.path}' does not hold the model its config describes ({best[1] if best else 'no class'}); "
        "give the config of the model that was trained"
    )


def _peft_on(base: torch.nn.Module, adapter_config: dict[str, Any]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    if adapter_config.get("use_dora") or adapter_config.get("lora_bias") or adapter_config.get("alpha_pattern"):
        raise ConfigError(
            "adapter_config.json: DoRA, LoRA biases and alpha_pattern are not converted by hftrain (its runs use "
            "none); merge with PEFT's merge_and_unload instead"
        )
    known = set(LoraConfig.__dataclass_fields__)
    config = LoraConfig(**{k: v for k, v in adapter_config.items() if k in known})
    return get_peft_model(base, config)


def _tied(base: torch.nn.Module, *, prefix: str) -> set[str]:
    """The names ``save_pretrained`` leaves out as tied to another (transformers 5: ``all_tied_weights_keys``)."""
    return {prefix + key for key in (getattr(base, "all_tied_weights_keys", None) or {})}


def _spec(name: str, source: _Source, source_name: str, export_dtype: torch.dtype) -> TensorSpec:
    shape, dtype = source.shapes[source_name]
    return TensorSpec(name, shape, saved_dtype(dtype, export_dtype))


def _full_targets(source: _Source, base: torch.nn.Module, export_dtype: torch.dtype, *, prefix: str) -> list[_Target]:
    tied = _tied(base, prefix="")
    return [
        _Target(_spec(name, source, prefix + name, export_dtype), lambda key=prefix + name: source.load(key))
        for name in base.state_dict()
        if name not in tied
    ]


def _adapter_targets(source: _Source, peft_model: torch.nn.Module, export_dtype: torch.dtype) -> list[_Target]:
    """PEFT's own adapter names: ``get_peft_model_state_dict`` run on the meta model says which tensor becomes which."""
    from peft import get_peft_model_state_dict

    state = dict(peft_model.state_dict())
    by_identity = {id(value): name for name, value in state.items()}
    selected = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=ADAPTER_NAME)
    targets = []
    for name, value in selected.items():
        source_name = by_identity[id(value)]
        targets.append(_Target(_spec(name, source, source_name, export_dtype), lambda k=source_name: source.load(k)))
    return targets


def _merged_targets(source: _Source, base: torch.nn.Module, export_dtype: torch.dtype) -> list[_Target]:
    """The base model's tensors with each adapted weight merged: ``W + transpose(B A) · scaling``, one at a time."""
    unmergeable = [k for k in source.shapes if any(part in k for part in _UNMERGEABLE)]
    if unmergeable:
        raise ConfigError(
            f"--merge_lora: the adapter has {unmergeable[0]}, a LoRA variant hftrain does not merge; drop "
            "--merge_lora and merge the adapter with PEFT"
        )
    adapter = source.adapter_config
    fan_in_fan_out = bool(adapter.get("fan_in_fan_out"))
    targets = []
    tied = _tied(base, prefix="")
    for name in base.state_dict():
        if name in tied:
            continue
        module, _, leaf = name.rpartition(".")
        stem = PEFT_PREFIX + (module + "." if module else "")
        lora_a = f"{stem}lora_A.{ADAPTER_NAME}.weight"
        if f"{stem}base_layer.{leaf}" in source.shapes:
            weight = f"{stem}base_layer.{leaf}"
            if leaf == "weight" and lora_a in source.shapes:
                produce = _merge_producer(source, weight, lora_a, f"{stem}lora_B.{ADAPTER_NAME}.weight", adapter,
                                          fan_in_fan_out)  # fmt: skip
            else:
                produce = lambda k=weight: source.load(k)  # noqa: E731
        elif f"{stem}modules_to_save.{ADAPTER_NAME}.{leaf}" in source.shapes:  # the trained head
            weight = f"{stem}modules_to_save.{ADAPTER_NAME}.{leaf}"
            produce = lambda k=weight: source.load(k)  # noqa: E731
        else:
            weight = PEFT_PREFIX + name
            produce = lambda k=weight: source.load(k)  # noqa: E731
        targets.append(_Target(_spec(name, source, weight, export_dtype), produce))
    return targets


def _merge_producer(
    source: _Source, weight: str, lora_a: str, lora_b: str, adapter: dict[str, Any], fan_in_fan_out: bool
) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        base, a, b = source.load(weight), source.load(lora_a), source.load(lora_b)
        rank = a.shape[0]
        alpha = adapter.get("lora_alpha", 8)
        scaling = alpha / math.sqrt(rank) if adapter.get("use_rslora") else alpha / rank
        # PEFT's get_delta_weight: transpose(B @ A, fan_in_fan_out) * scaling, added to the base weight.
        delta = b @ a
        if fan_in_fan_out:
            delta = delta.T
        return base + delta * scaling

    return produce


# ----------------------------------------------------------------- around the weights
def _check_new_dir(target: Path, source: Path) -> None:
    from hftrain.checkpoint.run import check_outside_source, check_writable_dir

    check_own(target, "convert output", folder=True)
    for kind in ("staging", "previous"):  # what the convert writes and deletes beside it
        check_own(target.with_name(f".{kind}-{target.name}"), f"convert output: the {kind} folder", folder=True)
    check_outside_source(target, source, "convert output")
    check_writable_dir(target, "convert output")
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"convert output '{target}' is not empty; give a new folder (nothing is overwritten)")


def _save_tokenizer(name_or_path: str | None, stage: Path) -> bool:
    """Copy the tokenizer of ``name_or_path`` (a local folder or a cached model) into ``stage``; False if none."""
    if not name_or_path:
        return False
    from transformers import AutoTokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # No code from the folder a checkpoint's config names: on a terminal, transformers would otherwise stop
            # at its "run the custom code? [y/N]" prompt (issue 52).
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError):  # no tokenizer files there: the folder is still a model
        return False
    tokenizer.save_pretrained(stage)
    return True


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings off while candidate classes are built (``BertLMHeadModel`` asks for ``is_decoder``)."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)
