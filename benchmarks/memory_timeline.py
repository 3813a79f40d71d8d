"""Per-phase, per-rank resident memory of a whole ``hftrain train`` job under each data-parallel layout (issue 42).

Each layout runs one real job (``python -m hftrain train``; through ``torch.distributed.run --standalone`` for N > 1
processes): 3 fp32 AdamW steps of 8 texts per rank (``tests/tiny.py``'s ``write_csv``, 200 rows of 3-20 words,
``max_seq_length`` 128), then the job's own final evaluation, checkpoint and streamed export. A thread reads
``VmRSS`` and ``VmHWM`` from ``/proc/<pid>/status`` every 0.3 s for every process of the job's tree. The **ranks**
are the job's process (1 process) or the torchrun agent's children (``RANK`` from ``/proc/<pid>/environ``); the
agent, the drawing helper and the ranks' own children are listed apart. The job's stdout and stderr are read line
by line (split on ``\\r`` too: tqdm) and timestamped; the progress bar marks the phases:

- ``model``: until the model is built (the ``length buckets:`` line): imports, data, model load;
- ``load``: until the bar appears (``| 0/3 [``): the strategy's ``prepare`` (DeepSpeed's engine creates the
  optimizer's states here, a 1-process run in its first step);
- ``first step``: until ``1/3``; ``steps``: until ``3/3``;
- ``save+export``: until the job exits (final evaluation, checkpoint, export).

A phase's peak is its largest sampled ``VmRSS``, or a ``VmHWM`` rise first seen in it (a peak between two
samples); ``whole run`` is the last ``VmHWM`` read, at most 0.3 s before the rank exited. GB are 10^9 bytes.
``ratio`` is a rank's whole-run peak over the 1-process (``ddp1``) peak of the same code: where the model states
dominate, sharding them over 2 ranks approaches 0.5.

Models (random weights, built once under /tmp): ``big``: Llama, hidden 1,024, 24 layers, 16 heads, intermediate
2,560, vocabulary 32,000 (322M parameters: 1.29 GB of fp32 weights, 5.2 GB with gradients and Adam moments);
``small``: hidden 256, 4 layers (11M); ``smollm2``: the embedded SmolLM2-135M. Layouts: ``ddp1`` and ``NAMExN``
for NAME in ddp, fsdp1, fsdp2, zero1, zero2, zero3, zero3_offload (parameters and optimizer on the CPU), and
megatron's ``tp`` (tp = N), ``pp`` (pp = N) and ``tp_pp`` (tp 2 × pp N/2).
``--ref REV`` runs each layout with REV's code too (a ``git worktree`` under /tmp, first on ``PYTHONPATH``): rows
``old`` (REV) and ``new`` (this working tree).

Usage (``small``: ~20 s per layout on 2 shared cores; ``big``: minutes per layout, ddp1's model states alone 5.2 GB):
    python benchmarks/memory_timeline.py [--model big|small|smollm2] [--ref REV] [--json out.json] [--png out.png]
        [--layouts ddp1,fsdp2x2,zero2x2,zero3x2,zero3_offloadx2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `tests`

MODELS = {
    "big": {"hidden_size": 1024, "intermediate_size": 2560, "num_hidden_layers": 24, "num_attention_heads": 16},
    "small": {"hidden_size": 256, "intermediate_size": 640, "num_hidden_layers": 4, "num_attention_heads": 4},
}
STRATEGIES = {
    "ddp": ["--strategy.name", "ddp"],
    "fsdp1": ["--strategy.name", "fsdp", "--strategy.fsdp_version", "1"],
    "fsdp2": ["--strategy.name", "fsdp", "--strategy.fsdp_version", "2"],
    "zero1": ["--strategy.name", "zero1"],
    "zero2": ["--strategy.name", "zero2"],
    "zero3": ["--strategy.name", "zero3"],
    "zero3_offload": ["--strategy.name=zero3", "--strategy.offload_params=true", "--strategy.offload_optimizer=true"],
    # megatron over all N processes: tp = N, pp = N, or tp = 2 × pp = N / 2 ("{n}": the process count)
    "tp": ["--strategy.name", "megatron", "--parallelism.tp", "{n}"],
    "pp": ["--strategy.name", "megatron", "--parallelism.pp", "{n}"],
    "tp_pp": ["--strategy.name", "megatron", "--parallelism.tp", "2", "--parallelism.pp", "{n/2}"],
}
STEPS, INTERVAL, GB = 3, 0.3, 1e9
PHASES = ("model", "load", "first step", "steps", "save+export")
MODEL_BUILT = re.compile(r"length buckets: ")  # the first line logged once the model is built (old code and new)
BAR = re.compile(r"\|\s*(\d+)/(\d+) \[[^\]]*step")  # tqdm's '| 1/3 [00:01<00:02, 1.1step/s]'
FIELDS = re.compile(
    r"\b(strategy|zero_stage|fsdp_version|sharding_strategy|offload_\w+|sharded|tp|pp)=(\[[^\]]*\]|[^,\s]+)"
)


def _build(kind: str, folder: Path) -> None:
    """In a subprocess: a random ``LlamaForSequenceClassification`` and ``tests/tiny.py``'s word-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from tests.tiny import tiny_tokenizer

    torch.manual_seed(0)
    shape = MODELS[kind]
    config = LlamaConfig(
        vocab_size=32000, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=512,
        num_labels=2, pad_token_id=0, **shape,
    )  # fmt: skip
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(partial)  # fp32 safetensors
    tokenizer = tiny_tokenizer("llama")  # w0..w39; <eos> (id 0) pads, as the config's pad_token_id
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(partial)
    partial.rename(folder)
    print(f"built {folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)


def model_folder(kind: str) -> str:
    if kind == "smollm2":
        return "embedded:smollm2"
    folder = Path("/tmp") / f"hftrain-mt-{kind}"
    if not (folder / "model.safetensors").exists():  # the parent never imports torch: its memory stays small
        subprocess.run([sys.executable, __file__, "--_build", kind, str(folder)], check=True, cwd=ROOT)
    return str(folder)


def parse_layout(layout: str) -> tuple[str, int]:
    match = re.fullmatch(r"(.+)x(\d+)", layout) or re.fullmatch(r"(ddp)(\d+)", layout)
    if not match or match[1] not in STRATEGIES:
        raise SystemExit(f"layout '{layout}': expected ddp1 or NAMExN with NAME in {', '.join(STRATEGIES)}")
    return match[1], int(match[2])


def _options(strategy: str, nprocs: int) -> list[str]:
    """The layout's command-line options, its ``{n}`` (``{n/2}``) the process count (half of it)."""
    return [arg.replace("{n}", str(nprocs)).replace("{n/2}", str(nprocs // 2)) for arg in STRATEGIES[strategy]]


def _status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in bytes; None for a process gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def run_job(cmd: list[str], cwd: str, env: dict, timeout: float, torchrun: bool) -> dict:
    import psutil

    start = time.time()
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=pipe, stderr=pipe, start_new_session=True)
    lines: list[tuple[float, str]] = []
    samples: list[tuple[float, int, int, int]] = []  # (seconds, pid, VmRSS, VmHWM)
    processes: dict[int, dict] = {}
    done = threading.Event()

    def read(stream) -> None:  # a piece is stamped when its first byte came (tqdm ends a bar at its next write)
        pending, since = b"", 0.0
        while chunk := stream.read1(65536):
            now = time.time() - start
            since = since if pending else now
            *whole, pending = re.split(rb"[\r\n]", pending + chunk)
            pieces = [(since if i == 0 else now, piece.decode(errors="replace")) for i, piece in enumerate(whole)]
            lines.extend(piece for piece in pieces if piece[1].strip())
            since = now if whole else since
        if pending.strip():
            lines.append((since, pending.decode(errors="replace")))

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            now = time.time() - start
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in tree:
                info = processes.setdefault(p.pid, {"ppid": None, "rank": None, "cmd": ""})
                try:  # again until the exec: a forked child has its parent's command line and environment
                    info.update(ppid=p.ppid(), cmd=" ".join(p.cmdline())[:300])
                    info["rank"] = info["rank"] or p.environ().get("RANK")
                except psutil.Error:
                    pass
                if (status := _status(p.pid)) is not None:
                    samples.append((now, p.pid, *status))
            done.wait(INTERVAL)

    threads = [threading.Thread(target=read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for thread in threads:
        thread.start()
    try:
        rc, timed_out = proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:  # torchrun's workers have sessions of their own: the tree, by pid
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.terminate()  # the agent passes it on to its workers
        for p in psutil.wait_procs(tree, timeout=30)[1]:
            p.kill()
        proc.kill()
        rc, timed_out = proc.wait(), True
    wall = time.time() - start
    done.set()
    for thread in threads:
        thread.join(timeout=30)
    lines.sort(key=lambda line: line[0])
    marks: list[float | None] = [0.0, None, None, None, None, wall]
    marks[1] = next((t for t, text in lines if MODEL_BUILT.search(text)), None)
    for t, match in ((t, m) for t, text in lines for m in BAR.finditer(text) if int(m[2]) == STEPS):
        for i, needed in ((2, 0), (3, 1), (4, STEPS)):  # the first bar at or past 0, 1 and 3 steps
            if marks[i] is None and int(match[1]) >= needed:
                marks[i] = t
    ranks = {proc.pid: 0}  # 1 process; under torchrun the agent's children (not a rank's own children)
    if torchrun:
        workers = sorted(pid for pid, info in processes.items() if info["ppid"] == proc.pid)
        ranks = {pid: int(processes[pid]["rank"] or 100 + n) for n, pid in enumerate(workers)}
    return {"cmd": cmd, "cwd": cwd, "rc": rc, "timed_out": timed_out, "wall_s": wall, "marks": marks,
            "lines": lines, "samples": samples, "processes": processes, "ranks": ranks}  # fmt: skip


def summarize(job: dict) -> dict[int, dict]:
    """Per rank: each phase's peak (None: the phase not seen, or shorter than a sample) and the whole run's."""
    marks, out = job["marks"], {}
    for pid, rank in sorted(job["ranks"].items(), key=lambda item: item[1]):
        mine = [(t, rss, hwm) for t, p, rss, hwm in job["samples"] if p == pid]
        phases, high = [None] * len(PHASES), 0
        for t, rss, hwm in mine:
            i = max([i for i in range(len(PHASES)) if marks[i] is not None and marks[i] <= t], default=0)
            phases[i] = max(phases[i] or 0, rss, hwm if hwm > high else 0)
            high = max(high, hwm)
        phases = [None if marks[i] is None else peak for i, peak in enumerate(phases)]
        out[rank] = {"phases": phases, "whole": max([high] + [rss for _, rss, _ in mine])}
    return out


def _others(job: dict) -> str:
    """The job's processes that are not ranks, by command, with their largest VmRSS."""
    groups: dict[str, list[int]] = {}
    for pid, info in job["processes"].items():
        if pid in job["ranks"] or not (rss := [s[2] for s in job["samples"] if s[1] == pid]):
            continue
        words = info["cmd"].split() or ["?"]
        name = words[words.index("-m") + 1] if "-m" in words[:-1] else Path(words[min(1, len(words) - 1)]).name
        name += " (a rank's child before its exec: the rank's pages)" if name == "hftrain" else ""
        groups.setdefault(name, []).append(max(rss))
    return ", ".join(f"{name}{f' ×{len(v)}' if len(v) > 1 else ''} {max(v) / GB:.2f}" for name, v in groups.items())


def _cells(values: list[float | None], digits: int = 2) -> str:
    return " / ".join("—" if v is None else f"{v:.{digits}f}" for v in values) or "—"


def revisions(ref: str | None) -> list[tuple[str, str, dict]]:
    """(label, code folder, environment) for this working tree and REV's worktree, each checked by an import."""
    found = [("new", str(ROOT))]
    if ref:
        tree = Path("/tmp") / ("mt-ref-" + re.sub(r"[^\w.-]", "_", ref))
        if not tree.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True)
        found.insert(0, ("old", str(tree)))
    out = []
    for label, code in found:
        env = os.environ | {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")]))
        probe = [sys.executable, "-c", "import hftrain; print(hftrain.__file__)"]
        where = subprocess.run(probe, cwd=code, env=env, capture_output=True, text=True, check=True).stdout.strip()
        rev = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        edits = " + uncommitted edits" if label == "new" else ""
        print(f"{label}: {code} at {rev.stdout.strip()}{edits}, hftrain imported from {where}", flush=True)
        if not where.startswith(code + "/"):
            raise SystemExit(f"{label}: hftrain comes from {where}, not {code}")
        out.append((label, code, env))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="big", choices=["big", "small", "smollm2"])
    parser.add_argument("--layouts", default="ddp1,fsdp2x2,zero2x2,zero3x2,zero3_offloadx2")
    parser.add_argument("--ref", help="also run every layout with this git revision's code (rows 'old')")
    parser.add_argument("--json", help="write the raw samples, output lines and phases here")
    parser.add_argument("--png", help="draw VmRSS per rank over time here, one subplot per job")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--_build", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._build:
        return _build(args._build[0], Path(args._build[1]))
    layouts = [(name, *parse_layout(name)) for name in args.layouts.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start", flush=True)
    folder = model_folder(args.model)
    from tests.tiny import write_csv

    data = write_csv(Path("/tmp/hftrain-mt-train.csv"), rows=200)
    codes = revisions(args.ref)
    print(f"model: {folder}; data: {data} (200 rows); {STEPS} fp32 steps of 8 texts per rank\n", flush=True)
    jobs = []
    for layout, strategy, nprocs in layouts:
        for label, code, env in codes:
            output = Path("/tmp/mt") / (layout if len(codes) == 1 else f"{layout}-{label}")
            shutil.rmtree(output, ignore_errors=True)
            launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
            cmd = [sys.executable, *(launcher if nprocs > 1 else []), "-m", "hftrain", "train",
                   "--model_name_or_path", folder, "--dataset_name", "null", "--train_file", str(data),
                   "--max_steps", str(STEPS), "--per_device_train_batch_size", "8", "--max_seq_length", "128",
                   "--mixed_precision", "no", "--log_with", "none", "--output_dir", str(output),
                   *_options(strategy, nprocs)]  # fmt: skip
            job = run_job(cmd, code, env, args.timeout, nprocs > 1) | {"layout": layout, "label": label}
            job["summary"] = summarize(job)
            jobs.append(job)
            chosen = next((text for _, text in job["lines"] if "strategy: " in text), "")
            fields = ", ".join(m[0] for m in FIELDS.finditer(chosen))
            print(f"{layout} ({label}): exit {job['rc']}{' (timed out)' * job['timed_out']} after "
                  f"{job['wall_s']:.1f} s; phases start at {_cells(job['marks'][:5], 1)} s; {fields}; "
                  f"not ranks (peak VmRSS, GB): {_others(job)}", flush=True)  # fmt: skip
            if job["rc"] != 0 or job["timed_out"]:
                print("  " + "\n  ".join([text for _, text in job["lines"][-20:]] or ["(no output)"]), flush=True)
            shutil.rmtree(output, ignore_errors=True)  # the big model's checkpoint and export: GBs per job
    ok = [job for job in jobs if job["rc"] == 0 and not job["timed_out"] and job["summary"]]
    base = {j["label"]: max(r["whole"] for r in j["summary"].values()) for j in ok if j["layout"] == "ddp1"}
    head = "| layout | ranks | " + " | ".join(PHASES) + " | whole run | ratio to 1 process | wall s |"
    print(f"\nPeak resident memory per rank (GB; rank 0 / rank 1 / ...):\n\n{head}\n{re.sub(r'[^|]+', '---', head)}")
    for job in jobs:
        name, ranks = job["layout"] + (f" {job['label']}" if len(codes) > 1 else ""), job["summary"].values()
        if job not in ok:
            failed = f"timed out after {args.timeout:.0f} s" if job["timed_out"] else f"failed (exit {job['rc']})"
            print(f"| {name} | — | {failed} | | | | | | {job['wall_s']:.0f} |")
            continue
        phases = [_cells([r["phases"][i] and r["phases"][i] / GB for r in ranks]) for i in range(len(PHASES))]
        whole = [r["whole"] for r in ranks]
        ratio = _cells([w / base[job["label"]] for w in whole]) if job["label"] in base else "—"
        print(f"| {name} | {len(whole)} | {' | '.join(phases)} | {_cells([w / GB for w in whole])} | {ratio} | "
              f"{job['wall_s']:.0f} |")  # fmt: skip
    print(
        f"\nwhole run: VmHWM, read every {INTERVAL} s (the last read at most {INTERVAL} s before the rank exited); "
        "a phase: its largest sampled VmRSS or a VmHWM rise first seen in it; —: not seen or shorter than a sample"
    )
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the end")
    if args.json:
        phases = [job | {"phases": dict(zip(PHASES, job["marks"], strict=False))} for job in jobs]
        Path(args.json).write_text(json.dumps(phases, indent=1, default=str))
    if args.png:
        draw(jobs, args.png)


def draw(jobs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(jobs), 1, figsize=(10, 2.6 * len(jobs)), sharey=True, squeeze=False)
    for ax, job in zip(axes[:, 0], jobs, strict=True):
        for pid, rank in sorted(job["ranks"].items(), key=lambda item: item[1]):
            points = [(t, rss / GB) for t, p, rss, _ in job["samples"] if p == pid]
            if points:
                ax.plot(*zip(*points, strict=True), label=f"rank {rank}")
        for mark, phase in zip(job["marks"][1:5], PHASES[1:], strict=True):
            if mark is not None:
                ax.axvline(mark, color="grey", linestyle="--", linewidth=0.8)
                ax.text(mark, 0.98, f" {phase}", transform=ax.get_xaxis_transform(), va="top", fontsize=7)
        ax.set_title(f"{job['layout']} ({job['label']}), exit {job['rc']}", fontsize=9)
        ax.set_ylabel("VmRSS (GB)")
        ax.legend(loc="lower right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the job started (dashed: where a phase starts)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"timeline: {path}")


if __name__ == "__main__":
    main()
