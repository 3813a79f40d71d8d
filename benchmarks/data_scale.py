"""Data at scale (issue 53): time to the first optimizer step and each rank's peak RSS, hftrain against run_clm's way.

For each corpus size (``--sizes``, MB of JSONL), each process count (``--processes``) and each pipeline, one job
runs to the end of its first optimizer step, twice: ``first`` with an empty cache, then ``cached`` with the cache the
first run left (the second start of the same job, as a resume or an export starts). Pipelines:

- ``hftrain``: the real command, ``python -m hftrain train`` (through ``python -m torch.distributed.run --standalone
  --nproc_per_node N`` for N > 1, strategy ``ddp``), ``model.task: causal_lm``, ``data.max_seq_length`` 1,024, the
  corpus as ``data.train_file``, ``data.cache_dir`` and ``HF_DATASETS_CACHE`` inside the work dir (nothing lands in
  ``~/.cache``), ``data.preprocessing_num_workers`` = ``--num_proc``, fp32;
- ``standard``: transformers' ``run_clm_no_trainer.py`` data pipeline: ``datasets.load_dataset("json")`` with the
  same held-out percentage, ``map(tokenize, batched=True, num_proc)``, ``map(group_texts, batched=True,
  num_proc)`` (the documents concatenated and cut into 1,024-token blocks, the remainder dropped), each under
  ``Accelerator.main_process_first()``, then the same model's first step in a plain Accelerate loop, fp32;
- ``stream`` rows (``hftrain`` with ``data.streaming: true`` and ``training.max_steps``), once per process count: only
  where this checkout reads ``data.streaming`` (the row says so otherwise), and checked at the first step: the rank's
  loader must read an iterable dataset.

Both train the same model: a random Llama (2 layers, hidden 64, 4 heads) built here from a ``LlamaConfig`` with the
embedded SmolLM2's byte-level BPE tokenizer (49,152 ids; the tokenizer files copied from
``resolve_model_path("embedded:smollm2")``), batch ``--batch`` blocks per rank. The logits of one 1,024-token block
over 49,152 ids are 0.2 GB in fp32, about the same extra memory on both sides.

The corpus is deterministic synthetic English-like JSONL (``{"text": ...}`` per line), made once per size and seed
under ``--work_dir``: words drawn Zipf-like (weight ∝ 1/(rank + 2.7)^1.07) from a fixed vocabulary (common English
words, then made-up words of English syllables), sentences of 4-28 words with commas and end marks, documents of
log-normal length (median ~120 words) and, one in sixteen, 1,200-6,000 words (2-8 blocks of 1,024 tokens; about
60% of the words), which ``data.long_documents: continue`` carries over blocks and ``truncate`` cuts.

What each row measures, from inside each rank (``benchmarks/data_scale_worker.py``: a hook at the end of the
first optimizer step records, then the rank exits; the docstring there says why not a poller):

- ``to first step``: from just before this script starts the launcher to the last rank's end of its first step
  (imports, reading, tokenizing, packing, model construction and the step itself);
- ``peak RSS before the step``: each rank's ``VmHWM`` as its training loop begins (data and model ready; 10^9
  bytes), rank 0 / rank 1: what the data pipeline costs (issue 53's goal is on this one);
- ``peak RSS at first step``: each rank's ``VmHWM`` at the end of its first step: the above, or the step's own peak
  (about 0.6 GB more for the logits of a batch of one block, their gradient and the loss's temporaries) where larger.
  The ``num_proc`` map workers are processes of their own, not in either (their peak RSS is in ``--json``, as
  ``children_peak_rss``, and is mostly pages they share with the rank that forked them);
- ``CPU s``: each rank's CPU seconds up to then, its own plus its map workers' (a rank that does not tokenize
  shows only imports, model and step);
- ``blocks``: training blocks (hftrain continues long documents and pads a block's tail; run_clm's concatenation
  drops only the last partial block).

The ratio table divides hftrain by the standard pipeline at the same size, processes and run (time: with
``--repeats``, the median of each repetition's ratio; and the largest rank's peak RSS before the step); the goal lines
are issue 53's. Runs alternate (hftrain, standard) so a change in
machine load hits both alike; on a shared 2-core machine times move by ±1.6×, memory by < 0.05 GB.

A job is stopped, and its row says so, when the machine has less than ``--min_free_gb`` available (before issue 53,
two ranks on a 500 MB corpus would need ~30 GB), or past ``--timeout``.

Usage (5 and 50 MB: about 10 minutes on 2 shared cores; 500 MB: an hour or more):
    python benchmarks/data_scale.py --sizes 5,50                 # 1 and 2 processes, both pipelines, streaming
    python benchmarks/data_scale.py --sizes 5,50,500 --json out.json --repeats 3
    python benchmarks/data_scale.py --sizes 5,50 --ref 1439dcd   # also hftrain at another commit (rows hftrain@REV;
                                                                 # a git worktree in the work dir: remove it after)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("data_scale_worker.py")
GB = 1e9
MB = 1e6
MODEL = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}

# ----------------------------------------------------------------------------- the corpus
COMMON = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from or had by "
    "not word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look more "
    "day could go come did number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air well also play small end put "
    "home read hand port large spell add even land here must big high such follow act why ask men change went "
    "light kind off need house picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant cover food sun four between "
    "state keep eye never last let thought city tree cross farm hard start might story saw far sea draw left late "
    "run while press close night real life few north open seem together next white children begin got walk example "
    "ease paper group always music those both mark often letter until mile river car feet care second book carry "
    "took science eat room friend began idea fish mountain stop once base hear horse cut sure watch color face wood "
    "main enough plain girl usual young ready above ever red list though feel talk bird soon body dog family direct "
    "pose leave song measure door product black short numeral class wind question happen complete ship area half "
    "rock order fire south problem piece told knew pass since top whole king space heard best hour better true "
    "during hundred five remember step early hold west ground interest reach fast verb sing listen six table travel "
    "less morning ten simple several vowel toward war lay against pattern slow center love person money serve "
    "appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark "
    "machine note wait plan figure star box noun field rest correct able pound done beauty drive stood contain "
    "front teach week final gave green oh quick develop ocean warm free minute strong special mind behind clear "
    "tail produce fact street inch multiply nothing course stay wheel full force blue object decide surface deep "
    "moon island foot system busy test record boat common gold possible plane stead dry wonder laugh thousand ago "
    "ran check game shape equate hot miss brought heat snow tire bring yes distant fill east paint language among"
).split()
ONSETS = ("b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "cl", "cr", "dr",
          "fl", "gr", "pl", "pr", "sh", "sl", "sp", "st", "str", "th", "tr", "wh", "")  # fmt: skip
NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oo", "ou", "y")
CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rd", "st", "ck", "ght", "sh", "ble", "tion", "ment")
VOCABULARY = 30_000
LONG_DOCUMENT = (1 / 16, 1_200, 6_000)
"""The share of long documents and their words (1,600-8,000 tokens: 2 to 8 blocks of 1,024). They hold about 60% of
the words, as the long tail of web text does."""
CORPUS_VERSION = 1
"""In the corpus's file name: a change to how it is made makes a new file, never a stale one reused."""


def vocabulary(seed: int) -> tuple[list[str], list[float]]:
    """A fixed vocabulary (common English words, then made-up words) and its cumulative Zipf-like weights."""
    rng = random.Random(seed)
    words, seen = list(COMMON), set(COMMON)
    while len(words) < VOCABULARY:
        syllables = rng.choices((1, 2, 3), (5, 4, 1))[0]
        word = "".join(rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS) for _ in range(syllables))
        if word not in seen:
            seen.add(word)
            words.append(word)
    cumulative, total = [], 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 2.7) ** 1.07
        cumulative.append(total)
    return words, cumulative


def document(rng: random.Random, words: list[str], cumulative: list[float]) -> str:
    """One document: sentences of Zipf-drawn words; one in sixteen is long (several blocks)."""
    share, *words_range = LONG_DOCUMENT
    if rng.random() < share:
        length = rng.randint(*words_range)
    else:
        length = max(3, min(1_400, int(rng.lognormvariate(math.log(120), 0.9))))
    drawn = rng.choices(words, cum_weights=cumulative, k=length)
    sentences, start = [], 0
    while start < length:
        end = min(length, start + rng.randint(4, 28))
        sentence = drawn[start:end]
        sentence[0] = sentence[0].capitalize()
        for i in range(len(sentence) - 1):
            if rng.random() < 0.07:
                sentence[i] += ","
        sentences.append(" ".join(sentence) + rng.choices(".?!", (0.9, 0.07, 0.03))[0])
        start = end
    return " ".join(sentences)


def corpus(size_mb: int, seed: int, work_dir: Path) -> Path:
    """The corpus of ``size_mb`` MB (10^6 bytes, whole documents up to that size), made once and kept."""
    path = work_dir / "corpus" / f"english-v{CORPUS_VERSION}-{size_mb}mb-seed{seed}.jsonl"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    start, rng = time.perf_counter(), random.Random(seed)
    words, cumulative = vocabulary(seed)
    partial, written, documents = path.with_suffix(".partial"), 0, 0
    with partial.open("w", encoding="utf-8") as out:
        while written < size_mb * MB:
            line = json.dumps({"text": document(rng, words, cumulative)}) + "\n"
            out.write(line)
            written += len(line)  # ASCII: characters are bytes
            documents += 1
    partial.rename(path)
    print(f"corpus: {path} ({written / MB:.1f} MB, {documents:,} documents, {time.perf_counter() - start:.0f} s)")
    return path


# ----------------------------------------------------------------------------- the model
def _build_model(folder: Path) -> None:
    """In a subprocess (this script never imports torch): the random tiny Llama and SmolLM2's tokenizer files."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hftrain.models import resolve_model_path

    source = resolve_model_path("embedded:smollm2")  # converts the embedded GGUF once (~30 s) if not done yet
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), num_key_value_heads=MODEL["num_attention_heads"], max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True, **MODEL,
    )  # fmt: skip
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(partial)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(source / name, partial / name)
    sample = "The river ran past the old mill, and the children watched."
    copied = AutoTokenizer.from_pretrained(partial)(sample, add_special_tokens=False)["input_ids"]
    if copied != tokenizer(sample, add_special_tokens=False)["input_ids"] or not copied:  # PITFALLS.md #33
        raise SystemExit(f"the copied tokenizer in {partial} encodes differently from {source}")
    partial.rename(folder)
    print(f"model: {folder} ({sum(p.numel() for p in LlamaForCausalLM(config).parameters()) / 1e6:.1f}M parameters)")


def model_folder(work_dir: Path) -> Path:
    folder = work_dir / ("model-llama-" + "-".join(str(v) for v in MODEL.values()))
    if not (folder / "model.safetensors").is_file():
        subprocess.run([sys.executable, __file__, "--_build_model", str(folder)], check=True, env=child_env(ROOT))
    return folder


# ----------------------------------------------------------------------------- one job
def child_env(code: Path, **extra: str) -> dict[str, str]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    return env


def supports(code: Path, field: str) -> bool:
    """Whether ``code``'s config has ``data.<field>`` (an older checkout refuses unknown fields)."""
    return re.search(rf"^    {field}:", (code / "hftrain/config/schema.py").read_text(), re.M) is not None


def reads_streaming(code: Path) -> bool:
    """Whether anything in ``code``'s hftrain besides the config reads ``data.streaming``."""
    return any(
        re.search(r"\.streaming\b", path.read_text())
        for path in (code / "hftrain").rglob("*.py")
        if path.parent.name != "config"
    )


def job_args(pipeline: str, code: Path, args: argparse.Namespace, data: Path, model: Path, run_dir: Path) -> list[str]:
    """The worker's arguments: ``hftrain train``'s overrides, or the standard pipeline's ``key=value`` pairs."""
    cache = run_dir / "cache"
    if pipeline == "standard":
        return [f"train_file={data}", f"model={model}", f"cache_dir={cache / 'datasets'}", f"block_size={args.block}",
                f"batch_size={args.batch}", f"num_proc={args.num_proc}", f"seed={args.seed}",
                f"validation_split_percentage={args.validation_split_percentage}"]  # fmt: skip
    argv = [
        "--model.model_name_or_path", str(model), "--model.task", "causal_lm",
        "--data.dataset_name", "null", "--data.train_file", str(data), "--data.max_seq_length", str(args.block),
        "--data.validation_split_percentage", str(args.validation_split_percentage),
        "--training.output_dir", str(run_dir / "output"), "--training.overwrite_output_dir", "true",
        "--training.per_device_train_batch_size", str(args.batch), "--training.mixed_precision", "no",
        "--training.log_with", "none", "--training.seed", str(args.seed), "--strategy.name", "ddp",
    ]  # fmt: skip
    if supports(code, "cache_dir"):
        argv += ["--data.cache_dir", str(cache / "hftrain")]
    if supports(code, "preprocessing_num_workers") and args.num_proc:
        argv += ["--data.preprocessing_num_workers", str(args.num_proc)]
    if pipeline.startswith("stream"):
        argv += ["--data.streaming", "true", "--training.max_steps", str(args.streaming_steps)]
    return argv


def run_job(kind: str, code: Path, nprocs: int, argv: list[str], run_dir: Path, log: Path, limits: Limits) -> dict:
    """Launch one job (its output to ``log``), wait for it, and return the ranks' records (none: it failed).

    The job is stopped (its whole process tree) past ``limits.timeout`` seconds, or as soon as the machine has less
    than ``limits.min_free_gb`` available: a job that would run the shared machine out of memory is a result (the
    row says so), not a reason to let the kernel's OOM killer choose among everyone's processes.
    """
    records = run_dir / "records"
    shutil.rmtree(records, ignore_errors=True)
    records.mkdir(parents=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nprocs)]
    cmd = [sys.executable, *(launcher if nprocs > 1 else []), str(WORKER), kind, str(records), "--", *argv]
    env = child_env(code, HF_DATASETS_CACHE=str(run_dir / "cache" / "datasets"))
    note, held = None, 0
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while (rc := _wait(proc, 1.0)) is None:
            tree = _tree(proc.pid)
            held = max(held, sum(_rss(p) for p in tree))
            available = psutil.virtual_memory().available
            if available < limits.min_free_gb * GB:
                note = (f"stopped: {available / GB:.1f} GB left on the machine, the job's processes held "
                        f"{held / GB:.1f} GB")  # fmt: skip
            elif time.time() - start > limits.timeout:
                note = f"timed out after {limits.timeout:.0f} s"
            if note:  # torchrun's ranks have sessions of their own: the tree, by pid
                for p in tree:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
                rc = proc.wait()
                break
    found = sorted(records.glob("rank*.json"))
    ranks = sorted((json.loads(path.read_text()) for path in found), key=lambda r: r["rank"])
    ok = len(ranks) == nprocs and note is None
    result = {"rc": rc, "note": note, "wall_s": time.time() - start, "ok": ok, "ranks": ranks, "tree_peak_rss": held}
    if ok:
        result["to_first_step_s"] = max(r["first_step_time"] for r in ranks) - start
    return result


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout: float
    """Seconds a job may run."""
    min_free_gb: float
    """Available memory (GB) below which a job is stopped."""


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _rss(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.Error:  # gone between the listing and the read
        return 0


# ----------------------------------------------------------------------------- the table
def gb(values: list[float]) -> str:
    return " / ".join(f"{v / GB:.2f}" for v in values)


def row_cells(row: dict) -> list[str]:
    if not row["ok"]:
        why = row.get("note") or f"failed (exit {row['rc']})"
        return [why, "", "", "", ""]
    ranks, times = row["ranks"], row.get("times", [])
    blocks = {r["train_blocks"] for r in ranks}
    spread = f" ({min(times):.1f}–{max(times):.1f})" if len(times) > 1 else ""
    return [
        f"{row['to_first_step_s']:.1f}{spread}",
        gb([r["vm_hwm_before_step"] for r in ranks]),
        gb([r["vm_hwm"] for r in ranks]),
        " / ".join(f"{r['cpu_s'] + r['children_cpu_s']:.0f}" for r in ranks),
        ", ".join("stream" if b is None else f"{round(b):,}" for b in sorted(blocks, key=lambda b: b or 0)),
    ]


def combine(rows: list[dict]) -> list[dict]:
    """One row per (size, pipeline, processes, run) in first-seen order: over its repetitions, the median time (and
    ``times``, all of them) and each rank's median of every measurement; rows that failed count only if all did."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((*_key(row), row["pipeline"]), []).append(row)
    combined = []
    for group in groups.values():
        ok = [row for row in group if row["ok"]]
        if not ok:
            combined.append(group[-1])
            continue
        ranks = [
            {name: statistics.median(values) if all(isinstance(v, float | int) for v in values) else values[0]
             for name, values in ((k, [row["ranks"][i][k] for row in ok]) for k in ok[0]["ranks"][i])}
            for i in range(len(ok[0]["ranks"]))
        ]  # fmt: skip
        times = [row["to_first_step_s"] for row in ok]
        combined.append(ok[0] | {"ranks": ranks, "to_first_step_s": statistics.median(times), "times": times})
    return combined


def print_tables(rows: list[dict], pipelines: list[str]) -> None:
    rows = combine(rows)
    head = ("| corpus | pipeline | processes | run | to first step s | peak RSS before the step GB | peak RSS at "
            "first step GB | CPU s per rank | train blocks |")  # fmt: skip
    print(f"\n{head}\n{re.sub(r'[^|]+', '---', head)}")
    for row in rows:
        name = f"| {row['size_mb']} MB | {row['pipeline']} | {row['nprocs']} | {row['run']} | "
        print(name + " | ".join(row_cells(row)) + " |")
    ratios = []
    for row in rows:
        if not row["pipeline"].startswith("hftrain") or not row["ok"]:
            continue
        key = (row["size_mb"], row["nprocs"], row["run"])
        standard = next((r for r in rows if r["pipeline"] == "standard" and r["ok"] and _key(r) == key), None)
        if standard is not None:
            ratios.append((row, standard))
    if not ratios:
        return
    head = (
        "| corpus | pipeline | processes | run | to first step, hftrain / standard | peak RSS before the step, same |"
    )
    print(f"\n{head}\n{re.sub(r'[^|]+', '---', head)}")
    for row, standard in ratios:
        rss_ratio = _peak(row) / _peak(standard)
        print(f"| {row['size_mb']} MB | {row['pipeline']} | {row['nprocs']} | {row['run']} | "
              f"{time_ratio(row, standard)} | {rss_ratio:.2f} |")  # fmt: skip
    goals(rows, pipelines)


def goals(rows: list[dict], pipelines: list[str]) -> None:
    """Issue 53's goals at the largest size with 2 processes (and the smallest size for memory growth)."""
    sizes = sorted({r["size_mb"] for r in rows})
    largest, smallest = sizes[-1], sizes[0]

    def find(pipeline: str, size: int, run: str, nprocs: int = 2) -> dict | None:
        return next((r for r in rows if r["ok"] and _key(r) == (size, nprocs, run) and r["pipeline"] == pipeline), None)

    print(f"\nissue 53's goals, 2 processes, {largest} MB:")
    standard = find("standard", largest, "first")
    for pipeline in (p for p in pipelines if p.startswith("hftrain")):
        first, cached = find(pipeline, largest, "first"), find(pipeline, largest, "cached")
        if first and standard:
            print(f"  {pipeline} first / standard first: {time_ratio(first, standard)} (goal <= 1.2)")
        if cached and standard:
            print(f"  {pipeline} cached / standard first: {time_ratio(cached, standard)} (goal <= 0.1)")
        if first and len(first["ranks"]) > 1:
            cpu = [r["cpu_s"] + r["children_cpu_s"] for r in first["ranks"]]
            print(f"  {pipeline} first: CPU s of rank 0 / rank 1: {cpu[0]:.0f} / {cpu[1]:.0f} (goal: rank 1 does not "
                  "tokenize)")  # fmt: skip
        small = find(pipeline, smallest, "first")
        if first and small and largest != smallest:
            pairs = zip(first["ranks"], small["ranks"], strict=True)
            growth = [(a["vm_hwm_before_step"] - b["vm_hwm_before_step"]) / GB for a, b in pairs]
            print(f"  {pipeline} first: peak RSS before the step, growth per rank from {smallest} to {largest} MB: "
                  + " / ".join(f"{g:+.2f}" for g in growth) + " GB (goal <= 1.5 GB)")  # fmt: skip


def time_ratio(row: dict, other: dict) -> str:
    """``row``'s time over ``other``'s: the median of the repetitions' ratios, each over the run it alternated with
    (their range beside it), so that a burst of load during one repetition moves one ratio, not the median."""
    pairs = list(zip(row.get("times", []), other.get("times", []), strict=False))
    if len(pairs) < 2:
        return f"{row['to_first_step_s'] / other['to_first_step_s']:.2f}"
    ratios = [a / b for a, b in pairs]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def _key(row: dict) -> tuple[int, int, str]:
    return row["size_mb"], row["nprocs"], row["run"]


def _peak(row: dict) -> float:
    return max(r["vm_hwm_before_step"] for r in row["ranks"])


def commit(code: Path) -> str:
    """``code``'s commit, the last one that changed ``hftrain/``, and whether ``hftrain/`` has uncommitted edits."""

    def git(*words: str) -> str:
        return subprocess.run(["git", "-C", str(code), *words], capture_output=True, text=True).stdout.strip()

    head, package = git("rev-parse", "--short", "HEAD"), git("log", "-1", "--format=%h", "--", "hftrain")
    dirty = " + uncommitted edits" if git("status", "--porcelain", "--", "hftrain") else ""
    return f"{head} (hftrain/ as of {package}{dirty})"


def checkouts(ref: str | None, work_dir: Path) -> list[tuple[str, Path]]:
    """(pipeline name, code folder): this tree's hftrain, and ``ref``'s in a detached worktree under the work dir."""
    found = [("hftrain", ROOT)]
    if ref:
        tree = work_dir / ("ref-" + re.sub(r"[^\w.-]", "_", ref))
        if not tree.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True)
        found.append((f"hftrain@{ref}", tree))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5,50,500", help="corpus sizes in MB (10^6 bytes), comma-separated")
    parser.add_argument("--processes", default="1,2", help="process counts, comma-separated")
    parser.add_argument("--pipelines", default="hftrain,standard", help="hftrain, standard, or both")
    parser.add_argument("--ref", help="also run hftrain at this git revision (rows 'hftrain@REV')")
    parser.add_argument("--work_dir", default="/tmp/hftrain-data-scale", help="corpora, model, caches, logs")
    parser.add_argument("--num_proc", type=int, default=os.cpu_count(), help="tokenizing processes on both sides")
    parser.add_argument("--batch", type=int, default=1, help="blocks per rank per step")
    parser.add_argument("--block", type=int, default=1024, help="tokens per block (data.max_seq_length)")
    parser.add_argument("--validation_split_percentage", type=int, default=10)
    parser.add_argument("--seed", type=int, default=42, help="the corpus's and the runs' seed")
    parser.add_argument("--no_streaming", action="store_true", help="leave out the streaming rows")
    parser.add_argument("--streaming_steps", type=int, default=10, help="training.max_steps of a streaming run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each row (the table: medians, time range)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--min_free_gb", type=float, default=2.0, help="stop a job when less memory is available")
    parser.add_argument("--json", help="write every row (with each rank's record) here")
    parser.add_argument("--_build_model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._build_model:
        return _build_model(Path(args._build_model))
    work_dir = Path(args.work_dir)
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(n) for n in args.processes.split(",")]
    wanted = args.pipelines.split(",")
    codes = [(name, code) for name, code in checkouts(args.ref, work_dir) if "hftrain" in wanted]
    pipelines = [name for name, _ in codes] + (["standard"] if "standard" in wanted else [])
    for name, code in codes:
        print(f"{name}: {code} at {commit(code)}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start; work dir {work_dir}")
    model = model_folder(work_dir)
    rows: list[dict] = []

    def run(pipeline: str, code: Path, size: int, data: Path, nprocs: int, run_name: str) -> None:
        label = f"{pipeline}-{size}mb-{nprocs}p".replace("@", "-at-")
        run_dir = work_dir / "runs" / label
        if run_name in ("first", "stream"):  # an empty cache: nothing tokenized before
            shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        kind = "standard" if pipeline == "standard" else "hftrain"
        argv = job_args("stream" if run_name == "stream" else pipeline, code, args, data, model, run_dir)
        log = work_dir / "logs" / f"{label}-{run_name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        result = run_job(kind, code, nprocs, argv, run_dir, log, Limits(args.timeout, args.min_free_gb))
        row = {"size_mb": size, "pipeline": pipeline + (" stream" if run_name == "stream" else ""),
               "nprocs": nprocs, "run": run_name, "log": str(log), **result}  # fmt: skip
        if run_name == "stream" and result["ok"] and not all(r.get("iterable") for r in result["ranks"]):
            row["ok"] = False
            row["note"] = f"not streamed: the loader read a {result['ranks'][0].get('dataset_class')}"
        rows.append(row)
        shown = " | ".join(c for c in row_cells(row) if c)
        print(f"{size} MB {row['pipeline']} x{nprocs} {run_name}: {shown} (load {os.getloadavg()[0]:.1f})", flush=True)
        if not row["ok"]:
            print("  " + "\n  ".join(log.read_text().splitlines()[-15:]), flush=True)

    sides = [(name, code) for name, code in codes] + ([("standard", ROOT)] if "standard" in wanted else [])
    for size in sizes:
        data = corpus(size, args.seed, work_dir)
        for nprocs, _ in itertools.product(counts, range(args.repeats)):
            for run_name in ("first", "cached"):  # alternated: hftrain, standard, hftrain, standard
                for pipeline, code in sides:
                    run(pipeline, code, size, data, nprocs, run_name)
            for name, code in codes if not args.no_streaming else []:
                if reads_streaming(code):
                    run(name, code, size, data, nprocs, "stream")
                else:
                    note = "skipped: this checkout does not read data.streaming yet"
                    rows.append({"size_mb": size, "pipeline": f"{name} stream", "nprocs": nprocs, "run": "stream",
                                 "ok": False, "note": note})  # fmt: skip
    print_tables(rows, pipelines)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; logs in {work_dir / 'logs'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
