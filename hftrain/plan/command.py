"""The ``hftrain plan`` subcommand: its options and what it prints or writes."""

from __future__ import annotations

import argparse
import math

from hftrain.errors import ConfigError
from hftrain.parallel.dims import AXIS_SIZES
from hftrain.tasks import DEFAULT_TASK, TASKS

SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
MAX_PARAMETERS = 10**15  # a thousand trillion: beyond any model, and every byte count stays a finite float


def _count(text: str) -> int:
    """A parameter count: ``7500000000``, ``7.5e9`` or ``7.5B`` (K, M, B, T), between 1 and ``MAX_PARAMETERS``."""
    scale = SUFFIXES.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a count (e.g. 7.5e9 or 7.5B)") from None
    if not math.isfinite(value) or not 1 <= value <= MAX_PARAMETERS:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a parameter count between 1 and {MAX_PARAMETERS:.0e} (e.g. 7.5e9 or 7.5B)"
        )
    return int(value)


def _number(text: str) -> float:
    """A finite number (``nan`` and ``inf`` are not sizes, speeds or fractions)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hftrain plan`` (model, hardware, workload, output).

    Args:
        parser: the subcommand's parser.
    """
    model = parser.add_argument_group("model: --model, or the sizes")
    model.add_argument("--model", help="a local model folder, its config.json, or embedded:minilm / embedded:smollm2")
    model.add_argument(
        "--task",
        choices=tuple(TASKS),
        default=DEFAULT_TASK,
        help="model.task: the sequence classifier (default) or a language model (causal_lm: the *ForCausalLM model "
        "counted, its logits in the activations, model.task written by --write-configs)",
    )
    model.add_argument("--parameters", type=_count, help="Ψ (e.g. 7.5B); default 12·L·h² + V·h")
    for name, text in (
        ("layers", "transformer layers"),
        ("hidden", "hidden size"),
        ("heads", "attention heads"),
        ("kv-heads", "key/value heads (default: heads)"),
        ("intermediate", "MLP width (default 4h)"),
        ("vocab", "vocabulary size"),
    ):
        model.add_argument(f"--{name}", type=int, help=text)
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpu-memory", type=_number, default=80.0, help="GB per GPU (default 80)")
    hw.add_argument("--cpu-memory", type=_number, default=512.0, help="GB of CPU memory per node (offload)")
    hw.add_argument("--reserve", type=_number, default=2.0, help="GB per GPU kept for the framework (default 2)")
    hw.add_argument("--intra", default="nvlink", help="link inside a node: nvlink, pcie, ib, ethernet, loopback")
    hw.add_argument("--inter", default="ib", help="link between nodes (default ib)")
    hw.add_argument("--tflops", type=_number, default=312.0, help="dense bf16 TFLOP/s per GPU (default 312, A100)")
    hw.add_argument("--efficiency", type=_number, default=0.4, help="fraction of --tflops reached (default 0.4)")
    work = parser.add_argument_group("workload")
    work.add_argument("--precision", default="bf16", help="bf16 (default), fp16 or fp32")
    work.add_argument("--micro-batch", type=int, default=8, help="sequences per GPU per micro-batch (default 8)")
    work.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    work.add_argument("--accumulation", type=int, default=1, help="micro-batches per step (pipeline: m)")
    work.add_argument("--lora-rank", type=int, default=0, help="LoRA r (default 0: full fine-tuning)")
    work.add_argument(
        "--recompute",
        nargs="?",
        const="full",
        choices=("full", "selective"),
        help="activation recomputation: full (every layer keeps its input; the default when given) or selective "
        "(the attention core), as training.gradient_checkpointing",
    )
    work.add_argument("--no-dropout", action="store_true", help="dropout off (default: as the model's config says)")
    work.add_argument(
        "--attention",
        choices=["fused", "eager"],
        default="fused",
        help="fused (flash/SDPA: no a·s² scores saved; default) or eager",
    )
    out = parser.add_argument_group("layouts and output")
    for axis, meaning in AXIS_SIZES.items():  # every axis of the layout: only layouts with this size of it
        out.add_argument(f"--{axis}", type=int, help=f"only layouts with this {meaning}")
    out.add_argument("--json", action="store_true", help="print the plan as JSON (bytes, seconds, formulas)")
    out.add_argument("--write-configs", metavar="DIR", help="write job/DeepSpeed/accelerate files for the choice")
    out.add_argument("--row", help="with --write-configs: this row instead of the recommendation")


def plan_from_args(args: argparse.Namespace):  # -> Plan
    """The plan the options describe.

    Args:
        args: the parsed options of ``hftrain plan``.
    """
    from hftrain.plan import Hardware, Workload, model_from_config, model_from_sizes, plan

    sizes = {
        k: getattr(args, k) for k in ("parameters", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")
    }
    if args.model and any(v is not None for v in sizes.values()):
        raise ConfigError("give --model or the sizes (--parameters, --layers, ...), not both")
    if not args.model and any(sizes[k] is None for k in ("layers", "hidden", "heads", "vocab")):
        raise ConfigError(
            "no model: give --model <folder|config.json|embedded:name>, or --layers, --hidden, "
            "--heads and --vocab (and optionally --parameters)"
        )
    for name in AXIS_SIZES:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)}: must be a positive integer")
    for name in ("gpu_memory", "cpu_memory", "reserve"):  # GB, turned into bytes below
        if not math.isfinite(getattr(args, name) * 1e9):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {getattr(args, name):g}: larger than any memory; give GB (e.g. {flag} 80)")
    if args.row and not args.write_configs:
        raise ConfigError("--row chooses what --write-configs writes; add --write-configs DIR")
    task = getattr(args, "task", DEFAULT_TASK)
    model = model_from_config(args.model, task=task) if args.model else model_from_sizes(**sizes, task=task)
    hardware = Hardware(
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        gpu_memory=args.gpu_memory * 1e9,
        cpu_memory=args.cpu_memory * 1e9,
        intra=args.intra,
        inter=args.inter,
        tflops=args.tflops,
        efficiency=args.efficiency,
        reserve=args.reserve * 1e9,
    )
    workload = Workload(
        precision=args.precision,
        micro_batch=args.micro_batch,
        seq=args.seq,
        accumulation=args.accumulation,
        lora_rank=args.lora_rank,
        recompute=args.recompute,
        dropout=model.dropout and not args.no_dropout,
        fused_attention=args.attention == "fused",
    )
    return plan(model, hardware, workload, **{axis: getattr(args, axis) for axis in AXIS_SIZES})


def run_plan(args: argparse.Namespace, extra: list[str]) -> int:
    """``hftrain plan``: print the table (or JSON); with ``--write-configs`` also write the chosen row's files.

    Args:
        args: the parsed options.
        extra: unused (the CLI refuses unknown arguments before this runs).
    """
    from hftrain.plan.configs import write_configs
    from hftrain.plan.report import plan_json, plan_table

    result = plan_from_args(args)
    written = []
    if args.write_configs:
        row = result.row(args.row) if args.row else result.choice
        written = write_configs(row, result.model, result.workload, result.hardware, args.write_configs)
    print(plan_json(result) if args.json else plan_table(result))
    if written and not args.json:
        print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
