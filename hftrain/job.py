"""The fine-tuning job behind ``hftrain train``: config in, trained and exported model out.

Every check that can fail on bad input runs before anything is written to ``output_dir``: the strategy's
preflight, ``hftrain.validate`` (output_dir, resume request), the model folder, the data, and the trainer's
resume checks. The config is written last, once the run is certain to start, under the folder's lock
(:func:`take_run_folder`), which the main process then holds until the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hftrain.config import ModelConfig, TrainConfig, config_from_flat, save_config
from hftrain.errors import ConfigError, HFTrainError, ProcessError, writing
from hftrain.log import get_logger, is_main_process
from hftrain.tasks import Inputs, task_of

if TYPE_CHECKING:
    from hftrain.files import FolderLock
    from hftrain.models.checks import ModelFacts
    from hftrain.strategies import LaunchInfo
    from hftrain.validate import RunPlan


@dataclass
class JobResult:
    """The headline numbers of a finished job."""

    metrics: dict[str, float]
    seconds: float
    model_dir: str | None
    global_step: int
    log_history: list[dict[str, float]]
    preempted: str | None = None
    checkpoint: str | None = None
    mixed_precision: str = "no"
    """The precision the run trained and evaluated in (``auto`` resolved): predict in it to reproduce ``metrics``."""
    throughput: dict[str, Any] = field(default_factory=dict)
    """Tokens/s, samples/s, FLOPs and MFU of the training steps (``output_dir/run_summary.json``)."""


def prepare_job(
    config: TrainConfig, launch: LaunchInfo, *, write: bool = True, opened: Any = None
) -> tuple[Any, Any, Any]:
    """Validate everything, then build the trainer: ``(trainer, tokenizer, tokenized splits)``.

    Args:
        config: the validated job config.
        launch: what the launcher set up (world size, accelerate strategy).
        write: create ``output_dir`` and save the config (a training run); an export writes nothing there.
        opened: the checkpoint ``training.resume_from_checkpoint`` names, opened already (an export's;
            ``hftrain.checkpoint.manager.VerifiedCheckpoint``): its ``checkpoint.json`` is not read again.
    """
    from hftrain.models import build_tokenizer, model_init_fn
    from hftrain.models.checks import check_tokenizer, effective_max_length
    from hftrain.strategies import build_strategy
    from hftrain.validate import validate_job

    log = get_logger()
    note = log.info if is_main_process() else (lambda _: None)
    quiet_libraries()
    strategy = build_strategy(config.strategy, launch=launch, parallelism=config.parallelism)
    model_facts, plan = validate_job(config, strategy, write=write, opened=opened)
    for line in plan.notes:
        note(line)
    # The process group before the data: the first process of each node prepares it while the others wait.
    strategy.start_processes(strategy.resolve_training(config.training)[0])
    tokenizer = build_tokenizer(config.model)
    check_tokenizer(tokenizer, model_facts)
    if config.data.streaming:
        tokenized, head = streaming_inputs(config, model_facts, tokenizer, note), {}
    else:
        max_length = effective_max_length(config.data.max_seq_length, model_facts, tokenizer, note)
        tokenized, head = prepare_data(config, model_facts, tokenizer, max_length, note)
    trainer = task_of(config.model.task).trainer_class()(
        dataclasses.replace(config.training, resume_from_checkpoint=plan.resume),
        run_id=plan.run_id,
        strategy=strategy,
        model_init=model_init_fn(config.model, tokenizer, config.lora, head),
        tokenizer=tokenizer,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        run_config=config.flat(),
        pad_to_multiple_of=config.data.pad_to_multiple_of,
        checkpoint=plan.checkpoint,
    )
    if write and launch.world_size > launch.local_world_size:
        from hftrain.launch.storage import check_shared_output_dir

        # Several machines: a checkpoint is only resumable when all their ranks write into one folder.
        check_shared_output_dir(
            trainer.accelerator.process_index, trainer.accelerator.num_processes, config.training.output_dir
        )
    # The trainer accepted the resume checkpoint: the run is certain to start, and may now write.
    if write:
        trainer.folder_lock = take_run_folder(config, plan, trainer.runtime)
    return trainer, tokenizer, tokenized


def take_run_folder(config: TrainConfig, plan: RunPlan, runtime: Any) -> FolderLock | None:
    """Take ``output_dir``'s lock for the run's life, then write the run config under it (collective).

    The main process takes the lock (a second command is refused in one line naming the holder), checks that the
    folder is as the plan found it, removes a replaced run's outputs and writes the config; the other ranks learn
    the outcome from it and check that it holds the lock for this run. Returns the lock on the main process (the
    trainer releases it in ``close``), None elsewhere.

    Args:
        config: the job config, accepted by every check.
        plan: the run it starts or continues.
        runtime: the trainer's runtime (its ranks agree through it).
    """
    from hftrain.checkpoint.run import run_folder_lock

    lock = run_folder_lock(Path(config.training.output_dir), run_id=plan.run_id)
    return hold_folder(lock, runtime, lambda: write_run_config(config, plan))


def hold_folder(lock: FolderLock, runtime: Any, work: Callable[[], Any]) -> FolderLock | None:
    """Take ``lock`` on the main process and run ``work`` under it; the other ranks check that the main process
    holds it (collective). A failure on any rank is raised on every rank, with the lock released.

    Args:
        lock: the folder's lock.
        runtime: the ranks' runtime (None or one process: no agreement).
        work: what the main process does first under the lock (re-checks, the first write).
    """
    from hftrain.parallel.host import broadcast_object

    main = runtime is None or runtime.is_main_process
    several = runtime is not None and runtime.num_processes > 1
    failure: HFTrainError | None = None
    if main:
        try:
            lock.acquire()
            work()
        except BaseException as error:
            lock.release()
            if not isinstance(error, HFTrainError) or not several:
                raise
            failure = error
    if not several:
        return lock
    # the main process's outcome, and who it is: the lock must record that holder (host and pid), not another
    message, holder = broadcast_object((None, lock.holder) if failure is None else (str(failure), None))
    if message is not None:  # said by the main process; the others exit with it
        raise failure or HFTrainError(message)
    mine: HFTrainError | None = None
    if not main:
        try:
            lock.check_held_by(host=holder["host"], pid=holder["pid"])
        except HFTrainError as error:
            mine = ProcessError(str(error))  # this rank's view of the folder: printed by the rank that met it
    if runtime.any_rank(mine is not None):
        lock.release()
        raise mine or HFTrainError(f"another process does not see the lock '{lock.path}' this one took; see its error")
    return lock if main else None


def prepare_data(
    config: TrainConfig, facts: ModelFacts, tokenizer: Any, max_length: int, log: Callable[[str], None]
) -> tuple[Any, dict[str, Any]]:
    """The run's model inputs (``train`` and ``validation``, tokenized or packed, memory-mapped) and the model-config
    fields the data decides (``Task.prepare``'s ``head``: the problem type, label names), through the data cache
    (``hftrain.data.cache``; collective when a process group is up).

    The first process of each node reads, tokenizes and packs the data once (in ``data.preprocessing_num_workers``
    processes) into a cache entry keyed by the data files' content, the tokenizer and every rule below, or opens the
    entry a run, a resume or an export built before; the other ranks wait on the host group, then open it.

    Args:
        config: the validated job config.
        facts: what the model-folder check read (its ``max_length`` bounds continued positions).
        tokenizer: the model's tokenizer.
        max_length: ``data.max_seq_length`` as far as the model takes it.
        log: receives one-line progress messages (the build's, again when the entry was there).
    """
    from accelerate.state import PartialState

    from hftrain.data.cache import DataCache, cache_root, prepared_per_node

    task = task_of(config.model.task)
    default = ModelConfig()

    def build(work_dir: Path, log: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
        splits = load_splits(config, facts, log, work_dir=work_dir)
        inputs = Inputs(
            max_length,
            long_documents=config.data.long_documents,
            max_position=facts.max_length,
            work_dir=work_dir,
            num_proc=tokenizing_processes(config),
            num_labels=config.model.num_labels if config.model.num_labels != default.num_labels else None,
        )
        tokenized, head = task.inputs(splits, tokenizer, inputs, log)
        # the problem type under its own key too: what hftrain read from an entry before the task records
        return tokenized, {"head": head, "problem_type": head.get("problem_type")}

    cache = DataCache(cache_root(config.data.cache_dir), overwrite=config.data.overwrite_cache)
    entry = prepared_per_node(
        cache,
        inputs=lambda: cache_inputs(config, facts, tokenizer, max_length),
        build=build,
        log=log,
        local_rank=PartialState().local_process_index if PartialState._shared_state else 0,
    )
    facts = entry.facts
    if "head" not in facts:  # an entry built before the task records: it kept the problem type alone
        return entry.splits, {"problem_type": facts["problem_type"]} if facts.get("problem_type") else {}
    return entry.splits, facts["head"]


def cache_inputs(config: TrainConfig, facts: ModelFacts, tokenizer: Any, max_length: int) -> dict[str, Any]:
    """Everything the model inputs depend on, for the data cache's key: the sources (each file's SHA-256; an embedded
    dataset's package version), the tokenizer's digest and version, and every rule (the ``data`` section but where
    the cache lives and how many processes tokenize, the task, labels, seed, block length and position bound).

    Args:
        config: the validated job config.
        facts: what the model-folder check read.
        tokenizer: the model's tokenizer.
        max_length: ``data.max_seq_length`` as far as the model takes it.
    """
    import importlib.metadata

    from hftrain.data.cache import file_digest, tokenizer_digest
    from hftrain.data.embedded import embedded_version

    data = config.data
    sources: list[dict[str, Any]] = []
    for field_name, path in (("data.train_file", data.train_file), ("data.validation_file", data.validation_file)):
        if path is not None:  # a file that cannot be read keys nothing: its loader refuses it in one line
            readable = Path(path).is_file()
            sources.append({"field": field_name, "path": str(path), "sha256": file_digest(path) if readable else None})
    if data.dataset_name is not None:
        sources.append({"dataset_name": data.dataset_name, "version": embedded_version(data.dataset_name)})
    unkeyed = {"cache_dir", "overwrite_cache", "preprocessing_num_workers"}
    task = task_of(config.model.task)
    return {
        "task": config.model.task,
        "sources": sources,
        "tokenizer": tokenizer_digest(tokenizer),
        "tokenizers": importlib.metadata.version("tokenizers"),
        "data": {key: value for key, value in dataclasses.asdict(data).items() if key not in unkeyed},
        "seed": config.training.seed,
        "max_length": max_length,
        "max_position": facts.max_length,
        "num_labels": config.model.num_labels if task.takes_labels else None,
        "problem_type": requested_problem_type(config.model, facts) if task.takes_problem_type else None,
    }


LARGE_CORPUS = 10 << 20
"""Bytes of data files from which tokenizing takes every core (``data.preprocessing_num_workers: null``)."""


def tokenizing_processes(config: TrainConfig) -> int:
    """``data.preprocessing_num_workers``, or (null) one process per core of this process for a corpus above
    :data:`LARGE_CORPUS` (the node's other ranks wait meanwhile), one for a smaller one (starting processes would
    cost more than they save).

    Args:
        config: the validated job config.
    """
    import os

    if config.data.preprocessing_num_workers is not None:
        return config.data.preprocessing_num_workers
    files = [Path(path) for path in (config.data.train_file, config.data.validation_file) if path is not None]
    size = sum(file.stat().st_size for file in files if file.is_file())
    return max(1, len(os.sched_getaffinity(0))) if size > LARGE_CORPUS else 1


def load_splits(
    config: TrainConfig, facts: ModelFacts, log: Callable[[str], None], *, work_dir: Path | None = None
) -> Any:
    """The run's ``train`` and ``validation`` splits before tokenization: labelled texts (classification: ``text``,
    ``label``), or texts / prompt-response pairs (``causal_lm``).

    Args:
        config: the validated job config.
        facts: what the model-folder check read.
        log: receives one-line progress messages.
        work_dir: where the reading's Arrow files go (a cache build's scratch folder); None: ``datasets``' own cache.
    """
    data = config.data
    sources = {
        "dataset_name": data.dataset_name,
        "train_file": data.train_file,
        "validation_file": data.validation_file,
        "text_column": data.text_column,
        "validation_split_percentage": data.validation_split_percentage,
        "max_train_samples": data.max_train_samples,
        "max_eval_samples": data.max_eval_samples,
        "seed": config.training.seed,
        "log": log,
        "work_dir": work_dir,
    }
    return task_of(config.model.task).read(config, facts, sources)


def streaming_inputs(config: TrainConfig, facts: ModelFacts, tokenizer: Any, log: Callable[[str], None]) -> dict:
    """``data.streaming``: ``{"train": the training stream, "validation": its fixed packed blocks}``
    (``hftrain.data.streaming``); the trainer deals the stream over its data-parallel ranks.

    Args:
        config: the validated job config (``model.task: causal_lm``).
        facts: what the model-folder check read (its position limit bounds continued documents).
        tokenizer: the model's tokenizer.
        log: receives one-line notes.
    """
    from hftrain.data.packing import BlockRules
    from hftrain.data.streaming import stream_train_split
    from hftrain.models.checks import effective_max_length

    block = effective_max_length(config.data.max_seq_length, facts, tokenizer, log)
    rules = BlockRules.of(tokenizer, block, long_documents=config.data.long_documents, max_position=facts.max_length)
    return stream_train_split(config.data, tokenizer, rules, log=log)


def classification_splits(config: TrainConfig, facts: ModelFacts, sources: dict[str, Any]) -> Any:
    from hftrain.data.loading import load_classification_splits

    return load_classification_splits(
        **sources,
        label_column=config.data.label_column,
        num_labels=config.model.num_labels,
        problem_type=requested_problem_type(config.model, facts),
    )


def language_splits(config: TrainConfig, facts: ModelFacts, sources: dict[str, Any]) -> Any:
    from hftrain.data.language import load_text_splits

    data = config.data
    return load_text_splits(**sources, prompt_column=data.prompt_column, response_column=data.response_column)


def classification_inputs(splits: Any, tokenizer: Any, inputs: Inputs, log: Callable[[str], None]) -> tuple:
    from hftrain.data.batching import tokenize_splits
    from hftrain.data.labels import problem_type_of

    tokenized = tokenize_splits(splits, tokenizer, max_seq_length=inputs.max_length)
    problem_type = problem_type_of(splits["train"].features)
    return tokenized, {} if problem_type is None else {"problem_type": problem_type}


def language_inputs(splits: Any, tokenizer: Any, inputs: Inputs, log: Callable[[str], None]) -> tuple:
    from hftrain.data.language import pack_splits

    packed = pack_splits(
        splits,
        tokenizer,
        block_size=inputs.max_length,
        log=log,
        long_documents=inputs.long_documents,
        max_position=inputs.max_position,
        work_dir=inputs.work_dir,
        num_proc=inputs.num_proc,
    )
    return packed, {}


def requested_problem_type(model: ModelConfig, facts: ModelFacts) -> str | None:
    """The task asked for before the data is read: ``model.problem_type``, else the folder's ``config.json``'s
    (checked against ``num_labels``), else None (the data decides; ``hftrain.data.labels``).

    Args:
        model: the ``model`` config section.
        facts: what the model-folder check read (its ``config.json``'s ``problem_type``).
    """
    from hftrain.data.labels import check_problem_type

    if model.problem_type != "auto":
        return model.problem_type
    if facts.problem_type is not None:
        check_problem_type(facts.problem_type, model.num_labels, f"'{facts.path / 'config.json'}'")
    return facts.problem_type


def write_run_config(config: TrainConfig, plan: RunPlan) -> None:
    """Create ``output_dir``, remove a replaced run's outputs, and write the resolved config (atomically); under the
    folder's lock, once the folder is found as the plan found it.

    Args:
        config: the job config, accepted by every check.
        plan: the run it starts or continues.
    """
    from hftrain.checkpoint.run import folder_state, remove_run_outputs

    output_dir = Path(config.training.output_dir)
    if plan.folder_state and folder_state(output_dir) != plan.folder_state:
        # Another command wrote into the folder after this one decided what to do with it (a run started at the
        # same moment, which took the lock first and has ended): decided on what is no longer there.
        raise ConfigError(
            f"training.output_dir '{output_dir}' changed while this command was starting (another hftrain command "
            "wrote into it); run the command again, which decides anew what to do with the folder"
        )
    with writing(f"the run config into training.output_dir '{output_dir}'", location=output_dir):
        if plan.replaces:
            removed = remove_run_outputs(output_dir)
            get_logger().info(f"overwrite_output_dir: removed the earlier run's {', '.join(removed)}")
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, output_dir, run_id=plan.run_id)


def run_training(config: TrainConfig, launch: LaunchInfo, *, process_exits_after: bool = False) -> JobResult:
    """Load data and model, train with the configured strategy, export, and report.

    Args:
        config: the validated job config.
        launch: what the launcher set up (world size, accelerate strategy).
        process_exits_after: the calling process ends when this returns (the CLI, a launched rank): what the job
            froze for the garbage collector stays frozen (see ``collections_paused_while_setting_up``).
    """
    from hftrain import pictures

    start = time.perf_counter()
    if is_main_process():  # the drawing process imports matplotlib beside this process's imports, on an idle core
        pictures.prestart()
    with (
        contextlib.ExitStack() as ending,
        collections_paused_while_setting_up(thaw=not process_exits_after) as collector,
    ):
        ending.callback(pictures.discard_spare)  # not taken: the job failed before its first drawing
        trainer, tokenizer, tokenized = prepare_job(config, launch)
        ending.callback(trainer.release_folder)  # a failed run frees its folder too (close() does it otherwise)
        collector.set_up()
        output_dir = Path(config.training.output_dir)
        # A full or read-only disk during training (trackers, state files) is one line naming what survived.
        with writing(
            f"the run in training.output_dir '{output_dir}'",
            location=output_dir,
            last_checkpoint=trainer.checkpoints.latest,
        ):
            # The export is written and verified beside the last checkpoint's background write, and replaces
            # output_dir/model only once that checkpoint is complete; a preempted run exports when it finishes,
            # after it is resumed (fit does not call it then).
            exported: list[Path] = []
            result = trainer.fit(
                beside_last_save=lambda: exported.append(
                    export_model(
                        trainer,
                        tokenizer,
                        tokenized,
                        output_dir / "model",
                        config,
                        before_publish=trainer.wait_for_checkpoint,
                    )
                )
            )
        model_dir = exported[0] if exported else None
        _close(trainer, collector, launch)
    return JobResult(
        metrics=result.metrics,
        seconds=time.perf_counter() - start,
        model_dir=str(model_dir) if model_dir else None,
        global_step=result.global_step,
        log_history=trainer.state.log_history,
        preempted=result.preempted,
        checkpoint=result.checkpoint,
        mixed_precision=trainer.args.mixed_precision,
        throughput=result.throughput,
    )


def run_export(
    checkpoint: str,
    directory: str,
    launch: LaunchInfo,
    *,
    merge_lora: bool,
    trust: bool,
    output_dir: str | None = None,
) -> str:
    """Export a checkpoint as a verified ``save_pretrained`` folder (launched like the run that wrote it).

    Trust comes from the command, never from the checkpoint: a checkpoint is the user's own when it lies in the
    run folder the user names (``output_dir``, or ``checkpoint`` given as a run folder); any other needs ``trust``.
    (Whatever the trust, its state files are only loaded by restricted unpicklers: ``checkpoint.safety``.)

    Args:
        checkpoint: a ``step_<N>`` folder, or a run's ``output_dir`` (its latest checkpoint).
        directory: the export folder; must not exist yet or be empty.
        launch: what the launcher set up; the checkpoint's process count is needed.
        merge_lora: also write the adapter merged into a full model.
        trust: allow a checkpoint outside the run folder the command names.
        output_dir: the run folder the checkpoint belongs to, as the user gives it.
    """
    from hftrain.checkpoint.manager import CheckpointError, open_checkpoint
    from hftrain.checkpoint.run import CHECKPOINTS_DIR, latest_of_run
    from hftrain.files import FolderLock
    from hftrain.validate import check_export_dir

    target = Path(directory)
    path = Path(checkpoint)
    check_export_dir(target, source=path, merged=merge_lora)
    if (path / CHECKPOINTS_DIR).is_dir():  # a run folder: its latest checkpoint, trusted as the user named the run
        output_dir = str(path)
        opened = latest_of_run(path, "export")
        path = opened.path
    else:
        opened = open_checkpoint(path, verify_files=False)  # checksums: verified once, when the trainer loads it
    meta = opened.meta
    saved = meta["topology"]
    if saved["world_size"] != launch.world_size:
        raise CheckpointError(
            f"checkpoint '{path}' was written by {saved['world_size']} processes and this export runs on "
            f"{launch.world_size}; launch it on {saved['world_size']} processes, like the run (torchrun "
            f"--nproc_per_node {saved['world_size']} -m hftrain export ...)"
        )
    config = config_from_flat(meta["config"], source=f"{path}/checkpoint.json")
    if merge_lora and not config.lora.use_lora:
        raise ConfigError(
            f"--merge_lora: checkpoint '{path}' is of a full fine-tune (lora.use_lora: false), there is no adapter "
            "to merge; drop --merge_lora"
        )
    config.strategy.name = meta["topology"]["strategy"]
    config.training.resume_from_checkpoint = str(path)
    config.training.trust_external_checkpoint = trust
    config.training.log_with = "none"
    # Only a folder the user named makes the checkpoint the user's own; without one, nothing is inside the run.
    config.training.output_dir = output_dir if output_dir is not None else str(target)
    with collections_paused_while_setting_up() as collector, contextlib.ExitStack() as ending:
        trainer, tokenizer, tokenized = prepare_job(config.validate(), launch, write=False, opened=opened)
        collector.set_up()
        # The export folder is this command's until it ends: a second export into it is refused naming this one,
        # and one that ran meanwhile and published is found under the lock (the folder is no longer empty).
        lock = FolderLock.for_folder(target, "export directory", command="export")
        recheck = lambda: check_export_dir(target, source=path, merged=merge_lora, locked=True)  # noqa: E731
        held = hold_folder(lock, trainer.runtime, recheck)
        ending.callback(held.release if held is not None else lambda: None)
        model_dir = export_model(trainer, tokenizer, tokenized, target, config, merge_lora=merge_lora)
        _close(trainer, collector, launch)
    return str(model_dir)


def export_model(
    trainer: Any,
    tokenizer: Any,
    tokenized: Any,
    directory: Path,
    config: TrainConfig,
    *,
    merge_lora: bool | None = None,
    before_publish: Callable[[], Any] | None = None,
) -> Path:
    """Export and reload-verify the trained model (collective: every rank calls it); ``before_publish`` runs on every
    rank before the export replaces what ``directory`` holds (``export_pretrained``)."""
    from hftrain.checkpoint.export import export_pretrained, verification_batch

    # The saved folder is reloaded and must reproduce the trained model's logits on a few validation texts.
    export = export_pretrained(
        trainer.runtime,
        trainer.model,
        tokenizer,
        directory,
        merge_lora=config.lora.merge_lora_on_export if merge_lora is None else merge_lora,
        verify_inputs=verification_batch(
            tokenized["validation"], tokenizer, pad_to_multiple_of=trainer.runtime.pad_to_multiple_of
        ),
        last_checkpoint=trainer.last_checkpoint,
        export_dtype=config.training.export_dtype,
        before_publish=before_publish,
    )
    if is_main_process():
        get_logger().info(
            f"exported the {'LoRA adapter' if export.is_adapter else 'model'} to {export.model_dir}"
            + (" (streamed, one tensor at a time)" if export.streamed else "")
            + (f" and the merged model to {export.merged_dir}" if export.merged_dir else "")
            + f"; reloaded it: max logit difference {export.max_logit_diff:.2e}"
        )
    return Path(export.model_dir)


class _Collector:
    """What :func:`collections_paused_while_setting_up` yields: the job calls :meth:`set_up`, maybe :meth:`thaw`."""

    def __init__(self, *, was_enabled: bool) -> None:
        self.was_enabled = was_enabled
        self.frozen = False

    def set_up(self) -> None:
        """The job is set up: one collection, freeze what is alive, collect again from now on."""
        # The youngest generation is everything created since the pause (nothing is promoted without a collection):
        # the setup's garbage, found at a third less than a full collection's cost (0.29 against 0.42 s).
        gc.collect(0)
        gc.freeze()
        self.frozen = True
        if self.was_enabled:
            gc.enable()

    def thaw(self) -> None:
        """Unfreeze (idempotent): what the job set up may become garbage that only a collection frees."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


def _close(trainer: Any, collector: _Collector, launch: LaunchInfo) -> None:
    """``trainer.close()``; with several processes, the collector thawed first: ``close``'s collection must free the
    DDP reducer while the process group lives."""
    if launch.world_size > 1:
        collector.thaw()
    trainer.close()


@contextlib.contextmanager
def collections_paused_while_setting_up(*, thaw: bool = True) -> Iterator[_Collector]:
    """Python's cyclic garbage collector during a job: paused while the libraries load and the model is built, then
    one collection, after which everything alive is frozen (``gc.freeze``) until the job ends.

    Loading torch, transformers and a model creates ~500,000 long-lived objects, and each full collection walks all
    of them (0.1-0.25 s each; a 1,000-row default job ran 9, 0.74 s in all: 7 while loading, 2 around the export, 1
    in ``close``). Frozen, they are skipped by every later collection, the interpreter's own at exit included (the
    ``hftrain train`` command returned 0.6-0.8 s sooner); nothing they hold is garbage (one collection ran first).
    ``thaw``: unfrozen when the job ends, so that a notebook's process collects as usual afterwards; a process that
    exits next (the CLI) skips it. A job of several processes thaws before ``Trainer.close``, whose collection must
    free the DDP reducer while the process group lives (see there).

    Args:
        thaw: unfreeze when the job ends.

    Yields:
        the collector: ``set_up()`` once the job is set up; ``thaw()`` before what must be collectable.
    """
    collector = _Collector(was_enabled=gc.isenabled())
    gc.disable()
    try:
        yield collector
    finally:
        if thaw:
            collector.thaw()
        if collector.was_enabled:
            gc.enable()


def quiet_libraries() -> None:
    """Keep one progress bar (the trainer's) and the warnings; drop per-step library chatter."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_warning()
    for handler in transformers.utils.logging._get_library_root_logger().handlers:
        handler.addFilter(_DecidedByHftrain())


class _DecidedByHftrain(logging.Filter):
    """Drops library warnings about a choice hftrain made for the user, who cannot act on them."""

    # transformers turns the key/value cache off under gradient checkpointing, which the job asked for; a
    # classifier never uses that cache.
    # A document longer than the model takes is tokenized whole on purpose: the packer continues it over blocks (or
    # cuts it, and logs how many tokens it kept).
    DECIDED = (
        "is incompatible with gradient checkpointing",
        "Token indices sequence length is longer than the specified maximum sequence length",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.DECIDED)
