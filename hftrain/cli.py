"""The ``hftrain`` command: the only place that reads argv and the environment.

Heavy libraries are imported inside the subcommands so that ``hftrain --help`` answers at once. Every
subcommand runs through ``main``, which applies the bad-input rule of ``hftrain.errors``: an ``HFTrainError``
(including a malformed command line) is one ``hftrain: error: ...`` line on stderr and exit code 2; any other
exception is a bug and keeps its traceback. Under a launcher (torchrun, accelerate launch, deepspeed) every rank
exits 2 but only the main process of each machine prints the line, so a bad input is said once, not once per
rank. A new subcommand is a parser entry and a line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import typing

from hftrain.errors import AxisError, ConfigError, HFTrainError, UsageError
from hftrain.files import read_input
from hftrain.launch.supervise import reports_errors
from hftrain.parallel.dims import AXIS_SIZES
from hftrain.plan.command import add_plan_arguments, run_plan

DESCRIPTION = "Distributed fine-tuning over Hugging Face Accelerate and DeepSpeed."
# Seconds a rank that leaves a bad input's line to the main process waits before exiting with it: the same input
# fails the same way on every rank within moments, and a launcher that stops the job at the first exit must not
# stop the main process before it printed the line.
SILENT_RANK_GRACE_S = 2.0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as ``UsageError`` (one line) instead of usage text and ``exit(2)``."""

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(f"{self.prog}: {message}; see {self.prog} --help")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its subcommands."""
    parser = _Parser(prog="hftrain", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser(
        "train",
        help="fine-tune a sequence classifier (no config: MiniLM on Rotten Tomatoes, both embedded)",
        description="Fine-tune a sequence classifier. Config fields may be overridden as --field value "
        "or --section.field=value (e.g. --learning_rate 1e-4 --training.max_steps=100).",
    )
    train.add_argument("--config", help="YAML config with sections model, data, training, strategy")
    commands.add_parser("env", help="versions, devices, backend, and which strategies can run here")
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a verified save_pretrained folder (LoRA: a PEFT adapter)",
        description="Export a checkpoint. Launch it like the run that wrote it, e.g. "
        "torchrun --nproc_per_node 2 -m hftrain export CKPT DIR for a 2-process ZeRO checkpoint.",
    )
    export.add_argument(
        "checkpoint", help="a run's output_dir (its latest checkpoint) or a checkpoint: output_dir/checkpoints/step_<N>"
    )
    export.add_argument("directory", help="a new folder for the export")
    export.add_argument(
        "--output_dir", help="the run folder the checkpoint belongs to (a checkpoint inside it needs no trust flag)"
    )
    export.add_argument("--merge_lora", action="store_true", help="also write the adapter merged into the model")
    export.add_argument(
        "--trust_external_checkpoint",
        action="store_true",
        help="allow a checkpoint outside the run folder this command names",
    )
    convert = commands.add_parser(
        "convert",
        help="turn a checkpoint (or a DeepSpeed ZeRO folder) into a save_pretrained folder, in one CPU process",
        description="Convert a checkpoint into a save_pretrained folder (LoRA: a PEFT adapter) in one process, "
        "one tensor at a time, without starting the world that wrote it; every written tensor is read back and "
        "compared with the checkpoint's.",
    )
    convert.add_argument(
        "checkpoint",
        help="output_dir/checkpoints/step_<N>, a run's output_dir (its latest), or a DeepSpeed checkpoint folder",
    )
    convert.add_argument("out", help="a new folder for the model (LoRA: the adapter; --merge_lora adds OUT_merged)")
    convert.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="saved dtype of the weights"
    )
    convert.add_argument("--merge_lora", action="store_true", help="also write the adapter merged into the model")
    convert.add_argument(
        "--config", help="for a DeepSpeed folder: the model's config folder (config.json, adapter_config.json)"
    )
    convert.add_argument("--max_shard_size", default="50GB", help="bytes per safetensors file, e.g. 5GB (default 50GB)")
    convert.add_argument(
        "--output_dir", help="the run folder the checkpoint belongs to (a checkpoint inside it needs no trust flag)"
    )
    convert.add_argument(
        "--trust_external_checkpoint",
        action="store_true",
        help="allow a checkpoint outside the run folder this command names",
    )
    groups = commands.add_parser(
        "groups",
        help="print the tensor-, pipeline- and data-parallel rank groups of a layout (starts no process)",
        description="Print the tp/pp/dp groups of tp × pp × dp = world size in Megatron-LM's rank order.",
    )
    groups.add_argument("--world-size", type=int, required=True, help="number of processes")
    for axis, meaning in AXIS_SIZES.items():
        groups.add_argument(f"--{axis}", type=int, default=1, help=meaning)
    groups.add_argument("--json", action="store_true", help='print {"tp": [...], "pp": [...], "dp": [...]}')
    doctor = commands.add_parser(
        "doctor",
        help="preflight a launch: hostfile, process counts, rendezvous, interface variable, versions per machine",
        description="Check a launch before starting it; exit code 1 with the reason when it would fail. Run it on "
        "every machine: the one hosting the rendezvous with --wait S compares the others' versions with its own.",
    )
    doctor.add_argument("--hostfile", help="a DeepSpeed hostfile (lines 'host slots=N')")
    doctor.add_argument("--master_addr", help="rendezvous address (default MASTER_ADDR, else the first host)")
    doctor.add_argument("--master_port", type=int, help="rendezvous port (default MASTER_PORT, else 29500)")
    doctor.add_argument("--nnodes", type=int, help="machines in the job")
    doctor.add_argument("--node_rank", type=int, help="this machine's index; 0 hosts the rendezvous")
    doctor.add_argument("--nproc_per_node", type=int, help="processes per machine")
    doctor.add_argument("--num_processes", type=int, help="processes in the whole job")
    doctor.add_argument("--timeout", type=float, help="seconds to wait for a connection (default 5)")
    doctor.add_argument("--wait", type=float, help="rendezvous machine: seconds to wait for the others' doctors")
    plan = commands.add_parser(
        "plan",
        help="which strategy: per-GPU memory, communication and time for DDP, ZeRO, FSDP and TP × PP × DP layouts",
        description="Estimate every strategy and layout the hardware admits (each formula stated) and recommend one; "
        "--write-configs DIR writes the files that start it.",
    )
    add_plan_arguments(plan)
    commands.add_parser(
        "launch",
        help="torchrun whose exit code is the ranks' own (75 preempted, 2 bad input): "
        "hftrain launch --nproc_per_node 2 -- train --config job.yaml",
        description="Run an hftrain command under torchrun (its options before --, the command after) and exit "
        "with the ranks' exit code: 75 when they were preempted and saved a checkpoint, so a requeue script sees it. "
        "SIGUSR1 is handled like SIGTERM, and signalled ranks get time to checkpoint.",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None, *, process_exits_after: bool = False) -> int:
    """Run a subcommand; a user error prints one line to stderr and returns exit code 2.

    Args:
        argv: the arguments after ``hftrain`` (``sys.argv[1:]`` when None).
        process_exits_after: the process ends when this returns (the ``hftrain`` command, ``python -m hftrain``,
            ``scripts/train.py``): a training job leaves its long-lived objects frozen for the garbage collector
            (``job.collections_paused_while_setting_up``), which spares the interpreter's exit a walk over them.
    """
    from hftrain.launch.supervise import INTERRUPTED_EXIT_CODE

    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):  # torchrun's options are not ours
            from hftrain.launch.supervise import launch_main

            return launch_main(argv[1:])
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        args.process_exits_after = process_exits_after
        if args.command != "train" and extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return COMMANDS[args.command](args, extra)
    except HFTrainError as error:
        _close_progress_bars()
        if error.every_rank or reports_errors(os.environ):
            message = " ".join(str(error).split())  # one line, whatever a library put into it
            print(f"hftrain: error: {message}", file=sys.stderr)
        else:  # torchrun stops every rank at the first exit: the main process must get to print first
            time.sleep(SILENT_RANK_GRACE_S)
        return error.exit_code
    except KeyboardInterrupt:
        _close_progress_bars()
        if reports_errors(os.environ):
            print(
                f"hftrain: interrupted (Ctrl-C); a training run resumes from its last complete checkpoint with "
                f"--resume_from_checkpoint auto (exit code {INTERRUPTED_EXIT_CODE})",
                file=sys.stderr,
            )
        return INTERRUPTED_EXIT_CODE


def entry(argv: list[str] | None = None) -> int:
    """The ``hftrain`` command: :func:`main` on ``sys.argv``, in a process that exits when it returns.

    A reader that stops early (``hftrain groups --world-size 64 --tp 8 | head``) closes the pipe: the command
    stops quietly, with the shell's usual status for it, instead of a ``BrokenPipeError`` traceback (Python's
    documented way: the rest of the output goes to ``/dev/null``, so the interpreter's final flush cannot fail).
    """
    from hftrain.launch.supervise import die_with_parent, record_exit

    die_with_parent(os.environ)  # a worker whose agent dies checkpoints and exits instead of training on alone
    try:
        code = main(argv, process_exits_after=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + 13  # SIGPIPE's status, as a command killed by it reports
    record_exit(code, os.environ)  # for hftrain launch, whose torchrun keeps no exit code after a signal
    return code


def _close_progress_bars() -> None:
    """End the progress bars a raising loop left open, so that the error starts a line of its own."""
    std = sys.modules.get("tqdm.std")
    for bar in list(getattr(std.tqdm, "_instances", ()) if std else ()):
        bar.close()


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from hftrain.config import load_config
    from hftrain.job import run_training
    from hftrain.launch.args import translate_launcher_args
    from hftrain.log import log_main

    launcher = translate_launcher_args(overrides, os.environ)  # --local_rank, --deepspeed ds.json
    config = launcher.apply(load_config(args.config, launcher.overrides))
    _preflight_launch()
    result = run_training(config, launch_info_from_environ(), process_exits_after=args.process_exits_after)
    if result.preempted:
        from hftrain.checkpoint.preemption import PREEMPTED_EXIT_CODE

        log_main(
            f"preempted ({result.preempted}) at step {result.global_step}; checkpoint {result.checkpoint}; run the "
            f"same command with --resume_from_checkpoint auto to continue (exit code {PREEMPTED_EXIT_CODE})"
        )
        return PREEMPTED_EXIT_CODE
    from hftrain.metrics import headline

    nan = float("nan")
    (first, first_value), (second, second_value) = headline(result.metrics) or (("accuracy", nan), ("f1", nan))
    metrics = result.metrics
    counted = (  # a language model's evaluation counts target tokens, a classifier's examples
        f"{int(metrics['eval_tokens']):,} tokens" if "eval_tokens" in metrics
        else f"{int(metrics.get('eval_samples', 0))} examples"
    )  # fmt: skip
    log_main(
        f"validation {first} {first_value:.4f} ({second} {second_value:.4f}, {counted}) after "
        f"{result.global_step} steps; "
        f"took {result.seconds:.1f} s ({_throughput(result.throughput)}); model saved to {result.model_dir}"
    )
    return 0


def _throughput(summary: dict) -> str:
    """The training steps' rates for the final line: real tokens/s, samples/s, TFLOP/s per process, MFU, padding."""
    from hftrain.trainers.throughput import padding_words

    if not summary.get("train_steps_seconds"):
        return "no training step"
    mfu = summary.get("train_mfu")
    return (
        f"{summary['train_tokens_per_second']:,.0f} tokens/s, {summary['train_samples_per_second']:.1f} samples/s, "
        f"{summary['train_tflops_per_process']:.3f} TFLOP/s per process"
        + (f", MFU {100 * mfu:.1f}%" if mfu is not None else "")
        + (f", {padding}" if (padding := padding_words(summary)) else "")
    )


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    from hftrain.job import run_export
    from hftrain.log import log_main

    model_dir = run_export(
        args.checkpoint,
        args.directory,
        launch_info_from_environ(),
        merge_lora=args.merge_lora,
        trust=args.trust_external_checkpoint,
        output_dir=args.output_dir,
    )
    log_main(f"exported {args.checkpoint} to {model_dir}")
    return 0


def _convert(args: argparse.Namespace, extra: list[str]) -> int:
    from hftrain.checkpoint.convert import convert_checkpoint
    from hftrain.log import log_main

    result = convert_checkpoint(
        args.checkpoint,
        args.out,
        dtype=args.dtype,
        merge_lora=args.merge_lora,
        trust=args.trust_external_checkpoint,
        output_dir=args.output_dir,
        config=args.config,
        max_shard_size=args.max_shard_size,
    )
    what = "LoRA adapter" if result.is_adapter else "model"
    log_main(
        f"converted {args.checkpoint} to {result.model_dir} ({what}, {args.dtype})"
        + (f" and the merged model to {result.merged_dir}" if result.merged_dir else "")
        + f"; {result.tensors} tensors read back equal to the checkpoint's"
    )
    return 0


def _groups(args: argparse.Namespace, extra: list[str]) -> int:
    from hftrain.parallel.dims import MAX_PRINTED_WORLD, ParallelDims, group_lines, groups_json_chunks

    for name in ("world_size", *AXIS_SIZES):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(args, name)}: must be a positive integer")
    if args.world_size > MAX_PRINTED_WORLD:
        raise ConfigError(
            f"--world-size {args.world_size}: hftrain groups prints layouts of at most {MAX_PRINTED_WORLD} processes; "
            "a larger one follows the same rule, rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank: "
            f"give a world size up to {MAX_PRINTED_WORLD}"
        )
    try:  # the megatron strategy's own check: a printed layout is one that training takes
        sizes = {axis: getattr(args, axis) for axis in AXIS_SIZES}
        dims = ParallelDims(args.world_size, **sizes).validate_trainable()
    except AxisError as error:  # hftrain.parallel names the axis; here the value came from a flag
        raise error.named_as(f"--{error.axis.replace('_', '-')}") from None  # tp · pp must divide the world
    for piece in groups_json_chunks(dims) if args.json else group_lines(dims):
        sys.stdout.write(piece if args.json else piece + "\n")
    if args.json:
        sys.stdout.write("\n")
    return 0


def _env(args: argparse.Namespace, extra: list[str]) -> int:
    from hftrain.env import report

    print(report())
    return 0


def _doctor(args: argparse.Namespace, extra: list[str]) -> int:
    from hftrain.doctor import main_doctor, settings_from_args

    return main_doctor(settings_from_args(args))


def _preflight_launch() -> None:
    """The launcher's environment checked (and gloo's interface variable set) before anything starts."""
    from hftrain.launch.preflight import preflight_launch
    from hftrain.log import get_logger
    from hftrain.strategies.platform import Platform

    platform = Platform.detect()
    found = preflight_launch(os.environ, backend=platform.backend, gpus=platform.gpus)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per machine
        for note in found.notes:
            get_logger().info(note)


def launch_info_from_environ(environ: dict[str, str] | None = None):  # -> LaunchInfo
    """What the launcher (torchrun / accelerate launch / deepspeed) put in the environment."""
    from hftrain.strategies import LaunchInfo

    env = dict(os.environ if environ is None else environ)
    world = int(env.get("WORLD_SIZE", "1"))
    settings = {
        k: v for k, v in env.items() if k.startswith(("ACCELERATE_DEEPSPEED_", "FSDP_", "ACCELERATE_MIXED_PRECISION"))
    }
    return LaunchInfo(
        world_size=world,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world),  # LOCAL_SIZE: deepspeed
        accelerate_strategy=_accelerate_strategy(env),
        accelerate_settings=settings,
    )


def _accelerate_strategy(env: dict[str, str]) -> str | None:
    """The strategy an ``accelerate launch --config_file`` selected, in hftrain's names."""
    import json

    use_fsdp = env.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if use_fsdp and env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise ConfigError("accelerate config: FSDP and DeepSpeed are both enabled; choose one distributed_type")
    if use_fsdp:
        return "fsdp"
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return None
    stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")  # Accelerate's own default stage
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file and config_file != "none":
        try:
            stage = str(json.loads(read_input(config_file, "deepspeed_config_file"))["zero_optimization"]["stage"])
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(
                f"deepspeed_config_file '{config_file}' (from the accelerate config) has no readable "
                f"zero_optimization.stage ({type(error).__name__}); fix the file or its path"
            ) from None
    if stage not in ("1", "2", "3"):
        raise ConfigError(f"accelerate config: zero_stage '{stage}' is not 1, 2 or 3; hftrain runs ZeRO-1/2/3")
    return f"zero{stage}"


COMMANDS = {
    "train": _train,
    "env": _env,
    "export": _export,
    "convert": _convert,
    "groups": _groups,
    "doctor": _doctor,
    "plan": run_plan,
}


if __name__ == "__main__":
    sys.exit(main())
