"""Export a trained model as a standard ``save_pretrained`` folder under any strategy, and prove it reloads.

The export is a collective call (pitfall "save on rank 0 only hangs", docs/pitfalls.md): every rank gathers, the main
process writes and checks.

- Stream (a full model, on a runtime with ``iter_full_state``): the runtime yields the full tensors one at a time
  (gathered over the ranks that hold them; the fp32 master values) and the main process writes each into
  ``model.safetensors`` as it arrives (``hftrain.checkpoint.stream``), so no rank holds more than its own shards and
  one full tensor; each is read back and compared before it is dropped.
- Gather (LoRA, and a runtime without ``iter_full_state``): ``accelerator.get_state_dict`` assembles the *full*
  state on the main process whatever the strategy (ZeRO-3 partitions with
  ``stage3_gather_16bit_weights_on_model_save``, FSDP1/FSDP2 shards) (pitfall "ZeRO-3 save_pretrained writes empty
  weights", docs/pitfalls.md).
- LoRA: PEFT filters the adapter out of that full state dict, so the adapter is complete even where each rank
  holds only a slice of it (pitfalls "LoRA adapter saved empty under ZeRO-3" and "FSDP2 + PEFT saves one rank's
  adapter slice", docs/pitfalls.md); ``merge_lora`` also writes ``<directory>_merged``, a plain
  model with the adapter merged in (beside the adapter folder, so each folder is one loadable model).
- Check: every gathered tensor must have the shape of a freshly built model's (pitfall "ZeRO-3 save_pretrained
  writes empty weights", docs/pitfalls.md); with
  ``verify_inputs`` the main process reloads what it wrote with plain transformers/peft, outside DeepSpeed's
  ``zero.Init``, and compares its logits with the trained model's.
- Publish: the folders are written and checked under staging names, and renamed into place only after
  ``before_publish`` (a collective the caller passes: the training job waits there for its last checkpoint, whose
  background write the export ran beside), so a run whose last checkpoint fails leaves the previous export.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hftrain.errors import HFTrainError, writing
from hftrain.files import check_own, fresh_folder, remove, remove_quietly

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

# Largest |logit difference| accepted between the trained and the reloaded model, relative to the largest logit
# when that exceeds 1. Under mixed precision the reload computes under the same autocast as the trained forward; it
# still need not round the same way (DeepSpeed keeps 16-bit weights and runs norms and softmax in 16 bits), so the
# bound is one of 16-bit rounding.
LOGIT_TOLERANCE = {"no": 1e-5, "bf16": 3e-2, "fp16": 4e-3}
# The same for weights saved in a 16-bit ``export_dtype`` (reloaded in fp32: what differs is their rounding only).
EXPORT_TOLERANCE = {"float32": 0.0, "bfloat16": 3e-2, "float16": 4e-3}
# Prefixes wrappers put on parameter names (FSDP1 units, activation checkpointing, torch.compile)
# (pitfall "PEFT + FSDP1 key prefixes", docs/pitfalls.md).
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class ExportResult:
    """What ``export_pretrained`` wrote and how well it reloaded (the same on every rank).

    Args:
        model_dir: the export folder (full model, or the LoRA adapter).
        merged_dir: the merged full model of a LoRA run, when ``merge_lora`` was set.
        is_adapter: whether ``model_dir`` holds a PEFT adapter rather than a full model.
        tensors: tensors in the gathered full state dict.
        logit_diffs: max |logit difference| per reloaded folder (``"model"``, ``"merged"``); empty unverified.
        streamed: whether the weights were written one tensor at a time (``runtime.iter_full_state``).
    """

    model_dir: str
    merged_dir: str | None = None
    is_adapter: bool = False
    tensors: int = 0
    logit_diffs: dict[str, float] = field(default_factory=dict)
    streamed: bool = False

    @property
    def max_logit_diff(self) -> float | None:
        """The largest difference over every reloaded folder; None when nothing was verified."""
        return max(self.logit_diffs.values()) if self.logit_diffs else None


def export_pretrained(
    accelerator: Any,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    directory: str | Path,
    *,
    merge_lora: bool = False,
    verify_inputs: dict[str, torch.Tensor] | None = None,
    last_checkpoint: str | Path | None = None,
    export_dtype: str = "float32",
    before_publish: Callable[[], Any] | None = None,
) -> ExportResult:
    """Write config, tokenizer and safetensors weights (or a LoRA adapter); every rank must call it.

    The folders are written and verified under a staging name and renamed into place only when complete, so
    ``directory`` never looks finished when it is not (a full disk leaves the previous export, or nothing).

    Args:
        accelerator: the run's runtime (``hftrain.strategies.runtime``): the Accelerator's facts and gathers, and
            the strategy's ``plain_model_context`` to reload the export in.
        model: the prepared (wrapped) model.
        tokenizer: saved beside the weights.
        directory: the export folder.
        merge_lora: for a LoRA model, also write the merged full model into ``<directory>_merged``.
        verify_inputs: a fixed batch (``input_ids``, ``attention_mask``...); when given, the written folders
            are reloaded and must give the trained model's logits, else ``HFTrainError``.
        last_checkpoint: named in the error when the disk is full (what the user still has).
        export_dtype: the saved dtype of floating-point weights (``float32``, ``bfloat16``, ``float16``).
        before_publish: called on every rank once the folders are written and verified, before they replace what
            ``directory`` holds; what it raises is raised, with the staged folders removed and ``directory`` as it
            was.
    """
    # After the last step no gradient is needed: a runtime that keeps a gradient buffer lends its memory to the
    # gathered tensors and the reload check (ZeRO-3's flat buffer; the others have freed theirs).
    with accelerator.gradients_released():
        return _export(
            accelerator, model, tokenizer, Path(directory), merge_lora=merge_lora, verify_inputs=verify_inputs,
            last_checkpoint=last_checkpoint, export_dtype=export_dtype, before_publish=before_publish,
        )  # fmt: skip


def _export(
    accelerator: Any,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    *,
    merge_lora: bool,
    verify_inputs: dict[str, torch.Tensor] | None,
    last_checkpoint: str | Path | None,
    export_dtype: str,
    before_publish: Callable[[], Any] | None,
) -> ExportResult:
    """:func:`export_pretrained`'s work (its arguments)."""
    accelerator.wait_for_everyone()
    # Collective: under ZeRO-3/FSDP every rank takes part in the forward and in the gather.
    expected = _trained_logits(accelerator, model, verify_inputs) if verify_inputs is not None else None
    options = {
        "verify_inputs": verify_inputs,
        "expected": expected,
        "mixed_precision": accelerator.mixed_precision,
        "export_dtype": export_dtype,
        "trained_on": torch.device(accelerator.device).type,  # the reload computes on the CPU
    }
    if _streams(accelerator, model):
        outcome, failure = _streamed_export(accelerator, model, tokenizer, directory, last_checkpoint, **options)
    else:
        state_dict = accelerator.get_state_dict(model)
        outcome, failure = _on_main(
            accelerator,
            directory,
            last_checkpoint,
            lambda: _staged_export(
                accelerator.unwrap_model(model),
                _strip_wrapper_prefixes(state_dict),
                tokenizer,
                directory,
                merge_lora=merge_lora,
                **options,
            ),
        )
    staged: list[tuple[Path, Path]] = []
    if accelerator.is_main_process and failure is None:
        outcome, staged = outcome
    outcome = _broadcast(accelerator, outcome)
    if failure is not None:
        raise failure
    if isinstance(outcome, str):
        raise HFTrainError(f"export to '{directory}' failed on the main process: {outcome}")
    try:
        if before_publish is not None:
            before_publish()
        published, failure = _on_main(accelerator, directory, last_checkpoint, lambda: _publish_all(staged))
        published = _broadcast(accelerator, published)
    finally:
        for stage, _ in staged:
            remove_quietly(stage)  # published: gone already; else not to be published
    if failure is not None:
        raise failure
    if isinstance(published, str):
        raise HFTrainError(f"export to '{directory}' failed on the main process: {published}")
    return outcome


def _publish_all(staged: list[tuple[Path, Path]]) -> None:
    for _, target in staged:  # every target checked before the first is replaced
        _check_publishable(target)
    for stage, target in staged:
        _publish(stage, target)


def _on_main(
    accelerator: Any, directory: Path, last_checkpoint: str | Path | None, work: Callable[[], Any]
) -> tuple[Any, Exception | None]:
    """Run ``work`` on the main process at the export's write boundary: ``(result, None)``, or ``(its one-line
    message, the error)`` so that the other ranks learn of it (they would wait for a result forever); other ranks
    get ``(None, None)``."""
    if not accelerator.is_main_process:
        return None, None
    try:
        with (
            accelerator.plain_model_context(),  # the strategy's: ZeRO-3 keeps transformers out of zero.Init
            writing(
                f"the export {directory}",
                location=directory,
                last_checkpoint=lambda: last_checkpoint,
                catch=(Exception,),  # torch/safetensors report a full disk as RuntimeError/SafetensorError
            ),
        ):
            return work(), None
    except Exception as error:
        return _one_line(error), error


# ----------------------------------------------------------------- the streamed export (full models)
def _streams(accelerator: Any, model: torch.nn.Module) -> bool:
    """Whether the export streams: a full model, on a runtime that yields its full tensors one at a time.

    A LoRA export keeps the gathered path: its adapter is small and PEFT picks its entries from a state dict.
    """
    from hftrain.models.lora import is_peft_model

    return hasattr(accelerator, "iter_full_state") and not is_peft_model(accelerator.unwrap_model(model))


def _streamed_export(
    accelerator: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    directory: Path,
    last_checkpoint: str | Path | None,
    *,
    verify_inputs: dict[str, torch.Tensor] | None,
    expected: torch.Tensor | None,
    mixed_precision: str,
    export_dtype: str,
    trained_on: str = "cpu",
) -> tuple[ExportResult | str | None, Exception | None]:
    """Write the full model from ``runtime.iter_full_state`` into ``model.safetensors``, one tensor at a time.

    Every rank consumes the iterator to its end (each tensor is a collective); the main process writes each tensor as
    it arrives (``hftrain.checkpoint.stream``: the headers come first, from the model's skeleton on the meta device),
    reads it back, and drops it, so no rank holds more than its own shards and one full tensor. A failure on the main
    process stops its writing, not the iteration, and is reported to every rank after it. Then config and tokenizer
    and the reload check, as the gathered export does; on the main process the result comes with the staged folder
    that ``export_pretrained`` renames into place.
    """
    from hftrain.checkpoint.stream import EXPORT_DTYPES, StreamedSafetensorsWriter, TensorSpec, saved_dtype

    unwrapped = accelerator.unwrap_model(model)
    stage = directory.with_name(f".staging-{directory.name}")
    plan: dict[str, Any] = {}

    def begin() -> None:
        with torch.device("meta"):  # the model's skeleton with clean parameter names, at no memory cost
            skeleton = _fresh_like(unwrapped)
        plan["tied"] = _tied_keys(skeleton)
        plan["specs"] = [
            TensorSpec(name, tuple(value.shape), saved_dtype(value.dtype, EXPORT_DTYPES[export_dtype]))
            for name, value in skeleton.state_dict().items()
            if name not in plan["tied"]
        ]
        fresh_folder(stage, "the export's staging folder")  # a killed export's is removed; a link is refused
        plan["writer"] = StreamedSafetensorsWriter(stage, plan["specs"])

    outcome, failure = _on_main(accelerator, directory, last_checkpoint, begin)
    for name, tensor in accelerator.iter_full_state(model):  # collective: every rank to the end
        if failure is None and accelerator.is_main_process:
            name = _strip_wrapper_prefixes({name: None}).popitem()[0]
            if name not in plan["tied"]:
                outcome, failure = _on_main(
                    accelerator, directory, last_checkpoint, lambda n=name, t=tensor: _write_one(plan, n, t, directory)
                )
        del tensor

    def finish() -> tuple[ExportResult, list[tuple[Path, Path]]]:
        try:
            _close_streamed(plan["writer"], directory)
            base = _base_of(unwrapped)
            from hftrain.models.remote_code import without_code

            config = without_code(copy.deepcopy(base.config))  # no auto_map: the export names no code to run
            config.architectures = [type(base).__name__]  # as save_pretrained records them, and the dtype
            config.dtype = EXPORT_DTYPES[export_dtype]
            config.save_pretrained(stage)
            if base.can_generate() and getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(stage)  # as save_pretrained writes it for a generating model
            tokenizer.save_pretrained(stage)
            diffs = {}
            if expected is not None:
                diffs["model"] = verify_export(
                    stage, verify_inputs, expected, mixed_precision=mixed_precision, export_dtype=export_dtype,
                    trained_on=trained_on, model_class=type(base),
                )  # fmt: skip
        except BaseException:
            remove_quietly(stage)
            raise
        result = ExportResult(model_dir=str(directory), tensors=len(plan["specs"]), logit_diffs=diffs, streamed=True)
        return result, [(stage, directory)]  # published by export_pretrained

    if failure is None:
        outcome, failure = _on_main(accelerator, directory, last_checkpoint, finish)
    elif accelerator.is_main_process:
        remove_quietly(stage)  # a link or a FIFO there (refused by begin) is left as it is
    return outcome, failure


def _write_one(plan: dict[str, Any], name: str, tensor: torch.Tensor | None, directory: Path) -> None:
    writer = plan["writer"]
    if name not in writer:  # a name the model does not have: another model than the skeleton
        raise HFTrainError(
            f"export to '{directory}': the runtime yields {name}, which a fresh model of this config does not have; "
            "nothing was written"
        )
    writer.write(name, tensor, verify=True)


def _close_streamed(writer: Any, directory: Path) -> None:
    try:
        writer.close()
    except ValueError as error:  # a tensor the model has never came: the runtime's gather is incomplete
        raise HFTrainError(
            f"export to '{directory}': {error}; the runtime's full state is incomplete, nothing was written"
        ) from None


def verify_export(
    directory: str | Path,
    inputs: dict[str, torch.Tensor],
    expected: torch.Tensor,
    *,
    base_model: torch.nn.Module | None = None,
    mixed_precision: str = "no",
    export_dtype: str = "float32",
    trained_on: str = "cpu",
    model_class: type | None = None,
) -> float:
    """Reload an export with plain transformers (or peft onto ``base_model``) and compare its logits.

    The reload computes in the trained model's precision (bf16/fp16 autocast), so that what is compared is the
    weights, not two roundings: in fp32, a 30-layer SmolLM2 trained under bf16 autocast differed from its own
    weights by 0.044 in logits.

    Returns the max |logit difference|; raises ``HFTrainError`` (one line) when it exceeds the precision's
    ``LOGIT_TOLERANCE``.

    Args:
        directory: a ``save_pretrained`` folder: a full model, or a PEFT adapter when ``base_model`` is given.
        inputs: the batch the expected logits were computed on.
        expected: the trained model's logits on ``inputs``.
        base_model: the frozen base weights the adapter applies to (it is modified); None for a full model.
        mixed_precision: the trained model's (``no``, ``bf16``, ``fp16``); its ``LOGIT_TOLERANCE`` is the largest
            accepted difference (times the largest expected logit when that exceeds 1).
        export_dtype: the dtype the weights were saved in; a 16-bit one is reloaded in fp32 and its
            ``EXPORT_TOLERANCE`` accepted on top (the weights' rounding).
        trained_on: the device type ``expected`` was computed on: the reload computes on the CPU, and fp32 kernels
            of another device sum in another order (TF32 rounds too, where torch lets fp32 matmuls use it), so
            ``cross_device_tolerance`` is accepted on top.
        model_class: the trained model's class, to reload a full model with (None: the class ``config.json``
            records, looked up in transformers). A model whose code came with its folder (``model.trust_remote_code``)
            is reloaded with the class already imported: the export names no code (no ``auto_map``) for a loader to
            import.
    """
    reloaded = _reload(Path(directory), base_model, upcast=export_dtype != "float32", model_class=model_class)
    logits = _logits(reloaded, inputs, mixed_precision)
    if logits.shape != expected.shape:
        raise HFTrainError(
            f"export '{directory}' gives logits of shape {tuple(logits.shape)}, the trained model "
            f"{tuple(expected.shape)}; the written model is not the trained one"
        )
    diff = (logits - expected.float()).abs().max().item()
    tolerance = LOGIT_TOLERANCE.get(mixed_precision, LOGIT_TOLERANCE["no"]) + EXPORT_TOLERANCE[export_dtype]
    tolerance += cross_device_tolerance(trained_on, mixed_precision)
    bound = tolerance * max(1.0, expected.abs().max().item())
    if not diff <= bound:  # also catches NaN
        raise HFTrainError(
            f"export '{directory}' does not reproduce the trained model: max logit difference {diff:.3g} > "
            f"{bound:.3g}; the written weights are incomplete or wrong, do not use this folder"
        )
    return diff


def verification_batch(
    dataset: Any, tokenizer: PreTrainedTokenizerBase, *, size: int = 4, pad_to_multiple_of: int | None = None
) -> dict[str, torch.Tensor]:
    """The first ``size`` examples of a tokenized dataset, padded into one batch (without labels; without an
    attention mask and with ``use_cache=False`` where the rows carry position ids: a causal LM's packed documents,
    masked from their positions as in training).

    Args:
        dataset: tokenized examples (``input_ids``...; ``labels`` and ``length`` columns are dropped).
        tokenizer: pads the batch.
        size: examples in the batch.
        pad_to_multiple_of: the sequence multiple the trained model needs (the runtime's, e.g. tp under
            sequence parallelism).
    """
    from transformers import DataCollatorWithPadding

    rows = dataset.select(range(min(size, len(dataset))))
    rows = rows.remove_columns([c for c in rows.column_names if c in ("labels", "label", "length", "num_tokens")])
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)
    batch = collate([rows[i] for i in range(len(rows))])
    if "position_ids" in rows.column_names:  # packed documents: masked from their positions, as in training
        batch.pop("attention_mask", None)
        batch["use_cache"] = False  # a cache, even an empty one, would turn transformers' packed masking off
    return batch


# ----------------------------------------------------------------- main process: check, write, reload
def _staged_export(
    unwrapped: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    tokenizer: Any,
    directory: Path,
    *,
    merge_lora: bool,
    **options: Any,
) -> tuple[ExportResult, list[tuple[Path, Path]]]:
    """``_write_and_verify`` into staging folders beside the targets; returns them with their targets, for
    ``export_pretrained`` to rename into place (removed here if anything fails)."""
    from hftrain.models.lora import is_peft_model

    merged = directory.with_name(directory.name + "_merged") if is_peft_model(unwrapped) and merge_lora else None
    targets = [t for t in (directory, merged) if t is not None]
    stages = [t.with_name(f".staging-{t.name}") for t in targets]
    made: list[Path] = []
    try:
        for stage in stages:  # a killed export's is removed; a link or a FIFO is refused, never written through
            made.append(fresh_folder(stage, "the export's staging folder"))
        result = _write_and_verify(
            unwrapped, state_dict, tokenizer, stages[0], merged_dir=stages[-1] if merged else None, **options
        )
    except BaseException:
        for stage in made:
            remove_quietly(stage)
        raise
    result = dataclasses.replace(result, model_dir=str(directory), merged_dir=str(merged) if merged else None)
    return result, list(zip(stages, targets, strict=True))


def _check_publishable(target: Path) -> None:
    """Refuse, before anything is renamed, a ``target`` (or its ``.previous-`` twin) that is a link or a special
    file: publishing deletes it."""
    check_own(target, "the export folder", folder=True)
    check_own(target.with_name(f".previous-{target.name}"), "the export's previous folder", folder=True)


def _publish(stage: Path, target: Path) -> None:
    """Rename a finished staging folder to ``target``; a previous export there is replaced only now.

    ``target`` and its ``.previous-`` twin are checked first (``files.check_own``): a link or a FIFO there is refused
    in one line with nothing renamed, never deleted through or waited on.
    """
    _check_publishable(target)
    if not os.path.lexists(target):
        os.replace(stage, target)
        return
    previous = target.with_name(f".previous-{target.name}")
    remove(previous, "the export's previous folder")
    os.replace(target, previous)
    os.replace(stage, target)
    remove(previous, "the export's previous folder")


def _write_and_verify(
    unwrapped: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    *,
    merged_dir: Path | None,
    verify_inputs: dict[str, torch.Tensor] | None,
    expected: torch.Tensor | None,
    mixed_precision: str,
    export_dtype: str = "float32",
    trained_on: str = "cpu",
) -> ExportResult:
    from hftrain.checkpoint.stream import EXPORT_DTYPES, saved_dtype
    from hftrain.models.lora import is_peft_model

    is_adapter = is_peft_model(unwrapped)
    dtype = EXPORT_DTYPES[export_dtype]
    # What is written, in the saved dtype (a copy only when it differs); a merge is computed from the fp32 values.
    written = {k: v.to(saved_dtype(v.dtype, dtype)) for k, v in state_dict.items()}
    with torch.device("meta"):  # the model's skeleton with clean parameter names, at no memory cost
        skeleton = _fresh_like(unwrapped)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items()}
    _check_complete(state_dict, shapes, _tied_keys(skeleton), directory)
    # PEFT picks the adapter's entries by walking the model's LoRA layers; under FSDP1 the trained model's layer
    # names carry wrapper prefixes and PEFT silently drops every LoRA weight (pitfall "PEFT + FSDP1 key prefixes",
    # docs/pitfalls.md), so the skeleton
    # filters the full state dict instead. A copy, as save_pretrained pops entries from the dict it is given.
    writer = skeleton if is_adapter else unwrapped
    writer.save_pretrained(directory, state_dict=dict(written), safe_serialization=True)
    if not is_adapter:  # save_pretrained records the model's dtype, not the dict's, and a trusted model's auto_map
        _clean_config(directory / "config.json", export_dtype)
    tokenizer.save_pretrained(directory)
    if is_adapter:
        _check_adapter_written(directory, skeleton, written)
    trained = _rebuild_on_cpu(unwrapped, state_dict) if is_adapter and (merged_dir or expected is not None) else None
    if merged_dir is not None:
        copy.deepcopy(trained).merge_and_unload().to(dtype).save_pretrained(merged_dir, safe_serialization=True)
        _clean_config(merged_dir / "config.json", export_dtype)
        tokenizer.save_pretrained(merged_dir)
    diffs: dict[str, float] = {}
    if expected is not None:
        base = trained.unload() if trained is not None else None
        precision = {"mixed_precision": mixed_precision, "export_dtype": export_dtype, "trained_on": trained_on}
        precision["model_class"] = type(_base_of(unwrapped))
        diffs["model"] = verify_export(directory, verify_inputs, expected, base_model=base, **precision)
        if merged_dir is not None:
            diffs["merged"] = verify_export(merged_dir, verify_inputs, expected, **precision)
    return ExportResult(
        model_dir=str(directory),
        merged_dir=str(merged_dir) if merged_dir else None,
        is_adapter=is_adapter,
        tensors=len(state_dict),
        logit_diffs=diffs,
    )


def _clean_config(config_file: Path, export_dtype: str) -> None:
    """The written ``config.json`` as an export records it: the saved dtype, and no code to run (``auto_map``,
    ``trust_remote_code``: a model trusted for training is not trusted again by whoever loads the export)."""
    import json

    from hftrain.files import write_file
    from hftrain.models.remote_code import CODE_KEYS

    config = json.loads(config_file.read_text())
    for key in CODE_KEYS:
        config.pop(key, None)
    if export_dtype != "float32":
        config["dtype"] = export_dtype
    write_file(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_complete(
    state_dict: dict[str, torch.Tensor], shapes: dict[str, torch.Size], tied: set[str], directory: Path
) -> None:
    """Every tensor of a freshly built model is there (a tied copy may be gathered once), with its full shape
    (not a rank's empty partition)."""
    missing = sorted(set(shapes) - set(state_dict) - tied)
    wrong = [k for k in shapes if k in state_dict and tuple(state_dict[k].shape) != tuple(shapes[k])]
    extra = sorted(set(state_dict) - set(shapes))
    if missing or wrong or extra:
        what = (
            f"{len(missing)} missing (e.g. {missing[0]})" if missing
            else f"{len(wrong)} of the wrong shape (e.g. {wrong[0]}: {tuple(state_dict[wrong[0]].shape)}, "
                 f"expected {tuple(shapes[wrong[0]])})" if wrong
            else f"{len(extra)} unexpected (e.g. {extra[0]})"
        )  # fmt: skip
        raise HFTrainError(
            f"export to '{directory}': the gathered state dict has {what} tensors; the gather is incomplete "
            "(for ZeRO-3 set stage3_gather_16bit_weights_on_model_save: true), nothing was written"
        )


def _check_adapter_written(directory: Path, skeleton: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """The adapter file holds one tensor per trained parameter (LoRA and head), equal to the gathered one.

    Exact in any precision, unlike the logits: it catches PEFT dropping entries it did not recognise (#2-#5).
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    trained = [name for name, param in skeleton.named_parameters() if param.requires_grad]
    expected = get_peft_model_state_dict(skeleton, state_dict=state_dict)
    written = load_file(directory / "adapter_model.safetensors")
    wrong = [k for k in expected if k not in written or not torch.equal(written[k], expected[k])]
    if len(written) != len(trained) or wrong:
        raise HFTrainError(
            f"export to '{directory}': the adapter holds {len(written)} tensors for {len(trained)} trained "
            f"parameters{f' and differs from the trained model in {wrong[0]}' if wrong else ''}; do not use this folder"
        )


def _tied_keys(skeleton: torch.nn.Module) -> set[str]:
    """State-dict names the model declares tied to another tensor (save_pretrained writes one of each, #22)."""
    base = _base_of(skeleton)
    prefix = "base_model.model." if base is not skeleton else ""
    return {prefix + key for key in getattr(base, "all_tied_weights_keys", None) or {}}


def _rebuild_on_cpu(unwrapped: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of the trained model from the gathered state dict (ZeRO-3/FSDP parameters are not whole)."""
    fresh = _fresh_like(unwrapped)
    # Not strict: tied copies may be absent; _check_complete has already vouched for every other key.
    fresh.load_state_dict(state_dict, strict=False)
    return fresh.eval()


def _fresh_like(unwrapped: torch.nn.Module) -> torch.nn.Module:
    """A newly built model of the same class and config (and the same LoRA adapters), randomly initialised."""
    base = _base_of(unwrapped)
    fresh = type(base)(copy.deepcopy(base.config))
    if unwrapped is not base:
        from peft import get_peft_model

        return get_peft_model(fresh, copy.deepcopy(unwrapped.peft_config["default"]))
    return fresh


def _base_of(model: torch.nn.Module) -> torch.nn.Module:
    from hftrain.models.lora import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model


def _reload(
    directory: Path, base_model: torch.nn.Module | None, *, upcast: bool = False, model_class: type | None = None
) -> torch.nn.Module:
    if base_model is None:
        import transformers

        if model_class is None:  # the class save_pretrained recorded (a *ForSequenceClassification for hftrain's runs)
            config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
            architectures = config.architectures or []
            model_class = getattr(transformers, architectures[0], None) if architectures else None
            model_class = model_class or transformers.AutoModelForSequenceClassification
        dtype = {"dtype": torch.float32} if upcast else {}  # else transformers' "auto": the saved dtype
        model, info = model_class.from_pretrained(directory, output_loading_info=True, trust_remote_code=False, **dtype)
        problems = {k: v for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if (v := info.get(k))}
        if problems:  # a missing tensor would be silently initialised at random
            kind, keys = next(iter(problems.items()))
            raise HFTrainError(
                f"export '{directory}' does not load strictly: {len(keys)} {kind.replace('_', ' ')} "
                f"(e.g. {sorted(keys, key=str)[0]}); do not use this folder"
            )
        return model.eval()
    from peft import PeftModel

    # PEFT reads only adapter_config.json and the adapter's tensors onto the base model given: it imports no code from
    # the folder and takes no trust_remote_code (the base model was built by hftrain, with the user's trust).
    return PeftModel.from_pretrained(base_model, directory).eval()


@torch.no_grad()
def cross_device_tolerance(trained_on: str, mixed_precision: str) -> float:
    """What a reload on the CPU may differ by from logits computed on ``trained_on``, beyond the precision's own
    tolerance: nothing on the CPU; in fp32 on a GPU ``1e-4`` (another summation order), ``2e-3`` where torch lets fp32
    matmuls run in TF32 (10 mantissa bits); under bf16/fp16 autocast the precision's tolerance covers it."""
    if trained_on == "cpu" or mixed_precision in ("bf16", "fp16"):
        return 0.0
    return 2e-3 if torch.backends.cuda.matmul.allow_tf32 else 1e-4


def _logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor], mixed_precision: str = "no") -> torch.Tensor:
    device = next(model.parameters()).device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        return model(**{k: _to(v, device) for k, v in inputs.items()}).logits.float().cpu()


def _to(value: Any, device: Any) -> Any:
    """A batch value on ``device`` (tensors; flags such as ``use_cache`` as they are)."""
    return value.to(device) if torch.is_tensor(value) else value


# ----------------------------------------------------------------- all ranks
@torch.no_grad()
def _trained_logits(accelerator: Accelerator, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The prepared model's logits on ``inputs`` in eval mode (a collective forward under ZeRO-3/FSDP); a language
    model split over cp ranks returns its positions' logits, gathered here into the whole sequences (collective)."""
    from hftrain.parallel.layers import whole_logits

    was_training = model.training
    model.eval()
    try:
        # the runtime's context: under ZeRO-3 it releases what the forward prefetched; a language model's
        # vocabulary-parallel head gathers its logits (tensor parallelism)
        with accelerator.evaluation_context(), whole_logits(model):
            output = model(**{k: _to(v, accelerator.device) for k, v in inputs.items() if k != "labels"})
        logits = output.logits
        split = getattr(model, "context_split", None) or getattr(accelerator.unwrap_model(model), "context_split", None)
        if split is not None and logits.dim() == 3 and logits.shape[1] != inputs["input_ids"].shape[1]:
            logits = split.gather(logits)  # per-token logits of this rank's positions → the whole sequences
    finally:
        model.train(was_training)
    return logits.float().cpu()


def _strip_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def clean(key: str) -> str:
        for prefix in _WRAPPER_PREFIXES:
            key = key.replace(prefix, "")
        return key

    return {clean(k): v for k, v in state_dict.items()}


def _broadcast(accelerator: Accelerator, value: Any) -> Any:
    from accelerate.utils import broadcast_object_list

    if accelerator.num_processes == 1:
        return value
    return broadcast_object_list([value], from_process=0)[0]


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
