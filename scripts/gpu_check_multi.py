"""What hftrain does on two or more GPUs, checked in under ten minutes: one PASS/FAIL/SKIP line per check, exit 1 on a
FAIL. The one-GPU checks are ``scripts/gpu_check.py``.

Run by ``scripts/gpu_check_multi.sh``. Each check is one ``torchrun --nproc_per_node N`` job of ``hftrain train`` on
a small model built locally (no hub), over NCCL:

- ``ddp``, ``zero2``, ``zero3``, ``fsdp2``, ``megatron tp2``, ``megatron pp2``: a sequence classifier (BERT) trained
  6 steps with a checkpoint at step 3, exported, then resumed from it to step 8 (a second launch);
- ``megatron cp2``: a causal LM (Llama, grouped-query attention) on packed prompt/response JSONL, its sequences
  split over 2 ranks; trained, checkpointed, exported;
- ``megatron ep2``: a Mixtral classifier (4 experts, top-2) with its experts split over 2 data-parallel ranks;
- ``fsdp1 export``: FSDP version 1, whose export hftrain reloads and compares (its logged logit difference), and which
  this script reloads again in plain transformers and runs.

Every launch goes through this file's ``--worker`` entry, which runs hftrain's CLI in each rank and writes the rank's
peak memory over the training steps (from the first step to the last step's end: not the load, the final evaluation
or the export) to a JSON file: ``torch.cuda.max_memory_allocated``, or on ``--cpu`` the process's ``VmHWM`` less its
resident memory once the libraries are imported. The most loaded rank's figure is set against ``hftrain plan``'s
per-GPU estimate for the same model, workload and layout (``hftrain.plan.plan`` with the layout's axes fixed; the
layout's strategy options are the plan row's own): the measured/planned ratio is informational, and a ratio more than
15% from 1 is flagged on the line, never failed.

``--cpu`` runs every launch as gloo processes on the CPU (no CUDA), so the commands, configs and result parsing are
proven on a machine without GPUs. Without CUDA and without ``--cpu`` every check is a SKIP line and the exit is 0.
A time budget (``--budget``, 570 s by default; 3600 s with ``--cpu``) skips the checks that would not finish in it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check import FLAG_APART, RESULTS, check  # noqa: E402 - one PASS/FAIL/SKIP line per check, as the 1-GPU script

MEMORY_DIR = "GPU_CHECK_MEMORY_DIR"  # where each worker rank writes its peak memory


@dataclass
class Check:
    """One multi-process check.

    Args:
        name: its line's name.
        model: ``bert``, ``llama`` (a causal LM) or ``mixtral``.
        axes: the layout's axes for the planner (megatron: tp, pp, cp, ep), or None for a data-parallel row.
        label: the plan row of a data-parallel strategy (``ddp``, ``zero2``, ``zero3``, ``fsdp``).
        strategy: extra ``hftrain train`` options (the plan row's options are added for a megatron layout).
        resume: a second launch resumes from the step-3 checkpoint to step 8.
        reload: reload the export in plain transformers and run it.
    """

    name: str
    model: str = "bert"
    axes: dict[str, int] | None = None
    label: str | None = None
    strategy: list[str] = field(default_factory=list)
    resume: bool = True
    reload: bool = False


CHECKS = [
    Check("ddp", label="ddp", strategy=["--strategy.name", "ddp"]),
    Check("megatron cp2", model="llama", axes={"tp": 1, "pp": 1, "cp": 2, "ep": 1}, resume=False),
    Check("megatron ep2", model="mixtral", axes={"tp": 1, "pp": 1, "cp": 1, "ep": 2}, resume=False),
    Check(
        "fsdp1 export", "bert", None, "fsdp", ["--strategy.name", "fsdp", "--strategy.fsdp_version", "1"], False, True
    ),
    Check("zero3", label="zero3", strategy=["--strategy.name", "zero3"]),
    Check("zero2", label="zero2", strategy=["--strategy.name", "zero2"]),
    Check("fsdp2", label="fsdp", strategy=["--strategy.name", "fsdp", "--strategy.fsdp_version", "2"]),
    Check("megatron tp2", axes={"tp": 2, "pp": 1, "cp": 1, "ep": 1}),
    Check("megatron pp2", axes={"tp": 1, "pp": 2, "cp": 1, "ep": 1}),
]
CHECK_NAMES = [c.name for c in CHECKS]

MICRO, SEQ, LM_SEQ, STEPS = 8, 32, 64, 6


def skip(name: str, why: str) -> None:
    RESULTS.append(("SKIP", name, why))
    print(f"SKIP {name}: {why}", flush=True)


# ---------------------------------------------------------------------------------------------------- the worker


def _resident(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(argv: list[str]) -> int:
    """One rank of a launch: ``hftrain train ARGV``, its peak memory over the training steps written to
    ``$GPU_CHECK_MEMORY_DIR/rank<R>.json`` (appended per launch)."""
    import accelerate  # noqa: F401 - the libraries a run loads, in the baseline below
    import torch
    import transformers.modeling_utils  # noqa: F401

    import hftrain.cli
    import hftrain.trainers.base as base

    if any(arg.startswith("zero") for arg in argv):
        import deepspeed  # noqa: F401

    cuda = torch.cuda.is_available()
    baseline = _resident("VmRSS")  # the libraries, before any model or data
    figures: dict[str, float] = {"baseline": baseline}
    fit, on_step_end = base.Trainer.fit, base.Trainer._on_step_end

    def fit_measured(self, *args, **kwargs):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM starts again from the resident memory
        figures["at_fit"] = torch.cuda.memory_allocated() if cuda else _resident("VmRSS")
        # the default group bound to this rank's device (eager NCCL init, Platform.start_group_eagerly); None on gloo
        bound = torch.distributed.distributed_c10d._get_default_group().bound_device_id
        figures["bound_device"] = None if bound is None else str(bound)
        return fit(self, *args, **kwargs)

    def step_end_measured(self, *args, **kwargs):
        reason = on_step_end(self, *args, **kwargs)
        if self.state.global_step >= self.max_steps or reason is not None:  # the steps' peak, before the export
            figures["peak"] = torch.cuda.max_memory_allocated() if cuda else _resident("VmHWM")
            figures["step"] = self.state.global_step
        return reason

    base.Trainer.fit, base.Trainer._on_step_end = fit_measured, step_end_measured
    code = hftrain.cli.entry(["train", *argv])
    figures["process_peak"] = torch.cuda.max_memory_allocated() if cuda else _resident("VmHWM")
    figures["cuda"] = cuda
    out = Path(os.environ[MEMORY_DIR])
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"rank{os.environ.get('RANK', '0')}.json").open("a") as handle:
        handle.write(json.dumps(figures) + "\n")
    return code


# ---------------------------------------------------------------------------------------------------- the checks


@dataclass
class Setup:
    """What every check shares: the scratch folder, processes, device kind, model width and the time budget."""

    where: Path
    nproc: int
    cpu: bool
    hidden: int
    budget: float
    started: float = field(default_factory=time.perf_counter)
    launch_seconds: list[float] = field(default_factory=list)
    models: dict[str, Path] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def expected(self, launches: int) -> float:
        """Seconds ``launches`` more launches are expected to take (the slowest so far; 60 s before any)."""
        return launches * (max(self.launch_seconds) if self.launch_seconds else 60.0)


def _model(setup: Setup, kind: str) -> Path:
    """A model folder of ``kind`` (``bert``, ``llama``, ``mixtral``): 4 layers of ``setup.hidden``, its tokenizer."""
    if kind in setup.models:
        return setup.models[kind]
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tests.tiny import tiny_config, tiny_tokenizer

    h = setup.hidden
    config = tiny_config(kind, num_layers=4, max_positions=128)
    tokenizer = tiny_tokenizer("bert" if kind == "bert" else "gpt2")
    config.hidden_size, config.num_attention_heads = h, 4
    config.intermediate_size = 4 * h if kind == "bert" else 2 * h
    if kind != "bert":
        config.eos_token_id = config.pad_token_id = tokenizer.eos_token_id if kind == "llama" else 0
        config.head_dim = h // 4
    path = setup.where / f"model-{kind}"
    built = AutoModelForCausalLM if kind == "llama" else AutoModelForSequenceClassification
    built.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    setup.models[kind] = path
    return path


def _data(setup: Setup, kind: str) -> Path:
    if kind == "llama":
        path = setup.where / "lm.jsonl"
        if not path.exists():
            from tests.test_causal_lm import lm_splits

            rows = lm_splits(n_train=320, n_eval=0, prompt_response=True, seed=0)["train"]
            path.write_text("".join(json.dumps(row) + "\n" for row in rows.to_list()))
        return path
    path = setup.where / "train.csv"
    if not path.exists():
        from tests.tiny import write_csv

        write_csv(path, rows=240)
    return path


def _plan_row(setup: Setup, item: Check):
    """The plan row of this check's model, workload and layout (None: the layout is not in the plan)."""
    import torch

    from hftrain.plan import Hardware, Workload, model_from_config, plan

    task = "causal_lm" if item.model == "llama" else "sequence_classification"
    spec = model_from_config(str(_model(setup, item.model)), task=task)
    memory = 80e9 if setup.cpu else torch.cuda.get_device_properties(0).total_memory
    hardware = Hardware(
        gpus_per_node=setup.nproc, gpu_memory=memory, reserve=0, dropout_mask_bytes=4 if setup.cpu else 1
    )
    pipelined = (item.axes or {}).get("pp", 1) > 1
    work = Workload(
        precision="fp32" if setup.cpu else "bf16",
        micro_batch=MICRO // 2 if pipelined else MICRO,
        seq=LM_SEQ if item.model == "llama" else SEQ,
        accumulation=2 if pipelined else 1,
        dropout=False,
    )
    if item.axes is None:
        rows = [r for r in plan(spec, hardware, work).rows if r.label == item.label]
    else:
        # the row without ZeRO-1 where the plan has one (an ep row at dp > 1 shards its optimizer, as training does)
        rows = sorted(
            plan(spec, hardware, work, **item.axes).rows, key=lambda r: bool(r.strategy.get("shard_optimizer"))
        )
    return rows[0] if rows else None


def _row_options(row) -> list[str]:
    """A megatron plan row's options as ``hftrain train`` arguments (``--section.field value``)."""
    from hftrain.config import nest_fields

    args = []
    for section, fields in nest_fields(row.strategy, source=f"plan row {row.label}").items():
        for name, value in fields.items():
            args += [f"--{section}.{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def _launch(setup: Setup, args: list[str], memory_dir: Path) -> str:
    """One ``torchrun`` of the worker; its output (raises with its tail on a non-zero exit)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(setup.nproc),
               str(Path(__file__).resolve()), "--worker", *args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", MEMORY_DIR: str(memory_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if setup.cpu:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    timeout = max(30.0, min(600.0, setup.left()))
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"launch ran past {timeout:.0f} s (the budget left)") from error
    setup.launch_seconds.append(time.perf_counter() - start)
    if done.returncode != 0:
        print(done.stdout[-3000:] + done.stderr[-6000:], flush=True)
        output = (done.stdout + done.stderr).splitlines()
        why = [line for line in output if line.startswith("hftrain: error:")]
        why = why or [line for line in output if re.match(r"\s*\w+(Error|Exception):", line)]
        raise RuntimeError(f"torchrun exited {done.returncode}: {(why or ['see the output above'])[0].strip()[:300]}")
    return done.stdout + done.stderr


def _memory(memory_dir: Path, cpu: bool) -> tuple[float, float]:
    """The most loaded rank's peak over the steps of the first launch, and its whole-process peak (bytes); on the
    CPU both less the rank's resident memory after its imports."""
    firsts = [json.loads(p.read_text().splitlines()[0]) for p in sorted(memory_dir.glob("rank*.json"))]
    if not firsts or any("peak" not in f for f in firsts):
        raise RuntimeError(f"no peak memory from {len(firsts)} rank(s) in {memory_dir}")
    less = (lambda f: f["baseline"]) if cpu else (lambda f: 0)
    return max(f["peak"] - less(f) for f in firsts), max(f["process_peak"] - less(f) for f in firsts)


def _check_bound(memory_dir: Path) -> None:
    """On GPUs: every rank's default process group was bound to its device (eager NCCL init,
    ``Platform.start_group_eagerly``); else NCCL bootstraps every subgroup on its own and finds a broken rank only at
    the first collective."""
    firsts = [json.loads(p.read_text().splitlines()[0]) for p in sorted(memory_dir.glob("rank*.json"))]
    unbound = [rank for rank, figures in enumerate(firsts) if not figures.get("bound_device")]
    if unbound:
        raise AssertionError(f"rank(s) {unbound}: the default process group is not bound to the rank's GPU")


def _compare(measured: float, row) -> str:
    if row is None:
        return "no plan row for this layout"
    if not row.fits:
        return f"plan: {row.label} does not fit"
    ratio = measured / row.total
    flag = f" FLAG: more than {FLAG_APART:.0%} apart" if abs(ratio - 1) > FLAG_APART else ""
    return f"plan {row.label} {row.total / 2**20:.1f} MiB, measured/planned {ratio:.2f}{flag}"


def _reload(folder: Path, kind: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    built = AutoModelForCausalLM if kind == "llama" else AutoModelForSequenceClassification
    model = built.from_pretrained(folder, trust_remote_code=False).eval()
    ids = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)(
        ["w1 w2 w3 w4", "w5 w6"], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        logits = model(**ids).logits
    if not torch.isfinite(logits).all():
        raise AssertionError(f"the reloaded export gives non-finite logits from {folder}")
    return f"reloaded in transformers, logits {tuple(logits.shape)} finite"


def run_check(setup: Setup, item: Check) -> str:
    launches = 2 if item.resume else 1
    if setup.left() < setup.expected(launches):
        return (f"skip: the time budget is spent ({setup.left():.0f} s left of {setup.budget:.0f} s, "
                f"{setup.expected(launches):.0f} s expected)")  # fmt: skip
    model, data = _model(setup, item.model), _data(setup, item.model)
    row = _plan_row(setup, item)
    if item.axes is not None and row is None:
        raise RuntimeError(f"hftrain plan has no layout {item.axes} for {setup.nproc} processes")
    options = _row_options(row) if item.axes is not None else item.strategy
    out = setup.where / item.name.replace(" ", "-")
    memory_dir = setup.where / f"memory-{item.name.replace(' ', '-')}"
    lm = item.model == "llama"
    pipelined = (item.axes or {}).get("pp", 1) > 1
    args = ["--model_name_or_path", str(model), "--dataset_name", "null", "--train_file", str(data),
            "--log_with", "none", "--max_steps", str(STEPS), "--save_steps", "3", "--output_dir", str(out),
            "--per_device_train_batch_size", str(MICRO), "--max_seq_length", str(LM_SEQ if lm else SEQ),
            "--logging_steps", "1", "--mixed_precision", "no" if setup.cpu else "bf16", "--learning_rate", "1e-4",
            *(["--task", "causal_lm"] if lm else []),
            *(["--parallelism.num_microbatches", "2"] if pipelined else []), *options]  # fmt: skip
    text = _launch(setup, args, memory_dir)
    state = json.loads((out / "trainer_state.json").read_text())
    if state["global_step"] != STEPS:
        raise AssertionError(f"trained to step {state['global_step']}, not {STEPS}")
    if not (out / "model" / "config.json").exists():
        raise AssertionError(f"no export in {out / 'model'}")
    done = [f"trained {STEPS} steps, checkpointed, exported"]
    found = re.search(r"reloaded it: max logit difference (\S+)", text)
    if found:
        difference = float(found.group(1).rstrip(";,)"))  # beyond its precision's tolerance hftrain exits 2
        done.append(f"hftrain reloaded its export (logits within {difference:.1e})")
    elif item.reload:
        raise AssertionError("hftrain did not report reloading its export ('reloaded it: max logit difference')")
    if item.reload:
        done.append(_reload(out / "model", item.model))
    if item.resume:
        _launch(setup, [*args, "--max_steps", "8", "--resume_from_checkpoint", "auto"], memory_dir)
        state = json.loads((out / "trainer_state.json").read_text())
        if state["global_step"] != 8:
            raise AssertionError(f"the resumed run ended at step {state['global_step']}, not 8")
        done.append("resumed from step 3 to 8")
    peak, process_peak = _memory(memory_dir, setup.cpu)
    if not setup.cpu:
        _check_bound(memory_dir)
    what = "VmHWM less imports" if setup.cpu else "max_memory_allocated"
    done.append(f"steps' peak {what} {peak / 2**20:.1f} MiB (whole process {process_peak / 2**20:.1f} MiB); "
                + _compare(peak, row))  # fmt: skip
    return "; ".join(done)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="every launch as gloo processes on the CPU (no CUDA)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per launch (GPUs; default 2)")
    parser.add_argument("--budget", type=float, help="seconds for all checks (default 570; 3600 with --cpu)")
    parser.add_argument("--hidden", type=int, help="the models' hidden size (default 512 on GPUs, 128 with --cpu)")
    parser.add_argument("--only", action="append", help="run only this check (repeatable), e.g. 'megatron cp2'")
    args = parser.parse_args(argv)
    chosen = [c for c in CHECKS if not args.only or c.name in args.only]
    import torch

    budget = args.budget or (3600.0 if args.cpu else 570.0)
    if not args.cpu and torch.cuda.device_count() < max(args.nproc, 2):
        why = (f"{torch.cuda.device_count()} GPU(s), {max(args.nproc, 2)} needed (NCCL refuses two ranks on one "
               f"device); --cpu runs the same launches with gloo on the CPU")  # fmt: skip
        for item in chosen:
            skip(item.name, why)
    else:
        device = "CPU, gloo" if args.cpu else f"{torch.cuda.get_device_name()} × {args.nproc}, NCCL"
        print(f"device: {device}, torch {torch.__version__}, budget {budget:.0f} s", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            hidden = args.hidden or (128 if args.cpu else 512)
            setup = Setup(Path(scratch), args.nproc, args.cpu, hidden, budget)
            for item in chosen:
                check(item.name, lambda item=item: run_check(setup, item))
    failed = [name for status, name, _ in RESULTS if status == "FAIL"]
    print(f"{'FAIL' if failed else 'PASS'} gpu_check_multi: {len(RESULTS) - len(failed)} of {len(RESULTS)} checks "
          f"passed or skipped{': failed ' + ', '.join(failed) if failed else ''}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker(sys.argv[2:]))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
